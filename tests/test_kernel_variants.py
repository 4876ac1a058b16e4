"""Which kernel variant a CPU gets, and the packed w8a8 weights of the AMX and AVX-512 variants."""

import pytest
import torch

from tandem.kernels import cpu_features, native
from tandem.kernels.cpu_features import cpu_info
from tandem.models.quant import Int8Linear, quantize_rows

ZEN3 = {"avx2"}
ZEN5 = {"avx2", "avx512", "avx512_vnni", "avx512_bf16"}
XEON_AMX = ZEN5 | {"amx_tile", "amx_bf16", "amx_int8"}


@pytest.mark.parametrize("features, want", [
    (XEON_AMX, ["amx", "avx512", "avx2"]),
    (ZEN5, ["avx512", "avx2"]),
    (ZEN3, ["avx2"]),
    (set(), []),
    (ZEN5 | {"amx_tile", "amx_bf16"}, ["avx512", "avx2"]),  # AMX without int8 tiles: no AMX variant
])
def test_variants_follow_the_features_best_first(features, want):
    assert [v.name for v in native.supported_variants(frozenset(features))] == want


def _fake_machine(monkeypatch, granted: bool) -> None:
    flags = frozenset("avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_vnni amx_tile amx_bf16 amx_int8".split())
    monkeypatch.setattr(cpu_features, "_proc_cpuinfo", lambda: ("fake Xeon", flags, "GenuineIntel"))
    monkeypatch.setattr(cpu_features, "_torch_says", lambda check: True)
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: granted)
    cpu_info.cache_clear()


@pytest.mark.parametrize("granted", [True, False])
def test_amx_counts_only_when_the_os_grants_the_tiles(monkeypatch, granted):
    _fake_machine(monkeypatch, granted)
    try:
        info = cpu_info()
        assert info.amx_permitted is granted
        assert info.has("amx_tile", "amx_int8", "amx_bf16") is granted
        assert info.has("avx512", "avx512_vnni")
        best = native.supported_variants()[0].name
        assert best == ("amx" if granted else "avx512")
    finally:
        cpu_info.cache_clear()


def test_a_variant_that_fails_to_load_falls_back_to_the_next(monkeypatch):
    loaded = []

    def load(name):
        loaded.append(name)
        if name == "amx":
            raise RuntimeError("compiling int8_gemm.c failed:\ncc: error: unrecognized option '-mamx-int8'")
        return native.Kernels(native.variant(name), None)

    monkeypatch.delenv("TANDEM_NO_KERNELS", raising=False)
    monkeypatch.delenv("TANDEM_KERNEL_ISA", raising=False)
    monkeypatch.setattr(native, "supported_variants", lambda: [native.variant(n) for n in ("amx", "avx512", "avx2")])
    monkeypatch.setattr(native, "load", load)
    native.best.cache_clear()
    try:
        assert native.best().name == "native-avx512" and loaded == ["amx", "avx512"]
    finally:
        native.best.cache_clear()


def _kernels(name):
    missing = [f for f in native.variant(name).requires if f not in cpu_info().features]
    if missing:
        pytest.skip(f"this CPU (or its OS) lacks {', '.join(missing)} for the {name} kernels")
    if native._compiler() is None:
        pytest.skip("no C compiler: the kernels are not built here")
    return native.load(name)


@pytest.fixture(params=["amx", "avx512"])
def packed_kernels(request):
    """The variants whose w8a8 kernel takes its weights packed: AMX tiles and AVX-512 VNNI."""
    return _kernels(request.param)


def test_w8a8_weights_are_packed_in_groups_of_16_rows(packed_kernels):
    q, _ = quantize_rows(torch.randn(48, 96))
    packed = packed_kernels.w8a8_weight(q)
    assert packed.shape == (3, 3, 8, 64)
    for n, k in ((0, 0), (17, 37), (47, 95), (31, 64)):
        t, b, k4, r = n // 16, k // 32, (k % 32) // 4, k % 4
        # each byte xor the kernel's offset (0x80 where VNNI multiplies unsigned weight bytes)
        assert int(packed.view(torch.uint8)[t, b, k4, 4 * (n % 16) + r]) ^ packed_kernels.weight_xor == int(q.view(torch.uint8)[n, k])
    odd = quantize_rows(torch.randn(40, 96))[0]  # 40 rows: not whole groups of 16, left as they are
    assert packed_kernels.w8a8_weight(odd) is odd
    with pytest.raises(ValueError, match="pass Kernels.w8a8_weight"):
        packed_kernels.gemm_w8a8(torch.randn(2, 96), q, torch.ones(48))


