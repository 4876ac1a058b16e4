"""GGUF files: architecture from the metadata, weights dequantized to float32 on load.

Tensor names are mapped to the Hugging Face names our models use, undoing the two changes
llama.cpp's converter makes: Llama's q/k rows are interleaved for its rope kernel, and Gemma's
norm weights are stored with the +1 already added.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from tandem.models.spec import FAMILIES, ModelSpec, RopeSpec
from tandem.weights.gguf_fields import array_length, scalar

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


@functools.cache
def _plain_reader():
    import gguf
    from gguf import GGUFValueType

    class PlainReader(gguf.GGUFReader):
        """``gguf.GGUFReader`` over a plain ndarray view of its memory map, with its arrays of
        scalars and of strings parsed without a Python call per element. numpy's memmap subclass
        runs Python code on every slice, and the stock reader slices the file a few times per
        metadata element: for a 262k-token vocabulary that is about 4 million slices. Opening the
        default model on a 2-core AMD EPYC Zen 3 (2026-12-07): 16.4 s stock, 5.9 s over the plain
        view, 1.0 s with the arrays parsed here too. The fields and tensors it reads are the same,
        part for part (an array's elements are still one view each, for scalars made by numpy in
        one call); the view keeps the map alive."""

        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, value) -> None:
            self._data = value.view(np.ndarray)

        def _get_field_parts(self, orig_offs: int, raw_type: int):
            if raw_type != GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            itype, count, offs = int(raw_itype[0]), int(alen[0]), orig_offs + 12
            nptype = self.gguf_scalar_to_np.get(GGUFValueType(itype)) if itype != GGUFValueType.ARRAY else None
            if nptype is None and itype != GGUFValueType.STRING:
                return super()._get_field_parts(orig_offs, raw_type)  # arrays of arrays
            parts: list = [raw_itype, alen]
            types = [GGUFValueType.ARRAY] + ([GGUFValueType(itype)] if count else [])
            if nptype is not None:  # one (1,)-shaped view per element, as the stock reader makes them
                values = self._get(offs, nptype, count)
                parts += list(values.reshape(count, 1))
                return offs + values.nbytes - orig_offs, parts, list(range(2, 2 + count)), types
            data, order = self.data, np.dtype(np.uint64).newbyteorder(self.byte_order)
            idxs = []
            for _ in range(count):  # strings: a uint64 length, then the bytes
                slen = data[offs:offs + 8].view(order)
                n = int(slen[0])
                idxs.append(len(parts) + 1)
                parts += (slen, data[offs + 8:offs + 8 + n])
                offs += 8 + n
            return offs - orig_offs, parts, idxs, types

    return PlainReader


def open_gguf(path: Path):
    try:
        return _plain_reader()(str(path))
    except Exception as exc:  # a truncated or foreign file
        raise ValueError(f"model: {path} is not a readable GGUF file ({exc})") from exc


def spec_from_gguf(reader) -> ModelSpec:
    arch = scalar(reader, "general.architecture")
    family = FAMILIES.get(arch or "")
    if family is None:
        raise ValueError(f"model: unsupported GGUF architecture {arch!r}")

    def get(key: str, default: Any = None) -> Any:
        return scalar(reader, f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = get("attention.head_count_kv", heads)
    head_dim = int(get("attention.key_length", hidden // heads))
    names = {t.name for t in reader.tensors}
    vocab = array_length(reader, "tokenizer.ggml.tokens")
    if vocab is None:
        embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
        vocab = int(embd.shape[-1])
    scaling_type = get("rope.scaling.type", "none")
    factor = float(get("rope.scaling.factor", 1.0))
    rope = RopeSpec(
        theta=float(get("rope.freq_base", 10000.0)),
        scaling_type="linear" if scaling_type == "linear" and factor != 1.0 else "default",
        factor=factor if scaling_type == "linear" else 1.0,
    )
    eos = scalar(reader, "tokenizer.ggml.eos_token_id")
    common = dict(
        family=family,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        rope=rope,
        bos_token_id=scalar(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )
    if family == "gemma3":
        n = common["num_layers"]
        # llama.cpp's Gemma 3: every sixth layer is global, the rest slide with a 10k rope base.
        return ModelSpec(
            **common,
            qk_norm=True,
            hidden_act="gelu_pytorch_tanh",
            sliding_window=int(get("attention.sliding_window", 512)),
            layer_types=tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)),
            rope_local=RopeSpec(theta=10000.0),
            query_pre_attn_scalar=float(head_dim),
        )
    return ModelSpec(
        **common,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
    )


def _hf_name(name: str, family: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_RE.match(name)
    if m is None:
        raise ValueError(f"model: unknown GGUF tensor {name!r}")
    layer, part, kind = m.groups()
    if part == "ffn_norm":
        target = "pre_feedforward_layernorm" if family == "gemma3" else "post_attention_layernorm"
    elif part in _LAYER_NAMES:
        target = _LAYER_NAMES[part]
    else:
        raise ValueError(f"model: unknown GGUF tensor {name!r}")
    return f"model.layers.{layer}.{target}.{kind}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of rotary halves in q/k projection rows."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


DEQUANTIZE_ELEMENTS = 1 << 18
"""Values per call of a quantized type's row dequantizer: ``gguf.quants.dequantize`` takes rows 16
at a time, a Python call each: for the default model's file 2.9 s on an AMD EPYC Zen 3 (2.0 s of it
the 262,144-row embedding), against 1.1 s in slices of 2^18 values (2^16 and 2^20 about the same,
2^22 slower), bit-identical."""


def _dequantize(data: np.ndarray, qtype) -> np.ndarray:
    """``gguf.quants.dequantize(data, qtype)``, the same values, through the type's own row
    dequantizer over slices of ``DEQUANTIZE_ELEMENTS`` values (its one-time tables set up first)."""
    import gguf.quants

    kind = getattr(gguf.quants, qtype.name, None)
    if kind is None or not hasattr(kind, "dequantize_rows"):
        return gguf.quants.dequantize(data, qtype)
    kind.init_grid()
    rows = data.reshape(-1, data.shape[-1])
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    width = rows.shape[-1] // size * block
    out = np.empty((rows.shape[0], width), dtype=np.float32)
    step = max(1, DEQUANTIZE_ELEMENTS // width)
    for i in range(0, rows.shape[0], step):
        out[i:i + step] = kind.dequantize_rows(rows[i:i + step])
    return out.reshape(*data.shape[:-1], width)


def iter_gguf_weights(reader, spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf import GGMLQuantizationType

    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            data = np.asarray(t.data, dtype=np.float32).reshape(shape)
        elif t.tensor_type == GGMLQuantizationType.BF16:
            raw = np.asarray(t.data).view(np.uint16).astype(np.uint32) << 16
            data = raw.view(np.float32).reshape(shape)
        else:
            data = _dequantize(t.data, t.tensor_type).reshape(shape)
        name = _hf_name(t.name, spec.family)
        if spec.family == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            data = _unpermute(data, spec.num_heads)
        elif spec.family == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = _unpermute(data, spec.num_kv_heads)
        if spec.family == "gemma3" and "norm" in name:
            data = data - 1.0
        yield name, torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
