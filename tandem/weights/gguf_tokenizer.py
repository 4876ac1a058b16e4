"""Build a Hugging Face ``tokenizers`` tokenizer from the metadata of a GGUF file.

A GGUF file carries no ``tokenizer.json``; llama.cpp stores the vocabulary, scores, token
types, merges and special-token ids as ``tokenizer.*`` metadata instead.  This module turns
that metadata into a serialized :class:`tokenizers.Tokenizer` (plus the few facts the engine
needs around it: BOS/EOS ids, whether to add BOS, the chat template).

Two tokenizer families are supported, named by ``tokenizer.ggml.model``:

``"llama"``  (SentencePiece BPE: Llama 2 / TinyLlama, Gemma 1-3)
    A BPE model with byte fallback over "▁"-for-space pieces.  The file has no merges, so
    they are derived from the vocabulary: ``a + b`` is a merge whenever ``a``, ``b`` and
    ``a+b`` are all tokens, ranked by the merged token (highest score first; for Gemma
    files, whose scores do not follow the merge order, by position in the vocabulary).
    Token types CONTROL / USER_DEFINED become special / added tokens so that
    ``<start_of_turn>`` or ``\\n\\n`` in a prompt stays one token.

``"gpt2"``  (byte-level BPE: Qwen2/Qwen3, Llama 3, ...)
    Vocabulary and merges come straight from the file; a regex ``Split`` chosen by
    ``tokenizer.ggml.pre`` followed by a ``ByteLevel`` pre-tokenizer / decoder.

The rules follow what llama.cpp and transformers' GGUF loader do, so that for the same file
the ids match ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``.

BOS is never added by the tokenizer's post-processor: the engine adds it itself when
``TokenizerSpec.add_bos_token`` is true.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import gguf

__all__ = ["TokenizerSpec", "tokenizer_from_gguf"]

# llama.cpp token types (gguf.TokenType).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_SPACE_PIECE = "\u2581"  # "▁", SentencePiece's spelling of a space

# Architectures whose "llama"-model vocabulary must be merged in vocabulary order rather than
# by score: Gemma files give their user-defined whitespace tokens (runs of spaces at ids
# 138..167, runs of tabs at the very end) a flat -1000 score although they merge first.
_POSITION_RANKED_ARCHS = ("gemma", "gemma2", "gemma3", "gemma3n", "gemma-embedding")

# Split regexes by tokenizer.ggml.pre for byte-level vocabularies.
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BYTE_LEVEL_SPLITS = {
    "gpt-2": _GPT2_SPLIT,
    "gpt2": _GPT2_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "pixtral": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "megrez": _QWEN2_SPLIT,
    "qwen35": _QWEN35_SPLIT,
    "gpt-4o": _GPT4O_SPLIT,
    "llama4": _GPT4O_SPLIT,
    "tekken": _TEKKEN_SPLIT,
}
# Pre-tokenizer types whose reference tokenizer (and llama.cpp) look a whole pre-token up in the
# vocabulary before applying merges.
_IGNORE_MERGES_PRES = frozenset({"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "llama4"})

# Control tokens that end a turn, and so end generation, besides the declared EOS
# (llama.cpp's end-of-generation heuristic).
_EOG_TEXTS = frozenset(
    {
        "<end_of_turn>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<EOT>",
        "_<EOT>",
        "<end_of_utterance>",
    }
)


@dataclass(frozen=True)
class TokenizerSpec:
    tokenizer_json: str  # a serialized `tokenizers.Tokenizer` (Tokenizer.to_str())
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    add_bos_token: bool
    chat_template: str | None  # from tokenizer.chat_template metadata if present


# --------------------------------------------------------------------------------------------
# Reading metadata
# --------------------------------------------------------------------------------------------


def _field(reader: "gguf.GGUFReader", key: str):
    return reader.fields.get(key)


def _scalar(reader: "gguf.GGUFReader", key: str, default: Any = None) -> Any:
    field = _field(reader, key)
    if field is None or not field.types:
        return default
    from gguf import GGUFValueType

    if field.types[0] == GGUFValueType.STRING:
        return bytes(field.parts[-1]).decode("utf-8")
    if field.types[0] == GGUFValueType.ARRAY:
        return field.contents()
    value = field.parts[-1].tolist()
    return value[0] if isinstance(value, list) else value


def _string_array(reader: "gguf.GGUFReader", key: str) -> list[str] | None:
    field = _field(reader, key)
    if field is None:
        return None
    parts = field.parts
    # Same as field.contents(), minus its per-call overhead; ~0.25 s for 262k entries.
    return [parts[i].tobytes().decode("utf-8", errors="replace") for i in field.data]


def _numeric_array(reader: "gguf.GGUFReader", key: str) -> np.ndarray | None:
    field = _field(reader, key)
    if field is None:
        return None
    if not field.data:
        return np.zeros(0)
    parts = field.parts
    # Each element is its own one-item view; concatenating them is ~10x faster than
    # field.contents() (which calls .tolist() per element) and keeps the dtype.
    return np.concatenate([parts[i] for i in field.data])


# --------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------


def _added_token(content: str, token_id: int, special: bool) -> dict[str, Any]:
    return {
        "id": int(token_id),
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": special,
    }


def _unique_vocab(tokens: list[str]) -> dict[str, int]:
    """token -> id; a later duplicate spelling (rare, a broken file) gets a placeholder name so
    that every id keeps a slot and the vocabulary size matches the model's embedding."""
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        if tok in vocab:
            tok = f"<gguf_duplicate_{i}>"
            tokens[i] = tok
        vocab[tok] = i
    if len(vocab) != len(tokens):  # placeholder collided with a real token; give up gracefully
        raise ValueError("GGUF tokenizer vocabulary has unresolvable duplicate tokens")
    return vocab


