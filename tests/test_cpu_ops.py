"""The fused float32 CPU kernels (tandem/kernels/cpu_ops.c) against the torch operators they
replace, on odd sizes (vector tails), the multi-threaded sizes, and awkward values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.ops import reference
from tandem.ops.dispatch import select_ops



@pytest.mark.parametrize("rows, d", [(1, 640), (3, 70), (257, 256), (5, 7)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_matches_torch(rows, d, offset, kernels):
    torch.manual_seed(rows + d)
    x = torch.randn(rows, d) * 30
    w = torch.randn(d)
    want = F.rms_norm(x, (d,), offset + w, 1e-6)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6, offset), want, atol=1e-5, rtol=1e-5)


def test_rms_norm_keeps_leading_dimensions_and_zero_rows(kernels):
    x = torch.zeros(2, 3, 32)
    x[1] = torch.randn(3, 32)
    got = kernels.rms_norm(x, torch.ones(32), 1e-6, 0.0)
    assert got.shape == x.shape and torch.all(got[0] == 0)
    torch.testing.assert_close(got[1], F.rms_norm(x[1], (32,), None, 1e-6))


@pytest.mark.parametrize("kind, ref", [("silu", F.silu), ("gelu_tanh", lambda t: F.gelu(t, approximate="tanh"))])
@pytest.mark.parametrize("rows, i", [(1, 2048), (3, 13), (40, 1024)])
def test_act_mul_matches_torch(kind, ref, rows, i, kernels):
    torch.manual_seed(rows * i)
    gate_up = torch.randn(rows, 2 * i) * 4
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 60.0, -60.0, 1e-20, -200.0])  # saturation and zeros
    gate, up = gate_up.split(i, dim=-1)
    torch.testing.assert_close(kernels.act_mul(gate_up, kind), ref(gate) * up, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows, n", [(1, 262147), (16, 1000), (3, 5)])
def test_argmax_matches_torch(rows, n, kernels):
    torch.manual_seed(rows + n)
    x = torch.randn(rows, n)
    assert torch.equal(kernels.argmax_rows(x), x.argmax(dim=-1))


def test_argmax_takes_the_first_of_equal_maxima(kernels):
    x = torch.full((4, 37), -float("inf"))
    x[0, [3, 11, 30]] = 2.0  # ties across vector lanes and in the tail
    x[1, [36, 9]] = 1.0
    x[2, :] = 0.5  # all equal
    # row 3: all -inf, like a fully masked row: index 0, as torch
    assert kernels.argmax_rows(x).tolist() == [3, 9, 0, 0]
    assert x[:3].argmax(dim=-1).tolist() == [3, 9, 0]


def test_argmax_of_one_long_row_split_across_threads_keeps_the_first_maximum(kernels):
    """One row of a vocabulary's size is split into spans for the threads: ties across spans
    (and a maximum in the last, shorter span) resolve as in one pass."""
    n = 262147
    x = torch.full((3, n), -float("inf"))
    x[0, [200000, 40000, n - 1]] = 3.0  # equal maxima in three spans: the first
    x[1, :] = 0.25  # all equal: index 0
    x[1, n - 1] = 0.5  # ... except the very last value
    for row in range(3):  # one row at a time, as at batch 1 (row 2: all -inf, index 0 as torch)
        assert kernels.argmax_rows(x[row : row + 1]).tolist() == [[40000], [n - 1], [0]][row]
        assert kernels.argmax_rows(x[row : row + 1]).tolist() == x[row : row + 1].argmax(dim=-1).tolist()


def test_dispatch_wrappers_take_non_contiguous_inputs():
    """The op table's kernel entries accept views (a transposed or sliced tensor) as torch does."""
    ops = select_ops("cpu", torch.float32)
    assert ops.choices["rms_norm"].impl.startswith("native")
    x = torch.randn(8, 4).t()  # [4, 8], not contiguous
    w = torch.randn(8)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6, 0.0), reference.rms_norm(x, w, 1e-6, 0.0),
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(ops.argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.parametrize("with_norm, offset", [(False, 0.0), (True, 0.0), (True, 1.0)])
@pytest.mark.parametrize("t", [1, 5, 300])
def test_qkv_to_cache_matches_norm_rope_and_cache_write(with_norm, offset, t, kernels):
    """The fused q/k norm + rotary + cache write against the same steps in torch."""
    torch.manual_seed(t)
    h, kvh, d, slots = 4, 2, 16, 700
    qkv = torch.randn(t, (h + 2 * kvh) * d) * 3
    qw, kw = (torch.randn(d) if with_norm else None for _ in range(2))
    angles = torch.rand(t, d // 2) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    where = torch.randperm(slots)[:t]
    k_cache, v_cache = torch.zeros(slots, kvh, d), torch.zeros(slots, kvh, d)
    q = kernels.qkv_to_cache(qkv, h, qw, kw, 1e-6, offset, cos, sin, where, k_cache, v_cache)

    wq, wk, wv = qkv.split((h * d, kvh * d, kvh * d), dim=-1)
    wq, wk, wv = wq.view(t, h, d), wk.view(t, kvh, d), wv.view(t, kvh, d)
    if with_norm:
        wq, wk = F.rms_norm(wq, (d,), offset + qw, 1e-6), F.rms_norm(wk, (d,), offset + kw, 1e-6)
    c, s = cos[:, None], sin[:, None]
    wq, wk = wq * c + reference.rotate_half(wq) * s, wk * c + reference.rotate_half(wk) * s
    torch.testing.assert_close(q, wq, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_cache[where], wk, atol=1e-5, rtol=1e-5)
    assert torch.equal(v_cache[where], wv)
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[where] = False
    assert torch.all(k_cache[untouched] == 0) and torch.all(v_cache[untouched] == 0)
    # the plain torch form the dispatch layer falls back to computes the same
    rk, rv = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    rq = reference.qkv_to_cache(qkv, h, qw, kw, 1e-6, offset, cos, sin, where, rk, rv)
    torch.testing.assert_close(rq, q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rk, k_cache, atol=1e-5, rtol=1e-5)
    assert torch.equal(rv, v_cache)


def test_kernels_follow_torch_thread_count_on_a_new_thread(kernels):
    """A fresh thread (like the server's engine loop) starts with OpenMP's default count; the
    kernels must use torch's (--threads) from their first call on."""
    import threading

    before = torch.get_num_threads()
    seen = []
    try:
        torch.set_num_threads(1)

        def work():
            kernels.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6, 0.0)  # the thread's first kernel call
            seen.append(kernels._cdll.tandem_threads())  # read, not set

        t = threading.Thread(target=work)
        t.start()
        t.join()
    finally:
        torch.set_num_threads(before)
    assert seen == [1]
