"""What every layer needs for one step, built once per step by the runner and passed explicitly
(no module-level state)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.ops.paged_attention import AttentionMetadata


@dataclass
class ForwardContext:
    meta: AttentionMetadata
    kv_cache: torch.Tensor  # [num_layers, 2, num_slots, num_kv_heads, head_dim]
    positions: torch.Tensor  # [num_tokens]
    rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """cos/sin rows for ``positions``, per rotary table, looked up once per step."""
