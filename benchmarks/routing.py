"""KV-aware routing against round robin and sglang-router's cache_aware policy on a multi-turn chat workload.

The workload (`_chat_workload.py`, fixed seed): a few long system prompts, each shared by many
conversations; each conversation runs several turns that resend the whole history (system prompt, earlier
questions and answers) plus a new question; conversations arrive as a Poisson process and a user thinks
between turns. The workload is written in real seconds and compressed by the mocker speedup (arrivals come
`speedup` times faster, users think `speedup` times shorter), so it loads the simulated workers as it
would load the real ones.

The same workload is played three times, each time against 8 fresh mockers with the cpu profile (empty
caches; `python -m dynserve.cli.mocker`: an OpenAI server each, registered in Redis, publishing KV
events):

1. **kv**: dynserve's gateway (own process, as `dynctl serve` runs it) following the mockers through the
   Redis registry, routing by prefix overlap and load, over our worker channel;
2. **rr**: the same gateway routing round robin;
3. **sglang**: `sglang-router --policy cache_aware` (sglang-router 0.3.2 from `.venv-peers`, set up by
   `scripts/setup-peers.sh` when missing) in front of the mockers' own HTTP servers.

Reported per phase: TTFT p50/p90 (and p50 by turn), the cache hit ratio (cached / prompt tokens from the
usage the server reports), `history_hit` (follow-up turns that found their previous prompt cached), the
workers' time-averaged load (polled over the worker channel) and its imbalance, the CPU the whole stack
used, wall time and load average; then `ttft_ratio_rr_over_kv` and `ttft_ratio_sglang_over_kv` (p50s).

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.routing [--quick]
    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.routing --phases kv kv:4 kv:8 rr   # overlap weights

The load generator is this process. The last stdout line is the JSON result; a copy goes to
`benchmarks/results/routing-<timestamp>.json`. `--quick` plays 16 conversations of 5 turns instead of 48 of
6: the full run loads the workers enough for placement to matter, the quick run's load is too light for it.

A request in flight counts all its KV in the load term while a follow-up turn saves only its history since
the system prompt, which is why the defaults weigh overlap well above load (`Settings.overlap_weight`) and
keep the hot-spot guard for real hot spots (`router_hot_spot_*`). What each router did at these loads, the
measurements (TTFT p50 and p90, cache hit, history hit, by router and setting) and their history:
`docs/benchmarks.md` (routing).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import psutil

from benchmarks._chat_workload import ChatWorkload, TurnResult, make_chat_workload, play, summarize
from benchmarks._common import git_commit, log, machine_info, write_result
from benchmarks._http import RawConnection
from benchmarks._services import (
    Service,
    ensure_sglang_router,
    start_gateway,
    start_mockers,
    start_redis,
    start_sglang_router,
    stop_all,
    stop_gateway,
)
from benchmarks._worker_load import LoadSampler, registered_workers
from dynserve.config import Settings

PHASES = ("kv", "rr", "sglang")
NUM_MOCKERS = 8
PROFILE = "cpu"


@dataclass(frozen=True)
class Plan:
    """The workload in real seconds (before the speedup)."""

    num_conversations: int
    num_turns: int
    arrival_rate_per_s: float
    think_s: float
    num_system_prompts: int = 4
    system_words: int = 600
    user_words: tuple[int, int] = (20, 100)
    max_tokens: tuple[int, int] = (100, 300)

    def workload(self, seed: int, speedup: float) -> ChatWorkload:
        return make_chat_workload(
            seed=seed, num_system_prompts=self.num_system_prompts, system_words=self.system_words,
            num_conversations=self.num_conversations, num_turns=self.num_turns, user_words=self.user_words,
            max_tokens=self.max_tokens, arrival_rate_per_s=self.arrival_rate_per_s * speedup,
            think_s=self.think_s / speedup)


FULL_PLAN = Plan(num_conversations=48, num_turns=6, arrival_rate_per_s=0.5, think_s=8.0)
QUICK_PLAN = Plan(num_conversations=16, num_turns=5, arrival_rate_per_s=0.5, think_s=4.0)


# ---- one phase ---------------------------------------------------------------------------------------


async def _warm_up(port: int, model: str, num_requests: int) -> None:
    """Short requests with prompts the workload never uses, so first-use costs stay out of the timing."""
    async def one(i: int) -> None:
        conn = await RawConnection("127.0.0.1", port).open()
        body = json.dumps({"model": model, "max_tokens": 4, "stream": True,
                           "messages": [{"role": "user", "content": f"warm-up request {i}"}]}).encode()
        _, events = await conn.post_events(conn.request_bytes("/v1/chat/completions", body))
        async for _ in events:
            pass
        await conn.close()

    await asyncio.gather(*(one(i) for i in range(num_requests)))


async def _drive(port: int, workload: ChatWorkload, sampler: LoadSampler,
                 model: str) -> tuple[list[TurnResult], int, float]:
    """Warm up, then play the workload while sampling the workers' loads: (results, retries, wall time)."""
    await _warm_up(port, model, NUM_MOCKERS)
    sampling = asyncio.create_task(sampler.run())
    start_s = time.monotonic()
    try:
        results, num_retries = await play(workload, "127.0.0.1", port, model)
    finally:
        sampling.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampling
    return results, num_retries, time.monotonic() - start_s


