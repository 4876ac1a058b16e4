"""Copy named checkpoint tensors into a model's parameters, checking that nothing is missing.

A checkpoint's separate projections (``q_proj``, ``k_proj``, ``v_proj``; ``gate_proj``,
``up_proj``) land in row ranges of the model's merged ones (``MergedLinear``).
"""

from __future__ import annotations

from typing import Iterable

import torch

from tandem.models.base import CausalLM
from tandem.models.layers import MergedLinear

# Checkpoint entries that carry no parameter of ours.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _targets(model: CausalLM) -> dict[str, torch.Tensor]:
    """Checkpoint name -> the tensor (a parameter or rows of one) it is copied into."""
    targets = dict(model.named_parameters())
    for path, module in model.named_modules():
        if not isinstance(module, MergedLinear):
            continue
        parent = path.rpartition(".")[0]
        for attr in ("weight", "bias"):
            param = getattr(module, attr)
            if param is None:
                continue
            del targets[f"{path}.{attr}"]
            for part in module.parts:
                targets[f"{parent}.{part}.{attr}"] = param.data[module.part_rows(part)]
    return targets


def load_weights(model: CausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    params = _targets(model)
    loaded: set[str] = set()
    for name, tensor in weights:
        if name.startswith("language_model."):  # multimodal Gemma 3 checkpoints
            name = name[len("language_model.") :]
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and model.lm_head is None:
            continue  # tied to the embeddings
        param = params.get(name)
        if param is None:
            if name.startswith(("vision_tower.", "multi_modal_projector.")):
                continue
            raise ValueError(f"model: checkpoint tensor {name!r} matches no parameter of {type(model).__name__}")
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(
                f"model: checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor.to(param.dtype))
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"model: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
