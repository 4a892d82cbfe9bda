"""The engine as a user drives it: prefix caching, preemption, chunked prefill, sampling and stopping."""

from __future__ import annotations

import pytest

from dynserve.errors import CacheCapacityError, InvalidRequestError
from dynserve.protocol import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def _text_of_tokens(tokenizer, n: int, seed: int = 0) -> list[int]:  # type: ignore[no-untyped-def]
    words = ("cache router worker block prefill decode token latency batch stream page "
             "transfer planner gateway scale memory").split()
    text = " ".join(words[(i * 7 + seed * 3) % len(words)] for i in range(n * 2))
    ids = tokenizer.encode(text)
    assert len(ids) >= n
    return ids[:n]


@pytest.fixture(scope="module")
def make_tiny_engine():  # type: ignore[no-untyped-def]
    """Engines over a tiny random-weight Llama with the real model's vocabulary (`tests/_tiny_models.py`), for
    what holds for any weights: which tokens are computed, cached, preempted and recomputed, in what chunks.
    A greedy token of its flat 49,152-way logits moves with any change to a sequence's cache or positions: a
    recompute after preemption that skips 8 tokens, or a chunk boundary that skips one prompt token, changes
    its tokens and left the real model's greedy 24 unchanged. A step costs milliseconds, not the real model's
    50-ms decode over 135M weights (`make_tiny_engine(...)` takes `make_engine`'s settings)."""
    from _tiny_models import tiny_model

    from dynserve.config import Settings
    from dynserve.engine.llm_engine import LLMEngine, load_model

    path = str(tiny_model("llama"))
    loaded = load_model(Settings(model=path, dtype="float32", device="cpu"))

    def factory(**overrides):  # type: ignore[no-untyped-def]
        settings = Settings(**{"model": path, "dtype": "float32", "device": "cpu", "kv_blocks": 512, **overrides})
        return LLMEngine(settings, loaded=loaded)

    return factory


def test_prefix_cache_computes_only_new_tokens(make_tiny_engine, tokenizer) -> None:  # type: ignore[no-untyped-def]
    prefix = _text_of_tokens(tokenizer, 256)
    first = prefix + tokenizer.encode(" First question: what is a block?")
    second = prefix + tokenizer.encode(" Second question: why does the router care?")
    engine = make_tiny_engine()
    engine.generate([first], GREEDY)
    before = engine.stats.num_computed_prompt_tokens
    result = engine.generate([second], GREEDY)[0]
    computed = engine.stats.num_computed_prompt_tokens - before
    assert result.num_cached_tokens == 256
    assert computed == len(second) - 256
    engine.block_manager.check_integrity()

    uncached = make_tiny_engine(enable_prefix_caching=False).generate([second], GREEDY)[0]
    assert result.token_ids == uncached.token_ids


