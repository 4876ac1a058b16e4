"""Model FLOPs utilization and memory-bandwidth utilization of engine steps.

A step's work is estimated from the model's shape and the step's chunks:

* FLOPs: 2 x (matmul weights of the decoder layers) per token, 2 x (output layer) per sampled
  row, and attention's 4 x heads x head_dim per (query, visible key) pair.
* Bytes: every matmul weight is read once per step, the output layer once if anything is
  sampled, plus the keys and values each query row reads from the KV cache.

Both are divided by the step's duration and by the machine's *measured* peaks (``measure_peaks``,
or values given on the command line), so 100% means the step ran at the best rate this machine
showed for that resource.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable

from tandem.models.spec import ModelSpec


@dataclass(frozen=True)
class Peaks:
    flops_per_s: float
    bytes_per_s: float
    measured: bool


@dataclass(frozen=True)
class ModelCost:
    layer_params: int  # matmul weights of all decoder layers
    head_params: int  # the output layer (vocab x hidden)
    attn_flops_per_pair: int  # per (query token, visible key) pair, all layers
    kv_bytes_per_token: int  # keys + values of one token, all layers
    weight_bytes: float  # bytes of one matmul parameter (1 with int8 weights, 0.5625 with int4)

    @classmethod
    def from_spec(cls, spec: ModelSpec, dtype_bytes: int, weight_bytes: float | None = None) -> "ModelCost":
        h, kvh, d = spec.hidden_size, spec.num_kv_heads, spec.head_dim
        per_layer = h * spec.num_heads * d * 2 + h * kvh * d * 2 + 3 * h * spec.intermediate_size
        return cls(
            layer_params=per_layer * spec.num_layers,
            head_params=spec.vocab_size * h,
            attn_flops_per_pair=4 * spec.num_heads * d * spec.num_layers,
            kv_bytes_per_token=2 * kvh * d * spec.num_layers * dtype_bytes,
            weight_bytes=dtype_bytes if weight_bytes is None else weight_bytes,
        )

    def step(self, chunks: Iterable[tuple[int, int]], num_sampled: int, window: int | None = None) -> tuple[float, float]:
        """``chunks``: (start position, tokens) per sequence -> (FLOPs, bytes) of the step."""
        tokens = 0
        pairs = 0
        kv_read = 0
        for start, n in chunks:
            tokens += n
            end = start + n
            # sum over the chunk's queries of the keys each one sees (causal)
            pairs += n * start + n * (n + 1) // 2
            kv_read += end
        flops = 2.0 * self.layer_params * tokens + 2.0 * self.head_params * num_sampled + self.attn_flops_per_pair * pairs
        weights = self.layer_params + (self.head_params if num_sampled else 0)
        nbytes = weights * self.weight_bytes + kv_read * self.kv_bytes_per_token
        return flops, float(nbytes)


def measure_peaks(device: str = "cpu", dtype_name: str = "float32", seconds: float = 0.6,
                  w8a8_kernels=None, bf16_prompts: bool = False) -> Peaks:
    """Best observed matmul FLOP/s (in the engine's dtype) and memory read bandwidth.

    ``w8a8_kernels``: the native kernels when the weights run as w8a8; the compute peak is then
    their integer matmul's (activations rounded to int8, int32 products), which outruns a float32
    matmul several times, so utilization against the float32 peak would read above 100%.
    ``bf16_prompts``: w8a8's prompt rows run bf16 matmuls (``OpTable.w8a8_prompt_bf16_tokens``):
    the peak is then the faster of the integer kernel's and bf16's."""
    import torch

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    dev = torch.device(device)

    n = 1024 if dev.type == "cpu" else 8192
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    best_flops = 0.0
    if w8a8_kernels is not None:
        from tandem.models.quant import quantize_rows

        qweight, scale = quantize_rows(b)
        qweight = w8a8_kernels.w8a8_weight(qweight)  # the layout its kernel reads

        def matmul() -> None:
            w8a8_kernels.gemm_w8a8(a, qweight, scale)
    else:
        def matmul() -> None:
            torch.mm(a, b)
    matmuls = [matmul]
    if w8a8_kernels is not None and bf16_prompts:
        a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
        matmuls.append(lambda: torch.mm(a16, b16))
    # the time allowed starts after the set-up (quantizing the weight), and every matmul runs once
    deadline = time.perf_counter() + seconds / 2
    while best_flops == 0.0 or time.perf_counter() < deadline:
        for fn in matmuls:
            _sync(dev)
            t = time.perf_counter()
            fn()
            _sync(dev)
            best_flops = max(best_flops, 2 * n**3 / (time.perf_counter() - t))
    return Peaks(best_flops, measure_bandwidth(device, seconds / 2), measured=True)


def measure_bandwidth(device: str = "cpu", seconds: float = 0.3) -> float:
    """Best observed memory read bandwidth (bytes/s) over ``seconds``: a sum over a tensor larger
    than any last-level cache, so it streams from memory."""
    import torch

    dev = torch.device(device)
    big = torch.ones(64 << 20 if dev.type == "cpu" else 1 << 30, dtype=torch.float32, device=dev)
    best_bw = 0.0
    deadline = time.perf_counter() + seconds
    while best_bw == 0.0 or time.perf_counter() < deadline:
        _sync(dev)
        t = time.perf_counter()
        big.sum()
        _sync(dev)
        best_bw = max(best_bw, big.numel() * 4 / (time.perf_counter() - t))
    return best_bw


def _sync(dev) -> None:
    """Wait for the device's queued work (a no-op on the CPU), so a timing covers it."""
    if dev.type == "cuda":
        import torch

        torch.cuda.synchronize()
