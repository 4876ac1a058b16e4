"""What the quantization tests share: the kernels for a paths test, a model's logits for one
prefill, a float model given a quantized model's rounded weights, and greedy generation checked
for batch independence."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM
from tandem.kernels import native
from tandem.models import quant
from tandem.models.context import ForwardContext
from tandem.ops.paged_attention import build_metadata
from tiny_models import greedy_together_and_alone, save_tiny


def path_kernels(monkeypatch, use_kernels: bool, k: int) -> native.Kernels | None:
    """The kernels a matmul-paths test runs on (None: plain torch; skipped where none run), with
    the blocked path cut into several row blocks even for a small weight of ``k`` columns."""
    if use_kernels and not native.available():
        pytest.skip("no native kernel here")
    monkeypatch.setattr(quant, "DEQUANT_ELEMENTS", 64 * k)
    return native.best() if use_kernels else None


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


def assert_greedy_is_batch_independent(tmp_path, quantization: str) -> None:
    """Greedy tokens of five prompts generated together equal those generated one at a time."""
    save_tiny("gemma3", tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", quantization=quantization, max_num_batched_tokens=16)
    together, alone = greedy_together_and_alone(llm)
    assert together == alone
    assert llm.engine.allocator.all_free()
