"""Drives one engine (an `EngineCore`: the model's or the mocker's) and hands its output to an asyncio loop.
Two drivers share the bookkeeping (`_Driver`: open requests, per-request timings, KV reads, delivery):

- `EngineLoop` steps the engine on its own thread, for engines whose steps compute (the model's). The
  engine is built on that same thread (`start` runs the builder there and waits for it): torch's OpenMP
  thread team belongs to the thread that first runs a parallel op, and an engine stepping on one thread
  after its model was loaded and warmed up on another runs 40-50% slower on CPU. Other threads talk to it
  through a command queue (`submit`, `abort`, `stop`), and the thread blocks on that
  queue when the engine is idle, so an idle worker costs no CPU. After every step the deltas are grouped
  by the `Sink` that owns each request. A thread-safe sink (a worker's connection) takes its group on the
  engine thread at once, saving the loop's wake-up (about 1 ms a step here); the others' groups are
  handed to the loop, and steps the loop has not taken yet go with the same wake-up (`_call`).
- `InlineEngineLoop` steps the engine as a task on the asyncio loop itself, for engines whose steps cost
  microseconds of Python and never block (the mocker's: `step()` returns at once and `next_step_s` says
  when its modelled time is up). No thread, no command queue, no hand-off and no GIL traffic between two
  threads per step: at a high speedup those cost a mocker more CPU than its steps (measured: the engine
  thread of a mocker at 2 tokens a step spent twice the CPU of its I/O thread). After each step the task
  waits for the step's modelled end, then delivers its tokens: on the loop's timer when that end is at
  least `_MIN_SLEEP_S` ahead, else with a bare yield (the engine's clock carries the difference into the
  next step). Either way the loop serves I/O between steps. Its tokens go out with the next step's while
  that step should end within `_COALESCE_S` (0.5 ms) of the oldest held token (judged by the last step's
  length, modelled or measured, whichever is longer), and at once when the engine runs out of work: a
  mocker at a high speedup steps every 0.1-0.2 ms with a few sequences, and one frame per step made every
  hop after it (the worker's write, the gateway's read and wake-ups, the client's writes) pay per step; a
  step of 0.5 ms or more (a mocker at the speedups the routing and disaggregation benchmarks use, any real
  model) still delivers each step's tokens alone. The window is short because a gateway that sleeps
  between deliveries wakes late for the last one: at concurrency 1 a longer one (1 ms) cost the gateway's
  path more than the single-process mocker's.

KV reads for requests prefilled elsewhere (`EngineCore.drain_receives`) run on a small thread pool through
the worker's `kv_reader`, so the engine keeps stepping other requests while pages arrive; each read's end
comes back to the driver (a command, or a callback on the loop). While prefills are held under lease, an
idle driver wakes when the oldest ends. A step that can schedule nothing (`EngineCore.stalled`: waiting
prompts find no free blocks while prefills hold theirs under lease) makes the driver wait the same way,
for a command (a release, an abort, a new request, a read's end) or the next lease's end, instead of
stepping again in a spin.

Invariants: the engine is single-threaded and only its driver touches it while a worker runs; every
submitted request ends with exactly one finished delta or one error at its sink, unless it was aborted (an
aborted request ends silently, its blocks freed before the next step); if the engine itself fails, every
open request gets a retryable error and the driver stops.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from dynserve.engine.core import EngineCore, ReceivePlan
from dynserve.errors import InvalidRequestError, KVTransferTimeoutError
from dynserve.protocol import GenerateRequest, KVEvent, RequestError, RequestTiming, TokenDelta

__all__ = ["EngineLoop", "InlineEngineLoop", "Sink"]

logger = logging.getLogger(__name__)

NUM_TIMINGS_KEPT = 4096
_STOPPED = "the engine loop has stopped"  # the error of a request or call a stopped driver refuses
_MIN_SLEEP_S = 0.001  # the asyncio loop's timers have millisecond resolution: shorter waits are not slept
_COALESCE_S = 0.0005  # the inline loop holds a fast engine's tokens up to this long, to send them together


class Sink(Protocol):
    """Where a request's output goes. Called on the asyncio loop, except that a sink whose `thread_safe` is
    true gets its deliveries on the engine's thread the moment a step ends (a worker's connection: no wait
    for the loop to wake)."""

    thread_safe: bool

    def deliver(self, deltas: list[TokenDelta]) -> None: ...

    def fail(self, error: RequestError) -> None: ...


@dataclass(slots=True)
class _Open:
    sink: Sink
    arrival_s: float
    first_token_s: float | None = None


class _Stop:
    pass


@dataclass(slots=True, frozen=True)
class _Received:
    request_id: str
    failure: str | None


@dataclass(slots=True, frozen=True)
class _Release:
    request_id: str


@dataclass(slots=True)
class _Call:
    fn: Callable[[EngineCore], object]
    future: concurrent.futures.Future[object]


_Command = tuple[GenerateRequest, Sink, float] | str | _Stop | _Call | _Received | _Release
KVReader = Callable[[ReceivePlan], None]
_SinkCall = tuple[Callable[[Any], None], Any]  # a sink's `deliver` or `fail` and what to give it
_MAX_CONCURRENT_READS = 4


class _Driver(abc.ABC):
    """What both drivers keep: the open requests and their sinks, recent timings, the KV read pool. Calls
    run on the driver's side (the engine thread, or the loop for the inline driver) unless marked."""

    def __init__(self, build: Callable[[], EngineCore], *, on_kv_events: Callable[[list[KVEvent]], None] | None,
                 kv_reader: KVReader | None) -> None:
        self._build = build
        self.kv_reader = kv_reader
        self._readers: concurrent.futures.ThreadPoolExecutor | None = None
        self._on_kv_events = on_kv_events  # called on the asyncio loop with each step's KV events, in order
        self.engine: EngineCore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._open: dict[str, _Open] = {}
        self._timings: deque[RequestTiming] = deque(maxlen=NUM_TIMINGS_KEPT)
        self.failure: BaseException | None = None

    @property
    def num_open_requests(self) -> int:
        return len(self._open)

    def recent_timings(self) -> list[RequestTiming]:
        """Timings of up to the last 4096 finished requests, oldest first."""
        return list(self._timings)

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
            self._call(lambda: _hand_to_sinks(errors))

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

    def _add(self, request: GenerateRequest, sink: Sink, arrival_s: float, errors: list[_SinkCall]) -> None:
        """Queue `request` on the engine; a request the engine refuses adds its sink's `fail` to `errors`."""
        assert self.engine is not None
        try:
            self.engine.add_request(request.token_ids, request.params, request.request_id,
                                    prefill_only=request.prefill_only, remote=request.remote_prefill)
        except InvalidRequestError as exc:
            errors.append((sink.fail, RequestError(request_id=request.request_id, message=str(exc),
                                                   param=exc.param)))
            return
        self._open[request.request_id] = _Open(sink, arrival_s)

    def _deliver(self, deltas: list[TokenDelta]) -> None:
        if not deltas:
            return
        now = time.monotonic()
        by_sink: dict[int, tuple[Sink, list[TokenDelta]]] = {}
        for delta in deltas:
            state = self._open.get(delta.request_id)
            if state is None:
                continue
            if state.first_token_s is None:
                state.first_token_s = now
            if delta.finished:
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
            _hand_to_sinks(here)
        if on_loop:
            self._call(lambda: _hand_to_sinks(on_loop))


