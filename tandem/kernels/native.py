"""Build, load and call the C kernels in this folder.

The library is compiled once per source digest with the system C compiler (``cc``/``gcc``) into
tandem's cache directory and loaded with ctypes; torch tensors are passed by data pointer.
Nothing here is required: ``available()`` is False without a compiler or without AVX2/FMA, and
``tandem.ops.dispatch`` then chooses the plain torch path (``unavailable_reason()`` says why).
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
from functools import lru_cache
from pathlib import Path

import torch

from tandem.paths import default_cache_dir

log = logging.getLogger("tandem.kernels")
SOURCES = tuple(
    Path(__file__).with_name(name) for name in ("int8_gemm.c", "cpu_ops.c", "decode_attention.c", "threads.c")
)
LIBRARY = "tandem_kernels"
ISA = "avx2"
"""The instruction set the library is compiled for (named in the op choices)."""
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]


def cpu_has_avx2() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _cache_dir() -> Path:
    return default_cache_dir() / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(sources: Path | tuple[Path, ...] = SOURCES, out_dir: Path | None = None, name: str | None = None) -> Path:
    """Compile ``sources`` into one shared library unless one for their exact text and flags is
    already cached."""
    sources = (sources,) if isinstance(sources, Path) else tuple(sources)
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC or install gcc)")
    headers = sorted({h for src in sources for h in src.parent.glob("*.h")})
    text = b"".join(f.read_bytes() for f in (*sources, *headers))
    digest = hashlib.sha256(text + " ".join(FLAGS).encode()).hexdigest()[:16]
    out_dir = out_dir or _cache_dir()
    name = name or (LIBRARY if len(sources) > 1 else sources[0].stem)
    lib = out_dir / f"{name}-{digest}.so"
    if lib.is_file():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    # Compile to a temporary name and rename, so a concurrent or interrupted build never leaves
    # a half-written library behind.
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        partial = Path(tmp) / lib.name
        done = subprocess.run([cc, *FLAGS, *map(str, sources), "-o", str(partial)], capture_output=True, text=True)
        if done.returncode != 0:
            names = ", ".join(src.name for src in sources)
            raise RuntimeError(f"compiling {names} failed:\n{done.stderr.strip()}")
        os.replace(partial, lib)
    return lib


_why_off: list[str] = []  # why _library() found no library, once it has looked


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if os.environ.get("TANDEM_NO_KERNELS"):
        _why_off.append("TANDEM_NO_KERNELS is set")
        return None
    if not cpu_has_avx2():
        _why_off.append("this CPU has no AVX2")
        log.info("native kernels off: this CPU has no AVX2")
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except (RuntimeError, OSError) as exc:
        _why_off.append(str(exc).splitlines()[0])
        log.warning("native kernels off, using the plain torch path: %s", exc)
        return None
    ptr, size = ctypes.c_void_p, ctypes.c_long
    lib.tandem_set_threads.argtypes = [ctypes.c_int]
    lib.tandem_set_threads.restype = None
    lib.tandem_gemm_i8.argtypes = [ptr, ptr, ptr, ptr, size, size, size]
    lib.tandem_gemm_i8.restype = None
    lib.tandem_gemm_w8a8.argtypes = [ptr, ptr, ptr, ptr, size, size, size, ptr, ptr]
    lib.tandem_gemm_w8a8.restype = None
    lib.tandem_dequant_i8.argtypes = [ptr, ptr, ptr, size, size, size]
    lib.tandem_dequant_i8.restype = None
    lib.tandem_rms_norm.argtypes = [ptr, ptr, ptr, size, size, ctypes.c_float, ctypes.c_float]
    lib.tandem_rms_norm.restype = None
    lib.tandem_act_mul.argtypes = [ptr, ptr, size, size, ctypes.c_int]
    lib.tandem_act_mul.restype = None
    lib.tandem_argmax_rows.argtypes = [ptr, ptr, size, size]
    lib.tandem_argmax_rows.restype = None
    lib.tandem_qkv_to_cache.argtypes = [ptr, size, size, size, size, ptr, ptr, ctypes.c_float, ctypes.c_float, ptr,
                                        ptr, ptr, ptr, ptr, ptr]
    lib.tandem_qkv_to_cache.restype = None
    lib.tandem_decode_attention.argtypes = [ptr, ptr, ptr, ptr, size, ptr, ptr, ptr, size, size, size, size, size,
                                            size, ctypes.c_float]
    lib.tandem_decode_attention.restype = ctypes.c_int
    return lib


def available() -> bool:
    return _library() is not None


def unavailable_reason() -> str:
    """Why ``available()`` is False ('' when it is True)."""
    return "" if available() else (_why_off[-1] if _why_off else "unknown")


_thread = threading.local()


def _lib() -> ctypes.CDLL:
    """The library, with this thread's OpenMP thread count set to torch's (see threads.c)."""
    lib = _library()
    n = torch.get_num_threads()
    if getattr(_thread, "threads", None) != n:
        lib.tandem_set_threads(n)
        _thread.threads = n
    return lib


def gemm_i8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` float32 [M, K] contiguous, ``weight`` int8 [N, K], ``scale`` float32 [N] -> [M, N]."""
    lib = _lib()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    lib.tandem_gemm_i8(x.data_ptr(), weight.data_ptr(), scale.data_ptr(), y.data_ptr(), m, n, k)
    return y


