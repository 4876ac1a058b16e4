"""What constrained decoding costs: the grammar's time per token and its effect on batch
throughput, in-process on the default model (or --model), at --concurrency requests at once.

    .venv/bin/python benchmarks/structured_outputs.py --concurrency 16 --max-tokens 128 --rounds 2 \
        --out docs/results/structured-outputs

Each round runs the same prompts three ways, alternated so that a change in the machine's load
hits all of them alike:

- ``json``: every request constrained by a JSON schema (a record with strings, numbers, an enum
  and an array; greedy, so the outputs and their lengths repeat);
- ``plain``: no constraint, each request generating exactly as many tokens as its ``json``
  output had (``ignore_eos``), so both do the same forward passes;
- ``mixed``: half of the requests constrained, half not.

Reported per mode: output tokens/s (wall clock), and for the constrained rows the grammar's own
time per token, split into filling the token mask, applying it to the logits and advancing the
matcher (timed around ``GrammarMatchers``), and the compile time of the schema (first use, then
cached). Writes ``structured_outputs.json`` and ``structured_outputs.md`` to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "maxLength": 60},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "email", "role", "score", "tags", "address"],
    "additionalProperties": False,
}

TOPICS = ["a software engineer in Berlin", "a retired teacher from Lyon", "a student of physics", "a chef in Osaka",
          "a nurse in Toronto", "a pilot from Nairobi", "a farmer in Iowa", "a painter in Lisbon"]


class Timed:
    """Wraps the grammar matchers' methods with timers (seconds and constrained rows)."""

    def __init__(self, matchers) -> None:
        self.matchers = matchers
        self.fill = self.apply = self.accept = 0.0
        self.rows = 0
        self._fill, self._apply, self._accept = matchers.fill, matchers.apply, matchers.accept
        matchers.fill, matchers.apply, matchers.accept = self.fill_masks, self.apply_masks, self.accept_tokens

    def fill_masks(self, chunks, vocab):
        start = time.perf_counter()
        try:
            return self._fill(chunks, vocab)
        finally:
            self.fill += time.perf_counter() - start
            self.rows += len(chunks)

    def apply_masks(self, logits, bitmask):
        start = time.perf_counter()
        try:
            return self._apply(logits, bitmask)
        finally:
            self.apply += time.perf_counter() - start

    def accept_tokens(self, request_ids, tokens):
        start = time.perf_counter()
        self._accept(request_ids, tokens)
        self.accept += time.perf_counter() - start

    def reset(self) -> None:
        self.fill = self.apply = self.accept = 0.0
        self.rows = 0

    def per_token_us(self) -> dict[str, float]:
        n = max(self.rows, 1)
        return {"fill_us": self.fill / n * 1e6, "apply_us": self.apply / n * 1e6, "accept_us": self.accept / n * 1e6,
                "total_us": (self.fill + self.apply + self.accept) / n * 1e6, "rows": self.rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model directory or .gguf; default: the embedded Gemma 3 270M")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    from tandem import LLM, SamplingParams
    from tandem.core.constraint import Constraint

    llm = LLM(model=args.model, max_num_seqs=args.concurrency, max_model_len=args.max_model_len)
    constraint = Constraint.json_schema(SCHEMA, "benchmark")
    compiler = llm.engine.runner.grammar
    start = time.perf_counter()
    compiler.compile(Constraint("regex", "x"))  # the tokenizer tables, built once per model
    tables_s = time.perf_counter() - start
    start = time.perf_counter()
    compiler.compile(constraint)
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    compiler.compile(constraint)
    cached_s = time.perf_counter() - start

    prompts = [f"Write a JSON record describing {TOPICS[i % len(TOPICS)]} (person {i}):" for i in range(args.concurrency)]
    timed = Timed(llm.engine.runner.sampler.grammars)
    json_params = SamplingParams(max_tokens=args.max_tokens, temperature=0, constraint=constraint)
    rounds = []
    for r in range(args.rounds):
        row: dict[str, object] = {"round": r}
        timed.reset()
        start = time.perf_counter()
        outs = llm.generate(prompts, json_params)
        wall = time.perf_counter() - start
        lengths = [len(o.token_ids) for o in outs]
        valid = sum(_parses(o.text) for o in outs)
        row["json"] = {"wall_s": wall, "tokens": sum(lengths), "tok_s": sum(lengths) / wall, "valid": valid,
                       "finished_stop": sum(o.finish_reason == "stop" for o in outs), **timed.per_token_us()}
        plain = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
        start = time.perf_counter()
        llm.generate(prompts, plain)
        wall = time.perf_counter() - start
        row["plain"] = {"wall_s": wall, "tokens": sum(lengths), "tok_s": sum(lengths) / wall}
        timed.reset()
        mixed = [json_params if i % 2 == 0 else plain[i] for i in range(len(prompts))]
        start = time.perf_counter()
        mixed_outs = llm.generate(prompts, mixed)
        wall = time.perf_counter() - start
        tokens = sum(len(o.token_ids) for o in mixed_outs)
        row["mixed"] = {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, **timed.per_token_us()}
        rounds.append(row)
        print(json.dumps(row), flush=True)

    summary = {
        "model": args.model or "gemma-3-270m (embedded)", "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "vocab_width": compiler.vocab_width, "tokenizer_tables_s": tables_s, "schema_compile_s": compile_s,
        "schema_cached_s": cached_s, "schema": SCHEMA, "rounds": rounds,
        "median": {mode: {k: statistics.median(r[mode][k] for r in rounds) for k in ("tok_s",)}  # type: ignore[index]
                   for mode in ("json", "plain", "mixed")},
        "median_grammar_us_per_token": statistics.median(r["json"]["total_us"] for r in rounds),  # type: ignore[index]
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "structured_outputs.json").write_text(json.dumps(summary, indent=2))
    (args.out / "structured_outputs.md").write_text(_markdown(summary))
    print(_markdown(summary))
    return 0


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


def _markdown(s: dict) -> str:
    med = s["median"]
    lines = [
        f"# Structured outputs: cost at C={s['concurrency']} ({s['model']}, vocab {s['vocab_width']})", "",
        f"Tokenizer tables {s['tokenizer_tables_s']:.2f} s (once per model); schema compile "
        f"{s['schema_compile_s'] * 1e3:.1f} ms first, {s['schema_cached_s'] * 1e3:.2f} ms cached.", "",
        "| round | mode | tokens | tok/s | valid JSON | grammar µs/token (fill + apply + accept) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in s["rounds"]:
        for mode in ("json", "plain", "mixed"):
            m = r[mode]
            grammar = (f"{m['total_us']:.1f} ({m['fill_us']:.1f} + {m['apply_us']:.1f} + {m['accept_us']:.1f})"
                       if "total_us" in m else "-")
            valid = f"{m['valid']}/{s['concurrency']}" if "valid" in m else "-"
            lines.append(f"| {r['round']} | {mode} | {m['tokens']} | {m['tok_s']:.1f} | {valid} | {grammar} |")
    ratio = med["json"]["tok_s"] / med["plain"]["tok_s"] if med["plain"]["tok_s"] else float("nan")
    lines += ["", f"Median throughput: json {med['json']['tok_s']:.1f} tok/s, plain {med['plain']['tok_s']:.1f} "
              f"tok/s (json/plain {ratio:.3f}), mixed {med['mixed']['tok_s']:.1f} tok/s; grammar "
              f"{s['median_grammar_us_per_token']:.1f} µs per constrained token.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
