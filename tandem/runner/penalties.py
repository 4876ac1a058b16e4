"""Logit processing before sampling: logit_bias, min_tokens, bad_words and the presence,
frequency and repetition penalties, with vLLM's semantics, applied to the rows that ask for them.

In order, on a row's float32 logits:

1. ``logit_bias`` is added;
2. while the output has fewer than ``min_tokens`` tokens, EOS (unless ``ignore_eos``) and the
   ``stop_token_ids`` are masked;
3. ``bad_words``: a one-token word is masked; a longer word's last token is masked when the
   output ends with the word's other tokens;
4. repetition penalty over the tokens of the prompt and output (a positive logit divided by it,
   a negative one multiplied), then ``frequency_penalty * count`` and ``presence_penalty`` (once)
   subtracted for the tokens of the output.

Every step is batched over the rows (dense [rows, vocab] counts by ``index_put_``); the Python
loops run over rows and their bias entries or words, never over the vocabulary. A row that
would have every token masked keeps its unprocessed logits rather than sampling from nothing.

``TokenHistory`` keeps what the penalties read: the output tokens the sampler drew for the
request, and the prompt, which the scheduler sends once (``ScheduledChunk.prompt_token_ids``)
since a runner does not see a prompt prefix served from the prefix cache. The history follows
the request's own count of output tokens: a step that failed after drawing, or whose token was
dropped, is forgotten the next time the request samples, and a preempted request keeps its
history (it draws nothing again for the tokens it has).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from tandem.core.sampling_params import SamplingParams
from tandem.core.step import ScheduledChunk


@dataclass
class _History:
    prompt: torch.Tensor | None = None
    output: list[int] = field(default_factory=list)


class TokenHistory:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._requests: dict[str, _History] = {}

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._requests)

    def prepare(self, chunk: ScheduledChunk) -> _History:
        """The history of ``chunk``'s request, as of the token this chunk samples."""
        h = self._requests.get(chunk.request_id) or _History()
        if chunk.prompt_token_ids is not None and h.prompt is None:
            h.prompt = torch.tensor(chunk.prompt_token_ids, dtype=torch.long, device=self.device)
        num_output = chunk.end - chunk.num_prompt_tokens
        if len(h.output) < num_output:
            raise RuntimeError(f"request {chunk.request_id}: the sampler holds {len(h.output)} of its "
                               f"{num_output} output tokens")
        if chunk.sampling.repetition_penalty != 1 and h.prompt is None:
            raise RuntimeError(f"request {chunk.request_id}: repetition_penalty needs the prompt, which was never sent")
        del h.output[num_output:]
        self._requests[chunk.request_id] = h
        return h

    def record(self, request_ids: Sequence[str], tokens: Sequence[int]) -> None:
        for rid, tok in zip(request_ids, tokens):
            h = self._requests.get(rid)
            if h is not None:
                h.output.append(tok)


def needs_history(params: SamplingParams) -> bool:
    return params.uses_penalties or any(len(w) > 1 for w in params.bad_words_token_ids)


def process(logits: torch.Tensor, params: Sequence[SamplingParams], num_output: Sequence[int],
            histories: Sequence[_History | None], eos_token_ids: Sequence[int]) -> torch.Tensor:
    """``logits``: float32 [rows, vocab] of the rows that process -> their processed logits."""
    out = logits.clone()
    rows, vocab = out.shape
    device = out.device
    bias_r, bias_t, bias_v = [], [], []
    mask_r, mask_t = [], []
    for r, (p, n, h) in enumerate(zip(params, num_output, histories)):
        for t, v in (p.logit_bias or {}).items():
            if t < vocab:
                bias_r.append(r)
                bias_t.append(t)
                bias_v.append(float(v))
        if n < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            for t in stops:
                mask_r.append(r)
                mask_t.append(t)
        for word in p.bad_words_token_ids:
            if len(word) == 1 or (h is not None and len(h.output) >= len(word) - 1
                                  and tuple(h.output[len(h.output) - len(word) + 1:]) == word[:-1]):
                mask_r.append(r)
                mask_t.append(word[-1])
    if bias_r:
        out.index_put_(_idx(bias_r, bias_t, device), torch.tensor(bias_v, device=device), accumulate=True)
    if mask_r:
        keep = [(r, t) for r, t in zip(mask_r, mask_t) if t < vocab]
        if keep:
            out.index_put_(_idx(*zip(*keep), device=device), torch.tensor(float("-inf"), device=device))
    pen = [r for r, p in enumerate(params) if p.uses_penalties]
    if pen:
        out[pen] = _penalize(out[pen], [params[r] for r in pen], [histories[r] for r in pen])
    dead = torch.isneginf(out).all(dim=-1)
    if bool(dead.any()):
        out[dead] = logits[dead]
    return out


def _penalize(logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[_History | None]) -> torch.Tensor:
    rows, vocab = logits.shape
    device = logits.device
    counts = torch.zeros(rows, vocab, dtype=logits.dtype, device=device)
    out_r = [r for r, h in enumerate(histories) for _ in h.output]  # type: ignore[union-attr]
    out_t = [t for h in histories for t in h.output]  # type: ignore[union-attr]
    if out_t:
        counts.index_put_(_idx(out_r, out_t, device), torch.ones(len(out_t), device=device), accumulate=True)
    in_output = counts > 0
    rep = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
    if bool((rep != 1).any()):
        seen = in_output.clone()
        for r, (p, h) in enumerate(zip(params, histories)):
            if p.repetition_penalty != 1 and h.prompt is not None:  # type: ignore[union-attr]
                seen[r, h.prompt[h.prompt < vocab]] = True  # type: ignore[union-attr,index]
        factor = torch.where(seen, rep, torch.ones_like(rep))
        logits = torch.where(logits > 0, logits / factor, logits * factor)
    freq = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
    presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
    return logits - freq * counts - presence * in_output.to(logits.dtype)


def _idx(rows: Sequence[int], cols: Sequence[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor(rows, dtype=torch.long, device=device), torch.tensor(cols, dtype=torch.long, device=device))
