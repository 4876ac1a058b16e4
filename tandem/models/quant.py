"""Int8 weights: every linear layer and the (tied) embedding table stored as int8.

Each output row ``n`` keeps one float32 scale, ``max|w[n, :]| / 127``, and its weights rounded to
the nearest multiple of it (symmetric, per channel). Two modes:

- ``int8`` (weight-only): activations stay in float32; inputs are multiplied by the widened int8
  weights, so the only error is the weights' rounding.
- ``w8a8``: each input row is also quantized at run time, one scale per block of ``QBLOCK``
  values (``max|x| / 127``, rounded half to even), and the kernel sums int8 products exactly in
  integers: twice float32's multiply-adds per instruction where the step is bound by arithmetic
  (prefill, large decode batches), at the cost of the activations' rounding. Where the CPU has
  bf16 arithmetic (``OpTable.w8a8_prompt_bf16_tokens``), the prompt positions of requests with
  prompts of 32+ tokens instead multiply ``bf16(x)`` by the int8 weights held exactly as bf16
  integers (oneDNN, in calls of a fixed row count: ``TiledBf16Weight``), then the scales: the
  integer kernel pays a conversion and a float multiply-add per VNNI product, oneDNN's bf16 dot
  product neither. Which road a row takes depends on its request and position only (decode rows
  and short prompts: always the integer kernel), so results stay independent of the batch.

Decode reads every weight once per step, so int8 weights cut the bytes a step must read by 4x
against float32. Weight-only int8 uses the AVX2 kernel in ``tandem.kernels`` for small batches
(decode) and, for large ones (prefill chunks), dequantizes the weights in row blocks and calls the
float32 BLAS matmul, which is compute-bound there anyway. ``w8a8`` uses its integer kernel for
every batch size, so a row's result never depends on the batch it shares. Without the kernels
(the op table says so: no compiler, no AVX2, another device, or ``kernels='torch'``) the same
arithmetic runs in plain torch: activations rounded the same way, then the blocked
dequantize-and-matmul path.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels.native import Kernels
from tandem.models.base import CausalLM
from tandem.models.bf16_rows import TiledBf16Weight
from tandem.models.context import BF16_ROWS, RowSplit


@dataclass(frozen=True)
class KernelRows:
    """Up to how many input rows a weight format's kernel beats dequantize + BLAS: ``layers`` for
    the layers' weights, ``large`` for a weight of at least ``LARGE_WEIGHT_ELEMENTS`` (the output
    head), which no cache holds and which BLAS also reads from memory at these row counts."""

    layers: int
    large: int


LARGE_WEIGHT_ELEMENTS = 1 << 26
# Where the int8 kernel stops beating dequantize + BLAS (benchmarks/int8_kernel.py,
# docs/performance.md).
INT8_ROWS = KernelRows(layers=32, large=128)
# Weights dequantized per BLAS call on the large-batch path (16 MiB in float32).
DEQUANT_ELEMENTS = 1 << 22
# Activation values sharing one scale in w8a8 (the kernel's QBLOCK).
QBLOCK = 32

Dequant = Callable[[int, int, "torch.Tensor | None"], torch.Tensor]
"""``dequant(n0, n1, buf)``: weight rows n0 .. n1 in float32, written into ``buf`` when given."""

_local = threading.local()


def _scratch(elements: int) -> torch.Tensor:
    """A float32 buffer reused across calls on this thread (grown when needed), so the prefill
    path does not allocate and fault in megabytes for every layer of every step."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < elements:
        buf = _local.buf = torch.empty(elements, dtype=torch.float32)
    return buf[:elements]


def use_kernel(rows: int, weight_elements: int, limits: KernelRows = INT8_ROWS) -> bool:
    if rows <= limits.layers:
        return True
    return weight_elements >= LARGE_WEIGHT_ELEMENTS and rows <= limits.large


