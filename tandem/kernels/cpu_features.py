"""What this CPU and its OS let the kernels use, found without running a single new instruction.

Two sources must agree: the kernel's CPU flags (``/proc/cpuinfo``, which Linux clears for
features whose register state the OS does not save) and torch's own checks (the cpuinfo library,
which reads the OS's XSAVE mask; for AMX, torch's ``_init_amx`` asks the OS for the tile
permission the way oneDNN needs it). Nothing here can fault on an older CPU: it only reads text
and calls torch's checks. A library variant is loaded only when every feature it was compiled
for is present.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from functools import lru_cache

# Feature name -> (cpuinfo flags that must all be present, torch check or None).
FEATURES = {
    "avx2": (("avx2", "fma", "f16c"), "_is_avx2_supported"),
    "avx512": (("avx512f", "avx512bw", "avx512vl", "avx512dq"), "_is_avx512_supported"),
    "avx512_vnni": (("avx512_vnni",), "_is_vnni_supported"),
    "avx512_bf16": (("avx512_bf16",), "_is_avx512_bf16_supported"),
    "amx_tile": (("amx_tile",), "_is_amx_tile_supported"),
    "amx_bf16": (("amx_bf16",), None),
    "amx_int8": (("amx_int8",), None),
}


@dataclass(frozen=True)
class CPUInfo:
    model: str
    flags: frozenset[str] = field(repr=False)
    features: frozenset[str]
    """Names of ``FEATURES`` usable here (CPU and OS both allow them)."""
    amx_permitted: bool
    """The OS granted this process the AMX tile state (only asked when the CPU has AMX)."""
    torch_capability: str
    vendor: str = ""
    """``vendor_id`` of /proc/cpuinfo (``AuthenticAMD``, ``GenuineIntel``); empty where unknown."""

    def has(self, *names: str) -> bool:
        return all(n in self.features for n in names)

    @property
    def amx_bf16(self) -> bool:
        """AMX bf16 tiles the OS lets this process use."""
        return self.has("amx_bf16") and self.amx_permitted

    @property
    def bf16_arithmetic(self) -> bool:
        """bf16 dot products in hardware: AVX-512 bf16, or AMX bf16 tiles the OS lets us use."""
        return self.has("avx512_bf16") or self.amx_bf16

    def describe(self) -> dict[str, object]:
        return {"model": self.model, "vendor": self.vendor, "features": sorted(self.features),
                "amx_permitted": self.amx_permitted, "torch_capability": self.torch_capability}


def _proc_cpuinfo() -> tuple[str, frozenset[str], str]:
    """(model with family and model number, flags, vendor) of the first processor."""
    model, flags = platform.processor() or platform.machine(), frozenset()
    try:
        text = open("/proc/cpuinfo", encoding="utf-8", errors="replace").read()
    except OSError:
        return model, flags, ""
    facts: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "cpu family", "model", "vendor_id") and key not in facts:
            facts[key] = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
        elif not line.strip() and facts:
            break  # the first processor's block is enough
    if "model name" in facts:
        # Virtual machines often show a bare "AMD EPYC": family and model tell the generation.
        model = f"{facts['model name']} (family {facts.get('cpu family', '?')}, model {facts.get('model', '?')})"
    return model, flags, facts.get("vendor_id", "")


def available_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cpu_model() -> str:
    """The CPU's name, with family and model (no torch needed: the load generator reports it)."""
    return _proc_cpuinfo()[0]


def _torch_says(check: str | None) -> bool:
    import torch

    if check is None:
        return True
    fn = getattr(torch.cpu, check, None)
    try:
        return bool(fn()) if fn is not None else False
    except RuntimeError:
        return False


def features_from(flags: frozenset[str], torch_checks: dict[str, bool]) -> frozenset[str]:
    """The usable features given cpuinfo ``flags`` and the outcome of each torch check (split out
    so the selection can be tested with faked machines)."""
    return frozenset(
        name for name, (needed, check) in FEATURES.items()
        if all(f in flags for f in needed) and (check is None or torch_checks.get(check, False))
    )


@lru_cache(maxsize=1)
def cpu_info() -> CPUInfo:
    import torch

    model, flags, vendor = _proc_cpuinfo()
    checks = {check: _torch_says(check) for _, check in FEATURES.values() if check}
    features = features_from(flags, checks)
    amx = False
    if "amx_tile" in features:
        try:
            amx = bool(torch.cpu._init_amx())
        except (AttributeError, RuntimeError):
            amx = False
    if not amx:  # tiles the OS does not grant are not usable: no kernel may run them
        features = features - {"amx_tile", "amx_bf16", "amx_int8"}
    return CPUInfo(model, flags, features, amx, torch.backends.cpu.get_cpu_capability(), vendor)
