"""The requests a workload turns into: prompt text of exact token lengths, cut from real text
(ShareGPT prompts when a dataset path is given, else a corpus shipped with tandem), or a trace
replayed with its own timestamps."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

from tandem.bench.workload import LengthDist, Workload


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
        if getattr(self.tokenizer, "add_bos", False):  # the simulator's tokenizer with a BOS
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(text)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids)


@dataclass
class BenchRequest:
    index: int
    class_name: str
    prompt: str
    input_len: int
    output_len: int
    arrival_s: float | None = None
    """Offset from the start (trace replay); None when the arrival process decides."""
    user: str = ""
    """The tenant it is sent as; "" is anonymous (no ``user`` field)."""


# --- building the requests ---------------------------------------------------------------------

CORPUS = Path(__file__).parent / "data" / "corpus.txt"


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


class TextPool:
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
        # one draw whatever the pool's length: the lengths and arrivals drawn after it must not
        # depend on the tokenizer (the simulator's and the model's cut the same workload)
        start = min(int(rng.random() * len(self.ids)), len(self.ids) - 1)
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
    texts = _sharegpt_prompts(w.dataset_path) if w.dataset_path else [CORPUS.read_text()]
    pool = TextPool(tokenizer, texts)
    shares = [c.share for c in w.classes]
    prefixes = {c.name: pool.take(rng, c.prefix_len) if c.prefix_len else "" for c in w.classes}
    reqs = []
    ordinals = {c.name: 0 for c in w.classes}
    for i in range(w.num_prompts):
        c = rng.choices(w.classes, weights=shares)[0]
        n_in = c.input.sample(rng)
        body = pool.take(rng, max(1, n_in - c.prefix_len))
        prefix = prefixes[c.name]
        if prefix and not prefix[-1].isspace() and not body[:1].isspace():
            prefix += " "  # keep the last prefix word and the first body word apart
        user = c.user_of(ordinals[c.name])
        ordinals[c.name] += 1
        reqs.append(BenchRequest(i, c.name, prefix + body, n_in, c.output.sample(rng), user=user))
    return reqs


def _trace_requests(w: Workload, tokenizer: Tokenizer, rng: random.Random) -> list[BenchRequest]:
    """JSONL lines of {"timestamp": s, "input_len": n, "output_len": m[, "class": name][, "user": u]}."""
    pool = TextPool(tokenizer, [CORPUS.read_text()])
    rows = []
    for lineno, line in enumerate(Path(w.dataset_path).read_text().splitlines(), 1):  # type: ignore[arg-type]
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            rows.append((float(row["timestamp"]), int(row["input_len"]), int(row["output_len"]),
                         str(row.get("class", "trace")), str(row.get("user") or "")))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"dataset_path: line {lineno} of the trace is not a valid record ({exc})") from None
    if not rows:
        raise ValueError("dataset_path: the trace is empty")
    rows.sort()
    t0 = rows[0][0]
    return [BenchRequest(i, cls, pool.take(rng, max(1, n_in)), n_in, max(1, n_out), ts - t0, user)
            for i, (ts, n_in, n_out, cls, user) in enumerate(rows[: w.num_prompts])]