def _eos_ids(reader: "gguf.GGUFReader", tokens: list[str], types: np.ndarray | None) -> tuple[int, ...]:
    ids: list[int] = []

    def add(i: Any) -> None:
        if i is None:
            return
        i = int(i)
        if 0 <= i < len(tokens) and i not in ids:
            ids.append(i)

    add(_scalar(reader, "tokenizer.ggml.eos_token_id"))
    add(_scalar(reader, "tokenizer.ggml.eot_token_id"))
    add(_scalar(reader, "tokenizer.ggml.eom_token_id"))
    if types is not None:
        for i in np.flatnonzero(types == _CONTROL).tolist():
            if tokens[i] in _EOG_TEXTS:
                add(i)
    return tuple(ids)


def _optional_id(reader: "gguf.GGUFReader", key: str, n_vocab: int) -> int | None:
    value = _scalar(reader, key)
    if value is None:
        return None
    value = int(value)
    return value if 0 <= value < n_vocab else None


# --------------------------------------------------------------------------------------------
# SentencePiece-style BPE ("llama")
# --------------------------------------------------------------------------------------------


def _spm_merges(tokens: list[str], vocab: dict[str, int], rank: np.ndarray, mergeable: np.ndarray):
    """All merges ``(a, b)`` with ``a``, ``b`` and ``a+b`` tokens, ``a+b`` mergeable, sorted
    by ``rank`` of the merged token (lower first), then longer left piece first, then by
    (left id, right id).  This reproduces transformers' ``generate_merges`` ordering."""
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
    if not merged_ids:
        return []
    merged = np.asarray(merged_ids, dtype=np.int64)
    left = np.asarray(left_ids, dtype=np.int64)
    right = np.asarray(right_ids, dtype=np.int64)
    llen = np.asarray(left_lens, dtype=np.int64)
    tlen = np.fromiter((len(tokens[t]) for t in merged_ids), dtype=np.int64, count=len(merged_ids))
    # np.lexsort: last key is primary.
    order = np.lexsort((right, left, merged, -(tlen - llen), -llen, rank[merged]))
    lo = left[order].tolist()
    ro = right[order].tolist()
    return [(tokens[a], tokens[b]) for a, b in zip(lo, ro)]


