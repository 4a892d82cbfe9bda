"""The gateway's backend on scripted in-memory channels (`ScriptedChannel`, a fake of our own `WorkerChannel`
interface): retry before the first token, migration after it, the migration limit, abort-migration, the
disaggregated path (first token at once, release exactly once, prefill failure and KV-read fallbacks),
membership from a registry, readiness, and requests handed back unstarted to a worker that joins. Milliseconds each; the Ray end-to-end tests keep what needs real
workers (a real model's greedy answer across a killed worker, real KV pages)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import msgspec
import pytest

from dynserve.errors import InvalidRequestError, WorkerUnavailableError
from dynserve.events.memory import MemoryEventPlane
from dynserve.gateway.backend import BackendObserver, WorkerChannel
from dynserve.gateway.directory import WorkerDirectory
from dynserve.gateway.disagg import DisaggregatedBackend
from dynserve.gateway.dispatcher import Dispatcher
from dynserve.gateway.directory import hand_back_shares
from dynserve.gateway.metrics import GatewayMetrics
from dynserve.protocol import (
    REQUEUE,
    GenerateRequest,
    Grammar,
    KVHandle,
    KVSnapshot,
    SamplingParams,
    TokenDelta,
    WorkerInfo,
    WorkerLoad,
)

T = TypeVar("T")


def next_token(context: list[int]) -> int:
    """The scripted model: the next token is a function of the whole context (greedy and deterministic, so a
    request continued elsewhere from its prompt plus what was sent goes on exactly as it would have)."""
    return (len(context) * 7 + context[-1] * 3) % 997


def greedy(prompt: list[int], num_tokens: int) -> list[int]:
    context = list(prompt)
    for _ in range(num_tokens):
        context.append(next_token(context))
    return context[len(prompt):]


class ScriptedChannel:
    """A fake `WorkerChannel`: generates `next_token` one delta at a time, and fails where told.

    `fail_before_first`: the next request fails before any token. `fail_after`: the channel drops after that
    many tokens of the next request. `abort_after`: the worker cuts the next request after that many tokens
    (finish_reason "abort", as a drain that ran out of time does). As a prefill worker, a `prefill_only`
    request gets one delta with the first token and a KV handle; `read_fails` makes a decode worker report a
    failed read (it prefills itself). `released` and `aborted` record those calls. `busy`: requests queue
    (no token yet) until it is cleared; `hand_back(n)` ends up to n of the queued ones, newest first, the
    oldest kept, with a `REQUEUE` delta, as a worker's engine does (`hand_backs` records the calls)."""

    def __init__(self, worker_id: str, role: str = "both") -> None:
        self.info = WorkerInfo(worker_id=worker_id, role=role, host="fake", port=0, model_id="m",
                               max_model_len=4096, block_size=4, num_blocks=64)
        self.open, self.streams = False, 0
        self.fail_before_first, self.fail_after, self.abort_after = False, None, None
        self.read_fails, self.connectable = False, True
        self.requests: list[GenerateRequest] = []
        self.released: list[str] = []
        self.aborted: list[str] = []
        self.idle = asyncio.Event()
        self.idle.set()
        self.queued: dict[str, asyncio.Event] = {}  # waiting request id -> set when handed back
        self.hand_backs: list[int] = []
        self.reported = WorkerLoad(worker_id=worker_id, role=role, num_blocks_used=0, num_blocks_total=64,
                                   num_running=0, num_waiting=0)

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def is_open(self) -> bool:
        return self.open

    @property
    def num_open_streams(self) -> int:
        return self.streams

    async def connect(self, timeout_s: float = 5.0, *, cluster_token: str | None = None) -> None:
        if not self.connectable:
            raise WorkerUnavailableError("refused", worker_id=self.worker_id)
        self.open = True

    async def close(self) -> None:
        self.open = False

    async def load(self, timeout_s: float = 2.0) -> WorkerLoad:
        if not self.open:
            raise WorkerUnavailableError("closed", worker_id=self.worker_id)
        return self.reported

    async def snapshot(self, timeout_s: float = 10.0) -> KVSnapshot:
        return KVSnapshot(worker_id=self.worker_id, block_hashes=[], last_event_id=0)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def release(self, request_id: str) -> None:
        self.released.append(request_id)

    def hold(self) -> None:
        """Queue every request from now on, until `serve`."""
        self.idle.clear()

    def serve(self) -> None:
        self.idle.set()

    def hand_back(self, max_requests: int) -> None:
        self.hand_backs.append(max_requests)
        for request_id in list(self.queued)[1:][::-1][:max_requests]:
            self.queued.pop(request_id).set()

    async def _queue(self, request: GenerateRequest) -> bool:
        """Wait while held; True when the request was handed back meanwhile."""
        if self.idle.is_set():
            return False
        handed = self.queued[request.request_id] = asyncio.Event()
        waits = [asyncio.ensure_future(self.idle.wait()), asyncio.ensure_future(handed.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
            self.queued.pop(request.request_id, None)
        return handed.is_set()

    def _drop(self) -> WorkerUnavailableError:
        self.open = False
        return WorkerUnavailableError(f"worker {self.worker_id} went away", worker_id=self.worker_id)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        if not self.open:
            raise WorkerUnavailableError("closed", worker_id=self.worker_id)
        self.requests.append(request)
        self.streams += 1
        finished = False
        try:
            if self.fail_before_first:
                self.fail_before_first = False
                raise self._drop()
            prompt = request.token_ids
            if await self._queue(request):
                finished = True
                yield TokenDelta(request_id=request.request_id, token_ids=[], finished=True, finish_reason=REQUEUE,
                                 num_prompt_tokens=len(prompt))
                return
            tokens = greedy(prompt, request.params.max_tokens)
            usage = {"num_prompt_tokens": len(prompt), "num_cached_tokens": 0}
            if request.prefill_only:
                handle = KVHandle(worker_id=self.worker_id, agent_name=None, block_ids=[0], num_tokens=len(prompt))
                finished = True
                yield TokenDelta(request_id=request.request_id, token_ids=tokens[:1], text=f"<{tokens[0]}>",
                                 num_output_tokens=1, kv_handle=handle, **usage)
                return
            fallback = None
            if request.remote_prefill is not None:
                assert request.remote_prefill.first_token_id == tokens[0]
                fallback = "transfer_failed" if self.read_fails else None
            drop_at_end = self.fail_after == len(tokens)  # every token sent, then the channel drops
            for n, token in enumerate(tokens, start=1):
                await asyncio.sleep(0)
                if self.fail_after is not None and n > self.fail_after:
                    self.fail_after = None
                    raise self._drop()
                cut = self.abort_after is not None and n == self.abort_after
                last = (n == len(tokens) and not drop_at_end) or cut
                finished = last
                yield TokenDelta(request_id=request.request_id, token_ids=[token], text=f"<{token}>",
                                 finished=last, finish_reason=("abort" if cut else "length") if last else None,
                                 num_output_tokens=n, kv_fallback=fallback if n == 1 else None, **usage)
                if cut:
                    self.abort_after = None
                    return
            if drop_at_end:
                self.fail_after = None
                raise self._drop()
        finally:
            self.streams -= 1
            if not finished:
                self.abort(request.request_id)


class Recorder(BackendObserver):
    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    def on_retry(self) -> None:
        self.events.append(("retry", None))

    def on_migration(self, reason: str) -> None:
        self.events.append(("migration", reason))

    def on_disagg(self, path: str) -> None:
        self.events.append(("disagg", path))

    def on_fallback(self, reason: str) -> None:
        self.events.append(("fallback", reason))

    def on_down(self, info: WorkerInfo) -> None:
        self.events.append(("down", info.worker_id))

    def on_leave(self, info: WorkerInfo) -> None:
        self.events.append(("leave", info.worker_id))

    def on_requeue(self) -> None:
        self.events.append(("requeue", None))


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def request(prompt: list[int] | None = None, max_tokens: int = 10, rid: str = "r1") -> GenerateRequest:
    return GenerateRequest(request_id=rid, token_ids=prompt or [5, 6, 7, 8, 9],
                           params=SamplingParams(max_tokens=max_tokens, temperature=0))


def dispatcher(channels: list[ScriptedChannel], **kwargs: Any) -> tuple[Dispatcher, Recorder]:
    by_id = {c.worker_id: c for c in channels}
    directory = WorkerDirectory([c.info for c in channels], channel_factory=lambda info: by_id[info.worker_id])
    backend = Dispatcher(directory, **kwargs)
    recorder = Recorder()
    backend.add_observer(recorder)
    return backend, recorder


async def collect(stream: AsyncIterator[TokenDelta]) -> list[TokenDelta]:
    async with contextlib.aclosing(stream) as deltas:
        return [delta async for delta in deltas]


def tokens_of(deltas: list[TokenDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def test_scripted_channel_is_a_worker_channel() -> None:
    assert isinstance(ScriptedChannel("a"), WorkerChannel)


def test_a_worker_that_fails_before_its_first_token_costs_a_retry() -> None:
    a, b = ScriptedChannel("a"), ScriptedChannel("b")
    a.fail_before_first = True
    backend, recorder = dispatcher([a, b])

    async def go() -> list[TokenDelta]:
        await backend.start()
        try:
            first = backend.pick(set(), [1])
            assert first is a  # both idle: the first listed; it fails, b serves
            return await collect(backend.generate(request()))
        finally:
            await backend.stop()

    deltas = run(go())
    assert tokens_of(deltas) == greedy([5, 6, 7, 8, 9], 10) and deltas[-1].finish_reason == "length"
    assert recorder.events == [("retry", None)] and backend.num_routed == {"a": 1, "b": 1}


def test_every_worker_failing_before_the_first_token_is_unavailable() -> None:
    a, b = ScriptedChannel("a"), ScriptedChannel("b")
    a.fail_before_first = b.fail_before_first = True
    backend, recorder = dispatcher([a, b])

    async def go() -> None:
        await backend.start()
        try:
            with pytest.raises(WorkerUnavailableError, match=r"tried \['a', 'b'\]"):
                await collect(backend.generate(request()))
        finally:
            await backend.stop()

    run(go())
    assert recorder.events == [("retry", None)] * 2


@pytest.mark.parametrize("cut", ["fail", "abort"])
def test_a_worker_lost_mid_stream_migrates_and_the_client_sees_no_gap_and_no_repeat(cut: str) -> None:
    a, b = ScriptedChannel("a"), ScriptedChannel("b")
    if cut == "fail":
        a.fail_after = 4
    else:
        a.abort_after = 4
    backend, recorder = dispatcher([a, b])
    prompt = [5, 6, 7, 8, 9]

    async def go() -> list[TokenDelta]:
        await backend.start()
        try:
            return await collect(backend.generate(request(prompt, 10)))
        finally:
            await backend.stop()

    deltas = run(go())
    assert tokens_of(deltas) == greedy(prompt, 10)  # the undisturbed answer
    assert all(not d.finished for d in deltas[:-1]) and deltas[-1].finish_reason == "length"
    continued = b.requests[0]
    assert continued.token_ids == prompt + greedy(prompt, 4) and continued.params.max_tokens == 6
    # usage over both workers, as the client's request sees it
    assert (deltas[-1].num_prompt_tokens, deltas[-1].num_output_tokens) == (5, 10)
    assert recorder.events == [("migration", "worker_failed" if cut == "fail" else "worker_aborted")]


def test_a_migrated_grammar_continues_from_every_token_sent_over_each_migration() -> None:
    a, b, c = ScriptedChannel("a"), ScriptedChannel("b"), ScriptedChannel("c")
    a.fail_after, b.fail_after = 4, 3
    backend, _recorder = dispatcher([a, b, c])
    prompt = [5, 6, 7, 8, 9]
    grammar = Grammar(kind="regex", source="[a-z]+")
    constrained = msgspec.structs.replace(request(prompt, 10), params=SamplingParams(max_tokens=10, temperature=0,
                                                                                     grammar=grammar))

    async def go() -> list[TokenDelta]:
        await backend.start()
        try:
            return await collect(backend.generate(constrained))
        finally:
            await backend.stop()

    assert tokens_of(run(go())) == greedy(prompt, 10)
    # each continuation's prompt ends with every token sent so far, and its grammar is told so
    first, second = (channel.requests[0] for channel in (b, c))
    assert first.params.grammar == msgspec.structs.replace(grammar, num_prior_tokens=4)
    assert second.params.grammar == msgspec.structs.replace(grammar, num_prior_tokens=7)
    assert second.token_ids == prompt + greedy(prompt, 7)


def test_migration_stops_at_its_limit_and_with_none_the_failure_reaches_the_caller() -> None:
    a, b = ScriptedChannel("a"), ScriptedChannel("b")
    a.fail_after = 3
    backend, recorder = dispatcher([a, b], migration_limit=0)

    async def go() -> list[int]:
        await backend.start()
        got: list[int] = []
        try:
            with pytest.raises(WorkerUnavailableError):
                async with contextlib.aclosing(backend.generate(request())) as stream:
                    async for delta in stream:
                        got.extend(delta.token_ids)
            return got
        finally:
            await backend.stop()

    assert run(go()) == greedy([5, 6, 7, 8, 9], 3)
    assert recorder.events == [] and not b.requests

    # an abort at the limit reaches the client as the worker said it
    c, d = ScriptedChannel("c"), ScriptedChannel("d")
    c.abort_after = 2
    backend, _ = dispatcher([c, d], migration_limit=0)

    async def aborted() -> list[TokenDelta]:
        await backend.start()
        try:
            return await collect(backend.generate(request()))
        finally:
            await backend.stop()

    assert run(aborted())[-1].finish_reason == "abort"


def test_a_migration_that_had_every_token_ends_the_stream_without_another_worker() -> None:
    a, b = ScriptedChannel("a"), ScriptedChannel("b")
    a.fail_after = 5  # drops after the 5th token of 5, before saying it finished
    backend, recorder = dispatcher([a, b])

    async def go() -> list[TokenDelta]:
        await backend.start()
        try:
            return await collect(backend.generate(request(max_tokens=5)))
        finally:
            await backend.stop()

    deltas = run(go())
    assert tokens_of(deltas) == greedy([5, 6, 7, 8, 9], 5) and deltas[-1].finished
    assert not b.requests and recorder.events == [("migration", "worker_failed")]


def test_closing_the_stream_early_aborts_on_the_worker() -> None:
    a = ScriptedChannel("a")
    backend, _ = dispatcher([a])

    async def go() -> None:
        await backend.start()
        try:
            async with contextlib.aclosing(backend.generate(request(max_tokens=20))) as stream:
                async for _delta in stream:
                    break
        finally:
            await backend.stop()

    run(go())
    assert a.aborted == ["r1"] and a.streams == 0


def test_an_invalid_request_is_not_retried() -> None:
    class Refusing(ScriptedChannel):
        async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
            raise InvalidRequestError("bad", param="max_tokens")
            yield  # an async generator

    a, b = Refusing("a"), ScriptedChannel("b")
    backend, recorder = dispatcher([a, b])

    async def go() -> None:
        await backend.start()
        try:
            with pytest.raises(InvalidRequestError):
                await collect(backend.generate(request()))
        finally:
            await backend.stop()

    run(go())
    assert not b.requests and recorder.events == []


def test_the_least_pending_worker_is_picked_without_a_router() -> None:
    a, b = ScriptedChannel("a"), ScriptedChannel("b")
    a.reported = msgspec.structs.replace(a.reported, num_running=3)
    backend, _ = dispatcher([a, b])

    async def go() -> str | None:
        await backend.start()
        try:
            chosen = backend.pick(set())
            return chosen.worker_id if chosen else None
        finally:
            await backend.stop()

    assert run(go()) == "b"


def test_a_finished_requests_load_leaves_the_router_before_its_last_delta_reaches_the_caller() -> None:
    """A client that sends its next request as soon as it has read the end must find the worker free: the
    router stops counting a request's blocks when the worker finishes it, not when the caller next pulls."""
    from dynserve.router.router import Router

    a, b = ScriptedChannel("a"), ScriptedChannel("b")
    router = Router("least_loaded", block_size=4, salt=0)
    backend, _ = dispatcher([a, b], router=router)

    async def go() -> tuple[int, int]:
        await backend.start()
        try:
            async with contextlib.aclosing(backend.generate(request(max_tokens=3))) as deltas:
                async for delta in deltas:
                    if delta.finished:
                        worker = "a" if a.requests else "b"
                        # the caller holds the last delta; the stream is not closed yet
                        return router.active_blocks(worker), router.active_blocks("b" if worker == "a" else "a")
                    assert router.active_blocks("a" if a.requests else "b") > 0
            raise AssertionError("no finished delta")
        finally:
            await backend.stop()

    assert run(go()) == (0, 0)


# ---- disaggregated ---------------------------------------------------------------------------------------


def disaggregated(prefills: list[ScriptedChannel], decodes: list[ScriptedChannel],
                  **kwargs: Any) -> tuple[DisaggregatedBackend, Recorder]:
    prefill, _ = dispatcher(prefills, pool="prefill")
    decode, _ = dispatcher(decodes, pool="decode")
    backend = DisaggregatedBackend(prefill, decode, **kwargs)
    recorder = Recorder()
    backend.add_observer(recorder)
    return backend, recorder


async def served(backend: Any, req: GenerateRequest) -> list[TokenDelta]:
    await backend.start()
    try:
        return await collect(backend.generate(req))
    finally:
        await backend.stop()


def test_a_remote_prefill_gives_the_first_token_at_once_and_releases_exactly_once() -> None:
    p, d = ScriptedChannel("p", "prefill"), ScriptedChannel("d", "decode")
    backend, recorder = disaggregated([p], [d])
    deltas = run(served(backend, request()))
    assert tokens_of(deltas) == greedy([5, 6, 7, 8, 9], 10)  # the decode worker's repeat of it trimmed
    assert deltas[0].kv_handle is None and not deltas[0].finished  # the prefill's token, sent before decode
    assert d.requests[0].remote_prefill is not None and p.requests[0].prefill_only
    assert p.released == ["r1"] and recorder.events == [("disagg", "remote")]


def test_a_decode_worker_lost_mid_stream_migrates_and_the_prefill_is_released_once() -> None:
    p, d0, d1 = ScriptedChannel("p", "prefill"), ScriptedChannel("d0", "decode"), ScriptedChannel("d1", "decode")
    d0.fail_after = 4
    backend, recorder = disaggregated([p], [d0, d1])
    deltas = run(served(backend, request()))
    assert tokens_of(deltas) == greedy([5, 6, 7, 8, 9], 10)
    assert d1.requests[0].remote_prefill is None  # the new worker prefills the prompt and what was sent
    assert p.released == ["r1"]
    assert recorder.events == [("disagg", "remote"), ("migration", "worker_failed")]


def test_a_decode_worker_failing_before_its_first_delta_still_releases_the_prefill() -> None:
    p, d0, d1 = ScriptedChannel("p", "prefill"), ScriptedChannel("d0", "decode"), ScriptedChannel("d1", "decode")
    d0.fail_before_first = True
    backend, _ = disaggregated([p], [d0, d1])
    deltas = run(served(backend, request()))
    assert tokens_of(deltas) == greedy([5, 6, 7, 8, 9], 10) and p.released == ["r1"]
    assert d1.requests[0].remote_prefill is not None  # the retry reads the same handle


def test_a_prefill_failing_everywhere_falls_back_to_the_decode_worker() -> None:
    p0, p1, d = ScriptedChannel("p0", "prefill"), ScriptedChannel("p1", "prefill"), ScriptedChannel("d", "decode")
    p0.fail_before_first = p1.fail_before_first = True
    backend, recorder = disaggregated([p0, p1], [d])
    deltas = run(served(backend, request()))
    assert tokens_of(deltas) == greedy([5, 6, 7, 8, 9], 10)
    assert d.requests[0].remote_prefill is None and not p0.released and not p1.released
    assert recorder.events == [("disagg", "remote"), ("retry", None), ("retry", None), ("fallback", "prefill_failed")]


def test_a_failed_kv_read_is_counted_and_the_answer_unchanged() -> None:
    p, d = ScriptedChannel("p", "prefill"), ScriptedChannel("d", "decode")
    d.read_fails = True
    backend, recorder = disaggregated([p], [d])
    deltas = run(served(backend, request()))
    assert tokens_of(deltas) == greedy([5, 6, 7, 8, 9], 10) and p.released == ["r1"]
    assert recorder.events == [("disagg", "remote"), ("fallback", "transfer_failed")]


def test_a_first_token_that_ends_the_request_skips_the_decode_worker() -> None:
    p, d = ScriptedChannel("p", "prefill"), ScriptedChannel("d", "decode")

    class Ending(ScriptedChannel):
        async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
            self.requests.append(request)
            yield TokenDelta(request_id=request.request_id, token_ids=[1], finished=True, finish_reason="stop")

    ending = Ending("p", "prefill")
    backend, _ = disaggregated([ending], [d])
    deltas = run(served(backend, request()))
    assert [(x.token_ids, x.finish_reason) for x in deltas] == [([1], "stop")] and not d.requests
    del p


@pytest.mark.parametrize(("local_tokens", "path"), [(100, "short_prompt"), (0, "remote")])
def test_short_prompts_prefill_on_the_decode_worker(local_tokens: int, path: str) -> None:
    p, d = ScriptedChannel("p", "prefill"), ScriptedChannel("d", "decode")
    backend, recorder = disaggregated([p], [d], local_prefill_tokens=local_tokens)
    run(served(backend, request()))
    assert recorder.events == [("disagg", path)] and bool(p.requests) == (path == "remote")


def test_without_prefill_workers_the_decode_worker_prefills() -> None:
    p, d = ScriptedChannel("p", "prefill"), ScriptedChannel("d", "decode")
    p.connectable = False
    backend, recorder = disaggregated([p], [d])
    deltas = run(served(backend, request()))
    assert tokens_of(deltas) == greedy([5, 6, 7, 8, 9], 10)
    assert ("disagg", "no_prefill_worker") in recorder.events and ("down", "p") in recorder.events


def test_a_gateway_started_on_the_first_prefill_worker_serves_once_a_decode_worker_joins() -> None:
    # a gateway-only pod may find the fleet's prefill worker registered before any decode worker
    p, d = ScriptedChannel("p", "prefill"), ScriptedChannel("d", "decode")
    plane = MemoryEventPlane()
    channels = {"p": p, "d": d}

    def pool(roles: frozenset[str], infos: list[WorkerInfo], name: str) -> Dispatcher:
        directory = WorkerDirectory(infos, registry=plane, roles=roles, registry_interval_s=3600,
                                    channel_factory=lambda info: channels[info.worker_id])
        return Dispatcher(directory, pool=name)

    backend = DisaggregatedBackend(pool(frozenset({"prefill"}), [p.info], "prefill"),
                                   pool(frozenset({"decode", "both"}), [], "decode"))
    assert (backend.model_id, backend.max_model_len) == ("m", 4096)  # named by the prefill pool until then

    async def go() -> list[TokenDelta]:
        await plane.register(p.info, ttl_s=60)
        await backend.start()
        try:
            await plane.register(d.info, ttl_s=60)
            await backend.decode.directory.refresh_members()
            return await collect(backend.generate(request()))
        finally:
            await backend.stop()

    assert tokens_of(run(go())) == greedy([5, 6, 7, 8, 9], 10)
    assert d.requests[0].remote_prefill is not None and backend.decode.directory.has_identity


# ---- membership and readiness ----------------------------------------------------------------------------


def test_the_directory_follows_the_registry_and_a_leaver_finishes_its_streams() -> None:
    channels = {name: ScriptedChannel(name) for name in ("a", "b")}
    plane = MemoryEventPlane()
    directory = WorkerDirectory([], registry=plane, channel_factory=lambda info: channels[info.worker_id],
                                registry_interval_s=3600)
    recorder = Recorder()
    directory.add_observer(recorder)
    backend = Dispatcher(directory)

    async def go() -> None:
        await plane.register(channels["a"].info, ttl_s=60)
        await backend.start()
        try:
            assert directory.routable_ids() == ["a"] and backend.is_ready()
            await plane.register(channels["b"].info, ttl_s=60)
            await directory.refresh_members()
            assert directory.routable_ids() == ["a", "b"]
            async with contextlib.aclosing(backend.generate(request(max_tokens=50))) as stream:
                await anext(stream)
                serving = next(c for c in channels.values() if c.streams)
                await plane.deregister(serving.worker_id)
                await directory.refresh_members()
                assert serving.worker_id not in directory.routable_ids()  # no new request goes there
                rest = [delta async for delta in stream]  # but its stream goes on to the end
            assert rest[-1].finish_reason == "length"
            assert recorder.events == [("down", serving.worker_id), ("leave", serving.worker_id)]
        finally:
            await backend.stop()

    run(go())


def test_a_registry_that_lists_nobody_does_not_empty_the_directory_until_the_grace_ends() -> None:
    channels = {name: ScriptedChannel(name) for name in ("a", "b")}
    plane = MemoryEventPlane()
    directory = WorkerDirectory([], registry=plane, channel_factory=lambda info: channels[info.worker_id],
                                registry_interval_s=3600, registry_grace_s=0.2)

    async def go() -> None:
        for channel in channels.values():
            await plane.register(channel.info, ttl_s=60)
        await directory.start()
        try:
            for channel in channels.values():
                await plane.deregister(channel.worker_id)
            await directory.refresh_members()
            assert directory.routable_ids() == ["a", "b"]
            await asyncio.sleep(0.25)
            await directory.refresh_members()
            assert directory.routable_ids() == []
        finally:
            await directory.stop()

    run(go())


def test_a_dropped_channel_is_out_of_picking_and_back_after_it_reconnects() -> None:
    a, b = ScriptedChannel("a"), ScriptedChannel("b")
    backend, recorder = dispatcher([a, b])

    async def go() -> None:
        await backend.start()
        try:
            a.open = False
            assert backend.directory.routable_ids() == ["b"]
            a.connectable = False
            await backend.directory.poll_once()
            assert ("down", "a") in recorder.events and "a" not in backend.directory.loads
            a.connectable = True
            await backend.directory.poll_once()
            assert backend.directory.routable_ids() == ["a", "b"] and "a" in backend.directory.loads
        finally:
            await backend.stop()

    run(go())


def test_a_channel_where_another_worker_answers_is_closed_and_left_down(
        caplog: pytest.LogCaptureFixture) -> None:
    """Worker a's address answered by worker c (an older worker that took a's port and does not refuse a
    Hello meant for a): its load names c, so the directory closes the channel, keeps it out of picking (also
    between a reconnection and its load's answer) and warns once, however many polls reconnect it; b goes on
    serving."""
    import logging

    a, b = ScriptedChannel("a"), ScriptedChannel("b")
    backend, recorder = dispatcher([a, b])

    async def go() -> list[TokenDelta]:
        await backend.start()
        try:
            a.reported = msgspec.structs.replace(a.reported, worker_id="c")
            for _ in range(3):
                await backend.directory.poll_once()
                assert not a.is_open and "a" not in backend.directory.loads
            assert backend.directory.routable_ids() == ["b"] and ("down", "a") in recorder.events
            a.open = True  # reconnected, its load not answered yet: not picked until it answers as itself
            assert backend.directory.routable_ids() == ["b"]
            return await collect(backend.generate(request()))
        finally:
            await backend.stop()

    with caplog.at_level(logging.DEBUG, logger="dynserve.gateway.directory"):
        deltas = run(go())
    assert deltas[-1].finished and b.requests and not a.requests
    warned = [r.levelno for r in caplog.records if "worker c answers at its address" in r.getMessage()]
    assert warned[0] == logging.WARNING and set(warned[1:]) == {logging.DEBUG} and len(warned) >= 3


# ---- hand-back: queued requests move to a worker that joins ----------------------------------------------


def joining_pool(names: tuple[str, ...], role: str = "both") -> tuple[dict[str, ScriptedChannel], MemoryEventPlane,
                                                                     WorkerDirectory]:
    channels = {name: ScriptedChannel(name, role) for name in names}
    plane = MemoryEventPlane()
    directory = WorkerDirectory([], registry=plane, channel_factory=lambda info: channels[info.worker_id],
                                registry_interval_s=3600)
    return channels, plane, directory


async def queued_on(channel: ScriptedChannel, num: int) -> None:
    while len(channel.queued) < num:
        await asyncio.sleep(0)


def test_hand_back_shares_bring_each_member_to_the_pools_mean_at_most_its_queue() -> None:
    assert hand_back_shares({"a": 6, "b": 0}, {"a": 5}, {"b"}) == {"a": 3}
    assert hand_back_shares({"a": 6, "b": 0}, {"a": 1}, {"b"}) == {"a": 1}  # only what is queued
    assert hand_back_shares({"a": 6, "b": 2, "c": 0}, {"a": 5, "b": 2}, {"c"}) == {"a": 3}
    assert hand_back_shares({"a": 1, "b": 0}, {"a": 1}, {"b"}) == {}  # nothing above the mean
    assert hand_back_shares({"b": 0}, {}, {"b"}) == {}


def test_requests_queued_on_a_busy_worker_are_served_by_a_worker_that_joins() -> None:
    channels, plane, directory = joining_pool(("a", "b"))
    a, b = channels["a"], channels["b"]
    backend = Dispatcher(directory)
    recorder, metrics = Recorder(), GatewayMetrics()
    backend.add_observer(recorder)
    backend.add_observer(metrics)
    prompts = {f"r{i}": [5 + i, 6, 7, 8, 9] for i in range(4)}

    async def go() -> dict[str, list[TokenDelta]]:
        await plane.register(a.info, ttl_s=60)
        await backend.start()
        try:
            a.hold()  # a is busy: what it is sent queues there
            tasks = {rid: asyncio.create_task(collect(backend.generate(request(p, 6, rid))))
                     for rid, p in prompts.items()}
            await queued_on(a, 4)
            a.reported = msgspec.structs.replace(a.reported, num_waiting=4)
            await plane.register(b.info, ttl_s=60)
            await directory.refresh_members()  # b joins: a is asked to hand back 2 (4 pending against 0)
            await asyncio.wait_for(asyncio.gather(tasks["r2"], tasks["r3"]), 5)  # b served them meanwhile
            a.serve()
            return {rid: await task for rid, task in tasks.items()}
        finally:
            await backend.stop()

    answers = run(go())
    assert a.hand_backs == [2] and sorted(r.request_id for r in b.requests) == ["r2", "r3"]  # the newest two
    for rid, deltas in answers.items():  # every answer whole, once, and no requeue reaches the client
        assert tokens_of(deltas) == greedy(prompts[rid], 6) and deltas[-1].finish_reason == "length"
        assert all(d.finish_reason != REQUEUE for d in deltas)
    assert recorder.events == [("requeue", None)] * 2
    assert metrics.registry.get_sample_value("dynserve_gateway_requeues_total") == 2


def test_a_request_that_started_is_not_handed_back_and_a_requeue_after_a_token_migrates() -> None:
    channels, plane, directory = joining_pool(("a", "b"))
    a, b = channels["a"], channels["b"]
    backend = Dispatcher(directory)
    recorder = Recorder()
    backend.add_observer(recorder)

    async def go() -> list[TokenDelta]:
        await plane.register(a.info, ttl_s=60)
        await backend.start()
        try:
            async with contextlib.aclosing(backend.generate(request(max_tokens=8))) as stream:
                first = await anext(stream)  # it runs on a
                a.reported = msgspec.structs.replace(a.reported, num_running=1, num_waiting=3)
                await plane.register(b.info, ttl_s=60)
                await directory.refresh_members()
                return [first, *[delta async for delta in stream]]
        finally:
            await backend.stop()

    deltas = run(go())
    assert a.hand_backs == [2] and not b.requests  # asked, but nothing of it was queued
    assert tokens_of(deltas) == greedy([5, 6, 7, 8, 9], 8) and recorder.events == []

    # a worker that breaks the rule (a requeue after a token) costs a migration, never a duplicate
    class Late(ScriptedChannel):
        async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
            self.requests.append(request)
            token = greedy(request.token_ids, 1)[0]
            yield TokenDelta(request_id=request.request_id, token_ids=[token], num_output_tokens=1)
            yield TokenDelta(request_id=request.request_id, token_ids=[], finished=True, finish_reason=REQUEUE)

    late, c = Late("late"), ScriptedChannel("c")
    backend, recorder = dispatcher([late, c])
    deltas = run(served(backend, request(max_tokens=8)))
    assert tokens_of(deltas) == greedy([5, 6, 7, 8, 9], 8) and recorder.events == [("migration", "worker_aborted")]


def test_a_handed_back_prefill_is_prefilled_by_the_prefill_worker_that_joins() -> None:
    channels, plane, directory = joining_pool(("p0", "p1"), "prefill")
    p0, p1 = channels["p0"], channels["p1"]
    d = ScriptedChannel("d", "decode")
    decode, _ = dispatcher([d], pool="decode")
    backend = DisaggregatedBackend(Dispatcher(directory, pool="prefill"), decode, max_prefill_queue=100)
    recorder = Recorder()
    backend.add_observer(recorder)

    async def go() -> dict[str, list[TokenDelta]]:
        await plane.register(p0.info, ttl_s=60)
        await backend.start()
        try:
            p0.hold()
            tasks = {rid: asyncio.create_task(collect(backend.generate(request(rid=rid)))) for rid in ("r0", "r1")}
            await queued_on(p0, 2)
            p0.reported = msgspec.structs.replace(p0.reported, num_waiting=2)
            await plane.register(p1.info, ttl_s=60)
            await directory.refresh_members()
            answer = await asyncio.wait_for(tasks["r1"], 5)
            p0.serve()
            return {"r0": await tasks["r0"], "r1": answer}
        finally:
            await backend.stop()

    answers = run(go())
    assert [r.request_id for r in p1.requests] == ["r1"] and p1.requests[0].prefill_only
    assert all(tokens_of(deltas) == greedy([5, 6, 7, 8, 9], 10) for deltas in answers.values())
    handles = {r.request_id: r.remote_prefill.handle.worker_id for r in d.requests if r.remote_prefill}
    assert handles == {"r0": "p0", "r1": "p1"}  # the decode worker reads each prompt where it was prefilled
    assert p0.released == ["r0"] and p1.released == ["r1"]
    assert recorder.events.count(("requeue", None)) == 1
