"""Llama 2/3 and look-alikes (Mistral, SmolLM, TinyLlama), Qwen2 (q/k/v bias) and Qwen3 (q/k norm).

The three differ only in flags of the shared attention layer, read from the ModelSpec.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.models.base import CausalLM
from tandem.models.context import ForwardContext
from tandem.models.layers import Attention, GatedMLP, RMSNorm, RotaryEmbedding
from tandem.models.spec import ModelSpec
from tandem.ops.dispatch import OpTable


class LlamaDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int, rotary: RotaryEmbedding, ops: OpTable) -> None:
        super().__init__()
        self.self_attn = Attention(spec, layer, rotary, ops)
        self.mlp = GatedMLP(spec.hidden_size, spec.intermediate_size, spec.hidden_act, ops)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops=ops)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops=ops)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(CausalLM):
    def __init__(self, spec: ModelSpec, max_positions: int, ops: OpTable) -> None:
        super().__init__(spec, max_positions, ops)
        self.model.layers = nn.ModuleList(
            LlamaDecoderLayer(spec, i, self.rotary, ops) for i in range(spec.num_layers)
        )
