"""Shared test fixtures: one loaded model per session, a factory for engines that share it, and the
Hugging Face reference model for parity tests.

TRITON_INTERPRET must be set before anything imports triton, so it is set here, first.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from dynserve.config import Settings  # noqa: E402
from dynserve.engine.llm_engine import LLMEngine, LoadedModel, load_model  # noqa: E402
from dynserve.engine.loader import default_model_path  # noqa: E402

EngineFactory = Callable[..., LLMEngine]


@pytest.fixture(scope="session")
def loaded_model() -> LoadedModel:
    """SmolLM2-135M-Instruct, fp32 on CPU, loaded once for the whole session."""
    return load_model(Settings(dtype="float32", device="cpu"))


@pytest.fixture(scope="session")
def make_engine(loaded_model: LoadedModel) -> EngineFactory:
    """Build an engine (its own KV cache and scheduler) over the shared model: make_engine(kv_blocks=64)."""

    def factory(**overrides: Any) -> LLMEngine:
        settings = Settings(**{"dtype": "float32", "device": "cpu", "kv_blocks": 512, **overrides})
        return LLMEngine(settings, loaded=loaded_model)

    return factory


@pytest.fixture(scope="session")
def tokenizer(loaded_model: LoadedModel):  # type: ignore[no-untyped-def]
    return loaded_model.tokenizer


@pytest.fixture(scope="session")
def hf_model() -> Any:
    """Hugging Face transformers' model loaded from the same GGUF file (the parity reference)."""
    import transformers

    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()
