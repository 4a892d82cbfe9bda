"""The planner benchmark's traces: a day of load, generated from a seed, and Mooncake's JSONL trace format.

**Format.** One JSON object a line, one line a request, in arrival order: `timestamp` (ms from the start of
the trace), `input_length` and `output_length` (tokens). Other keys (Mooncake's `hash_ids`, the prefix
blocks a request shares with others) are read and ignored; `write_mooncake` writes the three.

**The generated day** (`DayShape`, `generate`): a non-homogeneous Poisson process whose rate follows a
smooth diurnal curve, the day compressed into `duration_s` seconds (the replay's own clock: a day of 24 h
played in 120 s makes a second of the trace 12 minutes of the day). The curve starts and ends at its
trough, `trough_fraction` of the base peak, and rises to the base peak at midday:

    rate(t) = peak * (trough + (1 - trough) * ((1 - cos(2 pi t / duration)) / 2) ** sharpness) + bursts(t)

`sharpness` narrows the busy hours (3 gives peak / mean about 2.6 with a trough at 10%). A few bursts,
placed and sized from the seed, add Gaussian bumps (a height as a fraction of the base peak, a width as a
fraction of the day) wherever they land, the trough included: load no curve of the day predicts. Input and
output lengths are lognormal (a median and a sigma), rounded and clipped to a range, drawn independently
of each other and of the time of day.

**Rates of a trace** (`windowed_rates_per_s`, `peak_rate_per_s`, `mean_rate_per_s`): the rate in
consecutive windows of the trace; its peak is the busiest window, so it depends on the window (a shorter
one sees more Poisson noise). `compress` rescales a trace's timestamps to a new span, keeping every request
(rates scale by the same factor).

**The benchmark's days** (`Plan`, `FULL_PLAN`, `QUICK_PLAN`, `trace_shape`): the length and peak of the day
`benchmarks/planner.py` replays, and the planner's read window its peak is measured on.

    PYTHONPATH=$PWD python -m benchmarks.planner_trace --seed 0 --output day.jsonl

writes the trace the full benchmark generates (`--quick` the quick one's) and prints its summary.

Invariants: a trace's timestamps are non-decreasing and >= 0, its lengths >= 1; the same shape and seed
always give the same trace.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

__all__ = ["FULL_PLAN", "QUICK_PLAN", "DayShape", "LengthDistribution", "Plan", "TraceRequest", "compress",
           "day_rate_per_s", "generate", "mean_rate_per_s", "peak_rate_per_s", "read_mooncake", "summarize",
           "trace_shape", "windowed_rates_per_s", "write_mooncake"]


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: float  # from the start of the trace
    input_length: int
    output_length: int

    @property
    def timestamp_s(self) -> float:
        return self.timestamp_ms / 1000.0


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    """Lognormal token counts: `median` and `sigma` (of the log), rounded, clipped to
    [min_tokens, max_tokens]."""

    median: float
    sigma: float
    min_tokens: int
    max_tokens: int

    def draw(self, rng: random.Random) -> int:
        value = round(rng.lognormvariate(math.log(self.median), self.sigma))
        return min(self.max_tokens, max(self.min_tokens, value))


@dataclass(frozen=True, slots=True)
class Burst:
    center_s: float
    width_s: float  # the Gaussian's standard deviation
    rate_per_s: float  # its height


@dataclass(frozen=True, slots=True)
class DayShape:
    """A day of load played in `duration_s` (see the module docstring)."""

    duration_s: float
    peak_rate_per_s: float  # the curve's peak, bursts not included
    trough_fraction: float = 0.1
    sharpness: float = 3.0
    num_bursts: int = 3
    burst_height_range: tuple[float, float] = (0.2, 0.35)  # fractions of the peak
    burst_width_fraction: float = 0.025  # of the day
    isl: LengthDistribution = LengthDistribution(median=1800, sigma=0.5, min_tokens=256, max_tokens=6144)
    osl: LengthDistribution = LengthDistribution(median=150, sigma=0.4, min_tokens=32, max_tokens=512)

    def __post_init__(self) -> None:
        if not (self.duration_s > 0 and self.peak_rate_per_s > 0):
            raise ValueError("duration_s and peak_rate_per_s must be positive")
        if not 0 <= self.trough_fraction <= 1 or self.sharpness <= 0:
            raise ValueError("trough_fraction must be in [0, 1] and sharpness positive")


def _bursts(shape: DayShape, rng: random.Random) -> list[Burst]:
    """Where the bursts land: anywhere between 10% and 90% of the day, heights from the range."""
    low, high = shape.burst_height_range
    return [Burst(center_s=rng.uniform(0.1, 0.9) * shape.duration_s,
                  width_s=shape.burst_width_fraction * shape.duration_s,
                  rate_per_s=rng.uniform(low, high) * shape.peak_rate_per_s)
            for _ in range(shape.num_bursts)]


def day_rate_per_s(shape: DayShape, t_s: float, bursts: Sequence[Burst] = ()) -> float:
    """The generating rate at `t_s` (see the module docstring's formula)."""
    phase = (1.0 - math.cos(2.0 * math.pi * t_s / shape.duration_s)) / 2.0
    trough = shape.trough_fraction
    rate = shape.peak_rate_per_s * (trough + (1 - trough) * phase**shape.sharpness)
    for burst in bursts:
        rate += burst.rate_per_s * math.exp(-0.5 * ((t_s - burst.center_s) / burst.width_s) ** 2)
    return rate


def generate(shape: DayShape, seed: int) -> list[TraceRequest]:
    """The day's requests: arrivals by thinning (Lewis and Shedler) a Poisson process at the largest rate,
    then each request's lengths, all from one generator seeded with `seed`."""
    rng = random.Random(seed)
    bursts = _bursts(shape, rng)
    bound = shape.peak_rate_per_s + sum(b.rate_per_s for b in bursts)
    requests, t_s = [], 0.0
    while True:
        t_s += rng.expovariate(bound)
        if t_s >= shape.duration_s:
            return requests
        if rng.random() * bound <= day_rate_per_s(shape, t_s, bursts):
            requests.append(TraceRequest(round(t_s * 1000.0), shape.isl.draw(rng), shape.osl.draw(rng)))


# ---- the benchmark's days ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """A run of the planner benchmark (`benchmarks/planner.py`): the day it replays, the planner's clock."""

    duration_s: float  # the replayed day, in modelled seconds
    peak_rate_per_s: float  # the day's curve at its peak, bursts left out (modelled requests/s)
    interval_s: float  # the planner's decision interval (modelled seconds)
    window_s: float  # the planner's read window (modelled); the trace's peak is its busiest such window
    num_attainment_windows: int = 24  # attainment over time: one window per hour of the day


FULL_PLAN = Plan(duration_s=360.0, peak_rate_per_s=20.0, interval_s=2.0, window_s=4.0)
QUICK_PLAN = Plan(duration_s=120.0, peak_rate_per_s=20.0, interval_s=2.0, window_s=4.0)


def trace_shape(*, quick: bool) -> DayShape:
    """The day the planner benchmark generates (`--quick`: the quick run's, shorter)."""
    plan = QUICK_PLAN if quick else FULL_PLAN
    return DayShape(duration_s=plan.duration_s, peak_rate_per_s=plan.peak_rate_per_s)


# ---- Mooncake's format -------------------------------------------------------------------------------------


def write_mooncake(requests: Iterable[TraceRequest], path: Path) -> None:
    with open(path, "w") as out:
        out.writelines(json.dumps({"timestamp": round(r.timestamp_ms), "input_length": r.input_length,
                                   "output_length": r.output_length}) + "\n" for r in requests)


def read_mooncake(path: Path) -> list[TraceRequest]:
    """The requests of a Mooncake JSONL trace, in arrival order; ValueError names the first bad line."""
    requests = []
    with open(path) as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                request = TraceRequest(float(record["timestamp"]), int(record["input_length"]),
                                       int(record["output_length"]))
            except (ValueError, KeyError, TypeError) as exc:
                message = f"not a Mooncake request ({type(exc).__name__}: {exc})"
                raise ValueError(f"{path}:{number}: {message}") from None
            if request.timestamp_ms < 0 or request.input_length < 1 or request.output_length < 1:
                raise ValueError(f"{path}:{number}: timestamp must be >= 0 and lengths >= 1")
            requests.append(request)
    if not requests:
        raise ValueError(f"{path}: no requests")
    return sorted(requests, key=lambda r: r.timestamp_ms)  # stable: ties keep the file's order


def compress(requests: Sequence[TraceRequest], duration_s: float) -> list[TraceRequest]:
    """The trace played in `duration_s`: timestamps shifted to start at 0 and scaled so the span from the
    first request to the last becomes `duration_s` (a single request lands at 0)."""
    if duration_s <= 0:
        raise ValueError("duration_s must be positive")
    start_ms = min(r.timestamp_ms for r in requests)
    span_ms = max(r.timestamp_ms for r in requests) - start_ms
    factor = duration_s * 1000.0 / span_ms if span_ms > 0 else 0.0
    return [replace(r, timestamp_ms=(r.timestamp_ms - start_ms) * factor) for r in requests]


# ---- rates -------------------------------------------------------------------------------------------------


def windowed_rates_per_s(timestamps_s: Sequence[float], window_s: float, duration_s: float) -> list[float]:
    """Arrivals per second in consecutive windows of `window_s` from 0; the last window, when shorter, is
    divided by its own length. Arrivals at or past `duration_s` fall in the last window."""
    if window_s <= 0 or duration_s <= 0:
        raise ValueError("window_s and duration_s must be positive")
    num_windows = max(1, math.ceil(duration_s / window_s - 1e-9))
    counts = [0] * num_windows
    for t_s in timestamps_s:
        counts[min(num_windows - 1, max(0, int(t_s // window_s)))] += 1
    lengths_s = [min(window_s, duration_s - i * window_s) for i in range(num_windows)]
    return [count / length_s for count, length_s in zip(counts, lengths_s, strict=True)]


def peak_rate_per_s(requests: Sequence[TraceRequest], window_s: float, duration_s: float) -> float:
    """The busiest window's rate (only whole windows count, unless the trace is shorter than one)."""
    rates = windowed_rates_per_s([r.timestamp_s for r in requests], window_s, duration_s)
    whole = math.floor(duration_s / window_s + 1e-9)
    return max(rates[:whole] if whole else rates)


def mean_rate_per_s(requests: Sequence[TraceRequest], duration_s: float) -> float:
    return len(requests) / duration_s


def summarize(requests: Sequence[TraceRequest], duration_s: float, window_s: float) -> dict[str, Any]:
    """Counts, rates and mean lengths of a trace (token means are per request)."""
    peak, mean = peak_rate_per_s(requests, window_s, duration_s), mean_rate_per_s(requests, duration_s)
    isls = sorted(r.input_length for r in requests)
    osls = sorted(r.output_length for r in requests)
    return {"num_requests": len(requests), "duration_s": duration_s, "window_s": window_s,
            "peak_rate_per_s": peak, "mean_rate_per_s": mean, "peak_over_mean": peak / mean if mean else None,
            "mean_isl": sum(isls) / len(isls), "median_isl": isls[len(isls) // 2],
            "max_isl": isls[-1], "mean_osl": sum(osls) / len(osls), "median_osl": osls[len(osls) // 2],
            "max_osl": osls[-1]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.planner_trace",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="the quick benchmark's (shorter) day")
    parser.add_argument("--output", type=Path, required=True, help="the Mooncake JSONL file to write")
    args = parser.parse_args(argv)
    shape = trace_shape(quick=args.quick)
    requests = generate(shape, args.seed)
    write_mooncake(requests, args.output)
    window_s = (QUICK_PLAN if args.quick else FULL_PLAN).window_s
    print(json.dumps({"output": str(args.output), "seed": args.seed,
                      **summarize(requests, shape.duration_s, window_s)}))


if __name__ == "__main__":
    main()
