"""The routing decision as pure functions: cost per worker from prefix overlap and load, the hot-spot guard,
then the pick.

    cost(worker) = overlap_weight * blocks_to_prefill(worker) + active_blocks(worker)

`blocks_to_prefill` is the prompt's blocks the worker does not already hold (its prefix overlap from the
index subtracted); `active_blocks` is the KV the worker is busy with (what the router sent and has not
seen finish). The lowest cost wins (ties: the earliest candidate); with `temperature > 0` the pick is
sampled from a softmax over costs normalized to [0, 1], which spreads load among near-equal workers.

Hot-spot guard: cache affinity can pile requests onto the worker holding a popular prefix faster than the
load term pushes back. When the candidates' load is lopsided,

    max(active) >= hot_spot_min_blocks  and  max(active) / mean(active) > hot_spot_ratio   (active blocks),

load wins over cache: the least loaded candidate is picked (ties: more overlap, then the earliest). The
ratio can not exceed the number of candidates (with 2 workers, 1.5 would mean the busier one carries more than
3x the other's load), so a ratio at or above the worker count turns the guard off.

`choose` is the decision the router makes; `costs` + `select` are its plain definition, which `choose`
matches exactly (tests check it) while touching only the workers that hold part of the prompt plus the
least loaded one, so a decision costs a few C-level passes over the candidates, not a dict per decision.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import itemgetter

__all__ = ["Decision", "RoutingPolicy", "choose", "costs", "is_hot_spot", "select"]

_ZEROS = repeat(0)  # the default of `dict.get` for every candidate (an endless iterator: safe to share)


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    """The knobs of the cost model (see the module docstring); `Settings` has one field for each."""

    overlap_weight: float = 1.0
    temperature: float = 0.0
    hot_spot_ratio: float = 2.0
    hot_spot_min_blocks: int = 1024

    def __post_init__(self) -> None:
        if self.overlap_weight < 0 or self.temperature < 0 or self.hot_spot_min_blocks < 0:
            raise ValueError(f"routing policy values must not be negative: {self}")
        if self.hot_spot_ratio <= 1:
            raise ValueError(f"hot_spot_ratio must be above 1 (max/mean >= 1): {self.hot_spot_ratio}")


@dataclass(slots=True)
class Decision:
    """The chosen worker, how many leading blocks of the prompt it holds, and whether the hot-spot guard
    chose it (the guard fired; the cost may or may not have agreed)."""

    worker_id: str
    overlap_blocks: int
    hot_spot: bool = False


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


def is_hot_spot(active_blocks: Sequence[int], policy: RoutingPolicy) -> bool:
    """True when the busiest of the candidates (their loads in `active_blocks`) carries at least
    `hot_spot_min_blocks` and more than `hot_spot_ratio` times the mean load (compared without dividing,
    so an idle pool is never a hot spot)."""
    max_active = max(active_blocks)
    return (max_active >= policy.hot_spot_min_blocks
            and max_active * len(active_blocks) > policy.hot_spot_ratio * sum(active_blocks))


def choose(num_prompt_blocks: int, overlaps: Mapping[str, int], candidates: Sequence[str],
           active_blocks: Mapping[str, int], policy: RoutingPolicy,
           rng: random.Random | None = None, cached_blocks: Callable[[str], int] | None = None) -> Decision:
    """The worker among `candidates` (in preference order for ties) for a prompt of `num_prompt_blocks`
    blocks, given each worker's prefix overlap (`overlaps`, workers absent hold none; workers that are not
    candidates are ignored) and load (`active_blocks`, absent: 0).

    Equal to `select(costs(...), temperature, rng)` over the candidates unless the hot-spot guard fires;
    exactly so while costs stay below 2**52 (any real block count). With `cached_blocks` (the blocks a
    worker's cache holds), equally loaded workers that hold none of the prompt are ranked by it first: a new
    prompt goes to the emptiest cache, so new prefixes spread over the caches instead of filling the first
    candidate's (the role of sglang's smallest-tree pick)."""
    loads = _loads(candidates, active_blocks)
    if is_hot_spot(loads, policy):
        return _least_loaded(overlaps, candidates, loads)
    if policy.temperature > 0:
        worker_costs = costs(num_prompt_blocks, overlaps, dict(zip(candidates, loads)), policy.overlap_weight)
        chosen = select(worker_costs, policy.temperature, rng)
        return Decision(chosen, overlaps.get(chosen, 0))
    return _cheapest(num_prompt_blocks, overlaps, candidates, loads, policy.overlap_weight, cached_blocks)


def _loads(candidates: Sequence[str], active_blocks: Mapping[str, int]) -> Sequence[int]:
    """Each candidate's active blocks, in candidate order (0 for one `active_blocks` lacks)."""
    if len(candidates) < 2:
        if not candidates:
            raise ValueError("no candidate workers")
        return [active_blocks.get(candidates[0], 0)]
    try:  # one C call for all of them when every candidate has an entry (the router's steady state)
        return itemgetter(*candidates)(active_blocks)  # type: ignore[no-any-return]
    except KeyError:
        return list(map(active_blocks.get, candidates, _ZEROS))


def _cheapest(num_prompt_blocks: int, overlaps: Mapping[str, int], candidates: Sequence[str],
              loads: Sequence[int], overlap_weight: float,
              cached_blocks: Callable[[str], int] | None = None) -> Decision:
    """Lowest (cost, position). A candidate holding none of the prompt costs `w * P + load`, so among
    those the first least loaded wins; the only other contenders are the workers with overlap. (When the
    least loaded holds some of the prompt, its cost is at most `w * P + min_load`, and it comes before
    every other candidate of that load, so no worker without overlap can beat it either.) With
    `cached_blocks`, the least loaded is the one of them whose cache holds the fewest blocks (then the
    first); a worker with overlap still wins a tie of cost only by coming earlier."""
    min_load = min(loads)
    least = loads.index(min_load)  # the first least loaded candidate
    if cached_blocks is not None and loads.count(min_load) > 1:
        tied = [i for i, load in enumerate(loads) if load == min_load and not overlaps.get(candidates[i])]
        if tied:
            least = min(tied, key=lambda i: (cached_blocks(candidates[i]), i))
    least_id = candidates[least]
    best_overlap = overlaps.get(least_id, 0)
    best_cost = overlap_weight * (num_prompt_blocks - best_overlap) + loads[least]
    best_position = least
    for worker_id, overlap in overlaps.items():
        if worker_id == least_id:
            continue
        try:
            position = candidates.index(worker_id)
        except ValueError:  # not a candidate (excluded, or down)
            continue
        cost = overlap_weight * (num_prompt_blocks - overlap) + loads[position]
        if cost < best_cost or (cost == best_cost and position < best_position):
            best_cost, best_position, best_overlap = cost, position, overlap
    return Decision(candidates[best_position], best_overlap)


def _least_loaded(overlaps: Mapping[str, int], candidates: Sequence[str], loads: Sequence[int]) -> Decision:
    """The least loaded candidate; among equally loaded ones the one with the most overlap, then the first."""
    min_load = min(loads)
    least = loads.index(min_load)
    best_position, best_overlap = least, overlaps.get(candidates[least], 0)
    for worker_id, overlap in overlaps.items():
        try:
            position = candidates.index(worker_id)
        except ValueError:
            continue
        if loads[position] == min_load and (overlap, -position) > (best_overlap, -best_position):
            best_position, best_overlap = position, overlap
    return Decision(candidates[best_position], best_overlap, hot_spot=True)
