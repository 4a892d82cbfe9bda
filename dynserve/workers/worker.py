"""The engine worker: a Ray actor that owns one engine and serves it over the worker channel.

Ray places and starts the actor, and is how its owner asks for its info, load and recent timings and
tells it to stop. Token traffic goes over the channel (`channel.py`): `start()` opens a TCP listener in the
actor's event loop and returns a `WorkerInfo` with its address; a connection is served once its first
frame, the client's hello, presents `Settings.cluster_token` (when the fleet has one). Requests go to the
engine's driver (`engine_loop.py`: a thread for a model's engine; `inline_loop.py`: the actor's event loop
for a mocker's).
With `publish_events` the worker registers on the event plane and publishes its KV events there
(`registration.py`).

Roles: `both` (aggregated), `prefill`, `decode`; the role labels the worker's load and metrics, and the
pools and routers use it to pick workers. A prefill or decode worker also has a KV-transfer side
(`transfer.py`): a prefill worker publishes its connector's metadata in its `WorkerInfo` (so in the
registry); a decode worker reads prefilled pages from the prefill worker (a mocker's reads are simulated).
With peer pulls (`Settings.kv_peer_pulls`) an aggregated worker has one too: it publishes its metadata and
reads the prefix blocks a peer exported. A read that fails costs a local prefill (the engine driver), never
the request.

Hand-back: a gateway whose pool a worker joined asks the busier members to hand back requests queued on its
connection that never started (`HandBackRequest`); each ends with a `REQUEUE` delta and the gateway sends it
to another worker (`driver.Driver.hand_back`).

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
import functools
import logging
import os
import sys
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from dynserve.config import Settings
from dynserve.errors import ChannelError
from dynserve.framing import encode_frame, keep_alive, meant_for, read_frame, read_hello
from dynserve.model.resolve import resolve_model_path
from dynserve.protocol import (
    MEDIA,
    AbortRequest,
    ClientFrame,
    DeltaBatch,
    GenerateRequest,
    HandBackRequest,
    Hello,
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
from dynserve.workers.channel import FrameWriter, WarnOnce
from dynserve.workers.ray_start import worker_runtime_env
from dynserve.workers.registration import Registration
from dynserve.workers.transfer import WorkerTransfer

if TYPE_CHECKING:
    from dynserve.engine.block_manager import BlockManager

__all__ = ["MOCKER_NUM_CPUS", "EngineWorker", "Role", "kv_snapshot_of", "launch_mocker", "launch_worker",
           "reserved_cpus"]

logger = logging.getLogger(__name__)

Role = Literal["both", "prefill", "decode"]
# a mocker waits through its steps on its event loop: 64 of them fit in a 2-CPU Ray node
MOCKER_NUM_CPUS = 0.01
_CLIENT_FRAMES = msgspec.msgpack.Decoder(ClientFrame)


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


class EngineWorker:
    """One engine, one role. Construct it as a Ray actor (see `launch_worker`); `start()` before use."""

    def __init__(self, settings: Settings, worker_id: str, role: Role = "both", publish_events: bool = False
                 ) -> None:
        """`publish_events`: register on the event plane (Redis at `settings.redis_url`, else the one embedded
        in Ray), keep the lease alive, and publish every KV event there in order.

        The ports the worker serves (its channel, KV transfer) listen on `Settings.serving_addresses` of its
        node: announced at its Ray node's IP unless the node's environment says otherwise."""
        from dynserve.workers.engine_loop import EngineLoop
        from dynserve.workers.inline_loop import InlineEngineLoop

        if settings.num_threads is None:  # Ray sets OMP_NUM_THREADS=1 in actors; use the cores we may run on
            settings = settings.model_copy(update={"num_threads": len(os.sched_getaffinity(0))})
        node_ip = _ray_node_ip()
        if node_ip is not None and "torch" not in sys.modules:
            # Ray started this process with OMP_NUM_THREADS at its CPU reservation (1 here), and torch's later
            # set_num_threads does not undo that for every kernel library: nothing has loaded torch yet (its
            # imports are lazy), so the count the engine uses becomes the one its libraries read at load
            os.environ["OMP_NUM_THREADS"] = str(settings.num_threads)
        # Addresses belong to the node, not to the driver that sent these settings: inside Ray they come from
        # this process's own environment (a worker pod's DYN_ADVERTISE_HOST, its pod IP) and Ray's node IP.
        node = settings if node_ip is None else Settings()
        bind_host, advertise_host = node.serving_addresses(node_ip)
        settings = settings.model_copy(update={"bind_host": bind_host, "advertise_host": advertise_host})
        self.worker_id, self.role, self.host, self.bind_host = worker_id, role, advertise_host, bind_host
        # The engine thread runs Python between kernels while holding the GIL; a short switch interval bounds
        # how long the channel's I/O thread waits to move a finished token (the default is 5 ms).
        sys.setswitchinterval(0.0005)
        on_cpu = settings.mocker is None and (
            settings.device == "cpu" or (settings.device == "auto" and not _cuda_available()))
        self._settings = settings
        self._publish_events = publish_events
        self._registration: Registration | None = None  # on the event plane, from `start` (publish_events)
        on_kv_events = self._queue_kv_events if publish_events else None
        self._runner: EngineLoop | InlineEngineLoop
        if settings.mocker is not None:  # microseconds of Python a step: it steps on this actor's event loop
            self._runner = InlineEngineLoop(lambda: _build_engine(settings), on_kv_events=on_kv_events)
        else:
            self._runner = EngineLoop(lambda: _build_engine(settings), name=f"engine-{worker_id}",
                                      nice=settings.engine_nice if on_cpu else 0, on_kv_events=on_kv_events)
        self.engine = self._runner.start()  # loads the model on the engine's own thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._transfer: WorkerTransfer | None = None
        if role != "both" or settings.kv_peer_pulls:  # disaggregated, or reading peers' prefixes
            self._transfer = WorkerTransfer(settings, worker_id, self.engine)
            self._runner.kv_reader = self._transfer.read
        self._server: asyncio.Server | None = None
        self._metrics_server: Any = None  # serving the worker's Prometheus metrics, from `start`
        self._info: WorkerInfo | None = None
        self._draining = False
        self._sinks: set[_ConnectionSink] = set()
        self._refusals = WarnOnce()  # (peer, worker meant)

    async def start(self) -> WorkerInfo:
        if self._info is not None:
            return self._info
        self._loop = asyncio.get_running_loop()
        self._runner.attach(self._loop)
        self._server = await asyncio.start_server(self._serve_connection, self.bind_host, 0)
        keep_alive(self._server.sockets[0])  # inherited by each connection: a gateway that vanished ends
        port = self._server.sockets[0].getsockname()[1]
        try:
            metrics_port = self._serve_metrics() if self._settings.worker_metrics else None
        except OSError:  # e.g. a fixed metrics port taken: the worker does not start, nor leaves a listener
            self._server.close()
            raise
        self._info = WorkerInfo(
            worker_id=self.worker_id, role=self.role, host=self.host, port=port, model_id=self.engine.model_id,
            max_model_len=self.engine.max_model_len, block_size=self.engine.block_manager.block_size,
            num_blocks=self.engine.block_manager.num_blocks,
            kv_agent=(self._transfer.metadata() if self._transfer is not None and self.role != "decode"
                      else None),
            metrics_port=metrics_port, model_path=str(resolve_model_path(self._settings.model)),
        )
        logger.info("worker %s (%s) serving %s on %s:%d (metrics: %s)", self.worker_id, self.role,
                    self.engine.model_id, self.host, port, metrics_port)
        if self._publish_events:
            from dynserve.events.ray_plane import connect_event_plane

            plane = connect_event_plane(self._settings.redis_url, self._settings.namespace,
                                        cluster_token=self._settings.secret("cluster_token"))
            self._registration = Registration(plane, self.worker_id, self._settings.worker_lease_s)
            if self._transfer is not None:
                self._transfer.use_registry(plane, self._loop)  # where a decode worker meets its peers
            await self._registration.join(self._info)
        return self._info

    def _serve_metrics(self) -> int:
        """Record this worker's metrics and serve them on their own port; returns the port."""
        from dynserve.workers.metrics import WorkerMetrics, serve_metrics

        metrics = WorkerMetrics(self.worker_id, self.role, self.engine)
        self._runner.metrics = metrics
        if self._transfer is not None:
            self._transfer.metrics = metrics
        self._metrics_server, port = serve_metrics(metrics.registry, self.bind_host,
                                                   self._settings.worker_metrics_port)
        return port

    def _queue_kv_events(self, events: list[KVEvent]) -> None:
        if self._registration is not None:
            self._registration.queue_kv_events(events)

    async def _send_snapshot(self, sink: _ConnectionSink) -> None:
        sink.write(await self.kv_state())

    async def kv_state(self) -> KVSnapshot:
        """Every cached block hash, per medium (the KV tiers' blocks under `lower_block_hashes`), and the id
        of the last KV event they reflect: one consistent snapshot, taken between steps."""
        def take(engine: Any) -> KVSnapshot:
            return kv_snapshot_of(self.worker_id, engine.block_manager)

        return await asyncio.wrap_future(self._runner.call(take))  # type: ignore[arg-type]

    async def kv_snapshot(self) -> tuple[list[int], int | None]:
        """(every block hash cached on the device, the id of the last KV event they reflect)."""
        state = await self.kv_state()
        return state.block_hashes, state.last_event_id

    def load(self) -> WorkerLoad:
        scheduler, blocks = self.engine.scheduler, self.engine.block_manager
        return WorkerLoad(
            worker_id=self.worker_id, role=self.role, num_blocks_used=blocks.num_used_blocks,
            num_blocks_total=blocks.num_blocks, num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting) + self.engine.num_receiving,
        )

    def is_healthy(self) -> bool:
        return self._runner.is_alive

    async def until_dead(self) -> None:
        """Never answers: the pool's call fails when this actor dies, which is how it learns at once."""
        await asyncio.Event().wait()

    def recent_timings(self) -> list[RequestTiming]:
        return self._runner.recent_timings()

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
        if self._registration is not None:
            await self._registration.leave()
        # a no-op call through the command queue: every request submitted before now is open in the loop
        await asyncio.wrap_future(self._runner.call(lambda _engine: None))
        deadline_s = asyncio.get_running_loop().time() + timeout_s
        while self._runner.num_open_requests and asyncio.get_running_loop().time() < deadline_s:
            await asyncio.sleep(0.02)
        num_cut = self._runner.num_open_requests
        if num_cut:
            logger.warning("worker %s: drain timed out after %.1f s with %d requests open", self.worker_id,
                           timeout_s, num_cut)
            await asyncio.to_thread(self._runner.stop)
            await asyncio.sleep(0)  # deliver the errors the stop queued on this loop
        await asyncio.gather(*(sink.close() for sink in list(self._sinks)))
        logger.info("worker %s drained (%d requests cut)", self.worker_id, num_cut)
        return num_cut

    async def stop(self) -> None:
        """Stop accepting work, fail what is open (retryable), and stop the engine's driver."""
        self._draining = True
        if self._server is not None:
            self._server.close()
        if self._registration is not None:
            self._registration.cancel()
        await asyncio.to_thread(self._runner.stop)
        self.engine.close()  # its KV tiers' writer thread and disk directory
        if self._transfer is not None:
            self._transfer.close()
        if self._metrics_server is not None:
            await asyncio.to_thread(self._metrics_server.shutdown)
            self._metrics_server.server_close()

    # ---- the channel ---------------------------------------------------------------------------------

    def _submit(self, request: GenerateRequest, sink: Any) -> None:
        if self._info is None or self._draining or not self._runner.is_alive:
            sink.fail(RequestError(request_id=request.request_id, message=f"worker {self.worker_id} is not serving",
                                   retryable=True))
            return
        self._runner.submit(request, sink)

    def _log_refusal(self, peer: str, hello: Hello | None) -> None:
        """A refused channel: one without the cluster token is a warning each time; one meant for another
        worker (a gateway reconnecting to a gone worker's address, each poll until it hears the worker left)
        a warning the first time from each peer for each worker it means, then debug."""
        if hello is None:
            logger.warning("worker %s: refused a channel connection from %s (no hello with the cluster "
                           "token)", self.worker_id, peer)
            return
        logger.log(self._refusals.level((peer, hello.worker_id)),
                   "worker %s: refused a channel connection from %s meant for worker %s (gone; this worker "
                   "has its address now)", self.worker_id, peer, hello.worker_id)

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello = await read_hello(reader, self._settings.secret("cluster_token"))
        if hello is None or not meant_for(hello, self.worker_id):
            peer = writer.get_extra_info("peername")
            self._log_refusal(peer[0] if peer else "an unknown address", hello)
            writer.close()
            return
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
                elif isinstance(frame, HandBackRequest):
                    if not self._draining:  # a draining worker finishes what it has
                        self._runner.hand_back(sink, frame.max_requests)
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


