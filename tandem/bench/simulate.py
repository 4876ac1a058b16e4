"""`tandem simulate`: compare's workloads and report, with every configuration run on the
simulator (the real scheduler on a virtual clock, steps priced by a cost profile) instead of the
model. Seconds instead of minutes, and for machines that are not here (a roofline profile).

Prompts are cut by the scenario builders with the simulator's tokenizer (one token per word,
ids a stable hash of the word), so lengths are exact, a seed reproduces a run, and prompts that
share text share ids (prefix caching sees them as a real tokenizer's would).

A configuration with ``replicas=N`` (and ``routing``, ``routing_imbalance_tokens``,
``routing_stats_period``, as `tandem serve` takes them) runs N simulated engines behind the
serving router (``tandem.sim.replicas``); its report adds requests and prefix hits per replica."""

from __future__ import annotations

import dataclasses

from tandem.bench.compare import run_compare
from tandem.bench.config_keys import split_routing
from tandem.config import EngineConfig, SchedulerConfig, ServerConfig
from tandem.sim import SimTokenizer, sim_engine
from tandem.sim.profile import Profile, describe, load_profile
from tandem.sim.replicas import ReplicatedSimEngine


class SimEvaluator:
    """The evaluator compare and tune measure through (``tandem.bench.evaluate``), on the simulator."""

    def __init__(self, profile: Profile, base: SchedulerConfig | None = None) -> None:
        self.profile = profile
        self.base = base or SchedulerConfig()
        self.tokenizer = SimTokenizer(profile.vocab_size)
        self.meta = {"simulated": True, "profile": describe(profile), "profile_info": profile.info}

    def profile_for(self, overrides: dict) -> Profile:
        """The profile a configuration's steps are priced by (one for all of them here)."""
        return self.profile

    def engine(self, overrides: dict):
        """One simulated engine; with a replica key (``replicas``, ``routing``, ...), that many behind
        a router, the other replica settings `tandem serve`'s defaults."""
        p = self.profile_for(overrides)
        own, routing = split_routing(overrides)
        config = dataclasses.replace(self.base, **own)

        def one():
            return sim_engine(config, p.cost, p.num_kv_blocks, p.block_size, p.max_model_len, overhead=p.overhead,
                              prior=p.prior, vocab_size=p.vocab_size, add_bos=p.add_bos)

        if not routing:
            return one()
        r = ServerConfig(**routing)
        r.validate()
        return ReplicatedSimEngine([one() for _ in range(r.replicas)], r.routing, r.routing_imbalance_tokens,
                                   r.routing_stats_period)


def run_simulate(cfg, scheduler: SchedulerConfig | None = None) -> dict:
    """``cfg``: a SimulateConfig; ``scheduler``: the settings configurations override."""
    if not cfg.profile:
        raise ValueError("profile: required (a profile file from `tandem calibrate`, or DEVICE/MODEL such as "
                         "h100-sxm/llama-3.1-8b)")
    evaluator = SimEvaluator(load_profile(cfg.profile), scheduler)
    base = EngineConfig(scheduler=evaluator.base)
    return run_compare(None if cfg.workload else cfg.scenario, cfg.workload, list(cfg.configs), base,
                       cfg.result_dir, list(cfg.goodput), cfg.seed, cfg.max_duration, evaluator=evaluator)
