"""The engine worker: a Ray actor that owns one engine and serves it over the worker channel.

Ray places and starts the actor, and is how its owner asks for its info, load and recent timings and
tells it to stop. Token traffic goes over the channel (`channel.py`): `start()` opens a TCP listener in the
actor's event loop and returns a `WorkerInfo` with its address. `generate()` is also offered as a Ray
streaming generator for callers that hold only the actor handle; both paths feed the same engine driver
(`engine_loop.py`: a thread for a model's engine, the actor's event loop for a mocker's).

Roles: `both` (aggregated), `prefill`, `decode`; the role labels the worker's load and metrics, and the
pools and routers use it to pick workers. A prefill or decode worker with a model also owns a KV transfer
connector (`kv_transfer/`) over its engine's KV cache: a prefill worker publishes the connector's metadata
in its `WorkerInfo` (so in the registry); a decode worker reads prefilled pages with it, finding a prefill
worker's metadata in the registry the first time it meets that worker. A mocker's reads are simulated
(`MockEngine.simulate_read`). A read that fails costs a local prefill (the engine driver), never the request.

Draining (`drain`): the worker refuses new requests (retryable, so a gateway that has not yet seen it leave
retries elsewhere), leaves the registry, lets its in-flight requests finish, then closes its channels after
flushing them; its owner (the pool) then ends the actor.

With `settings.mocker` set the worker runs the mocker's engine (`mocker.py`: the real scheduler, block
manager and KV events, simulated step times, no model) and everything else here is unchanged; such a worker
imports no torch and reserves almost no Ray CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

import msgspec

from dynserve.config import Settings
from dynserve.errors import (
    ChannelError,
    InvalidRequestError,
    KVTransferError,
    KVTransferTimeoutError,
    WorkerUnavailableError,
)
from dynserve.framing import encode_frame, read_frame
from dynserve.protocol import (
    AbortRequest,
    ClientFrame,
    DeltaBatch,
    GenerateRequest,
    KVEvent,
    KVSnapshot,
    ReleaseRequest,
    RequestError,
    RequestTiming,
    SamplingParams,
    SnapshotRequest,
    TokenDelta,
    WorkerInfo,
    WorkerLoad,
)
from dynserve.workers.channel import FrameWriter

__all__ = ["MOCKER_NUM_CPUS", "EngineWorker", "Role", "launch_worker", "reserved_cpus"]

logger = logging.getLogger(__name__)

Role = Literal["both", "prefill", "decode"]
# a mocker waits through its steps on its event loop: 64 of them fit in a 2-CPU Ray node
MOCKER_NUM_CPUS = 0.01
_CLIENT_FRAMES = msgspec.msgpack.Decoder(ClientFrame)


# KV events: at most one publish per 50 ms while they keep coming, so a busy worker's steps batch up into
# one publish (each costs the plane's actor CPU; at 50 ms the frontend benchmark's machine spent 8% less
# CPU in all than at 20: docs/benchmarks.md). A router sees a stream's blocks at most this much later;
# the first events after a quiet spell still go out at once, and a conversation's next turn comes seconds
# later.
_PUBLISH_INTERVAL_S = 0.05


class _ConnectionSink:
    """Writes one connection's deltas and errors, from the engine's thread or the loop's (`FrameWriter`);
    remembers its open requests to abort them on close."""

    thread_safe = True  # the engine thread delivers to it directly (see `Sink`)

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.frames = FrameWriter(writer.get_extra_info("socket"), asyncio.get_running_loop())
        self.open_request_ids: set[str] = set()  # each change is one atomic set operation, from either thread

    def deliver(self, deltas: list[TokenDelta]) -> None:
        for delta in deltas:
            if delta.finished:
                self.open_request_ids.discard(delta.request_id)
        self.write(DeltaBatch(deltas))

    def fail(self, error: RequestError) -> None:
        self.open_request_ids.discard(error.request_id)
        self.write(error)

    def write(self, frame: DeltaBatch | RequestError | WorkerLoad | KVSnapshot) -> None:
        self.frames.write(encode_frame(frame))

    async def close(self) -> None:
        """Send what is waiting, then end the connection."""
        await self.frames.close()
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


class _QueueSink:
    """Feeds one request's output to a Ray streaming generator."""

    thread_safe = False  # an asyncio queue: delivered on the loop

    def __init__(self) -> None:
        self.queue: asyncio.Queue[TokenDelta | RequestError] = asyncio.Queue()

    def deliver(self, deltas: list[TokenDelta]) -> None:
        for delta in deltas:
            self.queue.put_nowait(delta)

    def fail(self, error: RequestError) -> None:
        self.queue.put_nowait(error)


