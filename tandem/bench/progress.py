"""Progress of a run: a live bar on a terminal, plain lines (every 10%) in a log."""

from __future__ import annotations

import sys
import time


class RunProgress:
    def __init__(self, total: int, label: str) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.total = max(total, 1)
        self.label = label
        self.done = self.failed = 0
        self.live = Console().is_terminal
        self._next_line = 0.1
        self._start = time.monotonic()
        if self.live:
            self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[status]}"), TimeElapsedColumn())
            self.task = self.progress.add_task(label, total=total, status="")

    def __enter__(self) -> "RunProgress":
        if self.live:
            self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.live:
            self.progress.stop()

    def __call__(self, result) -> None:
        self.done += 1
        self.failed += not result.success
        status = f"failed {self.failed}" if self.failed else ""
        if self.live:
            self.progress.update(self.task, advance=1, status=status)
        elif self.done / self.total >= self._next_line or self.done == self.total:
            self._next_line += 0.1
            print(f"{self.label}: {self.done}/{self.total} requests done {status} "
                  f"({time.monotonic() - self._start:.0f} s)", file=sys.stderr, flush=True)
