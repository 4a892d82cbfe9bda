"""The gateway as a user meets it: the official `openai` client (and raw HTTP where the client hides the wire)
against a gateway started in the test, over a real Ray engine worker serving SmolLM2."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from typing import Any

import httpx
import openai
import pytest

from dynserve.protocol import SamplingParams

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def _sse_events(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE response, in order; checks the framing on the way."""
    events = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        events.append(line.removeprefix("data: "))
    return events


# ---- the answers ------------------------------------------------------------------------------------------


def test_greedy_chat_equals_the_engine_offline(client: openai.OpenAI, make_engine: Any, tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "You are terse."}, *QUESTION]
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0)
    engine = make_engine()
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages))
    offline = engine.generate([prompt], SamplingParams(max_tokens=32, temperature=0))[0]
    assert answer.choices[0].message.content == offline.text
    assert answer.choices[0].finish_reason == offline.finish_reason
    assert answer.usage.prompt_tokens == len(prompt)
    assert answer.usage.completion_tokens == len(offline.token_ids)
    assert answer.usage.total_tokens == len(prompt) + len(offline.token_ids)
    assert "Paris" in offline.text


def test_streamed_chat_equals_unstreamed_and_reports_usage(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert len({c.id for c in chunks}) == 1


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
    ))
    running = [c.usage.completion_tokens for c in chunks if c.choices]
    assert all(c.usage is not None for c in chunks if c.choices)
    assert running == sorted(running) and running[-1] == 10 and running[0] < 10
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}


def test_sse_wire_format_ends_with_done(gateway: Any) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(response)
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert all(p["object"] == "text_completion" for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in payloads[0]  # only with stream_options.include_usage


def test_completions_accept_text_token_ids_and_batches(client: openai.OpenAI, tokenizer: Any) -> None:
    text = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=8, temperature=0)
    ids = client.completions.create(model=MODEL, prompt=tokenizer.encode("The sky is"), max_tokens=8, temperature=0)
    assert text.choices[0].text == ids.choices[0].text and text.choices[0].text
    batch = client.completions.create(model=MODEL, prompt=["The sky is", "Water is"], max_tokens=8, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == text.choices[0].text
    assert batch.usage.prompt_tokens == len(tokenizer.encode("The sky is")) + len(tokenizer.encode("Water is"))
    streamed = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text


def test_n_choices_are_distinct_and_indexed(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=1.0, n=2,
                                            seed=7)
    assert [c.index for c in answer.choices] == [0, 1]
    assert answer.choices[0].message.content != answer.choices[1].message.content
    single = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
    assert answer.usage.prompt_tokens == single.usage.prompt_tokens  # counted once, not per choice
    assert 2 <= answer.usage.completion_tokens <= 32
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=1.0,
                                                 n=2, seed=7, stream=True))
    for index in (0, 1):
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks
                           if c.choices and c.choices[0].index == index)
        assert streamed == answer.choices[index].message.content  # seeded: same text streamed or not


def test_seed_reproduces_and_differs(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        answer = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=1.0,
                                                top_p=0.95, seed=seed)
        return answer.choices[0].message.content or ""

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_stop_strings_cut_the_answer(client: openai.OpenAI) -> None:
    free = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    text = free.choices[0].message.content or ""
    assert "Paris" in text
    stopped = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0,
                                             stop=["Paris"])
    assert stopped.choices[0].message.content == text.split("Paris")[0]
    assert stopped.choices[0].finish_reason == "stop"


def test_chat_logprobs(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    assert "".join(e.token for e in content).startswith(answer.choices[0].message.content[:3])


def test_completion_logprobs(client: openai.OpenAI) -> None:
    answer = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=4, temperature=0, logprobs=2)
    logprobs = answer.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    assert "".join(logprobs.tokens) == answer.choices[0].text
    assert logprobs.text_offset[0] == 0


def test_cached_tokens_reported_for_a_shared_prefix(client: openai.OpenAI, worker: Any) -> None:
    import ray

    system = "You are a helpful assistant who answers in detail. " * 30  # ~300 tokens
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Say hi."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 16 and cached > 256
    ray.get(worker[0].reset_prefix_cache.remote())
    cold = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0


# ---- errors a client sees ---------------------------------------------------------------------------------


def test_bad_parameters_are_400s_that_name_them(client: openai.OpenAI) -> None:
    cases = [
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
         "response_format.json_schema.schema"),
        ({"temperature": 3.5}, "temperature"),
        ({"n": 0}, "n"),
        ({"extra_body": {"frobnicate": True}}, "frobnicate"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, **kwargs)
        assert param in info.value.message
        assert info.value.body["param"] == param or param == "frobnicate"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}])
    assert info.value.body["param"] == "messages[0].content[0]"


