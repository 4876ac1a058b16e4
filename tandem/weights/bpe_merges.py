"""BPE merges derived from a vocabulary that lists none (GGUF's SentencePiece-style files).

``a + b`` is a merge whenever ``a``, ``b`` and ``a+b`` are all tokens; merges are ranked by
the merged token, the order transformers' ``generate_merges`` produces.  A 262k-token
vocabulary has over a million candidate splits, too many for one dictionary look-up each in
Python, so a vectorized hashed search finds them; the exact look-ups stay as the fallback
(and the reference for tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["MergeIds", "derive_merges"]


@dataclass(frozen=True)
class MergeIds:
    """Merges as (left id, right id) arrays, spelled out only when serializing."""

    left: np.ndarray
    right: np.ndarray


def derive_merges(
    tokens: list[str],
    vocab: dict[str, int],
    codepoints: np.ndarray,
    lens: np.ndarray,
    mergeable: np.ndarray,
    rank: np.ndarray,
) -> MergeIds:
    """Every merge of two tokens into a mergeable token, lowest ``rank`` of the merged token first.

    ``codepoints`` / ``lens`` spell ``tokens`` as in :func:`_find_splits_hashed`.
    """
    splits = _find_splits_hashed(codepoints, lens, mergeable)
    if splits is None:  # a hash collision or duplicate tokens: exact look-ups instead
        splits = _find_splits_python(tokens, vocab, mergeable)
        lens = np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))
    return MergeIds(*_ordered_merges(lens, rank, splits))


def _find_splits_python(tokens: list[str], vocab: dict[str, int], mergeable: np.ndarray):
    """Every ``(t, a, b, i)`` with ``tokens[t] == tokens[a] + tokens[b]`` and
    ``len(tokens[a]) == i``, for mergeable ``t``.  Reference implementation (O(sum of lengths)
    dict look-ups); :func:`_find_splits_hashed` is the fast path."""
    merged_ids: list[int] = []
    left_ids: list[int] = []
    right_ids: list[int] = []
    left_lens: list[int] = []
    get = vocab.get
    for tid, tok in enumerate(tokens):
        n = len(tok)
        if n < 2 or not mergeable[tid]:
            continue
        for i in range(1, n):
            a = get(tok[:i])
            if a is None:
                continue
            b = get(tok[i:])
            if b is None:
                continue
            merged_ids.append(tid)
            left_ids.append(a)
            right_ids.append(b)
            left_lens.append(i)
    as_array = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    return as_array(merged_ids), as_array(left_ids), as_array(right_ids), as_array(left_lens)


# Two fixed odd 64-bit bases for polynomial string hashing modulo 2**64.
_HASH_BASES = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F)


def _find_splits_hashed(codepoints: np.ndarray, lens: np.ndarray, mergeable: np.ndarray):
    """Vectorized :func:`_find_splits_python`.

    ``codepoints`` is the concatenation of all tokens (one uint32 per character) and ``lens``
    their lengths.  Every substring gets two independent polynomial hashes (mod 2**64) from
    prefix sums; a split ``t = a + b`` is accepted when both halves match a token on both
    hashes and on length.  Returns ``None`` when two distinct tokens share a hash, in which case
    the caller falls back to exact look-ups.
    """
    n_tok = lens.size
    total = int(lens.sum())
    starts = np.zeros(n_tok, dtype=np.int64)
    np.cumsum(lens[:-1], out=starts[1:])
    values = codepoints.astype(np.uint64) + np.uint64(1)

    cand = np.flatnonzero((lens >= 2) & mergeable)
    counts = lens[cand] - 1
    t_rep = np.repeat(cand, counts)
    # split position i = 1 .. len-1 inside each candidate token
    first = np.zeros(cand.size, dtype=np.int64)
    np.cumsum(counts[:-1], out=first[1:])
    split = np.arange(t_rep.size, dtype=np.int64) - np.repeat(first, counts) + 1
    x0 = starts[t_rep]
    xm = x0 + split
    x1 = x0 + lens[t_rep]

    with np.errstate(over="ignore"):
        hashes = []
        for base in _HASH_BASES:
            powers = np.full(total, base, dtype=np.uint64)
            powers[0] = 1
            powers = np.cumprod(powers, dtype=np.uint64)  # base**k mod 2**64
            inv_powers = np.full(total + 1, pow(base, -1, 1 << 64), dtype=np.uint64)
            inv_powers[0] = 1
            inv_powers = np.cumprod(inv_powers, dtype=np.uint64)
            prefix = np.zeros(total + 1, dtype=np.uint64)
            np.cumsum(values * powers, dtype=np.uint64, out=prefix[1:])

            def substring(x: np.ndarray, y: np.ndarray) -> np.ndarray:
                # hash(s) = sum_k (s_k + 1) * base**k, independent of where s sits
                return (prefix[y] - prefix[x]) * inv_powers[x]

            hashes.append((substring(starts, starts + lens), substring(x0, xm), substring(xm, x1)))

    (tok_h1, left_h1, right_h1), (tok_h2, left_h2, right_h2) = hashes
    order = np.argsort(tok_h1, kind="stable")
    sorted_h1 = tok_h1[order]
    if sorted_h1.size > 1 and bool(np.any(sorted_h1[1:] == sorted_h1[:-1])):
        return None

    # A bitmap over the top hash bits rejects most non-tokens before the binary search.
    filter_bits = min(24, (4 * n_tok).bit_length() + 2)
    shift = np.uint64(64 - filter_bits)
    present = np.zeros(1 << filter_bits, dtype=bool)
    present[(tok_h1 >> shift).astype(np.intp)] = True

    def lookup(h1: np.ndarray, h2: np.ndarray, length: np.ndarray):
        """(indices of the queries that spell a token, that token's id)"""
        q = np.flatnonzero(present[(h1 >> shift).astype(np.intp)])
        pos = np.minimum(np.searchsorted(sorted_h1, h1[q]), sorted_h1.size - 1)
        ids = order[pos]
        ok = (sorted_h1[pos] == h1[q]) & (tok_h2[ids] == h2[q]) & (lens[ids] == length[q])
        return q[ok], ids[ok]

    left_q, left = lookup(left_h1, left_h2, split)
    # right halves are only looked up where the left half is a token
    right_q, right = lookup(right_h1[left_q], right_h2[left_q], (x1 - xm)[left_q])
    keep = left_q[right_q]
    return t_rep[keep], left[right_q], right, split[keep]


def _ordered_merges(
    lens: np.ndarray,
    rank: np.ndarray,
    splits: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
) -> tuple[np.ndarray, np.ndarray]:
    """(left ids, right ids) of the merges, sorted by ``rank`` of the merged token (lower
    first), then longer left piece, then longer right piece, then merged id -- the order
    transformers' ``generate_merges`` produces for the same vocabulary and scores."""
    merged, left, right, llen = splits
    if merged.size == 0:
        return left, right
    rlen = lens[merged] - llen
    # Within one merged token the left length picks the split, so (rank, -llen, -rlen, merged)
    # is already unique; pack it into one int64 when it fits (one argsort instead of a lexsort).
    dense_rank = np.unique(rank, return_inverse=True)[1].reshape(-1)
    len_bits = int(lens.max()).bit_length()
    id_bits = int(lens.size).bit_length()
    if 2 * id_bits + 2 * len_bits <= 62:
        max_len = int(lens.max())
        key = dense_rank[merged].astype(np.int64)
        key = (key << len_bits) | (max_len - llen)
        key = (key << len_bits) | (max_len - rlen)
        key = (key << id_bits) | merged
        order = np.argsort(key)
    else:
        order = np.lexsort((right, left, merged, -rlen, -llen, dense_rank[merged]))  # last key first
    return left[order], right[order]
