"""What the workers' own metrics cost the serving path: `benchmarks.frontend` with worker metrics off (the
baseline) and on (recorded every step, served on each worker's port and scraped every 50 ms), run back to
back, alternating (off, on, on, off, ...), `--runs` times each (3 by default), each run a fresh process and
a fresh Ray.

Reported: each run's c32 req/s and total CPU ms per request, the medians of each side, and
`req_per_s_ratio` (median on / median off; the target is >= 0.95). Alternating spreads this VM's phases of
speed (docs/benchmarks.md) over both sides alike; judge by the medians, never by one pair.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.metrics_cost [--quick] [--runs N]

`--quick` runs the frontend benchmark's `--quick` (about a minute a run). The last stdout line is the JSON
result; a copy goes to `benchmarks/results/`; the history is in `docs/benchmarks.md`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks._common import git_commit, log, machine_info, write_result

_ROOT = Path(__file__).resolve().parent.parent


def _frontend(worker_metrics: str, quick: bool, seed: int) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.frontend", "--worker-metrics", worker_metrics, "--seed", str(seed)]
    if quick:
        command.append("--quick")
    done = subprocess.run(command, cwd=_ROOT, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"benchmarks.frontend --worker-metrics {worker_metrics} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.metrics_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the frontend benchmark's --quick runs")
    parser.add_argument("--runs", type=int, default=3, help="runs of each side [default: 3]")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for index in range(args.runs):
        for side in (("off", "on") if index % 2 == 0 else ("on", "off")):  # ABBA: a drift hits both sides
            result = _frontend(side, args.quick, seed=index)
            if side == "on" and result["worker_scrapes_c32"] < 4:  # a run too short to hold the scrapes
                raise RuntimeError(f"only {result['worker_scrapes_c32']} scrapes landed during c32")
            runs[side].append({"req_per_s_c32": round(result["req_per_s_c32"], 1),
                               "cpu_ms_per_request_total": result["cpu_ms_per_request_c32"]["total"],
                               "p50_ms_c32": round(result["p50_ms_c32"], 2),
                               "worker_scrapes": result["worker_scrapes_c32"]})
            log(f"run {index + 1}/{args.runs}, worker metrics {side}: {runs[side][-1]}")
    median = {side: {key: statistics.median(r[key] for r in rs) for key in ("req_per_s_c32", "cpu_ms_per_request_total")}
              for side, rs in runs.items()}
    ratio = median["on"]["req_per_s_c32"] / median["off"]["req_per_s_c32"]
    log(f"median req/s: on {median['on']['req_per_s_c32']:.1f}, off {median['off']['req_per_s_c32']:.1f}, "
        f"ratio {ratio:.3f}")
    result = {"benchmark": "metrics_cost", "quick": args.quick, "runs_per_side": args.runs, "commit": git_commit(),
              "machine": machine_info(), "runs": runs, "median": median, "req_per_s_ratio": round(ratio, 3),
              "cpu_ms_per_request_ratio": round(median["on"]["cpu_ms_per_request_total"]
                                                / median["off"]["cpu_ms_per_request_total"], 3)}
    write_result("metrics_cost", result, args.output)
    return result


if __name__ == "__main__":
    main()