def quantized_matmul(x2: torch.Tensor, n: int, kernel: Callable[[torch.Tensor], torch.Tensor] | None,
                     dequant: Dequant, limits: KernelRows | None) -> torch.Tensor:
    """``x2`` float32 [M, K] times a quantized weight [N, K] -> [M, N]. With a C ``kernel`` (None:
    plain torch, and then no ``limits``) and at most ``limits`` rows, the kernel; else blocks of whole weight rows,
    dequantized by ``dequant`` (into a reused float32 buffer when the kernels run, else by torch),
    each multiplied by BLAS into contiguous rows of the transposed result."""
    m, k = x2.shape
    if kernel is not None and use_kernel(m, n * k, limits):
        return kernel(x2)
    y_t = torch.empty(n, m, dtype=torch.float32, device=x2.device)
    step = max(1, DEQUANT_ELEMENTS // k)
    buf = _scratch(min(step, n) * k).view(-1, k) if kernel is not None else None
    for n0 in range(0, n, step):
        n1 = min(n, n0 + step)
        torch.mm(dequant(n0, n1, buf), x2.t(), out=y_t[n0:n1])
    return y_t.t()


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (int8 [N, K], float32 scale [N]), symmetric per row. Rows go in slices of
    about ``QUANTIZE_ELEMENTS`` values, so each float temporary stays in the cores' L2 instead of
    costing a fresh 670 MB for the default model's 262k-row head (on an AMD EPYC Zen 3, 2 cores:
    2.5 s whole, 0.4 s sliced); the arithmetic per row is unchanged, and so are the results."""
    w = weight.detach()
    n, k = w.shape
    q = torch.empty((n, k), dtype=torch.int8, device=w.device)
    scale = torch.empty(n, dtype=torch.float32, device=w.device)
    step = max(1, QUANTIZE_ELEMENTS // max(k, 1))
    for n0 in range(0, n, step):
        part = w[n0:n0 + step].float()
        s = torch.div(part.abs().amax(dim=1).clamp_min(1e-12), 127.0, out=scale[n0:n0 + step])
        q[n0:n0 + step] = torch.round(part / s[:, None]).clamp_(-127, 127)
    return q, scale


QUANTIZE_ELEMENTS = 1 << 16
"""Values per slice in ``quantize_rows``: 256 KiB of float32, half the smallest L2 seen (512 KiB a
core on the Zen 3; slices of 1 MiB there ran 2.5x slower than 256 KiB)."""


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] float32 rounded as the w8a8 kernel rounds it: per row, blocks of ``QBLOCK``
    values (the last one may be shorter) share the scale ``d = max|x| / 127``; each value becomes
    ``round_half_even(x * (1 / d)) * d``. Returns the rounded values in float32."""
    m, k = x.shape
    pad = -k % QBLOCK
    xb = F.pad(x, (0, pad)).view(m, -1, QBLOCK)
    d = xb.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv).clamp_(-127, 127)
    return (q * d).view(m, -1)[:, :k].contiguous()


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, w8a8: bool = False,
                kernels: Kernels | None = None) -> torch.Tensor:
    """``x`` [..., K] times int8 ``qweight`` [N, K] (per-row ``scale``) -> float32 [..., N];
    with ``w8a8``, ``x`` is first rounded to int8 per block (see ``quantize_activations``).
    ``kernels``: the C kernels to use (``OpTable.int8_kernels``; CPU tensors only), or None; with
    ``w8a8`` and kernels, ``qweight`` is in their layout (``Kernels.w8a8_weight``)."""
    n, k = qweight.shape if kernels is None or not w8a8 else kernels.w8a8_shape(qweight)
    if (w8a8 and kernels is not None and k % QBLOCK == 0 and x.dim() == 2 and x.dtype == torch.float32
            and x.is_contiguous()):
        return kernels.gemm_w8a8(x, qweight, scale)  # every layer's call in float32: no reshapes
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).float().contiguous()
    if w8a8:
        if kernels is not None and k % QBLOCK == 0:
            return kernels.gemm_w8a8(x2, qweight, scale).reshape(*lead, n)
        x2 = quantize_activations(x2)

    def dequant(n0: int, n1: int, buf: torch.Tensor | None) -> torch.Tensor:
        if buf is not None:
            return kernels.dequant_i8(qweight, scale, buf, n0, n1)
        return qweight[n0:n1].float() * scale[n0:n1, None]

    kernel = None if kernels is None else (lambda x2: kernels.gemm_i8(x2, qweight, scale))
    return quantized_matmul(x2, n, kernel, dequant, INT8_ROWS).reshape(*lead, n)


