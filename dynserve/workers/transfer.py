"""The KV-transfer side of a prefill or decode worker, or of an aggregated one with peer pulls
(`WorkerTransfer`): its engine's identity as a KV source, and the reader its engine driver calls for
requests prefilled elsewhere and for prefixes pulled from a peer.

A worker with a model owns a transfer connector (`kv_transfer/`) registered over its engine's KV cache: a
prefill worker publishes the connector's metadata in its `WorkerInfo` (so in the registry); a decode worker
reads prefilled pages with it, finding a prefill worker's metadata in the registry the first time it meets
that worker. A mocker has no connector: its reads are simulated (`MockEngine.simulate_read`).
`Settings.transfer_fault` injects a failed or stalled read into either kind, for tests.

Invariants: a read either fills the local blocks or raises `KVTransferError` (a timeout as
`KVTransferTimeoutError`), which the driver turns into a local prefill, never a failed request; a peer whose
read failed is forgotten, so the next read meets it again (it may have restarted as a new agent); each
connector has a fresh agent name, so peers never reuse a restarted worker's old connection. Reads run on the
driver's read threads; finding a peer asks the registry on the worker's event loop.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from dynserve.config import Settings
from dynserve.errors import KVTransferError, KVTransferTimeoutError

__all__ = ["WorkerTransfer"]


class WorkerTransfer:
    """Set up for `engine` at construction; `read` is the driver's `kv_reader`. `use_registry` says where to
    find peers once the worker is on the event plane; `close` ends the connector."""

    def __init__(self, settings: Settings, worker_id: str, engine: Any) -> None:
        self._settings, self._engine = settings, engine
        self.connector: Any = None
        self._plane: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.metrics: Any = None  # a `WorkerMetrics` counting every read, when the worker has one
        engine.kv_source_id = worker_id
        if settings.mocker is not None:
            self._read = self._read_simulated
            self.block_size_bytes = engine.block_manager.block_size * engine.profile.kv_bytes_per_token
            return
        from dynserve.kv_transfer import make_connector

        # a restarted worker keeps its id but is a new agent: peers must not reuse the old connection
        self.connector = make_connector(settings, f"{worker_id}-{uuid.uuid4().hex[:8]}")
        kv_cache = engine.runner.kv_cache
        self.connector.register_kv_cache(kv_cache)
        self.block_size_bytes = kv_cache[0].numel() * kv_cache.element_size()
        engine.kv_agent_name = self.connector.agent_name
        self._read = self._read_kv

    def read(self, plan: Any) -> None:
        """The driver's `kv_reader`, on a read thread: `plan`'s blocks into ours, or `KVTransferError`; each
        read is counted in the worker's metrics (bytes and seconds, or its failure's reason)."""
        metrics = self.metrics
        if metrics is None:
            self._read(plan)
            return
        started_s = time.monotonic()
        try:
            self._read(plan)
        except KVTransferTimeoutError:
            metrics.record_read_failure("transfer_timeout", pull=plan.pull)
            raise
        except Exception:
            metrics.record_read_failure("transfer_error", pull=plan.pull)
            raise
        metrics.record_read(len(plan.local_block_ids) * self.block_size_bytes, time.monotonic() - started_s,
                            pull=plan.pull)

    def use_registry(self, plane: Any, loop: asyncio.AbstractEventLoop) -> None:
        """Find peers in `plane`'s registry, asking it on `loop` (the worker's event loop)."""
        self._plane, self._loop = plane, loop

    def metadata(self) -> Any:
        """The connector's metadata, for a prefill worker's `WorkerInfo`; None for a mocker."""
        return None if self.connector is None else self.connector.metadata()

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()

    def _injected_fault(self, plan: Any) -> None:
        fault = self._settings.transfer_fault
        if fault == "error":
            raise KVTransferError("injected transfer fault", backend="fault-injection",
                                  peer=plan.source_worker_id, num_blocks=len(plan.local_block_ids))
        if fault == "timeout":
            timeout_s = self._settings.transfer_timeout_s
            time.sleep(timeout_s)
            raise KVTransferTimeoutError(
                "injected transfer stall", backend="fault-injection", peer=plan.source_worker_id,
                num_blocks=len(plan.local_block_ids), timeout_s=timeout_s, elapsed_s=timeout_s,
                cancelled=True)

    def _read_simulated(self, plan: Any) -> None:
        self._injected_fault(plan)
        self._engine.simulate_read(plan)

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
        backend = self.connector.backend
        if self._plane is None or self._loop is None:
            raise KVTransferError("this worker has no registry to find its peers in", backend=backend,
                                  peer=agent_name)
        listed = asyncio.run_coroutine_threadsafe(self._plane.workers(), self._loop).result(timeout=5.0)
        info = next((i for i in listed if i.worker_id == worker_id and i.kv_agent is not None), None)
        if info is None or info.kv_agent is None:
            raise KVTransferError(f"worker {worker_id} is not in the registry", backend=backend,
                                  peer=agent_name)
        if self.connector.add_peer(info.kv_agent) != agent_name:
            raise KVTransferError(f"worker {worker_id} now runs another transfer agent", backend=backend,
                                  peer=agent_name)
