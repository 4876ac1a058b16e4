"""Schema fuzzing at a larger size than CI's (tests/test_schema_fuzz.py): bodies generated from the
request schemas `tandem serve` publishes in /openapi.json (as published, narrowed to mostly valid
values, and mutated off the schema) sent over one keep-alive connection, so a 500 that resets the
connection shows up as a failed next request. Counts the statuses per route and kind and keeps
every 5xx and connection error with its body.

    .venv/bin/python benchmarks/fuzz.py --cases 2000 --out docs/results/fuzz.json
    .venv/bin/python benchmarks/fuzz.py --url http://127.0.0.1:8000 --cases 500   # a running server

Without --url it starts `tandem serve` on a tiny random model (tests/tiny_models.py). Exits 1 if
any case got a 5xx or a connection error, or the server is not idle with its KV free afterwards.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from server_helpers import ERROR_KEYS, body_strategies, published_body_schemas  # noqa: E402
from soak import Server, parse_metrics  # noqa: E402

SHARES = {  # (route, kind): share of the cases, as in CI
    ("/v1/completions", "published"): 40, ("/v1/completions", "narrow"): 45, ("/v1/completions", "mutated"): 45,
    ("/v1/chat/completions", "published"): 30, ("/v1/chat/completions", "narrow"): 35,
    ("/v1/chat/completions", "mutated"): 40,
    ("/tokenize", "published"): 15, ("/tokenize", "narrow"): 15, ("/tokenize", "mutated"): 20,
    ("/detokenize", "published"): 15, ("/detokenize", "mutated"): 15,
}


def verdict(r: httpx.Response) -> str | None:
    """None if the answer is acceptable, else why not."""
    if r.status_code >= 500:
        return f"{r.status_code}: {r.text[:300]}"
    if r.status_code >= 400:
        try:
            err = r.json()["error"]
        except Exception:  # noqa: BLE001 - any unparsable refusal is a finding
            return f"{r.status_code} not in the error shape: {r.text[:300]}"
        if set(err) != ERROR_KEYS:
            return f"{r.status_code} error keys {sorted(err)}"
    return None


def run(url: str, cases: int, seed: int) -> dict:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed

    openapi = httpx.get(url + "/openapi.json", timeout=30).json()
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    strategies = body_strategies(published_body_schemas(openapi), model)
    total = sum(SHARES.values())
    statuses: dict[str, Counter] = {}
    findings: list[dict] = []
    with httpx.Client(base_url=url, timeout=120) as http:
        for (route, kind), share in SHARES.items():
            n = max(1, round(cases * share / total))
            counts = statuses.setdefault(f"{route} {kind}", Counter())

            @hypothesis_seed(seed)
            @settings(max_examples=n, database=None, deadline=None, suppress_health_check=list(HealthCheck),
                      phases=[Phase.generate])
            @given(strategies[route][kind])
            def one(raw: bytes) -> None:
                try:
                    r = http.post(route, content=raw, headers={"Content-Type": "application/json"})
                except httpx.HTTPError as exc:
                    counts["connection error"] += 1
                    findings.append({"route": route, "kind": kind, "body": raw[:2000].decode("latin-1"),
                                     "why": f"{type(exc).__name__}: {exc}"})
                    return
                counts[str(r.status_code)] += 1
                why = verdict(r)
                if why is not None:
                    findings.append({"route": route, "kind": kind, "body": raw[:2000].decode("latin-1"), "why": why})

            start = time.monotonic()
            one()
            print(f"{route:22} {kind:9} {n:5} cases {time.monotonic() - start:6.1f} s  {dict(sorted(counts.items()))}",
                  flush=True)
    return {"statuses": {k: dict(v) for k, v in statuses.items()}, "findings": findings}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=2000, help="cases in all, shared among routes as in CI")
    p.add_argument("--url", help="fuzz a server already running here instead of starting one")
    p.add_argument("--seed", type=int, default=0, help="hypothesis seed (the same seed sends the same bodies)")
    p.add_argument("--out", type=Path, help="write the counts and findings as JSON here")
    args = p.parse_args(argv)

    server = tmp = None
    url = args.url
    if url is None:
        from tiny_models import save_tiny

        tmp = tempfile.TemporaryDirectory()
        save_tiny("llama", Path(tmp.name))
        server = Server(["--model", tmp.name, "--served-model-name", "tiny", "--dtype", "float32",
                         "--peak-flops", "1e11", "--peak-memory-bandwidth", "1e10"], [])
        url = server.url
    try:
        start = time.monotonic()
        result = run(url, args.cases, args.seed)
        result["wall_s"] = time.monotonic() - start
        time.sleep(0.5)  # the last finished request's blocks are freed just after its answer
        end = parse_metrics(httpx.get(url + "/metrics", timeout=10).text)
        health = httpx.get(url + "/health", timeout=10).json()
    finally:
        if server is not None:
            code, _ = server.stop()
        if tmp is not None:
            tmp.cleanup()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    result.update({
        "command": "benchmarks/fuzz.py " + " ".join(argv if argv is not None else sys.argv[1:]), "commit": commit,
        "cases": sum(sum(c.values()) for c in result["statuses"].values()), "health": health,
        "end": {k: end.get(k) for k in ("tandem:kv_cache_usage_perc", "tandem:num_requests_running",
                                        "tandem:num_requests_waiting")},
    })
    if server is not None:
        result["exit_code"] = code
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    print(f"{result['cases']} cases in {result['wall_s']:.1f} s: {len(result['findings'])} findings; "
          f"health {health.get('status')}; KV usage at the end {result['end']['tandem:kv_cache_usage_perc']}")
    for f in result["findings"][:10]:
        print(f"  {f['route']} {f['kind']}: {f['why'][:160]}\n    body {f['body'][:160]!r}")
    clean = not result["findings"] and health.get("status") == "ok" and not result["end"]["tandem:kv_cache_usage_perc"]
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
