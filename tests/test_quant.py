"""Int8 weights: the kernels, the plain fallback and the model path against float references.

Weight-only int8 keeps activations in float32, so an int8 model must equal a float model whose
weights were replaced by their dequantized values, up to float32 rounding. w8a8 also rounds each
layer's inputs; its kernel must equal float arithmetic on the rounded inputs and weights.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tandem.build import load_model
from tandem.config import ModelConfig
from tandem.kernels import native
from tandem.models.bf16_rows import TiledBf16Weight
from tandem.ops.dispatch import BF16_TILE_ROWS, select_ops
from tandem.models.quant import Int8Linear, int8_matmul, quantize_activations, quantize_rows
from quant_helpers import assert_greedy_is_batch_independent, copy_rounded_weights, path_kernels, prefill_logits
from tiny_models import VOCAB, save_tiny



def dequantized(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.float() * s[:, None]


def test_quantize_rows_error_is_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(33, 70) * torch.logspace(-3, 1, 33)[:, None]
    w[5] = 0.0  # an all-zero row must not divide by zero
    q, s = quantize_rows(w)
    assert q.dtype == torch.int8 and s.shape == (33,)
    assert int(q.abs().max()) <= 127
    err = (dequantized(q, s) - w).abs()
    assert torch.all(err <= s[:, None] / 2 + 1e-7)
    assert torch.all(dequantized(q, s)[5] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_in_slices_equals_the_whole_matrix_at_once(dtype, monkeypatch):
    """Rows quantized a slice at a time (``QUANTIZE_ELEMENTS``; here 3 rows and a short last slice)
    round exactly as one pass over the whole matrix, and the float weight is left as it was."""
    import tandem.models.quant as quant

    torch.manual_seed(1)
    w = (torch.randn(11, 70) * torch.logspace(-3, 1, 11)[:, None]).to(dtype)
    w[4] = 0.0
    before = w.clone()
    monkeypatch.setattr(quant, "QUANTIZE_ELEMENTS", 3 * 70 + 5)
    q, s = quantize_rows(w)
    whole = w.float()
    want_s = whole.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    want_q = torch.round(whole / want_s[:, None]).clamp(-127, 127).to(torch.int8)
    assert torch.equal(q, want_q) and torch.equal(s, want_s)
    assert torch.equal(w, before)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 32])
@pytest.mark.parametrize("kind, n, k", [("int8", 7, 20), ("int8", 64, 64), ("int8", 130, 200),
                                        ("w8a8", 7, 32), ("w8a8", 64, 64), ("w8a8", 130, 224)])
def test_kernels_match_float_reference(m, kind, n, k, kernels):
    """int8: float inputs times the dequantized weights; w8a8: the same with the inputs rounded
    as ``quantize_activations`` rounds them (a first block of zeros included)."""
    torch.manual_seed(m * 1000 + n + k)
    q, s = quantize_rows(torch.randn(n, k))
    x = torch.randn(m, k)
    x[0, :32] = 0.0
    got = kernels.gemm_i8(x, q, s) if kind == "int8" else kernels.gemm_w8a8(x, kernels.w8a8_weight(q), s)
    xr = x if kind == "int8" else quantize_activations(x)
    want = xr.double() @ dequantized(q, s).double().t()
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kind", ["int8", "w8a8"])
def test_kernel_rows_are_independent_of_batch_size(kind, kernels):
    """A row's result must not depend on which other rows share the call (batch invariance)."""
    torch.manual_seed(1)
    q, s = quantize_rows(torch.randn(96, 128))
    x = torch.randn(11, 128)
    if kind == "w8a8":
        q = kernels.w8a8_weight(q)
    gemm = kernels.gemm_i8 if kind == "int8" else kernels.gemm_w8a8
    together = gemm(x, q, s)
    for i in range(11):
        assert torch.equal(gemm(x[i : i + 1].contiguous(), q, s)[0], together[i])


def test_quantize_activations_rounds_each_block_to_int8_steps():
    torch.manual_seed(4)
    x = torch.randn(3, 80) * torch.logspace(-2, 2, 80)  # blocks of 32, 32 and a short one of 16
    x[1, 32:64] = 0.0  # an all-zero block stays zero
    got = quantize_activations(x)
    for lo, hi in ((0, 32), (32, 64), (64, 80)):
        blk, out = x[:, lo:hi], got[:, lo:hi]
        d = blk.abs().amax(dim=1, keepdim=True) / 127
        steps = torch.where(d > 0, out / d.clamp_min(1e-30), torch.zeros_like(out))
        assert torch.allclose(steps, steps.round(), atol=1e-3)  # whole multiples of the scale
        assert int(steps.round().abs().max()) == 127 or bool((blk == 0).all())
        assert torch.all((out - blk).abs() <= d / 2 * (1 + 1e-5) + 1e-30)
    assert torch.all(got[1, 32:64] == 0)


