"""An offline what-if of the multimodel benchmark's planner half: its trace (`_multimodel_trace.py`) replayed
through the real `PlannerCore`s of its models, sharing a `SharedBudget`, against a model of the fleet
instead of a fleet: seconds a replay, so a change to the planner or the budget can be weighed over many
replays before a full run (12.5 minutes each) measures it.

The model of the fleet, and what it leaves out:

- **prefill**: each prefill worker serves its queue first come, first served, a prompt at a time, at the
  profile's saturated prompt tokens/s for its length (`CapacityProfile.prefill_tokens_per_s`); a request
  goes to the worker of its model with the least work queued; a worker that joins takes the tail of the
  busier workers' queues until the queues are even (the gateway's hand-back). A request's TTFT is its wait
  plus its prefill plus `FIRST_TOKEN_S`. Left out: the mocker's batching of prefills (a chunk of 8,192
  tokens a step), the KV transfer, the gateway, the machine's CPU;
- **decode**: workers are counted (budget, worker-seconds), not simulated: a request misses when its TTFT
  does (TTFT > 2 s: `benchmarks.planner.SLO`; the fleets' rare mean-ITL misses came from the machine);
- **a new worker** serves after a start drawn from a lognormal (`lag_median_s`, `lag_sigma`; each start's
  draw keyed by the replay's seed, its model, pool, slot and decision time, so two settings compared see the
  same lag wherever they start the same worker at the same time): the full runs
  measured a median of 2.2-2.8 s under load, p90 3.5-3.9 s, up to 6 s; a removed one finishes its queue;
- **the planner's reads**, each model's every `interval_s` from a random phase: the rate of its arrivals
  over the read window (as `ArrivalRate`), the mean ISL, OSL and TTFT of the requests whose first token
  came in the read window a scrape (1 s) ago, its serving and starting workers.

`replay` returns the misses, the worker-seconds and their ratio to the static fleet's, and the pool
decisions the budget cut. Its figures are this model's, not the fleet's: read them as a comparison between
settings replayed the same way, never as a forecast of a full run.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks._multimodel_whatif

replays the full plan's trace (seed 0) 20 times (start lags of median 3 and 4 s, 10 seeds each) for each of
four settings: a prefill floor of one worker a model with the planner's rise spare (the benchmark's until
2026-11-29) and without it, and the benchmark's floor (`TurnsPlan.prefill_floor`) without the rise spare (the
benchmark's since) and with it, each within the
budget its floors size (`size_fleets`); and prints each's misses, replays without a miss, worker-s ratio,
budget cuts and worker starts, all and the trickles' (about a minute and a half).
"""

from __future__ import annotations

import bisect
import functools
import heapq
import math
import random
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from benchmarks._multimodel_trace import Sizing, TurnsTrace
from dynserve.planner.core import Observation, PlannerConfig, PlannerCore, PoolObservation, SharedBudget

__all__ = ["FIRST_TOKEN_S", "WhatIf", "main", "planner_config", "replay", "start_lag_s"]

FIRST_TOKEN_S = 0.03  # the first decode step after a prefill
SCRAPE_LAG_S = 1.0
MISS_TTFT_S = 2.0


@dataclass(frozen=True, slots=True)
class WhatIf:
    """One replay's figures: TTFT misses (and each one's model and arrival), worker-seconds (prefill and
    decode workers serving, all models) and their ratio to the static fleet's, pool decisions cut by the
    budget, workers started (each a process start: on the benchmark's 2 cores about 1.4 s of CPU), and of
    them those a model started outside its bump (`bumps`: its trickle's blips)."""

    num_missed: int
    worker_s: float
    ratio: float
    num_budget_cuts: int
    missed: tuple[tuple[int, float], ...]
    num_starts: int = 0
    num_trickle_starts: int = 0


@dataclass(slots=True)
class _Worker:
    serving_from_s: float
    busy_until_s: float = 0.0
    queue: deque[tuple[float, int, int]] = field(default_factory=deque)  # (arrival, ISL, request index)
    draining: bool = False

    def work_s(self, now_s: float, tokens_per_s: float) -> float:
        return max(0.0, self.busy_until_s - now_s) + sum(isl for _, isl, _ in self.queue) / tokens_per_s


