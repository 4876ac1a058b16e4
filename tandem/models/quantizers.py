"""The weight formats a loaded model can be put in (``--quantization``), and the one step that
finishes a model once its weights are in their final format."""

from __future__ import annotations

from typing import Callable, NamedTuple

from tandem.models.base import CausalLM
from tandem.models.decode_layers import DecodeLayers
from tandem.models.quant import quantize_model_int8
from tandem.models.quant_int4 import BYTES_PER_WEIGHT as INT4_BYTES_PER_WEIGHT
from tandem.models.quant_int4 import quantize_model_int4


class Quantizer(NamedTuple):
    apply: Callable[[CausalLM], CausalLM]
    """Quantizes a loaded model's weights in place."""
    bytes_per_weight: float
    """Bytes one matmul weight takes as stored, scales included where they count (int8's one
    float32 per row of hundreds of weights is left out; int4's float16 per 32 weights is not)."""


# Every --quantization but 'none' and 'auto' (config.QUANTIZATIONS).
QUANTIZERS = {
    "int8": Quantizer(quantize_model_int8, 1.0),
    "w8a8": Quantizer(lambda model: quantize_model_int8(model, w8a8=True), 1.0),
    "int4": Quantizer(quantize_model_int4, INT4_BYTES_PER_WEIGHT),
}


def finish(model: CausalLM, quantization: str) -> CausalLM:
    """``model`` (its weights loaded) in the weight format ``quantization`` ('none': as it is),
    with its fused decode layers where the format and the CPU allow them, in eval mode."""
    if quantization != "none":
        QUANTIZERS[quantization].apply(model)
    model.decode_layers = DecodeLayers.build(model)
    model.bf16_prompt_attention = quantization == "w8a8" and model.ops.w8a8_prompt_attention_bf16
    model.eval()
    return model
