"""Disaggregated prefill/decode: the prefill path decision, the engines' lease and receive life cycle, real
pages moved between two real engines (in process, over a tiny random-weight model: any weights show a wrong
page in their greedy tokens), and the whole flow through the gateway (over NIXL, a tiny model with the real
one's KV geometry; mockers for fault injection and the block-leak run)."""

from __future__ import annotations

import asyncio
import random
import re
import time
from typing import Any

import httpx
import openai
import pytest
from conftest import lazy_import, needs

from dynserve.config import Settings
from dynserve.gateway.disagg import prefill_path
from dynserve.protocol import RemotePrefill, SamplingParams, TokenDelta

torch = lazy_import("torch")

MODEL = "SmolLM2-135M-Instruct"
GREEDY = SamplingParams(max_tokens=12, temperature=0)
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea. " * 6,
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17",
    "Here is a recipe for pancakes: first,",
    "The three laws of thermodynamics are",
    "Q: What is the tallest mountain on Earth?\nA:",
    "def fibonacci(n):\n    " * 3,
    "Once upon a time, in a small village by the river, there lived",
    "List five colors of the rainbow: red,",
    "The quick brown fox jumps over the lazy dog. " * 8,
]


# ---- the decision ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("uncached", "queued", "workers", "path"), [
    (1000, 0, 2, "remote"),
    (100, 0, 2, "short_prompt"),
    (1000, 4, 2, "prefill_queue"),
    (1000, 3, 2, "remote"),
    (1000, 0, 0, "no_prefill_worker"),
])
def test_prefill_path(uncached: int, queued: int, workers: int, path: str) -> None:
    assert prefill_path(num_uncached_tokens=uncached, num_prefill_queued=queued, num_prefill_workers=workers,
                        local_prefill_tokens=512, max_prefill_queue=2) == path


# ---- engines, in process ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def make_tiny_engine() -> Any:
    """Engines over one tiny random-weight Llama with the real model's vocabulary (`tests/_tiny_models.py`):
    what these tests check (leases, receives, the pages' bytes, greedy equality) holds for any weights, and
    a step costs milliseconds. Its embeddings are untied: a random tied model's greedy tokens repeat the last
    one, an untied one's vary, so a decode over a wrong page shows in its tokens.
    `make_tiny_engine(kv_blocks=64)` takes `make_engine`'s settings."""
    from _tiny_models import tiny_model

    from dynserve.engine.llm_engine import LLMEngine, load_model

    path = str(tiny_model("llama", tie_word_embeddings=False))
    loaded = load_model(Settings(model=path, dtype="float32", device="cpu"))

    def factory(**overrides: Any) -> Any:
        settings = Settings(**{"model": path, "dtype": "float32", "device": "cpu", "kv_blocks": 512, **overrides})
        return LLMEngine(settings, loaded=loaded)

    return factory


def _prefill(engine: Any, token_ids: list[int], request_id: str, params: SamplingParams = GREEDY) -> TokenDelta:
    engine.add_request(token_ids, params, request_id, prefill_only=True)
    while not (deltas := engine.step()):
        pass
    assert len(deltas) == 1 and deltas[0].finished
    return deltas[0]


def _decode(engine: Any, token_ids: list[int], request_id: str, prefilled: TokenDelta,
            read: Any, params: SamplingParams = GREEDY) -> tuple[list[int], TokenDelta]:
    """Run a remote-prefilled request on `engine`, moving its pages with `read(plan)` (None: the read fails)."""
    assert prefilled.kv_handle is not None
    remote = RemotePrefill(handle=prefilled.kv_handle, first_token_id=prefilled.token_ids[0],
                           num_cached_tokens=prefilled.num_cached_tokens)
    engine.add_request(token_ids, params, request_id, remote=remote)
    [plan] = engine.drain_receives()
    failure = None if read is not None and plan.fallback is None else (plan.fallback or "transfer_error")
    if failure is None:
        read(plan)
    first = engine.complete_receive(request_id, failure)
    assert first is not None
    tokens = list(first.token_ids)
    while engine.has_unfinished_requests():
        tokens += [t for d in engine.step() for t in d.token_ids]
    return tokens, first


