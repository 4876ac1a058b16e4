"""What every layer needs for one step, built once per step by the runner and passed explicitly
(no module-level state)."""

from __future__ import annotations

from contextvars import ContextVar
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
    bf16_rows: "RowSplit | None" = None
    """The token rows w8a8 layers multiply in bf16 (prompt positions of requests with long
    prompts: ``OpTable.w8a8_prompt_bf16_tokens``) and the rest; None: every row in w8a8."""


@dataclass(frozen=True)
class RowSplit:
    """A step's token rows in two sets: ``bf16`` and ``rest`` (ascending row indices); ``rest`` is
    None when every row is in ``bf16``."""

    bf16: torch.Tensor
    rest: torch.Tensor | None


def bf16_prompt_rows(first_row: int, start: int, num_tokens: int, num_prompt_tokens: int, is_decode: bool,
                     limit: int | None) -> range:
    """The token rows of one chunk (rows ``first_row ..``, positions ``start ..``) that take
    w8a8's bf16 road: its prompt positions, when the prompt has at least ``limit`` tokens (a
    decode or a recompute's output positions never do; ``limit`` None: no row does)."""
    if limit is None or is_decode or num_prompt_tokens < limit:
        return range(0)
    return range(first_row, first_row + max(0, min(num_tokens, num_prompt_tokens - start)))


def bf16_prompt_attention(enabled: bool, rows: range) -> bool:
    """Whether a chunk attends in bf16: it has rows on the bf16 road (``bf16_prompt_rows``) and
    the model's prompts on that road attend in bf16 (``CausalLM.bf16_prompt_attention``)."""
    return enabled and len(rows) > 0


def row_split(bf16_rows: list[int], num_rows: int, device: torch.device) -> RowSplit | None:
    """The split for rows ``bf16_rows`` (ascending) of ``num_rows``; None when it is empty."""
    if not bf16_rows:
        return None
    if len(bf16_rows) == num_rows:
        return RowSplit(torch.arange(num_rows, device=device), None)
    chosen = set(bf16_rows)
    rest = [r for r in range(num_rows) if r not in chosen]
    return RowSplit(torch.tensor(bf16_rows, dtype=torch.long, device=device),
                    torch.tensor(rest, dtype=torch.long, device=device))


BF16_ROWS: ContextVar[RowSplit | None] = ContextVar("bf16_rows", default=None)
"""``ForwardContext.bf16_rows`` of the forward pass in progress (set by ``CausalLM.forward`` for
its layers; None outside one): the linear layers are called with their input only."""
