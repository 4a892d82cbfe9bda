"""`InlineEngineLoop`: steps an engine as a task on the asyncio loop itself, for engines whose steps cost
microseconds of Python and never block (the mocker's: `step()` returns at once and `next_step_s` says when
its modelled time is up). What every driver keeps (open requests, timings, KV reads, delivery) is
`Driver`'s (`driver.py`); a model's engine steps on a thread instead (`engine_loop.py`).

No thread, no command queue, no hand-off and no GIL traffic between two threads per step: at a high speedup
those cost a mocker more CPU than its steps (its engine thread, at 2 tokens a step, spent twice the CPU of
its I/O thread; docs/benchmarks.md). After each step the task waits for the step's modelled end, then
delivers its tokens: on the loop's timer when that end is at least `_MIN_SLEEP_S` ahead, else with a bare
yield (the engine's clock carries the difference into the next step). Either way the loop serves I/O
between steps.

Delivery coalesces short steps: a step's tokens are held and go out with the next step's while that step
should end within `_COALESCE_S` of the oldest held token (judged by the last step's length, modelled or on
the wall clock, whichever is longer), and at once when the engine runs out of work. So each hop after the
worker (its write, the gateway's read and wake-ups, the client's writes) is paid once per frame, not once
per step of a fast mocker; a step of `_COALESCE_S` or longer (any real model, a mocker at the speedups the
routing and disaggregation benchmarks use) still delivers its tokens alone. The window is short because a
gateway that sleeps between deliveries wakes late for the last one.

Invariants: the engine is touched only on the loop's thread (a call from another thread is passed to the
loop); once stopped or broken the driver refuses work (requests fail, retryable; calls raise), and every
open request has had its retryable error; besides `Driver`'s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable

from dynserve.engine.core import EngineCore, ReceivePlan
from dynserve.protocol import GenerateRequest, KVEvent, RequestError, TokenDelta
from dynserve.workers.driver import (
    STOPPED_MESSAGE,
    Driver,
    EngineCall,
    KVReader,
    OpenRequest,
    Sink,
    SinkCall,
    hand_to_sinks,
    run_call,
)

__all__ = ["InlineEngineLoop"]

logger = logging.getLogger(__name__)

_MIN_SLEEP_S = 0.001  # the asyncio loop's timers have millisecond resolution: shorter waits are not slept
_COALESCE_S = 0.0005  # the inline loop holds a fast engine's tokens up to this long, to send them together


class InlineEngineLoop(Driver):
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
            sink.fail(RequestError(request_id=request.request_id, message=STOPPED_MESSAGE,
                                   retryable=True))
            return
        errors: list[SinkCall] = []
        arrival_s = time.monotonic()
        try:
            self._add(request, sink, arrival_s, errors)
        except Exception as exc:  # the engine broke taking it: fail it with the rest
            self._open.setdefault(request.request_id, OpenRequest(sink, arrival_s))
            self._break(exc)
            return
        hand_to_sinks(errors)
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
        if not self._elsewhere(self._call_here, EngineCall(fn, future)):
            self._call_here(EngineCall(fn, future))
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

    def _call_here(self, call: EngineCall) -> None:
        if not self.is_alive:
            if call.future.set_running_or_notify_cancel():
                call.future.set_exception(RuntimeError(STOPPED_MESSAGE))
            return
        run_call(call, self.engine)
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
        idle = True  # the last pass ran no step: the next step's decodes had no step before it
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
                        if self.metrics is not None and engine.stats.last_batch_size:  # it ran a batch
                            self.metrics.record_step(engine.stats, step_s, ended_s, idle)
                        if deltas and not held:
                            held_since_s = ended_s
                        held += deltas
                # tokens wait for the next step only while it should end within the window (module doc)
                if held and (not stepped or not engine.has_unfinished_requests()
                             or time.monotonic() + step_s - held_since_s >= _COALESCE_S):
                    self._deliver(held)  # a request aborted meanwhile is no longer open: skipped
                    held = []
                self._forward_kv_events(engine)
                idle = not stepped
                if not stepped:
                    if self.metrics is not None:
                        self.metrics.snapshot_queue()  # what aborts changed since the last step
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
