"""Block hashing: the one definition shared by the engine's prefix cache and the router.

A block is `block_size` consecutive token ids. Only full blocks are hashed. A block's hash is xxh3-64 over
its parent's hash (0 for the first block) followed by its token ids, seeded by a salt that covers the model
and LoRA adapter, so equal hashes mean "same tokens after the same prefix, same model".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NewType

import numpy as np
import xxhash

__all__ = ["BlockHash", "hash_block", "hash_blocks", "model_salt"]

BlockHash = NewType("BlockHash", int)

_ROOT_PARENT = 0


def model_salt(model_id: str, lora_id: str | None = None) -> int:
    """The seed for block hashes of one (model, adapter) pair."""
    return xxhash.xxh3_64_intdigest(f"{model_id}\x00{lora_id or ''}".encode())


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], salt: int) -> BlockHash:
    """Hash of one full block given its parent's hash (None for the first block)."""
    h = xxhash.xxh3_64(seed=salt)
    h.update((_ROOT_PARENT if parent is None else parent).to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return BlockHash(h.intdigest())


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    salt: int,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Chained hashes of every full block of `token_ids` (a trailing partial block is not hashed)."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    hashes: list[BlockHash] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = xxhash.xxh3_64(seed=salt)
        h.update((_ROOT_PARENT if parent is None else parent).to_bytes(8, "little"))
        h.update(tokens[start : start + block_size].tobytes())
        parent = BlockHash(h.intdigest())
        hashes.append(parent)
    return hashes
