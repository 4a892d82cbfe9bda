"""The tiny-model factory (tests/_tiny_models.py): each architecture's Hugging Face directory loads in
transformers with a working tokenizer and non-degenerate logits, and llama.cpp's converter turns it into a
GGUF file that transformers reads back to the same logits (fp32), so parity tests can trust both forms.
Where transformers cannot read a GGUF back whole (rope scaling, mistral's window), the file is checked for
what it says instead: that is what dynserve's loader has to read."""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest

from _tiny_models import ARCHS, tiny_config, tiny_model

# transformers reloading every GGUF (Qwen2's vocabulary alone takes half a minute) checks the factory, not
# dynserve: tests/test_architectures.py runs dynserve on every one in `make test`; this runs in make test-models
pytestmark = pytest.mark.models

# what a GGUF of these loses on the way back into transformers 5.23: the converter writes no key for it
# (mistral's sliding window, dynamic rope scaling) or transformers' GGUF reader ignores the key it wrote
GGUF_RELOAD_LOSES = {
    "llama3": "the llama3 rope factors (the converter writes rope_freqs.weight; the reader ignores it)",
    "llama-linear": "linear rope scaling (rope.scaling.type/factor written; the reader ignores them)",
    "llama-dynamic": "dynamic rope scaling (the converter writes nothing for it)",
    "llama-yarn": "yarn rope scaling (rope.scaling.* written; the reader ignores them)",
    "mistral": "the sliding window (converted as arch llama, no attention.sliding_window)",
    "phi3-longrope": "longrope (rope_factors_long/short.weight written; the reader ignores them)",
}
# prompt positions beyond every window and original context length the tiny configs use (32, 64)
_PROMPT_LENGTH = 80


def _prompt(vocab_size: int) -> Any:
    import torch

    generator = torch.Generator().manual_seed(1)
    return torch.randint(3, vocab_size, (1, _PROMPT_LENGTH), generator=generator)


def _logits(model: Any, input_ids: Any) -> Any:
    import torch

    with torch.no_grad():
        return model(input_ids).logits[0]


@functools.cache
def _load(arch: str, fmt: str) -> Any:
    import torch
    import transformers

    path = tiny_model(arch, fmt)
    if fmt == "hf":
        return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_directory_loads_with_tokenizer_and_distinct_logits(arch: str) -> None:
    import transformers

    path = tiny_model(arch, "hf")
    config = json.loads((path / "config.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    ids = tokenizer("Hello, world! 12345", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == "Hello, world! 12345"
    assert max(ids) < config["vocab_size"]

    model = _load(arch, "hf")
    prompt = _prompt(config["vocab_size"])
    logits = _logits(model, prompt)
    assert logits.std() > 0.5  # not near-uniform: greedy choices are not ties
    assert logits.argmax(-1).unique().numel() > _PROMPT_LENGTH // 8  # positions choose different tokens
    changed = prompt.clone()
    changed[0, -20] = (changed[0, -20] + 1) % config["vocab_size"]
    # an earlier token matters at the last position (inside every sliding window): attention is not uniform
    assert (_logits(model, changed)[-1] - logits[-1]).abs().max() > 1e-2


@pytest.mark.parametrize("arch", [arch for arch in ARCHS if arch not in GGUF_RELOAD_LOSES])
def test_gguf_reloads_with_the_same_logits(arch: str) -> None:
    import torch

    config = json.loads((tiny_model(arch, "hf") / "config.json").read_text())
    prompt = _prompt(config["vocab_size"])
    torch.testing.assert_close(_logits(_load(arch, "gguf"), prompt), _logits(_load(arch, "hf"), prompt),
                               rtol=1e-4, atol=1e-4)


# what the GGUF file says for each architecture transformers cannot read back: a loader must read these
GGUF_SAYS = {
    "llama3": ({"llama.rope.freq_base": 500000.0}, {"rope_freqs.weight"}),
    "llama-linear": ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}, set()),
    "llama-dynamic": ({"llama.context_length": 64}, set()),
    "llama-yarn": ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
                    "llama.rope.scaling.original_context_length": 64,
                    "llama.rope.scaling.yarn_beta_fast": 32.0, "llama.rope.scaling.yarn_beta_slow": 1.0}, set()),
    "mistral": ({"general.architecture": "llama"}, set()),
    "phi3-longrope": ({"phi3.rope.scaling.original_context_length": 64, "phi3.context_length": 256},
                      {"rope_factors_long.weight", "rope_factors_short.weight"}),
}


@pytest.mark.parametrize("arch", sorted(GGUF_RELOAD_LOSES))
def test_gguf_says_what_transformers_cannot_read_back(arch: str) -> None:
    import gguf

    reader = gguf.GGUFReader(tiny_model(arch, "gguf"))
    keys, tensors = GGUF_SAYS[arch]
    assert {key: reader.fields[key].contents() for key in keys} == pytest.approx(keys)
    assert tensors <= {tensor.name for tensor in reader.tensors}
    if arch == "mistral":  # converted as a plain llama: the window is not in the file at all
        assert not [key for key in reader.fields if "sliding_window" in key]


def test_models_are_cached_and_deterministic() -> None:
    first = tiny_model("llama", "hf")
    assert tiny_model("llama", "hf") == first
    assert tiny_model("llama", "hf", seed=1) != first
    assert tiny_model("llama", "hf", num_hidden_layers=3) != first
    assert json.loads((tiny_model("llama", "hf", num_hidden_layers=3) / "config.json").read_text())[
        "num_hidden_layers"] == 3


def test_unknown_arch_or_format_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown architecture"):
        tiny_config("gpt-j")
    with pytest.raises(ValueError, match="unknown format"):
        tiny_model("llama", "onnx")
    with pytest.raises(ValueError, match="unknown tokenizer"):
        tiny_config("llama", tokenizer="wordpiece")  # type: ignore[arg-type]
