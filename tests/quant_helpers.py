"""What the quantization tests share: a model's logits for one prefill, and a float model given a
quantized model's rounded weights."""

from __future__ import annotations

import torch

from tandem.models.context import ForwardContext
from tandem.ops.paged_attention import build_metadata


def prefill_logits(loaded, ids: torch.Tensor) -> torch.Tensor:
    """Logits at every position of one prefill over ``ids`` with a fresh paged KV cache."""
    spec = loaded.spec
    block = 4
    n_blocks = -(-len(ids) // block)
    cache = torch.zeros(spec.num_layers, 2, n_blocks * block, spec.num_kv_heads, spec.head_dim)
    meta = build_metadata([(0, len(ids), list(range(n_blocks)))], block, spec.sliding_window, torch.device("cpu"))
    with torch.no_grad():
        return loaded.model.compute_logits(loaded.model(ids, ForwardContext(meta, cache, torch.arange(len(ids)))))


def copy_rounded_weights(float_model: torch.nn.Module, quantized: torch.nn.Module) -> None:
    """Give the float model the quantized model's rounded weights (tied embedding table
    included), read back through each quantized layer's ``rows``."""
    qmods = dict(quantized.named_modules())
    with torch.no_grad():
        for name, mod in float_model.named_modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.copy_(qmods[name].rows(torch.arange(mod.out_features)))
        if float_model.lm_head is None:
            table = float_model.model.embed_tokens.weight
            table.copy_(quantized.lm_head.rows(torch.arange(table.shape[0])))
