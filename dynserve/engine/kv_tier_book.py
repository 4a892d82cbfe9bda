"""The bookkeeping of the KV tiers below the device pool, apart from where their pages are: which hashes the
host and disk tiers hold, how blocks move between them, the `TierChange`s each move makes and the counters.

`TierBook` is what the block manager drives (`offload` when it evicts a cached device block, `claim` +
`land` to onboard a prefix hit, `discard` when the device caches a hash again by computing it, `clear` on a
reset). It moves page data only through a `TierPages` store: the engine's `kv_tiers.KVTiers` is a book over
torch pages (a host pool, block files on disk); the mocker's tiers are a book over `NoPages`, which sizes
the tiers by block counts and keeps no data, so both emit the same events and count the same `TierStats`.
This module imports no torch.

Invariants:
- Tiers are exclusive: a hash is held by at most one of device, host and disk. A block moves down one tier
  at a time (device -> host -> disk -> dropped, least recently stored first); onboarding takes it out of
  its tier (`BlockRemoved(medium)`) and the device caches it (`BlockStored(device)`).
- An entry keeps its token ids, so a hit is confirmed token by token as on the device.
- A host slot is free, held by one entry, or claimed (being onboarded); free + held + claimed == total.
- The disk tier holds at most `num_disk_blocks_max` blocks; the store holds a disk copy of exactly those
  (checked by `check_integrity` once the store's writes are done).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Literal, Protocol

from dynserve.hashing import BlockHash

__all__ = ["DISK", "HOST", "Claim", "NoPages", "TierBook", "TierChange", "TierPages", "TierPolicy",
           "TierStats"]

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
    """Counters a worker exports; blocks held per tier are `TierBook.num_blocks(medium)`."""

    num_onboarded: dict[str, int] = field(default_factory=lambda: {HOST: 0, DISK: 0})  # hits served per tier
    onboard_bytes: int = 0
    onboard_s: float = 0.0
    num_offloaded: dict[str, int] = field(default_factory=lambda: {HOST: 0, DISK: 0})  # stored per tier
    num_dropped: int = 0  # blocks dropped from the last tier
    disk_write_bytes: int = 0
    disk_read_bytes: int = 0
    num_corrupt_files: int = 0  # disk blocks found corrupt or short at read, dropped and recomputed


@dataclass(slots=True)
class Claim:
    """A lower-tier block taken out of its tier to be copied into a device block by `TierBook.land`."""

    block_hash: BlockHash
    medium: str
    host_slot: int | None = None
    payload: object | None = None  # disk: the pages the store read back, already verified


class TierPages(Protocol):
    """Where the tiers' pages are. The book owns slots, hashes and order; a store only moves bytes (between
    device blocks, host slots and disk copies named by their block hash) and counts the disk bytes it reads
    and writes, and the time onboarding copies take, into the `TierStats` it was given."""

    @property
    def num_host_slots(self) -> int: ...

    @property
    def num_disk_blocks_max(self) -> int: ...

    @property
    def page_bytes(self) -> int:
        """One block's KV bytes (what an onboarded block moves)."""

    @property
    def disk_dir(self) -> str | None: ...

    def host_from_device(self, slot: int, block_id: int) -> None: ...

    def device_from_host(self, block_id: int, slot: int) -> None: ...

    def disk_from_device(self, block_hash: BlockHash, parent_hash: BlockHash | None,
                         token_ids: tuple[int, ...], block_id: int) -> None: ...

    def disk_from_host(self, block_hash: BlockHash, parent_hash: BlockHash | None, token_ids: tuple[int, ...],
                       slot: int) -> None: ...

    def take_disk(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> object | None:
        """Read `block_hash`'s disk copy and delete it: its verified pages, or None when the copy is corrupt,
        short or not this block's."""

    def device_from_disk(self, block_id: int, payload: object) -> None: ...

    def delete_disk(self, block_hash: BlockHash) -> None: ...

    def flush(self) -> None:
        """Wait until every queued disk write and delete is done."""

    def close(self) -> None:
        """Release what the store holds (a writer thread, a directory); no disk copy is left."""

    def check_disk(self, block_hashes: Collection[BlockHash]) -> None:
        """AssertionError unless the disk copies are exactly `block_hashes` (when the store can tell now)."""


@dataclass(slots=True)
class _Entry:
    token_ids: tuple[int, ...]
    parent_hash: BlockHash | None
    slot: int | None = None  # host entries: the slot of the store holding its pages


class TierBook:
    """The host and disk tiers of one engine's KV cache, over `pages`. Single-threaded like the block
    manager (a store may write on a thread of its own)."""

    def __init__(self, stats: TierStats, pages: TierPages) -> None:
        """`stats`: the counters (the store counts its bytes and copy times into the same object)."""
        self.stats = stats
        self._pages = pages
        self.num_host_slots = pages.num_host_slots
        self.num_disk_blocks_max = pages.num_disk_blocks_max
        self._host: OrderedDict[BlockHash, _Entry] = OrderedDict()  # least recently stored first
        self._free_slots = list(range(self.num_host_slots))
        self._num_claimed_slots = 0
        self._disk: OrderedDict[BlockHash, _Entry] = OrderedDict()

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
        return self._pages.disk_dir

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
                self._pages.host_from_device(entry.slot, block_id)
                self._host[block_hash] = entry
                self.stats.num_offloaded[HOST] += 1
                changes.append(TierChange(True, HOST, block_hash, parent_hash))
                return changes
        if self.num_disk_blocks_max:  # no host tier, or every host slot is being onboarded
            self._make_disk_room(changes)
            self._pages.disk_from_device(block_hash, parent_hash, token_ids, block_id)
            self._stored_on_disk(block_hash, entry, changes)
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
            self._make_disk_room(changes)
            self._pages.disk_from_host(block_hash, entry.parent_hash, entry.token_ids, slot)
            self._stored_on_disk(block_hash, entry, changes)
        else:
            self.stats.num_dropped += 1
        self._free_slots.append(slot)

    def _make_disk_room(self, changes: list[TierChange]) -> None:
        while len(self._disk) >= self.num_disk_blocks_max:
            old_hash, _ = self._disk.popitem(last=False)
            self._pages.delete_disk(old_hash)
            self.stats.num_dropped += 1
            changes.append(TierChange(False, DISK, old_hash))

    def _stored_on_disk(self, block_hash: BlockHash, entry: _Entry, changes: list[TierChange]) -> None:
        self._disk[block_hash] = entry
        self.stats.num_offloaded[DISK] += 1
        changes.append(TierChange(True, DISK, block_hash, entry.parent_hash))

    def claim(self, block_hash: BlockHash) -> tuple[Claim | None, list[TierChange]]:
        """Take `block_hash` out of its tier to onboard it; its pages stay reserved (a host slot) or read
        (disk) until `land`. None when it is no longer held, or its disk copy is corrupt (then dropped)."""
        entry = self._host.pop(block_hash, None)
        if entry is not None:
            assert entry.slot is not None
            self._num_claimed_slots += 1
            return Claim(block_hash, HOST, host_slot=entry.slot), [TierChange(False, HOST, block_hash)]
        entry = self._disk.pop(block_hash, None)
        if entry is None:
            return None, []
        changes = [TierChange(False, DISK, block_hash)]
        payload = self._pages.take_disk(block_hash, entry.token_ids)
        if payload is None:
            self.stats.num_corrupt_files += 1
            return None, changes
        return Claim(block_hash, DISK, payload=payload), changes

    def land(self, claim: Claim, block_id: int) -> None:
        """Copy a claimed block's pages into device block `block_id` and free what held them."""
        if claim.host_slot is not None:
            self._pages.device_from_host(block_id, claim.host_slot)
            self._free_slots.append(claim.host_slot)
            self._num_claimed_slots -= 1
        else:
            assert claim.payload is not None
            self._pages.device_from_disk(block_id, claim.payload)
        self.stats.num_onboarded[claim.medium] += 1
        self.stats.onboard_bytes += self._pages.page_bytes

    def discard(self, block_hash: BlockHash) -> list[TierChange]:
        """Drop `block_hash` from its tier (the device caches it again, computed)."""
        entry = self._host.pop(block_hash, None)
        if entry is not None:
            assert entry.slot is not None
            self._free_slots.append(entry.slot)
            return [TierChange(False, HOST, block_hash)]
        if self._disk.pop(block_hash, None) is not None:
            self._pages.delete_disk(block_hash)
            return [TierChange(False, DISK, block_hash)]
        return []

    def clear(self) -> None:
        """Forget every block of every tier (the caller emits Cleared)."""
        for entry in self._host.values():
            assert entry.slot is not None
            self._free_slots.append(entry.slot)
        self._host.clear()
        for block_hash in self._disk:
            self._pages.delete_disk(block_hash)
        self._disk.clear()

    def flush(self) -> None:
        """Wait until every queued disk write and delete is done."""
        self._pages.flush()

    def close(self) -> None:
        """Release the store (a disk tier's writer and directory). The tiers are empty afterwards."""
        self._host.clear()
        self._disk.clear()
        self._pages.close()
        self.num_disk_blocks_max = 0

    # ---- integrity ------------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError unless host slots are free, held or claimed exactly once, the tiers are
        exclusive and within their sizes, and (once its writes are done) the store's disk copies are exactly
        the disk tier's blocks."""
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
        if self.num_disk_blocks_max:
            self._pages.check_disk(self._disk.keys())


class NoPages:
    """A `TierPages` without page data (the mocker's): the tiers sized in blocks of `page_bytes` each, disk
    copies as a set of hashes, disk bytes counted as a block's `page_bytes` each way, copies instant (whoever
    models the time onboarding takes adds it to `stats.onboard_s`)."""

    def __init__(self, stats: TierStats, *, page_bytes: int, num_host_slots: int,
                 num_disk_blocks: int) -> None:
        if page_bytes <= 0 or num_host_slots < 0 or num_disk_blocks < 0:
            raise ValueError(f"page_bytes {page_bytes} must be > 0, block counts >= 0")
        self._stats = stats
        self._page_bytes = page_bytes
        self._num_host_slots = num_host_slots
        self._num_disk_blocks = num_disk_blocks
        self._on_disk: set[BlockHash] = set()

    @classmethod
    def sized(cls, stats: TierStats, policy: TierPolicy, page_bytes: int) -> NoPages:
        """The store for `policy`'s byte sizes, a block taking `page_bytes` on the host and on disk."""
        return cls(stats, page_bytes=page_bytes, num_host_slots=policy.host_bytes // page_bytes,
                   num_disk_blocks=policy.disk_bytes // page_bytes)

    @property
    def num_host_slots(self) -> int:
        return self._num_host_slots

    @property
    def num_disk_blocks_max(self) -> int:
        return self._num_disk_blocks

    @property
    def page_bytes(self) -> int:
        return self._page_bytes

    @property
    def disk_dir(self) -> str | None:
        return None

    def host_from_device(self, slot: int, block_id: int) -> None:
        pass

    def device_from_host(self, block_id: int, slot: int) -> None:
        pass

    def disk_from_device(self, block_hash: BlockHash, parent_hash: BlockHash | None,
                         token_ids: tuple[int, ...], block_id: int) -> None:
        self._write(block_hash)

    def disk_from_host(self, block_hash: BlockHash, parent_hash: BlockHash | None, token_ids: tuple[int, ...],
                       slot: int) -> None:
        self._write(block_hash)

    def _write(self, block_hash: BlockHash) -> None:
        self._on_disk.add(block_hash)
        self._stats.disk_write_bytes += self._page_bytes

    def take_disk(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> object | None:
        if block_hash not in self._on_disk:
            return None
        self._on_disk.discard(block_hash)
        self._stats.disk_read_bytes += self._page_bytes
        return b""  # verified, and empty: there are no pages

    def device_from_disk(self, block_id: int, payload: object) -> None:
        pass

    def delete_disk(self, block_hash: BlockHash) -> None:
        self._on_disk.discard(block_hash)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self._on_disk.clear()

    def check_disk(self, block_hashes: Collection[BlockHash]) -> None:
        assert self._on_disk == set(block_hashes), "disk copies != disk tier"