def test_mocker_engines_disaggregated_equal_aggregated() -> None:
    from dynserve.workers.mocker import MockEngine

    settings = Settings(mocker="cpu", mocker_speedup=1e6, kv_blocks=64)
    prefill, decode, whole = MockEngine(settings), MockEngine(settings), MockEngine(settings)
    prefill.kv_source_id = "p"
    for i, text in enumerate(PROMPTS[:4]):
        token_ids = prefill.tokenizer.encode(text)
        reference = whole.generate([token_ids], GREEDY)[0].token_ids
        prefilled = _prefill(prefill, token_ids, f"r{i}")
        assert prefilled.finish_reason == "prefilled" and prefilled.kv_handle is not None
        assert prefilled.kv_handle.worker_id == "p" and prefilled.kv_handle.num_tokens == len(token_ids)
        read = None if i % 2 else (lambda plan: None)  # odd requests: the read fails, the decode prefills
        tokens, first = _decode(decode, token_ids, f"r{i}", prefilled, read)
        assert tokens == reference
        assert first.kv_fallback == (None if read else "transfer_error")
        assert prefill.num_leases == 1 and prefill.release(f"r{i}") and not prefill.release(f"r{i}")
    for engine in (prefill, decode):
        engine.block_manager.check_integrity([])
        assert engine.block_manager.num_used_blocks == 0


def test_real_pages_move_byte_for_byte_and_decode_equals_aggregated(make_tiny_engine: Any) -> None:
    from dynserve.kv_transfer.tcp_backend import TcpConnector

    prefill, decode, whole = (make_tiny_engine(kv_blocks=128) for _ in range(3))
    settings = Settings(transfer_timeout_s=10)
    with TcpConnector("p", settings) as source, TcpConnector("d", settings) as sink:
        source.register_kv_cache(prefill.runner.kv_cache)
        sink.register_kv_cache(decode.runner.kv_cache)
        sink.add_peer(source.metadata())
        prefill.kv_source_id, prefill.kv_agent_name = "p", "p"
        moved: list[Any] = []

        def read(plan: Any) -> None:
            sink.read_blocks(plan.agent_name, plan.remote_block_ids, plan.local_block_ids)
            assert torch.equal(decode.runner.kv_cache[plan.local_block_ids],  # as landed, before decoding
                               prefill.runner.kv_cache[plan.remote_block_ids])
            moved.append(plan)

        for i, text in enumerate(PROMPTS[:5]):
            token_ids = prefill.tokenizer.encode(text)
            reference = whole.generate([token_ids], GREEDY)[0].token_ids
            prefilled = _prefill(prefill, token_ids, f"r{i}")
            tokens, _first = _decode(decode, token_ids, f"r{i}", prefilled, read)
            assert tokens == reference, text
            assert prefill.release(f"r{i}")
    assert sum(len(p.local_block_ids) for p in moved) > 5
    for engine in (prefill, decode):
        engine.block_manager.check_integrity([])
        assert engine.block_manager.num_used_blocks == 0


def test_an_abort_during_the_read_frees_the_blocks_only_after_it(make_tiny_engine: Any) -> None:
    prefill, decode = make_tiny_engine(kv_blocks=64), make_tiny_engine(kv_blocks=64)
    token_ids = prefill.tokenizer.encode(PROMPTS[1])
    prefilled = _prefill(prefill, token_ids, "a")
    assert prefilled.kv_handle is not None
    decode.add_request(token_ids, GREEDY, "a", remote=RemotePrefill(handle=prefilled.kv_handle,
                                                                      first_token_id=prefilled.token_ids[0]))
    [plan] = decode.drain_receives()
    assert decode.abort("a")
    assert decode.block_manager.num_used_blocks >= len(plan.local_block_ids)  # the read may still write them
    assert decode.complete_receive("a", None) is None
    assert decode.block_manager.num_used_blocks == 0
    assert prefill.abort("a")  # an abort releases a held prefill too
    assert prefill.block_manager.num_used_blocks == 0 and prefill.num_leases == 0


