"""Overload: open-loop arrivals at twice a fleet's capacity, with and without TTFT-keeping admission.

    python -m benchmarks.overload [--quick] [--ttft-ms 500] [--seconds 60]

A fleet of mocker workers (`dynctl serve --mocker cpu`) is measured first: its capacity is the completion
rate of a closed loop that keeps it saturated. Then two fleets, one after the other, each take Poisson
arrivals at `--load` (2) times that rate for `--seconds`, then half the capacity for a quarter of that
("after": does it serve normally right away?):
- `baseline`: no admission control but the gateway's `--max-queue` (what a fleet without it does);
- `admission`: `--admission-ttft-ms` at the target (the excess gets 429 with Retry-After).

Reported per fleet: requests offered, admitted (200), refused (429, and whether each carried Retry-After),
failed otherwise; the TTFT p50/p90 of the admitted ones against the target; the gateway's peak resident
memory; and in the "after" phase the same. The ratio `ttft_p90_ratio` is the baseline's admitted p90 over the
admission fleet's. Last stdout line JSON; results in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from benchmarks._common import git_commit, log, machine_info, percentile, write_result
from benchmarks._dynctl import dynctl_serve

MODEL = "SmolLM2-135M-Instruct"
PROMPT_WORDS = 120
MAX_TOKENS = 16


async def _one(client: httpx.AsyncClient, prompt: str) -> dict[str, Any]:
    start = time.perf_counter()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return {"status": response.status_code, "retry_after": response.headers.get("retry-after"),
                        "start": start}
            ttft = None
            async for line in response.aiter_lines():
                if ttft is None and line.startswith("data: {"):
                    ttft = time.perf_counter() - start
            return {"status": 200, "ttft_s": ttft, "start": start, "end": time.perf_counter()}
    except httpx.HTTPError as exc:
        return {"status": None, "error": repr(exc), "start": start}


def _prompt(rng: random.Random) -> str:
    return " ".join(f"w{rng.randrange(50_000)}" for _ in range(PROMPT_WORDS))


async def _closed_loop(url: str, concurrency: int, seconds: float) -> float:
    """Completions per second of `concurrency` clients back to back: the fleet's capacity when saturated."""
    rng, done = random.Random(1), 0
    deadline = time.perf_counter() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=concurrency)) as c:
        async def client_loop() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                if (await _one(c, _prompt(rng)))["status"] == 200:
                    done += 1
        start = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        return done / (time.perf_counter() - start)


async def _open_loop(url: str, rate_per_s: float, seconds: float, seed: int) -> list[dict[str, Any]]:
    """Poisson arrivals at `rate_per_s` for `seconds`; every request's outcome."""
    rng = random.Random(seed)
    tasks: list[asyncio.Task[dict[str, Any]]] = []
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=4096)) as client:
        end = time.perf_counter() + seconds
        next_s = time.perf_counter()
        while next_s < end:
            await asyncio.sleep(max(0.0, next_s - time.perf_counter()))
            tasks.append(asyncio.create_task(_one(client, _prompt(rng))))
            next_s += rng.expovariate(rate_per_s)
        return list(await asyncio.gather(*tasks))


def _summary(outcomes: list[dict[str, Any]], target_s: float) -> dict[str, Any]:
    ttfts = [o["ttft_s"] for o in outcomes if o["status"] == 200 and o.get("ttft_s") is not None]
    refused = [o for o in outcomes if o["status"] == 429]
    return {
        "offered": len(outcomes), "admitted": len(ttfts), "refused": len(refused),
        "refused_with_retry_after": sum(o.get("retry_after") is not None for o in refused),
        "failed": sum(o["status"] not in (200, 429) for o in outcomes),
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
        "within_target": (sum(t <= target_s for t in ttfts) / len(ttfts)) if ttfts else None,
    }