def test_context_length_exceeded(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=10_000)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hello " * 9000, max_tokens=4)
    assert info.value.code == "context_length_exceeded"


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-7", messages=QUESTION, max_tokens=4)
    assert info.value.code == "model_not_found"


@pytest.mark.parametrize("body", [b"{not json", b"[]", b"", b'{"model": "SmolLM2-135M-Instruct"}',
                                  b'{"model": 5, "messages": "hi"}', b"\xff\xfe\x00"])
def test_malformed_bodies_are_400_never_500(gateway: Any, body: bytes) -> None:
    response = httpx.post(f"{gateway.url}/v1/chat/completions", content=body,
                          headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"


def test_body_too_large_is_413(make_gateway: Any, worker: Any) -> None:  # (over the session's worker)
    small = make_gateway(max_body_bytes=4096)
    response = httpx.post(f"{small.url}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "x" * 10_000, "max_tokens": 1})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_api_key_is_enforced(make_gateway: Any, worker: Any) -> None:  # (over the session's worker)
    locked = make_gateway(api_key="s3cret")
    for key in ("wrong", ""):
        bad = openai.OpenAI(base_url=f"{locked.url}/v1", api_key=key or "x", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    assert httpx.get(f"{locked.url}/v1/models", timeout=10).status_code == 401
    good = openai.OpenAI(base_url=f"{locked.url}/v1", api_key="s3cret", max_retries=0)
    assert good.models.list().data[0].id == MODEL
    assert httpx.get(f"{locked.url}/health", timeout=10).status_code == 200  # ops routes stay open


def test_full_queue_is_429_with_retry_after(make_gateway: Any, worker: Any) -> None:  # (over the session's worker)
    tight = make_gateway(max_queue=1)
    client = openai.OpenAI(base_url=f"{tight.url}/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=64, temperature=0,
                                            stream=True)
    next(iter(stream))  # the first request is in flight
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4)
    assert info.value.response.headers["retry-after"] == "1"
    stream.close()
    deadline = time.monotonic() + 5
    while True:  # the slot frees as soon as the first stream is closed
        try:
            client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_not_ready_is_503(make_gateway: Any, worker: Any) -> None:
    import msgspec

    unreachable = msgspec.structs.replace(worker[1], worker_id="gone", port=1)
    orphan = make_gateway(infos=[unreachable])
    assert httpx.get(f"{orphan.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{orphan.url}/ready", timeout=10).status_code == 503
    client = openai.OpenAI(base_url=f"{orphan.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
    assert info.value.status_code == 503


def test_a_dead_worker_costs_a_retry_not_the_request(make_gateway: Any, worker: Any) -> None:
    import msgspec

    dead = msgspec.structs.replace(worker[1], worker_id="dead", port=1)
    both = make_gateway(infos=[dead, worker[1]])
    client = openai.OpenAI(base_url=f"{both.url}/v1", api_key="x", max_retries=0)
    for _ in range(3):
        answer = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, temperature=0)
        assert answer.choices[0].message.content


# ---- load and lifecycle -----------------------------------------------------------------------------------


def _blocks_used(worker: Any) -> int:
    import ray

    return ray.get(worker[0].load.remote()).num_blocks_used


def test_disconnect_frees_the_workers_blocks_within_1s(gateway: Any, worker: Any) -> None:
    baseline = _blocks_used(worker)
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 500, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        # One iterator, held: a `for` over `iter_lines()` left with `break` is finalized at once, and httpx
        # then closes the connection, so the client would already be gone while this checks that it is served.
        lines = response.iter_lines()
        num_pieces = 0
        while num_pieces < 3:
            line = next(lines)
            num_pieces += line.startswith("data: ") and '"content":"' in line and '"content":""' not in line
        time.sleep(0.5)  # connected but not reading: the request goes on and holds its blocks
        assert _blocks_used(worker) > baseline
        assert [c.num_open_streams for c in gateway.app.state.backend.directory.channels.values()] == [1]
    dropped_s = time.monotonic()  # the response is closed: the client is gone
    while _blocks_used(worker) != baseline:
        assert time.monotonic() - dropped_s < 1.0, "blocks still held 1 s after the client left"
        time.sleep(0.02)


def test_50_concurrent_streams_all_complete(gateway: Any) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, int]:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Give me a fact about the number {i}."}],
            max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True},
        )
        text, finish, roles, usage = [], [], 0, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                roles += choice.delta.role == "assistant"
                text.append(choice.delta.content or "")
                if choice.finish_reason:
                    finish.append(choice.finish_reason)
        assert roles == 1 and len(finish) == 1 and usage is not None
        return "".join(text), finish[0], usage.completion_tokens

    async def run() -> list[tuple[str, str | None, int]]:
        async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0,
                                      timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(50)))

    results = asyncio.run(run())
    assert len(results) == 50
    assert all(text and finish in ("stop", "length") and 1 <= n <= 12 for text, finish, n in results)