def start_lag_s(seed: int, model_index: int, pool: str, slot: int, decided_s: float, *, median_s: float,
                sigma: float) -> float:
    """The start of the worker that makes `pool` of model `model_index` `slot` workers, decided at
    `decided_s`: lognormal, drawn from the start's own key rather than from one stream, so a setting that
    starts one worker more or less leaves every other start's lag as it was (common random numbers: two
    settings' misses differ by the setting, not by a reshuffled draw)."""
    draw = random.Random(f"{seed}/{model_index}/{pool}/{slot}/{decided_s:.3f}")
    return median_s * math.exp(draw.gauss(0.0, sigma))


def planner_config(sizing: Sizing, *, ttft_target_s: float, itl_target_s: float, interval_s: float,
                   read_window_s: float, down_delay_s: float, floors: Mapping[str, int] | None = None,
                   **changes: Any) -> PlannerConfig:
    """The config `dynctl serve` builds from the planner fleet's flags (`fleet_flags`), with `changes`;
    `floors`: each pool's least workers (default one a pool), where a replay's models start."""
    config = PlannerConfig(mode="sla", ttft_target_s=ttft_target_s, itl_target_s=itl_target_s,
                           interval_s=interval_s, min_workers=dict(floors or {"prefill": 1, "decode": 1}),
                           max_workers=dict(sizing.static_fleet), read_window_s=read_window_s,
                           down_delay_s=down_delay_s)
    return replace(config, **changes)


class _Model:
    """One model's prefill queues, decode workers and planner."""

    def __init__(self, core: PlannerCore, requests: list[tuple[float, int, int]], tokens_per_s: Any) -> None:
        self.core, self.requests, self.tokens_per_s = core, requests, tokens_per_s
        self.arrivals_s = [t for t, _, _ in requests]
        # what a queue's tokens weigh when the gateway compares workers
        self.nominal_tokens_per_s = tokens_per_s(2048)
        floors = core.config.min_workers  # a model starts at its floors
        self.prefill = [_Worker(0.0) for _ in range(floors["prefill"])]
        self.decode_from_s = [0.0] * floors["decode"]
        self.targets = {"prefill": floors["prefill"], "decode": floors["decode"]}
        self.ttft_s: list[float | None] = [None] * len(requests)
        self.first_tokens: list[tuple[float, float, int, int]] = []  # (at, TTFT, ISL, OSL)

    def advance(self, now_s: float) -> None:
        """Serve every queue up to `now_s`; drop drained workers."""
        for worker in self.prefill:
            while worker.queue and worker.serving_from_s <= now_s:
                arrival_s, isl, index = worker.queue[0]
                start_s = max(worker.busy_until_s, arrival_s, worker.serving_from_s)
                if start_s > now_s:
                    break
                worker.queue.popleft()
                worker.busy_until_s = start_s + isl / self.tokens_per_s(isl)
                ttft_s = worker.busy_until_s - arrival_s + FIRST_TOKEN_S
                self.ttft_s[index] = ttft_s
                self.first_tokens.append((worker.busy_until_s, ttft_s, isl, self.requests[index][2]))
        self.prefill = [w for w in self.prefill if not (w.draining and not w.queue)]

    def serving(self, now_s: float) -> list[_Worker]:
        return [w for w in self.prefill if w.serving_from_s <= now_s and not w.draining]

    def arrive(self, now_s: float, index: int) -> None:
        workers = self.serving(now_s) or self.prefill
        self._least_busy(workers, now_s).queue.append((now_s, self.requests[index][1], index))

    def _least_busy(self, workers: list[_Worker], now_s: float) -> _Worker:
        return min(workers, key=lambda w: w.work_s(now_s, self.nominal_tokens_per_s))

    def join(self, now_s: float) -> None:
        """A worker joined: the busier workers hand the tails of their queues to the least busy."""
        workers, tokens_per_s = self.serving(now_s), self.nominal_tokens_per_s
        while True:
            busiest = max(workers, key=lambda w: w.work_s(now_s, tokens_per_s))
            idlest = self._least_busy(workers, now_s)
            gap_s = busiest.work_s(now_s, tokens_per_s) - idlest.work_s(now_s, tokens_per_s)
            if len(busiest.queue) < 2 or gap_s < 2 * busiest.queue[-1][1] / tokens_per_s:
                return
            idlest.queue.append(busiest.queue.pop())

    def observe(self, now_s: float) -> Observation:
        window_s = self.core.config.read_window_s
        count = bisect.bisect(self.arrivals_s, now_s) - bisect.bisect(self.arrivals_s, now_s - window_s)
        rate = count / window_s if now_s >= window_s else math.nan
        read_s = now_s - SCRAPE_LAG_S
        seen = [x for x in self.first_tokens if read_s - window_s <= x[0] <= read_s]

        def mean(k: int) -> float:
            return sum(x[k] for x in seen) / len(seen) if seen else math.nan

        num_prefill = len(self.serving(now_s))
        num_decode = sum(1 for t in self.decode_from_s if t <= now_s)
        waiting = float(sum(len(w.queue) for w in self.prefill))
        pools = {"prefill": PoolObservation(num_prefill, ttft_s=mean(1), num_waiting=waiting,
                                            num_starting=max(0, self.targets["prefill"] - num_prefill)),
                 "decode": PoolObservation(num_decode,
                                           num_starting=max(0, self.targets["decode"] - num_decode))}
        return Observation(now_s, pools, rate, mean(2), mean(3))

    def scale(self, now_s: float, targets: Mapping[str, int], lag_s: Any) -> list[float]:
        """Carry a decision out (`lag_s(pool, slot)`: the start of a new worker that makes the pool's count
        `slot`); the times new prefill workers join."""
        joins = []
        for slot in range(self.targets["prefill"] + 1, targets["prefill"] + 1):
            self.prefill.append(_Worker(now_s + lag_s("prefill", slot)))
            joins.append(self.prefill[-1].serving_from_s)
        for _ in range(self.targets["prefill"] - targets["prefill"]):
            starting = [w for w in self.prefill if w.serving_from_s > now_s]
            if starting:
                self.prefill.remove(starting[-1])
            else:
                self._least_busy(self.serving(now_s), now_s).draining = True
        for slot in range(self.targets["decode"] + 1, targets["decode"] + 1):
            self.decode_from_s.append(now_s + lag_s("decode", slot))
        for _ in range(self.targets["decode"] - targets["decode"]):
            self.decode_from_s.pop()
        self.targets = dict(targets)
        return joins

    def num_workers(self, now_s: float) -> int:
        return (sum(1 for w in self.prefill if w.serving_from_s <= now_s)
                + sum(1 for t in self.decode_from_s if t <= now_s))


