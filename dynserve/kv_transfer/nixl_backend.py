"""The NIXL backend: KV pages move by one-sided UCX READs between registered caches.

It owns one NIXL agent (UCX backend) per connector, the registration of the worker's KV tensor, the remote
agents it loaded, any transfer handle it could not cancel, and the way UCX makes progress.

Memory type follows the tensor's device (DRAM for CPU, VRAM for CUDA), so UCX picks cma on one host and
cuda_ipc/RDMA where the cache lives on GPUs. A read is one transfer request whose descriptors are the
coalesced block runs (one region per run on each side). UCX reads its configuration from `UCX_*`
environment variables when the agent is created, so the settings' transports and devices are put there
first unless the environment already names them.

Progress: a READ is carried out by the reader (process_vm_readv with cma), but the peer must make UCX
progress to accept a new connection and to take a notification, and a read posted after a notification
waits until the peer has taken it. NIXL's own progress thread does that but polls without pause: on a
2-core machine it cut read bandwidth to a third. So by default a poller thread here progresses UCX (and
collects notifications) every `transfer_progress_interval_s`: idle cost near zero, and at most that long
added to the first read of a connection and to a read that follows a notification.

Invariants: a transfer handle is released before `_read` returns, or kept in `_stuck_handles` until close;
the cache is registered at most once and deregistered on close; every call into the agent, the poller's
included, holds the connector's lock (the agent itself is created without internal locking).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any

import numpy as np

from dynserve.config import Settings
from dynserve.errors import KVTransferError
from dynserve.kv_transfer.connector import KVConnector, ReadPlan
from dynserve.kv_transfer.descriptors import BlockRun, KVLayout, NixlAgentMetadata, Notification

if TYPE_CHECKING:
    import torch

__all__ = ["NixlConnector", "apply_ucx_settings", "nixl_available"]

logger = logging.getLogger(__name__)

_MAX_POLL_SLEEP_S = 0.001  # the longest pause between two completion checks of a read in flight


def nixl_available() -> bool:
    """Whether the nixl package imports (it bundles UCX; no GPU needed)."""
    try:
        import nixl  # noqa: F401
    except ImportError:
        return False
    return True


def apply_ucx_settings(settings: Settings, environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Put the settings' UCX transports and devices into `environ` where it does not name them yet, for
    UCX to read when an agent is created. Returns what it set."""
    wanted = {"UCX_TLS": settings.transfer_ucx_tls, "UCX_NET_DEVICES": settings.transfer_ucx_net_devices}
    applied = {name: value for name, value in wanted.items() if value and name not in environ}
    environ.update(applied)
    return applied


def _nixl_errors() -> tuple[type[BaseException], ...]:
    """NIXL's binding exceptions share no base class; the wrapper itself raises the builtins below."""
    from nixl import _bindings

    found = [getattr(_bindings, n) for n in dir(_bindings) if n.startswith("nixl") and n.endswith("Error")]
    return (*found, RuntimeError, TypeError, ValueError, KeyError)


def _mem_type(device: str) -> str:
    return "VRAM" if device.startswith("cuda") else "DRAM"


