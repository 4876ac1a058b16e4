"""Build a Hugging Face ``tokenizers`` tokenizer from the metadata of a GGUF file.

A GGUF file carries no ``tokenizer.json``; llama.cpp stores the vocabulary, scores, token
types, merges and special-token ids as ``tokenizer.*`` metadata instead.  This module turns
that metadata into a serialized :class:`tokenizers.Tokenizer` (plus the few facts the engine
needs around it: BOS/EOS ids, whether to add BOS, the chat template).

Two tokenizer families are supported, named by ``tokenizer.ggml.model``:

``"llama"``  (SentencePiece BPE: Llama 2 / TinyLlama, Gemma 1-3)
    A BPE model with byte fallback over "▁"-for-space pieces.  The file has no merges, so
    they are derived from the vocabulary (:mod:`tandem.weights.bpe_merges`), ranked by the
    merged token's score, or for Gemma files, whose scores do not follow the merge order, by
    its position in the vocabulary.  Token types CONTROL / USER_DEFINED become special /
    added tokens so that ``<start_of_turn>`` or ``\\n\\n`` in a prompt stays one token.

``"gpt2"``  (byte-level BPE: Qwen2/Qwen3, Llama 3, ...)
    Vocabulary and merges come straight from the file; a regex ``Split`` chosen by
    ``tokenizer.ggml.pre`` followed by a ``ByteLevel`` pre-tokenizer / decoder.

The rules follow what llama.cpp and transformers' GGUF loader do, so that for the same file
the ids match ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` (checked for Gemma 3:
identical vocabulary, merges and added tokens).  Deliberate differences: byte-level control
tokens spelled outside the byte alphabet are kept (transformers drops them), llama-3 style
pre-tokenizers set ``ignore_merges`` as the original tokenizer.json and llama.cpp do, and
``eos_token_ids`` also lists end-of-turn control tokens (``<end_of_turn>``, ``<|im_end|>``,
``<|eot_id|>``, ...), as llama.cpp's end-of-generation set does.

BOS is never added by the tokenizer's post-processor: the engine adds it itself when
``TokenizerSpec.add_bos_token`` is true.

Longer than 300 lines because both tokenizer families (sentencepiece-style and byte-level)
live here side by side: they share the vocabulary, EOS and added-token handling below.
"""

from __future__ import annotations

import gc
from collections.abc import Container
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tandem.weights.bpe_merges import MergeIds, derive_merges
from tandem.weights.byte_level import byte_level_spelling, byte_to_unicode, ignores_merges, split_regex
from tandem.weights.gguf_fields import numeric_array, optional_id, scalar, string_array
from tandem.weights.tokenizer_json import added_token, bpe_model, serialize, tokenizer_document

if TYPE_CHECKING:  # pragma: no cover
    import gguf

__all__ = ["TokenizerSpec", "tokenizer_from_gguf"]

# llama.cpp token types (gguf.TokenType).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_DUPLICATE_PREFIX = "<gguf_duplicate_"  # a placeholder for a repeated spelling, see _unique_vocab

_SPACE_PIECE = "\u2581"  # "▁", SentencePiece's spelling of a space

# Architectures whose "llama"-model vocabulary is merged in vocabulary order rather than by
# score.  Gemma files give every control / user-defined token a flat -1000 score that says
# nothing about merge order (the runs of spaces at ids 138..167 must merge before any word
# piece); vocabulary order is what transformers' GGUF loader uses, and for ordinary tokens
# it coincides with the score order anyway.
_POSITION_RANKED_ARCHS = ("gemma", "gemma2", "gemma3", "gemma3n", "gemma-embedding")

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
    tokenizer_json: str  # a serialized `tokenizers.Tokenizer` (load with Tokenizer.from_str)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    add_bos_token: bool
    chat_template: str | None  # from tokenizer.chat_template metadata if present


# --------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------


def _unique_vocab(tokens: list[str]) -> dict[str, int]:
    """token -> id.  A later duplicate spelling (a broken file) is renamed in place to a
    placeholder so that every id keeps its slot and the vocabulary size still matches the
    model's embedding table."""
    vocab = dict(zip(tokens, range(len(tokens))))
    if len(vocab) == len(tokens):
        return vocab
    vocab = {}
    for i, tok in enumerate(tokens):
        if tok in vocab:
            tok = f"{_DUPLICATE_PREFIX}{i}>"
            tokens[i] = tok
        vocab[tok] = i
    if len(vocab) != len(tokens):
        raise ValueError("GGUF tokenizer vocabulary has unresolvable duplicate tokens")
    return vocab


