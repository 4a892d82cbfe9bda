"""The routing decision as pure functions: cost per worker from prefix overlap and load, the hot-spot guard,
then the pick.

    cost(worker) = overlap_weight * blocks_to_prefill(worker) + active_blocks(worker)

`blocks_to_prefill` is the prompt's blocks the worker does not already hold (its prefix overlap from the
index subtracted); `active_blocks` is the KV the worker is busy with (what the router sent and has not
seen finish). The lowest cost wins (ties: the earliest candidate); with `temperature > 0` the pick is
sampled from a softmax over costs normalized to [0, 1], which spreads load among near-equal workers.

Tiers. A prefix block held on the device saves a whole block of prefill; one held on a lower medium saves
the prefill less the cost of bringing it back to the device, so it is credited `host_hit_weight` or
`disk_hit_weight` of a block (`tier_credits`): the overlap subtracted above is then
`device + host_hit_weight * host + disk_hit_weight * disk`. With no lower-medium block in any candidate's
prefix the credit is the overlap itself and every decision is the device-only one.

Peer pulls (`pull_hit_weight > 0`). A worker that lacks blocks another candidate holds can read them from that
holder instead of prefilling them: cheaper than a prefill, dearer than a hit of the holder's own. The holder
first brings a block it keeps on a lower tier to its device, so a pulled block is worth `pull_hit_weight` of
what it is worth to the holder (the holder's tier credit per block it holds). Each candidate is credited that
for each prompt block the best holder (the candidate with the longest prefix) has beyond its own, where that
is at least `pull_min_blocks`; a pull never beats the holder's own hit at equal load. When the pick is not the
holder and it would pull, the decision names the holder (`pull_from`) and the blocks it holds
(`pull_blocks`). With pulls off, or no overlap anywhere, nothing changes.

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

__all__ = ["Decision", "RoutingPolicy", "choose", "costs", "is_hot_spot", "pull_credits", "select", "tier_credits"]

_ZEROS = repeat(0)  # the default of `dict.get` for every candidate (an endless iterator: safe to share)


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    """The knobs of the cost model (see the module docstring); `Settings` has one field for each."""

    overlap_weight: float = 1.0
    temperature: float = 0.0
    hot_spot_ratio: float = 2.0
    hot_spot_min_blocks: int = 1024
    # The share of a block's prefill that a hit on the host / disk tier saves (a device hit saves 1).
    # Estimates, not measurements: onboarding a block is a copy of its bytes, prefilling it is the model's
    # FLOPs over it. On a GPU (a 2 MiB block of an 8B model: ~0.6 ms to prefill on an H100, ~0.05 ms over
    # PCIe at ~40 GB/s, ~0.4 ms from NVMe at ~5 GB/s) host saves ~0.9 and disk ~0.4; on a CPU worker the
    # prefill is far dearer than either copy (both ~0.95+). The defaults take the GPU's, the smaller
    # savings; `python -m benchmarks.tiers` (issue 35, part 5) is to measure them.
    host_hit_weight: float = 0.9
    disk_hit_weight: float = 0.5
    # The share of a block's prefill that pulling it from a peer saves (0: no pulls). A pull is a one-sided
    # read of the block's bytes plus a round trip to the holder: on a GPU fleet over RDMA about a tenth of the
    # prefill, over TCP more; `pull_min_blocks` keeps short pulls, whose round trip dominates, from happening.
    pull_hit_weight: float = 0.0
    pull_min_blocks: int = 4

    def __post_init__(self) -> None:
        if self.overlap_weight < 0 or self.temperature < 0 or self.hot_spot_min_blocks < 0:
            raise ValueError(f"routing policy values must not be negative: {self}")
        if not (0 <= self.host_hit_weight <= 1 and 0 <= self.disk_hit_weight <= 1
                and 0 <= self.pull_hit_weight <= 1):
            raise ValueError(f"host_hit_weight, disk_hit_weight and pull_hit_weight must lie in [0, 1]: {self}")
        if self.pull_min_blocks < 1:
            raise ValueError(f"pull_min_blocks must be at least 1: {self.pull_min_blocks}")
        if self.hot_spot_ratio <= 1:
            raise ValueError(f"hot_spot_ratio must be above 1 (max/mean >= 1): {self.hot_spot_ratio}")


@dataclass(slots=True)
class Decision:
    """The chosen worker, how many leading blocks of the prompt it holds (on any medium), whether the
    hot-spot guard chose it (the guard fired; the cost may or may not have agreed), and, when part of its
    prefix lies below the device, its blocks per medium (`protocol.MEDIA` order; None: all on the device).
    With peer pulls, `pull_from` is the candidate to read the prefix from and `pull_blocks` the prompt's
    leading blocks it holds (more than `overlap_blocks`), or None and 0."""

    worker_id: str
    overlap_blocks: int
    hot_spot: bool = False
    blocks_by_medium: tuple[int, ...] | None = None
    pull_from: str | None = None
    pull_blocks: int = 0


def tier_credits(overlaps: Mapping[str, int], lower: Mapping[str, Sequence[int]],
                 policy: RoutingPolicy) -> Mapping[str, float]:
    """Each worker's overlap credited by tier: `overlaps` (blocks held on any medium) where the worker is
    absent from `lower`, else `device + host_hit_weight * host + disk_hit_weight * disk` from its blocks per
    medium in `lower` (`protocol.MEDIA` order). `overlaps` itself when `lower` is empty."""
    if not lower:
        return overlaps
    credits: dict[str, float] = dict(overlaps)
    host_weight, disk_weight = policy.host_hit_weight, policy.disk_hit_weight
    for worker_id, (device, host, disk) in lower.items():
        credits[worker_id] = device + host_weight * host + disk_weight * disk
    return credits


def pull_credits(overlaps: Mapping[str, int], credits: Mapping[str, float], candidates: Sequence[str],
                 policy: RoutingPolicy) -> tuple[Mapping[str, float], str | None, int]:
    """Each candidate's credit (`credits`: its overlap or tier credits) plus what pulling from the best holder
    would save it (see the module docstring), that holder and the blocks it holds. `credits` and no holder
    when pulls are off or no candidate holds `pull_min_blocks` of the prompt."""
    if policy.pull_hit_weight <= 0 or not overlaps:
        return credits, None, 0
    holder, held = None, 0
    for worker_id in candidates:  # the first of the longest: candidates come in preference order
        blocks = overlaps.get(worker_id, 0)
        if blocks > held:
            holder, held = worker_id, blocks
    if holder is None or held < policy.pull_min_blocks:
        return credits, None, 0
    # a pulled block is worth `pull_hit_weight` of what it is worth to the holder (below 1 for its lower tiers)
    weight, min_blocks = policy.pull_hit_weight * credits.get(holder, held) / held, policy.pull_min_blocks
    with_pulls: dict[str, float] = {}
    for worker_id in candidates:
        own = overlaps.get(worker_id, 0)
        credit = credits.get(worker_id, 0)
        with_pulls[worker_id] = credit + weight * (held - own) if held - own >= min_blocks else credit
    return with_pulls, holder, held


def costs(num_prompt_blocks: int, overlaps: Mapping[str, float], active_blocks: Mapping[str, int],
          overlap_weight: float = 1.0) -> dict[str, float]:
    """Cost of each worker in `active_blocks` (the candidates) for a prompt of `num_prompt_blocks` blocks;
    `overlaps` are the blocks each saves (its overlap, or its tier credits)."""
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
           rng: random.Random | None = None, cached_blocks: Callable[[str], int] | None = None,
           lower: Mapping[str, Sequence[int]] | None = None) -> Decision:
    """The worker among `candidates` (in preference order for ties) for a prompt of `num_prompt_blocks`
    blocks, given each worker's prefix overlap (`overlaps`, workers absent hold none; workers that are not
    candidates are ignored) and load (`active_blocks`, absent: 0). `lower`: the blocks per medium of the
    workers whose prefix reaches below the device (`TieredIndex.match`); the cost then credits their
    overlap by tier (`tier_credits`), and the decision still reports the blocks held.

    Equal to `select(costs(num_prompt_blocks, credits, ...), temperature, rng)` over the candidates, with
    `credits = pull_credits(overlaps, tier_credits(...), candidates, policy)[0]`, unless the hot-spot guard
    fires (both compute each cost by the same expression); exactly so while costs stay below 2**52 (any real block count). With `cached_blocks` (the blocks a worker's cache
    holds), equally loaded workers that hold none of the prompt are ranked by it first: a new prompt goes to
    the emptiest cache, so new prefixes spread over the caches instead of filling the first candidate's (the
    role of sglang's smallest-tree pick)."""
    if lower or (policy.pull_hit_weight > 0 and overlaps):
        credits = tier_credits(overlaps, lower, policy) if lower else overlaps
        credits, holder, held = pull_credits(overlaps, credits, candidates, policy)
        decision = _choose(num_prompt_blocks, credits, candidates, active_blocks, policy, rng, cached_blocks)
        worker_id = decision.worker_id
        decision.overlap_blocks = overlaps.get(worker_id, 0)
        by_medium = lower.get(worker_id) if lower else None
        decision.blocks_by_medium = tuple(by_medium) if by_medium is not None else None
        if holder is not None and holder != worker_id and held - decision.overlap_blocks >= policy.pull_min_blocks:
            decision.pull_from, decision.pull_blocks = holder, held
        return decision
    return _choose(num_prompt_blocks, overlaps, candidates, active_blocks, policy, rng, cached_blocks)


def _choose(num_prompt_blocks: int, overlaps: Mapping[str, float], candidates: Sequence[str],
            active_blocks: Mapping[str, int], policy: RoutingPolicy, rng: random.Random | None,
            cached_blocks: Callable[[str], int] | None) -> Decision:
    """`choose` over blocks saved per worker (`overlaps`: held blocks, or tier credits); the decision's
    `overlap_blocks` is the chosen one's entry there (a credit, which `choose` replaces by blocks held)."""
    loads = _loads(candidates, active_blocks)
    if is_hot_spot(loads, policy):
        return _least_loaded(overlaps, candidates, loads)
    if policy.temperature > 0:
        worker_costs = costs(num_prompt_blocks, overlaps, dict(zip(candidates, loads)), policy.overlap_weight)
        chosen = select(worker_costs, policy.temperature, rng)
        return Decision(chosen, overlaps.get(chosen, 0))  # type: ignore[arg-type]  # see the docstring
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


def _cheapest(num_prompt_blocks: int, overlaps: Mapping[str, float], candidates: Sequence[str],
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


def _least_loaded(overlaps: Mapping[str, float], candidates: Sequence[str], loads: Sequence[int]) -> Decision:
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
