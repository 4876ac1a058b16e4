"""The Hugging Face ``tokenizers`` JSON document of a BPE tokenizer: its sections, and a
serializer that spells the merges out cheaply."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from tandem.weights.bpe_merges import MergeIds

__all__ = ["added_token", "bpe_model", "serialize", "tokenizer_document"]


def added_token(content: str, token_id: int, special: bool) -> dict[str, Any]:
    return {
        "id": int(token_id),
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": special,
    }


def bpe_model(vocab: dict[str, int], merges: MergeIds, unk_token: str | None, sentencepiece: bool,
              ignore_merges: bool = False) -> dict[str, Any]:
    """The BPE model section. SentencePiece-style vocabularies (``llama``) fuse unknown pieces
    and fall back to bytes; byte-level ones (``gpt2``) do neither."""
    return {
        "type": "BPE",
        "dropout": None,
        "unk_token": unk_token,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": sentencepiece,
        "byte_fallback": sentencepiece,
        "ignore_merges": ignore_merges,
        "vocab": vocab,
        "merges": merges,
    }


def tokenizer_document(added_tokens: list[dict[str, Any]], normalizer: dict[str, Any] | None,
                       pre_tokenizer: dict[str, Any] | None, decoder: dict[str, Any],
                       model: dict[str, Any]) -> dict[str, Any]:
    """The whole document, ready for :func:`serialize`."""
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added_tokens,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        # BOS is the engine's to add (TokenizerSpec.add_bos_token), never the tokenizer's.
        "post_processor": None,
        "decoder": decoder,
        "model": model,
    }


_MERGES_PLACEHOLDER = "\x00tandem-merges\x00"


def serialize(data: dict[str, Any], tokens: list[str]) -> str:
    """``json.dumps(data)``, with ``data["model"]["merges"]`` (a :class:`MergeIds`) spelled out
    straight from pre-escaped token literals, which is several times cheaper than building and
    encoding ~500k small Python containers.

    Merges are written as ``"a b"`` strings (the only form tokenizers < 0.20 reads) unless a
    merged piece contains a space, in which case the ``["a", "b"]`` form is required.
    """
    from json.encoder import encode_basestring  # the C escaper json.dumps(ensure_ascii=False) uses

    model = data["model"]
    merges: MergeIds = model["merges"]
    model["merges"] = _MERGES_PLACEHOLDER
    text = json.dumps(data, ensure_ascii=False)
    # A '"' inside a token is escaped, so this key/value pair can only be the structural one.
    marker = '"merges": ' + json.dumps(_MERGES_PLACEHOLDER, ensure_ascii=False)
    head, found, tail = text.partition(marker)
    if not found:  # pragma: no cover - json.dumps' default separators guarantee the marker
        raise AssertionError("merges placeholder not found")

    left, right = merges.left.tolist(), merges.right.tolist()
    used = np.unique(np.concatenate([merges.left, merges.right])).tolist()
    literal = list(map(encode_basestring, tokens))
    if any(" " in tokens[i] for i in used):
        spell = literal.__getitem__
        pairs = map("[{},{}]".format, map(spell, left), map(spell, right))
    else:
        inner = [lit[1:-1] for lit in literal]
        spell = inner.__getitem__
        pairs = map('"{} {}"'.format, map(spell, left), map(spell, right))
    return "".join((head, '"merges": [', ",".join(pairs), "]", tail))
