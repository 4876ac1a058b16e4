"""Per-user series for /metrics with a bounded label set: the ``top`` users by tokens (prompt +
generation) get a series each, everyone else is summed as ``user="other"``.

The split is made when /metrics is read, so a user's series appears once it enters the top and
leaves when it drops out (its tokens move to ``other``, which then reads as a counter reset
to ``rate()``). The totals kept are bounded too: beyond ``tracked`` users the smaller half is
folded into ``other`` for good. The anonymous user ("") is labelled ``anonymous``.
"""

from __future__ import annotations

import threading
from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

OTHER = "other"
ANONYMOUS = "anonymous"
_FIELDS = ("requests", "prompt_tokens", "generation_tokens")


class UserMetrics:
    """A prometheus_client collector; ``observe`` runs in the engine loop, ``collect`` in a reader."""

    def __init__(self, model_name: str, top: int, tracked: int | None = None) -> None:
        self.model_name = model_name
        self.top = top
        self.tracked = tracked if tracked is not None else max(1000, 10 * top)
        self._totals: dict[str, list[int]] = {}  # user -> [requests, prompt tokens, generation tokens]
        self._folded = [0, 0, 0]
        self._counters: dict[str, float] = {}  # VTC counters, the last snapshot; empty without vtc
        self._lock = threading.Lock()

    def observe(self, user: str, prompt_tokens: int, generation_tokens: int) -> None:
        with self._lock:
            t = self._totals.setdefault(user, [0, 0, 0])
            t[0] += 1
            t[1] += prompt_tokens
            t[2] += generation_tokens
            if len(self._totals) > self.tracked:
                self._fold()

    def set_counters(self, counters: dict[str, float]) -> None:
        with self._lock:
            self._counters = counters

    def _fold(self) -> None:
        ranked = sorted(self._totals, key=lambda u: self._totals[u][1] + self._totals[u][2])
        for user in ranked[: len(ranked) // 2]:
            for i, v in enumerate(self._totals.pop(user)):
                self._folded[i] += v

    def rows(self) -> dict[str, list[int]]:
        """Label value -> [requests, prompt tokens, generation tokens]; at most ``top + 1`` rows."""
        with self._lock:
            ranked = sorted(self._totals.items(), key=lambda kv: -(kv[1][1] + kv[1][2]))
            rows: dict[str, list[int]] = {}
            for user, t in ranked[: self.top]:
                rows[label(user)] = [a + b for a, b in zip(rows.get(label(user), [0, 0, 0]), t)]
            other = list(self._folded)
            for _, t in ranked[self.top:]:
                other = [a + b for a, b in zip(other, t)]
            if any(other):
                # a user who calls itself "other" is merged with the aggregate, never a second row
                rows[OTHER] = [a + b for a, b in zip(rows.get(OTHER, [0, 0, 0]), other)]
            return rows

    def collect(self) -> Iterator[Metric]:
        rows = self.rows()
        labels = ["model_name", "user"]
        docs = {"requests": "Finished requests per user (top users by tokens; the rest as 'other').",
                "prompt_tokens": "Prompt tokens of finished requests per user.",
                "generation_tokens": "Output tokens of finished requests per user."}
        for i, name in enumerate(_FIELDS):
            family = CounterMetricFamily(f"tandem:user_{name}", docs[name], labels=labels)
            for user, t in rows.items():
                family.add_metric([self.model_name, user], t[i])
            yield family
        with self._lock:
            counters = self._counters
        if counters:
            family = GaugeMetricFamily("tandem:user_vtc_counter",
                                       "Fair sharing's virtual token counter per user (vtc; the top users only).",
                                       labels=labels)
            shown = {label(u): c for u, c in counters.items() if label(u) in rows and label(u) != OTHER}
            for user, value in shown.items():
                family.add_metric([self.model_name, user], value)
            yield family


def label(user: str) -> str:
    return user or ANONYMOUS
