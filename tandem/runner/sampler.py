"""Token sampling for the rows of a step that sample: greedy, temperature, top-k, top-p, seeds,
and logprobs of the sampled token with the top alternatives.

Sampling uses the exponential-race form of the categorical draw (argmax of p / E with
E ~ Exp(1)), so every row can take its noise from its own seeded generator while the rest of
the work stays batched. A request's generator lives as long as the request, so the same seed
gives the same output whatever else shares its steps.

Nothing one request asks for can make ``sample`` raise for the batch: any 64-bit seed is taken
(signed seeds as their two's complement, as torch does), ``top_k`` and ``logprobs`` are capped
at the vocabulary and ``top_p`` always keeps the most likely token. Every generator a step needs
is made before any noise is drawn, so a step that fails (and is retried by the engine without
its culprit) has advanced no request's generator, and its tokens reach no request's history
(``penalties.TokenHistory``) before every row is drawn.

Rows that ask for logit processing (``penalties.py``) are processed apart and put back; every
other row is sampled from its logits exactly as if no such row shared the step. Rows with an
output constraint are then masked to what their grammar allows (``grammar_matchers``); where the
processing had masked every token the grammar allows, the grammar's mask alone applies to the
unprocessed row, so the grammar always wins. ``min_p`` narrows
a random row's draw after temperature, as vLLM does; it changes no greedy choice. The logprobs
returned are those of the unprocessed logits (vLLM's default ``raw_logprobs``).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from tandem.core.request import TokenLogprob
from tandem.core.sampling_params import SamplingParams
from tandem.core.step import ScheduledChunk
from tandem.ops.reference import argmax_rows
from tandem.runner import penalties
from tandem.runner.grammar import GrammarCompiler
from tandem.runner.grammar_matchers import GrammarMatchers


_SEED_MASK = (1 << 64) - 1


class Sampler:
    def __init__(self, device: torch.device, default_seed: int,
                 argmax: Callable[[torch.Tensor], torch.Tensor] = argmax_rows,
                 eos_token_ids: Sequence[int] = (), grammar: GrammarCompiler | None = None) -> None:
        """``argmax``: the op table's row argmax (``OpTable.argmax_rows``); ``eos_token_ids``: what
        ``min_tokens`` masks besides a request's stop_token_ids; ``grammar``: compiles output
        constraints (without one, a constrained request fails)."""
        self.device = device
        self._argmax = argmax
        self.eos_token_ids = tuple(eos_token_ids)
        self.history = penalties.TokenHistory(device)
        self.grammars = GrammarMatchers(grammar) if grammar is not None else None
        self._generators: dict[str, torch.Generator] = {}
        self._default = torch.Generator(device=device)
        self._default.manual_seed(default_seed)

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self.history.forget(request_id)
        if self.grammars is not None:
            self.grammars.forget(request_id)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._default
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed & _SEED_MASK)
            self._generators[request_id] = gen
        return gen

    @staticmethod
    def argmax_only(chunks: Sequence[ScheduledChunk]) -> bool:
        """Every row takes its most likely token from the unprocessed logits and wants nothing else
        of them (no logprobs, no logit processing, no constraint): the head's argmax is the answer."""
        return all(c.sampling.greedy and c.sampling.logprobs is None and c.sampling.constraint is None
                   and not c.sampling.processes_logits(c.end - c.num_prompt_tokens) for c in chunks)

    def take(self, token_ids: list[int], chunks: Sequence[ScheduledChunk]) -> tuple[list[int], list[None]]:
        """The tokens of an ``argmax_only`` step, chosen outside (the head's argmax), recorded as
        ``sample`` records its own."""
        self._record([c.request_id for c in chunks], token_ids)
        return token_ids, [None] * len(token_ids)

    def _record(self, request_ids: list[str], token_ids: list[int]) -> None:
        self.history.record(request_ids, token_ids)
        if self.grammars is not None:
            self.grammars.accept(request_ids, token_ids)

    def sample(
        self, logits: torch.Tensor, chunks: Sequence[ScheduledChunk]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """``logits``: float32 [n, vocab], one row per sampling chunk -> one token id (and
        optional logprobs) per row."""
        n, vocab = logits.shape
        request_ids = [c.request_id for c in chunks]
        params = [c.sampling for c in chunks]
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw = logits[want] if want else None  # logprobs are the unprocessed logits' (a copy of those rows)
        work = self._processed(logits, chunks)
        chosen = self._argmax(work)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            idx = torch.tensor(random_rows, device=logits.device)
            rows = work[idx]
            temps = torch.tensor([params[i].temperature for i in random_rows], device=logits.device)
            rows = _filter_min_p(rows / temps[:, None], [params[i].min_p for i in random_rows])
            rows = _filter_top_k_top_p(
                rows,
                [params[i].top_k for i in random_rows],
                [params[i].top_p for i in random_rows],
            )
            gens = [self._generator(request_ids[i], params[i]) for i in random_rows]
            probs = torch.softmax(rows, dim=-1)
            noise = torch.empty_like(probs)
            for j, gen in enumerate(gens):
                noise[j].exponential_(generator=gen)
            chosen[idx] = (probs / noise).argmax(dim=-1)
        token_ids = chosen.tolist()
        logprobs: list[TokenLogprob | None] = [None] * n
        if raw is not None:
            lp = torch.log_softmax(raw, dim=-1)
            k = min(max(params[i].logprobs for i in want), vocab)
            top_v, top_i = lp.topk(k, dim=-1) if k > 0 else (None, None)
            for j, i in enumerate(want):
                kk = min(params[i].logprobs, k)
                top = []
                if kk:
                    top = list(zip(top_i[j, :kk].tolist(), top_v[j, :kk].tolist()))
                logprobs[i] = TokenLogprob(token_ids[i], float(lp[j, token_ids[i]]), top)
        self._record(request_ids, token_ids)
        return token_ids, logprobs

    def _processed(self, logits: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """``logits`` (the runner's, the sampler's to change) with the rows that ask for processing
        processed in place: a [rows, vocab] copy of a step's logits costs milliseconds at a large
        vocabulary, so only the rows that must be kept are copied."""
        rows = [i for i, c in enumerate(chunks) if c.sampling.constraint is not None]
        penalized = self._penalize(logits, chunks, keep=rows)
        if not rows:
            return logits
        if self.grammars is None:
            raise RuntimeError("structured outputs: this runner has no grammar compiler")
        constrained = [chunks[i] for i in rows]
        if len(rows) == len(chunks):
            self.grammars.mask(logits, constrained)
        else:
            idx = torch.tensor(rows, device=logits.device)
            logits.index_copy_(0, idx, self.grammars.mask(logits[idx], constrained))
        # where the other rules masked every token the grammar allows, the grammar's mask alone applies
        for i, before in penalized.items():
            if bool(torch.isneginf(logits[i]).all()):
                logits[i] = self.grammars.mask(before[None], [chunks[i]])[0]
        return logits

    def _penalize(self, logits: torch.Tensor, chunks: Sequence[ScheduledChunk], keep: Sequence[int]) -> dict[int, torch.Tensor]:
        """Apply the logit processing of ``penalties`` in place; returns the unprocessed row of each
        row in ``keep`` that it changed."""
        num_output = [c.end - c.num_prompt_tokens for c in chunks]
        rows = [i for i, c in enumerate(chunks) if c.sampling.processes_logits(num_output[i])]
        if not rows:
            return {}
        kept = {i: logits[i].clone() for i in set(rows).intersection(keep)}
        histories = [self.history.prepare(chunks[i]) if penalties.needs_history(chunks[i].sampling) else None
                     for i in rows]
        idx = torch.tensor(rows, device=logits.device)
        done = penalties.process(logits[idx], [chunks[i].sampling for i in rows], [num_output[i] for i in rows],
                                 histories, self.eos_token_ids)
        logits.index_copy_(0, idx, done)
        return kept


def _filter_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Mask what is less likely than ``min_p`` times the row's most likely token."""
    if not any(min_p):
        return logits
    probs = torch.softmax(logits, dim=-1)
    floor = torch.tensor(min_p, device=logits.device, dtype=logits.dtype)[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < floor, float("-inf"))


def _filter_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) what falls outside each row's top-k and nucleus (top-p)."""
    if all(k == -1 for k in top_k) and all(p >= 1.0 for p in top_p):
        return logits
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ks = torch.tensor([vocab if k == -1 else min(k, vocab) for k in top_k], device=logits.device)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    drop = rank >= ks[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    ps = torch.tensor(top_p, device=logits.device, dtype=torch.float32)
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep a token while the mass before it is below p; the top token stays whatever p is (a p
    # that rounds to 0 in float32 would otherwise mask the whole row).
    before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill((before >= ps[:, None]) & (rank > 0), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, sorted_idx, sorted_logits)
