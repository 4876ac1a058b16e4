"""Prompt attention as oneDNN matmuls (``tandem.ops.matmul_attention``): against torch's SDPA path,
each sequence independent of its step mates bit for bit, and where the op table chooses it."""

from __future__ import annotations

import pytest
import torch

from tandem.ops import dispatch, matmul_attention
from tandem.ops.paged_attention import build_metadata, paged_attention

pytestmark = pytest.mark.skipif(not matmul_attention.available(), reason="this torch build has no oneDNN")

BLOCK = 4


def _cache(slots: int, kv_heads: int, dim: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(slots, kv_heads, dim, generator=g), torch.randn(slots, kv_heads, dim, generator=g)


def _seqs(spans: list[tuple[int, int]]) -> list[tuple[int, int, list[int]]]:
    """Each (start, tokens) chunk with a block table of its own, blocks in reverse order (not contiguous)."""
    out, first = [], 0
    for start, n in spans:
        blocks = -(-(start + n) // BLOCK)
        out.append((start, n, list(range(first + blocks - 1, first - 1, -1))))
        first += blocks
    return out


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("heads, kv_heads", [(4, 1), (4, 2), (2, 2)])
def test_matches_sdpa_on_mixed_chunks_with_tiles_and_windows(monkeypatch, window, heads, kv_heads):
    monkeypatch.setattr(matmul_attention, "TILE", 5)  # several tiles per chunk, a short last one
    spans = [(0, 23), (9, 6), (30, 1), (3, 17), (40, 2)]
    seqs = _seqs(spans)
    k_cache, v_cache = _cache(BLOCK * 64, kv_heads, 16)
    q = torch.randn(sum(n for _, n in spans), heads, 16, generator=torch.Generator().manual_seed(1))
    for sliding in (False, True):
        want = paged_attention(q, k_cache, v_cache, build_metadata(seqs, BLOCK, window, torch.device("cpu")),
                               0.25, sliding)
        got = paged_attention(q, k_cache, v_cache, build_metadata(seqs, BLOCK, window, torch.device("cpu")),
                              0.25, sliding, None, True)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_prompt_does_not_depend_on_its_step_mates_bit_for_bit(monkeypatch):
    monkeypatch.setattr(matmul_attention, "TILE", 8)
    k_cache, v_cache = _cache(BLOCK * 64, 1, 32)
    mine = (5, 21)
    q_mine = torch.randn(mine[1], 4, 32, generator=torch.Generator().manual_seed(2))
    alone = paged_attention(q_mine, k_cache, v_cache, build_metadata(_seqs([mine]), BLOCK, None, torch.device("cpu")),
                            0.2, False, None, True)
    # the same chunk (same blocks) beside a longer chunk that pads the group to more queries and keys
    other = (0, 40)
    seqs = _seqs([mine, other])
    q = torch.cat([q_mine, torch.randn(other[1], 4, 32)])
    together = paged_attention(q, k_cache, v_cache, build_metadata(seqs, BLOCK, None, torch.device("cpu")),
                               0.2, False, None, True)
    assert torch.equal(together[:mine[1]], alone)


def _fake_cpu(monkeypatch, vendor: str, features: set[str]) -> None:
    from tandem.kernels.cpu_features import CPUInfo

    info = CPUInfo("fake", frozenset(features), frozenset(features), False, "AVX512", vendor)
    monkeypatch.setattr(dispatch, "cpu_info", lambda: info)


@pytest.mark.parametrize("vendor, features, dtype, kernels, impl", [
    ("AuthenticAMD", {"avx2", "avx512"}, torch.float32, "auto", "onednn-matmul"),
    ("AuthenticAMD", {"avx2", "avx512"}, torch.float32, "torch", "torch-sdpa"),
    ("AuthenticAMD", {"avx2", "avx512"}, torch.bfloat16, "auto", "torch-sdpa"),
    ("AuthenticAMD", {"avx2"}, torch.float32, "auto", "torch-sdpa"),  # AVX2 only: measured slower (Zen 3)
    ("GenuineIntel", {"avx2", "avx512"}, torch.float32, "auto", "torch-sdpa"),
    ("", {"avx2", "avx512"}, torch.float32, "auto", "torch-sdpa"),
])
def test_chosen_for_float32_prompts_on_amd_cpus_with_avx512(monkeypatch, vendor, features, dtype, kernels, impl):
    _fake_cpu(monkeypatch, vendor, features)
    ops = dispatch.select_ops("cpu", dtype, kernels=kernels)
    assert ops.choices["prefill_attention"].impl == impl
    assert ops.prompt_attention_matmul == (impl == "onednn-matmul")


def test_never_on_cuda_and_can_be_disabled(monkeypatch):
    _fake_cpu(monkeypatch, "AuthenticAMD", {"avx2", "avx512"})
    assert not dispatch.select_ops("cuda", torch.float32).prompt_attention_matmul
    off = dispatch.select_ops("cpu", torch.float32, disable=["prefill_attention"])
    assert not off.prompt_attention_matmul and off.choices["prefill_attention"].impl == "torch-sdpa"
