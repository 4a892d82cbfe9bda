"""Every supported architecture computes what `transformers` computes, from safetensors and from GGUF.

Tiny random-weight models of each family (`tests/_tiny_models.py`: Llama with each rope scaling, Mistral with
a 32-token sliding window, Qwen2's biases, Qwen3's q/k norm, Gemma 3's local and global layers, Phi-3 with and
without LongRoPE) are loaded by dynserve's loader from the Hugging Face directory and from the GGUF file
llama.cpp's converter made of it; the reference is `transformers` on the directory, in fp32. Prompts are
80 tokens, past the window (32) and past the length where LongRoPE and dynamic NTK switch (64), so those
paths run; a second request reuses a cached prefix that ends past the window's edge.

These tests feed and compare token ids, never text.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest
from _tiny_models import ARCHS, tiny_model
from conftest import lazy_import

from dynserve.protocol import SamplingParams

torch = lazy_import("torch")

LOGIT_ATOL = 1e-3  # fp32, as tests/test_hf_parity.py
BF16_REL = 0.05  # bf16: |ours - ref| / |ref| over the logits, as the GPU parity tests
PROMPT_LEN = 80
FORMATS = ("hf", "gguf")


def _prompt(vocab_size: int, length: int = PROMPT_LEN) -> list[int]:
    generator = torch.Generator().manual_seed(7)
    return torch.randint(3, vocab_size, (length,), generator=generator).tolist()


@cache
def _hf_model(arch: str) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model(arch, "hf")), dtype=torch.float32).eval()


def _engine(path: Path, tokenizer: Any, dtype: str = "float32", **settings: Any) -> Any:
    """An engine on the model at `path`, with its own tokenizer where dynserve reads it (else `tokenizer`:
    these tests compare ids, and its vocabulary covers the small ones)."""
    from dynserve.config import Settings
    from dynserve.errors import TokenizerError
    from dynserve.model.tokenizer import Tokenizer

    from dynserve.engine.llm_engine import LLMEngine, LoadedModel, torch_dtype
    from dynserve.engine.loader import load_model_weights
    from dynserve.engine.models.decoder import CausalLM

    config, state = load_model_weights(path, torch_dtype(dtype))
    model = CausalLM(config, torch_dtype(dtype))
    model.load_hf_state_dict(state)
    try:
        tokenizer = Tokenizer.load(path)
    except TokenizerError:
        assert config.vocab_size <= tokenizer.vocab_size
    loaded = LoadedModel(config, model.eval(), tokenizer, torch.device("cpu"))
    return LLMEngine(Settings(dtype=dtype, device="cpu", kv_blocks=64, **settings), loaded=loaded)


def _reference(arch: str, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return _hf_model(arch)(torch.tensor([ids])).logits[0].float()


def _assert_greedy_matches(engine: Any, arch: str, prompt: list[int], num_tokens: int) -> None:
    """Our greedy tokens are transformers' (its `generate`, which recomputes length-dependent rope per step as
    we do); only a near tie may go either way, and then the texts part."""
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    ours = engine.generate([prompt], params)[0].token_ids
    with torch.no_grad():
        out = _hf_model(arch).generate(
            torch.tensor([prompt]), max_new_tokens=num_tokens, do_sample=False, output_scores=True,
            return_dict_in_generate=True, eos_token_id=None, pad_token_id=0,
        )
    theirs = out.sequences[0, len(prompt):].tolist()
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a != b:
            scores = out.scores[step][0]
            assert (scores[b] - scores[a]).abs().item() < 1e-4, f"{arch}: step {step}: {ours} vs {theirs}"
            break


def _gguf_prompt(arch: str, fmt: str, config: Any, prompt: list[int]) -> list[int]:
    """llama.cpp's converter (0.3.36) writes neither Mistral's sliding window nor dynamic NTK: such a GGUF is a
    plain Llama, served as llama.cpp serves it; within the window and the trained length the two agree."""
    if fmt.startswith("gguf") and arch in ("mistral", "llama-dynamic"):
        assert config.layer_windows == () and config.rope_scaling is None
        return prompt[:32]
    return prompt


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers_fp32(arch: str, fmt: str, tokenizer) -> None:  # type: ignore[no-untyped-def]
    path = tiny_model(arch, fmt)
    engine = _engine(path, tokenizer)
    config = engine.model.config
    prompt = _gguf_prompt(arch, fmt, config, _prompt(config.vocab_size))
    ref = _reference(arch, prompt)
    err = (engine.compute_logits([prompt])[0] - ref[-1]).abs().max().item()
    assert err < LOGIT_ATOL, f"{arch} ({fmt}): max |logit error| {err}"
    if len(prompt) < PROMPT_LEN:
        return
    _assert_greedy_matches(engine, arch, prompt, 8)
    engine.generate([prompt[:48]], SamplingParams(max_tokens=1, temperature=0.0))
    if config.rope_depends_on_length:  # a block's KV depends on the length it was computed for: not cached
        assert engine.block_manager.num_cached_blocks == 0
        return
    # a cached prefix of 48 tokens (3 blocks), then 22 more: the new rows' windows reach back into the cache
    assert engine.block_manager.num_cached_blocks >= 3
    cached = engine.compute_logits([prompt[:70]])[0]
    err = (cached - _reference(arch, prompt[:70])[-1]).abs().max().item()
    assert err < LOGIT_ATOL, f"{arch} ({fmt}) after a cached prefix: max |logit error| {err}"


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_decode_matches_transformers_generate(arch: str, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Decode steps, chunked prefill (16-token chunks) and the window in the decode kernel: our greedy tokens
    are `transformers`' greedy tokens."""
    engine = _engine(tiny_model(arch, "hf"), tokenizer, max_num_batched_tokens=16)
    _assert_greedy_matches(engine, arch, _prompt(engine.model.config.vocab_size, 40), 24)


