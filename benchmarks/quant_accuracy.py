"""What lower precision costs in accuracy: bfloat16, weight-only int8, w8a8 and int4 against float32.

    .venv/bin/python benchmarks/quant_accuracy.py --out docs/results/quant_accuracy

(defaults: ``--texts 16 --max-tokens 256 --variants bfloat16,int8,w8a8 --greedy-prompts 4
--greedy-tokens 32 --threads 1``; ``--out`` is a path without suffix: the script writes
``<out>.json`` and ``<out>.md``.)

Reference: the default model (Gemma 3 270M) in float32, unquantized. Variants, each loaded alone
next to the reference and freed after use:

- ``bfloat16``: ``dtype="bfloat16"`` (weights and activations in bfloat16),
- ``int8``: ``dtype="float32", quantization="int8"`` (weight-only int8, float32 activations),
- ``w8a8``: ``dtype="float32", quantization="w8a8"`` (int8 weights; each layer's inputs rounded to
  int8 per block of 32 values),
- ``int4`` (not in the default list): ``dtype="float32", quantization="int4"`` (weight-only 4-bit,
  a float16 scale per 32 input values of each output row),
- ``int8-bfloat16`` (not in the default list): ``dtype="bfloat16", quantization="int8"``.

Teacher-forced part: real prompts (ShareGPT first turns from ``../shared/datasets``; without it,
paragraphs of ``tandem/bench/data/corpus.txt``), tokenized with the model's tokenizer, cut to
``--max-tokens`` tokens, prompts under 32 tokens skipped. Every text runs through the reference
and the variant back to back as one prefill over a paged KV cache, with logits for every
position; log-softmax in float32. Per variant, pooled over every predicted token:

- perplexity, ``exp(mean next-token NLL)``, for the variant and for the reference,
- mean ``KL(ref || variant)`` per position (nats), with its median, p99 and max,
- top-1 agreement: share of positions where the variant's argmax equals the reference's,
- mean ``|log p_variant(next) - log p_ref(next)|`` of the actual next token (nats).

Greedy part: ``--greedy-prompts`` short real prompts, ``--greedy-tokens`` greedy tokens each
(EOS ignored) through ``tandem.LLM`` per variant, in one batch; per prompt, the number of tokens
identical to float32's before the first divergence.

Bfloat16 matmuls are about 10x slower than float32 on a CPU without native bf16, so the default
workload is kept to 16 texts x 256 tokens (about 10-15 minutes on one thread). One thread by
default: the figures do not depend on speed, and on a shared 2-core machine a 2-thread forward ran
4x slower than a 1-thread one while other processes held the cores (each small parallel op waits
for a descheduled thread).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

from tandem import LLM, SamplingParams
from tandem.build import load_model
from tandem.model_files import default_model_path
from tandem.config import ModelConfig
from tandem.kernels.cpu_features import cpu_model
from tandem.models.auto_mode import ACCURACY_FILE
from tandem.models.context import ForwardContext, bf16_prompt_attention, bf16_prompt_rows, row_split
from tandem.ops.paged_attention import build_metadata

ROOT = Path(__file__).resolve().parent.parent
DATASET_DIR = ROOT.parent / "shared" / "datasets"
DATASET = DATASET_DIR / "sharegpt_v3_first_turn_1000.json"
CORPUS = ROOT / "tandem" / "bench" / "data" / "corpus.txt"
MIN_TOKENS = 32
BLOCK = 16  # KV-cache block size of the teacher-forced forward
CHUNK_ROWS = 64  # positions per log-softmax/KL chunk (each [64, 262144] float32 is 64 MiB)

# name -> (dtype, quantization)
VARIANTS = {
    "bfloat16": ("bfloat16", "none"),
    "int8": ("float32", "int8"),
    "w8a8": ("float32", "w8a8"),
    "int4": ("float32", "int4"),
    "int8-bfloat16": ("bfloat16", "int8"),
}
REFERENCE = ("float32", "none")
WEIGHTS_LABEL = {"int8": "int8 per-row", "w8a8": "int8 per-row, int8 inputs per 32",
                 "int4": "int4 per 32, float16 scales"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- text ---------------------------------------------------------------------------------------


def source_texts() -> tuple[list[str], str]:
    """Every candidate text, in order, and where they came from."""
    if DATASET.is_file():
        path = DATASET
    else:
        found = sorted(DATASET_DIR.glob("*.json")) + sorted(DATASET_DIR.glob("*.jsonl")) if DATASET_DIR.is_dir() else []
        path = found[0] if found else None
    if path is not None:
        raw = path.read_text()
        items = json.loads(raw) if path.suffix == ".json" else [json.loads(line) for line in raw.splitlines() if line.strip()]
        texts = []
        for item in items:
            turns = item.get("conversations") or []
            if turns and turns[0].get("from") == "human" and turns[0].get("value", "").strip():
                texts.append(turns[0]["value"])
        return texts, str(path.relative_to(ROOT.parent) if path.is_relative_to(ROOT.parent) else path)
    paragraphs = [p.strip() for p in CORPUS.read_text().split("\n\n") if p.strip()]
    return paragraphs, str(CORPUS.relative_to(ROOT))


def pick_texts(tokenizer, texts: list[str], n: int, max_tokens: int) -> list[list[int]]:
    out = []
    for text in texts:
        ids = tokenizer.encode(text)
        if len(ids) < MIN_TOKENS:
            continue
        out.append(ids[:max_tokens])
        if len(out) == n:
            break
    return out


def pick_greedy_prompts(tokenizer, texts: list[str], n: int) -> list[list[int]]:
    """Short, whole prompts (8-48 tokens) as a user would send them; cut longer ones if too few."""
    whole = [ids for ids in map(tokenizer.encode, texts[:400]) if 8 <= len(ids) <= 48]
    if len(whole) < n:
        whole += [ids[:32] for ids in map(tokenizer.encode, texts) if len(ids) > 48]
    return whole[:n]


# --- teacher-forced forward ---------------------------------------------------------------------


def all_logits(loaded, ids: list[int]) -> torch.Tensor:
    """One prefill over ``ids`` with a fresh paged KV cache -> float32 logits [len(ids), vocab]."""
    spec = loaded.spec
    n_blocks = -(-len(ids) // BLOCK)
    cache = torch.zeros(
        spec.num_layers, 2, n_blocks * BLOCK, spec.num_kv_heads, spec.head_dim, dtype=loaded.dtype
    )
    # the text is one prompt: its rows (and its attention) take the roads the runner would give them
    rows = bf16_prompt_rows(0, 0, len(ids), len(ids), False, loaded.model.ops.w8a8_prompt_bf16_tokens)
    meta = build_metadata([(0, len(ids), list(range(n_blocks)))], BLOCK, spec.sliding_window, torch.device("cpu"),
                          [bf16_prompt_attention(loaded.model.bf16_prompt_attention, rows)])
    ctx = ForwardContext(meta, cache, torch.arange(len(ids)), bf16_rows=row_split(list(rows), len(ids),
                                                                                   torch.device("cpu")))
    with torch.inference_mode():
        return loaded.model.compute_logits(loaded.model(torch.tensor(ids), ctx)).float()


def compare_text(ref_logits: torch.Tensor, var_logits: torch.Tensor, ids: list[int]) -> dict:
    """Per-position statistics for the ``len(ids) - 1`` predicted tokens."""
    target = torch.tensor(ids[1:])
    n = len(target)
    kl, ref_nll, var_nll, agree = [], [], [], []
    for a in range(0, n, CHUNK_ROWS):
        b = min(n, a + CHUNK_ROWS)
        ref_lp = torch.log_softmax(ref_logits[a:b], dim=-1)
        var_lp = torch.log_softmax(var_logits[a:b], dim=-1)
        kl.append((ref_lp.exp() * (ref_lp - var_lp)).sum(-1).clamp_min_(0.0))
        t = target[a:b, None]
        ref_nll.append(-ref_lp.gather(1, t)[:, 0])
        var_nll.append(-var_lp.gather(1, t)[:, 0])
        agree.append(ref_logits[a:b].argmax(-1) == var_logits[a:b].argmax(-1))
        del ref_lp, var_lp
    return {
        "kl": torch.cat(kl).double(),
        "ref_nll": torch.cat(ref_nll).double(),
        "var_nll": torch.cat(var_nll).double(),
        "agree": torch.cat(agree),
    }


def summarize(parts: list[dict]) -> dict:
    kl = torch.cat([p["kl"] for p in parts])
    ref_nll = torch.cat([p["ref_nll"] for p in parts])
    var_nll = torch.cat([p["var_nll"] for p in parts])
    agree = torch.cat([p["agree"] for p in parts])
    ref_ppl = math.exp(ref_nll.mean().item())
    var_ppl = math.exp(var_nll.mean().item())
    return {
        "predicted_tokens": len(kl),
        "ref_ppl": ref_ppl,
        "ppl": var_ppl,
        "ppl_change_pct": 100.0 * (var_ppl / ref_ppl - 1.0),
        "kl_mean": kl.mean().item(),
        "kl_median": kl.median().item(),
        "kl_p99": torch.quantile(kl, 0.99).item(),
        "kl_max": kl.max().item(),
        "top1_agreement": agree.double().mean().item(),
        "logprob_abs_diff_mean": (var_nll - ref_nll).abs().mean().item(),
    }


def teacher_forced(variant: str, texts: list[list[int]], ref) -> dict:
    dtype, quantization = VARIANTS[variant]
    t0 = time.perf_counter()
    loaded = load_model(ModelConfig(dtype=dtype, quantization=quantization, device="cpu"))
    log(f"{variant}: loaded in {time.perf_counter() - t0:.1f} s")
    parts, per_text, ref_s, var_s = [], [], 0.0, 0.0
    for i, ids in enumerate(texts):
        t = time.perf_counter()
        ref_logits = all_logits(ref, ids)
        t1 = time.perf_counter()
        var_logits = all_logits(loaded, ids)
        t2 = time.perf_counter()
        ref_s += t1 - t
        var_s += t2 - t1
        part = compare_text(ref_logits, var_logits, ids)
        del ref_logits, var_logits
        parts.append(part)
        s = summarize([part])
        per_text.append({"tokens": len(ids), **{k: s[k] for k in ("ref_ppl", "ppl", "kl_mean", "top1_agreement")}})
        log(
            f"{variant}: text {i + 1}/{len(texts)} ({len(ids)} tokens): ppl {s['ref_ppl']:.3f} -> {s['ppl']:.3f}, "
            f"KL {s['kl_mean']:.5f}, top-1 {100 * s['top1_agreement']:.1f}%  "
            f"[ref {t1 - t:.1f} s, {variant} {t2 - t1:.1f} s]"
        )
    out = summarize(parts)
    out["per_text"] = per_text
    out["forward_seconds"] = {"reference": ref_s, variant: var_s}
    out["ops"] = loaded.model.ops.describe()  # which paths ran (w8a8's prompt rows: the kernel or bf16)
    out["ref_nll_sum"] = sum(p["ref_nll"].sum().item() for p in parts)  # the reference must repeat exactly
    del loaded, parts
    gc.collect()
    return out


# --- greedy -------------------------------------------------------------------------------------


def greedy(dtype: str, quantization: str, prompts: list[list[int]], tokens: int, threads: int | None) -> list[list[int]]:
    llm = LLM(dtype=dtype, quantization=quantization, device="cpu", kv_cache_memory_gib=0.25, threads=threads)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    outs = [list(o.token_ids) for o in llm.generate(prompts, params)]
    del llm
    gc.collect()
    return outs


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# --- report -------------------------------------------------------------------------------------


def machine() -> dict:
    cpu = cpu_model()
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    except (ValueError, OSError, AttributeError):
        mem_gib = None
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(mem_gib, 1) if mem_gib else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def markdown(result: dict, json_name: str = "quant_accuracy.json") -> str:
    cfg, m = result["config"], result["machine"]
    tf, gr = result["teacher_forced"], result["greedy"]
    lines = [
        "# Accuracy cost of " + ", ".join(result["variants"]),
        "",
        f"Regenerate: `{result['command']}`",
        f"(raw numbers: [{json_name}]({json_name})).",
        "",
        f"Model: {result['model']}"
        + (" (the default: converted from its Q4_K_M GGUF, so the float32 reference's weights are already "
           "4-bit-rounded; the variants add their rounding on top of those)" if result["model"] == "gemma-3-270m" else "")
        + ". Reference: float32, unquantized. "
        f"Text: {result['texts']['count']} prompts from `{result['texts']['source']}` "
        f"(first ones with at least {MIN_TOKENS} tokens, cut to {cfg['max_tokens']} tokens), "
        f"{result['texts']['tokens']} tokens, {result['texts']['predicted_tokens']} predicted next tokens, "
        "teacher-forced (one prefill per text), log-softmax in float32.",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['torch_threads']} torch threads, "
        f"{m['memory_gib']} GiB; torch {m['torch']}, Python {m['python']}.",
        "",
    ]
    if tf:
        lines += [
            "| variant | dtype / weights | perplexity (ref → variant) | Δ perplexity | mean KL(ref‖variant), nats/token "
            "| median / p99 / max KL, nats | top-1 agreement | mean \\|Δ log p(next)\\|, nats | forward s (ref / variant) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, r in tf.items():
            dtype, quant = VARIANTS[name]
            fs = r["forward_seconds"]
            lines.append(
                f"| {name} | {dtype} / {WEIGHTS_LABEL.get(quant, dtype)} "
                f"| {r['ref_ppl']:.4f} → {r['ppl']:.4f} | {r['ppl_change_pct']:+.3f}% | {r['kl_mean']:.6f} "
                f"| {r['kl_median']:.6f} / {r['kl_p99']:.5f} / {r['kl_max']:.4f} "
                f"| {100 * r['top1_agreement']:.2f}% | {r['logprob_abs_diff_mean']:.5f} "
                f"| {fs['reference']:.0f} / {fs[name]:.0f} |"
            )
        lines.append("")
    if gr.get("variants"):
        n, t = len(gr["prompt_lengths"]), gr["tokens"]
        lines += [
            f"Greedy generation: {n} short prompts ({', '.join(map(str, gr['prompt_lengths']))} tokens), "
            f"{t} greedy tokens each (EOS ignored), through `tandem.LLM` in one batch; tokens identical to "
            "float32's before the first divergence, per prompt:",
            "",
            "| variant | matching prefix per prompt (of " + str(t) + ") | prompts fully identical |",
            "|---|---|---|",
        ]
        for name, g in gr["variants"].items():
            lines.append(
                f"| {name} | {', '.join(map(str, g['matching_prefix']))} | {g['identical']}/{n} |"
            )
        lines.append("")
    lines += [
        "Perplexity is pooled over all predicted tokens (exp of the mean NLL), not averaged per text. "
        "Forward seconds are the summed teacher-forced forward passes at the run's thread count on a "
        "shared machine: a rough guide, not a speed measurement. "
        "The teacher-forced numbers run the prefill path (for int8: blocked dequantize + float32 BLAS; for "
        "w8a8, and for int4 with the AVX-512 kernels: the kernel, the same at every batch size; for int4 "
        "with the AVX2 ones: blocked dequantize + BLAS); greedy decode runs the small-batch kernels, which "
        "agree with the prefill path to float32 rounding.",
        "",
    ]
    return "\n".join(lines)


# --- main ---------------------------------------------------------------------------------------


def update_package_summary(path: Path, result: dict) -> None:
    """Write each measured quantized mode's accuracy into the summary ``--quantization auto`` reads
    (``tandem/models/quant_accuracy.json``); modes not measured in this run keep their entries."""
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        summary = {}
    summary.update({
        "model": result["model"],
        "model_file": default_model_path().name,
        "reference": result["reference"],
        "texts": result["texts"]["count"],
        "predicted_tokens": result["texts"]["predicted_tokens"],
    })
    modes = summary.setdefault("modes", {})
    for variant, tf in result["teacher_forced"].items():
        quantization = result["variants"][variant]["quantization"]
        if quantization == "none":
            continue  # a dtype, not a weight format: auto does not choose it
        modes[quantization] = {
            "kl_mean": tf["kl_mean"], "top1_agreement": tf["top1_agreement"], "ppl_change_pct": tf["ppl_change_pct"],
            "command": result["command"], "date": result["date"],
        }
    path.write_text(json.dumps(summary, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--texts", type=int, default=16, help="number of prompts to score (default 16)")
    ap.add_argument("--max-tokens", type=int, default=256, help="tokens per text at most (default 256)")
    ap.add_argument("--variants", default="bfloat16,int8,w8a8", help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--greedy-prompts", type=int, default=4, help="short prompts for greedy agreement (0: skip)")
    ap.add_argument("--greedy-tokens", type=int, default=32, help="greedy tokens per prompt (default 32)")
    ap.add_argument(
        "--threads", type=int, default=1,
        help="torch threads (default 1: the figures do not depend on speed, and on a shared machine "
        "2 threads ran 4x slower than 1 while other work held the cores)",
    )
    ap.add_argument("--out", default="docs/results/quant_accuracy", help="output path without suffix: writes .json and .md")
    ap.add_argument("--package-file", default=str(ACCURACY_FILE),
                    help="the accuracy summary --quantization auto reads; the measured modes are updated in it "
                    "('' to leave it alone)")
    args = ap.parse_args(argv)

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        ap.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    if args.max_tokens < MIN_TOKENS:
        ap.error(f"--max-tokens: must be at least {MIN_TOKENS}")
    if args.threads < 1:
        ap.error("--threads: must be at least 1")
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    if out.suffix in (".json", ".md"):
        out = out.with_suffix("")
    out.parent.mkdir(parents=True, exist_ok=True)
    command = " ".join([".venv/bin/python benchmarks/quant_accuracy.py", shlex.join(sys.argv[1:] if argv is None else argv)]).strip()

    t_start = time.perf_counter()
    log(f"loading the float32 reference (torch {torch.__version__}, {torch.get_num_threads()} threads)")
    ref = load_model(ModelConfig(dtype=REFERENCE[0], quantization=REFERENCE[1], device="cpu"))
    candidates, source = source_texts()
    texts = pick_texts(ref.tokenizer, candidates, args.texts, args.max_tokens)
    greedy_prompts = pick_greedy_prompts(ref.tokenizer, candidates, args.greedy_prompts) if args.greedy_prompts else []
    n_tokens = sum(map(len, texts))
    log(f"{len(texts)} texts from {source}, {n_tokens} tokens; variants: {', '.join(variants)}")
    if not DATASET_DIR.is_dir():
        log(f"warning: {DATASET_DIR} not found (a checkout elsewhere, e.g. a git worktree?): the texts are "
            "the corpus paragraphs, so these figures do not compare with runs on the ShareGPT prompts")
    if len(texts) < args.texts:
        log(f"warning: only {len(texts)} texts of at least {MIN_TOKENS} tokens found")

    teacher = {}
    for v in variants:
        teacher[v] = teacher_forced(v, texts, ref)
        r = teacher[v]
        log(
            f"{v}: ppl {r['ref_ppl']:.4f} -> {r['ppl']:.4f} ({r['ppl_change_pct']:+.3f}%), mean KL {r['kl_mean']:.6f}, "
            f"top-1 {100 * r['top1_agreement']:.2f}%, mean |dlogp| {r['logprob_abs_diff_mean']:.5f}"
        )
    sums = {r["ref_nll_sum"] for r in teacher.values()}
    if len(sums) > 1:
        log(f"warning: the float32 reference did not repeat exactly across variants: NLL sums {sorted(sums)}")
    model_name = ref.name
    del ref
    gc.collect()

    greedy_result: dict = {"tokens": args.greedy_tokens, "prompt_lengths": [len(p) for p in greedy_prompts]}
    if greedy_prompts:
        log(f"greedy: {len(greedy_prompts)} prompts x {args.greedy_tokens} tokens, float32 reference")
        t = time.perf_counter()
        base = greedy(*REFERENCE, greedy_prompts, args.greedy_tokens, args.threads)
        greedy_result["reference_seconds"] = time.perf_counter() - t
        greedy_result["reference_tokens"] = base
        greedy_result["variants"] = {}
        for v in variants:
            t = time.perf_counter()
            got = greedy(*VARIANTS[v], greedy_prompts, args.greedy_tokens, args.threads)
            prefix = [common_prefix(a, b) for a, b in zip(base, got)]
            greedy_result["variants"][v] = {
                "matching_prefix": prefix,
                "identical": sum(p == args.greedy_tokens for p in prefix),
                "seconds": time.perf_counter() - t,
                "tokens": got,
            }
            log(f"greedy {v}: matching prefix {prefix} of {args.greedy_tokens} ({time.perf_counter() - t:.0f} s)")

    result = {
        "command": command,
        "model": model_name,
        "reference": {"dtype": REFERENCE[0], "quantization": REFERENCE[1]},
        "variants": {v: {"dtype": VARIANTS[v][0], "quantization": VARIANTS[v][1]} for v in variants},
        "config": vars(args),
        "texts": {
            "source": source,
            "count": len(texts),
            "tokens": n_tokens,
            "predicted_tokens": n_tokens - len(texts),
            "lengths": [len(t) for t in texts],
        },
        "teacher_forced": teacher,
        "greedy": greedy_result,
        "machine": machine(),
        "seconds": time.perf_counter() - t_start,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result, out.with_suffix(".json").name))
    if args.package_file:
        update_package_summary(Path(args.package_file), result)
    log(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')} ({result['seconds']:.0f} s in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
