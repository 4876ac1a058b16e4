"""``--quantization auto``: the fastest weight format on this machine among those accurate enough.

Two facts decide, one measured offline and one measured here:

- **Accuracy** (``quant_accuracy.json`` beside this file, written by
  ``benchmarks/quant_accuracy.py`` from teacher-forced runs against float32): a mode is eligible
  when its mean KL divergence and its top-1 agreement are within ``ACCURACY_BUDGET``. Accuracy
  was measured on the embedded default model, so only that model's quantized modes are eligible;
  for any other model ``auto`` keeps its weights as they are (pin ``--quantization`` to choose).
- **Speed**, on this machine: whole forward passes of the model in each eligible mode (a decode
  step of one sequence, one of 16, a prompt chunk), timed by a ``ModeTimer``
  (``tandem.runner.mode_timing.StepTimer``, which says how). The mode with the lowest geometric
  mean of its step times relative to unquantized wins. Modes that come within ``CLOSE`` of the
  best are timed again (``undecided``), since the choice is kept: on a shared machine a few
  busy seconds once made two modes 1.2x apart look level. The result is cached per machine, kernel
  variant, torch version, thread count, model shape and timing design, so later starts reuse it.

Quantized modes run float32 activations (the int8 kernels take float32 inputs), so when
``--dtype auto`` meets a quantized choice the activations are float32.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import torch

from tandem.kernels.cpu_features import cpu_info
from tandem.models.spec import ModelSpec
from tandem.ops.dispatch import OpTable
from tandem.startup import one_time


ACCURACY_FILE = Path(__file__).with_name("quant_accuracy.json")


@dataclass(frozen=True)
class AccuracyBudget:
    max_mean_kl: float = 0.01
    """Mean KL(float32 || mode) over predicted tokens, nats per token."""
    min_top1: float = 0.94
    """Share of positions whose most likely next token is float32's."""


ACCURACY_BUDGET = AccuracyBudget()
QUANTIZED = ("int8", "w8a8", "int4")
"""The quantized modes auto may pick (each needs an entry in the accuracy file)."""
CLOSE = 0.1
"""Modes whose scores are within this share of the best one's are ``undecided``: timed again."""


def scores(seconds: dict[str, dict[str, float]]) -> dict[str, float]:
    """Mode -> the geometric mean over steps of its time relative to unquantized ('none')."""
    base = seconds["none"]
    return {m: math.exp(sum(math.log(s[r] / base[r]) for r in s) / len(s)) for m, s in seconds.items()}


def undecided(seconds: dict[str, dict[str, float]]) -> list[str]:
    """The modes within ``CLOSE`` of the best score when there are two or more, else none."""
    score = scores(seconds)
    best = min(score.values())
    close = [m for m, v in score.items() if v <= best * (1.0 + CLOSE)]
    return close if len(close) > 1 else []


class ModeTimer(Protocol):
    """Measures the modes ``auto`` compares (``tandem.runner.mode_timing.StepTimer``)."""

    steps: tuple[str, ...]
    """The timed steps' names, in the reason."""
    facts: dict
    """What the timings depend on besides the machine and the model (part of the cache key)."""

    def __call__(self, modes: list[str],
                 undecided: Callable[[dict[str, dict[str, float]]], list[str]] | None = None
                 ) -> dict[str, dict[str, float]]:
        """Mode -> step -> seconds (the least over its rounds); after the base rounds, ``undecided``
        names, from the times so far, the modes to time in another round (none: stop)."""


@dataclass
class AutoChoice:
    quantization: str
    reason: str
    eligible: dict[str, str] = field(default_factory=dict)
    """Mode -> why it was (not) a candidate."""
    seconds: dict[str, dict[str, float]] = field(default_factory=dict)
    """Mode -> step (``STEPS``) -> seconds, as measured."""
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


def _cache_key(spec: ModelSpec, dtype: torch.dtype, ops: OpTable, modes: list[str], timer: ModeTimer) -> str:
    facts = {
        "cpu": cpu_info().describe(), "ops": ops.describe(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "dtype": str(dtype), "modes": modes,
        "spec": repr(spec), "timing": timer.facts,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def choose_quantization(spec: ModelSpec, device: torch.device, dtype: torch.dtype, ops: OpTable,
                        model_file: str | None, cache_dir: Path | None, timer: ModeTimer,
                        accuracy_file: Path = ACCURACY_FILE) -> AutoChoice:
    """The mode ``auto`` resolves to for this model on this machine (see the module docstring);
    ``ops``, the float32 op table the quantized modes run, is part of the cache key."""
    if device.type != "cpu":
        return AutoChoice("none", f"the quantized modes run on the CPU only, not on {device.type}")
    eligible = eligible_modes(model_file, accuracy_file)
    modes = ["none", *(m for m, why in eligible.items() if not why)]
    if len(modes) == 1:
        return AutoChoice("none", "no quantized mode is eligible: " + "; ".join(
            f"{m}: {why}" for m, why in eligible.items()), eligible)
    path = cache_dir / "auto_mode" / f"{_cache_key(spec, dtype, ops, modes, timer)}.json" if cache_dir else None
    if path is not None and path.is_file():
        try:
            choice = AutoChoice(**json.loads(path.read_text()))
            choice.cached = True
            return choice
        except (ValueError, TypeError):
            pass  # unreadable: measure again
    with one_time(f"quantization auto: timing {', '.join(modes)} on this machine",
                  "once: the choice is cached" + (f" in {path.parent}" if path is not None else "")) as took:
        seconds = timer(modes, undecided)
    score = scores(seconds)
    best = min(score, key=score.get)
    reason = (f"fastest of {', '.join(modes)} on this machine (step time relative to unquantized, geometric "
              f"mean over {', '.join(timer.steps)}: " + ", ".join(f"{m} {score[m]:.2f}" for m in modes)
              + f"; measured in {took.seconds:.1f} s)")
    choice = AutoChoice(best, reason, eligible, seconds)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(choice.to_dict(), indent=1))
    return choice
