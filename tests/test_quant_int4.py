"""Int4 weights: the packing, the rounding, the kernels, the plain fallback and the model path.

Weight-only int4 keeps activations in float32, so an int4 model must equal a float model whose
weights were replaced by their dequantized values, up to float32 rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tandem.build import QUANTIZERS, load_model
from tandem.config import QUANTIZATIONS, ModelConfig
from tandem.kernels import native
from tandem.models import quant
from tandem.models.quant_int4 import (
    BYTES_PER_WEIGHT, INT4_GROUP, INT4_ROWS, SCALE_STEPS, Int4Linear, dequantize, int4_matmul, pack, quantize_groups,
    unpack,
)
from quant_helpers import assert_greedy_is_batch_independent, copy_rounded_weights, path_kernels, prefill_logits
from tiny_models import VOCAB, save_tiny


def test_pack_unpack_round_trip_and_layout():
    torch.manual_seed(0)
    codes = torch.randint(-8, 8, (5, 3 * INT4_GROUP), dtype=torch.int8)
    packed = pack(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 3 * 16)
    assert torch.equal(unpack(packed), codes)
    # Byte t of a group: value t + 8 in the low nibble, value t + 16 (+ 8) in the high one.
    g, t = 1, 5
    byte = int(packed[2, g * 16 + t])
    assert byte & 0x0F == int(codes[2, g * 32 + t]) + 8
    assert byte >> 4 == int(codes[2, g * 32 + t + 16]) + 8


@pytest.mark.parametrize("k", [64, 70, 17])
def test_quantize_error_is_at_most_half_a_step_per_group(k):
    torch.manual_seed(k)
    rows = 33
    w = torch.randn(rows, k) * torch.logspace(-6, 1, rows)[:, None]
    w[5] = 0.0  # an all-zero row must not divide by zero
    w[7, :k // 2] = 0.0  # and neither may an all-zero group
    w[9] = w[9].abs()  # one-signed groups: the scale's sign puts the extreme near -8
    w[10] = -w[10].abs()
    packed, scales = quantize_groups(w)
    groups = -(-k // INT4_GROUP)
    assert packed.shape == (rows, groups * 16) and scales.shape == (rows, groups) and scales.dtype == torch.float16
    codes = unpack(packed)
    assert int(codes.min()) >= -8 and int(codes.max()) <= 7
    assert torch.all(codes[:, k:] == 0)  # the short last group is padded with zero codes
    assert torch.all(scales[9] <= 0) and torch.all(scales[10] >= 0)
    step = scales.float().abs().repeat_interleave(INT4_GROUP, dim=1)[:, :k]
    err = (dequantize(packed, scales, k) - w).abs()
    assert torch.all(err <= step / 2 * (1 + 1e-6))
    assert torch.all(dequantize(packed, scales, k)[5] == 0)
    # The steps are as fine as the bound permits, up to the search's largest step.
    g = torch.nn.functional.pad(w, (0, groups * INT4_GROUP - k)).view(rows, groups, INT4_GROUP)
    hi, lo = g.amax(-1), g.amin(-1)
    smallest = torch.maximum(torch.maximum(hi, -lo) / 8.5, torch.minimum(hi, -lo).clamp_min(0) / 7.5)
    assert torch.all(scales.float().abs() <= smallest * max(SCALE_STEPS) * (1 + 2e-3) + 1e-7)


def test_scale_search_beats_the_smallest_scale():
    """The chosen scales have less error, weighted by w ** 2, than the smallest valid ones."""
    torch.manual_seed(3)
    w = torch.randn(64, 256)
    packed, scales = quantize_groups(w)
    g = w.view(64, -1, INT4_GROUP)
    hi, lo = g.amax(-1), g.amin(-1)
    d = torch.maximum(torch.maximum(hi, -lo) / 8.5, torch.minimum(hi, -lo) / 7.5)
    d = torch.where(-lo >= hi, d, -d)[..., None]
    smallest = torch.round(g / d).clamp(-8, 7) * d
    searched = dequantize(packed, scales, 256).view_as(g)
    assert (g**2 * (searched - g) ** 2).sum() < 0.95 * (g**2 * (smallest - g) ** 2).sum()


def _reference(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, k: int) -> torch.Tensor:
    return x.double() @ dequantize(packed, scales, k).double().t()


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 32])
@pytest.mark.parametrize("n, k", [(7, 32), (64, 64), (130, 640), (65, 200), (9, 17), (5, 48)])
def test_kernel_matches_float_reference(m, n, k, kernels):
    """Against float inputs times the dequantized weights; K multiples of 32 and not (the short
    last group), N not a multiple of the register block or of a tile."""
    torch.manual_seed(m * 1000 + n + k)
    packed, scales = quantize_groups(torch.randn(n, k))
    x = torch.randn(m, k)
    got = kernels.gemm_i4(x, packed, scales)
    torch.testing.assert_close(got.double(), _reference(x, packed, scales, k), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("k", [128, 200])
def test_kernel_rows_are_independent_of_batch_size(k, kernels):
    """A row's result must not depend on which other rows share the call (batch invariance)."""
    torch.manual_seed(1)
    packed, scales = quantize_groups(torch.randn(96, k))
    x = torch.randn(11, k)
    together = kernels.gemm_i4(x, packed, scales)
    for i in range(11):
        assert torch.equal(kernels.gemm_i4(x[i : i + 1].contiguous(), packed, scales)[0], together[i])
    for lo, hi in ((0, 4), (3, 10), (8, 11)):
        assert torch.equal(kernels.gemm_i4(x[lo:hi].contiguous(), packed, scales), together[lo:hi])