class QuantLinear(nn.Module):
    """What the quantized linear layers share: the bias, and the output in the input's dtype.
    Subclasses hold the weight and give ``matmul(x)`` (float32 [..., N]) and ``rows(ids)`` (the
    dequantized weight rows ``ids``, float32, for an embedding lookup from a tied table)."""

    def __init__(self, out_features: int, in_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        if self.bias is not None:
            y = y + self.bias
        return y if y.dtype == x.dtype else y.to(x.dtype)


class Int8Linear(QuantLinear):
    """Drop-in for ``nn.Linear`` with int8 weights; output in the input's dtype. ``w8a8`` also
    rounds the inputs to int8 (see the module docstring)."""

    def __init__(
        self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, w8a8: bool = False,
        kernels: Kernels | None = None,
    ) -> None:
        super().__init__(*qweight.shape, bias)
        self.w8a8 = w8a8
        self.kernels = kernels
        # w8a8 on the kernels: the weights in the layout their kernel reads (packed in groups of
        # 16 rows for AMX tiles or AVX-512 VNNI, else as they are); ``weight_rows`` gives them back as [N, K]
        self.register_buffer("qweight", kernels.w8a8_weight(qweight) if w8a8 and kernels is not None else qweight)
        self.register_buffer("scale", scale)
        self._bf16_weight: TiledBf16Weight | None = None  # w8a8's prompt rows, made at first use

    @classmethod
    def from_linear(cls, linear: nn.Linear, w8a8: bool = False, kernels: Kernels | None = None) -> "Int8Linear":
        return cls(*quantize_rows(linear.weight), linear.bias, w8a8, kernels)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        split = BF16_ROWS.get() if self.w8a8 else None
        if split is not None and x.dim() == 2:
            return self._split_rows(x, split)
        # straight from the buffer dict: Module.__getattr__ costs a microsecond a name, ~70 times a step
        buffers = self._buffers
        return int8_matmul(x, buffers["qweight"], buffers["scale"], self.w8a8, self.kernels)

    @property
    def packed(self) -> bool:
        """The weights are in the packed kernel's layout (``Kernels.w8a8_weight``)."""
        return self._buffers["qweight"].dim() == 4

    @property
    def fused_argmax(self) -> bool:
        """``argmax`` runs inside the product's kernel (packed, no bias)."""
        return self.packed and self.bias is None

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """int64 [M]: each row's index of the largest output (first on ties), the output itself
        never made: what the argmax kernel finds in ``self(x)``. Only where ``fused_argmax``."""
        return self.kernels.gemm_w8a8_argmax(x.float().contiguous(), self._buffers["qweight"], self._buffers["scale"])

    def weight_rows(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The int8 weight rows ``ids`` (all rows when None) as [len, K], whatever the layout."""
        q = self._buffers["qweight"]
        if self.packed:
            return self.kernels.w8a8_rows(q, ids)
        return q if ids is None else q[ids]

    def _bf16_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``bf16(x) @ q.T`` by oneDNN, ``q`` the int8 weights held exactly as bf16 integers
        (|q| <= 127 fits bf16's 8-bit mantissa), each output column then times its float32
        scale. A row's result depends on its own values only (``TiledBf16Weight``)."""
        q, scale = self._buffers["qweight"], self._buffers["scale"]
        if self._bf16_weight is None or self._bf16_weight.device != q.device:
            self._bf16_weight = TiledBf16Weight(self.weight_rows().to(torch.bfloat16))
        return self._bf16_weight(x, scale)

    def _split_rows(self, x: torch.Tensor, split: RowSplit) -> torch.Tensor:
        """The rows ``split.bf16`` through ``_bf16_rows``, the others through the w8a8 path."""
        if split.rest is None:
            return self._bf16_rows(x)
        q, scale = self._buffers["qweight"], self._buffers["scale"]
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        y.index_copy_(0, split.rest, int8_matmul(x.index_select(0, split.rest), q, scale, True, self.kernels))
        y.index_copy_(0, split.bf16, self._bf16_rows(x.index_select(0, split.bf16)))
        return y

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight_rows(ids).float() * self.scale[ids, None]

    def extra_repr(self) -> str:
        mode = ("w8a8, packed in groups of 16 rows" if self.packed else "w8a8") if self.w8a8 else "int8 weights"
        return f"in_features={self.in_features}, out_features={self.out_features}, {mode}"


class QuantEmbedding(nn.Module):
    """Embedding lookup from a quantized table shared with the tied output head: each lookup
    dequantizes only the rows it needs (``QuantLinear.rows``)."""

    def __init__(self, head: QuantLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self._head = [head]  # not a submodule: the head owns the buffers
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self._head[0].rows(ids).to(self.dtype)


def quantize_model(model: CausalLM,
                   make: Callable[[torch.Tensor, "torch.Tensor | None", str], QuantLinear]) -> CausalLM:
    """Replace every ``nn.Linear`` in place by ``make(weight, bias, name)``; with tied embeddings,
    the table becomes the output head ``make(table, None, "lm_head")`` and the embedding looks its
    rows up there (one quantized table for both). Returns ``model``."""
    for prefix, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                name = f"{prefix}.{child_name}" if prefix else child_name
                setattr(module, child_name, make(child.weight, child.bias, name))
    if model.lm_head is None:  # tied: an untied head was an nn.Linear, quantized above
        table = model.model.embed_tokens.weight
        model.lm_head = make(table, None, "lm_head")
        model.model.embed_tokens = QuantEmbedding(model.lm_head, table.dtype)
    return model


def quantize_model_int8(model: CausalLM, w8a8: bool = False) -> CausalLM:
    """Every linear layer and the tied table as int8 (``quantize_model``); ``w8a8``: every layer
    also rounds its inputs to int8. The matmuls use the C kernels when the model's op table says
    so. Returns ``model``."""
    kernels = model.ops.int8_kernels
    return quantize_model(model, lambda w, bias, name: Int8Linear(*quantize_rows(w), bias, w8a8, kernels))
