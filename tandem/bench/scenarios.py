"""The built-in workloads of `tandem compare` and `tandem tune`, and the requests either tool
sends for a scenario name or a workload file.

This is the only list of scenarios: the CLI's choices and help come from it. It must stay free of
torch (and of anything heavy), because `tandem.bench.config` imports it to build the parser.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tandem.bench.arrivals import arrival_offsets
from tandem.bench.conversations import multi_turn_chats, shared_system_prompt
from tandem.bench.prompts import BenchRequest, build_requests
from tandem.bench.workload import ArrivalSpec, LengthDist, RequestClass, Workload


@dataclass
class Scenario:
    name: str
    brief: str
    """One line for the CLI help."""
    description: str
    """What the report says the scenario is."""
    build: Callable[[Any, int], tuple[list[BenchRequest], list[float]]] | None
    """(tokenizer, seed) -> (requests, send offsets); None for a scenario made of ``loads``."""
    max_num_seqs: int = 32
    configs: tuple[str, ...] = ()
    """What `tandem compare` runs when no --configs are given (else DEFAULT_CONFIGS)."""
    loads: tuple[str, ...] = ()
    """Other scenarios whose requests this one runs, each with this one's configurations and a
    report of its own: one question asked of several loads."""


# prefill-first gets a large budget (vLLM without chunking uses at least 2048 tokens per step)
# A chunked budget is fixed (``itl_target_factor=0``: no default ITL target sizing its prefill).
FIXED = "itl_target_factor=0"
DEFAULT_CONFIGS = (
    "policy=static",
    "policy=prefill-first,max_num_batched_tokens=2048",
    f"policy=chunked,max_num_batched_tokens=128,{FIXED}",
    f"policy=chunked,max_num_batched_tokens=512,{FIXED}",
    "default:policy=chunked",  # what `tandem serve` runs with no flags: 512 and the default ITL target
)
# The long-prefill cap: a long prompt takes at most half the 512-token budget per step and one
# long prompt prefills at a time, so a short prompt arriving behind a document is not queued
# behind all of it.
LONG_CAP = ("capped:policy=chunked,max_num_batched_tokens=512,long_prefill_token_threshold=256,"
            f"max_long_partial_prefills=1,{FIXED}")
# Two targets: 150 ms ("keep streams under 150 ms per token") and 50 ms (20 tokens/s, a stream
# read as it comes). The target policy may use the whole 2048-token budget when nothing decodes,
# and sizes prefill to its target while streams run; the fixed budgets around it show which of
# them also meet each target and at what TTFT. A target only steers where it binds: on a load
# where every fixed budget meets it, the largest budget (prefill-first, in effect) is as good as
# anything, and a policy that keeps every step within T can only lose TTFT to it.
ITL_TARGETS_MS = (50, 150)
ITL_TARGET_CONFIGS = (
    *(f"target-{t}:policy=chunked,max_num_batched_tokens=2048,target_itl_ms={t}" for t in ITL_TARGETS_MS),
    *(f"policy=chunked,max_num_batched_tokens={b},{FIXED}" for b in (32, 64, 128, 256, 512)),
    "default:policy=chunked",  # the no-flag default target, beside them (not judged as a fixed budget)
)
_TARGETS = " and ".join(map(str, ITL_TARGETS_MS))


def _equal(tok, seed: int):
    w = Workload(dataset="random", num_prompts=24, seed=seed,
                 classes=[RequestClass("equal", 1.0, LengthDist("fixed", 256), LengthDist("fixed", 64))])
    reqs = build_requests(w, tok)
    return reqs, [0.0] * len(reqs)


def _joined(*parts: list[BenchRequest]) -> list[BenchRequest]:
    reqs = [r for part in parts for r in part]
    for i, r in enumerate(reqs):
        r.index = i
    return reqs


def _long_prompts(tok, seed: int):
    chat = Workload(dataset="random", num_prompts=18, seed=seed, classes=[
        RequestClass("chat", 1.0, LengthDist("lognormal", 96, sigma=0.3, max=192), LengthDist("fixed", 96))])
    docs = Workload(dataset="random", num_prompts=3, seed=seed + 1, classes=[
        RequestClass("document", 1.0, LengthDist("fixed", 1536), LengthDist("fixed", 16))])
    reqs = _joined(build_requests(chat, tok), build_requests(docs, tok))
    # twelve chats start together and stream; the documents land in the middle of their streams,
    # and six more chats arrive just behind them: their TTFT is what the long-prefill cap is for
    late = [d + lag for d in (4.0, 10.0, 16.0) for lag in (0.3, 0.8)]
    offsets = [0.2 * i for i in range(12)] + late + [4.0 + 6.0 * i for i in range(3)]
    return reqs, offsets


def _power_user(tok, seed: int):
    power = Workload(dataset="random", num_prompts=64, seed=seed, classes=[
        RequestClass("power", 1.0, LengthDist("fixed", 128), LengthDist("uniform", 64, min=32, max=96), user="power")])
    light = Workload(dataset="random", num_prompts=28, seed=seed + 1, classes=[
        RequestClass("light", 1.0, LengthDist("fixed", 64), LengthDist("fixed", 32), user="light-{i%3}")])
    reqs = _joined(build_requests(power, tok), build_requests(light, tok))
    # two bursts of 32 from the power user, 25 s apart; three light users take turns, one
    # request every 1.25 s: under FCFS a light request queues behind the rest of a burst
    offsets = [0.0] * 32 + [25.0] * 32 + [0.3 + 1.25 * i for i in range(28)]
    return reqs, offsets


def _sharegpt_bursty(tok, seed: int):
    w = Workload(dataset="random", num_prompts=32, seed=seed, classes=[
        # lognormal fits of ShareGPT first turns and answers, shortened for a 2-core CPU
        RequestClass("sharegpt-like", 1.0, LengthDist("lognormal", 180, sigma=0.8, max=1024),
                     LengthDist("lognormal", 80, sigma=0.6, max=200)),
    ], arrival=ArrivalSpec("gamma", request_rate=0.8, burstiness=0.3))
    reqs = build_requests(w, tok)
    return reqs, arrival_offsets(w.arrival, len(reqs), seed)


# The prefix cache against no cache, at three chunk sizes: what reusing prefixes does to TTFT and
# to which budget is best.
SHARED_PREFIX_CONFIGS = tuple(
    f"{name}-{b}:policy=chunked,max_num_batched_tokens={b},enable_prefix_caching={on}"
    for name, on in (("cache", "true"), ("no-cache", "false")) for b in (128, 512, 2048)
)


def _shared_prefix(tok, seed: int):
    system = shared_system_prompt(tok, seed, n=24, system_len=1024, question_len=(24, 48), output_len=32)
    chats = multi_turn_chats(tok, seed + 1, chats=4, turns=4, opening_len=192, question_len=32, answer_len=64,
                             start=len(system))
    # a question every second; the chats start between them and take a turn every 6 s
    offsets = [1.0 * i for i in range(len(system))]
    offsets += [0.5 + 1.5 * c + 6.0 * t for c in range(len(chats)) for t in range(len(chats[c]))]
    return _joined(system, *chats), offsets


SCENARIOS = {s.name: s for s in (
    Scenario("equal", "equal-size requests at high concurrency",
             "24 equal requests (256 prompt / 64 output tokens) arriving at once: the case where chunked "
             "prefill can raise throughput", _equal),
    Scenario("long-prompts", "long prompts arriving while chats stream",
             "12 chats (~96 prompt / 96 output tokens) streaming while 3 1536-token documents arrive 4, 10 "
             "and 16 s in, each followed 0.3 and 0.8 s later by another chat: where prefill-first stalls "
             "streams, and where the long-prefill cap lets short prompts pass long ones",
             _long_prompts, configs=DEFAULT_CONFIGS + (LONG_CAP,)),
    Scenario("sharegpt-bursty", "a ShareGPT-like mix with bursty arrivals",
             "32 ShareGPT-like requests (lognormal lengths) with bursty gamma arrivals (0.8 req/s, "
             "burstiness 0.3)", _sharegpt_bursty),
    Scenario("power-user", "one user's bursts against three light users (fcfs vs vtc)",
             "a power user sends 64 requests (128 prompt / 32-96 output tokens) in two bursts of 32, 25 s "
             "apart; three light users send 28 short requests (64 / 32 tokens) in turn, one every 1.25 s; "
             "at most 4 requests run at once, so requests queue: whose go first is the fairness rule",
             _power_user, max_num_seqs=4, configs=("fcfs:fairness=fcfs", "vtc:fairness=vtc")),
    Scenario("itl-target", f"ITL targets of {_TARGETS} ms against fixed budgets, on two loads",
             f"the sharegpt-bursty and long-prompts loads, each with the target policy at target_itl_ms="
             f"{_TARGETS}, fixed chunked budgets of 32 to 512 tokens and the no-flag default: which "
             f"configurations keep ITL p99 within each target, and at what TTFT p99", None, configs=ITL_TARGET_CONFIGS,
             loads=("sharegpt-bursty", "long-prompts")),
    Scenario("shared-prefix", "a shared system prompt and multi-turn chats, with and without the prefix cache",
             "24 questions (24-48 tokens, 32 output) behind one 1024-token system prompt, one a second, and 4 chats "
             "of 4 turns that resend their history (192-token opening, then 64-token answers and 32-token "
             "questions; a turn every 6 s): the prefix cache on and off at chunk sizes 128, 512 and 2048",
             _shared_prefix, configs=SHARED_PREFIX_CONFIGS),
)}


def scenarios_help() -> str:
    """``'name' (brief), ...`` over every scenario, for the CLI."""
    return ", ".join(f"'{s.name}' ({s.brief})" for s in SCENARIOS.values())


def scenario_requests(scenario: str | None, workload_path: str | None, tok, seed: int):
    """-> (requests, send offsets, title, description, max_num_seqs of the scenario or None)."""
    if workload_path:
        w = Workload.load(workload_path)
        requests = build_requests(w, tok)
        offsets = ([r.arrival_s or 0.0 for r in requests] if w.dataset == "trace"
                   else arrival_offsets(w.arrival, len(requests), w.seed))
        return requests, offsets, Path(workload_path).stem, f"workload file {workload_path}", None
    if scenario not in SCENARIOS:
        raise ValueError(f"scenario: must be one of {', '.join(SCENARIOS)}, got {scenario!r}")
    sc = SCENARIOS[scenario]
    if sc.build is None:
        raise ValueError(f"scenario: {scenario!r} is several loads ({', '.join(sc.loads)}); "
                         f"`tandem compare` runs each, anything else takes one of them")
    requests, offsets = sc.build(tok, seed)
    return requests, offsets, sc.name, sc.description, sc.max_num_seqs
