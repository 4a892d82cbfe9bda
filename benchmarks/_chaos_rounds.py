"""The chaos benchmark's rounds: one fault under a steady load, and its summary.

`run_round` runs the load (`_chaos_load.SteadyLoad`) for the plan's before-window, injects the fault,
watches the fleet until it is back at full capacity (`_chaos_fleet.watch_recovery`), lets the load run a
little longer, stops it, and summarizes what the client saw against the two windows: requests that ran
entirely before the fault, and those the fault touched or that started before recovery. `guarded` turns a
drill that broke (a process not found, a gateway that did not start) into a summary that misses its target,
so the other drills still run.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import _chaos_fleet as fleet
from benchmarks._chaos_load import Outcome, SteadyLoad, ttft_p99_s
from benchmarks._common import log

__all__ = ["Bench", "Plan", "guarded", "run_round", "summarize", "warm_up"]


@dataclass(frozen=True)
class Plan:
    """A run's sizes: the load (mockers', then the real model's) and each round's windows, in seconds."""

    concurrency: int
    prompt_tokens: int  # more than disagg_local_prefill_tokens (512): prefilled on a prefill worker
    max_tokens: int
    warm_up_s: float
    before_s: float
    min_during_s: float
    after_s: float
    recovery_timeout_s: float
    redis_down_s: float
    transfer_faults: tuple[str, ...]
    real_concurrency: int
    real_before_s: float  # a real request takes seconds: the before-window must hold several whole ones
    real_prompt_tokens: int
    real_max_tokens: int
    real_recovery_timeout_s: float


@dataclass
class Bench:
    """What every round needs: the plan, the workload's words, the log directory, and the run's timeline."""

    plan: Plan
    model: str
    word_ids: list[int]
    log_dir: Path
    seed: int
    outcomes: list[Outcome]
    faults: list[dict[str, Any]]

    def load(self, label: str, port: int, *, real: bool = False, max_retries: int = 0) -> SteadyLoad:
        plan = self.plan
        self.seed += 1
        if real:
            return SteadyLoad(label, port, self.model, self.word_ids, concurrency=plan.real_concurrency,
                              prompt_tokens=plan.real_prompt_tokens, max_tokens=plan.real_max_tokens,
                              seed=self.seed, max_retries=max_retries)
        return SteadyLoad(label, port, self.model, self.word_ids, concurrency=plan.concurrency,
                          prompt_tokens=plan.prompt_tokens, max_tokens=plan.max_tokens, seed=self.seed,
                          max_retries=max_retries)


def run_round(bench: Bench, name: str, port: int, inject: Callable[[], dict[str, Any]],
              ready: Callable[[], bool], *, real: bool = False, max_retries: int = 0,
              before: Callable[[], None] | None = None, fault_at_start: bool = False,
              restarts_gateway: bool = False) -> dict[str, Any]:
    """The load on `port`; `before_s` later `inject()`; `ready` sampled until the fleet has recovered; the
    round's summary. `before` runs during the last seconds before the fault (to seed a watcher);
    `fault_at_start`: the fault is on from the start (no before-window); `restarts_gateway`: the gateway's
    counters start again from 0 with the fault (they are reported as they are at the end)."""
    plan = bench.plan
    timeout_s = plan.real_recovery_timeout_s if real else plan.recovery_timeout_s
    before_s = plan.real_before_s if real else plan.before_s
    counts_before = {} if restarts_gateway else fleet.counters(port)
    log(f"{name}: load on port {port}")
    with bench.load(name, port, real=real, max_retries=max_retries) as load:
        load_start_s = time.monotonic()
        if not fault_at_start:
            _sleep_then(before_s, before)
        fault_s = time.monotonic()
        details = inject()
        log(f"{name}: fault injected {details}")
        lowest_up: list[int] = []

        def watched() -> bool:  # and the fewest workers the gateway had up at any sample
            with contextlib.suppress(OSError, RuntimeError, ValueError):
                lowest_up.append(fleet.worker_up(port))
            return ready()

        recovery = fleet.watch_recovery(fault_s, watched, hold_s=1.0, min_s=plan.min_during_s,
                                        timeout_s=timeout_s)
        log(f"{name}: recovery_s {recovery.recovery_s}")
        time.sleep(plan.after_s)
    counts_after = fleet.counters(port)
    summary = summarize(name, load.outcomes, fault_s, load_start_s, recovery, before_s,
                        plan.min_during_s)
    summary.update(details=details, counters=_delta(counts_before, counts_after),
                   min_workers_up=min(lowest_up, default=None))
    bench.outcomes.extend(load.outcomes)
    bench.faults.append({"name": name, "at_s": fault_s, "recovery_s": recovery.recovery_s})
    log(f"{name}: {summary['num_requests']} requests, {summary['failed_requests']} failed, TTFT p99 "
        f"{summary['ttft_p99_s']}, counters {summary['counters']}")
    return summary


def _sleep_then(seconds: float, before: Callable[[], None] | None) -> None:
    """Sleep `seconds`; with `before`, call it every 0.2 s over the last 2 of them."""
    if before is None:
        time.sleep(seconds)
        return
    end_s = time.monotonic() + seconds
    time.sleep(max(0.0, seconds - 2.0))
    while time.monotonic() < end_s:
        before()
        time.sleep(fleet.SAMPLE_INTERVAL_S)


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def summarize(name: str, outcomes: list[Outcome], fault_s: float, load_start_s: float, recovery: Any,
              before_s: float, min_during_s: float) -> dict[str, Any]:
    """Failures, TTFT p99 and completed requests per second before the fault and from it until recovery (at
    least `min_during_s`)."""
    ends = [t for t, _ok in recovery.samples]
    during_s = max(recovery.recovery_s if recovery.recovery_s is not None else (ends[-1] if ends else 0.0),
                   min_during_s)
    before_from_s = max(load_start_s + 1.0, fault_s - before_s)  # not the first second: cold connections
    during_to_s = fault_s + during_s
    # TTFT: before, the requests that ran entirely before the fault; during, those it touched or that started
    # before recovery. Rates: the requests completed in each window.
    before = [o for o in outcomes if before_from_s <= o.start_s and o.end_s < fault_s]
    during = [o for o in outcomes if o.end_s >= fault_s and o.start_s < during_to_s]
    failed = [o for o in outcomes if not o.ok]

    def in_flight(o: Outcome) -> bool:
        return o.start_s < fault_s <= o.end_s

    return {
        "fault": name, "num_requests": len(outcomes), "failed_requests": len(failed),
        "failed_in_flight_at_fault": sum(1 for o in failed if in_flight(o)),
        "num_in_flight_at_fault": sum(1 for o in outcomes if in_flight(o)),
        "failures": [{"start_vs_fault_s": round(o.start_s - fault_s, 2), "in_flight_at_fault": in_flight(o),
                      "tokens": o.num_tokens, "error": o.error} for o in failed[:10]],
        "ttft_p99_s": {"before": _round(ttft_p99_s(before)), "during": _round(ttft_p99_s(during))},
        "req_per_s": {"before": _rate([o for o in before if o.ok], fault_s - before_from_s),
                      "during": _rate([o for o in outcomes if o.ok and fault_s <= o.end_s < during_to_s],
                                      during_s)},
        "num_retried_by_client": sum(1 for o in outcomes if o.num_attempts > 1),
        "statuses_not_200": dict(Counter(str(status) for o in outcomes for status in o.statuses)),
        "during_window_s": round(during_s, 2), "recovery_s": recovery.recovery_s,
        "not_ready_samples": sum(1 for _t, ok in recovery.samples if not ok),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _rate(outcomes: list[Outcome], seconds: float) -> float | None:
    return round(len(outcomes) / seconds, 2) if seconds > 0 else None


def warm_up(bench: Bench, port: int, *, real: bool = False) -> None:
    with bench.load("warm-up", port, real=real) as load:
        time.sleep(bench.plan.warm_up_s)
    failed = [o.error for o in load.outcomes if not o.ok]
    if failed:
        log(f"warm-up: {len(failed)} of {len(load.outcomes)} requests failed: {failed[:3]}")


def guarded(name: str, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`run()`, or, when the drill itself broke (a process not found, a gateway that did not start), a
    summary saying so: the other drills still run, and this one misses its target."""
    try:
        return run()
    except (RuntimeError, OSError, ValueError, KeyError) as exc:
        log(f"{name}: the drill failed: {type(exc).__name__}: {exc}")
        return {"fault": name, "drill_error": f"{type(exc).__name__}: {exc}"[:2000], "failed_requests": None,
                "failed_in_flight_at_fault": None, "recovery_s": None,
                "ttft_p99_s": {"before": None, "during": None}, "req_per_s": {"before": None, "during": None},
                "counters": {}}
