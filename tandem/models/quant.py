"""Int8 weights: every linear layer and the (tied) embedding table stored as int8.

Each output row ``n`` keeps one float32 scale, ``max|w[n, :]| / 127``, and its weights rounded to
the nearest multiple of it (symmetric, per channel). Two modes:

- ``int8`` (weight-only): activations stay in float32; inputs are multiplied by the widened int8
  weights, so the only error is the weights' rounding.
- ``w8a8``: each input row is also quantized at run time, one scale per block of ``QBLOCK``
  values (``max|x| / 127``, rounded half to even), and the kernel sums int8 products exactly in
  integers: twice float32's multiply-adds per instruction where the step is bound by arithmetic
  (prefill, large decode batches), at the cost of the activations' rounding.

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

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels.native import Kernels
from tandem.models.base import CausalLM

# When the int8 kernel beats dequantize + BLAS (benchmarks/int8_kernel.py, docs/performance.md):
# up to about 32 rows for the layers' weights, and up to 128 rows for a weight as large as the
# output head, which no cache holds and which BLAS also reads from memory at these row counts.
KERNEL_MAX_ROWS = 32
LARGE_WEIGHT_ELEMENTS = 1 << 26
LARGE_WEIGHT_MAX_ROWS = 128
# Weights dequantized per BLAS call on the large-batch path (16 MiB in float32).
DEQUANT_ELEMENTS = 1 << 22
# Activation values sharing one scale in w8a8 (the kernel's QBLOCK).
QBLOCK = 32


_local = threading.local()


def _scratch(elements: int) -> torch.Tensor:
    """A float32 buffer reused across calls on this thread (grown when needed), so the prefill
    path does not allocate and fault in megabytes for every layer of every step."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < elements:
        buf = _local.buf = torch.empty(elements, dtype=torch.float32)
    return buf[:elements]


def use_kernel(rows: int, weight_elements: int) -> bool:
    if rows <= KERNEL_MAX_ROWS:
        return True
    return weight_elements >= LARGE_WEIGHT_ELEMENTS and rows <= LARGE_WEIGHT_MAX_ROWS


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (int8 [N, K], float32 scale [N]), symmetric per row."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


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
    ``kernels``: the C kernels to use (``OpTable.int8_kernels``; CPU tensors only), or None."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).float().contiguous()
    n, k = qweight.shape
    native_ok = kernels is not None
    if w8a8:
        if native_ok and k % QBLOCK == 0:
            return kernels.gemm_w8a8(x2, qweight, scale).reshape(*lead, n)
        x2 = quantize_activations(x2)
    if native_ok and use_kernel(x2.shape[0], n * k):
        return kernels.gemm_i8(x2, qweight, scale).reshape(*lead, n)
    # Blocks of whole weight rows, written to contiguous rows of the transposed result.
    y_t = torch.empty(n, x2.shape[0], dtype=torch.float32, device=x2.device)
    step = max(1, DEQUANT_ELEMENTS // k)
    buf = _scratch(min(step, n) * k).view(-1, k) if native_ok else None
    for n0 in range(0, n, step):
        n1 = min(n, n0 + step)
        if native_ok:
            w = kernels.dequant_i8(qweight, scale, buf, n0, n1)
        else:
            w = qweight[n0:n1].float() * scale[n0:n1, None]
        torch.mm(w, x2.t(), out=y_t[n0:n1])
    return y_t.t().reshape(*lead, n)


class Int8Linear(nn.Module):
    """Drop-in for ``nn.Linear`` with int8 weights; output in the input's dtype. ``w8a8`` also
    rounds the inputs to int8 (see the module docstring)."""

    def __init__(
        self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, w8a8: bool = False,
        kernels: Kernels | None = None,
    ) -> None:
        super().__init__()
        self.w8a8 = w8a8
        self.kernels = kernels
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.out_features, self.in_features = qweight.shape

    @classmethod
    def from_linear(cls, linear: nn.Linear, w8a8: bool = False, kernels: Kernels | None = None) -> "Int8Linear":
        return cls(*quantize_rows(linear.weight), linear.bias, w8a8, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = int8_matmul(x, self.qweight, self.scale, self.w8a8, self.kernels)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        mode = "w8a8" if self.w8a8 else "int8 weights"
        return f"in_features={self.in_features}, out_features={self.out_features}, {mode}"


class Int8Embedding(nn.Module):
    """Embedding lookup from an int8 table (shared with a tied ``Int8Linear`` output head)."""

    def __init__(self, head: Int8Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self._head = [head]  # not a submodule: the head owns the buffers
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        head = self._head[0]
        return (head.qweight[ids].float() * head.scale[ids, None]).to(self.dtype)


def quantize_model_int8(model: CausalLM, w8a8: bool = False) -> CausalLM:
    """Replace every ``nn.Linear`` in place; with tied embeddings, one int8 table then serves both
    the lookup and the output head. ``w8a8``: every layer also rounds its inputs to int8. The
    matmuls use the C kernels when the model's op table says so. Returns ``model``."""
    kernels = model.ops.int8_kernels
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, Int8Linear.from_linear(child, w8a8, kernels))
    if model.lm_head is None:  # tied: an untied head was an nn.Linear, quantized above
        table = model.model.embed_tokens.weight
        model.lm_head = Int8Linear(*quantize_rows(table), None, w8a8, kernels)
        model.model.embed_tokens = Int8Embedding(model.lm_head, table.dtype)
    return model
