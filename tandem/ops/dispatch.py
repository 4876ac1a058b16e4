"""Which implementation each hot op uses, decided once when a model is built.

``select_ops(device, dtype)`` looks at the device, the activation dtype and whether the C kernels
(``tandem.kernels``) built and run on this CPU, and returns an ``OpTable``: the chosen function
for every op plus, for each op, the implementation's name and why it was chosen. The model, the
attention and the sampler call what the table holds; nothing else tests for kernels. The plain
torch form (``tandem.ops.reference``) is always there: with ``kernels="torch"``, on CUDA, or for a
dtype a kernel does not take (the fused kernels take float32 and bfloat16; float16 keeps torch).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from tandem.kernels import native
from tandem.kernels.cpu_features import cpu_info
from tandem.ops import matmul_attention, reference
from tandem.ops.modes import KERNEL_MODES

log = logging.getLogger("tandem.ops")

# The activations the fused act·mul kernel computes, by the name the kernel gives them.
NATIVE_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
# The activation dtypes the fused kernels take (rms_norm, act_mul, qkv_rope_cache,
# decode_attention), with what their Choice reason adds.
_FUSED_DTYPES = {torch.float32: "", torch.bfloat16: " in its bf16 form (bfloat16 in and out, float32 inside)"}


# Prompts from this many tokens on take w8a8's bf16 road (``OpTable.w8a8_prompt_bf16_tokens``):
# below it, reading the bf16 copy of the weights (twice int8's bytes) would cost more than the
# faster arithmetic saves. Decided per request (its prompt length), so a row's road never
# depends on its step mates or on how its prompt was cut into chunks.
W8A8_PROMPT_BF16_TOKENS = 32

# The bf16 road multiplies in calls of exactly this many rows, the weights packed once for it
# (``tandem.models.bf16_rows``): oneDNN's row results depend on the call's row count on AMX.
BF16_TILE_ROWS = 128


@dataclass(frozen=True)
class Choice:
    impl: str
    reason: str


def _fused(k: native.Kernels) -> dict[str, Callable]:
    """The kernels' entry points as the op table calls them (inputs made contiguous: a no-op for
    the layers' own outputs, a copy for a view)."""
    return {
        "rms_norm": lambda x, weight, eps, offset: k.rms_norm(x.contiguous(), weight, eps, offset),
        "qkv_to_cache": lambda qkv, *rest: k.qkv_to_cache(qkv.contiguous(), *rest),
        "argmax_rows": lambda x: k.argmax_rows(x.contiguous()),
    }


