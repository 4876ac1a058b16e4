"""Replay a run's steps through the step-time model: how well it predicted each kind of step.

    .venv/bin/python benchmarks/step_model_replay.py --trace TRACE.json[.gz] --out docs/results/.../replay.json

TRACE is a server's ``--trace`` file (its step track and each request's chunk spans give every
step's exact shape and measured time, its ``otherData`` the start-up estimate); ``--prior``
overrides that estimate, or gives it for a trace that did not record it, as its log printed it
(``step-time prior: StepCost(...)``, or ``base=...,per_token=...``). Each step is
predicted before it is observed, as the engine does, by the online model with and without the
prior's anchors (``tandem.core.step_time.anchors``), and the mean |predicted − measured| /
measured is reported per kind of step: decodes only, prompt work only, and a prompt chunk beside
decodes. The engine's own prediction of each step (the trace's ``predicted_ms``) is reported too:
the replay reproduces it where the engine ran the same model. ``--window`` and ``--refit-every``
as the run's ``--step-model-window`` and ``--step-model-refit-every``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.core.step_time import TERMS, StepCost, StepTimeModel, features  # noqa: E402

KINDS = ("decode", "prompt", "mixed")


def parse_prior(text: str) -> StepCost:
    """``base=...,per_token=...`` (or the log's ``StepCost(base=..., ...)``) -> a StepCost; a term
    not named is 0."""
    pairs = dict(re.findall(r"(\w+)=([-+0-9.eE]+)", text))
    unknown = set(pairs) - {*TERMS, "knee"}
    if unknown or not set(TERMS) & set(pairs):
        raise SystemExit(f"--prior: expected {', '.join(TERMS)} (and knee) as name=value, got {text!r}")
    return StepCost(**{**dict.fromkeys(TERMS, 0.0), **{k: float(v) for k, v in pairs.items()}})  # unnamed: 0


def load_trace(path: Path) -> tuple[list[dict], StepCost | None]:
    """The trace's steps in order (step id, measured seconds, the engine's prediction (s or None),
    the chunks' (start, tokens)) and the start-up estimate it recorded, if any."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"]
    recorded = (data.get("otherData") or {}).get("step_prior")
    chunks: dict[int, list[tuple[int, int]]] = defaultdict(list)
    steps = {}
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") != "X" or "step" not in args:
            continue
        if e.get("tid") == 0 and "predicted_ms" in args:
            steps[args["step"]] = {"step": args["step"], "seconds": e["dur"] / 1e6, "error": args.get("error"),
                                   "engine_predicted": None if args["predicted_ms"] is None else args["predicted_ms"] / 1e3}
        elif "positions" in args:
            start, end = args["positions"]
            chunks[args["step"]].append((start, end - start))
    out = []
    for sid in sorted(steps):
        s = steps[sid]
        if s["error"] is None and chunks.get(sid) and s["seconds"] > 0:
            out.append({**s, "spans": chunks[sid]})
    return out, None if recorded is None else StepCost(**recorded)


def kind(spans: list[tuple[int, int]]) -> str:
    prompt = any(n > 1 for _, n in spans)
    decodes = any(n == 1 for _, n in spans)
    return "mixed" if prompt and decodes else "prompt" if prompt else "decode"


def replay(steps: list[dict], prior: StepCost, anchored: bool, window: int, refit_every: int) -> list[float]:
    """Each step's prediction made before it was observed."""
    model = StepTimeModel(prior, window, refit_every, anchored=anchored)
    predicted = []
    for s in steps:
        x = features(s["spans"])
        predicted.append(model.predict(x))
        model.observe(x, s["seconds"])
    return predicted


def errors(steps: list[dict], predicted: list[float | None]) -> dict[str, dict]:
    by_kind: dict[str, list[float]] = defaultdict(list)
    for s, p in zip(steps, predicted):
        if p is not None:
            by_kind[kind(s["spans"])].append((p - s["seconds"]) / s["seconds"])
    return {k: {"steps": len(v), "mean_abs_rel_error": sum(map(abs, v)) / len(v), "mean_rel_error": sum(v) / len(v)}
            for k in KINDS if (v := by_kind.get(k))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True, type=Path)
    ap.add_argument("--prior", help="the start-up estimate, as name=value pairs or the log's StepCost(...); "
                    "default: the one the trace recorded")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--refit-every", type=int, default=16)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    steps, recorded = load_trace(args.trace)
    prior = parse_prior(args.prior) if args.prior else recorded
    if prior is None:
        raise SystemExit(f"--prior: {args.trace} recorded no start-up estimate; give the one its log printed")
    if not steps:
        raise SystemExit(f"--trace: no steps with chunk spans in {args.trace}")
    rows = {"engine (the trace's predicted_ms)": errors(steps, [s["engine_predicted"] for s in steps])}
    for anchored in (False, True):
        rows["anchored" if anchored else "not anchored"] = errors(
            steps, replay(steps, prior, anchored, args.window, args.refit_every))
    print(f"{len(steps)} steps of {args.trace}; mean |predicted - measured| / measured (mean signed), steps")
    for name, row in rows.items():
        cells = ", ".join(f"{k} {v['mean_abs_rel_error']:.3f} ({v['mean_rel_error']:+.3f}, {v['steps']})"
                          for k, v in row.items())
        print(f"  {name}: {cells}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": "benchmarks/step_model_replay.py " + " ".join(sys.argv[1:] if argv is None else argv),
                                        "trace": str(args.trace), "prior": prior.__dict__, "window": args.window,
                                        "refit_every": args.refit_every, "errors": rows}, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