class EngineWorker:
    """One engine, one role. Construct it as a Ray actor (see `launch_worker`); `start()` before use."""

    def __init__(self, settings: Settings, worker_id: str, role: Role = "both", publish_events: bool = False
                 ) -> None:
        """`publish_events`: register on the event plane (Redis at `settings.redis_url`, else the one embedded
        in Ray), keep the lease alive, and publish every KV event there in order.

        The ports the worker serves (its channel, KV transfer) listen on `Settings.serving_addresses` of its
        node: announced at its Ray node's IP unless the node's environment says otherwise."""
        from dynserve.workers.engine_loop import EngineLoop, InlineEngineLoop

        if settings.num_threads is None:  # Ray sets OMP_NUM_THREADS=1 in actors; use the cores we may run on
            settings = settings.model_copy(update={"num_threads": len(os.sched_getaffinity(0))})
        node_ip = _ray_node_ip()
        # Addresses belong to the node, not to the driver that sent these settings: inside Ray they come from
        # this process's own environment (a worker pod's DYN_ADVERTISE_HOST, its pod IP) and Ray's node IP.
        node = settings if node_ip is None else Settings()
        bind_host, advertise_host = node.serving_addresses(node_ip)
        settings = settings.model_copy(update={"bind_host": bind_host, "advertise_host": advertise_host})
        self.worker_id, self.role, self.host, self.bind_host = worker_id, role, advertise_host, bind_host
        # The engine thread runs Python between kernels while holding the GIL; a short switch interval bounds
        # how long the channel's I/O thread waits to move a finished token (the default is 5 ms).
        sys.setswitchinterval(0.0005)
        _undo_ray_niceness()
        on_cpu = settings.mocker is None and (
            settings.device == "cpu" or (settings.device == "auto" and not _cuda_available()))
        self._settings = settings
        self._publish_events = publish_events
        self._outbox: asyncio.Queue[list[KVEvent]] | None = None
        self._background: list[asyncio.Task[None]] = []
        on_kv_events = self._queue_kv_events if publish_events else None
        self._runner: EngineLoop | InlineEngineLoop
        if settings.mocker is not None:  # microseconds of Python a step: it steps on this actor's event loop
            self._runner = InlineEngineLoop(lambda: _build_engine(settings), on_kv_events=on_kv_events)
        else:
            self._runner = EngineLoop(lambda: _build_engine(settings), name=f"engine-{worker_id}",
                                      nice=settings.engine_nice if on_cpu else 0, on_kv_events=on_kv_events)
        self.engine = self._runner.start()  # loads the model on the engine's own thread
        self.connector: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        if role != "both":
            self._setup_transfer()
        self._server: asyncio.Server | None = None
        self._info: WorkerInfo | None = None
        self._draining = False
        self._plane: Any = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._sinks: set[_ConnectionSink] = set()
        self._num_ray_streams = 0

    def _setup_transfer(self) -> None:
        """Give the engine its identity as a KV source and the loop its KV reader (see the module doc)."""
        self.engine.kv_source_id = self.worker_id
        if self._settings.mocker is not None:
            self._runner.kv_reader = self._read_simulated
            return
        import uuid

        from dynserve.kv_transfer import make_connector

        # a restarted worker keeps its id but is a new agent: peers must not reuse the old connection
        self.connector = make_connector(self._settings, f"{self.worker_id}-{uuid.uuid4().hex[:8]}")
        self.connector.register_kv_cache(self.engine.runner.kv_cache)
        self.engine.kv_agent_name = self.connector.agent_name
        self._runner.kv_reader = self._read_kv

    def _injected_fault(self, plan: Any) -> None:
        fault = self._settings.transfer_fault
        if fault == "error":
            raise KVTransferError("injected transfer fault", backend="fault-injection", peer=plan.source_worker_id,
                                  num_blocks=len(plan.local_block_ids))
        if fault == "timeout":
            import time

            timeout_s = self._settings.transfer_timeout_s
            time.sleep(timeout_s)
            raise KVTransferTimeoutError(
                "injected transfer stall", backend="fault-injection", peer=plan.source_worker_id,
                num_blocks=len(plan.local_block_ids), timeout_s=timeout_s, elapsed_s=timeout_s, cancelled=True)

    def _read_simulated(self, plan: Any) -> None:
        self._injected_fault(plan)
        self.engine.simulate_read(plan)

    def _read_kv(self, plan: Any) -> None:
        """On a read thread: the prefill worker's blocks into ours, meeting that worker first if needed."""
        self._injected_fault(plan)
        peer = plan.agent_name
        if peer is None:
            raise KVTransferError(f"worker {plan.source_worker_id} offers no transfer agent", backend="none")
        if peer not in self.connector.peers:
            self._meet(plan.source_worker_id, peer)
        try:
            self.connector.read_blocks(peer, plan.remote_block_ids, plan.local_block_ids)
        except KVTransferError:
            self.connector.remove_peer(peer)  # reconnect next time: the peer may have restarted
            raise

    def _meet(self, worker_id: str, agent_name: str) -> None:
        """Add the transfer agent of `worker_id` as a peer, from its record in the registry."""
        if self._plane is None or self._loop is None:
            raise KVTransferError("this worker has no registry to find its peers in", backend=self.connector.backend,
                                  peer=agent_name)
        listed = asyncio.run_coroutine_threadsafe(self._plane.workers(), self._loop).result(timeout=5.0)
        info = next((i for i in listed if i.worker_id == worker_id and i.kv_agent is not None), None)
        if info is None or info.kv_agent is None:
            raise KVTransferError(f"worker {worker_id} is not in the registry", backend=self.connector.backend,
                                  peer=agent_name)
        if self.connector.add_peer(info.kv_agent) != agent_name:
            raise KVTransferError(f"worker {worker_id} now runs another transfer agent",
                                  backend=self.connector.backend, peer=agent_name)

    async def start(self) -> WorkerInfo:
        if self._info is not None:
            return self._info
        self._loop = asyncio.get_running_loop()
        self._runner.attach(self._loop)
        self._server = await asyncio.start_server(self._serve_connection, self.bind_host, 0)
        port = self._server.sockets[0].getsockname()[1]
        self._info = WorkerInfo(
            worker_id=self.worker_id, role=self.role, host=self.host, port=port, model_id=self.engine.model_id,
            max_model_len=self.engine.max_model_len, block_size=self.engine.block_manager.block_size,
            num_blocks=self.engine.block_manager.num_blocks,
            kv_agent=self.connector.metadata() if self.connector is not None and self.role == "prefill" else None,
        )
        logger.info("worker %s (%s) serving %s on %s:%d", self.worker_id, self.role, self.engine.model_id,
                    self.host, port)
        if self._publish_events:
            from dynserve.events.ray_plane import connect_event_plane

            self._plane = plane = connect_event_plane(self._settings.redis_url, self._settings.namespace)
            await plane.register(self._info, self._settings.worker_lease_s)
            self._outbox = asyncio.Queue()
            self._heartbeat = asyncio.create_task(self._heartbeat_forever(plane))
            self._background = [asyncio.create_task(self._publish_forever(plane)), self._heartbeat]
        return self._info

    def _queue_kv_events(self, events: list[KVEvent]) -> None:
        if self._outbox is not None:
            self._outbox.put_nowait(events)

    async def _publish_forever(self, plane: Any) -> None:
        """One publisher, so events reach the plane in the order the engine emitted them. Events after a quiet
        spell go out at once; while they keep coming, at most one batch goes out per `_PUBLISH_INTERVAL_S`
        (each publish is a call to the plane, which under load costs more CPU than the routing it informs)."""
        assert self._outbox is not None
        last_publish_s = -_PUBLISH_INTERVAL_S
        while True:
            events = await self._outbox.get()
            wait_s = last_publish_s + _PUBLISH_INTERVAL_S - time.monotonic()
            if wait_s > 0:  # a stream of events: the steps of the interval go out as one batch
                await asyncio.sleep(wait_s)
            last_publish_s = time.monotonic()
            while not self._outbox.empty():
                events = events + self._outbox.get_nowait()
            try:
                await plane.publish(self.worker_id, events)
            except Exception:  # the plane is down: routers will see the gap and resync
                logger.exception("worker %s could not publish %d KV events", self.worker_id, len(events))

    async def _heartbeat_forever(self, plane: Any) -> None:
        assert self._info is not None
        while True:
            await asyncio.sleep(self._settings.worker_lease_s / 3)
            try:
                await plane.register(self._info, self._settings.worker_lease_s)
            except Exception:
                logger.exception("worker %s could not renew its lease", self.worker_id)

    async def _send_snapshot(self, sink: _ConnectionSink) -> None:
        hashes, last_event_id = await self.kv_snapshot()
        sink.write(KVSnapshot(worker_id=self.worker_id, block_hashes=hashes, last_event_id=last_event_id))

    async def kv_snapshot(self) -> tuple[list[int], int | None]:
        """(every cached block hash, the id of the last KV event they reflect), taken between steps."""
        def take(engine: Any) -> tuple[list[int], int | None]:
            blocks = engine.block_manager
            return blocks.cached_block_hashes(), blocks.last_event_id

        return await asyncio.wrap_future(self._runner.call(take))  # type: ignore[arg-type]

    def load(self) -> WorkerLoad:
        scheduler, blocks = self.engine.scheduler, self.engine.block_manager
        return WorkerLoad(
            worker_id=self.worker_id, role=self.role, num_blocks_used=blocks.num_used_blocks,
            num_blocks_total=blocks.num_blocks, num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting) + self.engine.num_receiving,
        )

    def is_healthy(self) -> bool:
        return self._runner.is_alive

    def recent_timings(self) -> list[RequestTiming]:
        return self._runner.recent_timings()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Ray streaming generator over one request's deltas (the channel is the fast path)."""
        sink = _QueueSink()
        self._num_ray_streams += 1
        self._submit(request, sink)
        finished = False
        try:
            while not finished:
                item = await sink.queue.get()
                if isinstance(item, RequestError):
                    finished = True
                    if item.retryable:
                        raise WorkerUnavailableError(item.message, worker_id=self.worker_id)
                    raise InvalidRequestError(item.message, param=item.param)
                finished = item.finished
                yield item
        finally:
            self._num_ray_streams -= 1
            if not finished:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        self._runner.abort(request_id)

    async def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (between benchmark rounds, after a weight change)."""
        await asyncio.wrap_future(self._runner.call(lambda engine: engine.reset_prefix_cache()))

    async def drain(self, timeout_s: float) -> int:
        """Take no new requests, leave the registry, let in-flight requests finish for up to `timeout_s`, then
        close every channel once what was written to it is sent. Returns how many requests were still open
        at the deadline (they are failed, retryable). The actor stays up until its owner ends it."""
        self._draining = True
        if self._server is not None:
            self._server.close()  # no new connections; the open ones keep streaming
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        if self._plane is not None:
            try:
                await self._plane.deregister(self.worker_id)
            except Exception:  # the plane is down: the lease runs out instead
                logger.exception("worker %s could not leave the registry", self.worker_id)
        # a no-op call through the command queue: every request submitted before now is open in the loop
        await asyncio.wrap_future(self._runner.call(lambda _engine: None))
        deadline_s = asyncio.get_running_loop().time() + timeout_s
        while self._num_open() and asyncio.get_running_loop().time() < deadline_s:
            await asyncio.sleep(0.02)
        num_cut = self._num_open()
        if num_cut:
            logger.warning("worker %s: drain timed out after %.1f s with %d requests open", self.worker_id,
                           timeout_s, num_cut)
            await asyncio.to_thread(self._runner.stop)
            await asyncio.sleep(0)  # deliver the errors the stop queued on this loop
        await asyncio.gather(*(sink.close() for sink in list(self._sinks)))
        logger.info("worker %s drained (%d requests cut)", self.worker_id, num_cut)
        return num_cut

    def _num_open(self) -> int:
        return self._runner.num_open_requests + self._num_ray_streams

    async def stop(self) -> None:
        """Stop accepting work, fail what is open (retryable), and stop the engine's driver."""
        self._draining = True
        if self._server is not None:
            self._server.close()
        for task in self._background:
            task.cancel()
        await asyncio.to_thread(self._runner.stop)
        if self.connector is not None:
            self.connector.close()

    # ---- the channel ---------------------------------------------------------------------------------

    def _submit(self, request: GenerateRequest, sink: Any) -> None:
        if self._info is None or self._draining or not self._runner.is_alive:
            sink.fail(RequestError(request_id=request.request_id, message=f"worker {self.worker_id} is not serving",
                                   retryable=True))
            return
        self._runner.submit(request, sink)

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sink = _ConnectionSink(writer)
        self._sinks.add(sink)
        try:
            while (body := await read_frame(reader)) is not None:
                frame = _CLIENT_FRAMES.decode(body)
                if isinstance(frame, GenerateRequest):
                    sink.open_request_ids.add(frame.request_id)
                    self._submit(frame, sink)
                elif isinstance(frame, AbortRequest):
                    sink.open_request_ids.discard(frame.request_id)
                    self.abort(frame.request_id)
                elif isinstance(frame, ReleaseRequest):
                    self._runner.release(frame.request_id)
                elif isinstance(frame, SnapshotRequest):
                    asyncio.create_task(self._send_snapshot(sink))
                else:
                    sink.write(self.load())
        except (ChannelError, msgspec.DecodeError, OSError) as exc:
            logger.warning("worker %s: dropping a client connection: %s", self.worker_id, exc)
        finally:
            self._sinks.discard(sink)
            for request_id in list(sink.open_request_ids):  # the client is gone: free what it left running
                self.abort(request_id)
            await sink.close()


