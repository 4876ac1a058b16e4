"""The GGUF reader the conversion uses (``gguf_file.open_gguf``): gguf's own reader over a plain
ndarray view of the file's memory map, which must read exactly what the stock reader reads."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from tandem.weights.gguf_file import open_gguf  # noqa: E402


def _write(path, n_vocab: int = 3000):
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_token_list([f"tok{i}" for i in range(n_vocab)])
    w.add_token_scores([float(i) / 7 for i in range(n_vocab)])
    w.add_token_types([1 + i % 3 for i in range(n_vocab)])
    w.add_string("general.name", "tiny")
    w.add_array("test.empty", [])
    w.add_array("test.ints", [3, -1, 7])
    w.add_array("test.words", ["", "ä", "longer words"])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_tensor("token_embd.weight", rng.standard_normal((16, 32), dtype=np.float32))
    w.add_tensor("blk.0.attn_q.weight", rng.standard_normal((32, 32)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_reads_what_the_stock_reader_reads(tmp_path):
    path = _write(tmp_path / "tiny.gguf")
    fast, stock = open_gguf(path), gguf.GGUFReader(str(path))
    assert list(fast.fields) == list(stock.fields)
    for name, field in stock.fields.items():
        mine = fast.fields[name]
        assert (mine.types, mine.data, mine.offset) == (field.types, field.data, field.offset), name
        assert len(mine.parts) == len(field.parts) and all(
            np.array_equal(a, b) and a.dtype == b.dtype and a.shape == b.shape
            for a, b in zip(mine.parts, field.parts)), name
    assert [(t.name, t.tensor_type, list(t.shape)) for t in fast.tensors] == \
        [(t.name, t.tensor_type, list(t.shape)) for t in stock.tensors]
    for mine, theirs in zip(fast.tensors, stock.tensors):
        assert np.array_equal(mine.data, theirs.data)
        # no memmap left to run numpy's Python-level slicing hooks
        assert type(mine.data) is np.ndarray and type(fast.data) is np.ndarray
    tokens = fast.fields["tokenizer.ggml.tokens"]
    assert bytes(tokens.parts[tokens.data[-1]]).decode() == "tok2999"


def test_a_file_that_is_not_gguf_is_a_clear_error(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF but not really")
    with pytest.raises(ValueError, match="is not a readable GGUF file"):
        open_gguf(junk)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0", "Q4_K", "Q6_K", "Q4_0"])
def test_dequantizing_in_slices_gives_the_librarys_bits(qtype, monkeypatch):
    """``_dequantize`` (the type's row dequantizer over slices of rows) returns exactly what
    ``gguf.quants.dequantize`` does, also where a slice ends inside the tensor and for more than
    two dimensions. The bytes are random: scales that read as inf or NaN must come out the same too."""
    from gguf.quants import dequantize

    from tandem.weights import gguf_file

    kind = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = np.random.default_rng(1).integers(0, 256, (3, 37, 2 * size), dtype=np.uint8)
    monkeypatch.setattr(gguf_file, "DEQUANTIZE_ELEMENTS", 5 * 2 * block)  # 5 rows a slice: 111 rows end mid-slice
    with np.errstate(all="ignore"):  # NaN scales times values
        want = dequantize(raw, kind)
        got = gguf_file._dequantize(raw, kind)
    assert want.shape == (3, 37, 2 * block)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
