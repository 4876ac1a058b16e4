"""Workloads: which requests a benchmark sends, as a small YAML/JSON file that later tools reuse.

A workload is a dataset kind plus one or more request classes, each with input/output length
distributions and a share of the requests, and an arrival process::

    dataset: mixed
    num_prompts: 200
    seed: 0
    arrival: {process: poisson, request_rate: 4.0, burstiness: 1.0}
    classes:
      - {name: chat, share: 0.8, input: {dist: lognormal, mean: 200, sigma: 0.6}, output: {dist: fixed, mean: 128}}
      - {name: summarise, share: 0.2, input: {dist: uniform, min: 1500, max: 3000}, output: {dist: fixed, mean: 64}}

Prompt text is cut from real text (ShareGPT prompts when a dataset path is given, else a
corpus shipped with tandem) so tokenization is realistic.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence

DATASETS = ("sharegpt", "random", "mixed", "trace")
DISTS = ("fixed", "uniform", "normal", "lognormal")
PROCESSES = ("poisson", "gamma", "constant")


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...


class PlainTokenizer:
    """Adapter over a tandem Tokenizer (or anything with encode/decode): encode without special
    tokens, as prompts are cut from running text."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        backend = getattr(self.tokenizer, "backend", None)
        if backend is not None:
            return backend.encode(text, add_special_tokens=False).ids
        return self.tokenizer.encode(text)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids)


@dataclass
class LengthDist:
    """Token lengths. ``mean`` is the value for fixed, the mean for normal and lognormal
    (``std`` / ``sigma`` their spread); uniform draws from [min, max]."""

    dist: str = "fixed"
    mean: float = 128
    std: float = 0.0
    sigma: float = 0.5
    min: int = 1
    max: int | None = None

    def validate(self, name: str) -> None:
        if self.dist not in DISTS:
            raise ValueError(f"{name}.dist: must be one of {', '.join(DISTS)}, got {self.dist!r}")
        if self.mean <= 0 and self.dist != "uniform":
            raise ValueError(f"{name}.mean: must be > 0, got {self.mean}")
        if self.min < 1:
            raise ValueError(f"{name}.min: must be >= 1, got {self.min}")
        if self.dist == "uniform" and (self.max is None or self.max < self.min):
            raise ValueError(f"{name}.max: uniform needs max >= min")

    def sample(self, rng: random.Random) -> int:
        if self.dist == "fixed":
            x = self.mean
        elif self.dist == "uniform":
            x = rng.randint(self.min, self.max)  # type: ignore[arg-type]
        elif self.dist == "normal":
            x = rng.gauss(self.mean, self.std)
        else:  # lognormal with the given mean: mu = ln(mean) - sigma^2 / 2
            x = rng.lognormvariate(math.log(self.mean) - self.sigma**2 / 2, self.sigma)
        x = max(self.min, int(round(x)))
        return min(x, self.max) if self.max is not None else x


@dataclass
class RequestClass:
    name: str = "default"
    share: float = 1.0
    input: LengthDist = field(default_factory=LengthDist)
    output: LengthDist = field(default_factory=LengthDist)
    prefix_len: int = 0
    """Tokens of a prefix shared by every prompt of the class."""


@dataclass
class ArrivalSpec:
    process: str = "poisson"
    request_rate: float = math.inf
    """Requests per second; inf sends everything at once."""
    burstiness: float = 1.0
    """Gamma shape of the inter-arrival times: 1 is Poisson, < 1 burstier, > 1 more regular."""
    max_concurrency: int | None = None
    """At most this many requests in flight (a closed loop when the rate is inf)."""

    def validate(self) -> None:
        if self.process not in PROCESSES:
            raise ValueError(f"arrival.process: must be one of {', '.join(PROCESSES)}, got {self.process!r}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate: must be > 0, got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness: must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency: must be >= 1, got {self.max_concurrency}")


@dataclass
class Workload:
    dataset: str = "random"
    num_prompts: int = 100
    seed: int = 0
    dataset_path: str | None = None
    classes: list[RequestClass] = field(default_factory=lambda: [RequestClass()])
    arrival: ArrivalSpec = field(default_factory=ArrivalSpec)
    sharegpt_output_len: LengthDist | None = None
    """ShareGPT: output lengths (default: fixed 256)."""

    def validate(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset_name: must be one of {', '.join(DATASETS)}, got {self.dataset!r}")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts: must be >= 1, got {self.num_prompts}")
        if self.dataset in ("sharegpt", "trace") and not self.dataset_path:
            raise ValueError(f"dataset_path: the {self.dataset} dataset needs a file")
        if not self.classes:
            raise ValueError("classes: at least one request class")
        for c in self.classes:
            if c.share <= 0:
                raise ValueError(f"classes[{c.name}].share: must be > 0")
            c.input.validate(f"classes[{c.name}].input")
            c.output.validate(f"classes[{c.name}].output")
        self.arrival.validate()

    # --- files ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["arrival"]["request_rate"] = _rate_out(self.arrival.request_rate)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Workload":
        d = dict(d)
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"workload: unknown keys {sorted(unknown)}")
        classes = []
        for c in d.pop("classes", None) or [{}]:
            c = dict(c)
            c["input"] = LengthDist(**c.get("input", {}))
            c["output"] = LengthDist(**c.get("output", {}))
            classes.append(RequestClass(**c))
        arrival = dict(d.pop("arrival", None) or {})
        if "request_rate" in arrival:
            arrival["request_rate"] = _rate_in(arrival["request_rate"])
        sg = d.pop("sharegpt_output_len", None)
        w = cls(**d, classes=classes, arrival=ArrivalSpec(**arrival),
                sharegpt_output_len=LengthDist(**sg) if sg else None)
        w.validate()
        return w

    @classmethod
    def load(cls, path: str | Path) -> "Workload":
        text = Path(path).read_text()
        if str(path).endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        if str(path).endswith((".yaml", ".yml")):
            import yaml

            Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
        else:
            Path(path).write_text(json.dumps(self.to_dict(), indent=1))


