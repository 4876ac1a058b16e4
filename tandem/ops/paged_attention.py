"""Attention over a paged KV cache for a flattened batch.

A step's tokens arrive flattened, ``[num_tokens, ...]``, mixing prefill chunks and decodes. The
metadata built once per step (``AttentionMetadata``) maps them into padded per-sequence groups
(decodes in one group, prompt chunks in groups of similar shape, ``prompt_sets``, so a long
chunk pads neither the decodes nor a short chunk to its length) and gathers each sequence's keys
through its block table. Masks encode causality, each sequence's context length and, for
sliding-window layers, the window. No Python loop runs over the sequences of a group inside the
forward pass. A prompt group is computed in tiles of ``QUERY_TILE`` queries, each against only the
keys some query of the tile may see (up to the tile's last position; for a sliding-window layer,
from the window's start at the tile's first), so a long chunk costs its causal pairs, not every
(query, key) pair, and a sliding-window layer its window. Where the op table has a
decode-attention kernel (on the CPU in float32 or bfloat16: ``tandem/kernels/decode_attention.c``
and its bf16 form), the decode group (one query per sequence) instead runs it: keys and values
read through the block tables directly, no gathered copy and no mask. A prompt group on w8a8's
bf16 road (``OpTable.w8a8_prompt_attention_bf16``, AMX CPUs) runs its SDPA calls in bf16, in tiles
of ``BF16_QUERY_TILE``; such prompts group only with each other. Where the op table says so
(``OpTable.prompt_attention_matmul``: AMD CPUs with AVX-512), float32 prompt groups run as oneDNN
matmuls instead of SDPA, each sequence on its own (``tandem.ops.matmul_attention``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from typing import Callable

import torch
import torch.nn.functional as F

from tandem.ops.matmul_attention import matmul_attention

QUERY_TILE = 64
"""Queries of a prompt group per SDPA call: small enough that the keys a tile skips (past its last
query, before a sliding window) are most of what a long chunk would otherwise compute. Torch's
CPU flash kernel computes every (query, key) pair of a call, causal or not; with 64-query tiles
a 256-token prompt computes 62% of its grid (at 256: all of it). Measured on the Zen 5
(``benchmarks/attention_tiles.py``, default mode; docs/results/amd-epyc-zen5/attention-tiles.json):
two 256-token prompts in one step 283 ms at tile 256, 263 at 128, 269 at 64; one 1024-token
prompt 657, 639 and 627 ms."""

BF16_QUERY_TILE = 256
"""The same for a bf16 group (``AttentionGroup.bf16``): AMX tiles make the skipped keys cheap and
the calls' fixed cost dear. Measured on a Xeon with AMX (``benchmarks/roofline.py --quantization
w8a8``, prefill tok/s at chunks 256 / 1024, runs alternated): tile 64 2,083 / 2,228, 128
2,220–2,226 / 2,274–2,345, 256 2,250–2,337 / 2,383–2,539, 512 2,307 / 2,489."""

PAD_SLACK = 1.5
"""How much padding a prompt group may carry: its padded (query, key) grid at most this many times
the pairs its chunks hold. A chunk that would pad more starts a group of its own: a 41-token chunk
at position 1024 beside a 193-token prompt would otherwise pad both to 193 queries and 1,065 keys
(a step twice as slow as the two apart on the Zen 5 this was measured on)."""


@dataclass
class AttentionGroup:
    """One padded group of sequences. What every path reads is built with the group; the key
    slots and masks, which only the gather + SDPA path reads, are built on first use and kept,
    so a decode group that the decode kernel runs never builds them."""

    token_index: torch.Tensor  # [S * Q] flat token index per (sequence, query slot); padding -> 0
    valid: torch.Tensor  # [S, Q] bool, False for padding
    out_index: torch.Tensor  # [n_valid] flat token index of each valid (sequence, query) slot
    valid_rows: torch.Tensor | None  # [n_valid] position of each valid slot in [S * Q]; None: all valid
    block_tables: torch.Tensor  # [S, num_blocks] int64, cache block of each sequence's positions
    context_lens: torch.Tensor  # [S] int64, keys each sequence attends to (start + its tokens)
    min_start: int = 0  # the group's smallest and largest chunk start: query slot q of any
    max_start: int = 0  # sequence sits at a position in [min_start + q, max_start + q]
    block_size: int = 16
    sliding_window: int | None = None
    num_keys: int = 1  # key positions of the group's padded grid: its longest context
    bf16: bool = False  # a prompt group whose SDPA runs in bf16 (w8a8's bf16 road on AMX)

    @cached_property
    def kv_slots(self) -> torch.Tensor:
        """[S, K] cache slot per (sequence, key position); padding -> 0."""
        kv_pos = self._kv_pos
        return self.block_tables[:, kv_pos // self.block_size] * self.block_size + kv_pos % self.block_size

    @cached_property
    def mask_full(self) -> torch.Tensor:
        """[S, 1, Q, K] bool, True = may attend: causal, within each sequence's context."""
        kv_pos = self._kv_pos[None, None, :]
        return ((kv_pos <= self._q_pos[:, :, None]) & (kv_pos < self.context_lens[:, None, None]))[:, None]

    @cached_property
    def mask_sliding(self) -> torch.Tensor | None:
        """The same with the sliding window applied; None without a window."""
        if self.sliding_window is None:
            return None
        return self.mask_full & (self._kv_pos > self._q_pos[:, :, None] - self.sliding_window)[:, None]

    @cached_property
    def spans(self) -> list[tuple[int, int]]:
        """(start position, valid queries) of each sequence, as Python ints."""
        lens = self.valid.sum(1)
        return list(zip((self.context_lens - lens).tolist(), lens.tolist()))

    @cached_property
    def _kv_pos(self) -> torch.Tensor:
        return torch.arange(self.num_keys, device=self.block_tables.device)

    @cached_property
    def _q_pos(self) -> torch.Tensor:
        """[S, Q] position of each query slot; a padding query sits at position 0 so it still sees
        one key and softmax stays finite."""
        starts = self.context_lens - self.valid.sum(1)
        q_slot = torch.arange(self.valid.shape[1], device=self.valid.device)
        return torch.where(self.valid, starts[:, None] + q_slot[None, :], 0)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] cache slot each new token's K/V is written to
    groups: list[AttentionGroup]
    num_tokens: int
    block_size: int
    sliding_window: int | None