def _eos_ids(reader: "gguf.GGUFReader", tokens: list[str], types: np.ndarray) -> tuple[int, ...]:
    ids: list[int] = []

    def add(i: Any) -> None:
        if i is None:
            return
        i = int(i)
        if 0 <= i < len(tokens) and i not in ids:
            ids.append(i)

    add(scalar(reader, "tokenizer.ggml.eos_token_id"))
    add(scalar(reader, "tokenizer.ggml.eot_token_id"))
    add(scalar(reader, "tokenizer.ggml.eom_token_id"))
    for i in np.flatnonzero(types == _CONTROL).tolist():
        if tokens[i] in _EOG_TEXTS:
            add(i)
    return tuple(ids)


def _added_tokens(tokens: list[str], types: np.ndarray, skip: Container[int] = ()) -> list[dict[str, Any]]:
    """Control / user-defined tokens as added tokens, in id order, except duplicate
    placeholders and the ids in ``skip``."""
    return [
        added_token(tokens[i], i, special=bool(types[i] == _CONTROL))
        for i in np.flatnonzero((types == _CONTROL) | (types == _USER_DEFINED)).tolist()
        if tokens[i] and not tokens[i].startswith(_DUPLICATE_PREFIX) and i not in skip
    ]


def _unk_token(reader: "gguf.GGUFReader", tokens: list[str]) -> str | None:
    unk_id = optional_id(reader, "tokenizer.ggml.unknown_token_id", len(tokens))
    return tokens[unk_id] if unk_id is not None else None


# --------------------------------------------------------------------------------------------
# SentencePiece-style BPE ("llama")
# --------------------------------------------------------------------------------------------


def _llama_tokenizer(reader: "gguf.GGUFReader", tokens: list[str], types: np.ndarray) -> dict[str, Any]:
    n = len(tokens)
    scores = numeric_array(reader, "tokenizer.ggml.scores")
    arch = scalar(reader, "general.architecture", "") or ""
    add_space_prefix = bool(scalar(reader, "tokenizer.ggml.add_space_prefix", True))

    lens = np.fromiter(map(len, tokens), dtype=np.int64, count=n)
    codepoints = np.frombuffer("".join(tokens).encode("utf-32-le"), dtype=np.uint32).copy()
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(lens[:-1], out=starts[1:])

    # Some converters (Gemma's) write the whitespace-run pieces with real spaces ("  ") where
    # the tokenizer looks them up as "▁▁" (spaces become "▁" before the model sees the text).
    # A real space can never be looked up otherwise, so respell all-space tokens.
    with_space = np.unique(np.searchsorted(starts, np.flatnonzero(codepoints == 32), side="right") - 1)
    respelled_ids: set[int] = set()
    if with_space.size:
        taken = set(tokens)
        for i in with_space.tolist():
            tok = tokens[i]
            respelled = _SPACE_PIECE * len(tok)
            if tok == " " * len(tok) and respelled not in taken:
                tokens[i] = respelled
                taken.add(respelled)
                respelled_ids.add(i)
                codepoints[starts[i] : starts[i] + lens[i]] = ord(_SPACE_PIECE)
    vocab = _unique_vocab(tokens)

    if arch in _POSITION_RANKED_ARCHS or scores is None:
        rank = np.arange(n, dtype=np.float64)
    else:
        rank = -scores.astype(np.float64)
    # BYTE tokens are produced by byte fallback only, never by merging "<0x" pieces.
    merges = derive_merges(tokens, vocab, codepoints, lens, types != _BYTE, rank)

    model = bpe_model(vocab, merges, _unk_token(reader, tokens), sentencepiece=True)

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

    # Whitespace runs are not added tokens: they are reached through merges of "▁" after the
    # space normalizer (a raw text match would never see them: the input holds spaces, the
    # vocabulary "▁").
    added = _added_tokens(tokens, types, skip=respelled_ids)
    return tokenizer_document(added, normalizer, pre_tokenizer, {"type": "Sequence", "decoders": decoders}, model)


