"""Build, load and call the C kernels in this folder.

The same sources are built once per instruction-set variant (``VARIANTS``: AVX-512 with VNNI,
AVX2) and source digest with the system C compiler (``cc``/``gcc``) into tandem's cache
directory, and loaded with ctypes; torch tensors are passed by data pointer. ``best()`` loads
the best variant this CPU runs (``cpu_features`` decides, without executing anything new).
Nothing here is required: ``available()`` is False without a compiler or without AVX2/FMA, and
``tandem.ops.dispatch`` then chooses the plain torch path (``unavailable_reason()`` says why).

Longer than 300 lines because every exported kernel has its typed wrapper here, next to its
ctypes signature.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import torch

from tandem.kernels.cpu_features import cpu_info
from tandem.paths import default_cache_dir
from tandem.startup import one_time

log = logging.getLogger("tandem.kernels")
SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in ("int8_gemm.c", "packed_w8a8.c", "int4_gemm.c", "cpu_ops.c", "decode_attention.c", "bf16_ops.c", "decode_layers.c",
                 "threads.c")
)
LIBRARY = "tandem_kernels"
BASE_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]


@dataclass(frozen=True)
class Variant:
    """One build of the library for one instruction-set level: its compiler flags and the CPU
    features (``cpu_features.FEATURES``) a CPU must have to run it."""

    name: str
    flags: tuple[str, ...]
    requires: tuple[str, ...]


# Best first. Each adds to the one below; the sources pick their code paths from the compiler's
# own macros (__AVX512F__, __AVX512VNNI__, __AMX_INT8__), so one source serves every variant. Never
# -march=native: the cache directory may be shared by machines of different kinds.
_AVX512 = ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni")
VARIANTS = (
    # the w8a8 products on AMX int8 tiles (packed_w8a8.c); needs the OS's tile permission, which
    # cpu_features asks for before it counts the AMX features as usable
    Variant("amx", (*_AVX512, "-mamx-tile", "-mamx-int8"), ("avx2", "avx512", "avx512_vnni", "amx_tile", "amx_int8")),
    Variant("avx512", _AVX512, ("avx2", "avx512", "avx512_vnni")),
    Variant("avx2", ("-mavx2", "-mfma", "-mf16c"), ("avx2",)),
)
VARIANT_NAMES = tuple(v.name for v in VARIANTS)


def supported_variants(features: frozenset[str] | None = None) -> list[Variant]:
    """The variants this CPU can run, best first (``features`` overrides the detected ones)."""
    have = cpu_info().features if features is None else features
    return [v for v in VARIANTS if all(f in have for f in v.requires)]


def variant(name: str) -> Variant:
    for v in VARIANTS:
        if v.name == name:
            return v
    raise ValueError(f"kernel variant: must be one of {', '.join(VARIANT_NAMES)}, got {name!r}")


def _cache_dir() -> Path:
    return default_cache_dir() / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(sources: Path | tuple[Path, ...] = SOURCES, out_dir: Path | None = None, name: str | None = None,
          isa: Variant = VARIANTS[-1]) -> Path:
    """Compile ``sources`` for ``isa`` into one shared library unless one for their exact text
    and flags is already cached. Building needs no CPU support for ``isa``; running it does."""
    sources = (sources,) if isinstance(sources, Path) else tuple(sources)
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC or install gcc)")
    flags = [*BASE_FLAGS, *isa.flags]
    headers = sorted({h for src in sources for h in src.parent.glob("*.h")})
    text = b"".join(f.read_bytes() for f in (*sources, *headers))
    digest = hashlib.sha256(text + " ".join(flags).encode()).hexdigest()[:16]
    out_dir = out_dir or _cache_dir()
    name = name or (LIBRARY if len(sources) > 1 else sources[0].stem)
    lib = out_dir / f"{name}-{isa.name}-{digest}.so"
    if lib.is_file():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    # Compile to a temporary name and rename, so a concurrent or interrupted build never leaves
    # a half-written library behind.
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp, \
            one_time(f"compiling the {isa.name} kernels", f"once per CPU kind and source: cached in {out_dir}"):
        partial = Path(tmp) / lib.name
        done = subprocess.run([cc, *flags, *map(str, sources), "-o", str(partial)], capture_output=True, text=True)
        if done.returncode != 0:
            names = ", ".join(src.name for src in sources)
            raise RuntimeError(f"compiling {names} failed:\n{done.stderr.strip()}")
        os.replace(partial, lib)
    return lib


_PTR, _SIZE, _F32, _INT = ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_int
# Each exported function: (argument types, result type).
_SIGNATURES = {
    "tandem_set_threads": ([_INT], None),
    "tandem_gemm_i8": ([_PTR, _PTR, _PTR, _PTR, _SIZE, _SIZE, _SIZE], None),
    "tandem_gemm_w8a8": ([_PTR, _PTR, _PTR, _PTR, _SIZE, _SIZE, _SIZE, _PTR, _PTR], None),
    "tandem_w8a8_packs": ([_SIZE, _SIZE], _SIZE),
    "tandem_w8a8_weight_xor": ([], _SIZE),
    "tandem_w8a8_argmax_scratch": ([_SIZE, _SIZE], _SIZE),
    "tandem_gemm_w8a8_argmax": ([_PTR, _PTR, _PTR, _PTR, _SIZE, _SIZE, _SIZE, _PTR, _PTR, _PTR], None),
    "tandem_dequant_i8": ([_PTR, _PTR, _PTR, _SIZE, _SIZE, _SIZE], None),
    "tandem_gemm_i4": ([_PTR, _PTR, _PTR, _PTR, _SIZE, _SIZE, _SIZE], None),
    "tandem_dequant_i4": ([_PTR, _PTR, _PTR, _SIZE, _SIZE, _SIZE], None),
    "tandem_rms_norm": ([_PTR, _PTR, _PTR, _SIZE, _SIZE, _F32, _F32], None),
    "tandem_act_mul": ([_PTR, _PTR, _SIZE, _SIZE, _INT], None),
    "tandem_argmax_rows": ([_PTR, _PTR, _SIZE, _SIZE], None),
    "tandem_qkv_to_cache": ([_PTR, _SIZE, _SIZE, _SIZE, _SIZE, _PTR, _PTR, _F32, _F32, _PTR, _PTR, _PTR, _PTR, _PTR,
                             _PTR], None),
    "tandem_decode_attention": ([_PTR, _PTR, _PTR, _PTR, _SIZE, _PTR, _PTR, _PTR, _SIZE, _SIZE, _SIZE, _SIZE, _SIZE,
                                 _SIZE, _F32], _INT),
    "tandem_decode_layers_scratch": ([_PTR, _SIZE, _PTR, _SIZE], _SIZE),
    "tandem_decode_layers": ([_PTR, _PTR, _PTR], None),
}
# The kernels with a bfloat16 form: the same arguments, "_bf16" appended to the name.
_BF16_KERNELS = ("tandem_rms_norm", "tandem_act_mul", "tandem_qkv_to_cache", "tandem_decode_attention")
_SIGNATURES.update({f"{fn}_bf16": _SIGNATURES[fn] for fn in _BF16_KERNELS})
_DTYPE_SUFFIX = {torch.float32: "", torch.bfloat16: "_bf16"}


@lru_cache(maxsize=None)
def load(name: str) -> "Kernels":
    """The library built for variant ``name``, loaded; raises RuntimeError when this CPU cannot
    run it or it does not build (with the compiler's message)."""
    isa = variant(name)
    missing = [f for f in isa.requires if f not in cpu_info().features]
    if missing:
        raise RuntimeError(f"this CPU lacks {', '.join(missing)} for the {name} kernels")
    try:
        lib = ctypes.CDLL(str(build(isa=isa)))
    except OSError as exc:
        raise RuntimeError(f"loading the {name} kernels failed: {exc}") from exc
    for fn, (args, result) in _SIGNATURES.items():
        getattr(lib, fn).argtypes = args
        getattr(lib, fn).restype = result
    return Kernels(isa, lib)


_why_off: list[str] = []  # why best() found no library, once it has looked


@lru_cache(maxsize=1)
def best() -> "Kernels | None":
    """The best variant this machine runs (``TANDEM_KERNEL_ISA`` caps it, e.g. ``avx2``), or None
    when none does (``unavailable_reason()`` says why)."""
    if os.environ.get("TANDEM_NO_KERNELS"):
        _why_off.append("TANDEM_NO_KERNELS is set")
        return None
    candidates = supported_variants()
    cap = os.environ.get("TANDEM_KERNEL_ISA")
    if cap:
        names = VARIANT_NAMES[VARIANT_NAMES.index(variant(cap).name):]
        candidates = [v for v in candidates if v.name in names]
    if not candidates:
        _why_off.append("this CPU has no AVX2")
        log.info("native kernels off: this CPU has no AVX2")
        return None
    for i, candidate in enumerate(candidates):
        try:
            kernels = load(candidate.name)
        except RuntimeError as exc:
            _why_off.append(str(exc).splitlines()[0])
            if i + 1 < len(candidates):  # e.g. a compiler too old for the AMX flags
                log.warning("the %s kernels are off, trying %s: %s", candidate.name, candidates[i + 1].name, exc)
                continue
            log.warning("native kernels off, using the plain torch path: %s", exc)
            return None
        log.info("native kernels: %s", kernels.isa.name)
        return kernels
    return None


def available() -> bool:
    return best() is not None


def unavailable_reason() -> str:
    """Why ``available()`` is False ('' when it is True)."""
    return "" if available() else (_why_off[-1] if _why_off else "unknown")


_thread = threading.local()

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


def _align64(nbytes: int) -> int:
    return (nbytes + 63) & ~63


def _w8a8_scratch(values: int) -> int:
    """The address of this thread's scratch for ``values`` rounded inputs and their scales, kept
    between calls (grown when needed): a decode step makes ~70 w8a8 calls, and allocating two
    small tensors for each cost more than the rounding itself."""
    need = 64 + _align64(values) + values // 4  # the bytes, then per block of 32 a scale and a correction
    buf = getattr(_thread, "w8a8", None)
    if buf is None or buf.numel() < need:
        buf = _thread.w8a8 = torch.empty(2 * need, dtype=torch.uint8)
    return _align64(buf.data_ptr())


def _ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's data pointer, or NULL for None."""
    return None if t is None else t.data_ptr()


def _check_int4(packed: torch.Tensor, scales: torch.Tensor, k: int) -> None:
    groups = -(-k // 32)
    if packed.shape[1] != 16 * groups or scales.shape != (packed.shape[0], groups) or scales.dtype != torch.float16:
        raise ValueError(f"int4 weights for K={k}: packed [N, {16 * groups}] uint8 and scales [N, {groups}] "
                         f"float16, got {tuple(packed.shape)} and {tuple(scales.shape)} {scales.dtype}")


class Kernels:
    """One loaded variant of the library. Tensors are CPU tensors, contiguous, float32 unless
    said otherwise; outputs are allocated here unless passed in. ``rms_norm``, ``act_mul``,
    ``qkv_to_cache`` and ``decode_attention`` take float32 or bfloat16 tensors (all of one call's
    floating-point tensors in the same dtype) and run the kernel for that dtype."""

    def __init__(self, isa: Variant, lib: ctypes.CDLL) -> None:
        self.isa = isa
        self.name = f"native-{isa.name}"
        self._cdll = lib
        self._typed_fns: dict[tuple[str, torch.dtype], Callable[..., Any]] = {}
        self._packs_by_shape: dict[tuple[int, int], bool] = {}
        self._weight_xor: int | None = None

    def __deepcopy__(self, memo) -> "Kernels":
        return self  # a handle to the one loaded library: copies of a model share it

    def _lib(self) -> ctypes.CDLL:
        """The library, with this thread's OpenMP thread count set to torch's (see threads.c)."""
        n = torch.get_num_threads()
        if getattr(_thread, "threads", None) != n:
            self._cdll.tandem_set_threads(n)  # OpenMP's count is per thread, shared by every variant
            _thread.threads = n
        return self._cdll

    def _typed(self, fn: str, x: torch.Tensor, *others: torch.Tensor | None) -> Callable[..., Any]:
        """Kernel ``fn`` in the form for ``x``'s dtype; ValueError for a dtype it has no form for
        or for ``others`` (None skipped) in another dtype."""
        dtype = x.dtype
        for t in others:
            if t is not None and t.dtype != dtype:
                mixed = sorted({str(t.dtype) for t in others if t is not None and t.dtype != dtype})
                raise ValueError(f"{fn}: every tensor must be {dtype} like the input, got {', '.join(mixed)}")
        lib = self._lib()  # also sets this thread's OpenMP thread count
        typed = self._typed_fns.get((fn, dtype))
        if typed is None:
            suffix = _DTYPE_SUFFIX.get(dtype)
            if suffix is None:
                raise ValueError(f"{fn}: the kernels take float32 or bfloat16 tensors, not {dtype}")
            typed = self._typed_fns[(fn, dtype)] = getattr(lib, fn + suffix)
        return typed

    def gemm_i8(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``x`` float32 [M, K] contiguous, ``weight`` int8 [N, K], ``scale`` float32 [N] -> [M, N]."""
        lib = self._lib()
        m, k = x.shape
        n = weight.shape[0]
        y = torch.empty(m, n, dtype=torch.float32)
        lib.tandem_gemm_i8(x.data_ptr(), weight.data_ptr(), scale.data_ptr(), y.data_ptr(), m, n, k)
        return y

    def w8a8_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """int8 ``weight`` [N, K] in the layout this variant's w8a8 kernel reads: itself, or where
        its kernel takes it packed (``tandem_w8a8_packs``: AMX tiles or AVX-512 VNNI) a packed copy
        [N / 16, K / 32, 8, 64] (packed_w8a8.c): for weight rows 16 t + n and block b, ``[t, b, k4, 4 n + r]`` holds
        ``weight[16 t + n, 32 b + 4 k4 + r]``, each byte xor ``weight_xor`` (the VNNI kernel
        multiplies unsigned weight bytes: the weights plus 128)."""
        n, k = weight.shape
        if not self._packs(n, k):
            return weight
        packed = weight.view(n // 16, 16, k // 32, 8, 4).permute(0, 2, 3, 1, 4).reshape(n // 16, k // 32, 8, 64)
        return self._flip(packed.contiguous())

    @property
    def weight_xor(self) -> int:
        """What every byte of a packed w8a8 weight is xor-ed with: 0x80 for the VNNI kernel, else 0."""
        if self._weight_xor is None:
            self._weight_xor = int(self._cdll.tandem_w8a8_weight_xor())
        return self._weight_xor

    def _flip(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (int8) with each byte xor ``weight_xor``; ``t`` itself when that is 0."""
        if not self.weight_xor:
            return t
        return (t.view(torch.uint8) ^ self.weight_xor).view(torch.int8)

    def w8a8_rows(self, weight: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The int8 rows ``ids`` (all when None) as [len, K] of a weight ``w8a8_weight`` packed
        ([N / 16, K / 32, 8, 64]): the inverse of its packing. (``Int8Linear.weight_rows`` reads
        an unpacked [N, K] weight itself.)"""
        t, b = weight.shape[:2]
        groups = weight.view(t, b, 8, 16, 4)  # [t, b, k4, n, r]: row 16 t + n, column 32 b + 4 k4 + r
        if ids is None:
            return self._flip(groups.permute(0, 3, 1, 2, 4).reshape(16 * t, 32 * b))
        return self._flip(groups[ids // 16, :, :, ids % 16].reshape(*ids.shape, 32 * b))

    def _packs(self, n: int, k: int) -> bool:
        """``tandem_w8a8_packs`` for [n, k], asked once per shape (the matmuls ask on every call)."""
        packs = self._packs_by_shape.get((n, k))
        if packs is None:
            packs = self._packs_by_shape[(n, k)] = bool(self._cdll.tandem_w8a8_packs(n, k))
        return packs

    def w8a8_shape(self, weight: torch.Tensor) -> tuple[int, int]:
        """(N, K) of a weight from ``w8a8_weight``; ValueError for an [N, K] weight this variant
        wants packed (passing it would multiply the wrong bytes)."""
        if weight.dim() == 4:
            return weight.shape[0] * 16, weight.shape[1] * 32
        n, k = weight.shape
        if self._packs(n, k):
            raise ValueError(f"gemm_w8a8: the {self.isa.name} kernels take this weight packed: "
                             "pass Kernels.w8a8_weight(weight)")
        return n, k

    def _w8a8_inputs(self, fn: str, x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int, int, int]:
        """(M, N, K, the address of the rounded inputs' scratch) of a w8a8 call, its shapes checked."""
        m, k = x.shape
        n, wk = self.w8a8_shape(weight)
        if k % 32:
            raise ValueError(f"{fn}: K must be a multiple of 32, got {k}")
        if wk != k:
            raise ValueError(f"{fn}: the weight has K={wk}, the input {k}")
        return m, n, k, _w8a8_scratch(m * k)

    def gemm_w8a8(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """As ``gemm_i8`` with ``x`` rounded to int8 per block of 32 values (K a multiple of 32);
        ``weight`` as ``w8a8_weight`` gives it."""
        lib = self._lib()
        m, n, k, xq = self._w8a8_inputs("gemm_w8a8", x, weight)
        y = torch.empty(m, n, dtype=torch.float32)
        # the rounded inputs (m * k bytes), then their scales (m * k / 32 floats), 64-byte aligned
        lib.tandem_gemm_w8a8(x.data_ptr(), weight.data_ptr(), scale.data_ptr(), y.data_ptr(), m, n, k,
                             xq, xq + _align64(m * k))
        return y

    def gemm_w8a8_argmax(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``argmax_rows(gemm_w8a8(x, weight, scale))`` without making the product: int64 [M], the
        same indices. Only for a weight packed for this variant's kernel (``w8a8_weight``)."""
        if weight.dim() != 4:
            raise ValueError("gemm_w8a8_argmax: takes a packed weight (Kernels.w8a8_weight)")
        lib = self._lib()
        m, n, k, xq = self._w8a8_inputs("gemm_w8a8_argmax", x, weight)
        out = torch.empty(m, dtype=torch.int64)
        floats = lib.tandem_w8a8_argmax_scratch(m, torch.get_num_threads())
        buf = getattr(_thread, "argmax", None)
        if buf is None or buf.numel() < floats + 16:
            buf = _thread.argmax = torch.empty(floats + 16, dtype=torch.float32)
        lib.tandem_gemm_w8a8_argmax(x.data_ptr(), weight.data_ptr(), scale.data_ptr(), out.data_ptr(), m, n, k,
                                    xq, xq + _align64(m * k), _align64(buf.data_ptr()))
        return out

    def dequant_i8(self, weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, n0: int, n1: int) -> torch.Tensor:
        """Rows ``n0 .. n1`` of ``scale[:, None] * weight`` into ``out[: n1 - n0]`` (float32)."""
        lib = self._lib()
        lib.tandem_dequant_i8(weight.data_ptr(), scale.data_ptr(), out.data_ptr(), n0, n1, weight.shape[1])
        return out[: n1 - n0]

    def gemm_i4(self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """``x`` float32 [M, K] contiguous times int4 weights [N, K] -> [M, N]: ``packed`` uint8
        [N, 16 G] and ``scales`` float16 [N, G], G = ceil(K / 32) (``tandem.models.quant_int4``)."""
        m, k = x.shape
        n = packed.shape[0]
        _check_int4(packed, scales, k)
        y = torch.empty(m, n, dtype=torch.float32)
        self._lib().tandem_gemm_i4(x.data_ptr(), packed.data_ptr(), scales.data_ptr(), y.data_ptr(), m, n, k)
        return y

    def dequant_i4(self, packed: torch.Tensor, scales: torch.Tensor, k: int, out: torch.Tensor, n0: int,
                   n1: int) -> torch.Tensor:
        """Rows ``n0 .. n1`` of the int4 weight (``k`` input values) as float32 into ``out[: n1 - n0]``."""
        _check_int4(packed, scales, k)
        self._lib().tandem_dequant_i4(packed.data_ptr(), scales.data_ptr(), out.data_ptr(), n0, n1, k)
        return out[: n1 - n0]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
        """RMS norm over the last dimension, times ``offset + weight``; contiguous, CPU."""
        fn = self._typed("tandem_rms_norm", x, weight)
        out = torch.empty_like(x)
        d = x.shape[-1]
        fn(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // d, d, eps, offset)
        return out

    def act_mul(self, gate_up: torch.Tensor, kind: str) -> torch.Tensor:
        """``act(gate) * up`` for ``gate_up`` [..., 2 * I] holding gate then up; contiguous, CPU."""
        fn = self._typed("tandem_act_mul", gate_up)
        i = gate_up.shape[-1] // 2
        out = gate_up.new_empty(*gate_up.shape[:-1], i)
        fn(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * i), i, ACTIVATIONS[kind])
        return out

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Index of each row's largest value (first on ties) for a float32 [rows, N] tensor."""
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self._lib().tandem_argmax_rows(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1])
        return out

    def qkv_to_cache(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        eps: float,
        offset: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Split the merged projection ``qkv`` [T, (H + 2 KVH) * D]: q and k RMS-normed (when the
        weights are given) and rotated (``cos``/``sin`` [T, D]); k and v written to cache rows
        ``slots`` of ``k_cache``/``v_cache`` [slots, KVH, D]. Returns q [T, H, D]."""
        fn = self._typed("tandem_qkv_to_cache", qkv, q_norm, k_norm, cos, sin, k_cache, v_cache)
        _, kvh, d = k_cache.shape
        t = qkv.shape[0]
        q = qkv.new_empty(t, num_heads, d)
        fn(
            qkv.data_ptr(), t, num_heads, kvh, d, _ptr(q_norm), _ptr(k_norm), eps, offset, cos.data_ptr(),
            sin.data_ptr(), slots.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        )
        return q

    def decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        rows: torch.Tensor,
        out: torch.Tensor,
        block_size: int,
        window: int,
        scale: float,
    ) -> None:
        """One query per sequence against its keys in the paged cache, written into ``out``.

        ``q``/``out``: [T, H, D]; caches: [slots, KVH, D]; ``block_tables`` [S, B], ``context_lens``
        [S] and ``rows`` [S] (each sequence's token row in ``q``) int64; ``window`` 0 for none."""
        fn = self._typed("tandem_decode_attention", q, k_cache, v_cache, out)
        s, b = block_tables.shape
        _, h, d = q.shape
        status = fn(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), b, context_lens.data_ptr(),
            rows.data_ptr(), out.data_ptr(), s, h, k_cache.shape[1], d, block_size, window, scale,
        )
        if status != 0:
            raise MemoryError("decode attention: scratch allocation failed")

    def decode_layers(self, model: ctypes.Structure, step: ctypes.Structure) -> None:
        """Every decoder layer of a decode step in one call (``decode_layers.c``; the structures
        and their meaning: ``tandem.kernels.decode_layers``); ``step.x`` is overwritten with the
        layers' output. The scratch is this thread's, kept between calls."""
        lib = self._lib()
        threads = torch.get_num_threads()
        floats = lib.tandem_decode_layers_scratch(ctypes.byref(model), step.T, step.context, threads)
        buf = getattr(_thread, "decode_layers", None)
        if buf is None or buf.numel() < floats + 16:
            buf = _thread.decode_layers = torch.empty(floats + 16, dtype=torch.float32)
        lib.tandem_decode_layers(ctypes.byref(model), ctypes.byref(step), _align64(buf.data_ptr()))
