"""The tokenizer the engine uses: a Hugging Face ``tokenizers`` model plus the few facts the
engine needs (BOS handling, EOS ids, chat template)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer as HFTokenizer


@dataclass
class Tokenizer:
    backend: HFTokenizer
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    add_bos_token: bool
    chat_template: str | None = None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``add_special_tokens``: prepend BOS where the model wants one."""
        # the batch call releases the GIL (the single one holds it), so a long prompt tokenized in
        # a worker thread does not stall the server's event loop
        ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None and (
                not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_long(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """``decode`` without holding the GIL (worth it for many ids, in a worker thread)."""
        return self.backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # --- persistence (the converted-model cache keeps a tokenizer beside the weights) --------
    def save(self, directory: Path) -> None:
        self.backend.save(str(directory / "tokenizer.json"))
        meta = {
            "bos_token_id": self.bos_token_id,
            "eos_token_ids": list(self.eos_token_ids),
            "add_bos_token": self.add_bos_token,
            "chat_template": self.chat_template,
        }
        (directory / "tandem_tokenizer.json").write_text(json.dumps(meta))

    @classmethod
    def load_saved(cls, directory: Path) -> "Tokenizer":
        meta = json.loads((directory / "tandem_tokenizer.json").read_text())
        return cls(
            backend=HFTokenizer.from_file(str(directory / "tokenizer.json")),
            bos_token_id=meta["bos_token_id"],
            eos_token_ids=tuple(meta["eos_token_ids"]),
            add_bos_token=meta["add_bos_token"],
            chat_template=meta["chat_template"],
        )

    @classmethod
    def from_hf_dir(cls, directory: Path, eos_token_ids: Sequence[int] = ()) -> "Tokenizer":
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"model: {directory} has no tokenizer.json")
        backend = HFTokenizer.from_file(str(path))
        cfg_path = directory / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}

        def token_id(key: str) -> int | None:
            tok = cfg.get(key)
            if isinstance(tok, dict):
                tok = tok.get("content")
            return backend.token_to_id(tok) if isinstance(tok, str) else None

        bos = token_id("bos_token")
        eos = list(eos_token_ids)
        cfg_eos = token_id("eos_token")
        if cfg_eos is not None and cfg_eos not in eos:
            eos.append(cfg_eos)
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:  # infer from the post-processor, as the checkpoint's tokenizer would do
            with_special = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos is not None and bool(with_special) and with_special[0] == bos
        template = cfg.get("chat_template")
        jinja = directory / "chat_template.jinja"
        if template is None and jinja.is_file():
            template = jinja.read_text()
        return cls(backend, bos, tuple(eos), bool(add_bos), template if isinstance(template, str) else None)