@pytest.mark.parametrize("k", [640, 70])
def test_dequant_kernel_equals_torch_bit_for_bit(k, kernels):
    torch.manual_seed(5)
    packed, scales = quantize_groups(torch.randn(50, k))
    buf = torch.empty(50, k)
    got = kernels.dequant_i4(packed, scales, k, buf, 10, 37)
    assert torch.equal(got, dequantize(packed[10:37], scales[10:37], k))


def test_kernel_rejects_mismatched_weights(kernels):
    packed, scales = quantize_groups(torch.randn(4, 64))
    with pytest.raises(ValueError, match="int4 weights for K=96"):
        kernels.gemm_i4(torch.randn(1, 96), packed, scales)


# 1 and 40 rows: the kernel's side and the blocked-BLAS side of the cut; K = 48 has a short group.
@pytest.mark.parametrize("m, k", [(1, 64), (40, 64), (1, 48), (40, 48)])
@pytest.mark.parametrize("use_kernels", [True, False])
def test_int4_matmul_paths_agree(monkeypatch, m, k, use_kernels):
    kernels = path_kernels(monkeypatch, use_kernels, k)
    torch.manual_seed(2)
    packed, scales = quantize_groups(torch.randn(200, k))
    x = torch.randn(3, m, k)  # leading dimensions are kept
    got = int4_matmul(x, packed, scales, k, kernels=kernels)
    assert got.shape == (3, m, 200)
    want = _reference(x.reshape(-1, k), packed, scales, k)
    torch.testing.assert_close(got.reshape(-1, 200).double(), want, atol=1e-4, rtol=1e-5)
    if use_kernels:  # the blocked path against the kernel on the same rows
        monkeypatch.setattr(quant, "use_kernel", lambda *args: False)
        blocked = int4_matmul(x, packed, scales, k, kernels=kernels)
        monkeypatch.setattr(quant, "use_kernel", lambda *args: True)
        kernel = int4_matmul(x, packed, scales, k, kernels=kernels)
        torch.testing.assert_close(blocked, kernel, atol=1e-4, rtol=1e-5)


def test_int4_linear_keeps_bias_dtype_and_rows():
    torch.manual_seed(3)
    lin = torch.nn.Linear(40, 10, bias=True)
    qlin = Int4Linear.from_weight(lin.weight, lin.bias)
    x = torch.randn(5, 40)
    table = dequantize(qlin.packed, qlin.scales, 40)
    torch.testing.assert_close(qlin(x), x @ table.t() + lin.bias, atol=1e-5, rtol=1e-5)
    assert qlin(x.bfloat16()).dtype == torch.bfloat16
    ids = torch.tensor([[3, 0], [9, 3]])
    assert torch.equal(qlin.rows(ids), table[ids])


@pytest.mark.parametrize("family, overrides", [("llama", {}), ("gemma3", {}), ("llama", {"hidden_size": 80})])
@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_int4_model_equals_float_model_with_rounded_weights(tmp_path, family, overrides, kernels):
    """hidden_size 80: the layers reading the hidden state have a short last group."""
    save_tiny(family, tmp_path, **overrides)
    plain = load_model(ModelConfig(model=str(tmp_path), dtype="float32", device="cpu"))
    int4 = load_model(ModelConfig(model=str(tmp_path), dtype="float32", device="cpu", quantization="int4",
                                  kernels=kernels))
    layers = [m for m in int4.model.modules() if isinstance(m, Int4Linear)]
    assert layers and not any(isinstance(m, torch.nn.Linear) for m in int4.model.modules())
    assert all((m.kernels is None) == (kernels == "torch" or not native.available()) for m in layers)
    rounded = copy.deepcopy(plain)
    copy_rounded_weights(rounded.model, int4.model)
    ids = torch.randint(3, VOCAB, (37,))
    got, want, orig = prefill_logits(int4, ids), prefill_logits(rounded, ids), prefill_logits(plain, ids)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    # One decode-sized row (the kernel's side of the cut) against the same rows of the prefill.
    torch.testing.assert_close(prefill_logits(int4, ids[:1]), want[:1], atol=2e-4, rtol=1e-4)
    assert not torch.allclose(got, orig, atol=1e-3)  # the weights really were rounded


def test_int4_engine_greedy_is_batch_independent(tmp_path):
    assert_greedy_is_batch_independent(tmp_path, "int4")


def test_every_quantization_has_a_quantizer_and_honest_bytes(tmp_path):
    assert set(QUANTIZERS) == set(QUANTIZATIONS) - {"none", "auto"}  # auto resolves to one of them
    assert set(INT4_ROWS) == set(native.VARIANT_NAMES)  # row limits for every kernel variant
    assert BYTES_PER_WEIGHT == 0.5625  # half a byte and a float16 scale per 32 weights
    with pytest.raises(ValueError, match="quantization: 'int4' runs on the CPU only"):
        ModelConfig(quantization="int4", device="cuda").validate()
    save_tiny("llama", tmp_path)
    loaded = load_model(ModelConfig(model=str(tmp_path), dtype="float32", device="cpu", quantization="int4"))
    assert loaded.weight_bytes == BYTES_PER_WEIGHT
    stored = sum(m.packed.numel() + 2 * m.scales.numel() for m in loaded.model.modules() if isinstance(m, Int4Linear))
    cost = loaded.cost()
    assert stored == pytest.approx((cost.layer_params + cost.head_params) * BYTES_PER_WEIGHT)
    _, nbytes = cost.step([(0, 1)], 1)
    assert nbytes == pytest.approx(stored + cost.kv_bytes_per_token)
