"""The op-dispatch layer: which implementation each op gets, decided once per model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tandem.ops import dispatch, reference
from tandem.ops.dispatch import select_ops

KERNEL_OPS = ("rms_norm", "act_mul", "qkv_rope_cache", "decode_attention", "argmax", "int8_matmul",
              "int4_matmul")


FAKE = SimpleNamespace(name="native-fake", rms_norm=None, qkv_to_cache=None, decode_attention=lambda *a: None,
                       argmax_rows=None, act_mul=None)


def _fake_library(monkeypatch, present: bool) -> None:
    """Selection as on a machine whose kernels did (or did not) build."""
    monkeypatch.setattr(dispatch.native, "best", lambda: FAKE if present else None)
    monkeypatch.setattr(dispatch.native, "unavailable_reason", lambda: "" if present else "no C compiler found")


def test_float32_cpu_with_the_library_uses_every_kernel(monkeypatch):
    _fake_library(monkeypatch, True)
    ops = select_ops("cpu", torch.float32)
    assert all(ops.choices[op].impl == "native-fake" for op in KERNEL_OPS)
    assert ops.int8_kernels is FAKE and ops.int4_kernels is FAKE and ops.decode_attention is not None
    assert ops.rms_norm is not reference.rms_norm


@pytest.mark.parametrize("name, fused", [("native-amx", "fused-amx"), ("native-avx512", "fused-avx512"),
                                         ("native-avx2", None)])
def test_the_greedy_argmax_moves_into_the_head_only_with_the_packed_kernels(monkeypatch, name, fused):
    monkeypatch.setattr(dispatch.native, "best", lambda: SimpleNamespace(**{**vars(FAKE), "name": name}))
    monkeypatch.setattr(dispatch.native, "unavailable_reason", lambda: "")
    ops = select_ops("cpu", torch.float32)
    assert ops.fused_head_argmax is (fused is not None)
    assert ops.choices["head_argmax"].impl == (fused or "argmax-kernel")
    assert not select_ops("cpu", torch.float32, disable=("head_argmax",)).fused_head_argmax


@pytest.mark.parametrize("name, amx, bf16_road", [
    ("native-amx", True, True),        # AMX: oneDNN's bf16 tiles beat the int8 tiles' kernel on prompt rows
    ("native-avx512", False, False),   # AVX-512 VNNI without AMX: the packed integer kernel is faster
    ("native-avx2", False, True),      # avx512_bf16 but only the AVX2 integer kernel (capped): bf16 road
])
def test_w8a8_prompt_rows_take_the_faster_road_for_the_kernels_at_hand(monkeypatch, name, amx, bf16_road):
    monkeypatch.setattr(dispatch.native, "best", lambda: SimpleNamespace(**{**vars(FAKE), "name": name}))
    monkeypatch.setattr(dispatch.native, "unavailable_reason", lambda: "")
    monkeypatch.setattr(dispatch, "cpu_info", lambda: SimpleNamespace(bf16_arithmetic=True, amx_bf16=amx,
                                                                      vendor="AuthenticAMD", has=lambda *f: True))
    ops = select_ops("cpu", torch.float32)
    assert (ops.w8a8_prompt_bf16_tokens is not None) is bf16_road
    assert ops.choices["w8a8_prompt_matmul"].impl == ("onednn-bf16" if bf16_road else "w8a8-kernel")
    if not bf16_road:
        assert "packed VNNI kernel" in ops.choices["w8a8_prompt_matmul"].reason


def test_bfloat16_cpu_with_the_library_uses_every_kernel_in_its_bf16_form(monkeypatch):
    _fake_library(monkeypatch, True)
    ops = select_ops("cpu", torch.bfloat16)
    for op in ("rms_norm", "act_mul", "qkv_rope_cache", "decode_attention"):
        assert ops.choices[op].impl == "native-fake" and "bf16" in ops.choices[op].reason
    assert ops.decode_attention is not None and ops.act_mul_kernels is FAKE
    assert ops.rms_norm is not reference.rms_norm and ops.qkv_to_cache is not reference.qkv_to_cache
    # logits are float32 whatever the model's dtype, and int8 matmuls take float32 inputs
    assert ops.choices["argmax"].impl.startswith("native") and ops.int8_kernels is FAKE and ops.int4_kernels is FAKE


def test_float16_keeps_torch_for_the_fused_kernels_and_names_it(monkeypatch):
    _fake_library(monkeypatch, True)
    ops = select_ops("cpu", torch.float16)
    for op in ("rms_norm", "act_mul", "qkv_rope_cache"):
        assert ops.choices[op].impl == "torch" and "not float16" in ops.choices[op].reason
    assert ops.choices["decode_attention"].impl == "torch-sdpa" and ops.decode_attention is None
    assert ops.rms_norm is reference.rms_norm and ops.act_mul_kernels is None
    assert ops.choices["argmax"].impl.startswith("native") and ops.int8_kernels is FAKE


@pytest.mark.parametrize("device, kernels, present, reason", [
    ("cuda", "auto", True, "not on cuda"),
    ("cpu", "torch", True, "kernels='torch'"),
    ("cpu", "auto", False, "no C compiler found"),
])
def test_torch_everywhere_names_the_reason(monkeypatch, device, kernels, present, reason):
    _fake_library(monkeypatch, present)
    ops = select_ops(device, torch.float32, kernels=kernels)
    assert ops.int8_kernels is None and ops.int4_kernels is None and ops.decode_attention is None
    assert ops.rms_norm is reference.rms_norm and ops.argmax_rows is reference.argmax_rows
    for op in KERNEL_OPS:
        assert ops.choices[op].impl.startswith("torch") and reason in ops.choices[op].reason


def test_disable_holds_named_ops_to_torch(monkeypatch):
    _fake_library(monkeypatch, True)
    ops = select_ops("cpu", torch.float32, disable=["decode_attention", "argmax"])
    assert ops.decode_attention is None and ops.argmax_rows is reference.argmax_rows
    assert ops.choices["rms_norm"].impl.startswith("native")
    with pytest.raises(ValueError, match="disable: unknown ops nope"):
        select_ops("cpu", torch.float32, disable=["nope"])


def test_unknown_kernel_mode_and_activation_are_named():
    with pytest.raises(ValueError, match="kernels"):
        select_ops("cpu", torch.float32, kernels="fast")
    with pytest.raises(ValueError, match="activation"):
        select_ops("cpu", torch.float32, kernels="torch").act_mul("relu6")


def test_act_mul_matches_reference_for_every_activation():
    ops = select_ops("cpu", torch.float32)
    gate_up = torch.randn(5, 2 * 24)
    for act in reference.ACTIVATIONS:
        torch.testing.assert_close(ops.act_mul(act)(gate_up), reference.act_mul(gate_up, act), atol=1e-5, rtol=1e-5)


def test_model_built_with_a_table_runs_its_choices(tmp_path):
    """The choice is made at build time and reaches every layer."""
    from tandem.build import load_model
    from tandem.config import ModelConfig
    from tiny_models import save_tiny

    save_tiny("llama", tmp_path)
    loaded = load_model(ModelConfig(model=str(tmp_path), dtype="float32", device="cpu", kernels="torch"))
    norms = [m for m in loaded.model.modules() if m.__class__.__name__ == "RMSNorm"]
    assert norms and all(m._rms_norm is reference.rms_norm for m in norms)
    assert loaded.model.ops.describe()["rms_norm"] == "torch"


def _fake_cpu(monkeypatch, features: set[str], amx_permitted: bool = False) -> None:
    from tandem.kernels.cpu_features import CPUInfo

    info = CPUInfo("fake", frozenset(features), frozenset(features), amx_permitted, "AVX512")
    monkeypatch.setattr(dispatch, "cpu_info", lambda: info)


@pytest.mark.parametrize("features, amx, road, attention", [
    ({"avx2", "avx512", "avx512_bf16"}, False, "onednn-bf16", "torch-sdpa"),
    ({"avx2", "amx_tile", "amx_bf16"}, True, "onednn-bf16", "torch-sdpa-bf16"),
    ({"avx2", "avx512_bf16", "amx_tile", "amx_bf16"}, False, "onednn-bf16", "torch-sdpa"),  # the OS refused the tiles
    ({"avx2", "amx_tile", "amx_bf16"}, False, "w8a8-kernel", "torch-sdpa"),
    ({"avx2", "avx512", "avx512_vnni"}, False, "w8a8-kernel", "torch-sdpa"),
])
def test_w8a8_prompt_rows_take_bf16_only_where_the_cpu_has_bf16_arithmetic(monkeypatch, features, amx, road,
                                                                            attention):
    """Their matmuls wherever the CPU has bf16 dot products; their attention only on AMX tiles."""
    _fake_library(monkeypatch, True)
    _fake_cpu(monkeypatch, features, amx)
    ops = select_ops("cpu", torch.float32)
    assert ops.choices["w8a8_prompt_matmul"].impl == road
    assert ops.w8a8_prompt_bf16_tokens == (dispatch.W8A8_PROMPT_BF16_TOKENS if road == "onednn-bf16" else None)
    if road == "w8a8-kernel":
        assert "no bf16 arithmetic" in ops.choices["w8a8_prompt_matmul"].reason
    assert ops.choices["w8a8_prompt_attention"].impl == attention
    assert ops.w8a8_prompt_attention_bf16 == (attention == "torch-sdpa-bf16")
    if attention == "torch-sdpa":
        assert ("no AMX" if road == "onednn-bf16" else "road is off") in ops.choices["w8a8_prompt_attention"].reason


def test_w8a8_prompt_rows_can_be_disabled_and_stay_off_for_bf16_activations(monkeypatch):
    _fake_library(monkeypatch, True)
    _fake_cpu(monkeypatch, {"avx2", "avx512", "avx512_bf16"})
    off = select_ops("cpu", torch.float32, disable=("w8a8_prompt_matmul",))
    assert off.w8a8_prompt_bf16_tokens is None and off.choices["w8a8_prompt_matmul"].reason == "disabled by the caller"
    assert not off.w8a8_prompt_attention_bf16
    _fake_cpu(monkeypatch, {"avx2", "amx_tile", "amx_bf16"}, True)
    assert select_ops("cpu", torch.float32).w8a8_prompt_attention_bf16
    fp32_attention = select_ops("cpu", torch.float32, disable=("w8a8_prompt_attention",))
    assert not fp32_attention.w8a8_prompt_attention_bf16 and fp32_attention.w8a8_prompt_bf16_tokens is not None
    assert select_ops("cpu", torch.bfloat16).w8a8_prompt_bf16_tokens is None
    assert select_ops("cuda", torch.float32).w8a8_prompt_bf16_tokens is None
