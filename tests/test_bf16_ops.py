"""The bfloat16 kernels (tandem/kernels/bf16_ops.c, decode_attention.c's bf16 form) against the torch
reference run in bf16 and against float32/float64 math on the same bf16 inputs, then whole bf16
models with the kernels against the same models on the torch path.

Where the kernel rounds where the reference rounds (RMS norm, act·mul) it must give torch's bits
but for rare one-unit differences; where it rounds once instead of several times (rotary,
attention) it must be at least as close to the exact value as torch in bf16 is.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tandem import LLM
from tandem.build import load_model
from tandem.config import ModelConfig
from tandem.models.context import ForwardContext
from tandem.ops import reference
from tandem.ops.paged_attention import build_metadata, paged_attention
from test_decode_attention import BLOCK, _reference, _setup, tables_padded
from tiny_models import VOCAB, greedy_together_and_alone, save_tiny

BF16 = torch.bfloat16


def ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |t| (float32)."""
    return torch.exp2(torch.floor(torch.log2(t.float().abs().clamp_min(2.0**-126))) - 7)


def assert_within_ulps(got: torch.Tensor, want: torch.Tensor, ulps: float) -> None:
    """|got - want| <= ulps bf16 units of the larger of the two (want may be exact math)."""
    err = (got.double() - want.double()).abs()
    bound = ulps * ulp(torch.maximum(got.double().abs(), want.double().abs())).double() + 1e-30
    assert bool((err <= bound).all()), f"{int((err > bound).sum())} values more than {ulps} units off"


def assert_matches_torch(got: torch.Tensor, want: torch.Tensor, min_equal: float) -> None:
    """torch's bits for at least ``min_equal`` of the values, one unit off at most elsewhere."""
    assert got.dtype == want.dtype == BF16 and got.shape == want.shape
    assert float((got == want).float().mean()) >= min_equal
    assert_within_ulps(got, want, 1)


def assert_as_close_as_torch(got: torch.Tensor, torch_bf16: torch.Tensor, exact: torch.Tensor,
                             atol: float = 2e-2) -> None:
    """``got`` near torch's bf16 result, and on average no farther than it from ``exact``."""
    torch.testing.assert_close(got.float(), torch_bf16.float(), rtol=1.6e-2, atol=atol)
    err_got = (got.double() - exact.double()).abs().mean()
    err_torch = (torch_bf16.double() - exact.double()).abs().mean()
    assert err_got <= err_torch, (float(err_got), float(err_torch))


def test_rounding_is_to_nearest_even_and_keeps_nan(kernels):
    """With rows of +-1 (eps 0) the norm is exactly 1, so out = bf16(x * (1 + w)), rounded once:
    ties between bf16 values and NaN, against torch's float32 -> bf16 conversion."""
    w = torch.tensor([2.0**-8, 3 * 2.0**-8, -(2.0**-8), 2.0**-9, 1.0, 0.0, 3.0e38, float("inf"), float("nan"),
                      -2.0, 0.5, -0.25, 2.0**-8, 3 * 2.0**-8, 2.0**-7, 5 * 2.0**-8, -3 * 2.0**-8]).to(BF16)
    x = torch.ones(2, w.numel(), dtype=BF16)
    x[1, ::2] = -1.0
    got = kernels.rms_norm(x, w, 0.0, 1.0)
    want = (x.float() * (1.0 + w.float())).to(BF16)
    assert bool(((got == want) | (got.isnan() & want.isnan())).all()), (got, want)
    assert got[0, 0] == 1.0 and got[0, 1] == 1.015625  # 1 + 2^-8: to even (down); 1 + 3 * 2^-8: up
    assert bool(got[:, 8].isnan().all())


def test_finite_products_too_large_for_bf16_round_to_infinity(kernels):
    """silu(a) = a for a large a; a * b = 1.9996 * 2^127 is a finite float32 beyond bf16's
    largest value (1.9922 * 2^127), so it rounds to infinity, as torch rounds it."""
    a, b = 1.4140625 * 2.0**64, 1.4140625 * 2.0**63
    gate_up = torch.tensor([[a, -a, 1.0, b, b, float("nan")]] * 3).to(BF16)  # 3 rows of [gate | up]
    got = kernels.act_mul(gate_up, "silu")
    assert got[0, 0] == float("inf") and got[0, 1] == 0 and bool(got[:, 2].isnan().all())
    assert torch.equal(got[:, :2], reference.act_mul(gate_up, "silu")[:, :2])