# int8 at 1 and 40 rows: the kernel's side and the blocked-BLAS side of the cut; w8a8 with K = 48,
# not a multiple of 32, is rounded in torch on every path.
@pytest.mark.parametrize("w8a8, m, k", [(False, 1, 48), (False, 40, 48), (True, 7, 64), (True, 7, 48)])
@pytest.mark.parametrize("use_kernels", [True, False])
def test_int8_matmul_paths_agree(monkeypatch, w8a8, m, k, use_kernels):
    kernels = path_kernels(monkeypatch, use_kernels, k)
    torch.manual_seed(2)
    q, s = quantize_rows(torch.randn(200, k))
    x = torch.randn(3, m, k)  # leading dimensions are kept
    got = int8_matmul(x, q, s, w8a8=w8a8, kernels=kernels)
    assert got.shape == (3, m, 200)
    x2 = x.reshape(-1, k)
    want = (quantize_activations(x2) if w8a8 else x2) @ dequantized(q, s).t()
    torch.testing.assert_close(got.reshape(-1, 200), want, atol=1e-4, rtol=1e-5)


def test_int8_linear_keeps_bias_and_dtype():
    torch.manual_seed(3)
    lin = torch.nn.Linear(24, 10, bias=True)
    qlin = Int8Linear.from_linear(lin)
    x = torch.randn(5, 24)
    want = x @ dequantized(qlin.qweight, qlin.scale).t() + lin.bias
    torch.testing.assert_close(qlin(x), want, atol=1e-5, rtol=1e-5)
    assert qlin(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_int8_model_equals_float_model_with_rounded_weights(tmp_path, family):
    save_tiny(family, tmp_path)
    cfg = ModelConfig(model=str(tmp_path), dtype="float32", device="cpu")
    plain = load_model(cfg)
    int8 = load_model(ModelConfig(model=str(tmp_path), dtype="float32", device="cpu", quantization="int8"))
    assert not any(isinstance(m, torch.nn.Linear) for m in int8.model.modules())
    rounded = copy.deepcopy(plain)
    copy_rounded_weights(rounded.model, int8.model)
    ids = torch.randint(3, VOCAB, (37,))
    got, want, orig = prefill_logits(int8, ids), prefill_logits(rounded, ids), prefill_logits(plain, ids)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    assert not torch.allclose(got, orig, atol=1e-6)  # the weights really were rounded


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_w8a8_model_kernel_equals_plain_torch(tmp_path, family):
    """The whole w8a8 model on the kernels against the same model on the plain torch path."""
    save_tiny(family, tmp_path)
    # the prompts' attention as the plain path runs it (SDPA), so only the int8 kernels differ: the
    # oneDNN matmul form has its own comparison with SDPA (tests/test_matmul_attention.py)
    kernels = select_ops("cpu", torch.float32, disable=["prefill_attention"])
    w8a8 = load_model(ModelConfig(model=str(tmp_path), dtype="float32", device="cpu", quantization="w8a8"), kernels)
    int8 = load_model(ModelConfig(model=str(tmp_path), dtype="float32", device="cpu", quantization="int8"), kernels)
    assert all(m.w8a8 for m in w8a8.model.modules() if isinstance(m, Int8Linear))
    ids = torch.randint(3, VOCAB, (37,))
    got = prefill_logits(w8a8, ids)
    plain_torch = load_model(ModelConfig(model=str(tmp_path), dtype="float32", device="cpu", quantization="w8a8",
                                         kernels="torch"))
    assert not any(m.kernels for m in plain_torch.model.modules() if isinstance(m, Int8Linear))
    # Float rounding differs between the paths, and now and then it moves an activation across a
    # rounding boundary of its int8 step; later layers carry that on, so the bound is looser
    # than one layer's (a wrong kernel is off by whole units).
    torch.testing.assert_close(got, prefill_logits(plain_torch, ids), atol=1e-2, rtol=1e-3)
    # The activations really were rounded: close to weight-only int8, not equal to it.
    weight_only = prefill_logits(int8, ids)
    assert not torch.allclose(got, weight_only, atol=1e-5)
    assert (got.softmax(-1) - weight_only.softmax(-1)).abs().max() < 0.05


@pytest.mark.parametrize("quantization", ["int8", "w8a8"])
def test_int8_engine_greedy_is_batch_independent(tmp_path, quantization):
    assert_greedy_is_batch_independent(tmp_path, quantization)


def test_quantization_is_validated():
    with pytest.raises(ValueError, match="quantization"):
        ModelConfig(quantization="int3").validate()
    for mode in ("int8", "w8a8"):
        with pytest.raises(ValueError, match=f"quantization: '{mode}' runs on the CPU only"):
            ModelConfig(quantization=mode, device="cuda").validate()


def test_native_build_is_cached_and_reports_compiler_errors(tmp_path):
    if native._compiler() is None:
        pytest.skip("no C compiler")
    src = tmp_path / "k.c"
    src.write_text("int tandem_answer(void) { return 42; }\n")
    first = native.build(src, tmp_path / "out")
    assert first.name.startswith("k-")
    assert native.build(src, tmp_path / "out") == first  # the same source is not compiled again
    src.write_text("int tandem_answer(void) { return 42 }\n")
    with pytest.raises(RuntimeError, match="compiling k.c failed"):
        native.build(src, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [first.name]  # nothing half-written left


def test_w8a8_utilization_peak_times_the_integer_matmul(kernels):
    """With w8a8 weights the compute peak is the integer matmul's: measure_peaks times the
    kernel's w8a8 product (on int8 weights it quantized itself), not a float32 torch.mm."""
    from tandem.utilization import measure_peaks

    calls = []

    class Recording:
        def w8a8_weight(self, q):
            return kernels.w8a8_weight(q)

        def gemm_w8a8(self, x, q, s):
            calls.append((x.shape, q.dtype, s.shape))
            return kernels.gemm_w8a8(x, q, s)

    peaks = measure_peaks("cpu", "float32", seconds=0.05, w8a8_kernels=Recording())
    assert calls and calls[0][0] == torch.Size([1024, 1024]) and calls[0][1:] == (torch.int8, torch.Size([1024]))
    assert peaks.flops_per_s > 0 and peaks.bytes_per_s > 0


def test_w8a8_with_bf16_prompt_rows_peaks_at_the_faster_of_the_two(kernels, monkeypatch):
    """With the prompt rows on bf16 matmuls the peak is the better of the integer kernel's and a
    bf16 torch.mm's (a prompt step's utilization would read over 100% against the kernel's)."""
    from tandem import utilization

    class Slow:  # an integer kernel slower than any bf16 matmul
        def w8a8_weight(self, q):
            return q

        def gemm_w8a8(self, x, q, s):
            import time

            time.sleep(0.2)

    mm, timed = torch.mm, []

    def bf16_mm(a, b):  # a CPU without bf16 arithmetic emulates it slower than the sleep: count the call
        timed.append(a.dtype)
        return mm(a[:1], b[:, :1])

    monkeypatch.setattr(torch, "mm", bf16_mm)
    kernel_only = utilization.measure_peaks("cpu", "float32", seconds=0.1, w8a8_kernels=Slow())
    assert not timed and kernel_only.flops_per_s < 2 * 1024**3 / 0.2 + 1  # only the sleeping kernel was timed
    both = utilization.measure_peaks("cpu", "float32", seconds=0.1, w8a8_kernels=Slow(), bf16_prompts=True)
    assert timed and set(timed) == {torch.bfloat16}
    assert both.flops_per_s > kernel_only.flops_per_s  # the faster of the two counts


def _native_bf16() -> bool:
    from tandem.kernels.cpu_features import cpu_info

    return cpu_info().bf16_arithmetic


@pytest.mark.parametrize("use_kernels", [True, False])
@pytest.mark.parametrize("bf16_rows", [list(range(40)), list(range(7, 40)), [*range(2, 11), *range(20, 40)]])
def test_w8a8_prompt_rows_multiply_in_bf16_and_the_rest_stay_w8a8(use_kernels, bf16_rows, kernels):
    """Inside a forward pass whose split names some rows (prompt positions of long prompts):
    those rows are bf16(x) @ bf16(q).T (the int8 weights exactly) times the scales; the others
    are the w8a8 rows they would be alone; outside a forward pass every row is w8a8."""
    from tandem.models.context import BF16_ROWS, row_split

    torch.manual_seed(3)
    q, s = quantize_rows(torch.randn(48, 64))
    lin = Int8Linear(q, s, None, w8a8=True, kernels=kernels if use_kernels else None)
    x = torch.randn(40, 64)
    split = row_split(bf16_rows, 40, torch.device("cpu"))
    token = BF16_ROWS.set(split)
    try:
        got = lin(x)
    finally:
        BF16_ROWS.reset(token)
    rest = [r for r in range(40) if r not in bf16_rows]
    assert (split.rest is None) == (not rest)
    if rest:
        assert torch.equal(got[rest], lin(x[rest]))  # w8a8, as alone
    want = TiledBf16Weight(q.to(torch.bfloat16))(x[bf16_rows].to(torch.bfloat16)).float() * s
    assert torch.equal(got[bf16_rows], want)
    assert torch.equal(lin(x), int8_matmul(x, lin.qweight, s, w8a8=True, kernels=lin.kernels))  # no forward pass: w8a8


def test_w8a8_bf16_prompt_rows_do_not_depend_on_how_many_share_the_call():
    """The bf16 road's rows are the same bits whatever the row count of the call (what keeps a
    prompt chunk's rows independent of its step mates): its calls all have one row count. Plain
    oneDNN calls do not give this on AMX (its blocking follows the row count), so the check runs
    on the shapes and row counts where it failed there; on any CPU with bf16 arithmetic."""
    if not _native_bf16():
        pytest.skip("this CPU has no bf16 arithmetic (avx512_bf16 or AMX): the bf16 road is off here")
    torch.manual_seed(4)
    for k, n in ((640, 1536), (640, 1024), (2048, 640)):
        w = torch.randint(-127, 128, (n, k)).to(torch.bfloat16)
        x = torch.randn(600, k).to(torch.bfloat16)
        tiled = TiledBf16Weight(w)
        full = tiled(x)
        assert full.shape == (600, n)
        torch.testing.assert_close(full.float(), torch.nn.functional.linear(x, w).float(), rtol=1e-2, atol=1e-2 * full.float().abs().max().item())
        for a, b in ((0, 1), (0, 32), (5, 70), (33, 300), (299, 300), (3, 3 + BF16_TILE_ROWS), (100, 600)):
            assert torch.equal(tiled(x[a:b]), full[a:b]), (k, n, a, b)
        unpacked = TiledBf16Weight(w, pack=False)  # as torch without oneDNN: the same tiles, repacked per call
        assert torch.equal(unpacked(x[5:70]), unpacked(x)[5:70])


def test_w8a8_with_bf16_prompt_rows_keeps_greedy_outputs_batch_independent(tmp_path, monkeypatch):
    """The runner names the prompt positions of long prompts (here 8+ tokens, so most of the
    test's prompts), mixed with decodes and split over steps by a 16-token budget: each request's
    greedy tokens are the same together and alone, and the bf16 road did run."""
    if not _native_bf16():
        pytest.skip("this CPU has no bf16 arithmetic (avx512_bf16 or AMX): the bf16 road is off here")
    import dataclasses

    from tandem import LLM
    from tiny_models import greedy_together_and_alone

    save_tiny("gemma3", tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", quantization="w8a8", max_num_batched_tokens=16)
    model = llm.engine.runner.model
    model.ops = dataclasses.replace(model.ops, w8a8_prompt_bf16_tokens=8)
    model.bf16_prompt_attention = True  # as on AMX CPUs: their attention in bf16 too
    calls, attention = [], []
    real = Int8Linear._bf16_rows
    monkeypatch.setattr(Int8Linear, "_bf16_rows", lambda self, x: calls.append(x.shape[0]) or real(self, x))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, *a, **kw: attention.append(q.dtype) or sdpa(q, *a, **kw))
    from tandem.ops import paged_attention

    matmul = paged_attention.matmul_attention  # float32 prompts' form on AMD CPUs with AVX-512
    monkeypatch.setattr(paged_attention, "matmul_attention",
                        lambda q, *a, **kw: attention.append(q.dtype) or matmul(q, *a, **kw))
    together, alone = greedy_together_and_alone(llm)
    assert together == alone
    assert calls and llm.engine.allocator.all_free()
    assert torch.bfloat16 in attention and torch.float32 in attention  # long prompts in bf16, short ones not
