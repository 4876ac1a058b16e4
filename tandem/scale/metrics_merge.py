"""One Prometheus exposition for N replicas: every replica's series with a ``replica`` label.

The ingress scrapes each replica's ``/metrics`` (``ServerMetrics.render``, text format 0.0.4) and
serves the merge, so one scrape target shows the whole deployment and dashboards select replicas
by label. Each metric family appears once (HELP and TYPE from the first text that has it) with the
samples of all replicas under it; two families with one name in one exposition are invalid, and
Prometheus would drop the scrape.

Names are grouped the way the exposition writes them: a counter ``x`` is written ``# TYPE
x_total``, an info ``x`` as the gauge ``x_info``, and a ``_created`` sample as its own gauge
family, so the merge keys families by the written name and never writes a TYPE twice.

A replica whose text does not parse is left out whole (a half-read replica would show partial
counters that look like resets) and counted in ``tandem:replica_metrics_errors``; so is a family
whose type disagrees with the one already taken (a replica on another version) and a series that
repeats one already written. That gauge is written for every source, 0 when all went in, so an
alert can watch ``> 0``.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Mapping

from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

REPLICA_LABEL = "replica"
ERRORS_METRIC = "tandem:replica_metrics_errors"
_OWN_GAUGES = ("_created", "_gsum", "_gcount")  # samples the 0.0.4 writer moves to a gauge of their own


def merge_replica_metrics(texts: Mapping[str, str | bytes | None], extra: str | bytes = "",
                          extra_source: str = "ingress") -> str:
    """Merge replica expositions (replica name -> text) and ``extra`` (the ingress's own, already
    labelled, taken as it is) into one text exposition, format 0.0.4.

    A text of ``None`` is a replica whose /metrics could not be read: counted as an error like one
    that does not parse. Serve the result with ``prometheus_client.CONTENT_TYPE_LATEST``.
    ``extra_source`` is the ``replica`` value under which problems with ``extra`` are counted.
    """
    merged = _Merged()
    errors: dict[str, int] = {}
    for name, text in texts.items():
        errors[name] = merged.add(text, {REPLICA_LABEL: name})
    if extra:
        errors[extra_source] = errors.get(extra_source, 0) + merged.add(extra, None)
    gauge = Metric(ERRORS_METRIC, "Problems merging this replica's /metrics at the last scrape: 1 if its "
                   "text did not parse (its series are missing), plus 1 per family or series dropped for "
                   "clashing with one already merged.", "gauge")
    for name, count in errors.items():
        gauge.add_sample(ERRORS_METRIC, {REPLICA_LABEL: name}, float(count))
    merged.add_families([gauge], None)
    return generate_latest(merged).decode("utf-8")


def _written_name(family: Metric) -> str:
    """The name on the family's ``# TYPE`` line in format 0.0.4."""
    return family.name + {"counter": "_total", "info": "_info"}.get(family.type, "")


def _rejoin_counters(families: Iterable[Metric]) -> list[Metric]:
    """The parser reads ``# TYPE x counter`` followed by ``x_total`` samples (as clients other than
    prometheus_client write it) as an empty counter ``x`` and an untyped ``x_total``, which would
    be written as two ``# TYPE x_total`` lines; put the samples back under the counter."""
    out: list[Metric] = []
    counters: dict[str, Metric] = {}
    for family in families:
        counter = counters.get(family.name) if family.type == "unknown" else None
        if counter is not None:
            counter.samples.extend(family.samples)
            continue
        if family.type == "counter":
            counters[_written_name(family)] = family
        out.append(family)
    return out


def _split_own_gauges(family: Metric) -> list[Metric]:
    """``family`` and, apart, gauges for its ``_created``/``_gsum``/``_gcount`` samples, so the
    family written for each is the one keyed here (the parser already splits them; other sources
    of ``Metric`` objects may not)."""
    main = Metric(family.name, family.documentation, family.type)
    apart: dict[str, Metric] = {}
    for s in family.samples:
        suffix = next((x for x in _OWN_GAUGES if s.name == family.name + x), None)
        if suffix is None or family.type in ("gauge", "unknown"):
            main.samples.append(s)
        else:
            apart.setdefault(suffix, Metric(s.name, family.documentation, "gauge")).samples.append(s)
    return [main, *apart.values()]


class _Merged:
    """The families merged so far, in first-seen order; a prometheus_client collector."""

    def __init__(self) -> None:
        self._families: dict[str, Metric] = {}
        self._seen: set[tuple[str, tuple]] = set()  # (sample name, labels): one line per series

    def collect(self) -> Iterator[Metric]:
        return iter(self._families.values())

    def add(self, text: str | bytes | None, labels: dict[str, str] | None) -> int:
        """Merge one exposition, ``labels`` added to each sample; returns the problems met."""
        if text is None:
            return 1
        try:
            if isinstance(text, bytes):
                text = text.decode("utf-8")
            # read whole before merging any of it: a parse error can come at the last line
            families = _rejoin_counters(text_string_to_metric_families(text))
        except Exception:  # noqa: BLE001 - any failure of one replica's text leaves the others intact
            return 1
        return self.add_families(families, labels)

    def add_families(self, families: Iterable[Metric], labels: dict[str, str] | None) -> int:
        problems = 0
        for parsed in families:
            for family in _split_own_gauges(parsed):
                key = _written_name(family)
                into = self._families.get(key)
                if into is None:
                    into = self._families[key] = Metric(family.name, family.documentation, family.type)
                elif into.type != family.type or into.name != family.name:
                    problems += 1
                    continue
                for s in family.samples:
                    out = dict(s.labels)
                    if labels:
                        for k, v in labels.items():
                            if k in out:  # kept as Prometheus keeps a target label it overrides
                                out[f"exported_{k}"] = out.pop(k)
                            out[k] = v
                    series = (s.name, tuple(sorted(out.items())))
                    if series in self._seen:
                        problems += 1
                        continue
                    self._seen.add(series)
                    into.add_sample(s.name, out, s.value, s.timestamp)
        return problems