def _undo_ray_niceness() -> None:
    """Ray starts worker processes at niceness 15, fit for batch tasks; a serving worker's I/O must not wait
    behind every other process on the host (the engine thread lowers its own priority, `engine_nice`). Puts
    each thread of this process back to niceness 0 where allowed (it needs CAP_SYS_NICE; without it the
    worker keeps Ray's niceness)."""
    for task in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ():
        with contextlib.suppress(OSError):
            if os.getpriority(os.PRIO_PROCESS, int(task)) > 0:
                os.setpriority(os.PRIO_PROCESS, int(task), 0)


def _ray_node_ip() -> str | None:
    """The IP of the Ray node this process runs on (other nodes reach it there); None outside Ray."""
    ray = sys.modules.get("ray")  # an actor has Ray imported; a standalone worker has not
    if ray is None or not ray.is_initialized():
        return None
    return ray.util.get_node_ip_address()  # type: ignore[no-any-return]


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _build_engine(settings: Settings) -> Any:
    if settings.mocker is not None:
        from dynserve.workers.mocker import MockEngine

        return MockEngine(settings, sleep=False)  # nothing to warm up; `InlineEngineLoop` paces its steps
    from dynserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(settings)
    # one tiny request before serving, so kernel builds and first-touch allocations do not land on a
    # user's first request (a prompt shorter than a block caches nothing and emits no KV events)
    engine.generate([engine.tokenizer.encode("warm up")], SamplingParams(max_tokens=2, temperature=0))
    return engine