# --------------------------------------------------------------------------------------------
# Byte-level BPE ("gpt2")
# --------------------------------------------------------------------------------------------


def _gpt2_tokenizer(reader: "gguf.GGUFReader", tokens: list[str], types: np.ndarray) -> dict[str, Any]:
    merges_raw = string_array(reader, "tokenizer.ggml.merges") or []
    pre = (scalar(reader, "tokenizer.ggml.pre", "") or "").lower()

    alphabet = frozenset(byte_to_unicode().values())
    # Ordinary tokens must be spelled in the byte alphabet; a converter occasionally writes one
    # as raw text, so respell it.  Added (control / user-defined) tokens keep their raw text:
    # they are matched in the raw input and never reached through merges, so their vocabulary
    # key is what the added-token matcher needs.
    special_mask = (types == _CONTROL) | (types == _USER_DEFINED)
    respelled: dict[str, str] = {}
    for i, tok in enumerate(tokens):
        if special_mask[i] or set(tok) <= alphabet:
            continue
        new = byte_level_spelling(tok)
        respelled[tok] = new
        tokens[i] = new
    vocab = _unique_vocab(tokens)

    merge_left: list[int] = []
    merge_right: list[int] = []
    for m in merges_raw:
        a, sep, b = m.partition(" ")
        a, b = respelled.get(a, a), respelled.get(b, b)
        if not sep or a not in vocab or b not in vocab or a + b not in vocab:
            raise ValueError(f"tokenizer.ggml.merges entry {m!r} does not merge two tokens into a token")
        merge_left.append(vocab[a])
        merge_right.append(vocab[b])

    split = split_regex(pre)
    pre_tokenizer = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        ],
    }
    merges = MergeIds(np.asarray(merge_left, dtype=np.int64), np.asarray(merge_right, dtype=np.int64))
    model = bpe_model(vocab, merges, _unk_token(reader, tokens), sentencepiece=False, ignore_merges=ignores_merges(pre))
    decoder = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return tokenizer_document(_added_tokens(tokens, types), None, pre_tokenizer, decoder, model)


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------


def tokenizer_from_gguf(reader: "gguf.GGUFReader") -> TokenizerSpec:
    """Build a :class:`TokenizerSpec` from the ``tokenizer.*`` metadata of an open GGUF file.

    Raises ``ValueError`` for a ``tokenizer.ggml.model`` other than ``"llama"`` or ``"gpt2"``.
    """
    model_name = scalar(reader, "tokenizer.ggml.model")
    if model_name not in ("llama", "gpt2"):
        raise ValueError(
            f"unsupported GGUF tokenizer: tokenizer.ggml.model={model_name!r} "
            "(supported: 'llama', 'gpt2')"
        )
    tokens = string_array(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError("GGUF file has no tokenizer.ggml.tokens")
    n = len(tokens)
    original_tokens = list(tokens)
    types = numeric_array(reader, "tokenizer.ggml.token_type")
    if types is None or types.size != n:
        types = np.full(n, _NORMAL, dtype=np.int64)
    types = types.astype(np.int64)

    # The structure built below is complete and self-consistent (every merge joins two tokens
    # into a token, every added token is spelled as in the vocabulary, one id per token), so it
    # is serialized directly; a round trip through `tokenizers` would add ~2 s for Gemma.
    # ~1M short-lived containers are built below; the cyclic GC only slows that down.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        if model_name == "llama":
            data = _llama_tokenizer(reader, tokens, types)
            default_add_bos = True
        else:
            data = _gpt2_tokenizer(reader, tokens, types)
            default_add_bos = False
        tokenizer_json = serialize(data, tokens)
        del data
    finally:
        if gc_was_enabled:
            gc.enable()

    bos = optional_id(reader, "tokenizer.ggml.bos_token_id", n)
    add_bos = scalar(reader, "tokenizer.ggml.add_bos_token")
    add_bos = default_add_bos if add_bos is None else bool(add_bos)
    if bos is None:
        add_bos = False
    chat_template = scalar(reader, "tokenizer.chat_template")

    return TokenizerSpec(
        tokenizer_json=tokenizer_json,
        bos_token_id=bos,
        eos_token_ids=_eos_ids(reader, original_tokens, types),
        add_bos_token=add_bos,
        chat_template=chat_template if isinstance(chat_template, str) else None,
    )