class _PeakRss:
    """The peak resident memory of a process (the gateway: `dynctl serve`'s own), sampled every 0.2 s."""

    def __init__(self, pid: int) -> None:
        self.process, self.peak_bytes = psutil.Process(pid), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self.peak_bytes = max(self.peak_bytes, self.process.memory_info().rss)
            except psutil.NoSuchProcess:
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(5)
        return self.peak_bytes


def _fleet_flags(args: argparse.Namespace) -> list[str]:
    return ["--mocker", "cpu", "--workers", str(args.workers), "--mocker-speedup", str(args.speedup)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    target_s = args.ttft_ms / 1000
    after_s = max(5.0, args.seconds / 4)
    log_dir = Path(tempfile.mkdtemp(prefix="overload-"))
    with dynctl_serve("capacity", _fleet_flags(args), log_dir=log_dir) as server:
        url = f"http://127.0.0.1:{server.port}"
        asyncio.run(_closed_loop(url, 8, 3))  # warm-up
        unloaded = _summary(asyncio.run(_open_loop(url, 1.0, 5.0, seed=1)), target_s)  # one at a time, mostly
        capacity = asyncio.run(_closed_loop(url, args.concurrency, args.capacity_seconds))
    log(f"capacity: {capacity:.1f} completions/s; unloaded TTFT p50 {unloaded['ttft_p50_s']:.3f} s")
    if unloaded["ttft_p50_s"] and unloaded["ttft_p50_s"] > target_s / 2:
        log(f"the target ({target_s} s) is near the fleet's unloaded TTFT: admission cannot meet it")
    fleets: dict[str, Any] = {}
    for name, extra in (("baseline", []), ("admission", ["--admission-ttft-ms", str(args.ttft_ms)])):
        with dynctl_serve(name, [*_fleet_flags(args), *extra], log_dir=log_dir) as server:
            url = f"http://127.0.0.1:{server.port}"
            rss = _PeakRss(server.process.pid)
            rss_start = psutil.Process(server.process.pid).memory_info().rss
            overload = asyncio.run(_open_loop(url, args.load * capacity, args.seconds, seed=2))
            after = asyncio.run(_open_loop(url, 0.5 * capacity, after_s, seed=3))
            fleets[name] = {"overload": _summary(overload, target_s), "after": _summary(after, target_s),
                            "gateway_rss_mb_start": round(rss_start / 2**20, 1),
                            "gateway_rss_mb_peak": round(rss.stop() / 2**20, 1)}
            log(f"{name}: {json.dumps(fleets[name])}")
    base_p90 = fleets["baseline"]["overload"]["ttft_p90_s"]
    adm_p90 = fleets["admission"]["overload"]["ttft_p90_s"]
    return {
        "benchmark": "overload", "commit": git_commit(), "machine": machine_info(), "quick": args.quick,
        "ttft_target_s": target_s, "capacity_per_s": round(capacity, 2), "load": args.load,
        "unloaded_ttft_p50_s": unloaded["ttft_p50_s"],
        "seconds": args.seconds, "fleets": fleets,
        "admitted_ttft_p90_s": adm_p90, "admitted_within_target_p90": adm_p90 is not None and adm_p90 <= target_s,
        "ttft_p90_ratio": round(base_p90 / adm_p90, 2) if base_p90 and adm_p90 else None,
        "after_all_served": fleets["admission"]["after"]["failed"] == 0
        and fleets["admission"]["after"]["refused"] == 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="20 s of overload instead of 60")
    parser.add_argument("--seconds", type=float, default=None, help="overload phase length [default: 60; quick 20]")
    parser.add_argument("--ttft-ms", type=float, default=500.0, help="the TTFT target [default: 500]")
    parser.add_argument("--load", type=float, default=2.0, help="offered load over capacity [default: 2]")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--speedup", type=float, default=20.0, help="mocker speedup [default: 20]")
    parser.add_argument("--concurrency", type=int, default=32, help="closed-loop clients measuring capacity")
    parser.add_argument("--capacity-seconds", type=float, default=10.0)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    if args.seconds is None:
        args.seconds = 20.0 if args.quick else 60.0
    result = run(args)
    write_result("overload", result, args.output)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
