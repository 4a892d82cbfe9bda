"""The mocker as its users meet it: simulated workers that batch, cache prefixes, publish KV events and take
their profile's time like real ones, without torch; behind our gateway and router, standalone for other
routers, and from `dynctl serve --mocker`."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import replay_event_plane, stop_by_sigint, wait_for_line

from dynserve.config import Settings
from dynserve.model.resolve import default_model_path
from dynserve.model.tokenizer import Tokenizer
from dynserve.protocol import SamplingParams
from dynserve.workers.mocker import MockEngine, step_work
from dynserve.workers.mocker_profiles import CPU, MockerProfile, StepWork

MODEL = "SmolLM2-135M-Instruct"
SPEEDUP = 10.0
REPO = Path(__file__).resolve().parent.parent
SYSTEM = "You are the mocker test's assistant; you answer briefly and never cite anything at all. " * 12


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load(default_model_path())


def _profile(**overrides: float) -> MockerProfile:
    values: dict[str, Any] = {
        "prefill_fixed_ms": 20.0, "prefill_ms_per_token": 0.05, "prefill_ms_per_token_context": 0.0,
        "decode_fixed_ms": 40.0, "decode_ms_per_seq": 2.0, "decode_ms_per_context_token": 0.001}
    return dataclasses.replace(CPU, **{**values, "name": "test", **overrides})


def _engine(tokenizer: Tokenizer, profile: MockerProfile | None = None, **settings: Any) -> MockEngine:
    return MockEngine(Settings(**{"mocker": "cpu", "kv_blocks": 256, **settings}), tokenizer, profile or _profile())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- the engine: same contract as the real one, pseudo-random tokens, profiled time ---------------------


def test_importing_the_mocker_loads_no_torch() -> None:
    code = "import dynserve.workers.mocker, sys; assert 'torch' not in sys.modules, 'torch was imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)
    assert done.returncode == 0, done.stderr


def test_answers_respect_max_tokens_stop_ids_and_seeds(tokenizer: Tokenizer) -> None:
    engine = _engine(tokenizer, _profile(prefill_fixed_ms=0, prefill_ms_per_token=0, decode_fixed_ms=0,
                                         decode_ms_per_seq=0, decode_ms_per_context_token=0))
    prompt = tokenizer.encode("Tell me about the sea.")
    greedy = SamplingParams(max_tokens=12, temperature=0)
    first, again = engine.generate([prompt, prompt], greedy)
    assert first.token_ids == again.token_ids and len(first.token_ids) == 12 and first.finish_reason == "length"
    assert first.text == tokenizer.decode(first.token_ids)
    assert tokenizer.encode(first.text) == first.token_ids  # a resent answer hits the prefix cache
    assert not set(first.token_ids) & (tokenizer.special_token_ids | {tokenizer.eos_token_id})
    stop_id = first.token_ids[4]
    (stopped,) = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop_id,)))
    assert stopped.token_ids == first.token_ids[:5] and stopped.finish_reason == "stop"
    seeded = [SamplingParams(max_tokens=8, seed=s) for s in (1, 1, 2)]
    one, same, other = engine.generate([prompt] * 3, seeded)
    assert one.token_ids == same.token_ids != other.token_ids
    (with_logprobs,) = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0, logprobs=2))
    for token_id, logprob in zip(with_logprobs.token_ids, with_logprobs.logprobs, strict=True):
        assert logprob.token_id == token_id and logprob.logprob < 0
        assert logprob.top[0] == (token_id, logprob.logprob)
        assert len(logprob.top) == 2 and logprob.top[1][1] < logprob.logprob
    engine.block_manager.check_integrity()


def test_step_time_follows_the_profile_and_the_speedup(tokenizer: Tokenizer) -> None:
    profile = _profile()
    prompts = [tokenizer.encode(f"Question {i}: " + "why is the sky blue? " * 30) for i in range(4)]
    assert sum(map(len, prompts)) <= CPU.max_num_batched_tokens  # one prefill step
    params = SamplingParams(max_tokens=6, temperature=0)
    # one prefill step of the 4 prompts, then 5 decode steps of 4 sequences
    prefill = StepWork(num_prefill_tokens=sum(map(len, prompts)))
    decodes = [StepWork(num_decode_seqs=4, num_decode_context_tokens=sum(len(p) + i for p in prompts))
               for i in range(1, 6)]
    expected_s = (profile.step_time_ms(prefill) + sum(map(profile.step_time_ms, decodes))) / 1e3
    for speedup in (1.0, 4.0):
        engine = _engine(tokenizer, profile, mocker_speedup=speedup)
        start, waited_before_s = time.monotonic(), _runqueue_wait_s()
        results = engine.generate(prompts, params)
        elapsed_s, waited_s = time.monotonic() - start, _runqueue_wait_s() - waited_before_s
        assert [len(r.token_ids) for r in results] == [6] * 4 and engine.stats.num_steps == 6
        assert engine.simulated_busy_s == pytest.approx(expected_s / speedup, rel=1e-6)
        # at most half as long again, plus the time this thread was kept from a busy machine's CPUs (a clean
        # clone's run took 0.205 s over a 0.075 s answer while the other test worker ran)
        assert expected_s / speedup * 0.95 <= elapsed_s <= expected_s / speedup * 1.5 + 0.05 + waited_s, \
            (speedup, elapsed_s, waited_s)


def _runqueue_wait_s() -> float:
    """Seconds this thread has spent runnable but waiting for a CPU (the scheduler's count, Linux)."""
    with open("/proc/thread-self/schedstat") as stats:
        return int(stats.read().split()[1]) / 1e9


class _ListSink:
    """Collects a request's deltas and errors, and the threads they were delivered on."""

    thread_safe = False

    def __init__(self) -> None:
        self.deltas: list[Any] = []
        self.errors: list[Any] = []
        self.threads: set[int] = set()
        self.done = asyncio.Event()
        self.num_deliveries = 0

    def deliver(self, deltas: list[Any]) -> None:
        self.threads.add(threading.get_ident())
        self.deltas += deltas
        self.num_deliveries += 1
        if any(d.finished for d in deltas):
            self._end()

    def fail(self, error: Any) -> None:
        self.threads.add(threading.get_ident())
        self.errors.append(error)
        self._end()

    def _end(self) -> None:
        self.done.set()


def test_in_a_worker_the_mocker_steps_on_the_event_loop_at_the_profiles_pace(tokenizer: Tokenizer) -> None:
    """The worker's driver for a mocker (`InlineEngineLoop`): no thread, steps paced by the loop's timer
    from `next_step_s`, the same tokens and modelled time as the sleeping offline engine."""
    from dynserve.protocol import GenerateRequest
    from dynserve.workers.inline_loop import InlineEngineLoop

    profile = _profile()
    prompts = [tokenizer.encode(f"Question {i}: " + "why is the sky blue? " * 30) for i in range(4)]
    params = SamplingParams(max_tokens=6, temperature=0)
    offline = _engine(tokenizer, profile).generate(prompts, params)
    engine = MockEngine(Settings(mocker="cpu", kv_blocks=256), tokenizer, profile, sleep=False)

    async def serve() -> tuple[float, list[_ListSink]]:
        driver = InlineEngineLoop(lambda: engine)
        assert driver.start() is engine
        driver.attach(asyncio.get_running_loop())
        threads_before = threading.active_count()
        sinks = [_ListSink() for _ in prompts]
        start = time.monotonic()
        for i, (prompt, sink) in enumerate(zip(prompts, sinks, strict=True)):
            driver.submit(GenerateRequest(request_id=f"r{i}", token_ids=prompt, params=params), sink)
        await asyncio.wait_for(asyncio.gather(*(sink.done.wait() for sink in sinks)), 10)
        elapsed_s = time.monotonic() - start
        assert threading.active_count() == threads_before and driver.num_open_requests == 0
        assert [t.request_id for t in driver.recent_timings()] == ["r0", "r1", "r2", "r3"]
        await asyncio.to_thread(driver.stop)  # from another thread, as the worker stops it
        assert not driver.is_alive
        return elapsed_s, sinks

    elapsed_s, sinks = asyncio.run(serve())
    for sink, result in zip(sinks, offline, strict=True):
        assert not sink.errors and sink.threads == {threading.get_ident()}  # delivered on the loop's thread
        assert [t for d in sink.deltas for t in d.token_ids] == result.token_ids
    assert engine.stats.num_steps == 6
    modelled_s = engine.simulated_busy_s  # one prefill step of the 4 prompts, then 5 decode steps
    assert modelled_s > 0.2
    assert modelled_s * 0.95 <= elapsed_s <= modelled_s * 1.5 + 0.05, (modelled_s, elapsed_s)


def test_the_inline_loop_sends_a_fast_engines_tokens_together_and_a_slow_ones_step_by_step(
        tokenizer: Tokenizer) -> None:
    """Steps far under a millisecond (a mocker at a high speedup): the tokens of several steps go out in one
    delivery, all of them, in order, the last at once. Steps of a few ms: each step's tokens alone."""
    from dynserve.protocol import GenerateRequest
    from dynserve.workers.inline_loop import InlineEngineLoop

    prompt = tokenizer.encode("Tell me a story.")
    params = SamplingParams(max_tokens=300, temperature=0)

    async def serve(speedup: float) -> tuple[_ListSink, MockEngine]:
        settings = Settings(mocker="cpu", kv_blocks=256, mocker_speedup=speedup)
        engine = MockEngine(settings, tokenizer, _profile(), sleep=False)
        driver = InlineEngineLoop(lambda: engine)
        driver.start()
        driver.attach(asyncio.get_running_loop())
        sink = _ListSink()
        driver.submit(GenerateRequest(request_id="r", token_ids=prompt, params=params), sink)
        await asyncio.wait_for(sink.done.wait(), 30)
        assert driver.num_open_requests == 0
        driver.stop()
        return sink, engine

    reference = _engine(tokenizer, mocker_speedup=1e6).generate([prompt], params)[0].token_ids
    for speedup in (1e6, 10.0):  # a decode step of about 40 us of Python (the modelled 0.04 us), then 4 ms
        sink, engine = asyncio.run(serve(speedup))
        assert not sink.errors and [t for d in sink.deltas for t in d.token_ids] == reference
        assert sink.deltas[-1].finished and engine.stats.num_steps == 300
        if speedup > 1e3:
            assert sink.num_deliveries <= engine.stats.num_steps // 4, sink.num_deliveries
        else:
            assert sink.num_deliveries == engine.stats.num_steps


class _ThreadSafeListSink(_ListSink):
    """A `_ListSink` that takes deltas on any thread, as a worker's connection does: its end is a thread's
    event (`finished`), not the loop's."""

    thread_safe = True

    def __init__(self) -> None:
        super().__init__()
        self.finished = threading.Event()

    def _end(self) -> None:
        self.finished.set()


def test_the_threaded_loop_hands_a_thread_safe_sinks_tokens_over_on_the_engine_thread(
        tokenizer: Tokenizer) -> None:
    """`EngineLoop` (the real model's driver, here stepping a sleeping mocker): a sink that says it is
    thread-safe (a worker's connection) takes each step's tokens on the engine's thread, without waiting for
    the event loop to wake; any other sink on the loop's thread. The same tokens either way."""
    from dynserve.protocol import GenerateRequest
    from dynserve.workers.engine_loop import EngineLoop

    prompt = tokenizer.encode("Tell me a story.")
    params = SamplingParams(max_tokens=20, temperature=0)
    settings = Settings(mocker="cpu", kv_blocks=256, mocker_speedup=100.0)

    async def serve() -> tuple[_ListSink, _ThreadSafeListSink, int | None]:
        driver = EngineLoop(lambda: MockEngine(settings, tokenizer, _profile(), sleep=True), name="engine-t")
        driver.start()
        driver.attach(asyncio.get_running_loop())
        on_loop, direct = _ListSink(), _ThreadSafeListSink()
        driver.submit(GenerateRequest(request_id="a", token_ids=prompt, params=params), on_loop)
        driver.submit(GenerateRequest(request_id="b", token_ids=prompt, params=params), direct)
        await asyncio.wait_for(on_loop.done.wait(), 30)
        assert await asyncio.to_thread(direct.finished.wait, 30)
        engine_thread = driver._thread.ident
        await asyncio.to_thread(driver.stop)
        return on_loop, direct, engine_thread

    on_loop, direct, engine_thread = asyncio.run(serve())
    assert not on_loop.errors and on_loop.threads == {threading.get_ident()}
    assert not direct.errors and direct.threads == {engine_thread} != on_loop.threads
    tokens = [[t for d in sink.deltas for t in d.token_ids] for sink in (on_loop, direct)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 20


def test_stopping_the_inline_loop_fails_what_is_open_and_refuses_work(tokenizer: Tokenizer) -> None:
    from dynserve.protocol import GenerateRequest
    from dynserve.workers.inline_loop import InlineEngineLoop

    engine = MockEngine(Settings(mocker="cpu", kv_blocks=256), tokenizer, _profile(), sleep=False)
    prompt = tokenizer.encode("Tell me a story.")

    async def serve() -> tuple[_ListSink, _ListSink]:
        driver = InlineEngineLoop(lambda: engine)
        driver.start()
        driver.attach(asyncio.get_running_loop())
        sink, late = _ListSink(), _ListSink()
        driver.submit(GenerateRequest(request_id="long", token_ids=prompt,
                                      params=SamplingParams(max_tokens=500, temperature=0)), sink)
        while not sink.deltas:
            await asyncio.sleep(0.01)
        # a call from another thread runs between steps, on the loop
        num_open = await asyncio.to_thread(lambda: driver.call(lambda e: e.num_unfinished_requests).result(5))
        assert num_open == 1
        await asyncio.to_thread(driver.stop)
        assert not driver.is_alive and driver.num_open_requests == 0
        driver.submit(GenerateRequest(request_id="late", token_ids=prompt, params=SamplingParams()), late)
        with pytest.raises(RuntimeError, match="stopped"):
            driver.call(lambda e: None).result(1)
        return sink, late

    sink, late = asyncio.run(asyncio.wait_for(serve(), 30))
    assert len(sink.errors) == 1 and sink.errors[0].retryable and sink.errors[0].request_id == "long"
    assert not any(d.finished for d in sink.deltas)
    assert len(late.errors) == 1 and late.errors[0].retryable and not late.deltas


def test_the_inline_loop_reads_a_remote_prefill_that_comes_during_the_last_step(tokenizer: Tokenizer) -> None:
    """A decode worker's driver: a remotely prefilled request that arrives while the only other request
    takes its last step still gets its KV read and its answer (no wake-up is lost when the driver goes idle);
    a prefix-cache reset's KV event goes out at once though nothing steps."""
    from dynserve.protocol import AllBlocksCleared, GenerateRequest, RemotePrefill
    from dynserve.workers.inline_loop import InlineEngineLoop

    settings = Settings(mocker="cpu", kv_blocks=256)
    prefill, whole = _engine(tokenizer, kv_blocks=256), _engine(tokenizer, kv_blocks=256)
    decode = MockEngine(settings, tokenizer, _profile(), sleep=False)
    prefill.kv_source_id = "p"
    greedy = SamplingParams(max_tokens=4, temperature=0)
    prompt = tokenizer.encode("Why is the sea salty? " * 12)
    reference = whole.generate([prompt], greedy)[0].token_ids
    prefill.add_request(prompt, greedy, "remote", prefill_only=True)
    while not (prefilled := prefill.step()):
        pass
    handle = prefilled[0].kv_handle
    assert handle is not None
    remote = RemotePrefill(handle=handle, first_token_id=prefilled[0].token_ids[0],
                           num_cached_tokens=prefilled[0].num_cached_tokens)
    reads: list[Any] = []
    events: list[Any] = []

    async def serve() -> _ListSink:
        driver = InlineEngineLoop(lambda: decode, kv_reader=reads.append, on_kv_events=events.extend)
        driver.start()
        driver.attach(asyncio.get_running_loop())
        local, sink = _ListSink(), _ListSink()
        driver.submit(GenerateRequest(request_id="local", token_ids=tokenizer.encode("Hello there."),
                                      params=SamplingParams(max_tokens=2, temperature=0)), local)
        while not local.deltas:  # its prefill step delivered: the decode step, its last, is under way
            await asyncio.sleep(0.001)
        assert not local.done.is_set()
        driver.submit(GenerateRequest(request_id="remote", token_ids=prompt, params=greedy,
                                      remote_prefill=remote), sink)
        await asyncio.wait_for(sink.done.wait(), 5)
        events.clear()
        driver.call(lambda e: e.reset_prefix_cache()).result(0)
        assert [type(e) for e in events] == [AllBlocksCleared]
        driver.stop()
        return sink

    sink = asyncio.run(asyncio.wait_for(serve(), 30))
    assert len(reads) == 1 and reads[0].request_id == "remote" and reads[0].source_worker_id == "p"
    assert not sink.errors and [t for d in sink.deltas for t in d.token_ids] == reference
    assert sink.deltas[0].kv_fallback is None


@pytest.mark.parametrize("driver_kind", ["inline", "thread"])
def test_a_step_that_can_schedule_nothing_waits_for_a_release_instead_of_spinning(
        tokenizer: Tokenizer, driver_kind: str) -> None:
    """A prefill held under lease takes 7 of the 8 blocks; a prompt needing 4 cannot start. The driver waits
    (one empty step, not thousands) until the release frees them, then the prompt runs."""
    from dynserve.protocol import GenerateRequest
    from dynserve.workers.engine_loop import EngineLoop
    from dynserve.workers.inline_loop import InlineEngineLoop

    engine = MockEngine(Settings(mocker="cpu", kv_blocks=8, mocker_speedup=100.0), tokenizer, _profile(),
                        sleep=driver_kind == "thread")
    steps = {"n": 0}
    real_step = engine.step

    def counted_step() -> list[Any]:
        steps["n"] += 1
        return real_step()

    engine.step = counted_step  # type: ignore[method-assign]
    held_prompt = list(range(1000, 1100))  # 100 tokens: 7 blocks of 16
    waiting_prompt = list(range(2000, 2060))  # 60 tokens: 4 blocks

    async def serve() -> tuple[int, _ListSink]:
        driver: Any = (InlineEngineLoop if driver_kind == "inline" else EngineLoop)(lambda: engine)
        driver.start()
        driver.attach(asyncio.get_running_loop())
        held, waiting = _ListSink(), _ListSink()
        greedy = SamplingParams(max_tokens=3, temperature=0)
        driver.submit(GenerateRequest(request_id="held", token_ids=held_prompt, params=greedy,
                                      prefill_only=True), held)
        await asyncio.wait_for(held.done.wait(), 5)
        assert held.deltas[-1].finish_reason == "prefilled" and engine.num_leases == 1
        driver.submit(GenerateRequest(request_id="waiting", token_ids=waiting_prompt, params=greedy), waiting)
        await asyncio.sleep(0.1)
        steps_before = steps["n"]
        await asyncio.sleep(0.3)
        stalled_steps = steps["n"] - steps_before
        assert not waiting.deltas and engine.stalled
        driver.release("held")
        await asyncio.wait_for(waiting.done.wait(), 5)
        await asyncio.to_thread(driver.stop)
        return stalled_steps, waiting

    stalled_steps, waiting = asyncio.run(asyncio.wait_for(serve(), 30))
    assert stalled_steps == 0
    assert not waiting.errors and sum(len(d.token_ids) for d in waiting.deltas) == 3
    assert engine.block_manager.num_used_blocks == 0


def test_step_work_counts_uncached_prefill_and_decode_context(tokenizer: Tokenizer) -> None:
    engine = _engine(tokenizer, max_num_batched_tokens=64)
    prompt = list(range(1000, 1100))  # 100 tokens: a 64-token chunk, then 36 tokens
    engine.add_request(prompt, SamplingParams(max_tokens=3, temperature=0))
    batch = engine.scheduler.schedule()
    assert step_work(batch) == StepWork(num_prefill_tokens=64, num_prefill_attention_pairs=64 * 65 // 2)
    engine.scheduler.complete_step(batch)
    batch = engine.scheduler.schedule()
    assert step_work(batch) == StepWork(num_prefill_tokens=36, num_prefill_attention_pairs=36 * 64 + 36 * 37 // 2)


# ---- mocker actors behind the gateway and the KV router ------------------------------------------------


@pytest.fixture(scope="module")
def mockers(make_mocker: Any) -> list[tuple[Any, Any]]:
    return [make_mocker(worker_id, mocker_speedup=SPEEDUP) for worker_id in ("m0", "m1")]


@pytest.fixture(scope="module")
def mocker_gateway(mockers: list[tuple[Any, Any]], tokenizer: Tokenizer) -> Iterator[Any]:
    from dynserve.gateway.server import GatewayServer, make_gateway_app

    settings = Settings(port=0, router="kv")
    with GatewayServer(make_gateway_app(settings, [info for _, info in mockers], tokenizer), settings) as server:
        yield server


def test_a_mocker_actor_imports_no_torch_and_reserves_a_hundredth_of_a_cpu(mockers: Any) -> None:
    import ray

    def inside(_worker: Any) -> tuple[bool, dict[str, float]]:
        import sys as actor_sys

        return "torch" in actor_sys.modules, ray.get_runtime_context().get_assigned_resources()

    has_torch, resources = ray.get(mockers[0][0].__ray_call__.remote(inside), timeout=30)
    assert not has_torch and resources == {"CPU": 0.01}


def test_usage_cached_tokens_and_latency_through_the_kv_router(mocker_gateway: Any, tokenizer: Tokenizer) -> None:
    client = openai.OpenAI(base_url=f"{mocker_gateway.url}/v1", api_key="unused", max_retries=0, timeout=60)
    answers = []
    for question in ("What is a cache?", "What is a router?", "What is a router?"):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        start = time.monotonic()
        answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
        answers.append((answer, time.monotonic() - start, messages))
        time.sleep(0.3)  # the router's index learns of the cached blocks from the workers' KV events
    for answer, _, messages in answers:
        assert answer.usage.prompt_tokens == len(tokenizer.encode(tokenizer.apply_chat_template(messages)))
        assert answer.usage.completion_tokens == 16 and answer.choices[0].finish_reason == "length"
    cached = [a.usage.prompt_tokens_details.cached_tokens for a, _, _ in answers]
    system_only = tokenizer.apply_chat_template(answers[0][2][:1], add_generation_prompt=False)
    num_system = len(tokenizer.encode(system_only))
    num_repeated = answers[2][0].usage.prompt_tokens
    # the router sent the shared prefix back to the worker that holds it: every full block of it is a hit
    # (all but the last token of a repeated prompt, whose logits must be computed)
    assert cached == [0, cached[1], (num_repeated - 1) // 16 * 16] and cached[1] >= num_system // 16 * 16
    num_prompt = answers[0][0].usage.prompt_tokens
    assert answers[1][0].choices[0].message.content == answers[2][0].choices[0].message.content  # greedy
    # the first request ran alone on an idle mocker: its latency is the profile's prefill and 15 decodes
    expected_s = (CPU.step_time_ms(StepWork(num_prefill_tokens=num_prompt, num_prefill_attention_pairs=num_prompt
                                            * (num_prompt + 1) // 2))
                  + sum(CPU.step_time_ms(StepWork(num_decode_seqs=1, num_decode_context_tokens=num_prompt + i))
                        for i in range(1, 16))) / 1e3 / SPEEDUP
    assert expected_s * 0.95 <= answers[0][1] <= expected_s * 2 + 1.0, (answers[0][1], expected_s)


def test_kv_events_replay_to_each_mockers_snapshot(mockers: Any, tokenizer: Tokenizer) -> None:
    """Each mocker's KV events on the embedded plane, replayed, rebuild exactly its snapshot (as a router
    resyncing from them would), and each mocker is in the registry."""
    import ray

    from dynserve.protocol import GenerateRequest
    from dynserve.workers.channel import WorkerConnection

    async def fill(info: Any) -> None:  # a prompt of 8+ blocks straight to each mocker, over its channel
        connection = WorkerConnection(info)
        await connection.connect()
        request = GenerateRequest(request_id=f"fill-{info.worker_id}", token_ids=tokenizer.encode(
            f"{info.worker_id}: {SYSTEM}"), params=SamplingParams(max_tokens=2))
        assert [d async for d in connection.generate(request)][-1].finished
        await connection.close()

    for _, info in mockers:
        asyncio.run(fill(info))
    deadline = time.monotonic() + 10
    while True:
        snapshots = {info.worker_id: ray.get(handle.kv_snapshot.remote()) for handle, info in mockers}
        index, registered = asyncio.run(replay_event_plane())
        if all(index.last_event_id(wid) == last for wid, (_, last) in snapshots.items()):
            break
        assert time.monotonic() < deadline, "published events did not catch up with the snapshots"
    for worker_id, (hashes, _) in snapshots.items():
        assert index.worker_blocks(worker_id) == set(hashes) and len(hashes) >= 8
    assert {"m0", "m1"} <= set(registered)


# ---- processes: the standalone server and `dynctl serve --mocker` ----------------------------------------


def _check_sglang_router_bodies(url: str) -> None:
    """sglang-router 0.3.2 (cache_aware) forwards requests with SGLang's extension fields at their defaults
    (bodies captured from it); they are served, and a value dynserve does not implement is a 400 naming it."""
    sglang = {"no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True, "return_hidden_states": False}
    chat = {"messages": [{"role": "user", "content": "Hi"}], "model": MODEL, "logprobs": False,
            "max_completion_tokens": 5, "stream": False, "continue_final_message": False,
            "separate_reasoning": True, "stream_reasoning": True, **sglang}
    completion = {"model": MODEL, "prompt": "Hello there", "max_tokens": 5, "stream": False, "echo": False, **sglang}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
        answer = httpx.post(url + path, json=body, timeout=30)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 5, answer.text
    refused = httpx.post(url + "/v1/completions", json={**completion, "return_hidden_states": True}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "return_hidden_states"


def test_standalone_mocker_serves_the_openai_client(dynctl: str) -> None:
    command = [sys.executable, "-m", "dynserve.cli.mocker"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "DYN_MOCKER_SPEEDUP": str(SPEEDUP)}
    help_text = " ".join(subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=60,
                                        env=env, check=True).stdout.split())  # however the terminal wraps it
    for flags, twin in (("--profile", "DYN_MOCKER"), ("--speedup", "DYN_MOCKER_SPEEDUP"),
                        ("--http-port", "DYN_PORT"), ("--kv-blocks", "DYN_KV_BLOCKS")):
        assert flags in help_text and f"env: {twin};" in help_text, flags
    port = _free_port()
    process = subprocess.Popen([*command, "--profile", "cpu", "--http-port", str(port)], env=env,
                               stderr=subprocess.PIPE, text=True)
    try:
        banner = wait_for_line(process, "is serving", 60)
        assert f":{port}/v1" in banner and "speedup 10" in banner
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30)
        assert [m.id for m in client.models.list()] == [MODEL]
        completion = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5)
        assert completion.usage.completion_tokens == 5 and completion.choices[0].text
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi!"}], max_tokens=6, stream=True,
            stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
        _check_sglang_router_bodies(f"http://127.0.0.1:{port}")
        process.send_signal(signal.SIGUSR1)  # every thread's stack to stderr, and it goes on serving
        stacks = wait_for_line(process, "dynserve/cli/mocker.py", 30)  # the main thread, in main()
        assert "most recent call first" in stacks
        assert [m.id for m in client.models.list()] == [MODEL]
    finally:
        code, rest = stop_by_sigint(process)
    assert code == 0 and "stopped" in rest


def test_dynctl_serve_mocker_answers_with_two_workers(dynctl_serve_on_test_ray: Any, dynctl: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with dynctl_serve_on_test_ray([dynctl, "serve", "--mocker", "cpu", "--mocker-speedup", "20", "--workers", "2",
                       "--port", "0"], 120, env) as served:
        port = served.port
        assert "2 mocker workers" in served.banner and "profile cpu" in served.banner
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 8
        assert httpx.get(f"http://127.0.0.1:{port}/ready", timeout=10).json()["workers"] == ["w-0", "w-1"]
    assert served.code == 0 and "stopped" in served.rest


def test_dynctl_serve_mocker_disaggregated(dynctl_serve_on_test_ray: Any, dynctl: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with dynctl_serve_on_test_ray([dynctl, "serve", "--mocker", "cpu", "--mocker-speedup", "20", "--prefill-workers",
                       "1", "--decode-workers", "1", "--disagg-local-prefill-tokens", "0", "--port", "0"],
                      120, env) as served:
        port = served.port
        assert "1 prefill + 1 decode mocker workers" in served.banner
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 8
        assert httpx.get(f"http://127.0.0.1:{port}/ready", timeout=10).json()["workers"] == ["d-0"]
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert 'dynserve_disagg_requests_total{path="remote"} 1.0' in metrics
    assert served.code == 0 and "stopped" in served.rest


def test_dynctl_serve_refuses_prefill_workers_without_decode_workers() -> None:
    dynctl = str(Path(sys.executable).parent / "dynctl")
    done = subprocess.run([dynctl, "serve", "--mocker", "cpu", "--prefill-workers", "1"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "decode" in done.stderr