def _cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


@dataclass(frozen=True)
class Phase:
    """What fronts the fleet: `kv` (with `overlap_weight`, None for dynserve's default), `rr`, or `sglang`."""

    name: str
    front: str
    overlap_weight: float | None = None


def parse_phase(spec: str, default_overlap_weight: float | None = None) -> Phase:
    """`kv`, `kv:WEIGHT` (the kv router with that overlap weight), `rr` or `sglang`."""
    front, _, weight = spec.partition(":")
    if front == "kv":
        try:
            return Phase(spec, "kv", float(weight) if weight else default_overlap_weight)
        except ValueError:
            pass
    elif front in ("rr", "sglang") and not weight:
        return Phase(spec, front)
    raise ValueError(f"bad phase {spec!r}: use kv, kv:WEIGHT, rr or sglang")


def _start_front(phase: Phase, mockers: list[Service], redis_url: str, namespace: str, log_dir: Path,
                 sglang_router: Path | None) -> tuple[Any, int, int]:
    """(what to stop, its port, its pid) for the phase's router in front of `mockers`."""
    if phase.front == "sglang":
        if sglang_router is None:
            raise RuntimeError("the sglang phase needs sglang-router")
        router = start_sglang_router(sglang_router, [m.port for m in mockers], log_dir)
        return router, router.port, router.process.pid
    given = {} if phase.overlap_weight is None else {"overlap_weight": phase.overlap_weight}
    settings = Settings(router="kv" if phase.front == "kv" else "round_robin", redis_url=redis_url,
                        namespace=namespace, port=0, **given)
    gateway, port = start_gateway(settings)
    return gateway, port, gateway.pid


def _stop_front(front: Any) -> None:
    if isinstance(front, Service):
        front.stop()
    else:
        stop_gateway(front)


def run_phase(phase: Phase, workload: ChatWorkload, *, speedup: float, redis_url: str, log_dir: Path,
              sglang_router: Path | None) -> dict[str, Any]:
    """Fresh mockers, the phase's router in front of them, a warm-up, the workload; the phase's summary."""
    namespace = f"routing-{phase.name.replace(':', '-')}"
    log(f"{phase.name}: starting {NUM_MOCKERS} mockers (profile {PROFILE}, speedup {speedup:g})")
    started_s = time.monotonic()
    mockers = start_mockers(NUM_MOCKERS, profile=PROFILE, speedup=speedup, redis_url=redis_url,
                            namespace=namespace, log_dir=log_dir)
    front = None
    try:
        infos = asyncio.run(registered_workers(redis_url, namespace, NUM_MOCKERS))
        front, port, front_pid = _start_front(phase, mockers, redis_url, namespace, log_dir, sglang_router)
        ready_s = time.monotonic() - started_s
        log(f"{phase.name}: ready in {ready_s:.1f} s; playing {workload.num_turns} turns")
        pids = [os.getpid(), front_pid, *(m.process.pid for m in mockers)]
        cpu_before_s = _cpu_s(pids)
        sampler = LoadSampler(infos)
        results, num_retries, wall_s = asyncio.run(_drive(port, workload, sampler, infos[0].model_id))
        cpu_s = _cpu_s(pids) - cpu_before_s
    finally:
        if front is not None:
            _stop_front(front)
        stop_all(mockers)
    summary = summarize(results, block_size=infos[0].block_size)
    if phase.front == "kv":
        weight = phase.overlap_weight
        summary["overlap_weight"] = weight if weight is not None else _default_weight()
    summary.update(num_retries=num_retries, wall_s=wall_s, cpu_cores_used=cpu_s / wall_s,
                   load_avg_1m=os.getloadavg()[0], workers=sampler.summary())
    log(f"{phase.name}: TTFT p50 {summary['ttft_p50_ms']:.0f} ms, p90 {summary['ttft_p90_ms']:.0f} ms, "
        f"cache hit {summary['cache_hit']:.2f}, history hit {summary['history_hit']:.2f}, "
        f"{summary['turns']} turns in {wall_s:.1f} s ({num_retries} retried), "
        f"{summary['cpu_cores_used']:.2f} cores, load {summary['load_avg_1m']:.1f}")
    return summary