@pytest.mark.parametrize("rows, d", [(1, 640), (3, 70), (257, 256), (5, 7), (2, 1152)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_gives_torch_bf16_bits(rows, d, offset, kernels):
    torch.manual_seed(rows + d)
    x = (torch.randn(rows, d) * 30).to(BF16)
    w = (torch.randn(d) * 0.5 + 1 - offset).to(BF16)
    got = kernels.rms_norm(x, w, 1e-6, offset)
    assert_matches_torch(got, reference.rms_norm(x, w, 1e-6, offset), 0.99)
    # against float32 math on the same inputs: one rounding (offset 1), or two (offset 0: the
    # normed row is rounded before the weight multiplies it, as in the reference)
    exact = F.rms_norm(x.float(), (d,), offset + w.float(), 1e-6)
    assert_within_ulps(got, exact, 0.5 if offset else 1.5)


def _act64(gate: torch.Tensor, kind: str) -> torch.Tensor:
    """The activation in float64, GELU as x sigmoid(2u): torch's 0.5 x (1 + tanh(u)) loses
    digits as tanh(u) nears -1, in float64 too."""
    if kind == "silu":
        return F.silu(gate)
    return gate * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3))


@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows, i", [(1, 2048), (3, 13), (40, 1024), (1, 7)])
def test_act_mul_gives_torch_bf16_bits(kind, rows, i, kernels):
    torch.manual_seed(rows * i)
    gate_up = torch.randn(rows, 2 * i) * 4
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 60.0, -60.0, 1e-20, -200.0])
    gate_up = gate_up.to(BF16)
    got = kernels.act_mul(gate_up, kind)
    want = reference.act_mul(gate_up, kind)
    gate, up = gate_up.double().chunk(2, dim=-1)
    act = _act64(gate, kind)
    # exp's clamp at -87 (simd.h) leaves act(-200) at about -1e-36 where torch has -0
    keep = act.abs() > 1e-30
    assert bool((got[~keep].float().abs() < 1e-27).all())  # |act| <= 1e-30 times |up| < 100
    if kind == "silu":
        assert_matches_torch(got[keep], want[keep], 0.99)
    else:
        # where torch's float32 GELU loses digits the kernel's does not: its bits are float64
        # math rounded where torch rounds, and torch's result is only close
        torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-4)
        assert_matches_torch(got[keep], (act.to(BF16).double() * up).to(BF16)[keep], 0.99)
    # two roundings (act(gate), then the product) from the exact value
    assert_within_ulps(got, act * up, 1.5)


