"""A server process for a benchmark or a test: start a command, collect its log, wait until its
health route answers, and stop it with a signal, recording how it exited and how long that took."""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Mapping, Sequence

import httpx

LOG_TAIL_LINES = 30


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """``log_path``: write the server's output there (a chatty server, a long run) instead of
    keeping it in ``log``."""

    def __init__(self, cmd: Sequence[str], url: str, env: Mapping[str, str] | None = None,
                 startup_timeout: float = 600.0, health_path: str = "/health", log_path: Path | None = None) -> None:
        self.cmd = list(cmd)
        self.url = url
        self.log_path = log_path
        self._log: list[str] = []
        if log_path is None:
            out = subprocess.PIPE
        else:
            out = open(log_path, "wb")
        try:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, text=log_path is None,
                                         env=None if env is None else dict(env))
        finally:
            if log_path is not None:
                out.close()
        if log_path is None:
            threading.Thread(target=self._drain, daemon=True).start()
        deadline = time.time() + startup_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{Path(self.cmd[0]).name} exited ({self.proc.returncode}):\n{self._tail()}")
            try:
                if httpx.get(self.url + health_path, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.proc.kill()
        self.proc.wait()
        raise RuntimeError(f"{Path(self.cmd[0]).name} did not become healthy within {startup_timeout:g} s:\n"
                           f"{self._tail()}")

    @property
    def log(self) -> list[str]:
        """The output so far, as lines."""
        if self.log_path is None:
            return self._log
        return self.log_path.read_text(errors="replace").splitlines(keepends=True)

    def _tail(self) -> str:
        return "".join(self.log[-LOG_TAIL_LINES:]) or "(empty log)"

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self._log.append(line)

    def stop(self, timeout: float = 60.0, sig: int = signal.SIGINT) -> tuple[int, float]:
        """(exit status, seconds it took); -9 if it had to be killed after ``timeout``."""
        start = time.monotonic()
        self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            code = -9
        return code, time.monotonic() - start
