"""Model families by name; the loader picks the class from ModelSpec.family."""

from __future__ import annotations

from tandem.models.base import CausalLM
from tandem.models.gemma3 import Gemma3ForCausalLM
from tandem.models.llama import LlamaForCausalLM
from tandem.models.spec import ModelSpec
from tandem.ops.dispatch import REFERENCE, OpTable

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "gemma3": Gemma3ForCausalLM,
}


def build_model(spec: ModelSpec, max_positions: int, ops: OpTable = REFERENCE) -> CausalLM:
    """The model of ``spec.family``, its layers running the ops in ``ops``."""
    try:
        cls = MODEL_REGISTRY[spec.family]
    except KeyError:
        raise ValueError(f"model: unsupported architecture family {spec.family!r}") from None
    return cls(spec, max_positions, ops)
