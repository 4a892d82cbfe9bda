"""How many mocker workers one machine holds, and what each costs: start `--num-mockers` mocker actors on a
local Ray instance with `--num-cpus` CPUs, time their start, ask each one a question over its worker channel,
and measure each actor process's memory (RSS and USS, the memory that is its alone) and the machine's.

Baseline in the same run: the machine's used memory before Ray starts, and with Ray up but no mocker.
The last stdout line is the JSON result; a copy goes to `benchmarks/results/mocker_fleet-<timestamp>.json`.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.mocker_fleet --num-mockers 64

The measurements and their history: `docs/benchmarks.md` (mocker_fleet).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import psutil

from benchmarks._common import git_commit, log, start_local_ray, write_result
from dynserve.config import Settings
from dynserve.protocol import GenerateRequest, SamplingParams, WorkerInfo
from dynserve.workers.channel import WorkerConnection
from dynserve.workers.worker import launch_mocker


def _used_mib() -> float:
    memory = psutil.virtual_memory()
    return (memory.total - memory.available) / 2**20


def _actor_processes() -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if cmdline.startswith("ray::EngineWorker"):
            found.append(process)
    return found


async def _ask_each(infos: list[WorkerInfo]) -> list[int]:
    """One 4-token request per mocker over its channel; the number of tokens each answered."""
    async def ask(info: WorkerInfo) -> int:
        connection = WorkerConnection(info)
        await connection.connect()
        request = GenerateRequest(request_id=f"fleet-{info.worker_id}", token_ids=list(range(100, 164)),
                                  params=SamplingParams(max_tokens=4, temperature=0))
        num_tokens = 0
        async for delta in connection.generate(request):
            num_tokens = delta.num_output_tokens
        await connection.close()
        return num_tokens

    return await asyncio.gather(*(ask(info) for info in infos))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-mockers", type=int, default=64)
    parser.add_argument("--num-cpus", type=float, default=2)
    parser.add_argument("--profile", default="cpu")
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    used_before_mib = _used_mib()
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    start_local_ray(num_cpus=args.num_cpus, object_store_memory=80 * 2**20, include_dashboard=False,
                    log_to_driver=False, _temp_dir=temp_dir)
    time.sleep(2)
    used_ray_mib = _used_mib()
    start_s = time.monotonic()
    settings = Settings(mocker=args.profile, mocker_speedup=10, kv_blocks=1024)
    launched = [launch_mocker(settings, f"m{i}") for i in range(args.num_mockers)]
    infos: list[WorkerInfo] = []
    for i, (_, ref) in enumerate(launched):
        infos.append(ray.get(ref, timeout=600))
        if (i + 1) % 8 == 0:
            log(f"{i + 1} mockers up after {time.monotonic() - start_s:.0f} s")
    start_all_s = time.monotonic() - start_s
    answered = asyncio.run(_ask_each(infos))
    time.sleep(1)
    processes = _actor_processes()
    rss_mib = [p.memory_info().rss / 2**20 for p in processes]
    uss_mib = [p.memory_full_info().uss / 2**20 for p in processes]
    used_all_mib = _used_mib()
    result: dict[str, Any] = {
        "benchmark": "mocker_fleet", "commit": git_commit(), "num_mockers": args.num_mockers,
        "ray_num_cpus": args.num_cpus, "profile": args.profile, "start_all_s": round(start_all_s, 1),
        "num_answered": sum(1 for n in answered if n == 4), "num_actor_processes": len(processes),
        "rss_mib_median": round(statistics.median(rss_mib), 1),
        "uss_mib_median": round(statistics.median(uss_mib), 1),
        "machine_used_mib": {"before_ray": round(used_before_mib), "ray_idle": round(used_ray_mib),
                             "with_mockers": round(used_all_mib)},
        "machine_mib_per_mocker": round((used_all_mib - used_ray_mib) / args.num_mockers, 1),
        "machine_total_mib": round(psutil.virtual_memory().total / 2**20), "load_avg_1m": os.getloadavg()[0],
    }
    for handle, _ in launched:
        ray.kill(handle)
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)
    write_result("mocker_fleet", result)


if __name__ == "__main__":
    main()
