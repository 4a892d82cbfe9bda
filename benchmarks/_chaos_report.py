"""The chaos benchmark's verdicts and picture: which targets each fault met, the headline JSON fields, and a
timeline of the whole run (requests completed and failed per second, each request's TTFT, faults marked
with their recovery shaded).

Targets (issue 21): no failed request for a worker, transfer, Redis or event-plane fault; for the gateway
kill, failures only among the requests in flight at that gateway when it died; no KV block held by a
request once the load has stopped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks._chaos_load import Outcome

__all__ = ["headline", "plot", "targets_met"]


def targets_met(faults: Mapping[str, dict[str, Any]], leaked_blocks: int) -> dict[str, bool]:
    """Per fault, and for the leaked blocks: whether the target held."""
    met = {}
    for name, summary in faults.items():
        if summary["failed_requests"] is None:  # the drill itself broke
            met[name] = False
        elif name == "gateway_kill":
            met[name] = summary["failed_requests"] == summary["failed_in_flight_at_fault"]
        else:
            met[name] = summary["failed_requests"] == 0
    met["leaked_blocks"] = leaked_blocks == 0
    return met


def headline(faults: Mapping[str, dict[str, Any]], leaks: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """The fields the issue's acceptance reads, first in the JSON: per fault its failed requests, recovery
    and TTFT p99 before and during; the leaked blocks over every fleet."""
    leaked = sum(leak["leaked_blocks"] for leak in leaks.values())
    met = targets_met(faults, leaked)
    return {
        "failed_requests": {name: s["failed_requests"] for name, s in faults.items()},
        "recovery_s": {name: s["recovery_s"] for name, s in faults.items()},
        "ttft_p99_s": {name: s["ttft_p99_s"] for name, s in faults.items()},
        "leaked_blocks": leaked,
        "leaked_blocks_by_fleet": {name: leak["leaked_blocks"] for name, leak in leaks.items()},
        "migrations": {name: sum(v for k, v in s["counters"].items() if k.startswith("migrations:"))
                       for name, s in faults.items()},
        "retries": {name: s["counters"].get("retries", 0.0) for name, s in faults.items()},
        "fallbacks": {name: sum(v for k, v in s["counters"].items() if k.startswith("fallbacks:"))
                      for name, s in faults.items()},
        "targets_met": met,
        "all_targets_met": all(met.values()),
    }


def plot(path: Path, outcomes: Sequence[Outcome], faults: Sequence[dict[str, Any]], start_s: float) -> None:
    """Completed and failed requests per second and each request's TTFT against the run's clock."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not outcomes:
        return
    end_s = max(o.end_s for o in outcomes) - start_s
    num_bins = math.ceil(end_s) + 1
    ok, failed = [0] * num_bins, [0] * num_bins
    for o in outcomes:
        (ok if o.ok else failed)[int(o.end_s - start_s)] += 1
    figure, (rate_ax, ttft_ax) = plt.subplots(2, 1, figsize=(14, 7), sharex=True)
    seconds = list(range(num_bins))
    rate_ax.step(seconds, ok, where="post", color="tab:blue", linewidth=0.8, label="completed / s")
    rate_ax.bar(seconds, failed, width=1.0, align="edge", color="tab:red", label="failed / s")
    rate_ax.set_ylabel("requests per second")
    ttft_ax.scatter([o.start_s - start_s for o in outcomes if o.ttft_s is not None],
                    [o.ttft_s for o in outcomes if o.ttft_s is not None], s=3, color="tab:green")
    ttft_ax.set_yscale("log")
    ttft_ax.set_ylabel("TTFT (s), by request start")
    ttft_ax.set_xlabel("seconds since the run started (gaps: fleets starting and stopping)")
    for fault in faults:
        at_s = fault["at_s"] - start_s
        for ax in (rate_ax, ttft_ax):
            ax.axvline(at_s, color="black", linewidth=0.8, linestyle="--")
            if fault["recovery_s"]:
                ax.axvspan(at_s, at_s + fault["recovery_s"], color="orange", alpha=0.25)
        rate_ax.annotate(fault["name"], (at_s, 1.0), xycoords=("data", "axes fraction"), rotation=90,
                         fontsize=7, va="top", ha="right")
    rate_ax.legend(fontsize="small", loc="upper left")
    figure.suptitle("dynserve fault drills under load (dashed: fault; shaded: until full capacity)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
