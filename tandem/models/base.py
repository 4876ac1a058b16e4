"""What every model family shares: embeddings, a stack of decoder layers, the output head."""

from __future__ import annotations

import torch
from torch import nn

from tandem.models.context import BF16_ROWS, ForwardContext
from tandem.models.layers import RMSNorm, RotaryEmbedding
from tandem.models.spec import ModelSpec
from tandem.ops.dispatch import REFERENCE, OpTable


class CausalLM(nn.Module):
    """Subclasses build ``self.model.layers``; the forward pass is the same for all."""

    def __init__(self, spec: ModelSpec, max_positions: int, ops: OpTable = REFERENCE) -> None:
        super().__init__()
        self.spec = spec
        self.ops = ops
        self.model = nn.Module()
        # ``_weight``: no initial draw, which ``instantiate``'s meta device would route through
        # torch._refs and the import of torch._dynamo (about 3 s of every start; the checkpoint or
        # ``randomize`` fills the table anyway)
        self.model.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size,
                                               _weight=torch.empty(spec.vocab_size, spec.hidden_size))
        self.model.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, unit_offset=bool(spec.norm_unit_offset), ops=ops)
        self.rotary = RotaryEmbedding(spec.rope, spec.head_dim, max_positions)
        self.decode_layers = None
        """``tandem.models.decode_layers.DecodeLayers`` when a decode step's layers run in one C
        call (set by ``tandem.build.load_model`` for w8a8 models), else None."""
        self.bf16_prompt_attention = False
        """The prompts on w8a8's bf16 road attend in bf16 (``OpTable.w8a8_prompt_attention_bf16``;
        set with the weight format by ``tandem.models.quantizers.finish``)."""
        if spec.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def reset_buffers(self, device: torch.device) -> None:
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.reset(device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``input_ids`` [num_tokens] -> final hidden states [num_tokens, hidden]."""
        x = self.embed(input_ids)
        fused = self.decode_layers
        if fused is not None and fused.takes(ctx, x):
            return self.model.norm(fused(x, ctx))
        token = BF16_ROWS.set(ctx.bf16_rows)
        try:
            for layer in self.model.layers:
                x = layer(x, ctx)
        finally:
            BF16_ROWS.reset(token)
        return self.model.norm(x)

    @property
    def fused_argmax(self) -> bool:
        """The output head finds greedy tokens without making the logits (``greedy_tokens``)."""
        return self.ops.fused_head_argmax and bool(getattr(self.lm_head, "fused_argmax", False))

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> int64 [n]: the ops' argmax of ``compute_logits(hidden)``, found inside the
        head's kernel; only where ``fused_argmax``."""
        return self.lm_head.argmax(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Only for the rows that are sampled: [n, hidden] -> float32 [n, vocab]."""
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        return torch.nn.functional.linear(hidden, self.model.embed_tokens.weight).float()
