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
its culprit) has advanced no request's generator.
"""

from __future__ import annotations

from typing import Callable

import torch

from tandem.core.request import TokenLogprob
from tandem.core.sampling_params import SamplingParams
from tandem.ops.reference import argmax_rows


_SEED_MASK = (1 << 64) - 1


class Sampler:
    def __init__(self, device: torch.device, default_seed: int,
                 argmax: Callable[[torch.Tensor], torch.Tensor] = argmax_rows) -> None:
        """``argmax``: the op table's row argmax (``OpTable.argmax_rows``)."""
        self.device = device
        self._argmax = argmax
        self._generators: dict[str, torch.Generator] = {}
        self._default = torch.Generator(device=device)
        self._default.manual_seed(default_seed)

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._default
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed & _SEED_MASK)
            self._generators[request_id] = gen
        return gen

    def sample(
        self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """``logits``: float32 [n, vocab] -> one token id (and optional logprobs) per row."""
        n, vocab = logits.shape
        chosen = self._argmax(logits)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            idx = torch.tensor(random_rows, device=logits.device)
            rows = logits[idx]
            temps = torch.tensor([params[i].temperature for i in random_rows], device=logits.device)
            rows = _filter_top_k_top_p(
                rows / temps[:, None],
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
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:
            lp = torch.log_softmax(logits[want], dim=-1)
            k = min(max(params[i].logprobs for i in want), vocab)
            top_v, top_i = lp.topk(k, dim=-1) if k > 0 else (None, None)
            for j, i in enumerate(want):
                kk = min(params[i].logprobs, k)
                top = []
                if kk:
                    top = list(zip(top_i[j, :kk].tolist(), top_v[j, :kk].tolist()))
                logprobs[i] = TokenLogprob(token_ids[i], float(lp[j, token_ids[i]]), top)
        return token_ids, logprobs


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