def test_preemption_keeps_greedy_outputs(make_tiny_engine, tokenizer) -> None:  # type: ignore[no-untyped-def]
    prompts = [_text_of_tokens(tokenizer, 40 + 9 * i, seed=i) for i in range(8)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    reference = make_tiny_engine(kv_blocks=512).generate(prompts, params)
    # each request ends with 4-8 blocks; 8 of them need ~48, the cache holds 24
    small = make_tiny_engine(kv_blocks=24)
    constrained = small.generate(prompts, params)
    assert small.stats.num_preemptions > 0
    assert [r.token_ids for r in constrained] == [r.token_ids for r in reference]
    assert all(len(r.token_ids) == 24 for r in constrained)
    small.block_manager.check_integrity(small.scheduler.running)
    assert small.block_manager.num_used_blocks == 0


def test_chunked_prefill_matches_one_shot(make_tiny_engine, tokenizer) -> None:  # type: ignore[no-untyped-def]
    prompts = [_text_of_tokens(tokenizer, 300), _text_of_tokens(tokenizer, 50, seed=1)]
    one_shot = make_tiny_engine(max_num_batched_tokens=2048).generate(prompts, GREEDY)
    chunked_engine = make_tiny_engine(max_num_batched_tokens=64)
    chunked = chunked_engine.generate(prompts, GREEDY)
    assert chunked_engine.stats.num_steps > one_shot[0].token_ids.__len__()  # prefill took several steps
    assert [r.token_ids for r in chunked] == [r.token_ids for r in one_shot]


def test_seeded_sampling_is_reproducible_in_any_batch(make_engine, tokenizer) -> None:  # type: ignore[no-untyped-def]
    prompt = tokenizer.encode("Once upon a time")
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    alone = make_engine().generate([prompt], seeded)[0]
    others = [tokenizer.encode("Hello there"), tokenizer.encode("A list of fruits:")]
    in_batch = make_engine().generate(
        [others[0], prompt, others[1]], [SamplingParams(max_tokens=8, temperature=1.0), seeded, GREEDY]
    )[1]
    assert alone.token_ids == in_batch.token_ids
    different = make_engine().generate([prompt], SamplingParams(max_tokens=16, temperature=1.0, seed=99))[0]
    assert different.token_ids != alone.token_ids


def test_stop_strings_and_finish_reasons(make_engine, tokenizer) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Count from 1 to 20, comma separated."}])
    full = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0))[0]
    assert "5" in full.text
    stop_at = full.text[full.text.index("5"):full.text.index("5") + 2]
    stopped = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, stop=(stop_at,)))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index(stop_at)]
    short = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 3
    eos = engine.generate([tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}])],
                          SamplingParams(max_tokens=64, temperature=0.0))[0]
    assert eos.finish_reason == "stop" and tokenizer.eos_token_id not in eos.token_ids[:-1]


def test_logprobs_are_normalized_and_match_greedy(make_engine, tokenizer) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    result = engine.generate([tokenizer.encode("The capital of France is")],
                             SamplingParams(max_tokens=5, temperature=0.0, logprobs=5))[0]
    assert len(result.logprobs) == 5
    for chosen, entry in zip(result.token_ids, result.logprobs, strict=True):
        assert entry.token_id == chosen
        top_ids = [t for t, _ in entry.top]
        top_values = [v for _, v in entry.top]
        assert len(entry.top) == 5 and top_ids[0] == chosen  # greedy picks the most likely token
        assert top_values == sorted(top_values, reverse=True) and all(v <= 0 for v in top_values)
        assert entry.logprob == pytest.approx(top_values[0])


def test_penalties_reduce_repetition(make_engine, tokenizer) -> None:  # type: ignore[no-untyped-def]
    prompt = tokenizer.encode("na na na na na na na na")
    plain = make_engine().generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    penalized = make_engine().generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, frequency_penalty=2.0,
                                 presence_penalty=2.0))[0]
    assert len(set(penalized.token_ids)) > len(set(plain.token_ids))


def test_abort_frees_blocks(make_engine, tokenizer) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    request_id = engine.add_request(_text_of_tokens(tokenizer, 100), SamplingParams(max_tokens=50))
    engine.step()
    assert engine.block_manager.num_used_blocks > 0
    assert engine.abort(request_id)
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()
    assert not engine.abort(request_id)
    engine.block_manager.check_integrity(engine.scheduler.running)


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(temperature=-1.0), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(logprobs=21), "logprobs"),
        (SamplingParams(stop=("",)), "stop"),
    ],
)
def test_bad_parameters_are_named(make_engine, params: SamplingParams, param: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidRequestError) as info:
        make_engine(kv_blocks=8).add_request([1, 2, 3], params)
    assert info.value.param == param


def test_bad_prompts_are_rejected(make_engine) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(kv_blocks=8, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(InvalidRequestError, match="context length"):
        engine.add_request([5] * 64, GREEDY)
    for ids in ([10**7], [1, 2, -1], [3, engine.vocab_size, 4]):
        with pytest.raises(InvalidRequestError, match="token ids"):
            engine.add_request(ids, GREEDY)
    engine.add_request([0, engine.vocab_size - 1], GREEDY)  # both ends are ids
    tiny = make_engine(kv_blocks=2, max_model_len=64)
    with pytest.raises(CacheCapacityError) as info:
        tiny.add_request([5] * 40, SamplingParams(max_tokens=100))  # 64 tokens = 4 blocks of 16 > 2
    assert info.value.num_blocks_needed == 4 and info.value.num_blocks_total == 2
