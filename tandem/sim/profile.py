"""Cost profiles: the JSON files that tell the simulator what a step costs, and their schema.

Two kinds (``docs/simulate.md`` documents every field):

* ``measured`` -- written by `tandem calibrate` on this machine: the step-time model's
  coefficients for the forward pass (``forward``) and for the engine's time per step beyond it
  (``overhead``), the KV cache it ran with, and where it was measured (machine, model, dtype,
  quantization, date, fit error).
* ``roofline`` -- a model spec (a ``config.json``: a shipped name, a path, or inline) and a
  device description (a shipped name, a path, or inline; ``tandem.sim.roofline``).

``--profile`` takes a file, or ``DEVICE/MODEL`` for the roofline of a shipped device and model
(``h100-sxm/llama-3.1-8b``). No torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.core.step_time import TERMS, StepCost
from tandem.models.spec import ModelSpec
from tandem.sim import Cost
from tandem.sim.design import design, fit_cost
from tandem.sim.roofline import DEVICE_FIELDS, DTYPE_BYTES, Device, RooflineCost, kv_blocks
from tandem.sim.schema import SchemaError, boolean, integer, mapping, name_or, number, number_map, text, validate

SCHEMA = "tandem-sim-profile/1"
SHIPPED = Path(__file__).parent / "profiles"
KINDS = ("measured", "roofline")

LATER_TERMS = ("per_prompt_step",)
"""Terms added to the step-time model after profiles were first written: optional, 0 when absent."""
COEFFICIENTS = mapping({**{t: (number(), t not in LATER_TERMS) for t in TERMS}, "knee": (number(), False)})
_COMMON = {
    "schema": (text((SCHEMA,)), True),
    "kind": (text(KINDS), True),
    "name": (text(), True),
    "block_size": (integer(1), False),
    "max_model_len": (integer(1), False),
    "kv_num_blocks": (integer(1), False),
    "vocab_size": (integer(2), False),
    "add_bos": (boolean(), False),
}
MEASURED = mapping({
    **_COMMON,
    "forward": (COEFFICIENTS, True),
    "overhead": (COEFFICIENTS, True),
    "kv_num_blocks": (integer(1), True),
    "max_model_len": (integer(1), True),
    "machine": (text(), True),
    "device_type": (text(), False),
    "model": (text(), True),
    "dtype": (text(), True),
    "quantization": (text(), True),
    "date": (text(), True),
    "fit": (mapping({}, extra=True), False),
    "speed_probe_ms": (number_map(), False),
    "speed_check": (mapping({"ratio": (number(0, strict=True), True),
                             "prefill_ratio": (number(0, strict=True), False),
                             "decode_ratio": (number(0, strict=True), False)}, extra=True), False),
    "peaks": (mapping({"flops_per_s": (number(0, strict=True), True),
                       "bytes_per_s": (number(0, strict=True), True)}), False),
})
ROOFLINE = mapping({
    **_COMMON,
    "model": (name_or(mapping({}, extra=True), "a shipped model name, a config.json path or an inline config"), True),
    "device": (name_or(DEVICE_FIELDS, "a shipped device name, a device file path or an inline device"), True),
    "dtype": (text(tuple(DTYPE_BYTES)), False),
})


@dataclass
class Profile:
    name: str
    kind: str
    cost: Cost
    """The forward pass of a step."""
    prior: StepCost
    """The step-time model's start-up estimate (cost plus overhead, as a StepCost)."""
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    overhead: Cost | None = None
    vocab_size: int = 1000
    info: dict[str, Any] = field(default_factory=dict)
    """What the report says about the profile (kind, source, machine or device, model)."""
    add_bos: bool = True
    """Whether the model's tokenizer puts a BOS token before each prompt (most do)."""


def read_json(path: Path, what: str) -> Any:
    """A JSON file's content; ValueError naming ``what`` when it cannot be read or parsed."""
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"{what}: cannot read {path} ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what}: {path} is not valid JSON ({exc})") from None


def _resolve(ref: str | dict, kind: str, base: Path) -> tuple[dict, str]:
    """A shipped name, a path (relative to the profile's folder), or the inline object."""
    if isinstance(ref, dict):
        return ref, "inline"
    path = Path(ref).expanduser()
    if not path.is_absolute():
        path = base / path
    if path.is_file():
        return read_json(path, kind), str(path)
    shipped = SHIPPED / f"{kind}s" / f"{ref}.json"
    if shipped.is_file():
        return read_json(shipped, kind), ref
    names = sorted(p.stem for p in (SHIPPED / f"{kind}s").glob("*.json"))
    raise ValueError(f"{kind}: {ref!r} is neither a file nor a shipped {kind} ({', '.join(names)})")


