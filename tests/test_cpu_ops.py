"""The fused float32 CPU kernels (tandem/kernels/cpu_ops.c) against the torch operators they
replace, on odd sizes (vector tails), the multi-threaded sizes, and awkward values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels import native

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler or no AVX2 on this CPU")


@pytest.mark.parametrize("rows, d", [(1, 640), (3, 70), (257, 256), (5, 7)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_matches_torch(rows, d, offset):
    torch.manual_seed(rows + d)
    x = torch.randn(rows, d) * 30
    w = torch.randn(d)
    want = F.rms_norm(x, (d,), offset + w, 1e-6)
    torch.testing.assert_close(native.rms_norm(x, w, 1e-6, offset), want, atol=1e-5, rtol=1e-5)


def test_rms_norm_keeps_leading_dimensions_and_zero_rows():
    x = torch.zeros(2, 3, 32)
    x[1] = torch.randn(3, 32)
    got = native.rms_norm(x, torch.ones(32), 1e-6, 0.0)
    assert got.shape == x.shape and torch.all(got[0] == 0)
    torch.testing.assert_close(got[1], F.rms_norm(x[1], (32,), None, 1e-6))


@pytest.mark.parametrize("kind, ref", [("silu", F.silu), ("gelu_tanh", lambda t: F.gelu(t, approximate="tanh"))])
@pytest.mark.parametrize("rows, i", [(1, 2048), (3, 13), (40, 1024)])
def test_act_mul_matches_torch(kind, ref, rows, i):
    torch.manual_seed(rows * i)
    gate_up = torch.randn(rows, 2 * i) * 4
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 60.0, -60.0, 1e-20, -200.0])  # saturation and zeros
    gate, up = gate_up.split(i, dim=-1)
    torch.testing.assert_close(native.act_mul(gate_up, kind), ref(gate) * up, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows, n", [(1, 262147), (16, 1000), (3, 5)])
def test_argmax_matches_torch(rows, n):
    torch.manual_seed(rows + n)
    x = torch.randn(rows, n)
    assert torch.equal(native.argmax_rows(x), x.argmax(dim=-1))


def test_argmax_takes_the_first_of_equal_maxima():
    x = torch.full((4, 37), -float("inf"))
    x[0, [3, 11, 30]] = 2.0  # ties across vector lanes and in the tail
    x[1, [36, 9]] = 1.0
    x[2, :] = 0.5  # all equal
    # row 3: all -inf, like a fully masked row: index 0, as torch
    assert native.argmax_rows(x).tolist() == [3, 9, 0, 0]
    assert x[:3].argmax(dim=-1).tolist() == [3, 9, 0]


def test_usable_only_for_contiguous_float32_cpu_tensors():
    x = torch.randn(4, 8)
    assert native.usable(x)
    assert not native.usable(x.t())
    assert not native.usable(x.double())
    assert not native.usable(x, x.bfloat16())