def _llama_tokenizer(reader: "gguf.GGUFReader", tokens: list[str]) -> dict[str, Any]:
    n = len(tokens)
    scores = _numeric_array(reader, "tokenizer.ggml.scores")
    types = _numeric_array(reader, "tokenizer.ggml.token_type")
    if types is None:
        types = np.full(n, _NORMAL, dtype=np.int32)
    types = types.astype(np.int64)
    arch = _scalar(reader, "general.architecture", "") or ""
    add_space_prefix = bool(_scalar(reader, "tokenizer.ggml.add_space_prefix", True))

    # Some converters write whitespace-run pieces with real spaces ("  ") where the tokenizer
    # looks them up as "▁▁" (spaces are replaced by "▁" before the model sees them).
    taken = set(tokens)
    for i, tok in enumerate(tokens):
        if tok and " " in tok and tok.strip(" ") == "":
            respelled = _SPACE_PIECE * len(tok)
            if respelled not in taken:
                tokens[i] = respelled
                taken.add(respelled)
    vocab = _unique_vocab(tokens)

    if arch in _POSITION_RANKED_ARCHS or scores is None:
        rank = np.arange(n, dtype=np.float64)
    else:
        rank = -scores.astype(np.float64)
    # BYTE tokens are produced by byte fallback only, never by merging "<0x" pieces.
    mergeable = types != _BYTE
    merges = _spm_merges(tokens, vocab, rank, mergeable)

    unk_id = _optional_id(reader, "tokenizer.ggml.unknown_token_id", n)
    model = {
        "type": "BPE",
        "dropout": None,
        "unk_token": tokens[unk_id] if unk_id is not None else None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": True,
        "byte_fallback": True,
        "ignore_merges": False,
        "vocab": vocab,
        "merges": [[a, b] for a, b in merges],
    }

    if add_space_prefix:
        normalizer = None
        pre_tokenizer = {"type": "Metaspace", "replacement": _SPACE_PIECE, "prepend_scheme": "first", "split": False}
    else:
        normalizer = {"type": "Replace", "pattern": {"String": " "}, "content": _SPACE_PIECE}
        pre_tokenizer = None
    decoders: list[dict[str, Any]] = [
        {"type": "Replace", "pattern": {"String": _SPACE_PIECE}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if add_space_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})

    added: list[dict[str, Any]] = []
    for i in np.flatnonzero((types == _CONTROL) | (types == _USER_DEFINED)).tolist():
        tok = tokens[i]
        if not tok or tok.startswith("<gguf_duplicate_"):
            continue
        if types[i] == _USER_DEFINED and _SPACE_PIECE in tok:
            # Respelled whitespace runs: reached through merges of "▁", like any other piece.
            continue
        added.append(_added_token(tok, i, special=bool(types[i] == _CONTROL)))

    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": model,
    }


# --------------------------------------------------------------------------------------------
# Byte-level BPE ("gpt2")
# --------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level_spelling(text: str) -> str:
    table = _byte_to_unicode()
    return "".join(table[b] for b in text.encode("utf-8"))