def shipped_names() -> list[str]:
    devices = sorted(p.stem for p in (SHIPPED / "devices").glob("*.json"))
    models = sorted(p.stem for p in (SHIPPED / "models").glob("*.json"))
    return [f"{d}/{m}" for d in devices for m in models]


def load_profile(ref: str) -> Profile:
    """``ref``: a profile file, or ``DEVICE/MODEL`` (the roofline of a shipped device and model)."""
    path = Path(ref).expanduser()
    if path.is_file():
        return profile_from_dict(read_json(path, "profile"), f"profile {path}", path.parent)
    device, sep, model = ref.partition("/")
    if sep and (SHIPPED / "devices" / f"{device}.json").is_file() and (SHIPPED / "models" / f"{model}.json").is_file():
        return profile_from_dict({"schema": SCHEMA, "kind": "roofline", "name": ref, "model": model, "device": device},
                                 f"profile {ref}", SHIPPED)
    raise ValueError(f"profile: {ref!r} is neither a file nor a shipped DEVICE/MODEL ({', '.join(shipped_names())})")


def profile_from_dict(d: Any, source: str = "profile", base: Path = Path(".")) -> Profile:
    validate(mapping(_COMMON, extra=True), d, source)
    if d["kind"] == "measured":
        validate(MEASURED, d, source)
        return _measured(d)
    validate(ROOFLINE, d, source)
    try:
        return _roofline(d, base)
    except SchemaError as exc:
        raise SchemaError(f"{source}: {exc}") from None


def _measured(d: dict) -> Profile:
    forward = StepCost(**d["forward"])
    overhead = StepCost(**d["overhead"])
    prior = StepCost(*(a + b for a, b in zip(forward.vector(), overhead.vector())), knee=forward.knee)
    info = {"profile": d["name"], "kind": "measured", "machine": d["machine"], "model": d["model"],
            "dtype": d["dtype"], "quantization": d["quantization"], "date": d["date"]}
    if "speed_check" in d:
        info["speed_check"] = d["speed_check"]
    return Profile(d["name"], "measured", forward, prior, d["kv_num_blocks"], d.get("block_size", 16),
                   d["max_model_len"], overhead, d.get("vocab_size", 1000), info, d.get("add_bos", True))


def _roofline(d: dict, base: Path) -> Profile:
    model_cfg, model_src = _resolve(d["model"], "model", base)
    device_cfg, device_src = _resolve(d["device"], "device", base)
    device = Device.from_dict(device_cfg, f"device {device_src}")
    try:
        spec = ModelSpec.from_hf_config(model_cfg)
    except KeyError as exc:
        raise ValueError(f"model: the config {model_src} lacks {exc.args[0]!r}") from None
    dtype = d.get("dtype", "bfloat16")
    block_size = d.get("block_size", 16)
    max_len = d.get("max_model_len", min(spec.max_position_embeddings, 32768))
    blocks = d.get("kv_num_blocks") or kv_blocks(device, spec, dtype, block_size)
    cost = RooflineCost(device, spec, dtype)
    prior = fit_cost(cost.of_spans, design(blocks * block_size, max_len, max_chunk=8192, block_size=block_size))
    info = {"profile": d["name"], "kind": "roofline", "device": device.name, "device_source": device.source,
            "model": model_src, "dtype": dtype, "kv_tokens": blocks * block_size}
    return Profile(d["name"], "roofline", cost, prior, blocks, block_size, max_len, None, spec.vocab_size, info,
                   d.get("add_bos", True))


def describe(profile: Profile) -> str:
    """One line for the report: which profile, of what kind, measured or derived where."""
    i = profile.info
    if profile.kind == "measured":
        check = i.get("speed_check")
        rescaled = f", rescaled x{check['ratio']:.3f} by a speed check {check.get('date', '')}" if check else ""
        return (f"measured profile {profile.name!r}: {i['model']} ({i['dtype']}, quantization {i['quantization']}) "
                f"on {i['machine']}, calibrated {i['date']}{rescaled}")
    return (f"roofline profile {profile.name!r}: {i['model']} in {i['dtype']} on {i['device']} "
            f"({i['kv_tokens']:,} KV tokens)")
