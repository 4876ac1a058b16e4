"""Every knob of `tandem bench`; flags are derived from this dataclass. Names follow
`vllm bench serve` wherever that tool has the same concept."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tandem.bench.presets import ENGINES
from tandem.bench.scenarios import SCENARIOS, scenarios_help
from tandem.bench.workload import DATASETS, DISTS, PROCESSES
from tandem.config import _help

BACKENDS = ("openai", "openai-chat", "inprocess")


SCENARIO_NAMES = tuple(SCENARIOS)


@dataclass(frozen=True)
class BenchConfig:
    backend: str = field(default="openai", metadata=_help(
        "'openai' (/v1/completions of any OpenAI-compatible server), 'openai-chat' "
        "(/v1/chat/completions), or 'inprocess' (tandem's engine in this process, free of HTTP)",
        choices=BACKENDS))
    base_url: str = field(default="http://127.0.0.1:8000", metadata=_help("server to benchmark"))
    endpoint: str | None = field(default=None, metadata=_help(
        "API path; default: /v1/completions, or /v1/chat/completions for openai-chat"))
    model: str | None = field(default=None, metadata=_help(
        "model name sent to the server (default: the first of /v1/models); for the inprocess backend, "
        "the model path (default: the embedded Gemma 3 270M)"))
    tokenizer: str | None = field(default=None, metadata=_help(
        "tokenizer used to build prompts of exact token lengths: a HF model directory or .gguf file "
        "(default: the embedded Gemma 3 270M's; for inprocess, the engine's)"))
    api_key: str | None = field(default=None, metadata=_help("Bearer key (or OPENAI_API_KEY)"))
    workload: str | None = field(default=None, metadata=_help(
        "a workload YAML/JSON file (dataset, classes, arrivals); when given, it replaces the dataset, "
        "length and arrival flags"))
    save_workload: str | None = field(default=None, metadata=_help("write the effective workload to this file"))
    scenario: str | None = field(default=None, metadata=_help(
        "send a built-in scenario of `tandem compare` (its requests at its send times) instead of the dataset, "
        "length and arrival flags: " + ", ".join(SCENARIO_NAMES), choices=SCENARIO_NAMES))
    dataset_name: str = field(default="random", metadata=_help(
        " | ".join(DATASETS), choices=DATASETS))
    dataset_path: str | None = field(default=None, metadata=_help(
        "ShareGPT JSON file; for random/mixed, real text to cut prompts from; for trace, a JSONL of "
        "{timestamp, input_len, output_len[, class]}"))
    num_prompts: int = field(default=100, metadata=_help("number of requests"))
    request_rate: float = field(default=math.inf, metadata=_help("requests per second; inf sends all at once"))
    burstiness: float = field(default=1.0, metadata=_help(
        "gamma shape of inter-arrival times: 1 = Poisson, < 1 burstier, > 1 more regular"))
    arrival: str = field(default="poisson", metadata=_help(
        "arrival process: poisson (gamma with --burstiness) or constant", choices=PROCESSES))
    max_concurrency: int | None = field(default=None, metadata=_help(
        "at most this many requests in flight (with --request-rate inf: a closed loop)"))
    random_input_len: int = field(default=256, metadata=_help("random: mean input tokens"))
    random_output_len: int = field(default=128, metadata=_help("random: mean output tokens"))
    random_range_ratio: float = field(default=0.0, metadata=_help(
        "random, uniform: lengths drawn from [len*(1-r), len*(1+r)]"))
    random_dist: str = field(default="uniform", metadata=_help(
        "random: length distribution (fixed, uniform, normal, lognormal; uniform with ratio 0 is fixed)",
        choices=DISTS))
    random_prefix_len: int = field(default=0, metadata=_help("random: tokens of a prefix shared by all prompts"))
    sharegpt_output_len: int | None = field(default=None, metadata=_help(
        "sharegpt: output tokens per request (default: 256)"))
    ignore_eos: bool = field(default=False, metadata=_help("ask the server to ignore EOS (exact output lengths)"))
    percentile_metrics: str = field(default="ttft,tpot,itl,e2el,stall", metadata=_help(
        "metrics to report percentiles of (ttft, tpot, itl, e2el, stall)"))
    metric_percentiles: str = field(default="50,90,99", metadata=_help("percentiles to report"))
    goodput: tuple[str, ...] = field(default=(), metadata=_help(
        "SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000 (milliseconds)", nargs="+"))
    seed: int = field(default=0, metadata=_help("seed of lengths, prompts and arrivals"))
    result_dir: str = field(default="bench-results", metadata=_help("where result.json and the report go"))
    timeout: float = field(default=600.0, metadata=_help("per-request timeout in seconds"))
    max_duration: float = field(default=3600.0, metadata=_help("the run stops after this many seconds"))
    scrape_interval: float = field(default=0.5, metadata=_help("seconds between /metrics scrapes"))
    sweep: bool = field(default=False, metadata=_help(
        "walk closed-loop concurrency 1, 2, 4, ... until throughput stops growing (saturation)"))
    sweep_max_concurrency: int = field(default=64, metadata=_help("sweep: highest concurrency to try"))
    sweep_gain: float = field(default=0.05, metadata=_help(
        "sweep: stop when doubling concurrency raises output throughput by less than this fraction"))
    label: str | None = field(default=None, metadata=_help("a name for this run in the report"))

    def validate(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        for name in ("num_prompts", "random_input_len", "random_output_len", "sweep_max_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.random_range_ratio < 1:
            raise ValueError(f"random_range_ratio: must be in [0, 1), got {self.random_range_ratio}")
        if self.timeout <= 0 or self.max_duration <= 0:
            raise ValueError("timeout, max_duration: must be > 0")
        metrics = [m for m in self.percentile_metrics.split(",") if m]
        for m in metrics:
            if m not in ("ttft", "tpot", "itl", "e2el", "stall"):
                raise ValueError(f"percentile_metrics: unknown metric {m!r}")
        for q in self.metric_percentiles.split(","):
            try:
                if not 0 <= float(q) <= 100:
                    raise ValueError
            except ValueError:
                raise ValueError(f"metric_percentiles: {q!r} is not a number in [0, 100]") from None

    @property
    def percentiles(self) -> list[float]:
        return [float(q) for q in self.metric_percentiles.split(",") if q]

    @property
    def metrics(self) -> list[str]:
        return [m for m in self.percentile_metrics.split(",") if m]




@dataclass(frozen=True)
class LaunchOptions:
    """How `tandem compare` and `tandem tune` launch the servers they measure (both take these)."""

    server_cmd: str | None = field(default=None, metadata=_help(
        "launch this server command for every configuration (compare's --configs) or trial (tune): placeholders "
        "{port}, {model} and scheduler settings such as {max_num_batched_tokens} and {max_num_seqs}; with "
        "--engine the knobs are added as that engine's flags"))
    engine: str | None = field(default=None, metadata=_help(
        "with --server-cmd: the engine preset that maps tandem's knob names to its flags and says which knobs "
        "exist: " + ", ".join(ENGINES), choices=ENGINES))
    tokenizer: str | None = field(default=None, metadata=_help(
        "launched servers: the tokenizer prompts are cut with (HF directory or .gguf); default: --model's when "
        "it is a local path, else the embedded Gemma 3 270M's"))
    startup_timeout: float = field(default=600.0, metadata=_help(
        "launched servers: seconds a server may take to answer /health (or /v1/models) before its trial fails"))
    stop_timeout: float = field(default=30.0, metadata=_help(
        "launched servers: seconds between SIGTERM to the server's process group and SIGKILL"))


@dataclass(frozen=True)
class CompareConfig(LaunchOptions):
    scenario: str = field(default="equal", metadata=_help(
        "built-in scenario: " + scenarios_help(), choices=SCENARIO_NAMES))
    workload: str | None = field(default=None, metadata=_help("a workload YAML/JSON file instead of a scenario"))
    configs: tuple[str, ...] = field(default=(), metadata=_help(
        "configurations to compare, each KEY=VALUE[,KEY=VALUE] over the scheduler options, optionally "
        "'name:' first; default: the scenario's own set (power-user: fcfs and vtc; itl-target: 50 and 150 ms "
        "targets and fixed budgets; long-prompts: the defaults and a long-prefill cap), else static, "
        "prefill-first, chunked at 128 and 512 tokens", nargs="+"))
    goodput: tuple[str, ...] = field(default=(), metadata=_help(
        "SLOs for goodput, e.g. ttft:2000 tpot:300 (milliseconds)", nargs="+"))
    result_dir: str = field(default="compare-results", metadata=_help("where the report goes"))
    seed: int = field(default=0, metadata=_help("seed of the requests (the same for every configuration)"))
    max_duration: float = field(default=1800.0, metadata=_help("seconds each configuration may run"))
    repeats: int = field(default=1, metadata=_help(
        "runs of every configuration, round by round (each once, then each again); the report gives medians, "
        "each run's figures, and for an ITL target the rounds it won"))
    server: tuple[str, ...] = field(default=(), metadata=_help(
        "NAME=COMMAND: a launched server as one configuration (repeatable; replaces --configs); the command's "
        "{port} (and {model}) placeholders are filled for each run", action="append"))


@dataclass(frozen=True)
class TuneConfig(LaunchOptions):
    scenario: str = field(default="sharegpt-bursty", metadata=_help(
        "built-in scenario to tune against: " + scenarios_help(), choices=SCENARIO_NAMES))
    workload: str | None = field(default=None, metadata=_help("a workload YAML/JSON file instead of a scenario"))
    slo_ttft_ms: float | None = field(default=None, metadata=_help("SLO: p99 time to first token, milliseconds"))
    slo_itl_ms: float | None = field(default=None, metadata=_help("SLO: p99 inter-token latency, milliseconds"))
    chunk_sizes: str = field(default="32,64,128,256,512,1024,2048", metadata=_help(
        "chunk sizes (max_num_batched_tokens) the search may pick from"))
    max_num_seqs_values: str = field(default="4,8,16,32,64", metadata=_help(
        "max_num_seqs values the search may pick from"))
    target_itl_fractions: str = field(default="0.5,0.6,0.7,0.8,0.9,1.0", metadata=_help(
        "with --slo-itl-ms: the ITL targets (target_itl_ms) the search tries beside the budgets, as fractions "
        "of the SLO; empty: budgets only"))
    fixed: str = field(default="", metadata=_help(
        "KEY=VALUE[,KEY=VALUE] scheduler settings every trial gets, e.g. fairness=vtc"))
    replicas_values: str = field(default="", metadata=_help(
        "replica counts to search, comma-separated (e.g. 1,2): each is tuned as a deployment of its own; on a "
        "launched tandem server (--engine tandem) or in the simulator (--simulate)"))
    routing_values: str = field(default="", metadata=_help(
        "routing policies to search with the replica counts above 1 (e.g. round-robin,prefix-aware)"))
    repeats: int = field(default=2, metadata=_help("runs of each leading candidate; judged on the median"))
    max_trials: int = field(default=24, metadata=_help("most distinct configurations to measure"))
    result_dir: str = field(default="tune-results", metadata=_help("where the report goes"))
    seed: int = field(default=0, metadata=_help("seed of the requests"))
    max_duration: float = field(default=1800.0, metadata=_help("seconds each run may take"))
    simulate: str | None = field(default=None, metadata=_help(
        "search in the simulator with this cost profile (a file from `tandem calibrate`, or DEVICE/MODEL), "
        "then confirm the leaders on the real engine"))
    confirm: int = field(default=3, metadata=_help(
        "with --simulate: how many of the best simulated candidates to measure on the real engine (0: none)"))

    def targets(self) -> list[float]:
        """The ITL targets (ms) to try: the fractions of the ITL SLO, one decimal."""
        if not self.slo_itl_ms or not self.target_itl_fractions.strip():
            return []
        try:
            fractions = [float(v) for v in self.target_itl_fractions.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"target_itl_fractions: expected comma-separated numbers, "
                             f"got {self.target_itl_fractions!r}") from None
        if not all(0 < f <= 2 for f in fractions):
            raise ValueError(f"target_itl_fractions: each must be in (0, 2], got {self.target_itl_fractions!r}")
        return sorted({round(f * self.slo_itl_ms, 1) for f in fractions})

    def deployments(self) -> list[dict]:
        """The replica settings each deployment is tuned with ({} for none given)."""
        from tandem.core.routing import ROUTING_POLICIES

        counts = self.grid("replicas_values") if self.replicas_values.strip() else []
        routings = [v.strip() for v in self.routing_values.split(",") if v.strip()]
        for r in routings:
            if r not in ROUTING_POLICIES:
                raise ValueError(f"routing_values: {r!r} is not one of {', '.join(ROUTING_POLICIES)}")
        if routings and not counts:
            raise ValueError("routing_values: needs replicas_values with a count above 1")
        out: list[dict] = []
        for n in counts:
            if n == 1:
                out.append({"replicas": 1})
            else:
                out += [{"replicas": n, "routing": r} for r in routings] or [{"replicas": n}]
        return out or [{}]

    def grid(self, name: str) -> list[int]:
        text = getattr(self, name)
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"{name}: expected comma-separated integers, got {text!r}") from None
        if not values or min(values) < 1:
            raise ValueError(f"{name}: expected positive integers, got {text!r}")
        return values


PROFILE_HELP = ("cost profile: a JSON file written by `tandem calibrate` (or a roofline profile file), or "
                "DEVICE/MODEL for the roofline of a shipped device and model, e.g. h100-sxm/llama-3.1-8b")


@dataclass(frozen=True)
class SimulateConfig:
    scenario: str = field(default="equal", metadata=_help(
        "built-in scenario: " + scenarios_help(), choices=SCENARIO_NAMES))
    workload: str | None = field(default=None, metadata=_help("a workload YAML/JSON file instead of a scenario"))
    configs: tuple[str, ...] = field(default=(), metadata=_help(
        "configurations to simulate, in `tandem compare --configs` syntax; default: the scenario's own set, "
        "else compare's defaults", nargs="+"))
    profile: str | None = field(default=None, metadata=_help(PROFILE_HELP + " (required)"))
    goodput: tuple[str, ...] = field(default=(), metadata=_help(
        "SLOs for goodput, e.g. ttft:2000 tpot:300 (milliseconds)", nargs="+"))
    result_dir: str = field(default="simulate-results", metadata=_help("where the report goes"))
    seed: int = field(default=0, metadata=_help("seed of the requests (the same for every configuration)"))
    max_duration: float = field(default=36000.0, metadata=_help(
        "virtual seconds each configuration may run"))


@dataclass(frozen=True)
class CalibrateConfig:
    output: str = field(default="profile.json", metadata=_help("where the measured cost profile is written"))
    name: str | None = field(default=None, metadata=_help("the profile's name (default: model, dtype and machine)"))
    repeats: int = field(default=5, metadata=_help("timed runs of each designed step; the median counts"))
    max_chunk: int = field(default=2048, metadata=_help("largest prompt chunk in the designed steps"))
    max_batch: int = field(default=64, metadata=_help("largest decode batch in the designed steps"))
    overhead_requests: int = field(default=16, metadata=_help(
        "requests of the short engine run that measures the time per step beyond the forward pass"))
    device_out: str | None = field(default=None, metadata=_help(
        "also write a roofline device description of this machine from its measured peaks to this file"))
    rescale: str | None = field(default=None, metadata=_help(
        "a measured profile of this machine and model: instead of calibrating, time three of its designed "
        "steps again (seconds) and write it with every coefficient scaled by how much slower or faster they "
        "run now"))

    def validate(self) -> None:
        for name in ("repeats", "max_chunk", "max_batch", "overhead_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
