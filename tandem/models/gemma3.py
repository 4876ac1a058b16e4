"""Gemma 3 (text): scaled embeddings, four norms per layer with a unit offset, q/k norm,
sliding-window layers with their own rope base, GELU-tanh MLP, tied output head."""

from __future__ import annotations

import torch
from torch import nn

from tandem.models.base import CausalLM
from tandem.models.context import ForwardContext
from tandem.models.layers import Attention, GatedMLP, RMSNorm, RotaryEmbedding
from tandem.models.spec import ModelSpec
from tandem.ops.dispatch import OpTable


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int, rotary: RotaryEmbedding, ops: OpTable) -> None:
        super().__init__()
        eps = spec.rms_norm_eps
        self.self_attn = Attention(spec, layer, rotary, ops)
        self.mlp = GatedMLP(spec.hidden_size, spec.intermediate_size, spec.hidden_act, ops)
        self.input_layernorm = RMSNorm(spec.hidden_size, eps, unit_offset=True, ops=ops)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, eps, unit_offset=True, ops=ops)
        self.pre_feedforward_layernorm = RMSNorm(spec.hidden_size, eps, unit_offset=True, ops=ops)
        self.post_feedforward_layernorm = RMSNorm(spec.hidden_size, eps, unit_offset=True, ops=ops)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), ctx))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, spec: ModelSpec, max_positions: int, ops: OpTable) -> None:
        super().__init__(spec, max_positions, ops)
        assert spec.rope_local is not None, "gemma3 spec without a local rope"
        self._embed_scale: dict[torch.dtype, torch.Tensor] = {}  # sqrt(hidden) per dtype, made once
        self.rotary_local = RotaryEmbedding(spec.rope_local, spec.head_dim, max_positions)
        self.model.layers = nn.ModuleList(
            Gemma3DecoderLayer(spec, i, self.rotary_local if spec.is_sliding(i) else self.rotary, ops)
            for i in range(spec.num_layers)
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        # The scale is rounded to the weights' dtype, as the reference implementation does.
        scale = self._embed_scale.get(x.dtype)
        if scale is None:
            scale = self._embed_scale[x.dtype] = torch.tensor(self.spec.hidden_size**0.5, dtype=x.dtype)
        return x * scale
