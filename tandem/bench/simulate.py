"""`tandem simulate`: compare's workloads and report, with every configuration run on the
simulator (the real scheduler on a virtual clock, steps priced by a cost profile) instead of the
model. Seconds instead of minutes, and for machines that are not here (a roofline profile).

Prompts are cut by the scenario builders with the simulator's tokenizer (one token per word,
ids a stable hash of the word), so lengths are exact, a seed reproduces a run, and prompts that
share text share ids (prefix caching sees them as a real tokenizer's would)."""

from __future__ import annotations

import dataclasses

from tandem.bench.compare import run_compare
from tandem.config import EngineConfig, SchedulerConfig
from tandem.sim import SimTokenizer, sim_engine
from tandem.sim.profile import Profile, describe, load_profile


class SimEvaluator:
    """The evaluator compare and tune measure through (``tandem.bench.evaluate``), on the simulator."""

    def __init__(self, profile: Profile, base: SchedulerConfig | None = None) -> None:
        self.profile = profile
        self.base = base or SchedulerConfig()
        self.tokenizer = SimTokenizer(profile.vocab_size)
        self.meta = {"simulated": True, "profile": describe(profile), "profile_info": profile.info}

    def engine(self, overrides: dict):
        p = self.profile
        return sim_engine(dataclasses.replace(self.base, **overrides), p.cost, p.num_kv_blocks, p.block_size,
                          p.max_model_len, overhead=p.overhead, prior=p.prior, vocab_size=p.vocab_size)


def run_simulate(cfg, scheduler: SchedulerConfig | None = None) -> dict:
    """``cfg``: a SimulateConfig; ``scheduler``: the settings configurations override."""
    if not cfg.profile:
        raise ValueError("profile: required (a profile file from `tandem calibrate`, or DEVICE/MODEL such as "
                         "h100-sxm/llama-3.1-8b)")
    evaluator = SimEvaluator(load_profile(cfg.profile), scheduler)
    base = EngineConfig(scheduler=evaluator.base)
    return run_compare(None if cfg.workload else cfg.scenario, cfg.workload, list(cfg.configs), base,
                       cfg.result_dir, list(cfg.goodput), cfg.seed, cfg.max_duration, evaluator=evaluator)