def test_a_packed_linear_gives_its_rows_back(packed_kernels):
    """The tied embedding reads its rows from the packed head; the bf16 road unpacks it once."""
    q, s = quantize_rows(torch.randn(64, 64))
    lin = Int8Linear(q, s, None, w8a8=True, kernels=packed_kernels)
    assert lin.packed and lin.qweight.dim() == 4
    assert torch.equal(lin.weight_rows(), q)
    ids = torch.tensor([0, 63, 17, 17, 40])
    assert torch.equal(lin.weight_rows(ids), q[ids])
    assert torch.equal(lin.rows(ids), q[ids].float() * s[ids, None])
    plain = Int8Linear(q, s, None, w8a8=True, kernels=_kernels("avx2"))
    assert not plain.packed and plain.weight_rows() is plain.qweight
    x = torch.randn(5, 64)
    # the same arithmetic up to float rounding: the two kernels sum a block's products in another order
    torch.testing.assert_close(lin(x), plain(x), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m", [1, 2, 16, 17, 40])
@pytest.mark.parametrize("n, k", [(48, 96), (4096, 64), (272, 640)])
def test_the_fused_argmax_finds_what_the_argmax_of_the_product_finds(packed_kernels, m, n, k):
    torch.manual_seed(m * 7 + n)
    q, s = quantize_rows(torch.randn(n, k))
    q[n // 2] = q[n // 3]  # two equal weight rows: equal outputs, the first index must win
    s[n // 2] = s[n // 3]
    packed = packed_kernels.w8a8_weight(q)
    x = torch.randn(m, k)
    x[0] = 0.0  # every output 0: index 0
    want = packed_kernels.argmax_rows(packed_kernels.gemm_w8a8(x, packed, s))
    assert torch.equal(packed_kernels.gemm_w8a8_argmax(x, packed, s), want)
    assert want[0] == 0
    with pytest.raises(ValueError, match="packed"):
        packed_kernels.gemm_w8a8_argmax(x, q, s)


def test_greedy_steps_take_their_tokens_from_the_heads_kernel_and_the_same_ones(packed_kernels, tmp_path):
    """A greedy step's tokens come from the head's fused argmax; with it off, or with a row that
    wants logprobs (the step makes its logits), every token is the same."""
    from dataclasses import replace

    from tandem import LLM, SamplingParams
    from tiny_models import VOCAB, save_tiny

    save_tiny("gemma3", tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", quantization="w8a8", max_num_batched_tokens=32)
    model = llm.loaded.model
    kernel = llm.loaded.paths()["ops"]["int8_matmul"]
    if kernel != packed_kernels.name:
        pytest.skip(f"the model was built on the {kernel} kernels, not {packed_kernels.name} (the best here)")
    assert model.fused_argmax and llm.loaded.paths()["ops"]["head_argmax"] == "fused-" + kernel.split("-")[1]
    fused_calls = []
    head_argmax = model.lm_head.argmax
    model.lm_head.argmax = lambda x: fused_calls.append(len(x)) or head_argmax(x)
    prompts = [[1] + [(5 * i + 3 * j) % (VOCAB - 3) + 3 for j in range(6 + 5 * i)] for i in range(4)]
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    fused = [o.token_ids for o in llm.generate(prompts, greedy)]
    assert fused_calls and max(fused_calls) > 1  # batched steps took the fused argmax
    with_logprobs = [o.token_ids for o in llm.generate(prompts, [greedy] * 3 + [replace(greedy, logprobs=2)])]
    model.ops = replace(model.ops, fused_head_argmax=False)
    calls_before = len(fused_calls)
    plain = [o.token_ids for o in llm.generate(prompts, greedy)]
    assert len(fused_calls) == calls_before and not model.fused_argmax
    assert fused == plain == with_logprobs
