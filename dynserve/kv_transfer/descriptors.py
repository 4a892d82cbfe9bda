"""Block descriptors and the wire types that cross processes: a KV cache's layout, runs of blocks, and the
metadata an agent publishes so that peers can read its pages.

The KV cache is block-major (`[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`), so block
`b` is the one contiguous region `[b * block_size_bytes, (b + 1) * block_size_bytes)` of the tensor, and a
run of adjacent blocks is one region too. `coalesce_block_runs` turns a read's (remote, local) block pairs
into the fewest runs that are adjacent on both sides: one transfer descriptor per run on each side, and
the two sides always have the same number of descriptors with equal lengths.

Invariants: a `BlockRun` has `num_blocks >= 1`; the runs of one read cover each requested pair exactly once
and no local block twice. Everything here is pure (no I/O), so tests call it directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec

__all__ = [
    "AgentMetadata",
    "BlockRun",
    "KVLayout",
    "NixlAgentMetadata",
    "Notification",
    "TcpAgentMetadata",
    "coalesce_block_runs",
    "decode_metadata",
    "encode_metadata",
    "validate_block_ids",
]


class KVLayout(msgspec.Struct, frozen=True, kw_only=True):
    """The shape of a registered KV cache as peers need it: `num_blocks` blocks of `block_size_bytes` each,
    on `device` ("cpu", "cuda:0", ...), holding elements of `dtype` ("bfloat16", ...; "" from a peer that
    predates the field: not compared)."""

    num_blocks: int
    block_size_bytes: int
    device: str
    dtype: str = ""

    @property
    def size_bytes(self) -> int:
        return self.num_blocks * self.block_size_bytes


class BlockRun(msgspec.Struct, frozen=True, array_like=True):
    """Remote blocks `remote_start ..` copied to local blocks `local_start ..`, `num_blocks` of them."""

    remote_start: int
    local_start: int
    num_blocks: int

    def remote_offset_bytes(self, block_size_bytes: int) -> int:
        return self.remote_start * block_size_bytes

    def local_offset_bytes(self, block_size_bytes: int) -> int:
        return self.local_start * block_size_bytes

    def size_bytes(self, block_size_bytes: int) -> int:
        return self.num_blocks * block_size_bytes


class NixlAgentMetadata(msgspec.Struct, frozen=True, kw_only=True, tag="nixl"):
    """What a NIXL agent publishes: its name, its cache's layout and address, and NIXL's own metadata
    (connection info and the registered memory's remote keys)."""

    agent_name: str
    layout: KVLayout
    base_address: int
    device_id: int
    nixl_metadata: bytes


class TcpAgentMetadata(msgspec.Struct, frozen=True, kw_only=True, tag="tcp"):
    """What a TCP agent publishes: its name, its cache's layout, where it serves the cache's bytes, and the
    token a reader must present on connecting (the agent's own random secret: whoever can read the
    registry may read the pages, whoever can merely reach the port may not)."""

    agent_name: str
    layout: KVLayout
    host: str
    port: int
    token: str


AgentMetadata = NixlAgentMetadata | TcpAgentMetadata


class Notification(msgspec.Struct, frozen=True):
    """A message a peer sent with `KVConnector.notify` (e.g. "blocks read, release them")."""

    peer: str
    message: bytes


def encode_metadata(metadata: AgentMetadata) -> bytes:
    return msgspec.msgpack.encode(metadata)


def decode_metadata(data: bytes) -> AgentMetadata:
    """Raises `msgspec.ValidationError` / `msgspec.DecodeError` on bytes that are not agent metadata."""
    return msgspec.msgpack.decode(data, type=AgentMetadata)  # type: ignore[arg-type]


def validate_block_ids(block_ids: Sequence[int], num_blocks: int, side: Literal["remote", "local"]) -> None:
    """ValueError unless every id is in `0 .. num_blocks-1`."""
    for block_id in block_ids:
        if not 0 <= block_id < num_blocks:
            raise ValueError(f"{side} block id {block_id} is outside 0..{num_blocks - 1}")


def coalesce_block_runs(remote_block_ids: Sequence[int], local_block_ids: Sequence[int]) -> list[BlockRun]:
    """The fewest runs copying `remote_block_ids[i]` to `local_block_ids[i]` for every i: pairs are sorted by
    local block, and a pair extends the current run when both its blocks follow the run's last ones.

    ValueError when the lists differ in length or a local block appears twice (it would be written twice).
    """
    if len(remote_block_ids) != len(local_block_ids):
        raise ValueError(f"{len(remote_block_ids)} remote blocks but {len(local_block_ids)} local blocks")
    if len(set(local_block_ids)) != len(local_block_ids):
        raise ValueError("a local block appears twice in one read")
    runs: list[BlockRun] = []
    remote_start = local_start = num_blocks = 0
    for local_id, remote_id in sorted(zip(local_block_ids, remote_block_ids, strict=True)):
        if num_blocks and local_id == local_start + num_blocks and remote_id == remote_start + num_blocks:
            num_blocks += 1
            continue
        if num_blocks:
            runs.append(BlockRun(remote_start, local_start, num_blocks))
        remote_start, local_start, num_blocks = remote_id, local_id, 1
    if num_blocks:
        runs.append(BlockRun(remote_start, local_start, num_blocks))
    return runs
