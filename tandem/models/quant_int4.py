"""Int4 weights: every linear layer and the (tied) embedding table in 4.5 bits per weight.

Format: each output row is cut into groups of ``INT4_GROUP`` (32) consecutive input values; a
group keeps one float16 scale ``d`` and its values as integers ``q`` in [-8, 7], the weight being
``q * d`` (symmetric: no offset). ``q + 8`` is stored as a nibble, two per byte, 16 bytes per
group: byte ``t`` holds value ``t`` in its low nibble and value ``t + 16`` in its high one, so the
kernel unpacks a group with a mask and a shift. Where K is not a multiple of 32 the last group of
each row is shorter; it is stored padded with zeros (``q = 0``), and its scale comes from its own
values.

Why these choices:

- float16 scales, not float32: 0.5625 bytes per weight against 0.625, a tenth fewer bytes for a
  decode step that is bound by reading them; F16C (which every AVX2 CPU has) widens one per group
  in a single instruction, and the product of a 4-bit integer and a float16 scale is exact in
  float32, so the dequantized weights are exactly ``q * d``.
- [-8, 7], not [-7, 7]: all sixteen codes are used, and the scale's sign is free, so each group
  puts its largest-magnitude value on the side of -8: that side has 8.5 half-steps of room, the
  other 7.5. The smallest scale that keeps every value within half a step of a code is
  ``|d0| = max(|extreme| / 8.5, |other side| / 7.5)``; each group then takes the scale among
  ``d0 * SCALE_STEPS`` (all at least as large, so the rounding error stays at most half a step)
  with the least squared error weighted by ``w ** 2``, which keeps the large weights closest.
  On the default model (6 texts, 762 tokens, every weight rounded) the mean KL against float32
  was 0.54 nats with the smallest positive scale alone, 0.58 with [-7, 7] and ``max|w| / 7``,
  0.45-0.47 with the scale llama.cpp's Q4_0 takes (``extreme / -8``, the other side clamped),
  0.49 with the least plain squared error over positive scales, and 0.40 with this.
Activations stay float32 (weight-only). For few rows (decode) ``int4_matmul`` calls the C kernel
(``tandem/kernels/int4_gemm.c``), which unpacks the nibbles in registers; for many (prefill) it
dequantizes blocks of rows and calls BLAS, as int8 does (``quant.quantized_matmul``). The plain
torch path (no kernels, or ``kernels='torch'``) dequantizes the same way, bit for bit.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from tandem.kernels.native import Kernels
from tandem.models.base import CausalLM
from tandem.models.quant import KernelRows, QuantLinear, quantize_model, quantized_matmul

INT4_GROUP = 32
GROUP_BYTES = INT4_GROUP // 2
BYTES_PER_WEIGHT = 0.5 + 2 / INT4_GROUP  # the nibble and its share of a float16 scale
# Up to how many rows each kernel variant beats dequantize + BLAS (benchmarks/int8_kernel.py
# --kinds int4, on a 2-core AMD EPYC with AVX-512): the AVX2 kernel up to about 32 rows, for the
# layers' weights and the output head alike; the AVX-512 one at every row count measured, up to
# 512 (it also beat float32 BLAS there), so it serves every call and int4 rows are
# batch-invariant at every batch size where it runs.
INT4_ROWS = {"avx512": KernelRows(layers=sys.maxsize, large=sys.maxsize), "avx2": KernelRows(layers=32, large=32)}
INT4_ROWS["amx"] = INT4_ROWS["avx512"]  # the AMX build runs the AVX-512 int4 kernel
# Candidate scales, as multiples of the smallest one that keeps every value within half a step.
SCALE_STEPS = (1.0, 1.025, 1.05, 1.075, 1.1, 1.125, 1.15, 1.175, 1.2, 1.225, 1.25)
# Weights quantized per pass: the float32 temporaries stay in cache, and memory stays bounded while
# the output table is quantized.
QUANT_ELEMENTS = 1 << 20


def _half_at_least(d: torch.Tensor) -> torch.Tensor:
    """float32 ``d`` -> the float16 of the same sign nearest to it whose magnitude is not below
    ``|d|`` (where rounding to the nearest went down, the next float16 away from zero), so a
    scale never shrinks when it is stored."""
    a = d.abs()
    h = a.half()
    h = torch.where(h.float() < a, (h.view(torch.int16) + 1).view(torch.float16), h)
    return torch.where(d < 0, -h, h)


def _codes(groups: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``groups`` [..., 32] and per-group ``scale`` [...] -> integers in [-8, 7] (float):
    ``round_half_even(w / d)``, 0 where ``d`` is 0."""
    d = scale[..., None]
    return torch.div(groups, torch.where(d != 0, d, torch.inf)).round_().clamp_(-8, 7)


def _smallest_scales(groups: torch.Tensor) -> torch.Tensor:
    """Per group, the scale of least magnitude that keeps every value within half a step of a
    code, signed so that the largest-magnitude value rounds towards -8."""
    hi, lo = groups.amax(-1), groups.amin(-1)
    negative = -lo >= hi  # the extreme is negative: a positive scale puts it near -8
    extreme = torch.where(negative, -lo, hi)
    other = torch.where(negative, hi, -lo).clamp_min(0.0)
    size = torch.maximum(extreme / 8.5, other / 7.5)
    return torch.where(negative, size, -size)


