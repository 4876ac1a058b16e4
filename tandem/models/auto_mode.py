"""``--quantization auto``: the fastest weight format on this machine among those accurate enough.

Two facts decide, one measured offline and one measured here:

- **Accuracy** (``quant_accuracy.json`` beside this file, written by
  ``benchmarks/quant_accuracy.py`` from teacher-forced runs against float32): a mode is eligible
  when its mean KL divergence and its top-1 agreement are within ``ACCURACY_BUDGET``. Accuracy
  was measured on the embedded default model, so only that model's quantized modes are eligible;
  for any other model ``auto`` keeps its weights as they are (pin ``--quantization`` to choose).
- **Speed**, on this machine: the model's own linear layers (every distinct weight shape, counted
  as often as the model has it; values random, since step time does not depend on them) are timed
  in each eligible mode at a decode step's rows alone (1), a batched decode step's (16) and a
  prefill chunk's (256; the output layer runs for the sampled rows only), each mode's least time
  of three rounds that take the modes in turn (a slow spell of a shared machine then cannot land
  on one mode alone). The mode with the lowest geometric mean of its times relative to
  unquantized wins. The result is cached per
  machine, kernel variant, torch version, thread count and model shape, so later starts reuse it.

Quantized modes run float32 activations (the int8 kernels take float32 inputs), so when
``--dtype auto`` meets a quantized choice the activations are float32.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from tandem.kernels.cpu_features import cpu_info
from tandem.models.spec import ModelSpec
from tandem.ops.dispatch import OpTable

log = logging.getLogger("tandem.auto")

ACCURACY_FILE = Path(__file__).with_name("quant_accuracy.json")


@dataclass(frozen=True)
class AccuracyBudget:
    max_mean_kl: float = 0.01
    """Mean KL(float32 || mode) over predicted tokens, nats per token."""
    min_top1: float = 0.94
    """Share of positions whose most likely next token is float32's."""


ACCURACY_BUDGET = AccuracyBudget()
ROWS = (1, 16, 256)
"""Rows per linear: a lone decode step, a batched decode step, a prefill chunk."""
ROUNDS = 3
"""Rounds of timing, the modes taken in turn in each (``_measure``)."""
QUANTIZED = ("int8", "w8a8", "int4")
"""The quantized modes auto may pick (each needs an entry in the accuracy file)."""


@dataclass
class AutoChoice:
    quantization: str
    reason: str
    eligible: dict[str, str] = field(default_factory=dict)
    """Mode -> why it was (not) a candidate."""
    seconds: dict[str, dict[str, float]] = field(default_factory=dict)
    """Mode -> rows -> summed linear time (seconds), as measured."""
    cached: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def eligible_modes(model_file: str | None, accuracy_file: Path = ACCURACY_FILE,
                   budget: AccuracyBudget = ACCURACY_BUDGET) -> dict[str, str]:
    """Quantized mode -> '' when eligible for ``model_file`` (the GGUF file's name), else why not."""
    try:
        data = json.loads(accuracy_file.read_text())
    except (OSError, ValueError):
        return {m: f"no accuracy measurements ({accuracy_file.name} unreadable)" for m in QUANTIZED}
    out = {}
    for mode in QUANTIZED:
        m = data.get("modes", {}).get(mode)
        if model_file is None or model_file != data.get("model_file"):
            out[mode] = "accuracy measured on the default model only"
        elif m is None:
            out[mode] = "accuracy not measured"
        elif m["kl_mean"] > budget.max_mean_kl:
            out[mode] = f"mean KL {m['kl_mean']:.4f} nats > {budget.max_mean_kl}"
        elif m["top1_agreement"] < budget.min_top1:
            out[mode] = f"top-1 agreement {m['top1_agreement']:.1%} < {budget.min_top1:.0%}"
        else:
            out[mode] = ""
    return out


def linear_shapes(spec: ModelSpec) -> dict[tuple[int, int], int]:
    """(out, in) of every linear in one forward pass -> how many the model has; the output layer
    is (vocab, hidden)."""
    h, d = spec.hidden_size, spec.head_dim
    shapes: dict[tuple[int, int], int] = {}
    for shape in (((spec.num_heads + 2 * spec.num_kv_heads) * d, h), (h, spec.num_heads * d),
                  (2 * spec.intermediate_size, h), (h, spec.intermediate_size)):
        shapes[shape] = shapes.get(shape, 0) + spec.num_layers
    return shapes