def reserved_cpus(settings: Settings) -> float:
    """Ray CPUs a worker reserves: `worker_num_cpus` when it was set, else its default for a model worker
    and `MOCKER_NUM_CPUS` for a mocker."""
    if settings.mocker is not None and "worker_num_cpus" not in settings.model_fields_set:
        return MOCKER_NUM_CPUS
    return settings.worker_num_cpus


def launch_worker(
    settings: Settings, worker_id: str, role: Role = "both", *, num_cpus: float | None = None,
    num_gpus: float = 0.0, publish_events: bool = False,
) -> tuple[Any, Any]:
    """Create the worker actor and start it; returns (actor handle, ObjectRef of its `WorkerInfo`).

    `num_cpus` defaults to `reserved_cpus(settings)`. A mocker worker when `settings.mocker` names a
    profile. Resolving the ref waits for the model to load. Ray must be initialized.
    """
    import ray

    if num_cpus is None:
        num_cpus = reserved_cpus(settings)
    # Ray starts actors with OMP_NUM_THREADS set to their CPU reservation (1 here); torch's later
    # set_num_threads does not undo that for its GEMMs, which then run up to 4x slower. Start the process
    # with the thread count the engine will use.
    num_threads = settings.num_threads or os.cpu_count() or 1
    actor_cls = ray.remote(EngineWorker)
    handle = actor_cls.options(
        num_cpus=num_cpus, num_gpus=num_gpus, name=f"dynserve-worker-{worker_id}", max_concurrency=1000,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": str(num_threads)}},
        scheduling_strategy="SPREAD",  # a pool's workers on as many nodes as can take them: a lost node costs few
    ).remote(settings.model_copy(update={"num_threads": num_threads}), worker_id, role, publish_events)
    return handle, handle.start.remote()