def test_a_handle_near_the_end_of_its_lease_is_not_read(make_tiny_engine: Any) -> None:
    prefill, decode = make_tiny_engine(kv_blocks=64, kv_lease_s=1.0), make_tiny_engine(kv_blocks=64)
    token_ids = prefill.tokenizer.encode(PROMPTS[1])
    prefilled = _prefill(prefill, token_ids, "late")
    assert prefilled.kv_handle is not None and prefilled.kv_handle.lease_ends_unix_s < time.time() + 1.0
    tokens, first = _decode(decode, token_ids, "late", prefilled, read=lambda plan: None)
    assert first.kv_fallback == "lease_expired"  # 1 s left is inside the margin: prefilled here instead
    assert tokens == make_tiny_engine(kv_blocks=64).generate([token_ids], GREEDY)[0].token_ids


def test_leases_end_on_their_own(make_tiny_engine: Any) -> None:
    engine = make_tiny_engine(kv_blocks=64, kv_lease_s=0.05)
    for i in range(3):
        _prefill(engine, engine.tokenizer.encode(PROMPTS[i]), f"l{i}")
    assert engine.num_leases == 3 and engine.block_manager.num_used_blocks > 0
    end_s = engine.next_lease_end_s
    assert end_s is not None and engine.expire_leases(end_s - 0.01) == 0
    assert engine.expire_leases(time.monotonic() + 0.06) == 3
    assert engine.num_leases == 0 and engine.block_manager.num_used_blocks == 0


def test_a_first_token_that_ends_the_request_holds_nothing(make_tiny_engine: Any) -> None:
    engine = make_tiny_engine(kv_blocks=64)
    delta = _prefill(engine, engine.tokenizer.encode(PROMPTS[0]), "one", SamplingParams(max_tokens=1, temperature=0))
    assert delta.finish_reason == "length" and delta.kv_handle is None
    assert engine.num_leases == 0 and engine.block_manager.num_used_blocks == 0


# ---- through the gateway: workers over NIXL ----------------------------------------------------------------

# through the gateway, prompts of 5, 49, 21 and 81 tokens: under one block of 16, and one to five whole
# blocks with a partial one after them (the pages' layout is what differs; more prompts repeat these cases)
GATEWAY_PROMPTS = [PROMPTS[0], PROMPTS[1], PROMPTS[6], PROMPTS[9]]
# A tiny random-weight Llama with the real model's vocabulary and its KV geometry (30 layers, 3 KV heads of 64,
# fp32: 737,280 bytes a block), so NIXL moves the bytes the real model's pages would; its embeddings untied, so
# its greedy tokens follow the context and a wrong page shows in them. Its workers start as the real model's do
# (the process, torch, Ray), and decode in a fraction of its time. A tiny Llama's pages cross hosts over
# NIXL and TCP in test_multihost.py.
TINY_LLAMA = {"hidden_size": 96, "num_hidden_layers": 30, "num_attention_heads": 3, "num_key_value_heads": 3,
              "head_dim": 64, "tie_word_embeddings": False}
PAIR = {"dtype": "float32", "device": "cpu", "kv_blocks": 256, "num_threads": 1, "namespace": "disagg-nixl",
        "transfer_ucx_tls": "cma,tcp,self", "transfer_ucx_net_devices": "lo"}


