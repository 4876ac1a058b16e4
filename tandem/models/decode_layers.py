"""A decode step's decoder layers in one C call (``tandem/kernels/decode_layers.c``).

``DecodeLayers.build(model)`` (called by ``tandem.build.load_model`` once the weights are in their
final format) returns the fused form of a w8a8 model's layers on the CPU, or None when the model
has a shape or weight format the C driver does not run (``why_not`` says why). The model's
forward pass hands it a step when every token row is a decode (``takes``); other steps (prompt
chunks, mixed steps) go op by op, and since each op of the driver is the function the op-by-op
path calls, a sequence's hidden states are the same bits either way.

The weight pointers are gathered once (lazily, so a deep copy of the model gathers its own); a
step only fills the ``DecodeStep`` with its tensors.
"""

from __future__ import annotations

import copy
import ctypes
import logging

import torch

from tandem.kernels import decode_layers as abi
from tandem.kernels.native import ACTIVATIONS, Kernels
from tandem.models.context import ForwardContext
from tandem.models.gemma3 import Gemma3DecoderLayer
from tandem.models.layers import RMSNorm, RotaryEmbedding
from tandem.models.llama import LlamaDecoderLayer
from tandem.models.quant import QBLOCK, Int8Linear
from tandem.ops.dispatch import NATIVE_ACTIVATIONS

log = logging.getLogger("tandem.models")


class DecodeLayers:
    """The fused decode layers of one model (see the module docstring)."""

    def __init__(self, model, kernels: Kernels, sandwich: bool) -> None:
        self.model = model
        self.kernels = kernels
        self.sandwich = sandwich
        self._struct: abi.DecodeModel | None = None
        self._layers = None  # keeps the DecodeLayer array alive
        self._rotaries: list[RotaryEmbedding] = []

    def __deepcopy__(self, memo) -> "DecodeLayers":
        # the copy's pointers must be its own weights': gathered again at its first step
        return DecodeLayers(copy.deepcopy(self.model, memo), self.kernels, self.sandwich)

    @staticmethod
    def why_not(model) -> str:
        """Why the driver cannot run ``model``'s layers ('' when it can)."""
        spec = model.spec
        if model.ops.decode_layers is None:
            return model.ops.choices["decode_layers"].reason
        if NATIVE_ACTIVATIONS.get(spec.hidden_act) is None:
            return f"no C form of the activation {spec.hidden_act}"
        if spec.num_heads % spec.num_kv_heads:
            return "heads not a multiple of the KV heads"
        for layer in model.model.layers:
            if type(layer) not in (Gemma3DecoderLayer, LlamaDecoderLayer):
                return f"{type(layer).__name__} layers run op by op"
            attn, mlp = layer.self_attn, layer.mlp
            for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                if not (isinstance(lin, Int8Linear) and lin.w8a8 and lin.kernels is not None):
                    return "the layers' linears are not w8a8 on the C kernels"
                if lin.bias is not None:
                    return "linear biases run op by op"
                if lin.in_features % QBLOCK:
                    return f"an input width ({lin.in_features}) not a multiple of {QBLOCK}"
            norms = [m for m in layer.modules() if isinstance(m, RMSNorm)]
            if any(n.weight.dtype != torch.float32 for n in norms):
                return "norm weights not float32"
            outer = [n for n in norms if n is not attn.q_norm and n is not attn.k_norm]
            if len({(n.eps, n.offset) for n in outer}) != 1:
                return "the layer norms differ in eps or offset"
        return ""

    @classmethod
    def build(cls, model) -> "DecodeLayers | None":
        why = cls.why_not(model)
        if why:
            log.debug("decode layers run op by op: %s", why)
            return None
        sandwich = isinstance(model.model.layers[0], Gemma3DecoderLayer)
        return cls(model, model.ops.decode_layers, sandwich)

    def _model_struct(self) -> abi.DecodeModel:
        if self._struct is not None:
            return self._struct
        model, spec = self.model, self.model.spec
        layers = list(model.model.layers)
        arr = (abi.DecodeLayer * len(layers))()
        rotaries: list[RotaryEmbedding] = []
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            rot = attn._rotary[0]
            if all(rot is not r for r in rotaries):
                rotaries.append(rot)
            lins = {}
            for name, lin in (("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate_up", mlp.gate_up_proj),
                              ("down", mlp.down_proj)):
                lins[name] = abi.QLinear(lin.qweight.data_ptr(), lin.scale.data_ptr(), lin.out_features,  # kernel layout
                                         lin.in_features)
            norm_in = layer.input_layernorm
            if self.sandwich:
                norms = (norm_in, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                         layer.post_feedforward_layernorm)
            else:
                norms = (norm_in, layer.post_attention_layernorm, None, None)
            qn, kn = attn.q_norm, attn.k_norm
            arr[i] = abi.DecodeLayer(
                lins["qkv"], lins["o"], lins["gate_up"], lins["down"],
                *(None if n is None else n.weight.data_ptr() for n in norms),
                None if qn is None else qn.weight.data_ptr(), None if kn is None else kn.weight.data_ptr(),
                int(attn.sliding), next(j for j, r in enumerate(rotaries) if r is rot),
            )
        if len(rotaries) > 2:
            raise ValueError("decode layers: at most two rope tables")
        first = layers[0]
        qn = first.self_attn.q_norm
        self._struct = abi.DecodeModel(
            len(layers), spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size,
            ACTIVATIONS[NATIVE_ACTIVATIONS[spec.hidden_act]], int(self.sandwich),
            first.input_layernorm.eps, first.input_layernorm.offset,
            0.0 if qn is None else qn.eps, 0.0 if qn is None else qn.offset, first.self_attn.scale,
            arr,
        )
        self._layers, self._rotaries = arr, rotaries
        return self._struct

    @staticmethod
    def takes(ctx: ForwardContext, x: torch.Tensor) -> bool:
        """Whether this step is one the driver runs: every token row a decode, float32 on the CPU."""
        groups = ctx.meta.groups
        return (len(groups) == 1 and ctx.bf16_rows is None and groups[0].valid.shape[1] == 1
                and groups[0].valid.shape[0] == x.shape[0] and x.dtype == torch.float32
                and ctx.kv_cache.dtype == torch.float32 and x.device.type == "cpu" and ctx.kv_cache.is_contiguous())

    def __call__(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The layers' output for the step's hidden states ``x`` [T, hidden] (a decode step)."""
        m = self._model_struct()
        x = x.clone(memory_format=torch.contiguous_format)  # written in place by the driver
        g = ctx.meta.groups[0]
        tables = [r.tables(ctx, torch.float32) for r in self._rotaries]
        if len(tables) == 1:
            tables.append(tables[0])
        step = abi.DecodeStep(
            x.shape[0], x.data_ptr(),
            (ctypes.c_void_p * 2)(tables[0][0].data_ptr(), tables[1][0].data_ptr()),
            (ctypes.c_void_p * 2)(tables[0][1].data_ptr(), tables[1][1].data_ptr()),
            ctx.meta.slot_mapping.data_ptr(), g.block_tables.data_ptr(), g.block_tables.shape[1],
            g.context_lens.data_ptr(), g.token_index.data_ptr(), ctx.meta.block_size, ctx.meta.sliding_window or 0,
            ctx.kv_cache.data_ptr(), ctx.kv_cache.shape[2],
        )
        self.kernels.decode_layers(m, step)
        return x
