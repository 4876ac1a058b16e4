"""`tandem serve --replicas 2` as a user runs it: a local Ray instance started with the server,
requests answered through Ray Serve's HTTP proxy, and everything stopped on SIGINT (exit 0, no Ray
process left). Run alone with ``pytest -m ray``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray")
from tandem.bench.launch import free_port  # noqa: E402
from tiny_models import save_tiny  # noqa: E402

pytestmark = pytest.mark.ray


def _ray_daemons() -> set[int]:
    """PIDs of Ray's per-cluster daemons (the GCS server and raylets) running now, from /proc."""
    pids = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if b"raylet" in cmdline or b"gcs_server" in cmdline:
            pids.add(int(proc.name))
    return pids


def test_serve_replicas_starts_answers_and_stops(tmp_path):
    save_tiny("llama", tmp_path / "m")
    port = free_port()
    before = _ray_daemons()
    env = dict(os.environ)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "serve", "--model", str(tmp_path / "m"), "--replicas", "2",
         "--routing", "round-robin", "--port", str(port), "--dtype", "float32", "--threads", "2",
         "--peak-flops", "1e11", "--peak-memory-bandwidth", "1e10"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        deadline, lines = time.monotonic() + 180, []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "tandem serving with 2 replica(s)" in line:
                break
        assert any("tandem serving with 2 replica(s)" in x for x in lines), "".join(lines[-30:])
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            r = client.post("/v1/completions", json={"prompt": "w1 w2", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            assert client.get("/health").json()["replicas_alive"] == 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    deadline = time.monotonic() + 20
    while _ray_daemons() - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _ray_daemons() - before, "the server left Ray running"
