"""The incremental detokenizer's text and per-token offsets (OpenAI's ``text_offset``) agree with
one full decode, whatever the tokenizer does with leading spaces, split characters and stops."""

from __future__ import annotations

from tandem.core.detokenizer import IncrementalDetokenizer


class SpaceTokenizer:
    """Sentencepiece-like: ids map to byte strings, '▁' is a space, and a decode drops the space
    a sequence starts with (so decode([id]) of a word token differs from its text in context)."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def decode(self, ids) -> str:
        text = b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace").replace("\u2581", " ")
        return text[1:] if text.startswith(" ") else text


PIECES = [b"<s>", "\u2581Hello".encode(), "\u2581world".encode(), b"!", "\u2581caf".encode(),
          "é".encode()[:1], "é".encode()[1:], "\u2581STOP".encode(), "\u2581end".encode()]
BOS, HELLO, WORLD, BANG, CAF, E1, E2, STOP, END = range(len(PIECES))


def run(ids, stop=(), include_stop=False):
    tok = SpaceTokenizer(PIECES)
    d = IncrementalDetokenizer(tok, [BOS], stop, include_stop)
    matched = None
    for i in ids:
        matched = d.add_tokens([i])
        if matched is not None:
            break
    return d, matched


def test_offsets_point_at_each_tokens_text_in_context():
    d, _ = run([HELLO, WORLD, BANG])
    assert d.text == " Hello world!"  # after <s>, the first word keeps its space
    assert d.offsets == [0, 6, 12]
    assert [d.text[a:b] for a, b in zip(d.offsets, d.offsets[1:] + [len(d.text)])] == [" Hello", " world", "!"]


def test_a_character_split_over_two_tokens_shares_one_offset():
    d, _ = run([CAF, E1, E2, BANG])
    assert d.text == " café!"
    assert d.offsets == [0, 4, 4, 5]
    assert "\ufffd" not in d.text


def test_no_offset_points_past_a_stop_cut():
    d, matched = run([HELLO, STOP, END], stop=(" STOP",))
    assert matched == " STOP" and d.text == " Hello"
    assert all(o <= len(d.text) for o in d.offsets)
    d, _ = run([HELLO, STOP, END], stop=(" STOP",), include_stop=True)
    assert d.text == " Hello STOP" and d.offsets == [0, 6]


def test_offsets_and_text_are_the_same_whether_fed_one_by_one_or_together():
    one, _ = run([HELLO, CAF, E1, E2, WORLD])
    tok = SpaceTokenizer(PIECES)
    together = IncrementalDetokenizer(tok, [BOS], (), False)
    together.add_tokens([HELLO, CAF, E1, E2, WORLD])
    assert (one.text, one.offsets) == (together.text, together.offsets)