def kv_snapshot_of(worker_id: str, block_manager: BlockManager) -> KVSnapshot:
    """`block_manager`'s cached hashes as the snapshot a router resyncs from: the device's in `block_hashes`,
    each KV tier's that holds any in `lower_block_hashes`. Call it between steps (on the engine's thread)."""
    by_medium = block_manager.cached_block_hashes_by_medium()
    device = by_medium.pop(MEDIA[0])
    return KVSnapshot(worker_id=worker_id, block_hashes=device, last_event_id=block_manager.last_event_id,
                      lower_block_hashes={medium: hashes for medium, hashes in by_medium.items() if hashes})


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
    num_gpus: float = 0.0, publish_events: bool = False, resources: dict[str, float] | None = None,
) -> tuple[Any, Any]:
    """Create the worker actor and start it; returns (actor handle, ObjectRef of its `WorkerInfo`).

    `num_cpus` defaults to `reserved_cpus(settings)`; `resources`: custom Ray resources it needs (a pool
    following its nodes: `dynserve_pool_<role>`). A mocker worker when `settings.mocker` names a
    profile; a `vllm_worker.VllmWorker` when `settings.engine` is vllm. Resolving the ref waits for the model
    to load. Ray must be initialized.
    """
    if num_cpus is None:
        num_cpus = reserved_cpus(settings)
    if settings.engine == "vllm":  # vLLM's server, started and attached by its own actor
        from dynserve.workers.vllm_worker import VllmWorker

        handle = _actor_class(VllmWorker).options(
            num_cpus=num_cpus, num_gpus=num_gpus, resources=resources or {}, name=f"dynserve-worker-{worker_id}",
            max_concurrency=100, scheduling_strategy="SPREAD", runtime_env=worker_runtime_env(),
        ).remote(settings, worker_id, role, publish_events)
        return handle, handle.start.remote()
    handle = _actor_class(EngineWorker).options(  # its thread count: its own node's cores unless set (__init__)
        num_cpus=num_cpus, num_gpus=num_gpus, resources=resources or {}, name=f"dynserve-worker-{worker_id}",
        max_concurrency=1000, runtime_env=worker_runtime_env(),
        scheduling_strategy="SPREAD",  # a pool's workers on as many nodes as can take them: a lost node costs few
    ).remote(settings, worker_id, role, publish_events)
    return handle, handle.start.remote()


@functools.cache
def _actor_class(cls: type) -> Any:
    """`cls` as a Ray actor class, made once a process. Ray exports an actor class the first time a job
    creates an actor of it, and a class made anew each launch was exported at every launch: hashing every
    method's bytecode cost 20-25 ms of the launching thread (the gateway's event loop, when its planner
    scales a pool) a worker."""
    import ray

    return ray.remote(cls)


def launch_mocker(settings: Settings, worker_id: str, *, role: Role = "both", profile: str | None = None,
                  speedup: float | None = None, publish_events: bool = False) -> tuple[Any, Any]:
    """Start a mocker worker actor (`launch_worker` with the mocker's engine, `mocker.py`, and a tiny CPU
    reservation); returns (actor handle, ObjectRef of its `WorkerInfo`). Ray must be initialized."""
    update: dict[str, Any] = {"mocker": profile or settings.mocker or "cpu"}
    if speedup is not None:
        update["mocker_speedup"] = speedup
    return launch_worker(settings.model_copy(update=update), worker_id, role, publish_events=publish_events)
