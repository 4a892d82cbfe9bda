"""The engine computes what Hugging Face transformers computes from the same GGUF weights.

Reference: `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` in fp32. Our loader dequantizes the
same tensors itself (un-permuting Q and K), so agreement proves loader, rope, GQA, paged attention and the
packed varlen batch together.
"""

from __future__ import annotations

import pytest
import torch

from dynserve.protocol import SamplingParams

LOGIT_ATOL = 1e-3
_PARAGRAPH = (
    "Distributed inference splits the work of serving a language model across many machines. "
    "Prefill reads the whole prompt at once and is bound by compute; decode produces one token at a "
    "time and is bound by memory bandwidth. A router that knows which worker already caches a prompt's "
    "prefix can skip most of the prefill. "
)


def _parity_prompts(tokenizer) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Five chat prompts of clearly different lengths (about 20 to 700 tokens)."""
    users = [
        "Hi!",
        "What is the capital of France? Answer in one sentence.",
        "Summarize this text:\n" + _PARAGRAPH * 2,
        "Write a short poem about this text:\n" + _PARAGRAPH * 5 + "Numbers: 12345, 3.14159, 2026-11-22.",
        "Explain the following in simple words:\n" + _PARAGRAPH * 12,
    ]
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": u}])) for u in users]


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:  # type: ignore[no-untyped-def]
    ids = _parity_prompts(tokenizer)
    lengths = [len(p) for p in ids]
    assert lengths == sorted(lengths) and lengths[0] < 40 < 600 < lengths[-1], lengths
    return ids


@pytest.fixture(scope="module")
def hf_last_logits(hf_model, prompts) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return [hf_model(torch.tensor([p])).logits[0, -1].float() for p in prompts]


def test_hf_parity_logits_batched_and_alone(make_engine, prompts, hf_last_logits) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(enable_prefix_caching=False)
    batched = engine.compute_logits(prompts)
    for i, prompt in enumerate(prompts):
        alone = engine.compute_logits([prompt])[0]
        ref = hf_last_logits[i]
        err_batched = (batched[i] - ref).abs().max().item()
        err_alone = (alone - ref).abs().max().item()
        assert err_batched < LOGIT_ATOL, f"prompt {i} ({len(prompt)} tokens) batched: {err_batched}"
        assert err_alone < LOGIT_ATOL, f"prompt {i} ({len(prompt)} tokens) alone: {err_alone}"


def test_hf_parity_greedy_generation_32_tokens(make_engine, hf_model, prompts, tokenizer) -> None:  # type: ignore[no-untyped-def]
    greedy = SamplingParams(max_tokens=32, temperature=0.0)
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            out = hf_model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=32, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.eos_token_id,
            )
            tokens = out[0, len(prompt):].tolist()
            expected.append(tokens)
    engine = make_engine()
    batched = engine.generate(prompts, greedy)
    for i, prompt in enumerate(prompts):
        alone = make_engine(enable_prefix_caching=False).generate([prompt], greedy)[0]
        assert batched[i].token_ids == expected[i], f"prompt {i} batched"
        assert alone.token_ids == expected[i], f"prompt {i} alone"
    # the answers are real text, not noise
    assert "Paris" in batched[1].text
