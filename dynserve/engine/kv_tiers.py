"""KV tiers below the device pool: a host pool and a disk directory that keep cached blocks the device pool
evicted, so a returning prefix is copied back (onboarded) instead of prefilled.

`KVTiers` owns the host tier (a tensor pool of its own, pinned on a GPU, sized by `kv_host_bytes`) and the
disk tier (one file per block under a directory of its own, sized by `kv_disk_bytes`). The block manager
calls it: `offload` when it evicts a cached device block, `claim` + `land` to onboard a prefix hit,
`discard` when the device caches a hash again by computing it, `clear` on a reset. Each call that changes
the set of hashes a tier holds returns `TierChange`s, which the block manager numbers into KV events with
their `medium`, so the event stream replays to exactly the per-tier sets.

Invariants:
- Tiers are exclusive: a hash is held by at most one of device, host and disk. A block moves down one tier
  at a time (device -> host -> disk -> dropped, least recently stored first); onboarding takes it out of
  its tier (`BlockRemoved(medium)`) and the device caches it (`BlockStored(device)`).
- An entry keeps its token ids, so a hit is confirmed token by token as on the device.
- A host slot is free, held by one entry, or claimed (being onboarded); free + held + claimed == total.
- The disk holds at most `kv_disk_bytes` of block files (`kv_disk.py`: a header naming the format, model,
  layout and block, and a checksum; written in the background by `kv_disk.DiskWriter`, in the order asked).
  A file whose header or checksum disagrees, or that is short, is dropped at read
  (`TierStats.num_corrupt_files`) and its block is recomputed.
- A disk tier never outlives its engine: each engine writes into a fresh directory inside `kv_disk_dir`
  (a `dynserve-kv-*` directory under the system temp dir by default) and removes it on `close` (or when
  the tiers are collected, or at exit), so a restarted worker starts with an empty disk tier and no stale
  file can be served (the router learns a worker's blocks from its events, which a restarted worker starts
  afresh). The header and checksum would make reading a previous run's files safe; an empty start keeps
  the router's view and the worker's cache equal without a snapshot of the lower tiers.

Copies are synchronous on the caller's stream: a device -> host copy completes before the block is reused.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

import torch

from dynserve.engine.kv_disk import DiskWriter, PageLayout, decode_block, encode_block, pages_bytes
from dynserve.hashing import BlockHash

__all__ = ["Claim", "KVTiers", "PageLayout", "TierChange", "TierPolicy", "TierStats"]

logger = logging.getLogger(__name__)

HOST, DISK = "host", "disk"


@dataclass(frozen=True, slots=True)
class TierPolicy:
    """Sizes and write policy of the tiers (from `Settings`: kv_host_bytes, kv_disk_bytes, kv_disk_dir,
    kv_disk_write)."""

    host_bytes: int = 0
    disk_bytes: int = 0
    disk_dir: str | None = None
    disk_write: Literal["background", "sync"] = "background"

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0 or self.disk_bytes > 0


@dataclass(frozen=True, slots=True)
class TierChange:
    """One change of the set of hashes a tier holds (`medium` is "host" or "disk")."""

    stored: bool  # False: removed
    medium: str
    block_hash: BlockHash
    parent_hash: BlockHash | None = None


@dataclass(slots=True)
class TierStats:
    """Counters a worker exports; blocks held per tier are `KVTiers.num_blocks(medium)`."""

    num_onboarded: dict[str, int] = field(default_factory=lambda: {HOST: 0, DISK: 0})  # hits served per tier
    onboard_bytes: int = 0
    onboard_s: float = 0.0
    num_offloaded: dict[str, int] = field(default_factory=lambda: {HOST: 0, DISK: 0})  # stored per tier
    num_dropped: int = 0  # blocks dropped from the last tier
    disk_write_bytes: int = 0
    disk_read_bytes: int = 0
    num_corrupt_files: int = 0  # disk blocks found corrupt or short at read, dropped and recomputed


@dataclass(slots=True)
class _Entry:
    token_ids: tuple[int, ...]
    parent_hash: BlockHash | None
    slot: int | None = None  # host entries: the slot of the pool holding its pages


@dataclass(slots=True)
class Claim:
    """A lower-tier block taken out of its tier to be copied into a device block by `KVTiers.land`."""

    block_hash: BlockHash
    medium: str
    host_slot: int | None = None
    payload: torch.Tensor | None = None  # disk: the pages as bytes (uint8), already verified


class KVTiers:
    """The host and disk tiers of one engine's KV cache (`device_kv`: `[num_blocks, *layout.page_shape]`).
    Single-threaded like the block manager, but for the disk writer thread it owns."""

    def __init__(self, policy: TierPolicy, layout: PageLayout, device_kv: torch.Tensor) -> None:
        if tuple(device_kv.shape[1:]) != layout.page_shape or device_kv.dtype != layout.dtype:
            raise ValueError(f"device KV {tuple(device_kv.shape)} {device_kv.dtype} does not match {layout}")
        self.policy = policy
        self.layout = layout
        self.stats = TierStats()
        self._device_kv = device_kv
        self.num_host_slots = policy.host_bytes // layout.page_bytes
        pin = device_kv.device.type == "cuda"
        self._host_pool = torch.empty((self.num_host_slots, *layout.page_shape), dtype=layout.dtype,
                                      pin_memory=pin)
        self._host: OrderedDict[BlockHash, _Entry] = OrderedDict()  # least recently stored first
        self._free_slots = list(range(self.num_host_slots))
        self._num_claimed_slots = 0
        self.num_disk_blocks_max = policy.disk_bytes // layout.file_bytes()
        self._disk: OrderedDict[BlockHash, _Entry] = OrderedDict()
        self._disk_dir: str | None = None
        self._writer: DiskWriter | None = None
        if self.num_disk_blocks_max:
            parent = policy.disk_dir or tempfile.gettempdir()
            os.makedirs(parent, exist_ok=True)
            self._disk_dir = tempfile.mkdtemp(prefix="dynserve-kv-", dir=parent)
            self._writer = DiskWriter(self.stats, background=policy.disk_write == "background")
        # removes the directory on `close`, or when the tiers are collected or the interpreter exits unclosed
        self._finalizer = weakref.finalize(self, _remove_disk_tier, self._writer, self._disk_dir)

    # ---- queries --------------------------------------------------------------------------------------

    def num_blocks(self, medium: str) -> int:
        return len(self._host) if medium == HOST else len(self._disk)

    def hashes(self, medium: str) -> list[int]:
        return list(self._host if medium == HOST else self._disk)

    def find(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> str | None:
        """The tier holding `block_hash` with exactly `token_ids` (a hash collision is no hit), or None."""
        for medium, entries in ((HOST, self._host), (DISK, self._disk)):
            entry = entries.get(block_hash)
            if entry is not None:
                return medium if entry.token_ids == token_ids else None
        return None

    def holds(self, block_hash: BlockHash) -> bool:
        return block_hash in self._host or block_hash in self._disk

    @property
    def disk_dir(self) -> str | None:
        return self._disk_dir

    # ---- moves ----------------------------------------------------------------------------------------

    def offload(self, block_hash: BlockHash, parent_hash: BlockHash | None, token_ids: tuple[int, ...],
                block_id: int) -> list[TierChange]:
        """Keep device block `block_id` (cached as `block_hash`, about to be reused) in the highest tier with
        room, moving that tier's least recently stored blocks down (and off the last tier) to make it."""
        assert not self.holds(block_hash), "tiers are exclusive: the device held this hash"
        changes: list[TierChange] = []
        entry = _Entry(token_ids, parent_hash)
        if self.num_host_slots:
            if not self._free_slots:
                self._evict_host(changes)
            if self._free_slots:
                entry.slot = self._free_slots.pop()
                self._host_pool[entry.slot].copy_(self._device_kv[block_id])
                self._host[block_hash] = entry
                self.stats.num_offloaded[HOST] += 1
                changes.append(TierChange(True, HOST, block_hash, parent_hash))
                return changes
        if self.num_disk_blocks_max:  # no host tier, or every host slot is being onboarded
            self._store_disk(block_hash, entry, pages_bytes(self._device_kv[block_id]), changes)
        return changes

    def _evict_host(self, changes: list[TierChange]) -> None:
        """Move the least recently stored host block to disk (or drop it), freeing its slot."""
        if not self._host:
            return
        block_hash, entry = self._host.popitem(last=False)
        assert entry.slot is not None
        changes.append(TierChange(False, HOST, block_hash))
        slot, entry.slot = entry.slot, None
        if self.num_disk_blocks_max:
            self._store_disk(block_hash, entry, pages_bytes(self._host_pool[slot]), changes)
        else:
            self.stats.num_dropped += 1
        self._free_slots.append(slot)

    def _store_disk(self, block_hash: BlockHash, entry: _Entry, pages: bytes,
                    changes: list[TierChange]) -> None:
        assert self._writer is not None
        while len(self._disk) >= self.num_disk_blocks_max:
            old_hash, _ = self._disk.popitem(last=False)
            self._writer.delete(self._path(old_hash))
            self.stats.num_dropped += 1
            changes.append(TierChange(False, DISK, old_hash))
        self._disk[block_hash] = entry
        self._writer.write(self._path(block_hash),
                           encode_block(self.layout, block_hash, entry.parent_hash, entry.token_ids, pages))
        self.stats.num_offloaded[DISK] += 1
        changes.append(TierChange(True, DISK, block_hash, entry.parent_hash))

    def claim(self, block_hash: BlockHash) -> tuple[Claim | None, list[TierChange]]:
        """Take `block_hash` out of its tier to onboard it; its pages stay reserved (a host slot) or read
        (disk) until `land`. None when it is no longer held, or its disk file is corrupt (then dropped)."""
        entry = self._host.pop(block_hash, None)
        if entry is not None:
            assert entry.slot is not None
            self._num_claimed_slots += 1
            return Claim(block_hash, HOST, host_slot=entry.slot), [TierChange(False, HOST, block_hash)]
        entry = self._disk.pop(block_hash, None)
        if entry is None:
            return None, []
        changes = [TierChange(False, DISK, block_hash)]
        assert self._writer is not None
        path = self._path(block_hash)
        data = self._writer.read(path)
        self._writer.delete(path)
        payload = decode_block(self.layout, block_hash, entry.token_ids, data)
        if payload is None:
            self.stats.num_corrupt_files += 1
            logger.warning("KV disk tier: block %016x's file %s is corrupt or short; recomputing it",
                           block_hash, path)
            return None, changes
        return Claim(block_hash, DISK, payload=payload), changes

    def land(self, claim: Claim, block_id: int) -> None:
        """Copy a claimed block's pages into device block `block_id` and free what held them."""
        start = time.perf_counter()
        target = self._device_kv[block_id]
        if claim.host_slot is not None:
            target.copy_(self._host_pool[claim.host_slot])
            self._free_slots.append(claim.host_slot)
            self._num_claimed_slots -= 1
        else:
            assert claim.payload is not None
            target.view(-1).view(torch.uint8).copy_(claim.payload)
        self.stats.num_onboarded[claim.medium] += 1
        self.stats.onboard_bytes += self.layout.page_bytes
        self.stats.onboard_s += time.perf_counter() - start

    def discard(self, block_hash: BlockHash) -> list[TierChange]:
        """Drop `block_hash` from its tier (the device caches it again, computed)."""
        entry = self._host.pop(block_hash, None)
        if entry is not None:
            assert entry.slot is not None
            self._free_slots.append(entry.slot)
            return [TierChange(False, HOST, block_hash)]
        if self._disk.pop(block_hash, None) is not None:
            assert self._writer is not None
            self._writer.delete(self._path(block_hash))
            return [TierChange(False, DISK, block_hash)]
        return []

    def clear(self) -> None:
        """Forget every block of every tier (the caller emits Cleared)."""
        for entry in self._host.values():
            assert entry.slot is not None
            self._free_slots.append(entry.slot)
        self._host.clear()
        if self._writer is not None:
            for block_hash in self._disk:
                self._writer.delete(self._path(block_hash))
        self._disk.clear()

    def flush(self) -> None:
        """Wait until every queued disk write and delete is done."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Stop the writer and remove the disk tier's directory. The tiers are empty afterwards."""
        self._host.clear()
        self._disk.clear()
        self._finalizer()
        self._writer = None
        self._disk_dir = None
        self.num_disk_blocks_max = 0

    # ---- disk files -----------------------------------------------------------------------------------

    def _path(self, block_hash: BlockHash) -> str:
        assert self._disk_dir is not None
        return os.path.join(self._disk_dir, f"{block_hash:016x}.kvb")

    # ---- integrity ------------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError unless host slots are free, held or claimed exactly once, the tiers are
        exclusive and within their sizes, and (after `flush`) the disk directory holds exactly the disk
        tier's files."""
        held = [e.slot for e in self._host.values()]
        assert None not in held, "host entry without a slot"
        assert len(set(held)) == len(held), "host slot held twice"
        assert not set(held) & set(self._free_slots), "host slot both held and free"
        assert len(set(self._free_slots)) == len(self._free_slots), "host slot free twice"
        assert len(held) + len(self._free_slots) + self._num_claimed_slots == self.num_host_slots, (
            "host slots: free + held + claimed != total")
        assert not set(self._host) & set(self._disk), "a hash in two tiers"
        assert len(self._disk) <= self.num_disk_blocks_max, "disk tier over its size"
        assert all(e.slot is None for e in self._disk.values()), "disk entry holding a host slot"
        if self._writer is not None and self._writer.idle():
            assert self._disk_dir is not None
            on_disk = {name for name in os.listdir(self._disk_dir) if name.endswith(".kvb")}
            assert on_disk == {os.path.basename(self._path(h)) for h in self._disk}, "disk files != disk tier"


def _remove_disk_tier(writer: DiskWriter | None, disk_dir: str | None) -> None:
    if writer is not None:
        writer.close()
    if disk_dir is not None:
        shutil.rmtree(disk_dir, ignore_errors=True)
