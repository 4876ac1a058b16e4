"""The fused decode layers (tandem/kernels/decode_layers.c): the same bits as the op-by-op path
for every row of a decode step, chosen only where they apply, and used by the engine."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from tandem.build import load_model
from tandem.config import ModelConfig
from tandem.kernels import native
from tandem.models.context import ForwardContext
from tandem.models.decode_layers import DecodeLayers
from tandem.ops.dispatch import select_ops
from tandem.ops.paged_attention import build_metadata
from tiny_models import VOCAB, save_tiny

needs_kernels = pytest.mark.skipif(not native.available(), reason="no native kernels here")
BLOCK = 4


def _w8a8(tmp_path, family: str, **config):
    save_tiny(family, tmp_path)
    return load_model(ModelConfig(model=str(tmp_path), dtype="float32", device="cpu", quantization="w8a8", **config))


def _decode_step(loaded, contexts: list[int], seed: int = 0):
    """A KV cache holding random keys and values for sequences of ``contexts`` positions (their
    blocks interleaved), and the context of one decode step that adds a token to each."""
    spec = loaded.spec
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-(n + 1) // BLOCK) for n in contexts]
    total = sum(per_seq)
    order = torch.randperm(total, generator=g).tolist()  # blocks scattered over the cache
    tables, at = [], 0
    for n in per_seq:
        tables.append(order[at:at + n])
        at += n
    cache = torch.randn(spec.num_layers, 2, total * BLOCK, spec.num_kv_heads, spec.head_dim, generator=g)
    meta = build_metadata([(n, 1, t) for n, t in zip(contexts, tables)], BLOCK, spec.sliding_window,
                          torch.device("cpu"))
    ids = torch.randint(3, VOCAB, (len(contexts),), generator=g)
    return ids, cache, meta, torch.tensor(contexts)


def _hidden(loaded, ids, cache, meta, positions, fused: bool):
    model = loaded.model
    keep = model.decode_layers
    model.decode_layers = keep if fused else None
    try:
        with torch.no_grad():
            return model(ids, ForwardContext(meta, cache, positions))
    finally:
        model.decode_layers = keep


@needs_kernels
@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3"])
@pytest.mark.parametrize("contexts", [[5], [300], [3, 130, 7, 260, 1, 40]])
def test_fused_layers_give_the_per_op_bits(tmp_path, family, contexts):
    """Hidden states and the KV cache written: bitwise those of the op-by-op path, with contexts of
    one to three attention parts and (Gemma 3) past the sliding window."""
    loaded = _w8a8(tmp_path, family)
    assert loaded.model.decode_layers is not None
    ids, cache, meta, positions = _decode_step(loaded, contexts)
    per_op_cache, fused_cache = cache.clone(), cache.clone()
    want = _hidden(loaded, ids, per_op_cache, meta, positions, fused=False)
    calls = []
    real = native.Kernels.decode_layers
    native.Kernels.decode_layers = lambda self, *a: calls.append(1) or real(self, *a)
    try:
        got = _hidden(loaded, ids, fused_cache, meta, positions, fused=True)
    finally:
        native.Kernels.decode_layers = real
    assert calls == [1]
    assert torch.equal(got, want)
    assert torch.equal(fused_cache, per_op_cache)
    assert not torch.equal(fused_cache, cache)  # this step's keys and values were written


@needs_kernels
def test_a_row_does_not_depend_on_its_step_mates(tmp_path):
    loaded = _w8a8(tmp_path, "gemma3")
    contexts = [3, 130, 7, 260]
    ids, cache, meta, positions = _decode_step(loaded, contexts)
    together = _hidden(loaded, ids, cache.clone(), meta, positions, fused=True)
    for s in range(len(contexts)):
        g = meta.groups[0]
        table = g.block_tables[s].tolist()
        one = build_metadata([(contexts[s], 1, table)], BLOCK, loaded.spec.sliding_window, torch.device("cpu"))
        alone = _hidden(loaded, ids[s:s + 1], cache.clone(), one, positions[s:s + 1], fused=True)
        assert torch.equal(alone[0], together[s])


@needs_kernels
def test_steps_with_prompt_tokens_go_op_by_op(tmp_path):
    loaded = _w8a8(tmp_path, "llama")
    spec = loaded.spec
    cache = torch.zeros(spec.num_layers, 2, 64, spec.num_kv_heads, spec.head_dim)
    x = torch.zeros(4, spec.hidden_size)
    prompt = build_metadata([(0, 3, [0]), (5, 1, [1, 2])], BLOCK, None, torch.device("cpu"))
    decode = build_metadata([(5, 1, [1, 2])], BLOCK, None, torch.device("cpu"))
    assert not DecodeLayers.takes(ForwardContext(prompt, cache, torch.arange(4)), x)
    assert DecodeLayers.takes(ForwardContext(decode, cache, torch.tensor([5])), x[:1])
    assert not DecodeLayers.takes(ForwardContext(decode, cache.bfloat16(), torch.tensor([5])), x[:1])


@needs_kernels
def test_chosen_only_where_they_apply(tmp_path):
    assert select_ops("cpu", torch.float32).choices["decode_layers"].impl == native.best().name
    assert select_ops("cpu", torch.bfloat16).choices["decode_layers"].impl == "per-op"
    assert select_ops("cuda", torch.float32).choices["decode_layers"].impl == "per-op"
    off = select_ops("cpu", torch.float32, disable=["decode_attention"])
    assert off.decode_layers is None and "decode_attention runs in torch" in off.choices["decode_layers"].reason
    assert select_ops("cpu", torch.float32, disable=["decode_layers"]).decode_layers is None
    save_tiny("qwen2", tmp_path / "qwen2")  # q/k/v biases
    biased = load_model(ModelConfig(model=str(tmp_path / "qwen2"), dtype="float32", quantization="w8a8"))
    assert biased.model.decode_layers is None and DecodeLayers.why_not(biased.model) == "linear biases run op by op"
    assert biased.paths()["ops"]["decode_layers"] == "per-op"
    save_tiny("llama", tmp_path / "llama")
    int8 = load_model(ModelConfig(model=str(tmp_path / "llama"), dtype="float32", quantization="int8"))
    assert int8.model.decode_layers is None and int8.paths()["ops"]["decode_layers"] == "per-op"
    w8a8 = load_model(ModelConfig(model=str(tmp_path / "llama"), dtype="float32", quantization="w8a8"))
    assert w8a8.paths()["ops"]["decode_layers"] == native.best().name


@needs_kernels
def test_a_deep_copy_runs_on_its_own_weights(tmp_path):
    loaded = _w8a8(tmp_path, "llama")
    ids, cache, meta, positions = _decode_step(loaded, [9, 20])
    want = _hidden(loaded, ids, cache.clone(), meta, positions, fused=True)
    twin = copy.deepcopy(loaded)
    assert twin.model.decode_layers.model is twin.model
    for m in twin.model.modules():  # the copy's weights changed: the original's must not be read
        if hasattr(m, "qweight"):
            m.qweight.zero_()
    assert torch.equal(_hidden(loaded, ids, cache.clone(), meta, positions, fused=True), want)
    assert not torch.equal(_hidden(twin, ids, cache.clone(), meta, positions, fused=True), want)


@needs_kernels
def test_engine_runs_its_decode_steps_fused_and_greedy_stays_batch_independent(tmp_path, monkeypatch):
    from tandem import LLM
    from tiny_models import greedy_together_and_alone

    save_tiny("gemma3", tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", quantization="w8a8", max_num_batched_tokens=16)
    model = llm.engine.runner.model
    model.ops = dataclasses.replace(model.ops, w8a8_prompt_bf16_tokens=None)
    calls = []
    real = native.Kernels.decode_layers
    monkeypatch.setattr(native.Kernels, "decode_layers", lambda self, *a: calls.append(a[1].T) or real(self, *a))
    together, alone = greedy_together_and_alone(llm, max_tokens=40)
    assert together == alone
    assert max(calls) > 1 and 1 in calls  # batched and single decode steps both ran fused
    assert llm.engine.allocator.all_free()
