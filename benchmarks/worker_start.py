"""What a worker's start costs Ray's side: mocker workers launched one at a time (`launch_mocker`, as a pool
scaling up does), on a local Ray as dynserve starts one (`config.ray_system_config`: workers at niceness 0
by its config, so the actors carry no runtime env) and, as the baseline in the same run, on a local Ray as a
user might start one (no system config: each actor then carries its niceness in a runtime env, and Ray
starts it through its setup_worker). Each launch is timed from the call to its `WorkerInfo`, and the actor
process's CPU time and niceness are read once it is ready. Rounds alternate the two kinds of Ray.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.worker_start [--workers 8] [--rounds 2]

The last stdout line is the JSON result (`ready_s_ratio_config_over_env`, `cpu_s_ratio_config_over_env`,
medians over every worker of every round); a copy goes to `benchmarks/results/worker_start-<timestamp>.json`.
The measurements and their history: `docs/benchmarks.md` (worker_start).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import psutil

from benchmarks._common import git_commit, log, machine_info, start_local_ray, write_result
from dynserve.config import Settings
from dynserve.workers.worker import launch_mocker

KINDS = ("config", "env")  # dynserve's Ray; a Ray without its system config


def one_round(kind: str, num_workers: int) -> list[dict[str, float]]:
    """Start a local Ray of `kind`, launch `num_workers` mockers one after another, measure each."""
    import ray

    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    start_local_ray(with_system_config=kind == "config", num_cpus=8, object_store_memory=80 * 2**20,
                    include_dashboard=False, log_to_driver=False, _temp_dir=temp_dir)
    try:
        time.sleep(3)  # Ray's own processes finish starting before the first launch
        settings = Settings(mocker="cpu", port=0)
        out = []
        for i in range(num_workers):
            start_s = time.perf_counter()
            handle, info_ref = launch_mocker(settings, f"{kind}-{i}")
            ray.get(info_ref, timeout=120)
            ready_s = time.perf_counter() - start_s
            pid, nice = ray.get(handle.__ray_call__.remote(lambda _w: (os.getpid(), os.nice(0))), timeout=30)
            times = psutil.Process(pid).cpu_times()
            out.append({"ready_s": ready_s, "cpu_s": times.user + times.system, "nice": nice})
        return out
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=8, help="workers launched one at a time, each round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each kind, alternating")
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    workers: dict[str, list[dict[str, float]]] = {kind: [] for kind in KINDS}
    for round_index in range(args.rounds):
        for kind in KINDS if round_index % 2 == 0 else KINDS[::-1]:
            measured = one_round(kind, args.workers)
            workers[kind] += measured
            log(f"round {round_index} {kind}: ready s " + ", ".join(f"{w['ready_s']:.2f}" for w in measured)
                + "; CPU s " + ", ".join(f"{w['cpu_s']:.2f}" for w in measured)
                + f"; niceness {sorted({w['nice'] for w in measured})}")
    medians = {kind: {key: statistics.median(w[key] for w in workers[kind]) for key in ("ready_s", "cpu_s")}
               for kind in KINDS}
    result = {
        "benchmark": "worker_start", "commit": git_commit(), "machine": machine_info(),
        "workers_per_round": args.workers, "rounds": args.rounds, "medians": medians,
        "niceness": {kind: sorted({w["nice"] for w in workers[kind]}) for kind in KINDS},
        "workers": workers,
        "ready_s_ratio_config_over_env": medians["config"]["ready_s"] / medians["env"]["ready_s"],
        "cpu_s_ratio_config_over_env": medians["config"]["cpu_s"] / medians["env"]["cpu_s"],
    }
    config, env = medians["config"], medians["env"]
    log(f"median ready {config['ready_s']:.2f} s against {env['ready_s']:.2f} s "
        f"({result['ready_s_ratio_config_over_env']:.2f}); worker CPU {config['cpu_s']:.2f} s against "
        f"{env['cpu_s']:.2f} s ({result['cpu_s_ratio_config_over_env']:.2f})")
    write_result("worker_start", result)
    return result


if __name__ == "__main__":
    main()
