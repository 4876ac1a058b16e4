"""The model runner: turns a SchedulerOutput into one forward pass and sampled tokens.

``execute()`` is the only method the scheduling core relies on. It flattens the step's chunks
into ``input_ids``/``positions``, builds the attention metadata once, runs the model, computes
logits only for the rows that sample, and samples them.
"""

from __future__ import annotations

import time

import torch

from tandem.core.step import KVLayout, RunnerOutput, SampledToken, SchedulerOutput
from tandem.models.base import CausalLM
from tandem.models.context import ForwardContext, bf16_prompt_attention, bf16_prompt_rows, row_split
from tandem.ops.dispatch import BF16_TILE_ROWS
from tandem.ops.paged_attention import build_metadata
from tandem.runner.grammar import GrammarCompiler
from tandem.runner.sampler import Sampler


def kv_bytes_per_block(model: CausalLM, block_size: int, dtype: torch.dtype) -> int:
    spec = model.spec
    elem = dtype.itemsize
    return spec.num_layers * 2 * block_size * spec.num_kv_heads * spec.head_dim * elem


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        layout: KVLayout,
        device: torch.device,
        dtype: torch.dtype,
        seed: int = 0,
        eos_token_ids: tuple[int, ...] = (),
        grammar: GrammarCompiler | None = None,
    ) -> None:
        self.model = model
        self.layout = layout
        self.device = device
        self.dtype = dtype
        spec = model.spec
        # [layer, k/v, slot, kv_head, head_dim]
        self.kv_cache = torch.zeros(
            spec.num_layers, 2, layout.num_slots, spec.num_kv_heads, spec.head_dim,
            dtype=dtype, device=device,
        )
        self.sliding_window = spec.sliding_window if any(spec.is_sliding(i) for i in range(spec.num_layers)) else None
        self.grammar = grammar
        self.prompt_tile = BF16_TILE_ROWS if model.ops.w8a8_prompt_bf16_tokens is not None else 1
        """Rows a long prompt's chunk is multiplied in (w8a8's bf16 road: whole tiles, the last
        padded), so a chunk of a few tokens costs what a tile costs; 1: any row count."""
        self.sampler = Sampler(device, seed, model.ops.argmax_rows, eos_token_ids, grammar)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        for request_id in out.finished_ids:
            self.sampler.forget(request_id)
        input_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        bf16_limit = self.model.ops.w8a8_prompt_bf16_tokens
        bf16_rows: list[int] = []
        bf16_attention: list[bool] = []  # per chunk: its attention in bf16 (w8a8's bf16 road, on AMX)
        for chunk in out.chunks:
            rows = bf16_prompt_rows(len(input_ids), chunk.start, chunk.num_tokens, chunk.num_prompt_tokens,
                                    chunk.is_decode, bf16_limit)
            bf16_rows.extend(rows)
            bf16_attention.append(bf16_prompt_attention(self.model.bf16_prompt_attention, rows))
            input_ids.extend(chunk.token_ids)
            positions.extend(chunk.positions)
            if chunk.samples:
                sample_rows.append(len(input_ids) - 1)
        meta = build_metadata(
            [(c.start, c.num_tokens, c.block_table) for c in out.chunks],
            self.layout.block_size,
            self.sliding_window,
            self.device,
            bf16_attention,
        )
        ctx = ForwardContext(
            meta=meta,
            kv_cache=self.kv_cache,
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            bf16_rows=row_split(bf16_rows, len(input_ids), self.device),
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        sampling = [c for c in out.chunks if c.samples]
        # every row greedy and wanting nothing else of its logits: the head's argmax, inside its
        # kernel where it can (no [rows, vocab] table written and read back)
        argmax_only = bool(sampling) and self.model.fused_argmax and self.sampler.argmax_only(sampling)
        start = time.perf_counter()
        hidden = self.model(ids, ctx)
        logits = greedy = None
        if argmax_only:
            greedy = self.model.greedy_tokens(hidden.index_select(0, rows))
        elif sample_rows:
            logits = self.model.compute_logits(hidden.index_select(0, rows))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        model_seconds = time.perf_counter() - start
        sampled: dict[str, SampledToken] = {}
        if sampling:
            tokens, logprobs = (self.sampler.take(greedy.tolist(), sampling) if greedy is not None
                                else self.sampler.sample(logits, sampling))
            for chunk, tok, lp in zip(sampling, tokens, logprobs):
                sampled[chunk.request_id] = SampledToken(tok, lp)
        return RunnerOutput(sampled=sampled, forward_seconds=model_seconds)
