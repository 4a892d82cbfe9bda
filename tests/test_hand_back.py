"""A worker hands back queued requests that never started (a worker joined its pool): the scheduler's and the
engine's `shed` take only those, from the queue's tail, never its head, never one that computed, holds blocks,
produced a token or was preempted; the driver ends only the asking connection's, each with one `REQUEUE`
delta and no timing. The mocker's engine (the real scheduler and block manager, no torch), milliseconds
each; the gateway's side is in `tests/test_dispatcher.py`."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from test_scheduler import make_scheduler, make_seq

from dynserve.config import Settings
from dynserve.engine.sequence import SequenceStatus
from dynserve.model.resolve import default_model_path
from dynserve.model.tokenizer import Tokenizer
from dynserve.protocol import REQUEUE, GenerateRequest, KVHandle, RemotePrefill, SamplingParams, TokenDelta
from dynserve.workers.inline_loop import InlineEngineLoop
from dynserve.workers.mocker import MockEngine

PARAMS = SamplingParams(max_tokens=4, temperature=0)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load(default_model_path())


def engine_of(tokenizer: Tokenizer, **settings: Any) -> MockEngine:
    return MockEngine(Settings(**{"mocker": "cpu", "kv_blocks": 256, "mocker_speedup": 1000.0, **settings}),
                      tokenizer, sleep=False)


def prompt(i: int) -> list[int]:
    return [100 + i] * 40


def test_the_scheduler_sheds_only_never_started_sequences_from_the_tail_and_keeps_the_head() -> None:
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=1)
    seqs = [make_seq(f"s{i}", [1, 2, 3, 4, 5], 4) for i in range(5)]
    for seq in seqs:
        scheduler.add(seq)
    scheduler.schedule()  # s0 runs; s1..s4 wait
    seqs[3].num_preemptions = 1  # as if it had run and been preempted: its tokens may have gone out
    shed = scheduler.shed(10, lambda seq: seq.request_id != "s2")
    assert [seq.request_id for seq in shed] == ["s4"]  # s3 started once, s2 is not allowed, s1 is the head
    assert [seq.request_id for seq in scheduler.waiting] == ["s1", "s2", "s3"]
    assert shed[0].status is SequenceStatus.FINISHED and shed[0].finish_reason == "requeue"
    assert scheduler.shed(10, lambda seq: True) == [seqs[2]] and scheduler.running == [seqs[0]]
    scheduler.block_manager.check_integrity()


def test_the_engine_hands_back_the_tail_of_its_queue_and_serves_the_rest_unchanged(tokenizer: Tokenizer) -> None:
    engine = engine_of(tokenizer, max_num_seqs=1)
    for i in range(5):
        engine.add_request(prompt(i), PARAMS, f"r{i}")
    first = engine.step()  # r0 is admitted and prefilled
    assert [d.request_id for d in first] == ["r0"] and first[0].token_ids
    deltas = engine.shed(2)
    assert [(d.request_id, d.token_ids, d.finished, d.finish_reason) for d in deltas] == [
        ("r4", [], True, REQUEUE), ("r3", [], True, REQUEUE)]
    assert [seq.request_id for seq in engine.scheduler.waiting] == ["r1", "r2"]
    assert engine.shed(0) == [] and engine.stats.num_prompt_tokens == 3 * 40
    seen: dict[str, list[TokenDelta]] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            seen.setdefault(delta.request_id, []).append(delta)
    assert sorted(seen) == ["r0", "r1", "r2"] and all(d[-1].finish_reason == "length" for d in seen.values())
    assert engine.scheduler.num_unfinished == 0
    engine.block_manager.check_integrity()


def test_a_request_that_started_is_never_handed_back(tokenizer: Tokenizer) -> None:
    engine = engine_of(tokenizer, max_num_seqs=1)
    engine.add_request(prompt(0), PARAMS, "running")
    engine.add_request(prompt(1), PARAMS, "head")
    # a decode worker's request whose KV read failed waits to prefill here, its first token already sent
    handle = KVHandle(worker_id="p", agent_name=None, block_ids=[], num_tokens=40)
    engine.add_request(prompt(2), PARAMS, "received", remote=RemotePrefill(handle=handle, first_token_id=7))
    (plan,) = engine.drain_receives()
    assert plan.fallback is not None
    assert engine.complete_receive("received", plan.fallback) is not None
    engine.step()
    assert [seq.request_id for seq in engine.scheduler.waiting] == ["head", "received"]
    assert engine.shed(10) == []  # the running one, the head, and one that produced a token all stay


def test_the_inline_driver_hands_back_only_the_asking_connections_requests(tokenizer: Tokenizer) -> None:
    class Sink:
        thread_safe = False

        def __init__(self) -> None:
            self.deltas: list[TokenDelta] = []

        def deliver(self, deltas: list[TokenDelta]) -> None:
            self.deltas += deltas

        def fail(self, error: Any) -> None:
            raise AssertionError(error)

    engine = engine_of(tokenizer, max_num_seqs=1, mocker_speedup=1.0)  # slow steps: the queue stays queued

    async def go() -> tuple[Sink, Sink, InlineEngineLoop]:
        driver = InlineEngineLoop(lambda: engine)
        driver.start()
        driver.attach(asyncio.get_running_loop())
        mine, other = Sink(), Sink()
        for i in range(6):
            sink = mine if i % 2 == 0 else other
            driver.submit(GenerateRequest(request_id=f"r{i}", token_ids=prompt(i), params=PARAMS), sink)
        await asyncio.sleep(0)  # the first step runs r0
        driver.hand_back(mine, 10)
        assert driver.num_open_requests == 6 - 2  # r2 and r4 went; r0 runs
        driver.stop()
        return mine, other, driver

    mine, other, driver = asyncio.run(go())
    requeued = [d for d in mine.deltas if d.finish_reason == REQUEUE]
    assert sorted(d.request_id for d in requeued) == ["r2", "r4"] and all(not d.token_ids for d in requeued)
    assert not any(d.finish_reason == REQUEUE for d in other.deltas)
    assert not any(t.request_id in ("r2", "r4") for t in driver.recent_timings())


def test_a_worker_hands_back_over_its_channel_what_its_connection_queued() -> None:
    """The real wiring, in-process: `WorkerConnection.hand_back` -> the worker's frame -> its driver -> the
    engine; the queued streams end with `REQUEUE` and the rest are served."""
    from dynserve.workers.channel import WorkerConnection
    from dynserve.workers.worker import EngineWorker

    settings = Settings(mocker="cpu", kv_blocks=256, max_num_seqs=1, worker_metrics=False)
    worker = EngineWorker(settings, "w0")

    async def go() -> dict[str, list[TokenDelta]]:
        info = await worker.start()
        channel = WorkerConnection(info)
        await channel.connect()
        try:
            async def stream(rid: str, i: int) -> list[TokenDelta]:
                return [d async for d in channel.generate(GenerateRequest(request_id=rid, token_ids=prompt(i),
                                                                          params=PARAMS))]

            tasks = {f"r{i}": asyncio.create_task(stream(f"r{i}", i)) for i in range(4)}
            while worker.load().num_waiting < 3:  # r0 runs, r1..r3 wait
                await asyncio.sleep(0.001)
            channel.hand_back(2)
            return {rid: await asyncio.wait_for(task, 10) for rid, task in tasks.items()}
        finally:
            await channel.close()
            await worker.stop()

    answers = asyncio.run(go())
    assert [rid for rid, deltas in answers.items() if deltas[-1].finish_reason == REQUEUE] == ["r2", "r3"]
    assert all(answers[rid][-1].finish_reason == "length" and len(tokens) == 4 for rid in ("r0", "r1")
               for tokens in [[t for d in answers[rid] for t in d.token_ids]])


def test_a_gateway_moves_what_queued_on_a_busy_worker_to_one_that_joins() -> None:
    """End to end in one process: two mocker workers behind a dispatcher whose directory follows a registry;
    the second registers while the first has a queue, and takes what the first hands back, with the tokens the
    first would have given (greedy)."""
    from dynserve.events.memory import MemoryEventPlane
    from dynserve.gateway.backend import BackendObserver
    from dynserve.gateway.directory import WorkerDirectory
    from dynserve.gateway.dispatcher import Dispatcher
    from dynserve.workers.worker import EngineWorker

    class Requeues(BackendObserver):
        count = 0

        def on_requeue(self) -> None:
            self.count += 1

    settings = Settings(mocker="cpu", kv_blocks=256, max_num_seqs=1, worker_metrics=False)
    workers = [EngineWorker(settings, "a"), EngineWorker(settings, "b")]
    expected = [r.token_ids for r in engine_of(workers[0].engine.tokenizer).generate([prompt(i) for i in range(4)],
                                                                                     PARAMS)]
    requeues = Requeues()

    async def go() -> tuple[list[list[int]], Dispatcher]:
        plane = MemoryEventPlane()
        a, b = [await worker.start() for worker in workers]
        await plane.register(a, ttl_s=60)
        backend = Dispatcher(WorkerDirectory([], registry=plane, registry_interval_s=3600))
        backend.add_observer(requeues)
        await backend.start()
        try:
            async def tokens(i: int) -> list[int]:
                request = GenerateRequest(request_id=f"r{i}", token_ids=prompt(i), params=PARAMS)
                return [t async for d in backend.generate(request) for t in d.token_ids]

            tasks = [asyncio.create_task(tokens(i)) for i in range(4)]
            while workers[0].load().num_waiting < 3:
                await asyncio.sleep(0.001)
            await plane.register(b, ttl_s=60)
            await backend.directory.refresh_members()
            return [await asyncio.wait_for(task, 10) for task in tasks], backend
        finally:
            await backend.stop()
            for worker in workers:
                await worker.stop()

    answers, backend = asyncio.run(go())
    assert answers == expected and requeues.count == 2  # 4 pending against 0: 2 handed back, the head kept
    assert backend.num_routed == {"a": 4, "b": 2}
