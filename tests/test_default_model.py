"""The embedded default model (Gemma 3 270M, GGUF) against transformers' greedy continuation.

The reference tokens were produced once by scripts/make_gemma_reference.py (transformers, float32,
the same GGUF file) and are stored in tests/data/gemma3_270m_greedy.json.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tandem import SamplingParams
from tandem.weights import cache as wcache

REFERENCE = json.loads((Path(__file__).parent / "data" / "gemma3_270m_greedy.json").read_text())


@pytest.fixture(scope="module")
def gemma(default_llm):
    return default_llm


def test_tokenizer_matches_reference(gemma):
    for case in REFERENCE["cases"]:
        assert gemma.tokenizer.encode(case["prompt"]) == case["prompt_token_ids"]


def test_greedy_continuations_match_transformers(gemma):
    cases = REFERENCE["cases"]
    n = len(cases[0]["output_token_ids"])
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    # all prompts at once, in 8-token chunks mixed with the other prompts' decodes
    outs = gemma.generate([c["prompt_token_ids"] for c in cases], params)
    for case, out in zip(cases, outs):
        assert out.token_ids == case["output_token_ids"], case["prompt"]
        assert out.text == case["output_text"]


def test_cache_entry_is_validated_and_rebuilt(gemma, tmp_path, monkeypatch):
    from tandem.model_files import default_model_path

    gguf = default_model_path()
    entry = wcache.converted_entry(gguf)  # already built by the fixture: a cache hit
    copy_root = tmp_path / "converted"
    copy = copy_root / entry.name
    shutil.copytree(entry, copy)
    built = []
    monkeypatch.setattr(wcache, "_convert", lambda src, out: built.append(out) or shutil.copytree(entry, out, dirs_exist_ok=True))
    assert wcache.converted_entry(gguf, tmp_path) == copy and not built  # intact: reused
    with (copy / "model.safetensors").open("r+b") as f:  # flip bytes inside a sampled region
        f.seek(1 << 12)
        byte = f.read(1)
        f.seek(1 << 12)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert wcache.converted_entry(gguf, tmp_path) == copy and len(built) == 1  # corrupted: rebuilt
    (copy / "manifest.json").unlink()  # a partial entry (the manifest is written last)
    assert wcache.converted_entry(gguf, tmp_path) == copy and len(built) == 2
    assert wcache._valid(copy)


def test_prefix_cache_keeps_outputs_identical(gemma):
    """Prompts sharing a prefix that ends inside a block, at a block boundary and at the prompt's
    end give, served from the prefix cache, the greedy outputs they give with nothing cached."""
    prompts = [c["prompt_token_ids"] for c in REFERENCE["cases"]]
    rest = [t for p in prompts[1:] for t in p[1:]]  # the reference prompts run together, one BOS
    base = prompts[0] + rest + rest
    assert len(base) > 48
    variants = [base[:40] + [236761, 1018], base[:32] + [108, 236761], list(base)]
    short = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    fresh = []
    for p in variants:  # each alone on an empty cache: nothing to reuse
        gemma.engine.allocator.reset_cache()
        out = gemma.generate(p, short)[0]
        assert out.num_cached_tokens == 0
        fresh.append(out.token_ids)
    gemma.generate(base, short)
    reused = gemma.generate(variants, short)
    assert [o.num_cached_tokens for o in reused] == [32, 32, (len(base) - 1) // 16 * 16]
    assert [o.token_ids for o in reused] == fresh
    gemma.engine.scheduler.check_invariants()