class EngineLoop(_Driver):
    """Steps the engine on its own thread (see the module doc)."""

    def __init__(self, build: Callable[[], EngineCore], *, name: str = "engine", nice: int = 0,
                 on_kv_events: Callable[[list[KVEvent]], None] | None = None,
                 kv_reader: KVReader | None = None) -> None:
        """`kv_reader(plan)` reads a remote prefill's blocks (on a pool thread), raising KVTransferError when
        it cannot; without one, such requests prefill here."""
        super().__init__(build, on_kv_events=on_kv_events, kv_reader=kv_reader)
        self._nice = nice
        self._built = threading.Event()
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._handover: list[Callable[[], object]] = []  # for the loop, oldest first (see `_call`)
        self._handover_lock = threading.Lock()

    # ---- any thread ----------------------------------------------------------------------------------

    def start(self) -> EngineCore:
        """Start the thread, build the engine on it, and return the engine; re-raises a build failure."""
        self._thread.start()
        self._built.wait()
        if self.engine is None:
            raise self.failure or RuntimeError("the engine was not built")
        return self.engine

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver output on `loop` from now on; call before the first `submit`."""
        self._loop = loop

    def submit(self, request: GenerateRequest, sink: Sink) -> None:
        self._commands.put((request, sink, time.monotonic()))

    def abort(self, request_id: str) -> None:
        self._commands.put(request_id)

    def release(self, request_id: str) -> None:
        """Free the KV a prefill-only request holds for its decode worker."""
        self._commands.put(_Release(request_id))

    def call(self, fn: Callable[[EngineCore], object]) -> concurrent.futures.Future[object]:
        """Run `fn(engine)` on the engine thread between steps (e.g. a prefix-cache reset or snapshot)."""
        future: concurrent.futures.Future[object] = concurrent.futures.Future()
        self._commands.put(_Call(fn, future))
        return future

    def stop(self, timeout_s: float = 10.0) -> None:
        self._commands.put(_Stop())
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._readers is not None:
            self._readers.shutdown(wait=False, cancel_futures=True)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.failure is None and self.engine is not None

    # ---- the engine thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        if self._nice:
            # Lower this thread's priority (and that of the OpenMP team it starts, which inherits it), so
            # the serving path on the same cores (this process's event loop, the gateway, clients)
            # preempts the engine the moment it has a token to move, instead of waiting for a time slice.
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + self._nice)
        try:
            self.engine = engine = self._build()
        except BaseException as exc:
            self.failure = exc
            return
        finally:
            self._built.set()
        try:
            stalled = False  # the last step could schedule nothing: wait for a command or a lease's end
            while self._apply_commands(block=stalled or not engine.has_unfinished_requests(),
                                       wake_s=engine.next_lease_end_s):
                self._start_receives(engine)
                if engine.num_leases:
                    engine.expire_leases(time.monotonic())
                stalled = False
                if engine.has_unfinished_requests():
                    self._deliver(engine.step())
                    stalled = engine.stalled
                self._forward_kv_events(engine)
            self._fail_open("the worker is stopping")
        except BaseException as exc:
            self._fail_engine(exc)

    def _fail_open(self, message: str) -> None:
        while True:  # calls queued behind the stop get an answer too
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Call):
                command.future.set_exception(RuntimeError(_STOPPED))
        super()._fail_open(message)

    def _begin_read(self, plan: ReceivePlan) -> None:
        self._reader_pool().submit(lambda: self._commands.put(_Received(plan.request_id, self._read(plan))))

    def _apply_commands(self, block: bool, wake_s: float | None = None) -> bool:
        """Apply queued commands (waiting for one when `block`, until `wake_s` at most); False once asked to
        stop."""
        errors: list[_SinkCall] = []
        try:
            if block:
                timeout_s = None if wake_s is None else max(0.0, wake_s - time.monotonic())
                command = self._commands.get(timeout=timeout_s)
            else:
                command = self._commands.get_nowait()
            while True:
                if isinstance(command, _Stop):
                    return False
                if isinstance(command, str):
                    self._abort(command)
                elif isinstance(command, _Received):
                    assert self.engine is not None
                    self._deliver_first(self.engine, command.request_id, command.failure)
                elif isinstance(command, _Release):
                    assert self.engine is not None
                    self.engine.release(command.request_id)
                elif isinstance(command, _Call):
                    _run_call(command, self.engine)
                else:
                    self._add(*command, errors)
                command = self._commands.get_nowait()
        except queue.Empty:
            pass
        finally:
            if errors:
                self._call(lambda: _hand_to_sinks(errors))
        return True

    def _call(self, fn: Callable[[], object]) -> None:
        """Run `fn` on the asyncio loop, after everything handed over before it. While the loop has not yet
        taken what was handed over, `fn` joins it: one wake-up of the loop per batch, not per step (a fast
        engine steps more often than a busy loop wakes, and each wake-up costs a syscall and a GIL hand-off)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with self._handover_lock:
            self._handover.append(fn)
            if len(self._handover) > 1:
                return  # the loop has a wake-up pending that will take this too
        try:
            loop.call_soon_threadsafe(self._take_handover)
        except RuntimeError:  # the loop closed meanwhile: nobody is left to deliver to
            pass

    def _take_handover(self) -> None:
        with self._handover_lock:
            handover, self._handover = self._handover, []
        for fn in handover:
            fn()