def _gpt2_tokenizer(reader: "gguf.GGUFReader", tokens: list[str]) -> dict[str, Any]:
    n = len(tokens)
    types = _numeric_array(reader, "tokenizer.ggml.token_type")
    if types is None:
        types = np.full(n, _NORMAL, dtype=np.int32)
    types = types.astype(np.int64)
    merges_raw = _string_array(reader, "tokenizer.ggml.merges") or []
    pre = (_scalar(reader, "tokenizer.ggml.pre", "") or "").lower()

    alphabet = frozenset(_byte_to_unicode().values())
    # Ordinary tokens must be spelled in the byte alphabet; a converter occasionally writes one
    # as raw text, so respell it.  Added (control / user-defined) tokens keep their raw text:
    # they are matched in the raw input and never reached through merges, so their vocabulary
    # key is what the added-token matcher needs.
    special_mask = (types == _CONTROL) | (types == _USER_DEFINED)
    respelled: dict[str, str] = {}
    for i, tok in enumerate(tokens):
        if special_mask[i] or set(tok) <= alphabet:
            continue
        new = _byte_level_spelling(tok)
        respelled[tok] = new
        tokens[i] = new
    vocab = _unique_vocab(tokens)

    merges: list[list[str]] = []
    for m in merges_raw:
        a, sep, b = m.partition(" ")
        if not sep:
            raise ValueError(f"malformed merge {m!r} in tokenizer.ggml.merges")
        merges.append([respelled.get(a, a), respelled.get(b, b)])

    split = _BYTE_LEVEL_SPLITS.get(pre, _GPT2_SPLIT)
    pre_tokenizer = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        ],
    }
    unk_id = _optional_id(reader, "tokenizer.ggml.unknown_token_id", n)
    model = {
        "type": "BPE",
        "dropout": None,
        "unk_token": tokens[unk_id] if unk_id is not None else None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        "byte_fallback": False,
        "ignore_merges": pre in _IGNORE_MERGES_PRES,
        "vocab": vocab,
        "merges": merges,
    }
    added = [
        _added_token(tokens[i], i, special=bool(types[i] == _CONTROL))
        for i in np.flatnonzero(special_mask).tolist()
        if tokens[i] and not tokens[i].startswith("<gguf_duplicate_")
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": model,
    }


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------


def tokenizer_from_gguf(reader: "gguf.GGUFReader") -> TokenizerSpec:
    """Build a :class:`TokenizerSpec` from the ``tokenizer.*`` metadata of an open GGUF file.

    Raises ``ValueError`` for a ``tokenizer.ggml.model`` other than ``"llama"`` or ``"gpt2"``.
    """
    model_name = _scalar(reader, "tokenizer.ggml.model")
    if model_name not in ("llama", "gpt2"):
        raise ValueError(
            f"unsupported GGUF tokenizer: tokenizer.ggml.model={model_name!r} "
            "(supported: 'llama', 'gpt2')"
        )
    tokens = _string_array(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError("GGUF file has no tokenizer.ggml.tokens")
    n = len(tokens)
    original_tokens = list(tokens)
    types = _numeric_array(reader, "tokenizer.ggml.token_type")

    if model_name == "llama":
        data = _llama_tokenizer(reader, tokens)
        default_add_bos = True
    else:
        data = _gpt2_tokenizer(reader, tokens)
        default_add_bos = False

    # Serialize, then let `tokenizers` parse it once: this validates the whole structure and
    # normalizes the JSON to the library's own form.
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(json.dumps(data, ensure_ascii=False))
    if tokenizer.get_vocab_size(with_added_tokens=True) != n:
        raise ValueError(
            f"GGUF tokenizer conversion produced {tokenizer.get_vocab_size(with_added_tokens=True)} tokens, "
            f"expected {n}"
        )

    bos = _optional_id(reader, "tokenizer.ggml.bos_token_id", n)
    add_bos = _scalar(reader, "tokenizer.ggml.add_bos_token")
    add_bos = default_add_bos if add_bos is None else bool(add_bos)
    if bos is None:
        add_bos = False
    chat_template = _scalar(reader, "tokenizer.chat_template")

    return TokenizerSpec(
        tokenizer_json=tokenizer.to_str(),
        bos_token_id=bos,
        eos_token_ids=_eos_ids(reader, original_tokens, types),
        add_bos_token=add_bos,
        chat_template=chat_template if isinstance(chat_template, str) else None,
    )