def build_metadata(
    seqs: list[tuple[int, int, list[int]]],
    block_size: int,
    sliding_window: int | None,
    device: torch.device,
    bf16: list[bool] | None = None,
) -> AttentionMetadata:
    """``seqs``: per sequence ``(start, num_tokens, block_table)``, in flattened order. ``bf16``:
    per sequence, whether its prompt attends in bf16; such prompts group only with each other, so
    a prompt's arithmetic never depends on its step mates."""
    slot_mapping: list[int] = []
    offsets = []
    offset = 0
    for start, n, table in seqs:
        offsets.append(offset)
        for p in range(start, start + n):
            slot_mapping.append(table[p // block_size] * block_size + p % block_size)
        offset += n
    decode = [i for i, (_, n, _) in enumerate(seqs) if n == 1]
    in_bf16 = bf16 or [False] * len(seqs)
    sets: list[tuple[list[int], bool]] = [(decode, False)] if decode else []
    for road in (False, True):
        prefill = [i for i, (_, n, _) in enumerate(seqs) if n > 1 and in_bf16[i] == road]
        sets.extend((idx, road) for idx in prompt_sets([(seqs[i][0], seqs[i][1]) for i in prefill], prefill))
    groups = [
        _group([seqs[i] for i in idx], [offsets[i] for i in idx], block_size, sliding_window, device, road)
        for idx, road in sets
    ]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
        groups=groups,
        num_tokens=offset,
        block_size=block_size,
        sliding_window=sliding_window,
    )


def prompt_sets(spans: list[tuple[int, int]], ids: list[int], slack: float | None = None) -> list[list[int]]:
    """Prompt chunks ``(start, tokens)`` (named by ``ids``) split into groups that pad little: in
    order of context length, a chunk joins the current group while the group's padded (query, key)
    grid stays within ``slack`` (default ``PAD_SLACK``) times the pairs its chunks hold; equal
    chunks stay one group."""
    slack = PAD_SLACK if slack is None else slack
    out: list[list[int]] = []
    group: list[tuple[int, int, int]] = []
    for i, (start, n) in sorted(zip(ids, spans), key=lambda t: (t[1][0] + t[1][1], t[1][1])):
        trial = group + [(i, start, n)]
        q = max(m for _, _, m in trial)
        k = max(a + m for _, a, m in trial)
        held = sum(m * (a + m) for _, a, m in trial)
        if group and len(trial) * q * k > slack * held:
            out.append([j for j, _, _ in group])
            trial = [(i, start, n)]
        group = trial
    if group:
        out.append([j for j, _, _ in group])
    return out


def _group(
    seqs: list[tuple[int, int, list[int]]],
    offsets: list[int],
    block_size: int,
    sliding_window: int | None,
    device: torch.device,
    bf16: bool = False,
) -> AttentionGroup:
    starts = [s for s, _, _ in seqs]
    lens = [n for _, n, _ in seqs]
    ends = [s + n for s, n in zip(starts, lens)]
    num_q = max(lens)
    num_blocks = -(-max(ends) // block_size)
    tables = []
    for _, _, table in seqs:
        used = list(table[:num_blocks])
        tables.append(used + [0] * (num_blocks - len(used)))
    common = dict(block_tables=torch.tensor(tables, dtype=torch.long, device=device),
                  context_lens=torch.tensor(ends, dtype=torch.long, device=device),
                  min_start=min(starts), max_start=max(starts), block_size=block_size,
                  sliding_window=sliding_window, num_keys=max(ends), bf16=bf16)
    if num_q == 1:  # decodes: one query each, no padding
        index = torch.tensor(offsets, dtype=torch.long, device=device)
        return AttentionGroup(token_index=index, valid=torch.ones(len(seqs), 1, dtype=torch.bool, device=device),
                              out_index=index, valid_rows=None, **common)
    q_slot = torch.arange(num_q)
    valid = q_slot[None, :] < torch.tensor(lens, dtype=torch.long)[:, None]  # [S, Q]
    token_index = torch.where(valid, torch.tensor(offsets, dtype=torch.long)[:, None] + q_slot[None, :], 0)
    return AttentionGroup(
        token_index=token_index.reshape(-1).to(device),
        valid=valid.to(device),
        out_index=token_index[valid].to(device),
        valid_rows=None if bool(valid.all()) else valid.reshape(-1).nonzero().squeeze(1).to(device),
        **common,
    )


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_slots, KVH, D], this step's keys already written (OpTable.qkv_to_cache)
    v_cache: torch.Tensor,  # [num_slots, KVH, D]
    meta: AttentionMetadata,
    scale: float,
    sliding: bool,
    decode_kernel: Callable[..., None] | None = None,
    matmul_prompts: bool = False,
) -> torch.Tensor:
    """``decode_kernel``: the op table's decode attention (``OpTable.decode_attention``), used for
    the group of one-query sequences; None runs every group through gather + SDPA.
    ``matmul_prompts`` (``OpTable.prompt_attention_matmul``): float32 prompt groups run as oneDNN
    matmuls, each sequence on its own (``tandem.ops.matmul_attention``)."""
    out = q.new_empty(q.shape)
    for g in meta.groups:
        s, n_q = g.valid.shape
        if n_q == 1 and decode_kernel is not None:
            window = meta.sliding_window if sliding and meta.sliding_window else 0
            decode_kernel(q, k_cache, v_cache, g.block_tables, g.context_lens, g.token_index, out,
                          meta.block_size, window, scale)
            continue
        # index_select copies rows several times faster than advanced indexing on the CPU.
        n_k = g.kv_slots.shape[1]
        slots = g.kv_slots.reshape(-1)
        qg = q.index_select(0, g.token_index).view(s, n_q, *q.shape[1:]).transpose(1, 2)  # [S, H, Q, D]
        kg = k_cache.index_select(0, slots).view(s, n_k, *k_cache.shape[1:]).transpose(1, 2)  # [S, KVH, K, D]
        vg = v_cache.index_select(0, slots).view(s, n_k, *v_cache.shape[1:]).transpose(1, 2)
        if g.bf16:
            qg, kg, vg = qg.to(torch.bfloat16), kg.to(torch.bfloat16), vg.to(torch.bfloat16)
        windowed = sliding and g.mask_sliding is not None
        mask = g.mask_sliding if windowed else g.mask_full
        window = meta.sliding_window if windowed else None
        tile = BF16_QUERY_TILE if g.bf16 else QUERY_TILE
        if matmul_prompts and n_q > 1 and not g.bf16 and qg.dtype == torch.float32:
            o = matmul_attention(qg, kg, vg, mask, g.spans, scale, window)
        elif n_q <= tile and not window:
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale, enable_gqa=True)
        else:
            o = qg.new_empty(qg.shape)
            for q0 in range(0, n_q, tile):
                q1 = min(n_q, q0 + tile)
                # every valid query of the tile sees its own position, which lies in [k0, k1)
                k1 = min(n_k, g.max_start + q1)
                k0 = max(0, g.min_start + q0 - window + 1) if window else 0
                o[:, :, q0:q1] = F.scaled_dot_product_attention(
                    qg[:, :, q0:q1], kg[:, :, k0:k1], vg[:, :, k0:k1], attn_mask=mask[:, :, q0:q1, k0:k1],
                    scale=scale, enable_gqa=True)
        o = o.transpose(1, 2).reshape(s * n_q, *q.shape[1:]).to(q.dtype)
        if g.valid_rows is not None:
            o = o.index_select(0, g.valid_rows)
        out.index_copy_(0, g.out_index, o)  # [n_valid, H, D]
    return out