class InlineEngineLoop(_Driver):
    """Steps a non-blocking engine as a task on the asyncio loop (see the module doc). Its methods may be
    called from any thread; off the loop they are passed to it. Once stopped or broken it refuses work:
    requests fail (retryable) and calls raise."""

    def __init__(self, build: Callable[[], EngineCore], *,
                 on_kv_events: Callable[[list[KVEvent]], None] | None = None,
                 kv_reader: KVReader | None = None) -> None:
        super().__init__(build, on_kv_events=on_kv_events, kv_reader=kv_reader)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop_thread: int | None = None
        self._stopped = False

    def start(self) -> EngineCore:
        """Build the engine (here, now) and return it; it steps once `attach` gives it a loop."""
        self.engine = self._build()
        return self.engine

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Step on `loop` from now on; call on that loop, before the first `submit`."""
        self._loop, self._loop_thread = loop, threading.get_ident()
        self._wake = asyncio.Event()
        self._task = loop.create_task(self._drive(), name="engine")

    def submit(self, request: GenerateRequest, sink: Sink) -> None:
        if self._elsewhere(self.submit, request, sink):
            return
        if not self.is_alive:
            sink.fail(RequestError(request_id=request.request_id, message=_STOPPED,
                                   retryable=True))
            return
        errors: list[_SinkCall] = []
        arrival_s = time.monotonic()
        try:
            self._add(request, sink, arrival_s, errors)
        except Exception as exc:  # the engine broke taking it: fail it with the rest
            self._open.setdefault(request.request_id, _Open(sink, arrival_s))
            self._break(exc)
            return
        _hand_to_sinks(errors)
        self._poke()

    def abort(self, request_id: str) -> None:
        if not self._elsewhere(self.abort, request_id) and self.is_alive:
            self._guard(self._abort, request_id)
            self._poke()  # its blocks may be what a stalled step waits for

    def release(self, request_id: str) -> None:
        """Free the KV a prefill-only request holds for its decode worker."""
        if not self._elsewhere(self.release, request_id) and self.is_alive:
            assert self.engine is not None
            self._guard(self.engine.release, request_id)
            self._poke()

    def call(self, fn: Callable[[EngineCore], object]) -> concurrent.futures.Future[object]:
        """Run `fn(engine)` between steps (at once when called on the loop)."""
        future: concurrent.futures.Future[object] = concurrent.futures.Future()
        if not self._elsewhere(self._call_here, _Call(fn, future)):
            self._call_here(_Call(fn, future))
        return future

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop stepping and fail what is open (retryable)."""
        done = threading.Event()
        if not self._elsewhere(self._stop_here, done):
            self._stop_here(done)
        done.wait(timeout_s)

    @property
    def is_alive(self) -> bool:
        return (self.engine is not None and self.failure is None and not self._stopped
                and (self._task is None or not self._task.done()))

    # ---- on the loop ---------------------------------------------------------------------------------

    def _elsewhere(self, fn: Callable[..., object], *args: object) -> bool:
        """True when called off the loop's thread: `fn(*args)` is then queued on the loop instead. False on
        the loop's thread, and once the loop is closed (nothing runs there any more: the caller goes on)."""
        loop = self._loop
        if loop is None or threading.get_ident() == self._loop_thread or loop.is_closed():
            return False
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed meanwhile
            return False
        return True

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _call_here(self, call: _Call) -> None:
        if not self.is_alive:
            if call.future.set_running_or_notify_cancel():
                call.future.set_exception(RuntimeError(_STOPPED))
            return
        _run_call(call, self.engine)
        assert self.engine is not None
        self._forward_kv_events(self.engine)  # e.g. a prefix-cache reset's event, while no request steps

    def _guard(self, fn: Callable[[str], object], request_id: str) -> None:
        try:
            fn(request_id)
        except Exception as exc:
            self._break(exc)

    def _break(self, exc: BaseException) -> None:
        """The engine failed outside a step: stop stepping and fail everything open, as a failed step does."""
        if self._task is not None:
            self._task.cancel()
        self._fail_engine(exc)

    def _stop_here(self, done: threading.Event) -> None:
        self._stopped = True
        if self._task is not None:
            self._task.cancel()
        if self._readers is not None:
            self._readers.shutdown(wait=False, cancel_futures=True)
        self._fail_open("the worker is stopping")
        done.set()

    def _call(self, fn: Callable[[], object]) -> None:
        try:
            fn()  # already on the loop
        except Exception:  # e.g. the KV event hook: logged, and the engine steps on
            logger.exception("handing the engine's output over failed")

    def _begin_read(self, plan: ReceivePlan) -> None:
        assert self._loop is not None
        read = self._loop.run_in_executor(self._reader_pool(), self._read, plan)
        read.add_done_callback(lambda done: self._end_read(plan.request_id, done))

    def _end_read(self, request_id: str, read: asyncio.Future[str | None]) -> None:
        if read.cancelled() or not self.is_alive:
            return
        assert self.engine is not None
        try:
            self._deliver_first(self.engine, request_id, read.result())
        except Exception as exc:
            self._break(exc)
            return
        self._poke()

    async def _drive(self) -> None:
        engine = self.engine
        assert engine is not None and self._wake is not None
        held: list[TokenDelta] = []
        held_since_s = last_clock_s = 0.0
        try:
            while True:
                # anything that needs a pass from here on (a request, a read's end) sets the wake again
                self._wake.clear()
                self._start_receives(engine)
                if engine.num_leases:
                    engine.expire_leases(time.monotonic())
                stepped = False
                step_s = 0.0
                if engine.has_unfinished_requests():
                    started_s = time.monotonic()
                    deltas = engine.step()
                    stepped = not engine.stalled  # a stalled step waits for blocks to be freed, not in a spin
                    if stepped:
                        # the step's tokens exist at its modelled end; the wait (or, under the timer's
                        # resolution, a bare yield) lets requests that come meanwhile join the next step
                        wait_s = engine.next_step_s - time.monotonic()
                        await asyncio.sleep(wait_s if wait_s >= _MIN_SLEEP_S else 0)
                        # the step's length, or where the engine paces itself (a mocker), its modelled one: a
                        # step that caught up on a late clock ends early, but the next takes its full time
                        ended_s, clock_s = time.monotonic(), engine.next_step_s
                        step_s = max(ended_s - started_s, clock_s - last_clock_s)
                        last_clock_s = clock_s
                        if deltas and not held:
                            held_since_s = ended_s
                        held += deltas
                # tokens wait for the next step only while it should end within the window (module doc)
                if held and (not stepped or not engine.has_unfinished_requests()
                             or time.monotonic() + step_s - held_since_s >= _COALESCE_S):
                    self._deliver(held)  # a request aborted meanwhile is no longer open: skipped
                    held = []
                self._forward_kv_events(engine)
                if not stepped:
                    await self._idle(engine.next_lease_end_s)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._fail_engine(exc)

    async def _idle(self, wake_s: float | None) -> None:
        """Wait to be woken (a request, a read's end), or until `wake_s` (when the oldest lease ends)."""
        assert self._wake is not None
        if wake_s is None:
            await self._wake.wait()
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), max(0.0, wake_s - time.monotonic()))


def _hand_to_sinks(calls: list[_SinkCall]) -> None:
    """`fn(arg)` for each pair: a sink that raises loses its own output, not the others'."""
    for fn, arg in calls:
        try:
            fn(arg)
        except Exception:
            logger.exception("a sink failed to take the engine's output")


def _run_call(call: _Call, engine: EngineCore | None) -> None:
    if not call.future.set_running_or_notify_cancel():
        return
    try:
        assert engine is not None
        call.future.set_result(call.fn(engine))
    except Exception as exc:  # handed to the caller through the future
        call.future.set_exception(exc)
