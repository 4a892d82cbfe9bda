"""Where the models that `make setup` fetches into the user's cache live, for benchmarks and tests.

Only a path is computed here: nothing is downloaded (`scripts/gemma.sh` does that, once).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["GEMMA_GGUF_NAME", "gemma_gguf_path", "models_cache_dir"]

GEMMA_GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"  # Gemma 3 270M, Q4_K_M: a SentencePiece tokenizer, arch gemma3


def models_cache_dir() -> Path:
    """`${XDG_CACHE_HOME:-~/.cache}/dynserve/models`, as scripts/gemma.sh writes it."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dynserve" / "models"


def gemma_gguf_path() -> Path:
    """Gemma 3 270M's GGUF; FileNotFoundError, saying how to fetch it, when `make setup` has not run."""
    path = models_cache_dir() / GEMMA_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: `make setup` (scripts/gemma.sh) fetches it")
    return path
