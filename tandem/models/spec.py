"""A model's architecture, read from a Hugging Face config.json or from GGUF metadata.

One flat description covers the supported families; the model code reads only this.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# config.json "model_type" -> our family name
FAMILIES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
}


# What sets a family apart where the shared layers need to know it. A config.json does not say
# these, so they follow from the family; the layers read the resolved ModelSpec fields only.
FAMILY_TRAITS: dict[str, dict[str, Any]] = {
    "gemma3": {"norm_unit_offset": True},
}


@dataclass(frozen=True)
class RopeSpec:
    theta: float = 10000.0
    scaling_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelSpec:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeSpec
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    # Gemma 3: sliding-window layers use their own rope base.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    rope_local: RopeSpec | None = None
    query_pre_attn_scalar: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    norm_unit_offset: bool | None = None
    """RMS norms scale by ``1 + w`` (weights stored as ``w - 1``, Gemma); None: the family's trait."""

    def __post_init__(self) -> None:
        # Fill the family's traits into fields left unset (also for specs saved before a field existed).
        for name, value in FAMILY_TRAITS.get(self.family, {}).items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.norm_unit_offset is None:
            object.__setattr__(self, "norm_unit_offset", False)

    @property
    def attn_scale(self) -> float:
        if self.query_pre_attn_scalar is not None:
            return float(self.query_pre_attn_scalar) ** -0.5
        return self.head_dim**-0.5

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelSpec":
        d = dict(d)
        d["rope"] = RopeSpec(**d["rope"])
        d["rope_local"] = RopeSpec(**d["rope_local"]) if d.get("rope_local") else None
        d["layer_types"] = tuple(d.get("layer_types") or ())
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        return cls(**d)

    # --- Hugging Face config.json ----------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelSpec":
        if "text_config" in cfg and cfg.get("model_type") == "gemma3":
            cfg = {**cfg["text_config"], "model_type": "gemma3_text"}
        model_type = cfg.get("model_type")
        family = FAMILIES.get(model_type or "")
        if family is None:
            raise ValueError(
                f"model: unsupported architecture {model_type!r}; supported: {', '.join(sorted(FAMILIES))}"
            )
        hidden = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or hidden // heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        common = dict(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family == "gemma3")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
        if family == "gemma3":
            layer_types = cfg.get("layer_types")
            n = common["num_layers"]
            if not layer_types:
                pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
                layer_types = [
                    "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)
                ]
            rp = cfg.get("rope_parameters") or {}
            full = _rope_from_hf(rp.get("full_attention") or cfg, cfg.get("rope_theta", 1_000_000.0))
            local = _rope_from_hf(
                rp.get("sliding_attention") or {"rope_theta": cfg.get("rope_local_base_freq", 10_000.0)},
                cfg.get("rope_local_base_freq", 10_000.0),
            )
            return cls(
                **common,
                rope=full,
                rope_local=local,
                qk_norm=True,
                hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
                sliding_window=cfg.get("sliding_window"),
                layer_types=tuple(layer_types),
                query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", head_dim),
            )
        rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope = _rope_from_hf({**rp, "rope_theta": rp.get("rope_theta", cfg.get("rope_theta", 10000.0))}, 10000.0)
        return cls(
            **common,
            rope=rope,
            attention_bias=bool(cfg.get("attention_bias", family == "qwen2")),
            qk_norm=family == "qwen3",
            hidden_act=cfg.get("hidden_act", "silu"),
        )


def _rope_from_hf(d: dict[str, Any], default_theta: float) -> RopeSpec:
    kind = d.get("rope_type") or d.get("type") or "default"
    if kind not in ("default", "linear", "llama3"):
        raise ValueError(f"model: unsupported rope scaling type {kind!r}")
    scaling = d.get("rope_scaling") if isinstance(d.get("rope_scaling"), dict) else None
    if scaling:  # an old-style gemma3 config: the scaling applies to global layers
        return _rope_from_hf({**scaling, "rope_theta": d.get("rope_theta", default_theta)}, default_theta)
    return RopeSpec(
        theta=float(d.get("rope_theta", default_theta)),
        scaling_type=kind,
        factor=float(d.get("factor", 1.0)),
        low_freq_factor=float(d.get("low_freq_factor", 1.0)),
        high_freq_factor=float(d.get("high_freq_factor", 4.0)),
        original_max_position=int(d.get("original_max_position_embeddings", 8192)),
    )
