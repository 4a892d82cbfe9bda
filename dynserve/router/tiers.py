"""The tiered KV index: which worker caches which block on which medium (`protocol.MEDIA`: device, host,
disk), kept from the workers' KV events.

One `KVIndex` per medium holds that medium's blocks; the device one is the index a device-only fleet had
all along, so while no lower-medium block is known a decision costs what it did (one flag read more).
Each worker's events are numbered across media (one sequence per worker, as the worker sends them); the
device index keeps that numbering and hands the events of other media to `apply`, which routes each
`BlockStored`/`BlockRemoved` to its medium's index; `AllBlocksCleared` clears every medium of the worker.
A block moving between media arrives as a removal from one and a store on the other; a block held on two
media at once (an engine that copies rather than moves) is kept on both.

Matching. Block hashes are chained, so a worker holding blocks `0..k` on one medium and `k..n` on another
holds the prompt's prefix `0..n`. `match` returns, per worker holding the prompt's first block anywhere,
how many leading blocks it holds counting every medium, and, for the workers whose prefix leaves the
device, how many of those lie on each medium. The walk: at block `k`, take the fastest medium holding it,
follow that medium while it holds the next blocks (its runs, as `KVIndex` does), repeat from where it
stops; so each stretch is credited to the fastest medium holding its first block.

Gaps and resync are as in `KVIndex`: `apply` stops at a worker's first missing event id and returns False;
`resync` replaces what the index knows of the worker by its snapshot: the device hashes, and the hashes of
each lower medium where the snapshot carries them (a medium the snapshot does not name is cleared: an
undercount, never a stale hit).

Invariants, checked by `check_integrity`: each medium's index keeps its own (see `KVIndex`); every worker a
medium's index knows is a worker whose events this index numbers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from dynserve.protocol import MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from dynserve.router.indexer import KVIndex

__all__ = ["TierMatch", "TieredIndex"]

# What `match` returns, `(overlaps, lower)`. `overlaps`: per worker holding the prompt's first block on any
# medium, its leading blocks held on any medium (workers holding none are absent). `lower`: for the workers
# whose prefix reaches below the device only, its blocks per medium in `MEDIA` order (summing to its
# overlap); a worker absent from `lower` holds its whole overlap on the device. A plain tuple, read-only
# (`lower` may be shared): it is built once per decision.
TierMatch = tuple[dict[str, int], Mapping[str, tuple[int, ...]]]

_NO_LOWER: Mapping[str, tuple[int, ...]] = {}  # shared, never written: `lower` of a device-only match


class TieredIndex:
    def __init__(self, *, scan_max_workers: int = 8) -> None:
        """`scan_max_workers`: passed to each medium's `KVIndex` (a speed knob only)."""
        self.media = {medium: KVIndex(scan_max_workers=scan_max_workers) for medium in MEDIA}
        self.device = self.media[MEDIA[0]]
        self._lower = [self.media[medium] for medium in MEDIA[1:]]
        self._indexes = [self.media[medium] for medium in MEDIA]
        self._any_lower = False  # False only while no lower medium holds a block (checked by check_integrity)
        self.num_unknown_medium = 0  # blocks in events naming a medium not in MEDIA (not indexed)

    # ---- workers ---------------------------------------------------------------------------------------

    @property
    def worker_ids(self) -> list[str]:
        return self.device.worker_ids

    @property
    def num_blocks(self) -> int:
        """Blocks held by at least one worker, summed over media (a block on two media counts on each)."""
        return sum(index.num_blocks for index in self._indexes)

    def num_blocks_by_medium(self) -> dict[str, int]:
        return {medium: index.num_blocks for medium, index in self.media.items()}

    def num_worker_blocks(self, worker_id: str, medium: str | None = None) -> int:
        """Blocks `worker_id` holds on `medium`, or on every medium summed (None)."""
        if medium is not None:
            return self.media[medium].num_worker_blocks(worker_id)
        return sum(index.num_worker_blocks(worker_id) for index in self._indexes)

    def worker_blocks(self, worker_id: str, medium: str | None = None) -> set[int]:
        """The hashes `worker_id` holds on `medium`, or on any medium (None)."""
        if medium is not None:
            return self.media[medium].worker_blocks(worker_id)
        return set().union(*(index.worker_blocks(worker_id) for index in self._indexes))

    def last_event_id(self, worker_id: str) -> int | None:
        return self.device.last_event_id(worker_id)

    def remove_worker(self, worker_id: str) -> None:
        for index in self._indexes:
            index.remove_worker(worker_id)
        self._any_lower = any(index.num_blocks for index in self._lower)

    # ---- events ----------------------------------------------------------------------------------------

    def apply(self, worker_id: str, events: Iterable[KVEvent]) -> bool:
        """Apply `worker_id`'s events in order, each on its medium; False at the first gap (the rest is not
        applied: resync). Events already applied (a replay after a resync) are skipped. The device index
        numbers the events of every medium and hands those of the lower media here."""
        applied = self.device.apply(worker_id, events, self._apply_lower)
        if self._any_lower:
            self._any_lower = any(index.num_blocks for index in self._lower)
        return applied

    def _apply_lower(self, worker_id: str, event: KVEvent) -> None:
        """One event of `worker_id` not on the device: a store or removal on a lower medium, or a clear."""
        if isinstance(event, AllBlocksCleared):
            for index in self._lower:
                index.clear_blocks(worker_id)
            return
        assert isinstance(event, (BlockStored, BlockRemoved))
        index = self.media.get(event.medium)
        if index is None:
            self.num_unknown_medium += len(event.block_hashes)
        elif isinstance(event, BlockStored):
            index.add_blocks(worker_id, event.block_hashes)
            self._any_lower = True
        else:
            index.remove_blocks(worker_id, event.block_hashes)

    def resync(self, worker_id: str, block_hashes: Iterable[int], last_event_id: int | None,
               lower: Mapping[str, Iterable[int]] | None = None) -> None:
        """Replace what the index knows of `worker_id` by its snapshot, taken after event `last_event_id`:
        `block_hashes` on the device, `lower[medium]` on each lower medium (a medium absent: none)."""
        lower = lower or {}
        unknown = set(lower) - set(MEDIA[1:])
        if unknown:
            raise ValueError(f"a snapshot names media that are not lower media: {sorted(unknown)}")
        self.device.resync(worker_id, block_hashes, last_event_id)
        for medium in MEDIA[1:]:
            index = self.media[medium]
            index.clear_blocks(worker_id)
            if lower.get(medium):
                index.add_blocks(worker_id, lower[medium])
        self._any_lower = any(index.num_blocks for index in self._lower)

    # ---- matching --------------------------------------------------------------------------------------

    def match(self, block_hashes: Sequence[int]) -> TierMatch:
        """Per worker, its prefix overlap with the prompt over every medium, and where it lies (see
        `TierMatch` and the module docstring)."""
        device = self.device.match(block_hashes)
        if not self._any_lower:  # no block below the device anywhere: the device's answer is the whole answer
            return device, _NO_LOWER
        hashes = block_hashes if isinstance(block_hashes, list) else list(block_hashes)
        starts = [device, *(index.match(hashes) if index.num_blocks else {} for index in self._lower)]
        holders = dict.fromkeys(device)
        for start in starts[1:]:
            holders.update(dict.fromkeys(start))
        overlaps: dict[str, int] = {}
        by_medium: dict[str, tuple[int, ...]] = {}
        media = list(enumerate(self._indexes))
        num_blocks = len(hashes)
        for worker_id in holders:
            counts = [0] * len(media)
            ended = 0  # the medium whose stretch ended at `depth` (it does not hold the next block)
            for i, start in enumerate(starts):  # the first stretch: the fastest medium holding block 0
                depth = start.get(worker_id, 0)
                if depth:
                    counts[i] = depth
                    ended = i
                    break
            while depth < num_blocks:
                for i, index in media:
                    if i != ended:
                        reach = index.extend(worker_id, hashes, depth)
                        if reach > depth:
                            counts[i] += reach - depth
                            depth, ended = reach, i
                            break
                else:
                    break
            overlaps[worker_id] = depth
            if counts[0] != depth:
                by_medium[worker_id] = tuple(counts)
        return overlaps, by_medium

    # ---- integrity -------------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError unless every medium's index is sound and knows only numbered workers."""
        known = set(self.device.worker_ids)
        for medium, index in self.media.items():
            index.check_integrity()
            assert set(index.worker_ids) <= known, f"{medium}: workers the device index does not number"
        assert self._any_lower or not any(index.num_blocks for index in self._lower), "lower blocks unseen"
