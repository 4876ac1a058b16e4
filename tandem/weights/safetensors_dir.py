"""Weights of a local Hugging Face model directory: every ``*.safetensors`` file in it."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open


def iter_safetensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {directory}")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
