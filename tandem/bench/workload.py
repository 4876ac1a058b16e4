"""Workloads: which requests a benchmark sends, as a small YAML/JSON file that later tools reuse.

A workload is a dataset kind plus one or more request classes, each with input/output length
distributions and a share of the requests, and an arrival process::

    dataset: mixed
    num_prompts: 200
    seed: 0
    arrival: {process: poisson, request_rate: 4.0, burstiness: 1.0}
    classes:
      - {name: chat, share: 0.8, input: {dist: lognormal, mean: 200, sigma: 0.6}, output: {dist: fixed, mean: 128}}
      - {name: summarise, share: 0.2, input: {dist: uniform, min: 1500, max: 3000}, output: {dist: fixed, mean: 64},
         user: "team-{i%3}"}

A class may name the tenant (``user``) its requests are sent as; bench then reports percentiles
per user as well as per class.

Prompt text is cut from real text (``prompts.py``: ShareGPT prompts when a dataset path is given, else a
corpus shipped with tandem) so tokenization is realistic.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DATASETS = ("sharegpt", "random", "mixed", "trace")
_USER_FIELD = re.compile(r"\{i(?:%([0-9]+))?\}")
DISTS = ("fixed", "uniform", "normal", "lognormal")
PROCESSES = ("poisson", "gamma", "constant")


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
    user: str = ""
    """The tenant its requests are sent as (the OpenAI ``user`` field); "" sends none. ``{i}``
    is the request's ordinal within its class and ``{i%N}`` that modulo N, so ``light-{i%3}``
    spreads the class over three users."""

    def user_of(self, i: int) -> str:
        return _USER_FIELD.sub(lambda m: str(i % int(m.group(1)) if m.group(1) else i), self.user)


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
            _validate_user(c)
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


def _validate_user(c: RequestClass) -> None:
    """Only ``{i}`` and ``{i%N}`` (N >= 1) may be substituted; any other brace is a typo."""
    rest = _USER_FIELD.sub("", c.user)
    if "{" in rest or "}" in rest or any(m.group(1) and int(m.group(1)) < 1 for m in _USER_FIELD.finditer(c.user)):
        raise ValueError(f"classes[{c.name}].user: only {{i}} and {{i%N}} with N >= 1 may be substituted, "
                         f"got {c.user!r}")
    if len(c.user) > 256 or not c.user.isprintable():
        raise ValueError(f"classes[{c.name}].user: must be at most 256 printable characters, got {c.user!r}")


def _rate_out(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def _rate_in(rate: Any) -> float:
    return math.inf if rate in ("inf", None) else float(rate)