@dataclass(frozen=True)
class OpTable:
    """The ops one model runs with. ``choices`` names each op's implementation and the reason."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float, float], torch.Tensor]
    qkv_to_cache: Callable[..., torch.Tensor]
    decode_attention: Callable[..., None] | None
    """One query per sequence straight from the paged cache; None: attention's gather + SDPA path."""
    argmax_rows: Callable[[torch.Tensor], torch.Tensor]
    int8_kernels: native.Kernels | None
    """The C kernels int8 matmuls use; None: dequantize + torch matmul."""
    int4_kernels: native.Kernels | None
    """The same for int4 matmuls."""
    act_mul_kernels: native.Kernels | None
    decode_layers: native.Kernels | None = None
    """The C kernels a w8a8 model's decode steps run all their layers on in one call
    (``tandem.models.decode_layers``); None: op by op."""
    w8a8_prompt_bf16_tokens: int | None = None
    """w8a8 layers: the prompt positions of prompts of at least this many tokens multiply through
    oneDNN's bf16 matmul (the int8 weights held exactly as bf16 integers); None: every row
    through the integer kernel (``tandem.models.quant``)."""
    w8a8_prompt_attention_bf16: bool = False
    """w8a8 models: the prompts on the bf16 road above also attend in bf16 (torch's flash SDPA,
    softmax in float32 inside), their float32 queries, keys and values rounded for the call."""
    fused_head_argmax: bool = False
    """Steps whose every row is plain greedy take each row's token inside the output head's
    kernel (a packed w8a8 head: AMX tiles or AVX-512 VNNI), no logits made; False: the argmax of the logits."""
    prompt_attention_matmul: bool = False
    """Prompts attending in float32 on the CPU run as oneDNN matmuls (``tandem.ops.matmul_attention``);
    False: torch's SDPA."""
    choices: dict[str, Choice] = field(default_factory=dict)

    def act_mul(self, act: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """``act(gate) * up`` for one activation, fused when the kernel computes that activation."""
        if act not in reference.ACTIVATIONS:
            raise ValueError(f"model: unsupported activation {act!r}")
        kernel_name = NATIVE_ACTIVATIONS.get(act)
        k = self.act_mul_kernels
        if k is not None and kernel_name is not None:
            return lambda gate_up: k.act_mul(gate_up.contiguous(), kernel_name)
        return lambda gate_up: reference.act_mul(gate_up, act)

    def describe(self) -> dict[str, str]:
        """Op -> implementation name, for logs, /config and result files."""
        return {op: c.impl for op, c in self.choices.items()}


def select_ops(
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    kernels: str = "auto",
    disable: Iterable[str] = (),
) -> OpTable:
    """The ops for a model on ``device`` with activations in ``dtype``. ``disable`` names ops
    (keys of ``OpTable.choices``) held to their torch form whatever else is chosen, for ablations."""
    device = torch.device(device)
    disable = frozenset(disable)
    if kernels not in KERNEL_MODES:
        raise ValueError(f"kernels: must be one of {', '.join(KERNEL_MODES)}, got {kernels!r}")
    lib: native.Kernels | None = None
    if kernels == "torch":
        why_not = "kernels='torch' asks for the plain torch path"
    elif device.type != "cpu":
        why_not = f"the C kernels run on the CPU, not on {device.type}"
    elif (lib := native.best()) is None:
        why_not = f"the C kernels are off: {native.unavailable_reason()}"
    else:
        why_not = ""
    cpu_lib = lib is not None
    dtype_name = str(dtype).removeprefix("torch.")
    takes_dtype = cpu_lib and dtype in _FUSED_DTYPES
    why_not_fused = why_not or f"the fused kernels take float32 or bfloat16 activations, not {dtype_name}"
    kernel = lib.name if lib is not None else "native"

    use: dict[str, bool] = {}
    choices: dict[str, Choice] = {}

    def pick(op: str, ok: bool, reason_no: str, torch_name: str = "torch", form: str = "",
             chosen: Choice | None = None) -> None:
        """``chosen``: what a chosen op is called (default: the C kernel)."""
        if op in disable:
            ok, reason_no = False, "disabled by the caller"
        use[op] = ok
        if ok:
            choices[op] = chosen or Choice(kernel, "the C kernel runs here" + form)
        else:
            choices[op] = Choice(torch_name, reason_no)

    for op in ("rms_norm", "act_mul", "qkv_rope_cache", "decode_attention"):
        pick(op, takes_dtype, why_not_fused, "torch-sdpa" if op == "decode_attention" else "torch",
             _FUSED_DTYPES.get(dtype, ""))
    pick("argmax", cpu_lib, why_not)  # logits are float32 whatever the model's dtype
    pick("int8_matmul", cpu_lib, why_not)
    pick("int4_matmul", cpu_lib, why_not)
    # w8a8's prompt rows: on AMX, oneDNN's bf16 tiles multiply them faster than the int8 tiles'
    # kernel; with AVX-512 VNNI and no AMX the packed integer kernel wins (two products per
    # instruction for bf16's one, a conversion per 512: Zen 4, 1.3-1.4x the prefill of the bf16
    # road, docs/performance.md); without either neither road has bf16 arithmetic to stand on
    info = cpu_info()
    why_prompt = _first_reason(
        (device.type != "cpu" or dtype != torch.float32, "w8a8 runs float32 activations on the CPU only"),
        (not info.bf16_arithmetic, "this CPU has no bf16 arithmetic (avx512_bf16 or AMX)"),
        (not info.amx_bf16 and kernel == "native-avx512" and use["int8_matmul"],
         "no AMX bf16 tiles here: the packed VNNI kernel multiplies prompt rows faster than oneDNN's bf16"))
    pick("w8a8_prompt_matmul", not why_prompt, why_prompt, "w8a8-kernel", chosen=Choice(
        "onednn-bf16", f"w8a8 layers: the prompt positions of prompts of {W8A8_PROMPT_BF16_TOKENS}+ tokens "
                       "through bf16 matmuls of the exact int8 weights (float32 activations rounded to bf16), "
                       f"in calls of {BF16_TILE_ROWS} rows with the weights packed once"))
    # their attention: in bf16 where AMX tiles run it (a 1024-token causal prompt of the default
    # model's shape, one layer: 10.8 ms float32, 3.4 ms bf16 on a Xeon with AMX); without AMX
    # torch's bf16 SDPA loses (Zen 5, avx512_bf16: prefill 8-11% slower than with float32 SDPA,
    # benchmarks/prefill_variants.py, docs/results/amd-epyc-zen5/2026-12-03/prefill-variants.json),
    # so float32 stays
    why_attention = _first_reason(
        (not use["w8a8_prompt_matmul"], "only the prompts of w8a8's bf16 road attend in bf16, and that road is off"),
        (not info.amx_bf16,
         "no AMX bf16 tiles here: the prompts' attention stays float32 (bf16 SDPA measured slower without AMX)"))
    pick("w8a8_prompt_attention", not why_attention, why_attention, "torch-sdpa", chosen=Choice(
        "torch-sdpa-bf16", "w8a8 models: the attention of the prompts on the bf16 road in bf16 (AMX tiles; "
                           "softmax in float32), float32 in and out"))
    # prompts attending in float32 on the CPU: as oneDNN matmuls where torch's flash SDPA pays for
    # MKL's slow float32 GEMM (AMD with AVX-512; Zen 5: prefill 1.05-1.21x, prefill_variants.py),
    # else flash SDPA (on Intel MKL is fast; on an AVX2-only Zen 3 the matmul form made prefill
    # 1-17% slower: docs/results/amd-epyc-zen3/2026-12-03/prefill-variants.json)
    why_matmul = _first_reason(
        (kernels == "torch", "kernels='torch' asks for the plain torch path"),
        (device.type != "cpu" or dtype != torch.float32, "the oneDNN matmul form is for float32 prompts on the CPU"),
        (not matmul_attention.available(), "this torch build has no oneDNN"),
        (info.vendor != "AuthenticAMD" or not info.has("avx512"),
         "the oneDNN matmul form measured faster on AMD CPUs with AVX-512 only (slower on an AVX2-only Zen 3)"))
    pick("prefill_attention", not why_matmul, f"gather through the block tables + SDPA ({why_matmul})",
         "torch-sdpa", chosen=Choice(
             "onednn-matmul", f"float32 prompts: Q·Kᵀ and P·V as oneDNN matmuls in {matmul_attention.TILE}-query "
                              "tiles, each sequence on its own; gathered through the block tables"))
    # a w8a8 model's decode steps: every layer in one C call, from the ops chosen above
    parts = ("rms_norm", "act_mul", "qkv_rope_cache", "decode_attention", "int8_matmul")
    if not cpu_lib or dtype != torch.float32:
        why_layers = why_not or "the fused decode layers take float32 activations"
    else:
        why_layers = next((f"{op} runs in torch" for op in parts if not use[op]), "")
    pick("decode_layers", not why_layers, why_layers, "per-op", chosen=Choice(
        kernel, "w8a8 models: a decode step's layers in one C call (one OpenMP region); other weight "
                "formats and steps with prompt tokens op by op"))
    # greedy steps of a w8a8 model: the token inside the output head's packed kernel (the
    # logits, 1 MiB a row for Gemma 3, never written and read back)
    packed_isa = {"native-amx": "amx", "native-avx512": "avx512"}.get(kernel)
    why_fused_argmax = _first_reason(
        (not use["int8_matmul"], why_not or "the int8 kernels are off"),
        (packed_isa is None, f"the fused argmax is the packed head kernel's (AMX or AVX-512 VNNI); "
                             f"this CPU runs the {kernel} kernels"))
    pick("head_argmax", not why_fused_argmax, why_fused_argmax, "argmax-kernel", chosen=Choice(
        f"fused-{packed_isa}", "w8a8 models: steps whose rows are all plain greedy (no logprobs, penalties or "
                               "constraints) find each token inside the output head's packed kernel, without "
                               "writing the logits"))
    unknown = disable - set(choices)
    if unknown:
        raise ValueError(f"disable: unknown ops {', '.join(sorted(unknown))}; known: {', '.join(choices)}")
    choices["linear"] = Choice("torch", "torch's matmul (oneDNN/BLAS on the CPU, cuBLAS on CUDA)")
    fused = _fused(lib) if lib is not None else {}
    table = OpTable(
        rms_norm=fused["rms_norm"] if use["rms_norm"] else reference.rms_norm,
        qkv_to_cache=fused["qkv_to_cache"] if use["qkv_rope_cache"] else reference.qkv_to_cache,
        decode_attention=lib.decode_attention if use["decode_attention"] else None,
        argmax_rows=fused["argmax_rows"] if use["argmax"] else reference.argmax_rows,
        int8_kernels=lib if use["int8_matmul"] else None,
        int4_kernels=lib if use["int4_matmul"] else None,
        act_mul_kernels=lib if use["act_mul"] else None,
        decode_layers=lib if use["decode_layers"] else None,
        w8a8_prompt_bf16_tokens=W8A8_PROMPT_BF16_TOKENS if use["w8a8_prompt_matmul"] else None,
        w8a8_prompt_attention_bf16=use["w8a8_prompt_attention"],
        prompt_attention_matmul=use["prefill_attention"],
        fused_head_argmax=use["head_argmax"],
        choices=choices,
    )
    log.info("ops for %s/%s: %s", device.type, dtype_name,
             ", ".join(f"{op}={c.impl}" for op, c in choices.items()))
    return table


def _first_reason(*checks: tuple[bool, str]) -> str:
    """The reason of the first check that holds: why an op keeps its torch form ("" when none does)."""
    return next((reason for holds, reason in checks if holds), "")


REFERENCE = select_ops("cpu", torch.float32, kernels="torch")
"""The plain torch form of every op: what models use when built without a table (tests)."""
