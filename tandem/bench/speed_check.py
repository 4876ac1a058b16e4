"""How fast this machine runs now against when a measured profile was calibrated.

A shared or virtual machine's speed moves: on a 2-core VM the same 256-token prompt step has
timed 161 ms and 231 ms a quarter of an hour apart. A profile calibrated at one of those moments
prices every simulated step at that speed. A speed check times a few of the profile's designed
steps again (a prompt chunk, a decode batch, one long-context decode: seconds, where a
calibration takes minutes) and compares them with the times the same check gave right after
the profile's calibration (``speed_probe_ms``; the calibration's own times of those steps, taken
amid forty other shapes, differ from a check's: the prompt step by about 14% in one run). It
gives their ratio (the geometric mean over the steps; above 1: slower now) and two of its parts:
the prompt step's ratio and the decode steps'. The two drift apart on a shared
VM (around one run of the accuracy benchmark the prompt step ran at 1.19x its reference and the
decode steps at 0.98x, around another at 1.04x and 1.25x), so a rescaled profile multiplies the compute terms a prompt step is made of (per token,
per attention pair, once per prompt step) by the first, and the rest (the step's base, per sequence, per KV position
read: a decode step) by the second, in the forward pass and the per-step overhead alike. It
records the check (``speed_check``) beside its calibration.

`tandem calibrate --rescale PROFILE` writes a rescaled profile; ``benchmarks/sim_accuracy.py``
checks the speed beside every real run it compares the simulator with.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from typing import Any

from tandem.runner.step_timing import blocks_needed, time_steps
from tandem.core.step import KVLayout
from tandem.core.step_time import TERMS, StepCost, features
from tandem.sim.design import Spans, compact

PROBE: dict[str, Spans] = {
    "prefill 256": [(0, 256)],
    "decode x16 at 128": [(128, 1)] * 16,
    "decode x1 at 1024": [(1024, 1)],
}
"""The designed steps a speed check times (each is in every calibration's design)."""

PREFILL_STEPS = ("prefill 256",)
"""The probe steps whose time is a prompt chunk's compute; the others are decode steps."""
PREFILL_TERMS = ("per_token", "per_pair", "per_prompt_step")
PROBE_REPEATS = 3


def recorded(profile: dict) -> dict[str, float]:
    """Seconds of each probe step at calibration: the speed check the calibration ran right after
    its designed steps (``speed_probe_ms``: the same procedure as every later check, so the two
    compare like with like), else the designed step's own time, else (a profile written by hand)
    its fitted forward pass."""
    probe = {k: ms / 1000 for k, ms in (profile.get("speed_probe_ms") or {}).items()}
    timed = {json.dumps(t["spans"]): t["seconds"] for t in (profile.get("fit") or {}).get("timed", [])}
    forward = StepCost(**profile["forward"])
    return {name: probe.get(name) or timed.get(json.dumps(compact(spans))) or forward.predict(features(spans))
            for name, spans in PROBE.items()}


def reference(loaded, block_size: int, checks: int = 3) -> dict[str, float]:
    """Milliseconds of each probe step, the median of ``checks`` speed checks: what a calibration
    records as ``speed_probe_ms``."""
    runs = [measure(loaded, block_size) for _ in range(checks)]
    return {k: 1000 * statistics.median(r[k] for r in runs) for k in runs[0]}


def check_matches(profile: dict, loaded, machine: str) -> None:
    """A profile can be rescaled only on the machine, model and mode it was calibrated for."""
    if profile.get("kind") != "measured":
        raise ValueError(f"rescale: only a measured profile can be rescaled, this one is {profile.get('kind')!r}")
    dtype = str(loaded.dtype).removeprefix("torch.")
    for name, here in (("machine", machine), ("model", loaded.name), ("dtype", dtype),
                       ("quantization", loaded.quantization)):
        if profile.get(name) != here:
            raise ValueError(f"rescale: the profile's {name} is {profile.get(name)!r}, this engine's is {here!r}; "
                             "calibrate a new profile instead")


def measure(loaded, block_size: int, seed: int = 0) -> dict[str, float]:
    """Seconds of each probe step on ``loaded`` now (median of ``PROBE_REPEATS`` after one untimed
    run); a step longer than the model's context is left out."""
    from tandem.runner.runner import ModelRunner

    probe = {k: v for k, v in PROBE.items() if all(s + n <= loaded.max_model_len for s, n in v)}
    if not probe:
        raise ValueError(f"speed check: the model's context ({loaded.max_model_len}) fits no probe step")
    layout = KVLayout(blocks_needed(KVLayout(1, block_size), list(probe.values())), block_size)
    runner = ModelRunner(loaded.model, layout, loaded.device, loaded.dtype, seed)
    timed = time_steps(runner, layout, list(probe.values()), PROBE_REPEATS)
    return {name: seconds for name, (_, seconds) in zip(probe, timed)}


def ratio(now: dict[str, float], then: dict[str, float], steps=None) -> float:
    """The geometric mean of now / then over ``steps`` (default: every step both timed); above 1:
    the machine is slower now."""
    logs = [math.log(now[k] / then[k]) for k in (steps or now)
            if now.get(k, 0) > 0 and then.get(k, 0) > 0]
    if not logs:
        raise ValueError("speed check: no probe step was timed")
    return math.exp(sum(logs) / len(logs))


def speed_check(profile: dict, now: dict[str, float]) -> dict[str, Any]:
    """The check's record: the overall ratio, the prompt step's and the decode steps' own."""
    then = recorded(profile)
    whole = ratio(now, then)
    prefill = [k for k in now if k in PREFILL_STEPS]
    decode = [k for k in now if k not in PREFILL_STEPS]
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "ratio": whole,
            "prefill_ratio": ratio(now, then, prefill) if prefill else whole,
            "decode_ratio": ratio(now, then, decode) if decode else whole,
            "steps_ms": {k: {"calibrated": 1000 * then[k], "now": 1000 * now[k]} for k in now}}


def factors(check: dict[str, Any] | None) -> dict[str, float]:
    """Per coefficient, the factor a check scales it by: the compute terms a prompt step is made of
    (``PREFILL_TERMS``) by the prompt step's ratio, the rest (weights read per step, per-sequence
    work, KV reads: what a decode step is made of) by the decode steps'."""
    if not check:
        return dict.fromkeys(TERMS, 1.0)
    whole = check["ratio"]
    return {t: check.get("prefill_ratio" if t in PREFILL_TERMS else "decode_ratio", whole) for t in TERMS}


def rescaled(profile: dict, check: dict[str, Any]) -> dict:
    """``profile`` with its forward pass and overhead at ``check``'s ratios to the calibration (a
    new dict; a profile rescaled before is rescaled from its calibration, not compounded)."""
    new, old = factors(check), factors(profile.get("speed_check"))
    out = dict(profile)
    for part in ("forward", "overhead"):
        out[part] = {k: v * new[k] / old[k] if k in new else v for k, v in profile[part].items()}  # the knee stays
    out["speed_check"] = check
    return out
