"""The structures ``decode_layers.c`` takes, as ctypes mirrors (field for field, same order).

``DecodeModel`` and its ``DecodeLayer`` array hold a model's weight pointers, made once per model
(``tandem.models.decode_layers``); ``DecodeStep`` holds one step's tensors, filled every step.
"""

from __future__ import annotations

import ctypes

_P, _L, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_float


class QLinear(ctypes.Structure):
    """A w8a8 linear: int8 weight [N, K] and float32 per-row scale [N]."""

    _fields_ = [("weight", _P), ("scale", _P), ("N", _L), ("K", _L)]


class DecodeLayer(ctypes.Structure):
    _fields_ = [
        ("qkv", QLinear), ("o", QLinear), ("gate_up", QLinear), ("down", QLinear),
        ("norm_in", _P), ("norm_post_attn", _P), ("norm_pre_ffn", _P), ("norm_post_ffn", _P),
        ("q_norm", _P), ("k_norm", _P),
        ("sliding", _L), ("rope", _L),
    ]


class DecodeModel(ctypes.Structure):
    _fields_ = [
        ("layers", _L), ("hidden", _L), ("heads", _L), ("kv_heads", _L), ("head_dim", _L), ("intermediate", _L),
        ("act", _L), ("sandwich", _L),
        ("eps", _F), ("offset", _F), ("qk_eps", _F), ("qk_offset", _F), ("attn_scale", _F),
        ("layer", ctypes.POINTER(DecodeLayer)),
    ]


class DecodeStep(ctypes.Structure):
    _fields_ = [
        ("T", _L), ("x", _P), ("cos", _P * 2), ("sin", _P * 2), ("slots", _P), ("tables", _P), ("max_blocks", _L),
        ("context", _P), ("rows", _P), ("block_size", _L), ("window", _L), ("kv", _P), ("kv_slots", _L),
    ]
