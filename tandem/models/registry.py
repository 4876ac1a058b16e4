"""Model families by name; the loader picks the class from ModelSpec.family."""

from __future__ import annotations

import torch

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


def instantiate(spec: ModelSpec, max_positions: int, device: torch.device, dtype: torch.dtype,
                ops: OpTable = REFERENCE) -> CausalLM:
    """``build_model`` on ``device`` in ``dtype``, its parameters uninitialised (a checkpoint, or
    ``randomize``, fills them); buffers such as the rope tables are computed on the CPU in float32
    and then moved."""
    with torch.device("meta"):
        model = build_model(spec, max_positions, ops)
    model.to_empty(device=device)
    model.to(dtype)
    model.reset_buffers(device)
    return model


def randomize(model: CausalLM, seed: int = 0) -> CausalLM:
    """Fill ``model``'s parameters with random values of a trained model's scale (norm scales 1,
    matrices N(0, 0.02)): for timing and what-ifs, where step times do not depend on the values.
    The matrices repeat one block of ``RANDOM_BLOCK`` draws (copying it is ten times faster than
    drawing 270M values; the values' pattern is of no consequence)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    block = torch.empty(RANDOM_BLOCK, device=device).normal_(0.0, 0.02, generator=gen)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.fill_(1.0)  # keeps activations finite
                continue
            flat = p.view(-1)
            for i in range(0, flat.numel(), RANDOM_BLOCK):
                n = min(RANDOM_BLOCK, flat.numel() - i)
                flat[i:i + n].copy_(block[:n])
    return model


RANDOM_BLOCK = 1 << 20 | 7
"""Draws ``randomize`` repeats (an odd length, so rows of a power-of-two width do not repeat)."""