def gemm_w8a8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """As ``gemm_i8`` with ``x`` rounded to int8 per block of 32 values (K a multiple of 32)."""
    lib = _lib()
    m, k = x.shape
    n = weight.shape[0]
    if k % 32:
        raise ValueError(f"gemm_w8a8: K must be a multiple of 32, got {k}")
    y = torch.empty(m, n, dtype=torch.float32)
    xq = torch.empty(m, k, dtype=torch.int8)
    xs = torch.empty(m, k // 32, dtype=torch.float32)
    lib.tandem_gemm_w8a8(x.data_ptr(), weight.data_ptr(), scale.data_ptr(), y.data_ptr(), m, n, k,
                         xq.data_ptr(), xs.data_ptr())
    return y


def dequant_i8(weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, n0: int, n1: int) -> torch.Tensor:
    """Rows ``n0 .. n1`` of ``scale[:, None] * weight`` into ``out[: n1 - n0]`` (float32)."""
    lib = _lib()
    lib.tandem_dequant_i8(weight.data_ptr(), scale.data_ptr(), out.data_ptr(), n0, n1, weight.shape[1])
    return out[: n1 - n0]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """RMS norm over the last dimension, times ``offset + weight``; float32, contiguous, CPU."""
    out = torch.empty_like(x)
    d = x.shape[-1]
    _lib().tandem_rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // d, d, eps, offset)
    return out


ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


def act_mul(gate_up: torch.Tensor, kind: str) -> torch.Tensor:
    """``act(gate) * up`` for ``gate_up`` [..., 2 * I] holding gate then up; float32, contiguous, CPU."""
    i = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], i)
    _lib().tandem_act_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * i), i, ACTIVATIONS[kind])
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's largest value (first on ties) for a float32 [rows, N] tensor."""
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _lib().tandem_argmax_rows(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1])
    return out


def _ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's data pointer, or NULL for None."""
    return None if t is None else t.data_ptr()


def qkv_to_cache(
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
    _, kvh, d = k_cache.shape
    t = qkv.shape[0]
    q = qkv.new_empty(t, num_heads, d)
    _lib().tandem_qkv_to_cache(
        qkv.data_ptr(), t, num_heads, kvh, d, _ptr(q_norm), _ptr(k_norm), eps, offset, cos.data_ptr(),
        sin.data_ptr(), slots.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
    )
    return q


def decode_attention(
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
    s, b = block_tables.shape
    _, h, d = q.shape
    status = _lib().tandem_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), b, context_lens.data_ptr(),
        rows.data_ptr(), out.data_ptr(), s, h, k_cache.shape[1], d, block_size, window, scale,
    )
    if status != 0:
        raise MemoryError("decode attention: scratch allocation failed")
