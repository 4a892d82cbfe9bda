"""KV-cache pages: allocation, reference counts, the prefix cache, eviction and KV events.

The block manager owns block ids `0 .. num_blocks-1` of the worker's KV tensor (the tensor itself belongs to
the model runner). Every block is in exactly one of three states:

- used:      `ref_count > 0`, in one or more sequences' block tables;
- evictable: `ref_count == 0` but holding a cached, hashed block (kept in LRU order, reusable on a hit);
- free:      `ref_count == 0` and holding nothing.

A sequence whose model attends only within a sliding window (every layer) gives back the blocks that slid
out of it (`free_slid_out`): their table entries become `NO_BLOCK`, which no kernel reads (the attention
backends start at each row's window), so a long conversation holds a bounded number of blocks.

A full, computed block is registered under its chained hash; a later sequence whose prefix hashes the same
reuses it after its token ids are confirmed equal, so a hash collision never serves the wrong block.
Allocation takes free blocks first, then evicts the least recently freed cached block. Every change to the
set of cached hashes is recorded as a numbered KV event in an outbox that the worker publishes.

With KV tiers (`kv_tier_book.TierBook`: the engine's `kv_tiers.KVTiers`, the mocker's page-less book), an
evicted cached block is kept in the host or disk tier instead of lost (`BlockRemoved(device)` then
`BlockStored(host)`, and so on down), and a prefix match continues past the device pool into the tiers: each
such block is taken out of its tier (`BlockRemoved(host|disk)`) and copied into a freshly taken device block
that is cached at once (`BlockStored(device)`), so it counts as computed. Its tier copy is claimed before any
device block is taken, so the evictions that taking blocks causes can never push out a block the same sequence
just matched; a device hit is referenced first for the same reason. A hash is cached in at most one of device,
host and disk; without tiers the events are those of a device-only pool, unchanged. `check_integrity()` proves
these invariants, the tiers' included.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dynserve.engine.sequence import Sequence
from dynserve.hashing import BlockHash
from dynserve.protocol import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

if TYPE_CHECKING:  # the tiers hold tensors; the block manager itself imports no torch
    from dynserve.engine.kv_tier_book import Claim, TierBook, TierChange

__all__ = ["Block", "BlockManager", "NO_BLOCK"]

NO_BLOCK = -1  # a block-table entry whose block slid out of every layer's window and was given back


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None  # the tokens a cached block holds, to confirm hits
    parent_hash: BlockHash | None = None  # a cached block's parent in its chain (None: the first block)


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, hash_salt: int = 0, enable_prefix_caching: bool = True,
        tiers: TierBook | None = None,
    ) -> None:
        """`tiers`: where evicted cached blocks are kept and hits are onboarded from (None: device only)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hash_salt = hash_salt
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[BlockHash, int] = {}
        self._events: list[KVEvent] = []
        self._next_event_id = 0
        self.num_evictions = 0  # cached blocks taken back for new content (LRU)
        self.tiers = tiers if enable_prefix_caching else None

    # ---- capacity -------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free plus evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- allocation -----------------------------------------------------------------------------------

    def allocate(self, seq: Sequence, num_reserved_blocks: int = 0) -> bool:
        """Admit `seq`: reuse its cached prefix and allocate blocks for all its tokens.

        Sets `seq.block_table` and `seq.num_computed_tokens` (the reused prefix). Returns False and changes
        nothing when the blocks are not there with `num_reserved_blocks` still free afterwards (headroom for
        running sequences to grow). At least one token is always left to compute.
        """
        assert not seq.block_table, "sequence already holds blocks"
        hit_ids = self._match_prefix(seq)
        lower_hashes = self._match_lower(seq, len(hit_ids)) if self.tiers is not None else []
        num_needed = self.blocks_needed(seq.num_tokens) - len(hit_ids)
        num_taken_from_cache = sum(1 for b in hit_ids if self.blocks[b].ref_count == 0)
        if num_needed + num_taken_from_cache + num_reserved_blocks > self.num_free_blocks:
            return False
        for block_id in hit_ids:
            self._ref(block_id)
        claims = self._claim(lower_hashes) if lower_hashes else []
        seq.block_table = hit_ids + [self._take_block() for _ in range(num_needed)]
        if claims:
            self._onboard(seq, len(hit_ids), claims)
        num_reused = len(hit_ids) + len(claims)
        seq.num_computed_tokens = num_reused * self.block_size
        seq.num_registered_blocks = num_reused
        return True

    def hold_prefix(self, seq: Sequence) -> int:
        """Hold the leading blocks of `seq` this cache has, on the device or in a lower tier (onboarded into
        free device blocks while there are any), every one of them: nothing of `seq` is computed here, a
        peer reads them (`GenerateRequest.export_prefix`). Sets `seq.block_table` to them; `free(seq)` lets
        them go (they stay cached). Returns how many."""
        assert not seq.block_table, "sequence already holds blocks"
        hit_ids = self._match_prefix(seq, whole=True)
        for block_id in hit_ids:
            self._ref(block_id)
        lower_hashes = self._match_lower(seq, len(hit_ids), whole=True) if self.tiers is not None else []
        claims = self._claim(lower_hashes[:self.num_free_blocks]) if lower_hashes else []
        seq.block_table = hit_ids + [self._take_block() for _ in claims]
        if claims:
            self._onboard(seq, len(hit_ids), claims)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        seq.num_registered_blocks = len(seq.block_table)
        return len(seq.block_table)

    def ensure_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow `seq.block_table` to hold `num_tokens` tokens; False (nothing changed) if blocks run out."""
        num_new = self.blocks_needed(num_tokens) - len(seq.block_table)
        if num_new <= 0:
            return True
        if num_new > self.num_free_blocks:
            return False
        seq.block_table.extend(self._take_block() for _ in range(num_new))
        return True

    def free_slid_out(self, seq: Sequence, window: int) -> int:
        """Give back `seq`'s blocks that no later token can attend to under a `window`-token sliding window
        (every token of the block is before the next token's window), among those already offered to the
        prefix cache; returns how many. A cached block stays cached (evictable), as after `free`."""
        first_needed = seq.num_computed_tokens - window + 1  # the first key the next token attends to
        i = min(first_needed // self.block_size, seq.num_registered_blocks) - 1
        freed = 0
        while i >= 0 and seq.block_table[i] != NO_BLOCK:  # earlier ones were given back by an earlier call
            self._unref(seq.block_table[i])
            seq.block_table[i] = NO_BLOCK
            freed += 1
            i -= 1
        return freed

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed more often than taken"
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is None:
                self._free.append(block_id)
            else:
                self._evictable[block_id] = None

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks, last block first so a sequence's tail is evicted before its prefix."""
        for block_id in reversed(seq.block_table):
            if block_id != NO_BLOCK:
                self._unref(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    # ---- prefix cache ---------------------------------------------------------------------------------

    def _match_prefix(self, seq: Sequence, whole: bool = False) -> list[int]:
        """Block ids of the longest cached prefix of `seq`, confirmed token by token; short of the last token
        unless `whole`."""
        if not self.enable_prefix_caching:
            return []
        seq.update_block_hashes(self.block_size, self.hash_salt)
        hit_ids: list[int] = []
        for i, block_hash in enumerate(seq.block_hashes):
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                break
            start = i * self.block_size
            if self.blocks[block_id].token_ids != tuple(seq.token_ids[start : start + self.block_size]):
                break  # a hash collision: never serve another prefix's KV
            hit_ids.append(block_id)
        if hit_ids and len(hit_ids) * self.block_size >= seq.num_tokens and not whole:
            hit_ids.pop()  # the last token must be computed to produce logits
        return hit_ids

    def _match_lower(self, seq: Sequence, start: int, whole: bool = False) -> list[BlockHash]:
        """Hashes of the blocks after `seq`'s first `start` (its device hits) that the tiers hold, in chain
        order, confirmed token by token, leaving at least the last token to compute unless `whole`."""
        assert self.tiers is not None
        if not self.enable_prefix_caching:
            return []
        hashes: list[BlockHash] = []
        for i in range(start, len(seq.block_hashes)):
            first = i * self.block_size
            token_ids = tuple(seq.token_ids[first : first + self.block_size])
            if self.tiers.find(seq.block_hashes[i], token_ids) is None:
                break
            hashes.append(seq.block_hashes[i])
        if hashes and (start + len(hashes)) * self.block_size >= seq.num_tokens and not whole:
            hashes.pop()
        return hashes

    def _claim(self, hashes: list[BlockHash]) -> list[Claim]:
        """Take the tiers' copies of `hashes` out of their tiers, up to the first that fails (a corrupt file:
        that block and the rest are computed)."""
        assert self.tiers is not None
        claims: list[Claim] = []
        for block_hash in hashes:
            claim, changes = self.tiers.claim(block_hash)
            self._record(changes)
            if claim is None:
                break
            claims.append(claim)
        return claims

    def _onboard(self, seq: Sequence, first: int, claims: list[Claim]) -> None:
        """Copy each claim into `seq`'s fresh blocks from index `first` on; cache them (one Stored event)."""
        assert self.tiers is not None
        for k, claim in enumerate(claims):
            i = first + k
            block = self.blocks[seq.block_table[i]]
            self.tiers.land(claim, block.block_id)
            start = i * self.block_size
            block.block_hash = claim.block_hash
            block.token_ids = tuple(seq.token_ids[start : start + self.block_size])
            block.parent_hash = seq.block_hashes[i - 1] if i > 0 else None
            self._hash_to_block[claim.block_hash] = block.block_id
        parent = seq.block_hashes[first - 1] if first > 0 else None
        self._emit_stored(parent, [c.block_hash for c in claims])

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Offer `seq`'s full, computed blocks to the prefix cache (call after each step)."""
        if seq.num_computed_tokens // self.block_size <= seq.num_registered_blocks:
            return  # no block filled since the last call (most decode steps): hashes can wait too
        if self.enable_prefix_caching:
            seq.update_block_hashes(self.block_size, self.hash_salt)
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        if not self.enable_prefix_caching or not seq.cacheable or num_full <= seq.num_registered_blocks:
            seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)
            return
        run: list[BlockHash] = []
        run_parent: BlockHash | None = None
        for i in range(seq.num_registered_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            block_hash = seq.block_hashes[i]
            if block.block_hash is None and block_hash not in self._hash_to_block:
                start = i * self.block_size
                block.block_hash = block_hash
                block.token_ids = tuple(seq.token_ids[start : start + self.block_size])
                block.parent_hash = seq.block_hashes[i - 1] if i > 0 else None
                self._hash_to_block[block_hash] = block.block_id
                if self.tiers is not None and self.tiers.holds(block_hash):
                    self._record(self.tiers.discard(block_hash))  # computed again: keep tiers exclusive
                if not run:
                    run_parent = seq.block_hashes[i - 1] if i > 0 else None
                run.append(block_hash)
            else:
                if run:  # another block already caches this hash: close the run
                    self._emit_stored(run_parent, run)
                    run = []
                holder = self.blocks[self._hash_to_block[block_hash]]  # this block itself after a hit
                start = i * self.block_size
                if holder.token_ids != tuple(seq.token_ids[start : start + self.block_size]):
                    # A hash collision: every later block's KV depends on this one, so none of this
                    # sequence's later blocks may be cached under this chain.
                    seq.cacheable = False
                    num_full = i
                    break
        if run:
            self._emit_stored(run_parent, run)
        seq.num_registered_blocks = num_full

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (emits Cleared). Blocks in use stay with their sequences, uncached."""
        for block in self.blocks:
            if block.block_hash is not None:
                block.block_hash = None
                block.token_ids = None
                block.parent_hash = None
        if self.tiers is not None:
            self.tiers.clear()
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._hash_to_block.clear()
        self._events.append(AllBlocksCleared(self._take_event_id()))

    @property
    def last_event_id(self) -> int | None:
        """The id of the newest event emitted (drained or not); None before the first."""
        return self._next_event_id - 1 if self._next_event_id else None

    def cached_block_hashes(self) -> list[int]:
        """Snapshot of every hash cached on the device (for a router resyncing after a gap)."""
        return list(self._hash_to_block)

    def cached_block_hashes_by_medium(self) -> dict[str, list[int]]:
        """Snapshot of every cached hash per tier ("device", and "host" and "disk" with tiers)."""
        snapshot = {"device": list(self._hash_to_block)}
        if self.tiers is not None:
            snapshot["host"] = self.tiers.hashes("host")
            snapshot["disk"] = self.tiers.hashes("disk")
        return snapshot

    def drain_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    # ---- internals ------------------------------------------------------------------------------------

    def _take_block(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            block = self.blocks[block_id]
            if self.tiers is None:
                self._uncache(block)
            else:  # keep its pages in the tiers before the block's new content overwrites them
                block_hash, parent_hash, token_ids = block.block_hash, block.parent_hash, block.token_ids
                assert block_hash is not None and token_ids is not None
                self._uncache(block)
                self._record(self.tiers.offload(block_hash, parent_hash, token_ids, block_id))
            self.num_evictions += 1
        self.blocks[block_id].ref_count = 1
        return block_id

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._evictable[block_id]
        block.ref_count += 1

    def _uncache(self, block: Block) -> None:
        assert block.block_hash is not None
        del self._hash_to_block[block.block_hash]
        self._events.append(BlockRemoved(self._take_event_id(), [block.block_hash]))
        block.block_hash = None
        block.token_ids = None
        block.parent_hash = None

    def _record(self, changes: list[TierChange]) -> None:
        """Number the tiers' changes as KV events on their medium."""
        for change in changes:
            event_id, hashes = self._take_event_id(), [change.block_hash]
            if change.stored:
                self._events.append(BlockStored(event_id, change.parent_hash, hashes, medium=change.medium))
            else:
                self._events.append(BlockRemoved(event_id, hashes, medium=change.medium))

    def _emit_stored(self, parent: BlockHash | None, hashes: list[BlockHash]) -> None:
        self._events.append(BlockStored(self._take_event_id(), parent, list(hashes)))

    def _take_event_id(self) -> int:
        event_id = self._next_event_id
        self._next_event_id += 1
        return event_id

    def check_integrity(self, seqs: Iterable[Sequence] | None = None) -> None:
        """Raise AssertionError unless free + evictable + used == total and the hash map agrees with the
        blocks; with `seqs` (every sequence holding blocks), reference counts must equal table membership."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is listed free twice"
        used = {b.block_id for b in self.blocks if b.ref_count > 0}
        assert all(b.ref_count >= 0 for b in self.blocks), "negative reference count"
        assert not (free & evictable) and not (free & used) and not (evictable & used), "block in two states"
        assert len(free) + len(evictable) + len(used) == self.num_blocks, "free + used != total"
        for block_hash, block_id in self._hash_to_block.items():
            assert self.blocks[block_id].block_hash == block_hash, "hash map disagrees with block"
        hashed = {b.block_id for b in self.blocks if b.block_hash is not None}
        assert hashed == set(self._hash_to_block.values()), "hashed block missing from the map"
        assert evictable <= hashed and not (free & hashed), "uncached block evictable or cached block free"
        if self.tiers is not None:
            self.tiers.check_integrity()
            assert not any(self.tiers.holds(h) for h in self._hash_to_block), "a hash on device and in a tier"
        if seqs is not None:
            counts = [0] * self.num_blocks
            for seq in seqs:
                for block_id in seq.block_table:
                    if block_id != NO_BLOCK:
                        counts[block_id] += 1
            assert counts == [b.ref_count for b in self.blocks], "reference counts != table membership"
