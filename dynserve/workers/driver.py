"""What every engine driver keeps, whichever way it steps its engine (an `EngineCore`: the model's or the
mocker's): `Driver`, the base of `EngineLoop` (`engine_loop.py`: a thread) and `InlineEngineLoop`
(`inline_loop.py`: a task on the asyncio loop), and `Sink`, where a request's output goes.

A driver owns the open requests and their sinks, the timings of recently finished requests, and delivery:
after every step the deltas are grouped by the sink that owns each request; a thread-safe sink (a worker's
connection) takes its group at once on the driver's side, the others' groups are handed to the asyncio loop
(`_call`, which each driver implements).

KV reads for requests prefilled elsewhere (`EngineCore.drain_receives`) run on a small thread pool through
the worker's `kv_reader`, so the engine keeps stepping other requests while pages arrive; each read's end
comes back to the driver (`_begin_read`, which each driver implements: a command, or a callback on the
loop). A read that fails becomes a local prefill, never a failed request. While prefills are held under
lease, an idle driver wakes when the oldest ends. A step that can schedule nothing (`EngineCore.stalled`:
waiting prompts find no free blocks while prefills hold theirs under lease) makes the driver wait the same
way, for a command (a release, an abort, a new request, a read's end) or the next lease's end, instead of
stepping again in a spin. `hand_back` ends a sink's queued, never started requests with a `REQUEUE` delta
each (a worker joined the pool: their gateway sends them there).

Invariants: the engine is single-threaded and only its driver touches it while a worker runs; every
submitted request ends with exactly one finished delta or one error at its sink, unless it was aborted (an
aborted request ends silently, its blocks freed before the next step); if the engine itself fails, every
open request gets a retryable error and the driver stops; a sink that raises loses its own output, not the
others'.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from dynserve.engine.core import EngineCore, ReceivePlan
from dynserve.errors import InvalidRequestError, KVTransferTimeoutError
from dynserve.protocol import (
    REQUEUE,
    GenerateRequest,
    KVEvent,
    RequestError,
    RequestTiming,
    TokenDelta,
)

if TYPE_CHECKING:
    from dynserve.workers.metrics import WorkerMetrics

__all__ = [
    "NUM_TIMINGS_KEPT", "STOPPED_MESSAGE", "Driver", "EngineCall", "KVReader", "OpenRequest", "Sink",
    "SinkCall", "hand_to_sinks", "run_call",
]

logger = logging.getLogger(__name__)

NUM_TIMINGS_KEPT = 4096
STOPPED_MESSAGE = "the engine loop has stopped"  # the error of a request or call a stopped driver refuses
_MAX_CONCURRENT_READS = 4


class Sink(Protocol):
    """Where a request's output goes. Called on the asyncio loop, except that a sink whose `thread_safe` is
    true gets its deliveries on the engine's thread the moment a step ends (a worker's connection: no wait
    for the loop to wake)."""

    thread_safe: bool

    def deliver(self, deltas: list[TokenDelta]) -> None: ...

    def fail(self, error: RequestError) -> None: ...


@dataclass(slots=True)
class OpenRequest:
    sink: Sink
    arrival_s: float
    first_token_s: float | None = None


@dataclass(slots=True)
class EngineCall:
    """`fn(engine)`, run by the driver between steps; its result or exception goes to `future`."""

    fn: Callable[[EngineCore], object]
    future: concurrent.futures.Future[object]


KVReader = Callable[[ReceivePlan], None]
SinkCall = tuple[Callable[[Any], None], Any]  # a sink's `deliver` or `fail` and what to give it


class Driver(abc.ABC):
    """What both drivers keep: the open requests and their sinks, recent timings, the KV read pool. Calls
    run on the driver's side (the engine thread, or the loop for the inline driver) unless marked."""

    def __init__(self, build: Callable[[], EngineCore], *,
                 on_kv_events: Callable[[list[KVEvent]], None] | None, kv_reader: KVReader | None) -> None:
        self._build = build
        self.kv_reader = kv_reader
        self._readers: concurrent.futures.ThreadPoolExecutor | None = None
        self._on_kv_events = on_kv_events  # called on the asyncio loop with each step's KV events, in order
        self.engine: EngineCore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._open: dict[str, OpenRequest] = {}
        self._timings: deque[RequestTiming] = deque(maxlen=NUM_TIMINGS_KEPT)
        self.failure: BaseException | None = None
        self.metrics: WorkerMetrics | None = None  # steps and first tokens are recorded here when set

    @property
    def num_open_requests(self) -> int:
        return len(self._open)

    def recent_timings(self) -> list[RequestTiming]:
        """Timings of up to the last 4096 finished requests, oldest first."""
        return list(self._timings)

    @abc.abstractmethod
    def call(self, fn: Callable[[EngineCore], object]) -> concurrent.futures.Future[object]:
        """Run `fn(engine)` on the driver's side between steps; its result or exception goes to the future."""

    def hand_back(self, sink: Sink, max_requests: int) -> None:
        """Hand back up to `max_requests` of `sink`'s queued requests that never started (`EngineCore.shed`):
        each ends at `sink` with one `REQUEUE` delta, for its gateway to send elsewhere. From any thread."""
        def shed(engine: EngineCore) -> None:
            self._deliver(engine.shed(max_requests, lambda rid: self._sink_of(rid) is sink))

        self.call(shed)

    def _sink_of(self, request_id: str) -> Sink | None:
        state = self._open.get(request_id)
        return state.sink if state is not None else None

    @abc.abstractmethod
    def _call(self, fn: Callable[[], object]) -> None:
        """Run `fn` on the asyncio loop, after everything handed over before it."""

    @abc.abstractmethod
    def _begin_read(self, plan: ReceivePlan) -> None:
        """Start reading `plan` on the pool; its end comes back through `_deliver_first`."""

    def _fail_engine(self, exc: BaseException) -> None:
        """The engine broke: nothing it holds can finish here, so every open request fails (retryable)."""
        self.failure = exc
        logger.error("engine loop failed; failing %d open requests", len(self._open), exc_info=exc)
        self._fail_open(f"the worker's engine failed: {exc}")

    def _forward_kv_events(self, engine: EngineCore) -> None:
        if self._on_kv_events is None:
            return
        events = engine.drain_kv_events()
        if events:
            on_kv_events = self._on_kv_events
            self._call(lambda: on_kv_events(events))

    def _fail_open(self, message: str) -> None:
        errors = [(o.sink.fail, RequestError(request_id=rid, message=message, retryable=True))
                  for rid, o in self._open.items()]
        self._open.clear()
        if errors:
            self._call(lambda: hand_to_sinks(errors))

    def _start_receives(self, engine: EngineCore) -> None:
        for plan in engine.drain_receives():
            if plan.fallback is not None:  # nothing to read: the request prefills here
                self._deliver_first(engine, plan.request_id, plan.fallback)
                continue
            if not plan.local_block_ids:  # this engine already caches every block of the prompt
                self._deliver_first(engine, plan.request_id, None)
                continue
            if self.kv_reader is None:  # no way to read remote blocks: prefill here
                self._deliver_first(engine, plan.request_id, "transfer_error")
                continue
            self._begin_read(plan)

    def _reader_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._readers is None:
            self._readers = concurrent.futures.ThreadPoolExecutor(_MAX_CONCURRENT_READS, "kv-read")
        return self._readers

    def _read(self, plan: ReceivePlan) -> str | None:
        """On a pool thread: read one request's KV; None, or why it failed."""
        assert self.kv_reader is not None
        try:
            self.kv_reader(plan)
        except KVTransferTimeoutError as exc:
            logger.warning("request %s: KV read timed out (%s); prefilling locally", plan.request_id, exc)
            return "transfer_timeout"
        except Exception as exc:  # any failure to get the pages costs a local prefill, never the request
            logger.warning("request %s: KV read failed (%s); prefilling locally", plan.request_id, exc)
            return "transfer_error"
        return None

    def _deliver_first(self, engine: EngineCore, request_id: str, failure: str | None) -> None:
        delta = engine.complete_receive(request_id, failure)
        if delta is not None:
            self._deliver([delta])

    def _abort(self, request_id: str) -> None:
        assert self.engine is not None
        if self._open.pop(request_id, None) is not None:
            self.engine.abort(request_id)
        else:
            self.engine.release(request_id)  # a prefill held for a decode worker that is gone

    def _add(self, request: GenerateRequest, sink: Sink, arrival_s: float, errors: list[SinkCall]) -> None:
        """Queue `request` on the engine; a request the engine refuses adds its sink's `fail` to `errors`."""
        assert self.engine is not None
        try:
            if request.export_prefix:  # answered at once, from the cache: no step, no open request
                delta = self.engine.export_prefix(request.request_id, request.token_ids)
                if sink.thread_safe:
                    hand_to_sinks([(sink.deliver, [delta])])
                else:
                    self._call(lambda: hand_to_sinks([(sink.deliver, [delta])]))
                return
            self.engine.add_request(request.token_ids, request.params, request.request_id,
                                    prefill_only=request.prefill_only, remote=request.remote_prefill,
                                    peer=request.peer_prefix)
        except InvalidRequestError as exc:
            errors.append((sink.fail, RequestError(request_id=request.request_id, message=str(exc),
                                                   param=exc.param)))
            return
        self._open[request.request_id] = OpenRequest(sink, arrival_s)

    def _deliver(self, deltas: list[TokenDelta]) -> None:
        if not deltas:
            return
        now = time.monotonic()
        by_sink: dict[int, tuple[Sink, list[TokenDelta]]] = {}
        for delta in deltas:
            state = self._open.get(delta.request_id)
            if state is None:
                continue
            if delta.finish_reason == REQUEUE:  # handed back unstarted: neither a first token nor a timing
                del self._open[delta.request_id]
            elif state.first_token_s is None:
                state.first_token_s = now
                if self.metrics is not None:
                    self.metrics.record_first_token(now - state.arrival_s)
            if delta.finished and delta.finish_reason != REQUEUE:
                del self._open[delta.request_id]
                self._timings.append(RequestTiming(
                    request_id=delta.request_id, arrival_s=state.arrival_s, first_token_s=state.first_token_s,
                    finished_s=now, num_prompt_tokens=delta.num_prompt_tokens,
                    num_cached_tokens=delta.num_cached_tokens, num_output_tokens=delta.num_output_tokens,
                    finish_reason=delta.finish_reason,
                ))
            by_sink.setdefault(id(state.sink), (state.sink, []))[1].append(delta)
        here = [(sink.deliver, batch) for sink, batch in by_sink.values() if sink.thread_safe]
        on_loop = [(sink.deliver, batch) for sink, batch in by_sink.values() if not sink.thread_safe]
        if here:
            hand_to_sinks(here)
        if on_loop:
            self._call(lambda: hand_to_sinks(on_loop))


def hand_to_sinks(calls: list[SinkCall]) -> None:
    """`fn(arg)` for each pair: a sink that raises loses its own output, not the others'."""
    for fn, arg in calls:
        try:
            fn(arg)
        except Exception:
            logger.exception("a sink failed to take the engine's output")


def run_call(call: EngineCall, engine: EngineCore | None) -> None:
    """Run `call` on `engine` unless its caller cancelled it; the result or exception goes to its future."""
    if not call.future.set_running_or_notify_cancel():
        return
    try:
        assert engine is not None
        call.future.set_result(call.fn(engine))
    except Exception as exc:  # handed to the caller through the future
        call.future.set_exception(exc)