@pytest.mark.parametrize("fmt", ["hf", "gguf-bf16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_native_path_stays_near_fp32_reference(arch: str, fmt: str, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The bf16 C++ path (packed linears, fused bias + q/k norm + rope, GELU, windowed decode) runs every
    family, with no eager fallback, within bf16's tolerance of the fp32 reference."""
    from dynserve.engine.kernels.eager import fallback_counts

    before = fallback_counts()
    engine = _engine(tiny_model(arch, fmt), tokenizer, dtype="bfloat16")
    if engine.model.step_ops().name != "native-bf16":
        pytest.skip("the C++ bf16 kernels are not available on this machine")
    prompt = _gguf_prompt(arch, fmt, engine.model.config, _prompt(engine.model.config.vocab_size))
    ref = _reference(arch, prompt)[-1]
    ours = engine.compute_logits([prompt])[0]
    rel = ((ours - ref).norm() / ref.norm()).item()
    assert rel < BF16_REL, f"{arch}: relative logit distance {rel:.4f}"
    engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # decode kernel
    assert fallback_counts() == before


def test_a_sliding_window_model_decoding_4x_its_window_holds_a_bounded_number_of_blocks(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Mistral-style (every layer windowed, 32 tokens, blocks of 16): decoding 4x the window past a 16-token
    prompt, a sequence never holds more than window / block_size + 2 blocks (the slid-out ones are back in
    the pool), and its greedy tokens are still transformers' (whose cache keeps everything)."""
    engine = _engine(tiny_model("mistral", "hf"), tokenizer)
    window, block_size = engine.model.config.sliding_window, engine.block_manager.block_size
    prompt = _prompt(engine.model.config.vocab_size, 16)
    engine.add_request(prompt, SamplingParams(max_tokens=4 * window, temperature=0.0, ignore_eos=True))
    held: list[int] = []
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens += delta.token_ids
        for seq in engine.scheduler.running:
            held.append(sum(1 for b in seq.block_table if b >= 0))
            engine.block_manager.check_integrity(engine.scheduler.running)
    assert len(tokens) == 4 * window
    assert max(held) <= window // block_size + 2, held
    assert engine.block_manager.num_used_blocks == 0
    with torch.no_grad():
        theirs = _hf_model("mistral").generate(torch.tensor([prompt]), max_new_tokens=4 * window, do_sample=False,
                                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert tokens == theirs
