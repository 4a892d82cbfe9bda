"""`EngineLoop`: steps an engine on its own thread, for engines whose steps compute (the model's). What every
driver keeps (open requests, timings, KV reads, delivery) is `Driver`'s (`driver.py`); the mocker's engine
steps on the asyncio loop instead (`inline_loop.py`).

The engine is built on that same thread (`start` runs the builder there and waits for it): torch's OpenMP
thread team belongs to the thread that first runs a parallel op, and an engine stepping on one thread after
its model was loaded and warmed up on another runs 40-50% slower on CPU (docs/benchmarks.md). Other threads
talk to it through a command queue (`submit`, `abort`, `release`, `call`, `stop`), and the thread blocks on
that queue when the engine is idle, so an idle worker costs no CPU. After every step the deltas are grouped
by the `Sink` that owns each request. A thread-safe sink (a worker's connection) takes its group on the
engine thread at once, saving the loop's wake-up (`channel.FrameWriter`); the others' groups are handed to
the loop, and steps the loop has not taken yet go with the same wake-up (`_call`). A KV read's end comes
back as a command.

Invariants: once `start` returns only the engine thread steps the engine or changes its requests; commands
apply in the order they were queued, and a call queued behind a stop still gets an answer (an error);
besides `Driver`'s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from dynserve.engine.core import EngineCore, ReceivePlan
from dynserve.protocol import GenerateRequest, KVEvent
from dynserve.workers.driver import (
    STOPPED_MESSAGE,
    Driver,
    EngineCall,
    KVReader,
    Sink,
    SinkCall,
    hand_to_sinks,
    run_call,
)

__all__ = ["EngineLoop"]


class _Stop:
    pass


@dataclass(slots=True, frozen=True)
class _Received:
    request_id: str
    failure: str | None


@dataclass(slots=True, frozen=True)
class _Release:
    request_id: str


_Command = tuple[GenerateRequest, Sink, float] | str | _Stop | EngineCall | _Received | _Release


class EngineLoop(Driver):
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
        self._commands.put(EngineCall(fn, future))
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
            idle = True  # the last pass ran no step: the next step's decodes had no step before it
            while self._apply_commands(block=self._idling(engine, stalled), wake_s=engine.next_lease_end_s):
                self._start_receives(engine)
                if engine.num_leases:
                    engine.expire_leases(time.monotonic())
                stalled = False
                if engine.has_unfinished_requests():
                    started_s = time.monotonic()
                    deltas = engine.step()
                    stalled = engine.stalled
                    if self.metrics is not None and engine.stats.last_batch_size:  # a step that ran a batch
                        ended_s = time.monotonic()
                        self.metrics.record_step(engine.stats, ended_s - started_s, ended_s, idle)
                    idle = stalled
                    self._deliver(deltas)
                else:
                    idle = True
                self._forward_kv_events(engine)
            self._fail_open("the worker is stopping")
        except BaseException as exc:
            self._fail_engine(exc)

    def _idling(self, engine: EngineCore, stalled: bool) -> bool:
        """Whether the loop is about to wait for a command (nothing to step); the metrics' queue gauges are
        taken then, so what changed since the last step (aborts) shows while it waits."""
        idle = stalled or not engine.has_unfinished_requests()
        if idle and self.metrics is not None:
            self.metrics.snapshot_queue()
        return idle

    def _fail_open(self, message: str) -> None:
        while True:  # calls queued behind the stop get an answer too
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, EngineCall):
                command.future.set_exception(RuntimeError(STOPPED_MESSAGE))
        super()._fail_open(message)

    def _begin_read(self, plan: ReceivePlan) -> None:
        self._reader_pool().submit(lambda: self._commands.put(_Received(plan.request_id, self._read(plan))))

    def _apply_commands(self, block: bool, wake_s: float | None = None) -> bool:
        """Apply queued commands (waiting for one when `block`, until `wake_s` at most); False once asked to
        stop."""
        errors: list[SinkCall] = []
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
                elif isinstance(command, EngineCall):
                    run_call(command, self.engine)
                else:
                    self._add(*command, errors)
                command = self._commands.get_nowait()
        except queue.Empty:
            pass
        finally:
            if errors:
                self._call(lambda: hand_to_sinks(errors))
        return True

    def _call(self, fn: Callable[[], object]) -> None:
        """Run `fn` on the asyncio loop, after everything handed over before it. While the loop has not yet
        taken what was handed over, `fn` joins it: one wake-up of the loop per batch, not per step (a fast
        engine steps more often than a busy loop wakes, and each wake-up costs a syscall and a GIL
        hand-off)."""
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