def test_models_health_ready_openapi_metrics(gateway: Any, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(f"{gateway.url}/health", timeout=10).json() == {"status": "ok"}
    assert httpx.get(f"{gateway.url}/ready", timeout=10).json()["workers"] == ["w0"]
    paths = httpx.get(f"{gateway.url}/openapi.json", timeout=10).json()["paths"]
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(paths)
    client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3, temperature=0, stream=True)
    text = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    for name in ('dynserve_requests_total{endpoint="chat/completions",status="200"}',
                 "dynserve_time_to_first_token_seconds_count", "dynserve_inter_token_latency_seconds_count",
                 "dynserve_request_duration_seconds_count", 'dynserve_request_prompt_tokens_count{endpoint="chat/co',
                 f'dynserve_request_generation_tokens_sum{{endpoint="chat/completions",model="{MODEL}"}}',
                 f'dynserve_generated_tokens_total{{model="{MODEL}"}}', "dynserve_cached_prompt_tokens_total",
                 "dynserve_inflight_requests", 'dynserve_gateway_worker_up{role="both",worker_id="w0"} 1.0'):
        assert name in text, name
    assert "dynserve_worker_kv" not in text  # a worker's own state is on the worker's port, not mirrored here


# ---- every stream is its own ------------------------------------------------------------------------------

def _own_stream_check(url: str, seed: int, stop_after: int | None) -> list[str]:
    """One seeded chat stream of QUESTION, read raw: its first event is the role chunk, every chunk carries
    the same id, and the text pieces, in order. With `stop_after`, the client leaves after that many pieces."""
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 12, "temperature": 1.0, "seed": seed,
            "ignore_eos": True, "stream": True}
    pieces: list[str] = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        ids = set()
        for n, line in enumerate(line for line in response.iter_lines() if line):
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            ids.add(chunk["id"])
            delta = chunk["choices"][0]["delta"]
            if n == 0:
                assert delta == {"role": "assistant", "content": ""}, f"seed {seed}: the stream began with {line}"
                continue
            assert "role" not in delta, f"seed {seed}: a second role chunk {line}"
            if delta.get("content"):
                pieces.append(delta["content"])
            if stop_after is not None and len(pieces) >= stop_after:
                break
        assert len(ids) == 1, f"seed {seed}: chunks of several responses {ids}"
    return pieces


def test_concurrent_identical_streams_each_get_their_own_answer_from_the_first_chunk(gateway: Any) -> None:
    """Many streams of one prompt at once, seeded apart so each answer is its own; some clients leave early
    and ask again at once. Every stream must begin with its role chunk and read exactly its own answer's text
    (the text its seed gives unstreamed) from the first piece on; nothing of another request may arrive.
    (The disconnect test's old flake looked like a stream of another request; it was its own client leaving
    early, see that test.)"""
    seeds = list(range(100, 108))

    def unstreamed(seed: int) -> str:
        answer = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": QUESTION, "max_tokens": 12, "temperature": 1.0, "seed": seed,
            "ignore_eos": True}).json()
        return answer["choices"][0]["message"]["content"]

    # the expected answers asked all at once, so decoded in one batch (a seed's sample does not depend on
    # what shares its batch: tests/test_engine.py); answers crossed between them would not match the streams
    # below, and answers not told apart by their seeds fail the count
    with concurrent.futures.ThreadPoolExecutor(len(seeds)) as pool:
        expected = dict(zip(seeds, pool.map(unstreamed, seeds), strict=True))
    assert len(set(expected.values())) > len(seeds) // 2  # the seeds do tell the answers apart

    def client(seed: int) -> None:
        for round_ in range(3):  # leave after a few pieces, come back at once; the last round reads to the end
            stop_after = None if round_ == 2 else 1 + (seed + round_) % 3
            text = "".join(_own_stream_check(gateway.url, seed, stop_after))
            assert expected[seed].startswith(text) if stop_after else text == expected[seed], (seed, text)

    with concurrent.futures.ThreadPoolExecutor(len(seeds)) as pool:
        for done in [pool.submit(client, seed) for seed in seeds]:
            done.result()