def _rate_out(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def _rate_in(rate: Any) -> float:
    return math.inf if rate in ("inf", None) else float(rate)


@dataclass
class BenchRequest:
    index: int
    class_name: str
    prompt: str
    input_len: int
    output_len: int
    arrival_s: float | None = None
    """Offset from the start (trace replay); None when the arrival process decides."""


# --- building the requests ---------------------------------------------------------------------

_CORPUS = Path(__file__).parent / "data" / "corpus.txt"


def _sharegpt_prompts(path: str) -> list[str]:
    data = json.loads(Path(path).read_text())
    prompts = []
    for item in data:
        turns = item.get("conversations") or item.get("conversation") or []
        if turns and turns[0].get("from") in ("human", "user") and turns[0].get("value"):
            prompts.append(turns[0]["value"])
    if not prompts:
        raise ValueError(f"dataset_path: no first human turns found in {path}")
    return prompts


class _TextPool:
    """Token stream of real text to cut prompts of exact token lengths from."""

    def __init__(self, tokenizer: Tokenizer, texts: list[str]) -> None:
        ids: list[int] = []
        for t in texts:
            ids.extend(tokenizer.encode(t))
            if len(ids) > 200_000:
                break
        if len(ids) < 16:
            raise ValueError("dataset_path: not enough text to build prompts from")
        self.ids = ids
        self.tokenizer = tokenizer

    def take(self, rng: random.Random, n: int) -> str:
        start = rng.randrange(len(self.ids))
        out = []
        while len(out) < n:
            out.extend(self.ids[start : start + n - len(out)])
            start = 0
        text = self.tokenizer.decode(out)
        if not text.strip():
            raise ValueError("tokenizer: it cannot represent the prompt text (decoded prompts are empty); "
                             "pass the served model's tokenizer with --tokenizer")
        return text


def build_requests(w: Workload, tokenizer: Tokenizer) -> list[BenchRequest]:
    w.validate()
    rng = random.Random(w.seed)
    if w.dataset == "trace":
        return _trace_requests(w, tokenizer, rng)
    if w.dataset == "sharegpt":
        prompts = _sharegpt_prompts(w.dataset_path)  # type: ignore[arg-type]
        rng.shuffle(prompts)
        out_dist = w.sharegpt_output_len or LengthDist("fixed", 256)
        reqs = []
        for i in range(w.num_prompts):
            text = prompts[i % len(prompts)]
            reqs.append(BenchRequest(i, "sharegpt", text, len(tokenizer.encode(text)), out_dist.sample(rng)))
        return reqs
    texts = _sharegpt_prompts(w.dataset_path) if w.dataset_path else [_CORPUS.read_text()]
    pool = _TextPool(tokenizer, texts)
    shares = [c.share for c in w.classes]
    prefixes = {c.name: pool.take(rng, c.prefix_len) if c.prefix_len else "" for c in w.classes}
    reqs = []
    for i in range(w.num_prompts):
        c = rng.choices(w.classes, weights=shares)[0]
        n_in = c.input.sample(rng)
        body = pool.take(rng, max(1, n_in - c.prefix_len))
        prefix = prefixes[c.name]
        if prefix and not prefix[-1].isspace() and not body[:1].isspace():
            prefix += " "  # keep the last prefix word and the first body word apart
        reqs.append(BenchRequest(i, c.name, prefix + body, n_in, c.output.sample(rng)))
    return reqs


def _trace_requests(w: Workload, tokenizer: Tokenizer, rng: random.Random) -> list[BenchRequest]:
    """JSONL lines of {"timestamp": s, "input_len": n, "output_len": m[, "class": name]}."""
    pool = _TextPool(tokenizer, [_CORPUS.read_text()])
    rows = []
    for lineno, line in enumerate(Path(w.dataset_path).read_text().splitlines(), 1):  # type: ignore[arg-type]
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            rows.append((float(row["timestamp"]), int(row["input_len"]), int(row["output_len"]),
                         str(row.get("class", "trace"))))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"dataset_path: line {lineno} of the trace is not a valid record ({exc})") from None
    if not rows:
        raise ValueError("dataset_path: the trace is empty")
    rows.sort()
    t0 = rows[0][0]
    return [BenchRequest(i, cls, pool.take(rng, max(1, n_in)), n_in, max(1, n_out), ts - t0)
            for i, (ts, n_in, n_out, cls) in enumerate(rows[: w.num_prompts])]
