"""compare and tune on launched servers: `tandem serve` (tiny model) as the external command, fake
servers that never become ready, exit at once or die mid-run (each a failed trial with its log and
no process left behind), and the engine presets' command lines."""

from __future__ import annotations

import json
import os
import shlex
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tandem.bench.compare import run_compare
from tandem.bench.config import TuneConfig
from tandem.bench.launched import LaunchedEvaluator
from tandem.bench.presets import PRESETS, render, tunable
from tandem.bench.tune_run import run_tune
from tandem.cli import main
from tandem.config import EngineConfig, SchedulerConfig
from tiny_models import save_tiny

PY = shlex.quote(sys.executable)
SERVE = (f"{PY} -m tandem.cli serve --model {{model}} --port {{port}} --dtype float32 --peak-flops 1e11 "
         "--peak-memory-bandwidth 1e10 --num-kv-blocks 512")
# four requests, short: a launch costs seconds, the run should not
WORKLOAD = {"dataset": "random", "num_prompts": 4, "seed": 0,
            "classes": [{"name": "chat", "share": 1.0, "input": {"dist": "fixed", "mean": 48},
                         "output": {"dist": "fixed", "mean": 8}}],
            "arrival": {"request_rate": "inf"}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tandem.model_files import default_model_path
    from tandem.weights.cache import converted_entry

    d = tmp_path_factory.mktemp("launched-model")
    save_tiny("llama", d)
    # the tiny model's word-level tokenizer cannot spell real text: cut prompts with Gemma's
    return str(d), str(converted_entry(default_model_path()))


@pytest.fixture
def workload(tmp_path):
    path = tmp_path / "load.json"
    path.write_text(json.dumps(WORKLOAD))
    return str(path)


def _gone(pid: int) -> bool:
    """No process of the group led by ``pid`` is left (zombies awaiting init's reaping aside)."""
    from tandem.bench.launch import _has_live_member

    deadline = time.time() + 5
    while time.time() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return True
        if not _has_live_member(pid):
            return True
        time.sleep(0.05)
    return False


# --- presets --------------------------------------------------------------------------------------------


def test_vllm_preset_renders_its_flags():
    argv = render("vllm serve meta-llama/Llama-3.1-8B", {"policy": "chunked", "max_num_batched_tokens": 512,
                                                          "max_num_seqs": 64, "long_prefill_token_threshold": 256,
                                                          "max_long_partial_prefills": 1}, 8123, None, PRESETS["vllm"])
    assert argv == ["vllm", "serve", "meta-llama/Llama-3.1-8B", "--port", "8123", "--enable-chunked-prefill",
                    "--max-num-batched-tokens", "512", "--max-num-seqs", "64", "--long-prefill-token-threshold",
                    "256"]  # one long partial prefill is vLLM's default, which 0.19 refuses to be given
    two = render("vllm serve m", {"max_long_partial_prefills": 2}, 1, None, PRESETS["vllm"])
    assert two[-4:] == ["--max-num-partial-prefills", "2", "--max-long-partial-prefills", "2"]


def test_sglang_and_llama_server_presets():
    sg = render("python -m sglang.launch_server --model-path {model}", {"policy": "chunked",
                "max_num_batched_tokens": 1024, "max_num_seqs": 32}, 30001, "Qwen/Qwen2.5-7B", PRESETS["sglang"])
    assert sg == ["python", "-m", "sglang.launch_server", "--model-path", "Qwen/Qwen2.5-7B", "--port", "30001",
                  "--enable-mixed-chunk", "--chunked-prefill-size", "1024", "--max-running-requests", "32",
                  "--enable-metrics"]
    ll = render("llama-server -m m.gguf -c 8192 --port {port}", {"max_num_batched_tokens": 256, "max_num_seqs": 4},
                9001, None, PRESETS["llama-server"])
    assert ll == ["llama-server", "-m", "m.gguf", "-c", "8192", "--port", "9001", "-b", "256", "-ub", "256",
                  "-np", "4", "--metrics"]
    assert tunable("llama-server -m m.gguf", PRESETS["llama-server"]) == {"policy", "max_num_batched_tokens",
                                                                           "max_num_seqs"}


def test_tandem_preset_and_placeholders():
    argv = render("tandem serve --model {model}", {"policy": "chunked", "target_itl_ms": 150.0,
                                                   "max_num_batched_tokens": 2048}, 8000, "m.gguf", PRESETS["tandem"])
    assert argv == ["tandem", "serve", "--model", "m.gguf", "--port", "8000", "--policy", "chunked",
                    "--max-num-batched-tokens", "2048", "--target-itl-ms", "150"]
    # a knob given as a placeholder is filled there, not added again; an unset one takes its default
    raw = render("srv --port={port} -b {max_num_batched_tokens} -n {max_num_seqs}", {"max_num_batched_tokens": 64},
                 5, None, None)
    assert raw == ["srv", "--port=5", "-b", "64", "-n", str(SchedulerConfig().max_num_seqs)]
    assert tunable("srv {port} {max_num_seqs}", None) == {"max_num_seqs"}


@pytest.mark.parametrize("command, overrides, engine, message", [
    ("vllm serve m", {"target_itl_ms": 100.0}, "vllm", "target_itl_ms: engine vllm has no such setting"),
    ("llama-server -m m", {"policy": "static"}, "llama-server", "policy: engine llama-server has no 'static'"),
    ("srv --port {port} {chunk}", {}, None, "unknown placeholder {chunk}"),
    ("srv --listen 80", {}, None, "needs a {port} placeholder"),
    ("srv {port} {model}", {}, None, "uses {model}, so --model is required"),
])
def test_bad_commands_are_refused_naming_the_field(command, overrides, engine, message):
    with pytest.raises(ValueError, match=message.replace("{", r"\{").replace("(", r"\(")):
        render(command, overrides, 1, None, PRESETS[engine] if engine else None)


# --- failing servers ------------------------------------------------------------------------------------

DIES_MID_RUN = textwrap.dedent("""
    import json, os, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    open(sys.argv[2], "w").write(str(os.getpid()))
    class H(BaseHTTPRequestHandler):
        def _json(self, obj):
            body = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def do_GET(self):
            self._json({"data": [{"id": "fake"}]} if self.path == "/v1/models" else {})
        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["content-length"])))
            if req.get("stream"):
                print("crashing on the first streamed request", flush=True)
                os._exit(7)
            self._json({"choices": [{"text": "hi"}]})
        def log_message(self, *args):
            pass
    HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def test_failing_servers_are_failed_trials_with_logs_and_no_process_left(tmp_path, workload):
    script = tmp_path / "dies.py"
    script.write_text(DIES_MID_RUN)
    pids = {name: tmp_path / f"{name}.pid" for name in ("never", "child", "exits", "dies")}
    servers = {
        "never": f"{PY} -c 'import os, sys, time; open(sys.argv[2], \"w\").write(str(os.getpid())); "
                 f"print(\"loading forever\", flush=True); time.sleep(600)' {{port}} {pids['never']}",
        # a shell whose background child must die with it: the whole process group is stopped
        "child": f"sh -c 'sleep 600 & echo $! > {pids['child']}; exec sleep 600' {{port}}",
        "exits": f"{PY} -c 'import os, sys; open(sys.argv[2], \"w\").write(str(os.getpid())); "
                 f"print(\"bad flag\"); sys.exit(2)' {{port}} {pids['exits']}",
        "dies": f"{PY} {script} {{port}} {pids['dies']}",
    }
    from tandem.bench.main import load_tokenizer

    ev = LaunchedEvaluator(tmp_path / "out", load_tokenizer(None), servers=servers, startup_timeout=3,
                           stop_timeout=2)
    out = run_compare(None, workload, [], EngineConfig(), str(tmp_path / "out"), evaluator=ev)
    by_name = {e.candidate.name: e for e in out["evaluations"]}
    assert "did not become healthy within 3 s" in by_name["never"].server["error"]
    assert "loading forever" in by_name["never"].server["log_tail"]
    assert "exited (2)" in by_name["exits"].server["error"] and "bad flag" in by_name["exits"].server["log_tail"]
    assert "exited (7) during the run" in by_name["dies"].server["error"]
    assert "crashing on the first streamed request" in by_name["dies"].server["log_tail"]
    for e in by_name.values():
        assert e.summary["completed"] == 0 and e.summary["failed"] == 4
        assert Path(e.server["log"]).is_file()
    for name, path in pids.items():
        assert _gone(int(path.read_text())), f"{name}: a process of the server is still running"
    md = (tmp_path / "out" / "compare.md").read_text()
    assert md.count("FAILED") == 4 and "crashing on the first streamed request" in md


def test_tune_survives_servers_that_never_start(tmp_path, workload):
    # every trial fails fast; tune still ends, re-measures its leaders (a new start each) and reports
    cmd = f"{PY} -c 'import sys; print(\"no GPU\"); sys.exit(1)' {{port}} {{max_num_batched_tokens}}"
    cfg = TuneConfig(workload=workload, slo_ttft_ms=1000, chunk_sizes="32,64,128", max_num_seqs_values="8",
                     max_trials=3, repeats=2, server_cmd=cmd, result_dir=str(tmp_path / "t"), startup_timeout=5)
    out = run_tune(cfg, EngineConfig())
    result = out["result"]
    assert not result.feasible and all(t.error for t in result.trials)
    assert len(result.trials) == 3 and sorted(len(t.runs) for t in result.trials) == [1, 2, 2]
    assert len(list((tmp_path / "t" / "logs").glob("*.log"))) == 5
    md = (tmp_path / "t" / "tune.md").read_text()
    assert "## Failed trials" in md and "no GPU" in md and "every trial's server failed" in md


# --- tandem serve as the launched command ---------------------------------------------------------------


def test_compare_two_launched_tandem_servers(tiny, tmp_path, workload, capsys):
    model, tok = tiny
    out = tmp_path / "cmp"
    code = main(["compare", "--workload", workload, "--model", model, "--tokenizer", tok, "--result-dir", str(out),
                 "--max-duration", "120", "--server", f"small={SERVE} --max-num-batched-tokens 16",
                 "--server", f"large={SERVE} --max-num-batched-tokens 256"])
    assert code == 0
    data = json.loads((out / "compare.json").read_text())
    assert data["launched"] and [c["config"] for c in data["configs"]] == ["small", "large"]
    for c in data["configs"]:
        assert c["completed"] == 4 and c["failed"] == 0 and c["server"]["error"] is None
        assert c["server"]["exit"] == 0  # SIGTERM: tandem serve drains and exits cleanly
        assert c["output_throughput"] > 0 and c["p99_ttft_ms"] > 0
        # /metrics was scraped during the run: the recomputed-tokens counter is known (None if not)
        assert c["recomputed_tokens"] == 0
    assert data["configs"][0]["server"]["command"].endswith("--max-num-batched-tokens 16")
    logs = sorted(p.name for p in (out / "logs").iterdir())
    assert logs == ["01-small.log", "02-large.log"]
    assert "tandem serving" in (out / "logs" / "01-small.log").read_text()
    md = (out / "compare.md").read_text()
    assert "## Servers" in md and "step_mix" not in md and (out / "itl_timelines.png").is_file()


def test_short_tune_of_a_launched_tandem_server(tiny, tmp_path, workload):
    model, tok = tiny
    cfg = TuneConfig(workload=workload, slo_ttft_ms=60_000, slo_itl_ms=60_000, chunk_sizes="16,256",
                     max_num_seqs_values="8", target_itl_fractions="", max_trials=2, repeats=1,
                     server_cmd=SERVE, engine="tandem", tokenizer=tok, result_dir=str(tmp_path / "tune"),
                     max_duration=120)
    out = run_tune(cfg, EngineConfig.from_kwargs(model=model))
    result = out["result"]
    assert result.feasible and len(result.trials) == 2
    assert {t.overrides["max_num_batched_tokens"] for t in result.trials} == {16, 256}
    best = result.best.overrides["max_num_batched_tokens"]
    # the recommendation is the launched command itself, with the winner's flags, on port 8000
    assert result.command.startswith(f"{sys.executable} -m tandem.cli serve --model {model}")
    assert " --port 8000 " in result.command
    assert result.command.endswith(f" --policy chunked --max-num-batched-tokens {best} --max-num-seqs 8")
    data = json.loads((tmp_path / "tune" / "tune.json").read_text())
    assert data["launched"] and data["engine"] == "tandem" and data["command"] == result.command
    assert all(len(t["server_logs"]) == 1 for t in data["trials"])
    assert (tmp_path / "tune" / "pareto.png").is_file()


def test_simulated_search_confirms_its_leaders_on_launched_servers(tmp_path, workload):
    # the search runs in the simulator over llama-server's knobs only; the leaders are launched
    cmd = f"{PY} -c 'import sys; print(\"out of memory\"); sys.exit(1)' {{port}}"
    cfg = TuneConfig(workload=workload, slo_ttft_ms=10_000, slo_itl_ms=100, chunk_sizes="64,256,1024",
                     max_num_seqs_values="8,32", max_trials=4, simulate="h100-sxm/llama-3.1-8b", confirm=2,
                     server_cmd=cmd, engine="llama-server", result_dir=str(tmp_path / "t"), startup_timeout=5)
    out = run_tune(cfg, EngineConfig())
    assert all("long_prefill_token_threshold" not in t.overrides and "target_itl_ms" not in t.overrides
               for t in out["result"].trials)
    rows = out["confirmed"]["rows"]
    assert len(rows) == 2 and all("exited (1)" in r["error"] for r in rows)
    assert not out["confirmed"]["best_meets_slos"]
    assert " -b " in out["confirmed"]["command"] and out["confirmed"]["command"].endswith("--metrics")
    assert len(list((tmp_path / "t" / "logs").glob("*.log"))) == 2


def test_compare_configs_render_through_a_preset(tmp_path):
    from tandem.bench.evaluate import Candidate
    from tandem.bench.launched import from_config
    from tandem.bench.config import CompareConfig

    ev = LaunchedEvaluator(tmp_path, None, command="vllm serve m", engine="vllm")
    cand = Candidate.parse("small:policy=chunked,max_num_batched_tokens=256,max_num_seqs=16")
    assert ev.argv(cand, 4321) == ["vllm", "serve", "m", "--port", "4321", "--enable-chunked-prefill",
                                   "--max-num-batched-tokens", "256", "--max-num-seqs", "16"]
    assert ev.candidates is None  # compare's --configs stay the configurations
    with pytest.raises(ValueError, match="not both"):
        from_config(CompareConfig(server=("a=srv {port}",), server_cmd="srv"), EngineConfig())
    with pytest.raises(ValueError, match="configs: not with --server"):
        from_config(CompareConfig(server=("a=srv {port}",), configs=("policy=static",)), EngineConfig())
    with pytest.raises(ValueError, match="engine: needs --server-cmd"):
        from_config(CompareConfig(engine="vllm"), EngineConfig())
    with pytest.raises(ValueError, match="expected NAME=COMMAND"):
        from_config(CompareConfig(server=("srv {port}",)), EngineConfig())


def test_replica_settings_reach_tandem_serve_and_nothing_else():
    argv = render("tandem serve", {"replicas": 2, "routing": "least-loaded", "routing_stats_period": 0.25}, 9000,
                  preset=PRESETS["tandem"])
    assert argv[-6:] == ["--replicas", "2", "--routing", "least-loaded", "--routing-stats-period", "0.25"]
    assert {"replicas", "routing"} <= tunable("tandem serve", PRESETS["tandem"])
    assert render("tandem serve --port {port} --replicas {replicas}", {}, 9000) == \
        ["tandem", "serve", "--port", "9000", "--replicas", "1"]
    with pytest.raises(ValueError, match="replicas: engine vllm has no such setting"):
        render("vllm serve m", {"replicas": 2}, 9000, preset=PRESETS["vllm"])
    with pytest.raises(ValueError, match="routing_values"):
        TuneConfig(routing_values="random", replicas_values="2").deployments()
