"""Goodput under latency targets, as pure functions of what the client measured.

A request meets the targets when it completed, its TTFT is within `Slo.ttft_ms` and its mean inter-token
latency within `Slo.itl_ms` (see `_streaming.py` for both). Times are measured on a clock `speedup` times
faster than the modelled one (mockers with a speedup) and scaled back before they are compared.

Goodput at an offered rate is the rate times the fraction of its requests that met both targets: requests
per second that met them. A mode's goodput is the best over the rates played; its `max_rate_at_goal` the
highest rate at which at least `ATTAINMENT_GOAL` of the requests met both (DistServe's goodput).

How a comparison comes out depends on the targets, above all the ITL one, so each rate also reports its
goodput at the same TTFT target and each ITL target of `ITL_SWEEP_MS` (`goodput_by_itl_ms`), and
`goodput_by_itl_target` puts the modes side by side over that sweep.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks._common import percentile
from benchmarks._streaming import StreamedCompletion

__all__ = ["ATTAINMENT_GOAL", "ITL_SWEEP_MS", "Slo", "goodput_by_itl_target", "summarize_mode", "summarize_rate"]

ATTAINMENT_GOAL = 0.9
ITL_SWEEP_MS = (20.0, 25.0, 30.0, 40.0, 50.0, 100.0)  # 50 down to 10 tokens/s per user


@dataclass(frozen=True)
class Slo:
    ttft_ms: float
    itl_ms: float  # the mean inter-token latency of a request

    def met_by(self, result: StreamedCompletion, speedup: float) -> tuple[bool, bool]:
        """(TTFT met, mean ITL met) by one request, its times scaled to the modelled clock."""
        ttft_s, mean_itl_s = result.ttft_s, result.mean_itl_s
        if result.error is not None or ttft_s is None or mean_itl_s is None:
            return False, False
        return ttft_s * speedup * 1e3 <= self.ttft_ms, mean_itl_s * speedup * 1e3 <= self.itl_ms


def summarize_rate(rate_per_s: float, results: Sequence[StreamedCompletion], slo: Slo,
                   speedup: float) -> dict[str, Any]:
    """Goodput and latency percentiles at one rate, in modelled ms (the client's send lag in real ms)."""
    met = [slo.met_by(r, speedup) for r in results]
    num_good = sum(ttft_ok and itl_ok for ttft_ok, itl_ok in met)
    completed = [r for r in results if r.error is None]
    scale_ms = speedup * 1e3
    ttfts = [r.ttft_s * scale_ms for r in completed if r.ttft_s is not None]
    mean_itls = [r.mean_itl_s * scale_ms for r in completed if r.mean_itl_s is not None]
    itls = [gap * scale_ms for r in completed for gap in r.itls_s()]
    lags = [(r.sent_s - r.scheduled_s) * 1e3 for r in results if r.sent_s is not None]
    attainment = num_good / len(results) if results else 0.0
    by_itl = {}
    for itl_ms in ITL_SWEEP_MS:
        swept = Slo(slo.ttft_ms, itl_ms)
        good = sum(all(swept.met_by(r, speedup)) for r in results)
        by_itl[f"{itl_ms:g}"] = rate_per_s * good / len(results) if results else 0.0
    return {
        "rate_per_s": rate_per_s, "num_requests": len(results), "num_completed": len(completed),
        "num_ttft_met": sum(ttft_ok for ttft_ok, _ in met), "num_itl_met": sum(itl_ok for _, itl_ok in met),
        "num_good": num_good, "attainment": attainment, "goodput_per_s": rate_per_s * attainment,
        "ttft_p50_ms": percentile(ttfts, 50), "ttft_p90_ms": percentile(ttfts, 90),
        "mean_itl_p50_ms": percentile(mean_itls, 50), "mean_itl_p90_ms": percentile(mean_itls, 90),
        "itl_p50_ms": percentile(itls, 50), "itl_p90_ms": percentile(itls, 90),
        "itl_p99_ms": percentile(itls, 99),
        "send_lag_p99_real_ms": percentile(lags, 99),
        "errors": sorted({r.error for r in results if r.error is not None})[:5],
        "goodput_by_itl_ms": by_itl,
    }


def summarize_mode(rates: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A mode's goodput over its rates (each a `summarize_rate`). `past_knee`: the highest rate played fell
    short of the attainment goal; when it did not, the mode's goodput is only a lower bound."""
    best = max(rates, key=lambda r: r["goodput_per_s"])
    at_goal = [r["rate_per_s"] for r in rates if r["attainment"] >= ATTAINMENT_GOAL]
    highest = max(rates, key=lambda r: r["rate_per_s"])
    return {"goodput_per_s": best["goodput_per_s"], "goodput_at_rate_per_s": best["rate_per_s"],
            "max_rate_at_goal_per_s": max(at_goal, default=None),
            "past_knee": highest["attainment"] < ATTAINMENT_GOAL}


def goodput_by_itl_target(modes: dict[str, Sequence[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """For each ITL target of the sweep: each mode's goodput (best over its rates, each a `summarize_rate`)
    and, with modes `disagg` and `agg`, their ratio."""
    table: dict[str, dict[str, float]] = {}
    for itl_ms in ITL_SWEEP_MS:
        key = f"{itl_ms:g}"
        row = {mode: max((r["goodput_by_itl_ms"][key] for r in rates), default=0.0) for mode, rates in modes.items()}
        if "disagg" in row and "agg" in row and row["agg"] > 0:
            row["ratio"] = row["disagg"] / row["agg"]
        table[key] = row
    return table
