"""The per-request record the engine's parts share.

A Sequence owns its token ids (prompt then output), how many of them have KV in the cache
(`num_computed_tokens`), its block table, and the hashes of its full blocks, computed once, incrementally.
Invariant: `num_computed_tokens <= num_tokens` and the block table covers every computed token.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dynserve.hashing import BlockHash, hash_block
from dynserve.protocol import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    import torch

    from dynserve.engine.structured import GrammarState

__all__ = ["Sequence", "SequenceStatus"]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_registered_blocks: int = 0  # leading blocks of the table already offered to the prefix cache
    cacheable: bool = True  # False once a hash collision was met: later blocks are never cached
    finish_reason: str | None = None
    num_preemptions: int = 0
    _generator: torch.Generator | None = None  # built on first use: see `sampling_generator`
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # token id -> count over output tokens, kept only when a penalty needs it
    output_counts: dict[int, int] | None = None
    # the grammar's matcher when `params.grammar` is set (`structured.py`): it has consumed every output token
    grammar: GrammarState | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.presence_penalty or self.params.frequency_penalty:
            self.output_counts = {}

    def sampling_generator(self, device: torch.device | None = None) -> torch.Generator | None:
        """This request's seeded torch generator (None without a seed), on the device its engine samples on
        (the CPU by default). Built on the first draw, so engines that never sample with torch (the mocker)
        never import it; the stream is the same either way."""
        if self._generator is None and self.params.seed is not None:
            import torch

            self._generator = torch.Generator(device=device or "cpu").manual_seed(self.params.seed)
        return self._generator

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.output_counts is not None:
            self.output_counts[token_id] = self.output_counts.get(token_id, 0) + 1

    def update_block_hashes(self, block_size: int, salt: int) -> None:
        """Extend `block_hashes` to cover every full block of `token_ids`."""
        num_full = len(self.token_ids) // block_size
        for i in range(len(self.block_hashes), num_full):
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.append(
                hash_block(parent, self.token_ids[i * block_size : (i + 1) * block_size], salt)
            )
