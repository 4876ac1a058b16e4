"""A server process for a benchmark or a test: start a command, collect its log, wait until its
health route answers, and stop it with a signal, recording how it exited and how long that took."""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time
from typing import Mapping, Sequence

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, cmd: Sequence[str], url: str, env: Mapping[str, str] | None = None,
                 startup_timeout: float = 600.0, health_path: str = "/health") -> None:
        self.cmd = list(cmd)
        self.url = url
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=None if env is None else dict(env))
        self.log: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()
        deadline = time.time() + startup_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited:\n" + "".join(self.log))
            try:
                if httpx.get(self.url + health_path, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.proc.kill()
        raise RuntimeError(f"server did not start within {startup_timeout:g} s:\n" + "".join(self.log))

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)

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