def replay(trace: TurnsTrace, sizing: Sizing, profile: Any, config: PlannerConfig, *, budget: int,
           lag_median_s: float = 3.0, lag_sigma: float = 0.45, seed: int = 0,
           bumps: Sequence[tuple[float, float]] = ()) -> WhatIf:
    """`trace` through one `PlannerCore` a model (`config`, sharing `budget` workers) against the fleet model
    of the module docstring; `seed` draws the start lags and the planners' phases; `bumps`: each model's
    busy span (`_multimodel_trace.bump_s`), outside which its starts count as a trickle's."""
    rng = random.Random(seed)
    shared = SharedBudget(budget)
    by_model: list[list[tuple[float, int, int]]] = [[] for _ in range(trace.num_models)]
    for request, m in zip(trace.requests, trace.model_indexes, strict=True):
        by_model[m].append((request.timestamp_s, request.input_length, request.output_length))
    models = []
    for m in range(trace.num_models):
        shared.record(str(m), config.min_workers["prefill"] + config.min_workers["decode"], squeezed=False)
        core = PlannerCore(config, ("prefill", "decode"), profile, budget=shared, member=str(m))
        models.append(_Model(core, by_model[m], profile.prefill_tokens_per_s))
    events: list[tuple[float, int, int, int]] = []  # (time, kind: 0 decide, 1 arrive, 2 join, model, index)
    for m, model in enumerate(models):
        for index, (t_s, _, _) in enumerate(model.requests):
            events.append((t_s, 1, m, index))
        phase_s = rng.random() * config.interval_s
        events.extend((phase_s + k * config.interval_s, 0, m, 0)
                      for k in range(math.ceil((trace.duration_s - phase_s) / config.interval_s)))
    heapq.heapify(events)
    worker_s, last_s, cuts, starts, trickle_starts = 0.0, 0.0, 0, 0, 0

    def lag_s(m: int, now_s: float, pool: str, slot: int) -> float:
        return start_lag_s(seed, m, pool, slot, now_s, median_s=lag_median_s, sigma=lag_sigma)
    while events:
        now_s, kind, m, index = heapq.heappop(events)
        worker_s += sum(model.num_workers(now_s) for model in models) * (now_s - last_s)
        last_s = now_s
        model = models[m]
        model.advance(now_s)
        if kind == 1:
            model.arrive(now_s, index)
        elif kind == 2:
            model.join(now_s)
        else:
            decision = model.core.decide(model.observe(now_s))
            cuts += sum(reason == "budget" for reason in decision.reasons.values())
            started = sum(max(0, n - model.targets[pool]) for pool, n in decision.targets.items())
            starts += started
            if m < len(bumps) and not bumps[m][0] <= now_s <= bumps[m][1]:
                trickle_starts += started
            for join_s in model.scale(now_s, decision.targets, functools.partial(lag_s, m, now_s)):
                heapq.heappush(events, (join_s, 2, m, 0))
    tail_s = max(0.0, trace.duration_s - last_s)
    worker_s += sum(model.num_workers(trace.duration_s) for model in models) * tail_s
    for model in models:
        model.advance(math.inf)
    missed = tuple(sorted((m, model.requests[i][0]) for m, model in enumerate(models)
                          for i, ttft_s in enumerate(model.ttft_s) if ttft_s is None or ttft_s > MISS_TTFT_S))
    static_s = sizing.static_workers * trace.duration_s
    return WhatIf(len(missed), worker_s, worker_s / static_s, cuts, missed, starts, trickle_starts)


