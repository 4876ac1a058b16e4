"""`tandem bench`: build the workload, run it (once, or as a concurrency sweep), write reports."""

from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from tandem.bench.arrivals import arrival_offsets
from tandem.bench.config import BenchConfig
from tandem.bench.progress import RunProgress
from tandem.bench.report import save_figure, write_report
from tandem.bench.replay import RunData, run_inprocess, run_openai
from tandem.bench.summary import counter_delta, parse_goodput, per_class, per_user, sizing_summary, summarize_run
from tandem.bench.prompts import PlainTokenizer, build_requests
from tandem.bench.scenarios import scenario_requests
from tandem.bench.workload import ArrivalSpec, LengthDist, RequestClass, Workload
from tandem.config import EngineConfig
from tandem.kernels.cpu_features import cpu_model


def load_tokenizer(path: str | None):
    from tandem.tokenizer import Tokenizer

    if path is None:
        from tandem.model_files import default_model_path
        from tandem.weights.cache import converted_entry

        return Tokenizer.load_saved(converted_entry(default_model_path()))
    p = Path(path).expanduser()
    if p.is_dir() and (p / "tandem_tokenizer.json").is_file():  # a tandem converted-model cache entry
        return Tokenizer.load_saved(p)
    if p.is_dir():
        return Tokenizer.from_hf_dir(p)
    if p.suffix == ".gguf" and p.is_file():
        from tokenizers import Tokenizer as HFTokenizer

        from tandem.weights.gguf_file import open_gguf
        from tandem.weights.gguf_tokenizer import tokenizer_from_gguf

        spec = tokenizer_from_gguf(open_gguf(p))
        return Tokenizer(HFTokenizer.from_str(spec.tokenizer_json), spec.bos_token_id, tuple(spec.eos_token_ids),
                         spec.add_bos_token, spec.chat_template)
    raise ValueError(f"tokenizer: {path} is neither a model directory nor a .gguf file")