def _best_of(fn, repeats: int = 3) -> float:
    fn()  # warm-up (page faults, kernel build)
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _mode_modules(mode: str, spec: ModelSpec, dtype: torch.dtype, ops: OpTable) -> dict:
    """One linear module (or function) per weight shape of the model, in ``mode``, random values."""
    from tandem.models.quant import Int8Linear
    from tandem.models.quant_int4 import INT4_GROUP, Int4Linear

    head = (spec.vocab_size, spec.hidden_size)
    modules = {}
    for (n, k) in (*linear_shapes(spec), head):
        if mode == "none":
            w = torch.empty(n, k, dtype=dtype).uniform_(-0.05, 0.05)
            modules[(n, k)] = lambda x, w=w: F.linear(x, w)
        elif mode == "int4":
            packed = torch.randint(0, 256, (n, -(-k // INT4_GROUP) * INT4_GROUP // 2), dtype=torch.uint8)
            scales = torch.full((n, -(-k // INT4_GROUP)), 1e-3, dtype=torch.float16)
            modules[(n, k)] = Int4Linear(packed, scales, k, None, kernels=ops.int4_kernels)
        else:
            q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
            lin = Int8Linear(q, torch.full((n,), 1e-3), None, w8a8=mode == "w8a8", kernels=ops.int8_kernels)
            modules[(n, k)] = lin
    return modules


def _time_mode(mode: str, modules: dict, spec: ModelSpec, dtype: torch.dtype) -> dict[str, float]:
    """Seconds of one pass over the model's linear layers in ``mode`` at each of ``ROWS``."""
    head = (spec.vocab_size, spec.hidden_size)
    layers = linear_shapes(spec)
    seconds = {}
    act = dtype if mode == "none" else torch.float32
    for rows in ROWS:
        total = 0.0
        for (n, k), count in layers.items():
            x = torch.randn(rows, k, dtype=act)
            total += count * _best_of(lambda: modules[(n, k)](x))
        sampled = min(rows, 16)  # a prefill chunk samples few rows: at most one per sequence
        x = torch.randn(sampled, head[1], dtype=act)
        total += _best_of(lambda: modules[head](x), repeats=2)
        seconds[str(rows)] = total
    return seconds


def _measure(modes: list[str], spec: ModelSpec, dtype: torch.dtype, ops: OpTable) -> dict[str, dict[str, float]]:
    """Each mode's times, the least of ``ROUNDS`` rounds that take the modes in turn (forwards,
    then backwards): on a shared machine a slow spell of a few seconds would otherwise land on one
    mode only and decide against it (seen: w8a8 timed slower than int8 in one pass, and int8
    chosen)."""
    modules = {mode: _mode_modules(mode, spec, dtype, ops) for mode in modes}
    best: dict[str, dict[str, float]] = {}
    for r in range(ROUNDS):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            got = _time_mode(mode, modules[mode], spec, dtype)
            best[mode] = got if mode not in best else {k: min(v, got[k]) for k, v in best[mode].items()}
    return best


def _cache_key(spec: ModelSpec, dtype: torch.dtype, ops: OpTable, modes: list[str]) -> str:
    facts = {
        "cpu": cpu_info().describe(), "ops": ops.describe(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "dtype": str(dtype), "modes": modes,
        "shapes": sorted(map(list, linear_shapes(spec))), "vocab": spec.vocab_size, "rows": ROWS,
        "rounds": ROUNDS,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def choose_quantization(spec: ModelSpec, device: torch.device, dtype: torch.dtype, ops: OpTable,
                        model_file: str | None, cache_dir: Path | None,
                        accuracy_file: Path = ACCURACY_FILE) -> AutoChoice:
    """The mode ``auto`` resolves to for this model on this machine (see the module docstring)."""
    if device.type != "cpu":
        return AutoChoice("none", f"the quantized modes run on the CPU only, not on {device.type}")
    eligible = eligible_modes(model_file, accuracy_file)
    modes = ["none", *(m for m, why in eligible.items() if not why)]
    if len(modes) == 1:
        return AutoChoice("none", "no quantized mode is eligible: " + "; ".join(
            f"{m}: {why}" for m, why in eligible.items()), eligible)
    path = cache_dir / "auto_mode" / f"{_cache_key(spec, dtype, ops, modes)}.json" if cache_dir else None
    if path is not None and path.is_file():
        try:
            choice = AutoChoice(**json.loads(path.read_text()))
            choice.cached = True
            return choice
        except (ValueError, TypeError):
            pass  # unreadable: measure again
    t0 = time.perf_counter()
    seconds = _measure(modes, spec, dtype, ops)
    base = seconds["none"]
    score = {m: math.exp(sum(math.log(s[r] / base[r]) for r in s) / len(s)) for m, s in seconds.items()}
    best = min(score, key=score.get)
    reason = (f"fastest of {', '.join(modes)} on this machine (time relative to unquantized, geometric mean "
              f"over {', '.join(map(str, ROWS))} rows: " + ", ".join(f"{m} {score[m]:.2f}" for m in modes)
              + f"; measured in {time.perf_counter() - t0:.1f} s)")
    choice = AutoChoice(best, reason, eligible, seconds)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(choice.to_dict(), indent=1))
    return choice