def _best_scales(groups: torch.Tensor) -> torch.Tensor:
    """Per group, the float16 scale among ``_smallest_scales * SCALE_STEPS`` with the least
    squared error weighted by ``w ** 2``: ``sum v (q d - w)^2 = d^2 v.q^2 - 2 d (v w).q + v.w^2``
    with ``v = w ** 2``; the last term is the same for every candidate."""
    d0 = _smallest_scales(groups)
    v = groups.square()
    vw = v * groups
    best, best_err = None, None
    for step in SCALE_STEPS:
        d = _half_at_least(d0 * step)
        df = d.float()
        q = _codes(groups, df)
        err = df * (df * torch.linalg.vecdot(q.square(), v) - 2 * torch.linalg.vecdot(q, vw))
        if best is None:
            best, best_err = d, err
        else:
            better = err < best_err
            best, best_err = torch.where(better, d, best), torch.where(better, err, best_err)
    return best


def quantize_groups(weight: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (packed uint8 [N, 16 G], scales float16 [N, G]), G = ceil(K / 32); see the
    module docstring. ``name`` (the layer) is for the error raised when a scale overflows float16."""
    w = weight.detach().float()
    n, k = w.shape
    groups = -(-k // INT4_GROUP)
    packed = torch.empty(n, groups * GROUP_BYTES, dtype=torch.uint8)
    scales = torch.empty(n, groups, dtype=torch.float16)
    step = max(1, QUANT_ELEMENTS // (groups * INT4_GROUP))
    for n0 in range(0, n, step):
        n1 = min(n, n0 + step)
        g = F.pad(w[n0:n1], (0, groups * INT4_GROUP - k)).view(n1 - n0, groups, INT4_GROUP)
        d = _best_scales(g)
        if not torch.isfinite(d).all():
            raise ValueError(f"int4: {name} has weights too large for float16 group scales (or not finite)")
        packed[n0:n1] = pack(_codes(g, d.float()).view(n1 - n0, -1))
        scales[n0:n1] = d
    return packed, scales


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Integer codes [N, 32 G] in [-8, 7] (any dtype) -> packed uint8 [N, 16 G]."""
    nib = (codes + 8).to(torch.uint8).view(codes.shape[0], -1, INT4_GROUP)
    return (nib[..., :GROUP_BYTES] | (nib[..., GROUP_BYTES:] << 4)).view(codes.shape[0], -1)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [N, 16 G] -> int8 codes [N, 32 G] in [-8, 7], padding included."""
    n = packed.shape[0]
    b = packed.view(n, -1, GROUP_BYTES)
    return (torch.cat([b & 0x0F, b >> 4], dim=-1).to(torch.int8) - 8).view(n, -1)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, k: int) -> torch.Tensor:
    """float32 [N, k]: each code times its group's scale (exact in float32)."""
    n, groups = scales.shape
    w = unpack(packed).view(n, groups, INT4_GROUP).float() * scales.float()[..., None]
    return w.view(n, -1)[:, :k]


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, k: int,
                kernels: Kernels | None = None) -> torch.Tensor:
    """``x`` [..., k] times the int4 weight [N, k] -> float32 [..., N]. ``kernels``: the C kernels
    to use (``OpTable.int4_kernels``; CPU tensors only), or None for plain torch."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).float().contiguous()

    def dequant(n0: int, n1: int, buf: torch.Tensor | None) -> torch.Tensor:
        if buf is not None:
            return kernels.dequant_i4(packed, scales, k, buf, n0, n1)
        return dequantize(packed[n0:n1], scales[n0:n1], k)

    kernel = None if kernels is None else (lambda x2: kernels.gemm_i4(x2, packed, scales))
    limits = INT4_ROWS[kernels.isa.name] if kernels is not None else None
    return quantized_matmul(x2, packed.shape[0], kernel, dequant, limits).reshape(*lead, -1)


class Int4Linear(QuantLinear):
    """Drop-in for ``nn.Linear`` with int4 weights (``packed``, ``scales`` from
    ``quantize_groups``); float32 arithmetic, output in the input's dtype."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, in_features: int, bias: torch.Tensor | None,
                 kernels: Kernels | None = None) -> None:
        super().__init__(packed.shape[0], in_features, bias)
        self.kernels = kernels
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, kernels: Kernels | None = None,
                    name: str = "weight") -> "Int4Linear":
        return cls(*quantize_groups(weight, name), weight.shape[1], bias, kernels)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return int4_matmul(x, self.packed, self.scales, self.in_features, self.kernels)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        shape = ids.shape
        flat = ids.reshape(-1)
        return dequantize(self.packed[flat], self.scales[flat], self.in_features).view(*shape, -1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 weights (groups of 32)"


def quantize_model_int4(model: CausalLM) -> CausalLM:
    """Every linear layer and the tied table as int4 (``quant.quantize_model``), on the C kernels
    when the model's op table says so. Returns ``model``."""
    kernels = model.ops.int4_kernels
    return quantize_model(model, lambda w, bias, name: Int4Linear.from_weight(w, bias, kernels, name))