def workload_from_config(cfg: BenchConfig) -> Workload:
    arrival = ArrivalSpec(process=cfg.arrival, request_rate=cfg.request_rate, burstiness=cfg.burstiness,
                          max_concurrency=cfg.max_concurrency)
    if cfg.workload:
        w = Workload.load(cfg.workload)
        return w
    n_in, n_out, r = cfg.random_input_len, cfg.random_output_len, cfg.random_range_ratio

    def dist(mean: int) -> LengthDist:
        if cfg.random_dist == "uniform" and r > 0:
            return LengthDist("uniform", mean, min=max(1, int(mean * (1 - r))), max=max(1, int(math.ceil(mean * (1 + r)))))
        if cfg.random_dist == "normal":
            return LengthDist("normal", mean, std=mean * (r or 0.25))
        if cfg.random_dist == "lognormal":
            return LengthDist("lognormal", mean, sigma=r or 0.5)
        return LengthDist("fixed", mean)

    if cfg.dataset_name == "mixed":
        # Interactive chat plus long-document summarisation: the heterogeneous case.
        classes = [
            RequestClass("chat", 0.8, LengthDist("lognormal", n_in, sigma=0.5), LengthDist("fixed", n_out)),
            RequestClass("summarise", 0.2, LengthDist("uniform", 6 * n_in, min=4 * n_in, max=8 * n_in),
                         LengthDist("fixed", max(16, n_out // 2))),
        ]
    else:
        classes = [RequestClass("random", 1.0, dist(n_in), dist(n_out), prefix_len=cfg.random_prefix_len)]
    w = Workload(
        dataset=cfg.dataset_name, num_prompts=cfg.num_prompts, seed=cfg.seed, dataset_path=cfg.dataset_path,
        classes=classes, arrival=arrival,
        sharegpt_output_len=LengthDist("fixed", cfg.sharegpt_output_len) if cfg.sharegpt_output_len else None,
    )
    w.validate()
    return w


def _workload_line(w: Workload) -> str:
    a = w.arrival
    rate = "inf" if math.isinf(a.request_rate) else f"{a.request_rate:g} req/s"
    conc = f", max concurrency {a.max_concurrency}" if a.max_concurrency else ""
    classes = "; ".join(f"{c.name} {c.share:g}: in {c.input.dist} {c.input.mean:g}, out {c.output.dist} "
                        f"{c.output.mean:g}" for c in w.classes)
    return f"{w.dataset}, {w.num_prompts} prompts, rate {rate} ({a.process}, burstiness {a.burstiness:g}){conc}; {classes}"


def _server_info(base_url: str, headers: dict[str, str]) -> dict[str, Any]:
    info: dict[str, Any] = {"base_url": base_url}
    for path in ("/v1/models", "/version", "/config"):
        try:
            r = httpx.get(base_url.rstrip("/") + path, headers=headers, timeout=5)
            if r.status_code == 200:
                info[path.strip("/").replace("v1/", "")] = r.json()
        except (httpx.HTTPError, ValueError):
            continue
    return info


def run_once(cfg: BenchConfig, w: Workload, engine_config: EngineConfig | None, tokenizer=None,
             engine=None) -> tuple[RunData, dict, dict, dict]:
    headers = {}
    key = cfg.api_key or os.environ.get("OPENAI_API_KEY")
    if key:
        headers["Authorization"] = f"Bearer {key}"
    meta: dict[str, Any] = {"label": cfg.label or cfg.backend, "workload": w.to_dict(), "workload_line": _workload_line(w),
                            "backend": cfg.backend, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                            "host": platform.node()}
    if cfg.backend == "inprocess":
        if engine is None:
            from tandem.build import build_engine

            engine, loaded = build_engine(engine_config or EngineConfig())
            meta["paths"] = loaded.paths()
        tok = PlainTokenizer(tokenizer or (load_tokenizer(cfg.tokenizer) if cfg.tokenizer else engine.tokenizer))
        meta["target"] = "in-process engine"
        meta["server_config"] = (engine_config or EngineConfig()).flat()
    else:
        tok = PlainTokenizer(tokenizer or load_tokenizer(cfg.tokenizer))
        meta["target"] = cfg.base_url
        meta["server_config"] = _server_info(cfg.base_url, headers)
        paths = (meta["server_config"].get("config") or {}).get("paths")
        if paths:  # a tandem server says which paths it runs
            meta["paths"] = paths
    meta["load_generator_cpu"] = cpu_model()
    arrival = w.arrival
    if cfg.scenario:
        requests, offsets, _, description, _ = scenario_requests(cfg.scenario, None, tok, cfg.seed)
        meta["workload_line"] = f"scenario {cfg.scenario}: {description}"
        arrival = ArrivalSpec(request_rate=math.inf)  # the scenario's own send times
    else:
        requests = build_requests(w, tok)
        if w.dataset == "trace":
            offsets = [r.arrival_s or 0.0 for r in requests]
        else:
            offsets = arrival_offsets(w.arrival, len(requests), w.seed)
    recomputed_before = engine.scheduler.num_recomputed_tokens if engine is not None else 0
    with RunProgress(len(requests), meta["label"]) as progress:
        if cfg.backend == "inprocess":
            data = run_inprocess(engine, requests, offsets, arrival, cfg.ignore_eos, cfg.max_duration, progress)
        else:
            endpoint = cfg.endpoint or ("/v1/chat/completions" if cfg.backend == "openai-chat" else "/v1/completions")
            model = cfg.model
            if model is None:
                models = meta["server_config"].get("models") or {}
                data_ = models.get("data") if isinstance(models, dict) else None
                model = data_[0]["id"] if data_ else None
            meta["model"] = model
            data = asyncio.run(run_openai(requests, offsets, arrival, cfg.base_url, endpoint, model, cfg.ignore_eos,
                                          headers, cfg.timeout, cfg.max_duration, cfg.scrape_interval, progress))
    slos = parse_goodput(cfg.goodput)
    summary = summarize_run(data.results, data.duration, cfg.percentiles, cfg.metrics, slos)
    classes = per_class(data.results, data.duration, cfg.percentiles, cfg.metrics, slos)
    recomputed = (engine.scheduler.num_recomputed_tokens - recomputed_before if cfg.backend == "inprocess"
                  else counter_delta(data.samples, "recomputed_tokens"))
    if recomputed is not None:
        summary["recomputed_tokens"] = recomputed
    if cfg.backend != "inprocess":  # what the server's /metrics counted, next to what its responses said
        queries, hits = (counter_delta(data.samples, k) for k in ("prefix_cache_queries", "prefix_cache_hits"))
        if queries:
            summary["prefix_cache_hit_rate"] = hits / queries
    summary.update(sizing_summary(data.samples))
    users = per_user(data.results, data.duration, cfg.percentiles, cfg.metrics, slos)
    if users:
        meta["per_user"] = users
    if data.samples:
        keys = sorted({k for _, g in data.samples for k in g})
        meta["server_metrics"] = {k: [[t, g.get(k)] for t, g in data.samples] for k in keys}
        for k in ("mfu", "mbu", "kv_usage"):
            vals = [g[k] for _, g in data.samples if k in g]
            if vals:
                summary[f"mean_{k}"] = sum(vals) / len(vals)
    if slos:
        meta["goodput_slos_ms"] = {k: v * 1000 for k, v in slos.items()}
    meta["notes"] = data.notes
    return data, summary, classes, meta


def run_bench(cfg: BenchConfig, engine_config: EngineConfig | None = None) -> dict:
    cfg.validate()
    parse_goodput(cfg.goodput)
    w = workload_from_config(cfg)
    if cfg.save_workload:
        w.save(cfg.save_workload)
    out_dir = Path(cfg.result_dir)
    if not cfg.sweep:
        data, summary, classes, meta = run_once(cfg, w, engine_config)
        paths = write_report(out_dir, data, summary, classes, meta)
        return {"summary": summary, "paths": [str(p) for p in paths], "failure": all_failed(data.results)}
    return _sweep(cfg, w, engine_config, out_dir)


def all_failed(results) -> str | None:
    """A message when no request succeeded (the run measured nothing; the CLI then exits 1)."""
    if any(r.success for r in results):
        return None
    errors = [r.error for r in results if r.error]
    first = f"; the first error: {errors[0]}" if errors else ""
    return f"every one of the {len(results)} requests failed{first}"


def _sweep(cfg: BenchConfig, w: Workload, engine_config: EngineConfig | None, out_dir: Path) -> dict:
    """Closed loop at concurrency 1, 2, 4, ... until output throughput stops growing."""
    tokenizer = engine = None
    if cfg.backend == "inprocess":
        from tandem.build import build_engine

        engine, _ = build_engine(engine_config or EngineConfig())
    if cfg.backend != "inprocess" or cfg.tokenizer:
        tokenizer = load_tokenizer(cfg.tokenizer)
    levels, rows, failures = [], [], []
    c = 1
    while c <= cfg.sweep_max_concurrency:
        levels.append(c)
        wl = replace(w, arrival=replace(w.arrival, request_rate=math.inf, max_concurrency=c))
        data, summary, classes, meta = run_once(replace(cfg, label=f"concurrency {c}"), wl, engine_config,
                                                tokenizer, engine)
        write_report(out_dir / f"concurrency_{c}", data, summary, classes, meta)
        failures.append(all_failed(data.results))
        rows.append({"concurrency": c, **{k: summary.get(k) for k in (
            "completed", "failed", "output_throughput", "request_throughput", "median_ttft_ms", "p99_ttft_ms",
            "median_itl_ms", "p99_itl_ms", "median_tpot_ms", "p99_tpot_ms")}})
        if summary["failed"] and not summary["completed"]:
            break
        if len(rows) > 1:
            prev, cur = rows[-2]["output_throughput"], rows[-1]["output_throughput"]
            if prev and cur < prev * (1 + cfg.sweep_gain):
                break
        c *= 2
    saturated = len(rows) > 1 and rows[-1]["concurrency"] <= cfg.sweep_max_concurrency and \
        rows[-1]["output_throughput"] < (rows[-2]["output_throughput"] or 0) * (1 + cfg.sweep_gain)
    result = {"levels": rows, "saturated": saturated,
              "saturation_concurrency": rows[-2]["concurrency"] if saturated else None}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sweep.json").write_text(json.dumps(result, indent=1) + "\n")
    _plot_sweep(rows, out_dir / "sweep.png")
    lines = ["# Concurrency sweep", "", "| concurrency | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms |",
             "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['output_throughput']:.1f} | {r['median_ttft_ms']:.0f} / "
                     f"{r['p99_ttft_ms']:.0f} | {r['median_itl_ms']:.0f} / {r['p99_itl_ms']:.0f} |")
    lines.append("")
    lines.append(f"Saturated at concurrency {result['saturation_concurrency']}." if saturated
                 else "Did not saturate within --sweep-max-concurrency.")
    (out_dir / "sweep.md").write_text("\n".join(lines) + "\n")
    return {"summary": result, "paths": [str(out_dir / "sweep.json"), str(out_dir / "sweep.md"),
                                         str(out_dir / "sweep.png")],
            "failure": failures[0] if all(failures) else None}


def _plot_sweep(rows: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt  # the Agg backend is chosen by tandem.bench.report

    cs = [r["concurrency"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    a.plot(cs, [r["output_throughput"] for r in rows], marker="o")
    a.set_xscale("log", base=2)
    a.set_xlabel("concurrency")
    a.set_ylabel("output tokens/s")
    a.set_title("Throughput vs concurrency")
    a.grid(alpha=0.3)
    for key, label in (("median_ttft_ms", "TTFT p50"), ("p99_ttft_ms", "TTFT p99"), ("median_itl_ms", "ITL p50"),
                       ("p99_itl_ms", "ITL p99")):
        b.plot(cs, [r[key] for r in rows], marker="o", label=label)
    b.set_xscale("log", base=2)
    b.set_yscale("log")
    b.set_xlabel("concurrency")
    b.set_ylabel("milliseconds")
    b.set_title("Latency vs concurrency")
    b.legend()
    b.grid(alpha=0.3)
    save_figure(fig, path)
