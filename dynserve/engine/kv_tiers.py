"""KV tiers below the device pool: a host pool and a disk directory that keep cached blocks the device pool
evicted, so a returning prefix is copied back (onboarded) instead of prefilled.

`KVTiers` is the engine's tiers: the bookkeeping of `kv_tier_book.TierBook` (which hashes each tier holds,
the moves device -> host -> disk -> dropped, the `TierChange`s the block manager numbers into KV events with
their `medium`, the counters) over `TorchPages`, where the pages are: the host tier a tensor pool of its own
(pinned on a GPU, sized by `kv_host_bytes`), the disk tier one file per block under a directory of its own
(sized by `kv_disk_bytes`). The mocker keeps the same book over a store without data (`TierBook` over
`NoPages`), so its events and counters are the engine's.

Invariants (the book's are in `kv_tier_book`):
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
from collections.abc import Collection

import torch

from dynserve.engine.kv_disk import DiskWriter, PageLayout, decode_block, encode_block, pages_bytes
from dynserve.engine.kv_tier_book import Claim, TierBook, TierChange, TierPolicy, TierStats
from dynserve.hashing import BlockHash

__all__ = ["Claim", "KVTiers", "PageLayout", "TierChange", "TierPolicy", "TierStats", "TorchPages"]

logger = logging.getLogger(__name__)


class KVTiers(TierBook):
    """The host and disk tiers of one engine's KV cache (`device_kv`: `[num_blocks, *layout.page_shape]`)."""

    def __init__(self, policy: TierPolicy, layout: PageLayout, device_kv: torch.Tensor) -> None:
        self.policy = policy
        self.layout = layout
        stats = TierStats()
        super().__init__(stats, TorchPages(policy, layout, device_kv, stats))


class TorchPages:
    """The engine's `TierPages`: host slots in a tensor pool, disk copies as block files written by a
    `DiskWriter` under a directory of this store's own, removed on `close`."""

    def __init__(self, policy: TierPolicy, layout: PageLayout, device_kv: torch.Tensor,
                 stats: TierStats) -> None:
        if tuple(device_kv.shape[1:]) != layout.page_shape or device_kv.dtype != layout.dtype:
            raise ValueError(f"device KV {tuple(device_kv.shape)} {device_kv.dtype} does not match {layout}")
        self.layout = layout
        self._stats = stats
        self._device_kv = device_kv
        self._num_host_slots = policy.host_bytes // layout.page_bytes
        pin = device_kv.device.type == "cuda"
        self._host_pool = torch.empty((self._num_host_slots, *layout.page_shape), dtype=layout.dtype,
                                      pin_memory=pin)
        self._num_disk_blocks = policy.disk_bytes // layout.file_bytes()
        self._disk_dir: str | None = None
        self._writer: DiskWriter | None = None
        if self._num_disk_blocks:
            parent = policy.disk_dir or tempfile.gettempdir()
            os.makedirs(parent, exist_ok=True)
            self._disk_dir = tempfile.mkdtemp(prefix="dynserve-kv-", dir=parent)
            self._writer = DiskWriter(stats, background=policy.disk_write == "background")
        # removes the directory on `close`, or when the store is collected or the interpreter exits unclosed
        self._finalizer = weakref.finalize(self, _remove_disk_tier, self._writer, self._disk_dir)

    @property
    def num_host_slots(self) -> int:
        return self._num_host_slots

    @property
    def num_disk_blocks_max(self) -> int:
        return self._num_disk_blocks

    @property
    def page_bytes(self) -> int:
        return self.layout.page_bytes

    @property
    def disk_dir(self) -> str | None:
        return self._disk_dir

    # ---- host -----------------------------------------------------------------------------------------

    def host_from_device(self, slot: int, block_id: int) -> None:
        self._host_pool[slot].copy_(self._device_kv[block_id])

    def device_from_host(self, block_id: int, slot: int) -> None:
        start = time.perf_counter()
        self._device_kv[block_id].copy_(self._host_pool[slot])
        self._stats.onboard_s += time.perf_counter() - start

    # ---- disk -----------------------------------------------------------------------------------------

    def disk_from_device(self, block_hash: BlockHash, parent_hash: BlockHash | None,
                         token_ids: tuple[int, ...], block_id: int) -> None:
        self._write(block_hash, parent_hash, token_ids, pages_bytes(self._device_kv[block_id]))

    def disk_from_host(self, block_hash: BlockHash, parent_hash: BlockHash | None, token_ids: tuple[int, ...],
                       slot: int) -> None:
        self._write(block_hash, parent_hash, token_ids, pages_bytes(self._host_pool[slot]))

    def _write(self, block_hash: BlockHash, parent_hash: BlockHash | None, token_ids: tuple[int, ...],
               pages: bytes) -> None:
        assert self._writer is not None
        data = encode_block(self.layout, block_hash, parent_hash, token_ids, pages)
        self._writer.write(self._path(block_hash), data)

    def take_disk(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> torch.Tensor | None:
        assert self._writer is not None
        start = time.perf_counter()
        path = self._path(block_hash)
        data = self._writer.read(path)
        self._writer.delete(path)
        payload = decode_block(self.layout, block_hash, token_ids, data)
        self._stats.onboard_s += time.perf_counter() - start  # onboarding from disk: the read and check too
        if payload is None:
            logger.warning("KV disk tier: block %016x's file %s is corrupt or short; recomputing it",
                           block_hash, path)
        return payload

    def device_from_disk(self, block_id: int, payload: object) -> None:
        assert isinstance(payload, torch.Tensor)
        start = time.perf_counter()
        self._device_kv[block_id].view(-1).view(torch.uint8).copy_(payload)
        self._stats.onboard_s += time.perf_counter() - start

    def delete_disk(self, block_hash: BlockHash) -> None:
        if self._writer is not None:
            self._writer.delete(self._path(block_hash))

    def _path(self, block_hash: BlockHash) -> str:
        assert self._disk_dir is not None
        return os.path.join(self._disk_dir, f"{block_hash:016x}.kvb")

    # ---- lifetime -------------------------------------------------------------------------------------

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Stop the writer and remove the disk tier's directory."""
        self._finalizer()
        self._writer = None
        self._disk_dir = None
        self._num_disk_blocks = 0

    def check_disk(self, block_hashes: Collection[BlockHash]) -> None:
        """After the writer's queue is done: the directory holds exactly the files of `block_hashes`."""
        if self._writer is not None and self._writer.idle():
            assert self._disk_dir is not None
            on_disk = {name for name in os.listdir(self._disk_dir) if name.endswith(".kvb")}
            expected = {os.path.basename(self._path(h)) for h in block_hashes}
            assert on_disk == expected, "disk files != disk tier"


def _remove_disk_tier(writer: DiskWriter | None, disk_dir: str | None) -> None:
    if writer is not None:
        writer.close()
    if disk_dir is not None:
        shutil.rmtree(disk_dir, ignore_errors=True)