@pytest.fixture(scope="module")
@needs("fleet")
def pair(ray_instance: Any) -> Any:
    """A prefill worker and a decode worker of the tiny Llama (NIXL between them), in their own namespace, and
    an aggregated engine over the same model in this process: (handles, infos, engine)."""
    from _tiny_models import tiny_model

    from dynserve.engine.llm_engine import LLMEngine
    from dynserve.workers.worker import launch_worker

    settings = Settings(**PAIR, model=str(tiny_model("llama", **TINY_LLAMA)))
    launched = [launch_worker(settings, f"nixl-{role}", role, num_cpus=0.25, publish_events=True)  # type: ignore[arg-type]
                for role in ("prefill", "decode")]
    engine = LLMEngine(settings)
    infos = ray_instance.get([ref for _handle, ref in launched], timeout=300)
    yield [handle for handle, _ref in launched], infos, engine
    for handle, _ref in launched:
        ray_instance.kill(handle)


def _metric(url: str, name: str, label: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    match = re.search(rf'^{name}\{{[^}}]*"{label}"\}} (\S+)$', text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _wait_used_blocks(ray: Any, handle: Any, expected: int, timeout_s: float = 5.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (used := ray.get(handle.load.remote()).num_blocks_used) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return used


def test_disaggregated_greedy_outputs_equal_aggregated(pair: Any, make_gateway: Any, ray_instance: Any) -> None:
    (prefill_handle, decode_handle), infos, engine = pair
    assert infos[0].kv_agent is not None  # the prefill worker published its transfer agent
    server = make_gateway(infos=infos, namespace=PAIR["namespace"], disagg_local_prefill_tokens=0)
    assert 'dynserve_disagg_fallbacks_total{reason="transfer_error"} 0.0' in httpx.get(f"{server.url}/metrics").text
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = infos[0].model_id
    baseline = ray_instance.get(prefill_handle.load.remote()).num_blocks_used
    for i, text in enumerate(GATEWAY_PROMPTS):
        offline = engine.generate([text], GREEDY)[0]
        whole = client.completions.create(model=model, prompt=text, max_tokens=12, temperature=0)
        assert whole.choices[0].text == offline.text, text
        assert whole.usage.completion_tokens == len(offline.token_ids)
        assert _wait_used_blocks(ray_instance, prefill_handle, baseline) == baseline
        chunks = list(client.completions.create(model=model, prompt=text, max_tokens=12, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == offline.text, text
        assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
        if i == 0:  # the second run of a prompt finds its full blocks in the prefill worker's cache
            assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0
        assert _wait_used_blocks(ray_instance, prefill_handle, baseline) == baseline
    assert _wait_used_blocks(ray_instance, decode_handle, 0) == 0
    long_prompt = PROMPTS[1]
    answer = client.completions.create(model=model, prompt=long_prompt, max_tokens=4, temperature=0)
    assert answer.usage.prompt_tokens_details.cached_tokens >= 32  # cached on the prefill worker
    assert _metric(server.url, "dynserve_disagg_requests_total", "remote") == 2 * len(GATEWAY_PROMPTS) + 1
    for reason in ("transfer_error", "transfer_timeout", "prefill_failed", "no_blocks"):
        assert _metric(server.url, "dynserve_disagg_fallbacks_total", reason) == 0


# ---- through the gateway: mockers, for faults and leaks ----------------------------------------------------

MOCK = {"namespace": "disagg-mock", "kv_blocks": 512}
LONG_PROMPT = " ".join(f"word{i}" for i in range(600))


@pytest.fixture(scope="module")
def mock_prefill(make_mocker: Any) -> Any:
    return make_mocker("mp-0", role="prefill", mocker_speedup=50, **MOCK)


@pytest.mark.parametrize(("fault", "reason"), [("error", "transfer_error"), ("timeout", "transfer_timeout")])
def test_a_failed_transfer_costs_a_local_prefill_not_the_request(
        fault: str, reason: str, mock_prefill: Any, make_mocker: Any, make_gateway: Any, ray_instance: Any) -> None:
    handle, decode = make_mocker(f"md-{fault}", "decode", mocker_speedup=50, **MOCK, transfer_fault=fault,
                             transfer_timeout_s=0.3)
    try:
        server = make_gateway(infos=[mock_prefill[1], decode], namespace=MOCK["namespace"],
                              disagg_local_prefill_tokens=0)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        for stream in (False, True):
            answer = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                               stream=stream)
            chunks = list(answer) if stream else [answer]
            assert "".join(c.choices[0].text for c in chunks if c.choices)
        assert _metric(server.url, "dynserve_disagg_fallbacks_total", reason) == 2
        assert _wait_used_blocks(ray_instance, mock_prefill[0], 0) == 0
    finally:
        ray_instance.kill(handle)


def test_the_first_token_reaches_the_client_before_the_decode_worker_has_the_kv(
        mock_prefill: Any, make_mocker: Any, make_gateway: Any, ray_instance: Any) -> None:
    """The prefill worker's first token is streamed at once: a read that hangs for 1.5 s (and then falls back
    to a local prefill) delays the second token, not the first, and no token is sent twice."""
    handle, decode = make_mocker("md-slow-read", "decode", mocker_speedup=50, **MOCK, transfer_fault="timeout",
                                 transfer_timeout_s=1.5)
    try:
        server = make_gateway(infos=[mock_prefill[1], decode], namespace=MOCK["namespace"],
                              disagg_local_prefill_tokens=0)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        whole = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=8, temperature=0, logprobs=1)
        start = time.monotonic()
        arrivals, tokens = [], []
        for chunk in client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=8, temperature=0,
                                               logprobs=1, stream=True):
            if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.tokens:
                arrivals.append(time.monotonic() - start)
                tokens += chunk.choices[0].logprobs.tokens
        assert arrivals[0] < 1.0 < 1.4 < arrivals[1]
        assert tokens == whole.choices[0].logprobs.tokens and len(tokens) == 8
        assert _metric(server.url, "dynserve_disagg_fallbacks_total", "transfer_timeout") == 2
    finally:
        ray_instance.kill(handle)


def test_no_block_leaks_after_200_requests_with_random_cancellations(mock_prefill: Any, make_mocker: Any,
                                                                     make_gateway: Any, ray_instance: Any) -> None:
    handle, decode = make_mocker("md-leak", "decode", mocker_speedup=50, **MOCK)
    try:
        server = make_gateway(infos=[mock_prefill[1], decode], namespace=MOCK["namespace"],
                              disagg_local_prefill_tokens=0, disagg_max_prefill_queue=64)
        rng = random.Random(7)
        plans = [(rng.choice(PROMPTS) + f" #{i}", rng.choice([None, 0, 1, 3])) for i in range(200)]

        async def one(client: httpx.AsyncClient, prompt: str, cancel_after: int | None) -> bool:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0.7, "stream": True}
            async with client.stream("POST", f"{server.url}/v1/completions", json=body) as response:
                assert response.status_code == 200
                seen = 0
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        seen += 1
                        if cancel_after is not None and seen > cancel_after:
                            return False  # leaving the block closes the connection mid-stream
            return True

        async def run() -> list[bool]:
            limit = asyncio.Semaphore(16)
            async with httpx.AsyncClient(timeout=60) as client:
                async def bounded(prompt: str, cancel_after: int | None) -> bool:
                    async with limit:
                        return await one(client, prompt, cancel_after)

                return await asyncio.gather(*(bounded(p, c) for p, c in plans))

        finished = asyncio.run(run())
        assert 0 < sum(finished) < len(plans)
        assert _wait_used_blocks(ray_instance, mock_prefill[0], 0) == 0
        assert _wait_used_blocks(ray_instance, handle, 0) == 0
        assert _metric(server.url, "dynserve_disagg_requests_total", "remote") >= 100
    finally:
        ray_instance.kill(handle)
