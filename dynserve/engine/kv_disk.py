"""Block files of the disk KV tier: their format, and the thread that writes them.

A block file is a header, the block's token ids and its pages. The header (`_HEADER`) holds a magic, the
format version, the model salt, the block's hash and parent, its layout (dtype, page shape, block size), the
payload's size and an xxh3-64 checksum of token ids and pages. `decode_block` returns the pages only when
every header field matches what the reader expects and the checksum holds, so a corrupt, short, misplaced
or foreign file is never served.

`DiskWriter` writes and deletes files in the order they were asked for, on a thread of its own
(background) or at once (sync); a file's last operation wins. A file whose write is still queued is read
from its queued bytes, so a reader never waits for the disk nor sees a half-written file (each file is
written under a temporary name and renamed).
"""

from __future__ import annotations

import logging
import os
import queue
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import xxhash

from dynserve.hashing import BlockHash

__all__ = ["DiskWriter", "PageLayout", "decode_block", "encode_block", "pages_bytes"]

logger = logging.getLogger(__name__)

_MAGIC = b"DYNKVBLK"
_VERSION = 1
# magic, version, model salt, block hash, parent hash, has parent, block size, num tokens, dtype, ndim,
# shape (8 dims, zero-padded), payload bytes, checksum
_HEADER = struct.Struct("<8sHQQQBII16sB8IQQ")
_MAX_DIMS = 8


@dataclass(frozen=True, slots=True)
class PageLayout:
    """One block's pages: `page_shape` (`[num_layers, 2, block_size, num_kv_heads, head_dim]`) of `dtype`,
    for the model whose hashes are salted with `model_salt`."""

    dtype: torch.dtype
    page_shape: tuple[int, ...]
    block_size: int
    model_salt: int

    @property
    def page_bytes(self) -> int:
        num = 1
        for dim in self.page_shape:
            num *= dim
        return num * self.dtype.itemsize

    @property
    def dtype_name(self) -> bytes:
        return str(self.dtype).removeprefix("torch.").encode()

    def file_bytes(self) -> int:
        """A disk file's size: header, token ids, pages."""
        return _HEADER.size + 8 * self.block_size + self.page_bytes


def pages_bytes(pages: torch.Tensor) -> bytes:
    """A block's pages (any dtype, any device) as bytes in memory order."""
    return pages.detach().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()


def encode_block(layout: PageLayout, block_hash: BlockHash, parent_hash: BlockHash | None,
                 token_ids: Sequence[int], pages: bytes) -> bytes:
    """A block file's bytes: header, token ids, pages."""
    ids = struct.pack(f"<{len(token_ids)}q", *token_ids)
    shape = list(layout.page_shape) + [0] * (_MAX_DIMS - len(layout.page_shape))
    digest = xxhash.xxh3_64()
    digest.update(ids)
    digest.update(pages)
    checksum = digest.intdigest()
    header = _HEADER.pack(_MAGIC, _VERSION, layout.model_salt, block_hash,
                          0 if parent_hash is None else parent_hash,
                          parent_hash is not None, layout.block_size, len(token_ids), layout.dtype_name,
                          len(layout.page_shape), *shape, len(pages), checksum)
    return b"".join((header, ids, pages))


def decode_block(layout: PageLayout, block_hash: BlockHash, token_ids: tuple[int, ...],
                 data: bytes | bytearray | None) -> torch.Tensor | None:
    """The pages (uint8) of block file `data` if it is whole, its checksum holds, and its header names this
    format, `layout`'s model and shape, `block_hash` and `token_ids`; None otherwise."""
    if data is None or len(data) < _HEADER.size:
        return None
    fields = _HEADER.unpack_from(data)
    magic, version, salt, stored_hash, _parent, _has_parent, block_size, num_tokens, dtype_name, ndim = (
        fields[:10])
    shape, payload_bytes, checksum = fields[10:18], fields[18], fields[19]
    expected_shape = tuple(layout.page_shape) + (0,) * (_MAX_DIMS - len(layout.page_shape))
    if (magic != _MAGIC or version != _VERSION or salt != layout.model_salt or stored_hash != block_hash
            or block_size != layout.block_size or num_tokens != len(token_ids)
            or dtype_name.rstrip(b"\0") != layout.dtype_name or ndim != len(layout.page_shape)
            or tuple(shape) != expected_shape or payload_bytes != layout.page_bytes
            or len(data) != _HEADER.size + 8 * num_tokens + payload_bytes):
        return None
    body = memoryview(data)[_HEADER.size:]
    if xxhash.xxh3_64_intdigest(body) != checksum:
        return None
    if struct.unpack_from(f"<{num_tokens}q", body) != token_ids:
        return None
    start = _HEADER.size + 8 * num_tokens
    if isinstance(data, bytearray):  # read from its file: the pages are used in place
        return torch.frombuffer(data, dtype=torch.uint8, offset=start, count=payload_bytes)
    return torch.frombuffer(bytearray(body[8 * num_tokens:]), dtype=torch.uint8)


class DiskCounters(Protocol):
    disk_write_bytes: int
    disk_read_bytes: int


class DiskWriter:
    """Writes and deletes block files in the order asked, on a thread (background) or at once (sync); a file
    whose write is queued is read from its queued bytes."""

    def __init__(self, stats: DiskCounters, *, background: bool) -> None:
        """`stats`: where the bytes written and read are counted (written ones on the writer thread)."""
        self._stats = stats
        self._lock = threading.Lock()
        self._pending: dict[str, bytes] = {}  # path -> bytes queued for it, until written or deleted
        self._queue: queue.Queue[tuple[str, bytes | None] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name="kv-disk-writer", daemon=True)
            self._thread.start()

    def write(self, path: str, data: bytes) -> None:
        with self._lock:
            self._pending[path] = data
        self._submit((path, data))

    def delete(self, path: str) -> None:
        with self._lock:
            self._pending.pop(path, None)
        self._submit((path, None))

    def read(self, path: str) -> bytes | bytearray | None:
        """The file's bytes (one sequential read into one buffer), its queued bytes if not yet written, None
        if absent."""
        with self._lock:
            queued = self._pending.get(path)
        if queued is not None:
            return queued
        try:
            with open(path, "rb", buffering=0) as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                del data[f.readinto(data) or 0:]
        except OSError:
            return None
        self._stats.disk_read_bytes += len(data)
        return data

    def _submit(self, job: tuple[str, bytes | None]) -> None:
        if self._thread is None:
            self._do(job)
        else:
            self._queue.put(job)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._do(job)
            finally:
                self._queue.task_done()

    def _do(self, job: tuple[str, bytes | None]) -> None:
        path, data = job
        try:
            if data is None:
                with self._lock:
                    if path in self._pending:
                        return  # written again since: the newer write follows in the queue
                if os.path.exists(path):
                    os.unlink(path)
                return
            tmp = f"{path}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
            with self._lock:
                self._stats.disk_write_bytes += len(data)
                if self._pending.get(path) is data:
                    del self._pending[path]
        except OSError:
            logger.exception("KV disk tier: writing %s failed; the block will be recomputed", path)
            with self._lock:
                if self._pending.get(path) is data:
                    del self._pending[path]

    def idle(self) -> bool:
        return self._queue.unfinished_tasks == 0

    def flush(self) -> None:
        if self._thread is not None:
            self._queue.join()

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
