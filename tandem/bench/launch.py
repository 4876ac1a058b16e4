"""A server process for a benchmark, a test or a launched trial: start a command in its own
process group, collect its log, wait until its health route answers, and stop the whole group with
a signal (then SIGKILL after a grace period), recording how it exited and how long that took."""

from __future__ import annotations

import os
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


def _has_live_member(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is more than a zombie (killed, its parent not yet
    reaping it: init reaps an orphan in its own time). Without /proc, any member counts."""
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


class ServerProcess:
    """``log_path``: write the server's output there (a chatty server, a long run) instead of
    keeping it in ``log``. ``fallback_path``: asked when ``health_path`` answers 404 (a server
    without a health route), e.g. ``/v1/models``."""

    def __init__(self, cmd: Sequence[str], url: str, env: Mapping[str, str] | None = None,
                 startup_timeout: float = 600.0, health_path: str = "/health", log_path: Path | None = None,
                 fallback_path: str | None = None) -> None:
        self.cmd = list(cmd)
        self.url = url
        self.log_path = log_path
        self._log: list[str] = []
        if log_path is None:
            out = subprocess.PIPE
        else:
            out = open(log_path, "wb")
        try:
            # its own session: a signal reaches every process the command starts, and a Ctrl-C
            # meant for the caller does not reach the server
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, text=log_path is None,
                                         env=None if env is None else dict(env), start_new_session=True)
        finally:
            if log_path is not None:
                out.close()
        if log_path is None:
            threading.Thread(target=self._drain, daemon=True).start()
        self.pgid = self.proc.pid
        try:
            self._wait_ready(startup_timeout, health_path, fallback_path)
        except BaseException:  # an interrupt while it starts must not leave it running either
            self._kill_group()
            self.proc.wait()
            raise

    def _wait_ready(self, startup_timeout: float, health_path: str, fallback_path: str | None) -> None:
        deadline = time.time() + startup_timeout
        path = health_path
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{Path(self.cmd[0]).name} exited ({self.proc.returncode}):\n{self._tail()}")
            try:
                code = httpx.get(self.url + path, timeout=1).status_code
                if code == 200:
                    return
                if code == 404 and fallback_path and path != fallback_path:
                    path = fallback_path
                    continue
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
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

    def _kill_group(self) -> None:
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def alive(self) -> bool:
        """Whether any process of the command's group is left."""
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # a process of that id belongs to someone else: not ours
            return False
        return _has_live_member(self.pgid)

    def stop(self, timeout: float = 60.0, sig: int = signal.SIGINT) -> tuple[int, float]:
        """(exit status, seconds it took); -9 if it had to be killed after ``timeout``. The whole
        process group gets ``sig``; whatever of it outlives the command's own process is killed."""
        start = time.monotonic()
        if self.proc.poll() is None:
            try:
                os.killpg(self.pgid, sig)
            except ProcessLookupError:
                pass
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill_group()
            self.proc.wait()
            code = -9
        self._kill_group()
        deadline = time.monotonic() + 5
        while self.alive() and time.monotonic() < deadline:  # a child reparented to init dies shortly
            time.sleep(0.02)
        return code, time.monotonic() - start
