"""Whole forward passes of a model in each weight format, timed on this machine: the speed half
of ``--quantization auto`` (``tandem.models.auto_mode`` decides; this measures).

The model, its shape with random values (step time does not depend on them), is built in each
mode as loading builds it (its fused decode layers included, where the mode has them), and
``STEPS`` run on a model runner: a decode step of one sequence and one of 16 at a context of 256,
and a 256-token prompt chunk. Each mode keeps its least time per step over ``ROUNDS`` rounds
that take the modes in turn. Whole steps, not the linear layers alone, because a mode's other
kernels count too: on an AVX2 CPU (AMD EPYC Zen 3, 2026-12-02) timing the linears alone put int8
level with w8a8 (0.25 and 0.27 of unquantized), while w8a8's one-call decode layers made its
decode steps 1.3x faster than int8's.
"""

from __future__ import annotations

import torch

from tandem.core.step import KVLayout
from tandem.models.quantizers import finish
from tandem.models.registry import instantiate, randomize
from tandem.models.spec import ModelSpec
from tandem.ops.dispatch import OpTable
from tandem.runner.runner import ModelRunner
from tandem.runner.step_timing import blocks_needed, time_steps

CONTEXT = 256
STEPS = {"decode 1": [(CONTEXT, 1)], "decode 16": [(CONTEXT, 1)] * 16, "prompt 256": [(0, 256)]}
"""The timed steps: (start position, tokens) per sequence."""
ROUNDS = 3
"""Rounds of timing, the modes taken in turn in each (``StepTimer.__call__``)."""
EXTRA_ROUNDS = 4
"""At most this many rounds after the base ones, for the modes still in contention."""
BLOCK_SIZE = 16


def candidate(mode: str, spec: ModelSpec, dtype: torch.dtype, ops: OpTable) -> ModelRunner:
    """A model runner over ``spec``'s model with random values in ``mode``, running ``ops``
    (unquantized: activations in ``dtype``; quantized: in float32, as ``load_model`` builds them),
    its KV cache just large enough for ``STEPS``."""
    act = dtype if mode == "none" else torch.float32
    device = torch.device("cpu")
    positions = max(start + n for spans in STEPS.values() for start, n in spans)
    model = finish(randomize(instantiate(spec, positions, device, act, ops)), mode)
    layout = KVLayout(blocks_needed(KVLayout(1, BLOCK_SIZE), list(STEPS.values())), BLOCK_SIZE)
    return ModelRunner(model, layout, device, act)


def time_mode(runner: ModelRunner, first: bool) -> dict[str, float]:
    """Seconds of each of ``STEPS`` on ``runner``, one timed run each (``first``: after an untimed
    one, which pays the one-time costs)."""
    timed = time_steps(runner, runner.layout, list(STEPS.values()), repeats=1, warm=first)
    return {name: seconds for name, (_, seconds) in zip(STEPS, timed)}


class StepTimer:
    """Times ``spec``'s model in the modes it is called with (``tandem.models.auto_mode.ModeTimer``):
    quantized modes on ``ops`` (float32), the unquantized one in ``dtype`` on ``none_ops``."""

    steps = tuple(STEPS)
    facts = {"steps": STEPS, "rounds": ROUNDS, "extra_rounds": EXTRA_ROUNDS, "measure": "whole steps"}

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, ops: OpTable, none_ops: OpTable | None = None) -> None:
        self.spec, self.dtype, self.ops, self.none_ops = spec, dtype, ops, none_ops or ops

    def __call__(self, modes: list[str], undecided=None) -> dict[str, dict[str, float]]:
        """Each mode's times, the least of ``ROUNDS`` rounds that take the modes in turn
        (forwards, then backwards): on a shared machine a slow spell of a few seconds would
        otherwise land on one mode only and decide against it (seen: w8a8 timed slower than
        int8 in one pass, and int8 chosen). Then up to ``EXTRA_ROUNDS`` more, each over the
        modes ``undecided`` names from the least times so far, while it names any."""
        runners = {m: candidate(m, self.spec, self.dtype, self.none_ops if m == "none" else self.ops) for m in modes}
        best: dict[str, dict[str, float]] = {}
        todo, r = list(modes), 0
        while todo and r < ROUNDS + EXTRA_ROUNDS:
            for mode in todo if r % 2 == 0 else todo[::-1]:
                got = time_mode(runners[mode], first=r == 0)
                best[mode] = got if mode not in best else {k: min(v, got[k]) for k, v in best[mode].items()}
            r += 1
            if r >= ROUNDS:
                todo = undecided(best) if undecided is not None else []
        return best
