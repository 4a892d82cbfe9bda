"""The routing decision as a pure function: cost per worker from prefix overlap and load, then the pick.

    cost(worker) = overlap_weight * blocks_to_prefill(worker) + active_blocks(worker)

`blocks_to_prefill` is the prompt's blocks the worker does not already hold (its prefix overlap from the
index subtracted); `active_blocks` is the KV the worker is busy with (what the router sent and has not
seen finish, corrected by what the worker reports). The lowest cost wins; with `temperature > 0` the pick
is sampled from a softmax over costs normalized to [0, 1], which spreads load among near-equal workers.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping

__all__ = ["costs", "select"]


def costs(num_prompt_blocks: int, overlaps: Mapping[str, int], active_blocks: Mapping[str, int],
          overlap_weight: float = 1.0) -> dict[str, float]:
    """Cost of each worker in `active_blocks` (the candidates) for a prompt of `num_prompt_blocks` blocks."""
    return {worker: overlap_weight * (num_prompt_blocks - overlaps.get(worker, 0)) + active
            for worker, active in active_blocks.items()}


def select(worker_costs: Mapping[str, float], temperature: float = 0.0, rng: random.Random | None = None) -> str:
    """The lowest-cost worker (ties: the first in iteration order), or a softmax sample when temperature > 0."""
    if not worker_costs:
        raise ValueError("no candidate workers")
    if temperature <= 0:
        return min(worker_costs, key=worker_costs.__getitem__)
    low, high = min(worker_costs.values()), max(worker_costs.values())
    span = (high - low) or 1.0
    weights = [math.exp(-(c - low) / span / temperature) for c in worker_costs.values()]
    return (rng or random).choices(list(worker_costs), weights)[0]
