"""Tiny randomly initialised models of each family, saved as Hugging Face directories."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 384


def hf_config(family: str, **overrides):
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    common.update(overrides)
    if family == "llama":
        return tf.LlamaConfig(
            **common,
            rope_parameters={
                "rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
            },
        )
    if family == "qwen2":
        return tf.Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "qwen3":
        return tf.Qwen3Config(**common, head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "gemma3":
        cfg = dict(common, num_hidden_layers=6, num_key_value_heads=1)
        return tf.Gemma3TextConfig(**cfg, head_dim=32, sliding_window=8, query_pre_attn_scalar=32)
    raise ValueError(family)


def build_reference(family: str, seed: int = 0, **overrides):
    import transformers as tf

    torch.manual_seed(seed)
    config = hf_config(family, **overrides)
    cls = tf.Gemma3ForCausalLM if family == "gemma3" else tf.AutoModelForCausalLM
    model = cls.from_config(config, dtype=torch.float32) if family != "gemma3" else cls(config)
    # Random norms, so that a norm applied with the wrong convention is caught.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + (0.0 if family == "gemma3" else 1.0))
            elif name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.1)
    return model.eval().float()


def write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens(["<pad>", "<s>", "</s>"])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True})
    )


def save_tiny(family: str, directory: Path, seed: int = 0, **overrides):
    model = build_reference(family, seed, **overrides)
    model.save_pretrained(directory)
    write_tokenizer(directory)
    return model


def greedy_together_and_alone(llm, num_prompts: int = 5, max_tokens: int = 12):
    """Greedy outputs of the same prompts (6 to 22 tokens) run as one batch, and one at a time:
    equal lists mean the engine's results do not depend on the batch."""
    from tandem import SamplingParams

    prompts = [[1] + [(7 * i + 3 * j) % (VOCAB - 3) + 3 for j in range(5 + 4 * i)] for i in range(num_prompts)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    together = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate(p, params)[0].token_ids for p in prompts]
    return together, alone
