"""Requests that repeat what came before them: a long system prompt shared by many short questions,
and multi-turn chats that resend their whole history each turn (the traffic a prefix cache is for).

Prompts are cut from real text in exact token counts, as every scenario's are. A chat's answers are
text of the turn's output length standing in for the model's reply, so the history a later turn
resends is fixed before the run (the model's own reply would differ per configuration)."""

from __future__ import annotations

import random

from tandem.bench.prompts import CORPUS, BenchRequest, TextPool, Tokenizer


def _join(a: str, b: str) -> str:
    return a + b if not a or a[-1].isspace() or b[:1].isspace() else f"{a} {b}"


def shared_system_prompt(tok: Tokenizer, seed: int, n: int, system_len: int, question_len: tuple[int, int],
                         output_len: int, start: int = 0) -> list[BenchRequest]:
    """``n`` requests: one ``system_len``-token system prompt, then a question of its own each."""
    rng = random.Random(seed)
    pool = TextPool(tok, [CORPUS.read_text()])
    system = pool.take(rng, system_len)
    out = []
    for i in range(n):
        q = rng.randint(*question_len)
        out.append(BenchRequest(start + i, "system-prompt", _join(system, pool.take(rng, q)), system_len + q,
                                output_len))
    return out


def multi_turn_chats(tok: Tokenizer, seed: int, chats: int, turns: int, opening_len: int, question_len: int,
                     answer_len: int, start: int = 0) -> list[list[BenchRequest]]:
    """Per chat, its turns: turn k's prompt is turn k-1's prompt, an answer of ``answer_len`` tokens
    and a new question of ``question_len``."""
    rng = random.Random(seed)
    pool = TextPool(tok, [CORPUS.read_text()])
    out: list[list[BenchRequest]] = []
    index = start
    for c in range(chats):
        history, length, conversation = pool.take(rng, opening_len), opening_len, []
        for t in range(turns):
            conversation.append(BenchRequest(index, "multi-turn", history, length, answer_len))
            index += 1
            history = _join(_join(history, pool.take(rng, answer_len)), pool.take(rng, question_len))
            length += answer_len + question_len
        out.append(conversation)
    return out


def shareable_tokens(prompts: list[list[int]], block_size: int) -> int:
    """Tokens a prefix cache with unlimited room would serve for ``prompts`` sent in this order,
    each after the previous one's prefill: per prompt, the full blocks it shares with an earlier one
    (never its last token). What a run's hit counters are measured against."""
    from tandem.core.prefix_cache import PrefixHasher

    hasher, seen, total = PrefixHasher(block_size), set(), 0
    for ids in prompts:
        hashes: list[bytes] = []
        hasher.extend(hashes, None, lambda s, e: ids[s:e], len(ids))
        usable = (len(ids) - 1) // block_size
        hits = 0
        while hits < usable and hashes[hits] in seen:
            hits += 1
        total += hits * block_size
        seen.update(hashes)
    return total