# ---- main --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.routing", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer conversations (about 90 s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--speedup", type=float, default=10.0,
                        help="the mockers' speedup, which the workload's clock follows [default: 10]")
    parser.add_argument("--arrival-rate", type=float, default=None,
                        help="conversations per real second (before the speedup) [default: the plan's]")
    parser.add_argument("--overlap-weight", type=float, default=None,
                        help="the kv phase's overlap weight [default: dynserve's]")
    parser.add_argument("--phases", nargs="+", default=list(PHASES),
                        help="phases in order: kv, kv:WEIGHT (kv with that overlap weight), rr, sglang "
                             "[default: kv rr sglang]")
    parser.add_argument("--sglang-router", type=Path, default=None,
                        help="sglang-router executable [default: .venv-peers', set up when missing]")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        args.phases = [parse_phase(spec, args.overlap_weight) for spec in args.phases]
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    plan = QUICK_PLAN if args.quick else FULL_PLAN
    if args.arrival_rate is not None:
        plan = replace(plan, arrival_rate_per_s=args.arrival_rate)
    workload = plan.workload(args.seed, args.speedup)
    needs_sglang = any(phase.front == "sglang" for phase in args.phases)
    sglang_router = ensure_sglang_router(args.sglang_router) if needs_sglang else None
    start_s = time.monotonic()
    phases: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="routing-bench-") as tmp:
        log_dir = Path(tmp)
        redis, redis_url = start_redis(log_dir)
        try:
            for phase in args.phases:
                phases[phase.name] = run_phase(phase, workload, speedup=args.speedup, redis_url=redis_url,
                                               log_dir=log_dir, sglang_router=sglang_router)
        finally:
            redis.stop()
    result: dict[str, Any] = {
        "benchmark": "routing", "quick": args.quick, "seed": args.seed, "commit": git_commit(),
        "machine": machine_info(), "num_mockers": NUM_MOCKERS, "profile": PROFILE, "speedup": args.speedup,
        "plan": asdict(plan), "num_turns": workload.num_turns, "phases": phases,
        "default_overlap_weight": _default_weight(),
        "wall_s": time.monotonic() - start_s,
    }
    for key in PHASES:
        if key in phases:
            result[f"ttft_p50_ms_{key}"] = phases[key]["ttft_p50_ms"]
            result[f"ttft_p90_ms_{key}"] = phases[key]["ttft_p90_ms"]
            result[f"cache_hit_{key}"] = phases[key]["cache_hit"]
    result["ttft_ratio_rr_over_kv"] = _ratio(result, "rr", "kv")
    result["ttft_ratio_sglang_over_kv"] = _ratio(result, "sglang", "kv")
    write_result("routing", result, args.output)
    return result


def _default_weight() -> float:
    return float(Settings.model_fields["overlap_weight"].default)


def _ratio(result: dict[str, Any], num: str, den: str) -> float | None:
    a, b = result.get(f"ttft_p50_ms_{num}"), result.get(f"ttft_p50_ms_{den}")
    return a / b if a is not None and b else None


if __name__ == "__main__":
    main()