class NixlConnector(KVConnector):
    backend = "nixl"
    metadata_type = NixlAgentMetadata

    def __init__(self, agent_name: str, settings: Settings) -> None:
        super().__init__(agent_name, settings)
        applied = apply_ucx_settings(settings)
        try:
            from nixl._api import nixl_agent, nixl_agent_config

            self._errors = _nixl_errors()
            config = nixl_agent_config(enable_prog_thread=settings.transfer_progress_thread, backends=["UCX"])
            self._agent: Any = nixl_agent(agent_name, config)
        except ImportError as exc:
            raise KVTransferError(f"nixl is not installed: {exc}", backend=self.backend) from None
        except Exception as exc:  # the agent's constructor raises what its plugins raise
            raise KVTransferError(f"cannot create NIXL agent {agent_name!r}: {exc!r}",
                                  backend=self.backend) from exc
        if "UCX" not in self._agent.backends:
            raise KVTransferError("NIXL has no UCX backend here", backend=self.backend)
        logger.info("NIXL agent %s created (UCX settings applied: %s)", agent_name, applied or "none")
        self._reg_descs: Any = None
        self._base_address = 0
        self._device_id = 0
        self._mem_type = "DRAM"
        self._peer_metadata: dict[str, NixlAgentMetadata] = {}
        self._stuck_handles: list[Any] = []
        self._inbox: collections.deque[Notification] = collections.deque()
        self._stop_polling = threading.Event()
        if not settings.transfer_progress_thread:
            poller = threading.Thread(target=self._poll_loop, name=f"kv-nixl-poll-{agent_name}", daemon=True)
            poller.start()

    def _poll_loop(self) -> None:
        while not self._stop_polling.wait(self.settings.transfer_progress_interval_s):
            with self._lock:
                if self._closed:
                    return
                try:
                    self._collect_notifications()
                except self._errors:
                    logger.warning("%s: progressing UCX failed", self.agent_name, exc_info=True)

    # ---- registration and peers ------------------------------------------------------------------------

    def _register(self, kv_cache: torch.Tensor, layout: KVLayout) -> None:
        device = kv_cache.device
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"NIXL registers CPU or CUDA memory, not {device.type}")
        self._mem_type = _mem_type(layout.device)
        self._device_id = device.index or 0
        self._base_address = kv_cache.data_ptr()
        region = [(self._base_address, layout.size_bytes, self._device_id, "")]
        try:
            self._reg_descs = self._agent.register_memory(self._agent.get_reg_descs(region, self._mem_type))
        except self._errors as exc:
            self._reg_descs = None
            raise KVTransferError(f"registering the KV cache failed: {exc!r}", backend=self.backend) from exc

    def _metadata(self, layout: KVLayout) -> NixlAgentMetadata:
        return NixlAgentMetadata(agent_name=self.agent_name, layout=layout, base_address=self._base_address,
                                 device_id=self._device_id, nixl_metadata=self._agent.get_agent_metadata())

    def _add_peer(self, peer: NixlAgentMetadata) -> None:  # type: ignore[override]
        name = peer.agent_name
        try:
            loaded = self._agent.add_remote_agent(peer.nixl_metadata)
        except self._errors as exc:
            raise KVTransferError(f"loading peer {name!r} failed: {exc!r}", backend=self.backend,
                                  peer=name) from exc
        loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        try:
            if loaded_name != name:
                raise KVTransferError(f"peer metadata names agent {loaded_name!r}, not {name!r}",
                                      backend=self.backend, peer=name)
            self._agent.make_connection(name)  # connect now rather than on the first read
        except (KVTransferError, *self._errors) as exc:
            self._invalidate(loaded_name)
            if isinstance(exc, KVTransferError):
                raise
            raise KVTransferError(f"connecting to peer {name!r} failed: {exc!r}", backend=self.backend,
                                  peer=name) from exc
        self._peer_metadata[name] = peer

    def _remove_peer(self, peer: str) -> None:
        self._peer_metadata.pop(peer, None)
        self._invalidate(peer)

    def _invalidate(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except self._errors:
            logger.debug("%s: NIXL had no remote agent %s", self.agent_name, name)

    # ---- reads and notifications ----------------------------------------------------------------------

    def _descs(self, runs: list[BlockRun], peer: NixlAgentMetadata) -> tuple[Any, Any]:
        """Local and remote transfer descriptor lists: row i of each is run i (address, length, device)."""
        size = self._layout.block_size_bytes  # type: ignore[union-attr]
        local = np.array([(self._base_address + r.local_offset_bytes(size), r.size_bytes(size),
                           self._device_id) for r in runs], dtype=np.uint64)
        remote = np.array([(peer.base_address + r.remote_offset_bytes(size), r.size_bytes(size),
                            peer.device_id) for r in runs], dtype=np.uint64)
        return (self._agent.get_xfer_descs(local, self._mem_type),
                self._agent.get_xfer_descs(remote, _mem_type(peer.layout.device)))

    def _read(self, plan: ReadPlan) -> None:
        peer = self._peer_metadata[plan.peer]
        try:
            local, remote = self._descs(plan.runs, peer)
            handle = self._agent.initialize_xfer("READ", local, remote, plan.peer)
        except self._errors as exc:
            raise self._error(f"preparing a READ from {plan.peer!r} failed: {exc!r}", plan) from exc
        try:
            state = self._agent.transfer(handle)
            sleep_s = 0.0
            while state == "PROC":
                if time.monotonic() >= plan.deadline_s:
                    raise self._timeout(plan, cancelled=self._release(handle))
                time.sleep(sleep_s)
                sleep_s = min(_MAX_POLL_SLEEP_S, sleep_s * 2 or 1e-5)
                state = self._agent.check_xfer_state(handle)
        except self._errors as exc:
            self._release(handle)
            raise self._error(f"READ from {plan.peer!r} failed: {exc!r}", plan) from exc
        self._release(handle)
        if state != "DONE":
            raise self._error(f"READ from {plan.peer!r} ended in state {state}", plan)

    def _release(self, handle: Any) -> bool:
        """Release a transfer handle (cancelling it if in flight); False, keeping it, when NIXL cannot."""
        try:
            handle.release()
        except self._errors:
            logger.warning("%s: a NIXL transfer could not be cancelled; kept until close", self.agent_name)
            self._stuck_handles.append(handle)
            return False
        return True

    def _notify(self, peer: str, message: bytes) -> None:
        try:
            self._agent.send_notif(peer, message)
        except self._errors as exc:
            raise KVTransferError(f"notifying {peer!r} failed: {exc!r}", backend=self.backend,
                                  peer=peer) from exc

    def _collect_notifications(self) -> None:
        """Progress UCX and move the notifications that arrived into the inbox."""
        for peer, messages in self._agent.get_new_notifs().items():
            self._inbox.extend(Notification(str(peer), bytes(message)) for message in messages)

    def _take_notifications(self) -> list[Notification]:
        self._collect_notifications()
        taken = list(self._inbox)
        self._inbox.clear()
        return taken

    def _close(self) -> None:
        self._stop_polling.set()  # the poller sees `_closed` once it holds the lock, and returns
        for handle in self._stuck_handles:
            try:
                handle.release()
            except self._errors:
                logger.warning("%s: a NIXL transfer is still in flight at close", self.agent_name)
        self._stuck_handles.clear()
        if self._reg_descs is not None:
            try:
                self._agent.deregister_memory(self._reg_descs)
            except self._errors:
                logger.warning("%s: deregistering the KV cache failed", self.agent_name, exc_info=True)
            self._reg_descs = None
        self._agent = None
