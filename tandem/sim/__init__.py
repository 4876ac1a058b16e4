"""A simulator: the real scheduling core on a virtual clock, with a runner whose step time is a
cost model instead of a forward pass. `tandem simulate` runs compare's workloads through it with a
cost profile (``profile``: measured by `tandem calibrate` from ``design``'s steps, or a
``roofline`` of a model spec on a device, checked by ``schema``); tests use it to check the tuner
and the policies on cases whose answer is known. No torch.
"""

from tandem.sim.runner import Cost, SimRunner, SimTokenizer, StepCost, VirtualClock, sim_engine

__all__ = ["Cost", "StepCost", "SimRunner", "SimTokenizer", "VirtualClock", "sim_engine"]
