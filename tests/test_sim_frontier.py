"""benchmarks/sim_frontier.py: the default ITL target's frontier on the simulator, with measured
peers.py points beside it, and the line of a host slower than its start-up estimate."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from profiles import MEASURED

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "sim_frontier.py"


@pytest.fixture(scope="module")
def frontier():
    spec = importlib.util.spec_from_file_location("sim_frontier", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("sim_frontier", module)
    spec.loader.exec_module(module)
    return module


def peers_run(path: Path, factor: float, policy: str | None = None) -> Path:
    """A peers.py result directory with a tandem and a llama-server point at C=4 (and one at C=1)."""
    def level(c, ttft, itl):
        return {"concurrency": c, "summary": {"output_throughput": 50.0, "p50_ttft_ms": ttft / 2, "p99_ttft_ms": ttft,
                                             "p50_itl_ms": itl / 2, "p99_itl_ms": itl}}
    run = {"machine": {"date": "2026-12-07 10:00:00"}, "peers": [
        {"peer": "tandem", "status": "ok", "info": {"/config": {"engine": {
            "itl_target_factor": factor, **({"policy": policy} if policy else {})}}},
         "levels": [level(1, 100.0, 20.0), level(4, 900.0, 80.0)]},
        {"peer": "llama-server", "status": "ok", "info": {}, "levels": [level(4, 1200.0, 70.0)]},
        {"peer": "transformers", "status": "failed", "info": {}, "levels": []}]}
    path.mkdir(parents=True)
    (path / "peers.json").write_text(json.dumps(run))
    return path


def test_frontier_writes_each_line_and_the_measured_points(frontier, tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(MEASURED))
    measured = peers_run(tmp_path / "run", 2.5)
    out = tmp_path / "out"
    assert frontier.main(["--profile", str(profile), "--factors", "1.5,4", "--slowdowns", "1,1.5",
                          "--concurrency", "4", "--requests", "8", "--input-len", "400", "--output-len", "16",
                          "--max-num-seqs", "4", "--measured", str(measured), "--out", str(out)]) == 0
    result = json.loads((out / "sim_frontier.json").read_text())
    sim = {(p["slowdown"], p["itl_target_factor"]): p for p in result["simulated"]}
    assert set(sim) == {(1.0, 1.5), (1.0, 4.0), (1.5, 1.5), (1.5, 4.0)}
    assert all(p["completed"] == 8 for p in sim.values())
    # a tighter target holds ITL lower; steps slower than the estimate that priced T cost TTFT and throughput
    assert sim[(1.0, 1.5)]["p99_itl_ms"] < sim[(1.0, 4.0)]["p99_itl_ms"]
    for f in (1.5, 4.0):
        assert sim[(1.5, f)]["p99_ttft_ms"] > sim[(1.0, f)]["p99_ttft_ms"]
        assert sim[(1.5, f)]["output_throughput"] < sim[(1.0, f)]["output_throughput"]
    # the measured points at the same concurrency, tandem's labelled by its factor; failed peers left out
    assert [(p["peer"], p["itl_target_factor"], p["p99_ttft_ms"]) for p in result["measured"]] == [
        ("tandem", 2.5, 900.0), ("llama-server", None, 1200.0)]
    md = (out / "sim_frontier.md").read_text()
    assert "| 1.5 | 4 |" in md and "| tandem | 2.5 |" in md and "SIMULATED" in md
    assert (out / "sim_frontier.png").stat().st_size > 10_000


def test_other_policies_are_points_on_every_line(frontier, tmp_path):
    """``--policies``: each named policy is simulated once per line with its defaults; prefill-first
    prefills whole prompts while streams pause, so at this burst its first tokens come sooner than
    under the tightest factor, and its streams' longest gaps are longer."""
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(MEASURED))
    out = tmp_path / "out"
    measured = peers_run(tmp_path / "run", 3.5, policy="prefill-first")
    assert frontier.main(["--profile", str(profile), "--factors", "1.5", "--slowdowns", "1,1.5",
                          "--measured", str(measured), "--policies", "prefill-first,static", "--concurrency", "4", "--requests", "8",
                          "--input-len", "400", "--output-len", "16", "--max-num-seqs", "4", "--out", str(out)]) == 0
    sim = {(p["slowdown"], p["policy"], p["itl_target_factor"]): p
           for p in json.loads((out / "sim_frontier.json").read_text())["simulated"]}
    assert set(sim) == {(s, p, f) for s in (1.0, 1.5)
                        for p, f in (("chunked", 1.5), ("prefill-first", None), ("static", None))}
    assert all(p["completed"] == 8 for p in sim.values())
    tight, first = sim[(1.0, "chunked", 1.5)], sim[(1.0, "prefill-first", None)]
    assert first["p50_ttft_ms"] < tight["p50_ttft_ms"] and first["p99_itl_ms"] > tight["p99_itl_ms"]
    md = (out / "sim_frontier.md").read_text()
    assert "| 1 | prefill-first |" in md and "| 1.5 | static |" in md and "| 1 | 1.5 |" in md
    # a measured tandem point under another policy is named by it: its factor does not apply there
    assert "| tandem | prefill-first |" in md and "| tandem | 3.5 |" not in md


@pytest.mark.parametrize("argv, message", [
    (["--factors", "2,x"], "--factors: comma-separated numbers"),
    (["--factors", "0"], "--factors: each must be > 0"),
    (["--slowdowns", "-1"], "--slowdowns: each must be > 0"),
    (["--requests", "0"], "--requests: must be >= 1"),
    (["--policies", "prefill-first,fastest"], "--policies: each must be one of"),
    (["--policies", "chunked"], "--policies: each must be one of"),
    (["--measured", "/nonexistent"], "does not exist"),
    (["--profile", "/nonexistent.json"], "--profile:"),
])
def test_bad_arguments_name_the_field(frontier, tmp_path, argv, message):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(MEASURED))
    with pytest.raises(SystemExit, match=message):
        frontier.main(["--profile", str(profile), "--out", str(tmp_path / "o"), *argv])