def _rotary(rows: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(rows, d // 2) * 6
    return torch.cat([angles.cos()] * 2, -1).to(BF16), torch.cat([angles.sin()] * 2, -1).to(BF16)


@pytest.mark.parametrize("with_norm, offset", [(False, 0.0), (True, 0.0), (True, 1.0)])
@pytest.mark.parametrize("t, d", [(1, 16), (5, 70), (300, 64), (3, 256)])
def test_qkv_to_cache_matches_torch_and_is_closer_to_float32(with_norm, offset, t, d, kernels):
    torch.manual_seed(t * d)
    h, kvh, slots = 8, 2, 700  # grouped heads: H / KVH = 4
    qkv = (torch.randn(t, (h + 2 * kvh) * d) * 3).to(BF16)
    qw, kw = ((torch.randn(d) * 0.5 + 1 - offset).to(BF16) if with_norm else None for _ in range(2))
    cos, sin = _rotary(t, d)
    where = torch.randperm(slots)[:t]
    k_cache, v_cache = torch.zeros(slots, kvh, d, dtype=BF16), torch.zeros(slots, kvh, d, dtype=BF16)
    q = kernels.qkv_to_cache(qkv, h, qw, kw, 1e-6, offset, cos, sin, where, k_cache, v_cache)
    rk, rv = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    rq = reference.qkv_to_cache(qkv, h, qw, kw, 1e-6, offset, cos, sin, where, rk, rv)

    # the same steps in float32 on the same bf16 inputs, rounded nowhere
    eq, ek, _ = qkv.float().split((h * d, kvh * d, kvh * d), dim=-1)
    eq, ek = eq.view(t, h, d), ek.view(t, kvh, d)
    if with_norm:
        eq, ek = F.rms_norm(eq, (d,), offset + qw.float(), 1e-6), F.rms_norm(ek, (d,), offset + kw.float(), 1e-6)
    # torch rounds x cos, rotate_half(x) sin and their sum: a few units of the rotated values
    atol = 3 * float(ulp(torch.cat([eq.flatten(), ek.flatten()]).abs().max()))
    eq, ek = (reference.apply_rotary(x, cos.float(), sin.float()) for x in (eq, ek))
    assert q.dtype == BF16 and q.shape == (t, h, d)
    assert_as_close_as_torch(q, rq, eq, atol)
    assert_as_close_as_torch(k_cache[where], rk[where], ek, atol)
    if not with_norm:  # nothing rounded before the rotation: rounded once from float32
        assert_within_ulps(q, eq, 0.5 + 1e-3)
    assert torch.equal(v_cache, rv)  # v copied bit for bit, other slots untouched
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[where] = False
    assert torch.all(k_cache[untouched] == 0)


def _bf16_setup(contexts, heads, kv_heads, dim, seed):
    q, k_cache, v_cache, tables = _setup(contexts, heads, kv_heads, dim, seed)
    return q.to(BF16), k_cache.to(BF16), v_cache.to(BF16), tables


@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 1, 256), (8, 2, 36), (2, 2, 8), (8, 2, 70)])
@pytest.mark.parametrize("window", [0, 5])
def test_decode_attention_is_float32_inside_and_rounded_once(heads, kv_heads, dim, window, kernels):
    contexts = [1, 7, 13, 33, 2]
    q, k_cache, v_cache, tables = _bf16_setup(contexts, heads, kv_heads, dim, seed=heads * dim + window)
    scale = 1 / math.sqrt(dim)
    out = torch.full_like(q, float("nan"))
    kernels.decode_attention(q, k_cache, v_cache, torch.tensor(tables_padded(tables)), torch.tensor(contexts),
                             torch.arange(len(contexts)), out, BLOCK, window, scale)
    exact = _reference(q, k_cache, v_cache, tables, contexts, scale, window)  # float64, same bf16 inputs
    assert_within_ulps(out, exact, 0.5 + 1e-3)
    # context 1: the one value row, exactly
    assert torch.equal(out[0], v_cache[tables[0][0] * BLOCK].repeat_interleave(heads // kv_heads, dim=0))


@pytest.mark.parametrize("window", [0, 200])
def test_decode_attention_over_several_parts_in_bf16(window, kernels):
    """Contexts of one, two and three parts of 128 keys, merged: within half a unit of the exact
    result, plus float32's absolute error over a few hundred keys (a sum that nearly cancels has
    a tiny unit, so a bound in units alone does not hold there, for the unsplit kernel either)."""
    contexts = [128, 129, 300, 5]
    q, k_cache, v_cache, tables = _bf16_setup(contexts, 4, 1, 256, seed=17 + window)
    out = torch.full_like(q, float("nan"))
    kernels.decode_attention(q, k_cache, v_cache, torch.tensor(tables_padded(tables)), torch.tensor(contexts),
                             torch.arange(len(contexts)), out, BLOCK, window, 1 / 16)
    exact = _reference(q, k_cache, v_cache, tables, contexts, 1 / 16, window)
    err = (out.double() - exact).abs()
    assert bool((err <= 0.5 * ulp(exact).double() + 1e-5).all())


@pytest.mark.parametrize("sliding", [False, True])
def test_decode_attention_against_sdpa_in_bf16(sliding, kernels):
    """Through ``paged_attention``: the kernel against the gather + SDPA path, both in bf16, in a
    step mixing prompt chunks and decodes."""
    heads, kv_heads, dim, window = 8, 2, 64, 6
    seqs_ctx = [(0, 5), (9, 1), (3, 4), (20, 1), (2, 1), (40, 1)]
    contexts = [s + n for s, n in seqs_ctx]
    _, k_cache, v_cache, tables = _bf16_setup(contexts, heads, kv_heads, dim, seed=11)
    q = (torch.randn(sum(n for _, n in seqs_ctx), heads, dim, generator=torch.Generator().manual_seed(5)) * 2).to(BF16)
    meta = build_metadata([(s, n, tables[i]) for i, (s, n) in enumerate(seqs_ctx)], BLOCK, window,
                          torch.device("cpu"))
    got = paged_attention(q, k_cache, v_cache, meta, 0.2, sliding, kernels.decode_attention)
    sdpa = paged_attention(q, k_cache, v_cache, meta, 0.2, sliding, None)
    exact = paged_attention(q.double(), k_cache.double(), v_cache.double(), meta, 0.2, sliding, None)
    decode_rows = torch.tensor([sum(n for _, n in seqs_ctx[:i]) for i, (_, n) in enumerate(seqs_ctx) if n == 1])
    assert_as_close_as_torch(got[decode_rows], sdpa[decode_rows], exact[decode_rows])
    prompt_rows = ~torch.isin(torch.arange(len(q)), decode_rows)
    assert torch.equal(got[prompt_rows], sdpa[prompt_rows])  # prompt rows: SDPA in both


def test_decode_attention_rows_do_not_depend_on_the_batch(kernels):
    contexts = [3, 17, 9, 40, 260]
    q, k_cache, v_cache, tables = _bf16_setup(contexts, 8, 2, 64, seed=3)
    padded = torch.tensor(tables_padded(tables))
    together = torch.empty_like(q)
    kernels.decode_attention(q, k_cache, v_cache, padded, torch.tensor(contexts), torch.arange(5), together, BLOCK,
                             0, 0.125)
    for s in range(5):
        alone = torch.empty_like(q[s : s + 1])
        kernels.decode_attention(q[s : s + 1].contiguous(), k_cache, v_cache, padded[s : s + 1].contiguous(),
                                 torch.tensor(contexts[s : s + 1]), torch.arange(1), alone, BLOCK, 0, 0.125)
        assert torch.equal(alone[0], together[s])


def test_mixed_or_unsupported_dtypes_are_refused(kernels):
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="float16"):
        kernels.rms_norm(x.half(), torch.ones(8).half(), 1e-6, 0.0)
    with pytest.raises(ValueError, match="float32"):
        kernels.rms_norm(x.to(BF16), torch.ones(8), 1e-6, 0.0)  # a float32 weight with bf16 rows


def _decode_logits(loaded, seqs: list[torch.Tensor], prompt: int) -> list[torch.Tensor]:
    """Logits at every position: the first ``prompt`` tokens of each sequence as one prefill
    batch, then one decode step per position, all sequences together (bf16 cache)."""
    spec = loaded.spec
    n_blocks = [-(-len(s) // BLOCK) for s in seqs]
    tables = [list(range(sum(n_blocks[:i]), sum(n_blocks[: i + 1])))[::-1] for i in range(len(seqs))]
    cache = torch.zeros(spec.num_layers, 2, sum(n_blocks) * BLOCK, spec.num_kv_heads, spec.head_dim,
                        dtype=loaded.dtype)
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    steps = [[(0, prompt)]] + [[(p, 1)] for p in range(prompt, len(seqs[0]))]
    for step in steps:
        (start, n), = step
        meta = build_metadata([(start, n, t) for t in tables], BLOCK, spec.sliding_window, torch.device("cpu"))
        ids = torch.cat([s[start : start + n] for s in seqs])
        pos = torch.arange(start, start + n).repeat(len(seqs))
        with torch.no_grad():
            logits = loaded.model.compute_logits(loaded.model(ids, ForwardContext(meta, cache, pos))).float()
        for i in range(len(seqs)):
            out[i].append(logits[i * n : (i + 1) * n])
    return [torch.cat(o) for o in out]


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3"])  # q/k norms: none, offset 1, offset 0
def test_bf16_model_on_the_kernels_matches_the_torch_path(tmp_path, family):
    save_tiny(family, tmp_path)
    models = {k: load_model(ModelConfig(model=str(tmp_path), dtype=d, device="cpu", kernels=k))
              for k, d in (("auto", "bfloat16"), ("torch", "bfloat16"))}
    exact = load_model(ModelConfig(model=str(tmp_path), dtype="float32", device="cpu", kernels="torch"))
    ops = models["auto"].model.ops.describe()
    assert all(ops[op].startswith("native") for op in ("rms_norm", "act_mul", "qkv_rope_cache", "decode_attention"))
    torch.manual_seed(4)
    seqs = [torch.randint(3, VOCAB, (30,)) for _ in range(3)]
    got, plain, want = (_decode_logits(m, seqs, prompt=6) for m in (models["auto"], models["torch"], exact))
    for g, p, w in zip(got, plain, want):
        torch.testing.assert_close(g, p, atol=0.05, rtol=1.6e-2)  # the logits are within +-1 here
        assert (g - w).abs().mean() <= 1.25 * (p - w).abs().mean()  # bf16 error no larger than torch's


@pytest.mark.parametrize("mode", ["auto", "torch"])
def test_bf16_engine_greedy_is_batch_independent(tmp_path, mode):
    """With the bf16 kernels, and on the torch path for comparison (its linear layers are torch's
    on both: were it batch-dependent, the kernels could not make the engine batch-independent)."""
    from tandem.kernels.cpu_features import cpu_info

    if mode == "torch" and not cpu_info().bf16_arithmetic:
        # seen on an AMD Zen 3 (AVX2 only): torch's own bf16 path gave other greedy tokens in a
        # batch than alone; `--dtype auto` is float32 on such a CPU
        pytest.skip("this CPU has no bf16 arithmetic (avx512_bf16 or AMX): torch's bf16 matmuls are not batch-invariant here")
    save_tiny("gemma3", tmp_path)
    llm = LLM(str(tmp_path), dtype="bfloat16", device="cpu", kernels=mode, max_num_batched_tokens=16)
    together, alone = greedy_together_and_alone(llm)
    assert together == alone