def main() -> None:
    from benchmarks._multimodel_planner import FULL_TURNS
    from benchmarks._multimodel_trace import bump_s, generate, models_busy_at_once, size_fleets
    from benchmarks.planner import PROFILE, SIZING
    from dynserve.planner import profile as profiles

    plan, capacity = FULL_TURNS, profiles.shipped(PROFILE)
    trace = generate(plan.shape, 0)
    bumps = [bump_s(plan.shape, m) for m in range(plan.shape.num_models)]
    for prefill_floor in sorted({1, plan.prefill_floor}):
        floors = {"prefill": prefill_floor, "decode": 1}
        sizing = size_fleets(capacity, trace, plan.sizing_window_s, ttft_target_s=SIZING.ttft_ms / 1000,
                             itl_target_s=SIZING.itl_ms / 1000, floors=floors,
                             busy_at_once=models_busy_at_once(plan.shape, plan.down_delay_s))
        for spare, changes in {"none": {"rise_spare_workers": 0}, "the default": {}}.items():
            config = planner_config(sizing, ttft_target_s=plan.planner_ttft_ms / 1000,
                                    itl_target_s=SIZING.itl_ms / 1000, interval_s=plan.interval_s,
                                    read_window_s=plan.window_s, down_delay_s=plan.down_delay_s, floors=floors,
                                    **changes)
            runs = [replay(trace, sizing, capacity, config, budget=sizing.budget, lag_median_s=lag_s, seed=seed,
                           bumps=bumps)
                    for lag_s in (3.0, 4.0)
                    for seed in range(1, 11)]
            clean = sum(r.num_missed == 0 for r in runs)
            print(f"prefill floor {prefill_floor}, budget {sizing.budget}, rise spare {spare}: "
                  f"{sum(r.num_missed for r in runs)} missed in {len(runs)} replays, {clean} without a miss, "
                  f"worker-s ratio {sum(r.ratio for r in runs) / len(runs):.3f}, "
                  f"{sum(r.num_budget_cuts for r in runs)} budget cuts, "
                  f"{sum(r.num_starts for r in runs) / len(runs):.1f} worker starts a replay "
                  f"({sum(r.num_trickle_starts for r in runs) / len(runs):.1f} outside the bumps)", flush=True)


if __name__ == "__main__":
    main()
