"""Where tandem keeps what it builds once and reuses: converted models and compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """``$TANDEM_CACHE_DIR``, else the user's cache directory (``~/.cache/tandem`` on Linux)."""
    from platformdirs import user_cache_dir

    return Path(os.environ.get("TANDEM_CACHE_DIR") or user_cache_dir("tandem"))
