"""The multimodel benchmark's planner half, its pure part: a trace in which models take turns being busy, and
the fleets sized for it by the planner's own capacity math.

**The trace** (`TurnsShape`, `generate`): each of `num_models` models gets a Poisson stream of its own at

    rate_i(t) = trickle + peak * sin(pi * (t - i * phase) / (2 * phase)) ** 2   for t in [i * phase, (i + 2) * phase]
    rate_i(t) = trickle                                                            elsewhere

so model i rises from its trickle to its peak over `phase_s`, falls back over the next `phase_s`, and model
i + 1 rises while it falls. Two bumps half a period apart sum to `peak` (sin^2 + cos^2 = 1), so after the
first phase the busy load is constant: at any time one model carries most of it (two while they hand over)
and the others a trickle. The trace lasts `(num_models + 1) * phase_s`: model 0 rises alone in the first
phase, the last model falls alone in the last. Arrivals by thinning (as `planner_trace.generate`); prompt and
answer lengths lognormal (`planner_trace.LengthDistribution`), drawn independently of time and model.

**Sizing** (`size_fleets`): a model's load in each window of `window_s` (the benchmark's sizing window) is
its arrivals in it; `planner.fleet_for_rate` turns a rate into workers per pool at the sizing targets, at the
trace's mean ISL and OSL. The static fleet gives every model the workers its own busiest window needs (the
largest over the models: `dynctl serve` gives every model the same pools, and the models' shapes are the
same but for the Poisson draws); `oracle_workers` is, per window, what each model's window needs summed over
the models (a planner that knew the load and started workers in no time). The planner's shared budget is
what its own floors and down delay hold while models overlap: `busy_at_once` models with the static fleet's
pools and every other model at its floors (`floors`: one worker a pool unless given), plus `budget_margin`;
never less than the
oracle's busiest window plus the margin, never more than the static fleet. `models_busy_at_once`: a model
holds workers over its floor from its rise to a down delay after its fall, `2 * phase_s + down_delay_s`,
and a new model rises every `phase_s`, so that many phases' models hold workers at once (3 in the full
plan: the rising one, the one falling from its peak, and the one before it inside its down delay).

Invariants: timestamps are non-decreasing and within [0, duration_s); every model index is in
[0, num_models); the same shape and seed always give the same trace.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.planner import fleet_for_rate
from benchmarks.planner_trace import LengthDistribution, TraceRequest, windowed_rates_per_s

__all__ = ["Sizing", "TurnsShape", "TurnsTrace", "bump_s", "generate", "model_rate_per_s", "models_busy_at_once",
           "rates_by_model", "size_fleets", "total_by_time"]


@dataclass(frozen=True, slots=True)
class TurnsShape:
    """`num_models` models taking turns (see the module docstring); rates in requests/s of modelled time."""

    num_models: int
    phase_s: float  # a model's rise from its trickle to its peak, and its fall back
    peak_rate_per_s: float  # a model's busy part at its peak, the trickle not included
    trickle_rate_per_s: float
    isl: LengthDistribution = LengthDistribution(median=2800, sigma=0.3, min_tokens=1024, max_tokens=6144)
    osl: LengthDistribution = LengthDistribution(median=140, sigma=0.3, min_tokens=32, max_tokens=384)

    def __post_init__(self) -> None:
        if self.num_models < 1 or self.phase_s <= 0 or self.peak_rate_per_s <= 0 or self.trickle_rate_per_s < 0:
            raise ValueError("num_models >= 1, phase_s > 0, peak_rate_per_s > 0 and trickle_rate_per_s >= 0")

    @property
    def duration_s(self) -> float:
        return (self.num_models + 1) * self.phase_s


@dataclass(frozen=True, slots=True)
class TurnsTrace:
    """The requests in arrival order and, beside each, the index of its model."""

    requests: tuple[TraceRequest, ...]
    model_indexes: tuple[int, ...]
    duration_s: float
    num_models: int

    def of_model(self, model_index: int) -> list[TraceRequest]:
        return [r for r, m in zip(self.requests, self.model_indexes, strict=True) if m == model_index]


def model_rate_per_s(shape: TurnsShape, model_index: int, t_s: float) -> float:
    """Model `model_index`'s generating rate at `t_s` (the module docstring's formula)."""
    offset_s = t_s - model_index * shape.phase_s
    busy = 0.0
    if 0.0 <= offset_s <= 2 * shape.phase_s:
        busy = shape.peak_rate_per_s * math.sin(math.pi * offset_s / (2 * shape.phase_s)) ** 2
    return shape.trickle_rate_per_s + busy


def bump_s(shape: TurnsShape, model_index: int) -> tuple[float, float]:
    """When model `model_index` is over its trickle: its rise and its fall."""
    return model_index * shape.phase_s, (model_index + 2) * shape.phase_s


def generate(shape: TurnsShape, seed: int) -> TurnsTrace:
    """Each model's arrivals by thinning a Poisson process at its largest rate, merged in time order; then each
    request's lengths. One generator, seeded with `seed`, draws everything."""
    rng = random.Random(seed)
    bound = shape.peak_rate_per_s + shape.trickle_rate_per_s
    arrivals: list[tuple[float, int]] = []
    for model_index in range(shape.num_models):
        t_s = 0.0
        while True:
            t_s += rng.expovariate(bound)
            if t_s >= shape.duration_s:
                break
            if rng.random() * bound <= model_rate_per_s(shape, model_index, t_s):
                arrivals.append((t_s, model_index))
    arrivals.sort()
    requests = tuple(TraceRequest(t_s * 1000.0, shape.isl.draw(rng), shape.osl.draw(rng)) for t_s, _ in arrivals)
    return TurnsTrace(requests, tuple(m for _, m in arrivals), shape.duration_s, shape.num_models)


