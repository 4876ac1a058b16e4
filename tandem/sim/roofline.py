"""The roofline cost of a step on a device that is not here: a model's shape (a ``config.json``,
no weights) and a device description (peak dense FLOP/s per dtype, memory bandwidth and size,
efficiency factors, a fixed per-step overhead).

``seconds = max(FLOPs / (peak x compute_efficiency), bytes / (bandwidth x memory_efficiency))
+ step_overhead_s + per_seq_overhead_s x sequences``, with FLOPs and bytes those MFU/MBU are
measured with (``tandem.utilization.ModelCost``: 2 x weights per token, attention per (query,
key) pair; weights read once per step, KV read per visible position). The max is the point:
a prompt chunk is compute-bound, a decode batch memory-bound, and one step holding both pays
for the larger only, which a sum of terms (the step-time model) cannot say.

The KV cache gets what the device's memory holds after the weights: ``memory_bytes x
kv_memory_fraction - weight bytes``. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.core.step import SchedulerOutput
from tandem.models.spec import ModelSpec
from tandem.sim.schema import mapping, number, number_map, text, validate
from tandem.utilization import ModelCost

DEVICE_SCHEMA = "tandem-sim-device/1"
DEVICE_FIELDS = mapping({
    "schema": (text((DEVICE_SCHEMA,)), False),
    "name": (text(), True),
    "source": (text(), False),
    "peak_flops_per_s": (number_map(), True),
    "memory_bytes_per_s": (number(0, strict=True), True),
    "memory_bytes": (number(0, strict=True), True),
    "compute_efficiency": (number(0, strict=True, maximum=1), True),
    "memory_efficiency": (number(0, strict=True, maximum=1), True),
    "step_overhead_s": (number(), True),
    "per_seq_overhead_s": (number(), False),
    "kv_memory_fraction": (number(0, strict=True, maximum=1), False),
})

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class Device:
    name: str
    peak_flops_per_s: dict[str, float]
    memory_bytes_per_s: float
    memory_bytes: float
    compute_efficiency: float
    memory_efficiency: float
    step_overhead_s: float
    per_seq_overhead_s: float = 0.0
    kv_memory_fraction: float = 0.9
    source: str = ""

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "device") -> "Device":
        validate(DEVICE_FIELDS, d, where)
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    def flops_per_s(self, dtype: str) -> float:
        if dtype not in self.peak_flops_per_s:
            raise ValueError(f"dtype: the device {self.name!r} gives no peak for {dtype!r} "
                             f"(it has {', '.join(self.peak_flops_per_s)})")
        return self.peak_flops_per_s[dtype]


def model_cost(spec: ModelSpec, dtype: str) -> ModelCost:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype: must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    return ModelCost.from_spec(spec, DTYPE_BYTES[dtype])


def weight_bytes(spec: ModelSpec, cost: ModelCost) -> float:
    """Every weight the device holds: the layers, the output layer and, when not tied, the
    embedding table (norms are too small to count)."""
    embeddings = 0 if spec.tie_word_embeddings else cost.head_params
    return (cost.layer_params + cost.head_params + embeddings) * cost.weight_bytes


def kv_blocks(device: Device, spec: ModelSpec, dtype: str, block_size: int) -> int:
    cost = model_cost(spec, dtype)
    free = device.memory_bytes * device.kv_memory_fraction - weight_bytes(spec, cost)
    blocks = int(free // (cost.kv_bytes_per_token * block_size))
    if blocks < 1:
        raise ValueError(f"device: {device.name!r} cannot hold the model's weights "
                         f"({weight_bytes(spec, cost) / 1e9:.1f} GB) and any KV cache")
    return blocks


class RooflineCost:
    def __init__(self, device: Device, spec: ModelSpec, dtype: str) -> None:
        self.device = device
        self.cost = model_cost(spec, dtype)
        self.flops_per_s = device.flops_per_s(dtype) * device.compute_efficiency
        self.bytes_per_s = device.memory_bytes_per_s * device.memory_efficiency

    def of_spans(self, spans: list[tuple[int, int]], num_sampled: int | None = None) -> float:
        if not spans:
            return 0.0
        # a designed step samples every chunk (as decodes and last prompt chunks do)
        flops, nbytes = self.cost.step(spans, len(spans) if num_sampled is None else num_sampled)
        d = self.device
        return max(flops / self.flops_per_s, nbytes / self.bytes_per_s) + d.step_overhead_s + \
            d.per_seq_overhead_s * len(spans)

    def seconds(self, out: SchedulerOutput) -> float:
        return self.of_spans([(c.start, c.num_tokens) for c in out.chunks], sum(1 for c in out.chunks if c.samples))
