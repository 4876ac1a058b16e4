"""`tandem tune --simulate`: the search ran in the simulator; the leading candidates are measured
on the real engine, each reported as predicted against measured, and the recommendation is the
best of the measured ones (a prediction picks candidates, a measurement picks the winner)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

from tandem.bench.tune import SLO, Trial, TuneResult, _label, is_feasible, rank, serve_command

COMPARED = (("output_throughput", "output tok/s"), ("p50_ttft_ms", "TTFT p50"), ("p99_ttft_ms", "TTFT p99"),
            ("p50_itl_ms", "ITL p50"), ("p99_itl_ms", "ITL p99"))


def _error(predicted, measured) -> float | None:
    if predicted is None or measured is None or not measured or any(map(math.isnan, (predicted, measured))):
        return None
    return (predicted - measured) / measured


def confirm(result: TuneResult, slo: SLO, measure: Callable[[dict[str, Any]], dict], top: int,
            base_command: str | Callable[[dict[str, Any]], str], log: Callable[[str], None] = lambda _: None) -> dict:
    """Measure the ``top`` best simulated trials for real; -> rows and the measured winner."""
    rows, measured = [], []
    for trial in result.trials[:top]:
        summary = measure(trial.overrides)
        real = Trial(trial.overrides, [summary])
        measured.append(real)
        predicted = {**trial.runs[0], **trial.summary}
        row = {"config": trial.overrides, "label": _label(trial.overrides), "meets_slos": is_feasible(real, slo),
               "error": real.error}
        for key, _ in COMPARED:
            row[key] = {"predicted": predicted.get(key), "measured": summary.get(key),
                        "error": _error(predicted.get(key), summary.get(key))}
        rows.append(row)
        log(f"confirmed {row['label']}: {summary['output_throughput']:.1f} tok/s measured, "
            f"{predicted['output_throughput']:.1f} predicted")
    best = max(measured, key=lambda t: rank(t, slo)) if measured else None
    return {"rows": rows, "best": best.overrides if best else None,
            "best_meets_slos": bool(best and is_feasible(best, slo)),
            "command": (base_command(best.overrides) if callable(base_command)
                        else serve_command(base_command, best.overrides)) if best else None}


def write_confirm(out: Path, confirmed: dict, profile: str) -> list[Path]:
    (out / "confirm.json").write_text(json.dumps({"profile": profile, **confirmed}, indent=1, default=str) + "\n")
    head = " | ".join(f"{name} sim / real (err)" for _, name in COMPARED)
    md = ["", "## Confirmed on the real engine", "",
          f"The search ran in the simulator ({profile}); the leaders were then measured on the real engine.", "",
          f"| configuration | {head} | meets SLOs (measured) |", "|---" * (len(COMPARED) + 2) + "|"]
    for r in confirmed["rows"]:
        cells = []
        for key, _ in COMPARED:
            c = r[key]
            err = f"{100 * c['error']:+.0f}%" if c["error"] is not None else "n/a"
            cells.append(f"{_fmt(c['predicted'])} / {_fmt(c['measured'])} ({err})")
        md.append(f"| {r['label']} | {' | '.join(cells)} | {'yes' if r['meets_slos'] else 'no'} |")
    if confirmed["command"]:
        verdict = "meets the SLOs" if confirmed["best_meets_slos"] else "is the nearest miss (none met the SLOs)"
        md += ["", f"Best measured, which {verdict}:", "", f"    {confirmed['command']}"]
    with (out / "tune.md").open("a") as f:
        f.write("\n".join(md) + "\n")
    return [out / "confirm.json"]


def _fmt(v) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:,.1f}"