def models_busy_at_once(shape: TurnsShape, down_delay_s: float) -> int:
    """How many models hold workers over their floors at once (the module docstring): each does for its
    bump (`2 * phase_s`) and a down delay after it, and the next model's bump starts `phase_s` later."""
    return min(shape.num_models, math.ceil((2 * shape.phase_s + down_delay_s) / shape.phase_s - 1e-9))


def rates_by_model(trace: TurnsTrace, window_s: float) -> list[list[float]]:
    """Per model, its arrivals per second in consecutive windows of `window_s` (`windowed_rates_per_s`)."""
    return [windowed_rates_per_s([r.timestamp_s for r in trace.of_model(m)], window_s, trace.duration_s)
            for m in range(trace.num_models)]


@dataclass(frozen=True)
class Sizing:
    """The fleets for a trace (see the module docstring); workers per pool."""

    static_fleet: dict[str, int]  # every model's pools in the static fleet, and the planner's max per pool
    budget: int  # the planner's --planner-max-total-workers
    peak_rate_by_model: list[float]  # each model's busiest window, requests/s
    oracle_workers: list[int]  # per window: the workers all models' loads need, summed
    mean_isl: float
    mean_osl: float

    @property
    def static_workers(self) -> int:
        """The static fleet's workers, all models together."""
        return len(self.peak_rate_by_model) * sum(self.static_fleet.values())

    def as_dict(self) -> dict[str, Any]:
        return {"static_fleet": dict(self.static_fleet), "static_workers": self.static_workers,
                "budget": self.budget, "peak_rate_by_model": [round(r, 2) for r in self.peak_rate_by_model],
                "oracle_workers": list(self.oracle_workers), "mean_isl": round(self.mean_isl, 1),
                "mean_osl": round(self.mean_osl, 1)}


def size_fleets(profile: Any, trace: TurnsTrace, window_s: float, *, ttft_target_s: float, itl_target_s: float,
                busy_at_once: int = 1, budget_margin: int = 2, floors: Mapping[str, int] | None = None) -> Sizing:
    """The static fleet, the planner's budget and the oracle's workers for `trace` (see the module
    docstring); `profile` is a `CapacityProfile` (of the mockers' speed); `busy_at_once`: the models that hold
    more than their floors at once (`models_busy_at_once`); `floors`: the planner's least workers a pool
    (default one a pool)."""
    mean_isl = sum(r.input_length for r in trace.requests) / len(trace.requests)
    mean_osl = sum(r.output_length for r in trace.requests) / len(trace.requests)

    def fleet(rate_per_s: float) -> dict[str, int]:
        return fleet_for_rate(profile, rate_per_s, mean_isl, mean_osl, ttft_target_s=ttft_target_s,
                              itl_target_s=itl_target_s)

    rates = rates_by_model(trace, window_s)
    # only whole windows count toward a peak (a last short window divides few arrivals by little time)
    num_whole = max(1, math.floor(trace.duration_s / window_s + 1e-9))
    peaks = [max(model_rates[:num_whole]) for model_rates in rates]
    by_model = [fleet(peak) for peak in peaks]
    static = {pool: max(f[pool] for f in by_model) for pool in by_model[0]}
    oracle = [sum(sum(fleet(model_rates[k]).values()) for model_rates in rates) for k in range(len(rates[0]))]
    busy = min(busy_at_once, trace.num_models)
    floor_workers = sum((floors or {}).get(pool, 1) for pool in static)
    overlap = busy * sum(static.values()) + (trace.num_models - busy) * floor_workers  # the others at their floors
    static_workers = trace.num_models * sum(static.values())
    budget = min(static_workers, max(overlap, max(oracle[:num_whole])) + budget_margin)
    return Sizing(static, budget, peaks, oracle, mean_isl, mean_osl)


def total_by_time(samples: Sequence[tuple[float, Mapping[str, Mapping[str, int]]]]) -> list[tuple[float, int]]:
    """(time, workers of all models and pools) from samples of (time, {model: {pool: workers}})."""
    return [(t_s, sum(sum(pools.values()) for pools in models.values())) for t_s, models in samples]
