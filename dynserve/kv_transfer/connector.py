"""The connector interface: how one worker's agent reads KV blocks out of another worker's cache.

A connector belongs to one worker. Its life: `register_kv_cache` once (the whole block-major tensor, CPU or
GPU), publish `metadata()` through the worker registry, `add_peer` for each worker it will read from, then
`read_blocks` (a one-sided READ: the peer's CPU does nothing for it with NIXL, and only serves bytes with
TCP), `notify` the peer that its blocks may be released, and `close`.

Invariants the base class keeps for every backend:
- a failed call leaves no partial state: a registration that fails registers nothing, a peer that fails to
  be added is not known, a read that fails holds no transfer handle (unless the backend could not cancel
  it, which the timeout error says);
- every transfer failure is a `KVTransferError` (a `KVTransferTimeoutError` past the deadline), so the
  decode worker can fall back to prefilling locally; a `ValueError` means the caller's arguments are wrong;
- calls are serialized by one lock, so a connector may be shared by threads (a read blocks the others).
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import msgspec

from dynserve.config import Settings
from dynserve.errors import KVTransferError, KVTransferTimeoutError
from dynserve.kv_transfer.descriptors import (
    AgentMetadata,
    BlockRun,
    KVLayout,
    Notification,
    coalesce_block_runs,
    decode_metadata,
    encode_metadata,
    validate_block_ids,
)

if TYPE_CHECKING:
    import torch

__all__ = ["KVConnector", "ReadPlan", "ReadResult", "layout_of"]

logger = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class ReadResult:
    """What one `read_blocks` moved: `num_descriptors` regions (coalesced runs) on each side."""

    peer: str
    num_blocks: int
    num_descriptors: int
    size_bytes: int
    elapsed_s: float


@dataclass(slots=True, frozen=True)
class ReadPlan:
    """A validated read handed to a backend: its runs, and when it started and must end."""

    peer: str
    runs: list[BlockRun]
    num_blocks: int
    timeout_s: float
    start_s: float

    @property
    def deadline_s(self) -> float:
        return self.start_s + self.timeout_s


def layout_of(kv_cache: torch.Tensor) -> KVLayout:
    """The layout of a block-major KV cache; ValueError unless it is contiguous with at least one block."""
    if kv_cache.dim() < 1 or kv_cache.shape[0] < 1 or kv_cache.numel() == 0:
        raise ValueError(f"a KV cache needs at least one non-empty block, got shape {tuple(kv_cache.shape)}")
    if not kv_cache.is_contiguous():
        raise ValueError("the KV cache must be contiguous (block-major: one block is one region)")
    block_size_bytes = kv_cache[0].numel() * kv_cache.element_size()
    return KVLayout(num_blocks=kv_cache.shape[0], block_size_bytes=block_size_bytes,
                    device=str(kv_cache.device), dtype=str(kv_cache.dtype).removeprefix("torch."))


class KVConnector(abc.ABC):
    """One worker's transfer agent. Public methods validate and serialize; backends implement the `_` hooks.

    Every method raises `KVTransferError` once the connector is closed, except `close` (always safe).
    """

    backend: ClassVar[str]
    metadata_type: ClassVar[type[AgentMetadata]]  # type: ignore[valid-type]

    def __init__(self, agent_name: str, settings: Settings) -> None:
        if not agent_name:
            raise ValueError("agent_name must not be empty")
        self.agent_name = agent_name
        self.settings = settings
        self._lock = threading.Lock()
        self._layout: KVLayout | None = None
        self._kv_cache: torch.Tensor | None = None  # held so its memory outlives the registration
        self._peers: dict[str, KVLayout] = {}
        self._closed = False

    # ---- public interface -----------------------------------------------------------------------------

    @property
    def layout(self) -> KVLayout | None:
        """The registered cache's layout; None before `register_kv_cache`."""
        return self._layout

    @property
    def peers(self) -> list[str]:
        return sorted(self._peers)

    def register_kv_cache(self, kv_cache: torch.Tensor) -> KVLayout:
        """Register the worker's whole KV cache (block-major, contiguous; its device picks the memory type)
        for peers to read and for reads to land in. Once per connector; the connector holds the tensor until
        `close`, and its storage must not be resized or swapped. ValueError for a tensor that is not a block-major cache or a second call;
        KVTransferError when the backend refuses it (then nothing is registered)."""
        with self._lock:
            self._check_open()
            if self._layout is not None:
                raise ValueError("the KV cache is already registered")
            layout = layout_of(kv_cache)
            self._register(kv_cache, layout)
            self._layout, self._kv_cache = layout, kv_cache
            return layout

    def metadata(self) -> bytes:
        """This agent's metadata (msgpack bytes) for the worker registry; peers pass it to `add_peer`.
        Mutates nothing. ValueError before `register_kv_cache`."""
        with self._lock:
            self._check_open()
            if self._layout is None:
                raise ValueError("register the KV cache before publishing metadata")
            return encode_metadata(self._metadata(self._layout))

    def add_peer(self, metadata: bytes) -> str:
        """Know a peer from its published metadata and return its name; a peer already known under that
        name is replaced (a restarted worker). KVTransferError for metadata of another backend, of an
        incompatible layout (a different block size), or that the backend rejects; the peer is then unknown.
        ValueError before `register_kv_cache`."""
        with self._lock:
            self._check_open()
            if self._layout is None:
                raise ValueError("register the KV cache before adding peers")
            try:
                peer = decode_metadata(metadata)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise KVTransferError(f"malformed peer metadata: {exc}", backend=self.backend) from None
            if not isinstance(peer, self.metadata_type):
                raise KVTransferError(f"peer {peer.agent_name!r} uses another transfer backend",
                                      backend=self.backend, peer=peer.agent_name)
            if peer.layout.dtype and self._layout.dtype and peer.layout.dtype != self._layout.dtype:
                # equal block sizes would not catch bfloat16 against float16: the pages would be misread
                raise KVTransferError(
                    f"peer {peer.agent_name!r} holds {peer.layout.dtype} KV, this agent {self._layout.dtype}: "
                    "give every worker the same --dtype", backend=self.backend, peer=peer.agent_name)
            if peer.layout.block_size_bytes != self._layout.block_size_bytes:
                raise KVTransferError(
                    f"peer {peer.agent_name!r} has {peer.layout.block_size_bytes}-byte blocks, this agent "
                    f"{self._layout.block_size_bytes}", backend=self.backend, peer=peer.agent_name)
            if peer.agent_name in self._peers:
                self._forget_peer(peer.agent_name)
            self._add_peer(peer)
            self._peers[peer.agent_name] = peer.layout
            return peer.agent_name

    def remove_peer(self, peer: str) -> None:
        """Forget a peer (and drop its connection). Safe for an unknown peer."""
        with self._lock:
            if not self._closed and peer in self._peers:
                self._forget_peer(peer)

    def read_blocks(self, peer: str, remote_block_ids: Sequence[int], local_block_ids: Sequence[int], *,
                    timeout_s: float | None = None) -> ReadResult:
        """Copy the peer's blocks `remote_block_ids[i]` into local blocks `local_block_ids[i]`, blocking until
        every byte has landed or `timeout_s` (default: settings.transfer_timeout_s) has passed. Mutates only
        the named local blocks. ValueError for ids out of range, lists of unequal length or a local block
        named twice; KVTransferError for an unknown or unreachable peer or a failed read;
        KVTransferTimeoutError past the deadline. After an error the local blocks hold undefined data."""
        timeout_s = self.settings.transfer_timeout_s if timeout_s is None else timeout_s
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        with self._lock:
            start_s = time.monotonic()
            self._check_open()
            if self._layout is None:
                raise ValueError("register the KV cache before reading")
            peer_layout = self._peers.get(peer)
            if peer_layout is None:
                raise KVTransferError(f"unknown peer {peer!r}", backend=self.backend, peer=peer,
                                      num_blocks=len(local_block_ids))
            validate_block_ids(remote_block_ids, peer_layout.num_blocks, "remote")
            validate_block_ids(local_block_ids, self._layout.num_blocks, "local")
            runs = coalesce_block_runs(remote_block_ids, local_block_ids)
            plan = ReadPlan(peer, runs, len(local_block_ids), timeout_s, start_s)
            if runs:
                self._read(plan)
            size_bytes = plan.num_blocks * self._layout.block_size_bytes
            return ReadResult(peer, plan.num_blocks, len(runs), size_bytes, time.monotonic() - start_s)

    def notify(self, peer: str, message: bytes) -> None:
        """Send `message` to a known peer (e.g. "blocks read, release them"); it arrives in the peer's
        `get_notifications`. Fire and forget. KVTransferError for an unknown or unreachable peer."""
        with self._lock:
            self._check_open()
            if peer not in self._peers:
                raise KVTransferError(f"unknown peer {peer!r}", backend=self.backend, peer=peer)
            self._notify(peer, message)

    def get_notifications(self) -> list[Notification]:
        """Messages peers sent since the last call, oldest first per peer; consumes them."""
        with self._lock:
            self._check_open()
            return self._take_notifications()

    def close(self) -> None:
        """Forget every peer, deregister the cache and release the backend. Always safe; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for peer in list(self._peers):
                self._forget_peer(peer)
            self._close()
            self._kv_cache = None

    def __enter__(self) -> KVConnector:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- helpers for backends -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise KVTransferError(f"connector {self.agent_name!r} is closed", backend=self.backend)

    def _error(self, message: str, plan: ReadPlan) -> KVTransferError:
        return KVTransferError(message, backend=self.backend, peer=plan.peer, num_blocks=plan.num_blocks)

    def _timeout(self, plan: ReadPlan, *, cancelled: bool) -> KVTransferTimeoutError:
        elapsed_s = time.monotonic() - plan.start_s
        return KVTransferTimeoutError(
            f"reading {plan.num_blocks} blocks from {plan.peer!r} took over {plan.timeout_s:g} s",
            backend=self.backend, peer=plan.peer, num_blocks=plan.num_blocks, timeout_s=plan.timeout_s,
            elapsed_s=elapsed_s, cancelled=cancelled)

    def _forget_peer(self, peer: str) -> None:
        del self._peers[peer]
        try:
            self._remove_peer(peer)
        except Exception:  # forgetting must not fail: the peer is unknown either way
            logger.warning("%s: dropping peer %s failed", self.agent_name, peer, exc_info=True)

    # ---- backend hooks (called under the lock, after validation) --------------------------------------

    @abc.abstractmethod
    def _register(self, kv_cache: torch.Tensor, layout: KVLayout) -> None:
        """Register the cache; raise KVTransferError leaving nothing registered."""

    @abc.abstractmethod
    def _metadata(self, layout: KVLayout) -> AgentMetadata: ...

    @abc.abstractmethod
    def _add_peer(self, peer: AgentMetadata) -> None:
        """Load a peer; raise KVTransferError leaving it unknown."""

    @abc.abstractmethod
    def _remove_peer(self, peer: str) -> None: ...

    @abc.abstractmethod
    def _read(self, plan: ReadPlan) -> None:
        """Run the read to completion or raise `self._error(...)` / `self._timeout(...)`."""

    @abc.abstractmethod
    def _notify(self, peer: str, message: bytes) -> None: ...

    @abc.abstractmethod
    def _take_notifications(self) -> list[Notification]: ...

    @abc.abstractmethod
    def _close(self) -> None:
        """Release everything; peers are already forgotten."""
