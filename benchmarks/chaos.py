"""Fault drills under load: one fault at a time, each while a steady stream of requests runs, and what the
client saw of it.

**Fleets**, each a `dynctl serve` started for its drills and stopped after them:

- *embedded*: mockers (`--mocker cpu --mocker-speedup 10`), `--prefill-workers 2 --decode-workers 2`, the
  embedded event plane (a Ray actor), and a second gateway alone over the same fleet (`dynctl gateway
  --ray-address`, the fleet's local Ray; both given one `DYN_CLUSTER_TOKEN`), so that one can be killed
  while the fleet lives on;
- *redis*: the same with `--redis-url` of a real redis-server this benchmark starts on a free port;
- *transfer_error* (and, full run, *transfer_timeout*): the same with `--transfer-fault error` (`timeout`,
  with `--transfer-timeout-s 1`). The fault is a setting with no switch at run time, and `dynctl serve` gives
  every worker the same settings, so every KV read of the fleet's decode workers fails; prefill workers read
  nothing. Its "before" is the embedded fleet's first before-window (same layout, same load);
- *real*: SmolLM2-135M, `--workers 2 --num-threads 1`, aggregated, a lighter load.

**Drills**, in this order (the event plane's kill last: nothing brings that actor back):

| fault | how |
|---|---|
| `decode_worker_kill` | SIGKILL of the busiest decode worker (by its metrics port in `/metrics/targets`) |
| `prefill_worker_kill` | the same for the busiest prefill worker |
| `gateway_kill` | SIGKILL of the gateway alone, restarted on its port; the client retries (`max_retries=6`) |
| `event_plane_kill` | SIGKILL of the `ray::EventPlaneActor` process |
| `redis_restart` | SIGKILL of redis-server, an empty one on the same port a moment later |
| `transfer_error` | every KV read fails (the fleet above) |
| `real_worker_kill` | SIGKILL of the busiest real worker |

**Load**: `benchmarks/_chaos_load.py`: a closed loop through the official `openai` async client, no client
retries except in `gateway_kill`; each request a unique prompt of plain-word token ids, exactly `max_tokens`
tokens asked (`ignore_eos`). A round runs the load `before_s` (`real_before_s` on the real model), injects
the fault, samples the fleet every 0.2 s until it has been back at full capacity for 1 s (and at least
`min_during_s` have passed; at most `recovery_timeout_s`), runs `after_s` more, then stops the load and
waits for its requests to end.

**Per fault** (`faults` in the JSON): failed requests (each with its error, whether it was in flight at the
fault, and the tokens it had), TTFT p99 *before* (requests that ran entirely within the `before_s` before
the fault) and *during* (requests in flight at the fault or started before recovery, at least
`min_during_s` after it), completed requests per second in both windows, `recovery_s`, the fewest workers
the gateway had up, the client's retried requests and the statuses other than 200 it saw, and the
gateway's retries, migrations (`dynserve_migrations_total{reason}`) and disaggregation fallbacks
(`dynserve_disagg_fallbacks_total{reason}`) over the round.

*Full capacity* (what `recovery_s` waits for): for a kill, every worker listed by the gateway's
`/metrics/targets` and up in `dynserve_gateway_worker_up`, the killed one's address gone (its replacement
announces a new one); for the event plane and Redis, every worker up and the gateway's routers applying KV
events again (`dynserve_router_event_lag_seconds_count` growing under the load: a router without events
routes blind); for a gateway, it answers `/ready` with every worker up. `recovery_s` is null when that did
not happen within the round.

**Leaked blocks**: after each fleet's drills, with no load, the sum of `dynserve_worker_kv_blocks_used`
(blocks held by requests; the prefix cache's evictable blocks are not counted) over the workers the
gateway lists, waited for up to `kv_lease_s` + 15 s (a prefill worker frees blocks its decode worker never
took when their lease ends, as after the gateway kill).

**Targets**: 0 failed requests for every worker, transfer, Redis and event-plane fault; for the gateway
kill, failures only among the requests in flight at that gateway; 0 leaked blocks (`targets_met`).

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.chaos [--quick] [--skip-real]

The last stdout line is the JSON result (`failed_requests`, `recovery_s`, `ttft_p99_s` per fault,
`leaked_blocks`, `targets_met`, ...); a copy goes to `benchmarks/results/chaos-<timestamp>.json`, and a
timeline (requests/s, failures and TTFT, faults marked) to the `.png` next to it. Most of a run goes to
starting and stopping the four fleets (five in the full run).

Measurements: `docs/benchmarks.md` (chaos).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks import _chaos_fleet as fleet
from benchmarks._chaos_report import headline, plot
from benchmarks._chaos_rounds import Bench, Plan, guarded, run_round, warm_up
from benchmarks._common import RESULTS_DIR, git_commit, log, machine_info, write_result
from benchmarks._dynctl import DynctlServer, dynctl_serve
from benchmarks._services import free_port, start_redis
from benchmarks.disagg import plain_word_ids
from dynserve.model.resolve import default_model_path, model_id_of
from dynserve.model.tokenizer import Tokenizer

SPEEDUP = 10.0
MOCKER_FLAGS = ["--mocker", "cpu", "--mocker-speedup", f"{SPEEDUP:g}", "--prefill-workers", "2",
                "--decode-workers", "2"]
NUM_MOCKERS = 4
REAL_FLAGS = ["--workers", "2", "--num-threads", "1"]
NUM_REAL = 2
KV_LEASE_S = 30.0  # Settings.kv_lease_s's default, which the fleets keep
GATEWAY_RETRIES = 6  # the openai SDK's backoff: 0.5, 1, 2, 4, 8, 8 s (with jitter): ~23 s in all

QUICK = Plan(concurrency=6, prompt_tokens=600, max_tokens=32, warm_up_s=2.0, before_s=5.0, min_during_s=5.0,
             after_s=2.0, recovery_timeout_s=15.0, redis_down_s=1.0, transfer_faults=("error",),
             real_concurrency=2, real_before_s=12.0, real_prompt_tokens=48, real_max_tokens=16,
             real_recovery_timeout_s=90.0)
FULL = Plan(concurrency=8, prompt_tokens=600, max_tokens=48, warm_up_s=4.0, before_s=15.0, min_during_s=15.0,
            after_s=5.0, recovery_timeout_s=60.0, redis_down_s=3.0, transfer_faults=("error", "timeout"),
            real_concurrency=3, real_before_s=20.0, real_prompt_tokens=64, real_max_tokens=24,
            real_recovery_timeout_s=120.0)


# ---- faults ------------------------------------------------------------------------------------------------


def kill_busiest(server: DynctlServer, role: str | None) -> tuple[dict[str, Any], str]:
    """SIGKILL the worker of `role` (any, if None) with the most requests; (details, its metrics address)."""
    views = [w for w in fleet.workers(server.port) if role is None or w.role == role]
    if not views:
        raise RuntimeError(f"no {role} worker listed by the gateway")
    victim = max(views, key=lambda w: w.num_running)
    pid = fleet.listening_pid(server.process.pid, int(victim.address.rsplit(":", 1)[1]))
    if pid is None:
        raise RuntimeError(f"no process of the fleet listens on {victim.address}")
    fleet.kill(pid)
    return {"worker_id": victim.worker_id, "role": victim.role, "pid": pid,
            "requests_on_it": victim.num_running,
            "address": victim.address}, victim.address


def replaced(port: int, killed: str, expected: int) -> bool:
    """Every worker listed and up at the gateway on `port`, the one at `killed` gone."""
    addresses = fleet.worker_addresses(port)
    return killed not in addresses and len(addresses) == expected and fleet.worker_up(port) == expected


def worker_round(bench: Bench, server: DynctlServer, name: str, role: str | None, expected: int,
                 real: bool = False) -> dict[str, Any]:
    killed: list[str] = []

    def inject() -> dict[str, Any]:
        details, address = kill_busiest(server, role)
        killed.append(address)
        return details

    return run_round(bench, name, server.port, inject, lambda: replaced(server.port, killed[0], expected),
                     real=real)


def plane_round(bench: Bench, server: DynctlServer, name: str,
                inject: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A fault of the event plane: recovered once every worker is up and KV events reach the routers again."""
    flow = fleet.EventFlow(server.port)
    applied: list[float] = []

    def injected() -> dict[str, Any]:
        applied.append(fleet.counters(server.port)["kv_event_batches"])
        return inject()

    def ready() -> bool:
        grew = flow.grew()
        return (grew and fleet.worker_up(server.port) == NUM_MOCKERS
                and len(fleet.worker_addresses(server.port)) == NUM_MOCKERS)

    summary = run_round(bench, name, server.port, injected, ready, before=flow.grew)
    # KV-event batches the gateway's routers applied after the fault, load and all
    applied_after = fleet.counters(server.port)["kv_event_batches"] - applied[0]
    summary["kv_event_batches_applied_after_fault"] = applied_after
    return summary


def gateway_round(bench: Bench, server: DynctlServer, ray_tmp: Path, env: dict[str, str]) -> dict[str, Any]:
    """A gateway alone over the fleet, killed under a retrying client's load and started again."""
    gateway = fleet.StandaloneGateway(fleet.gcs_address(ray_tmp), free_port(), [], env, bench.log_dir)

    def inject() -> dict[str, Any]:
        pid = gateway.process.pid if gateway.process else None
        gateway.kill()
        gateway.launch()
        return {"pid": pid, "port": gateway.port}

    def ready() -> bool:
        return (fleet.http_ready(gateway.port) and fleet.worker_up(gateway.port) == NUM_MOCKERS)

    try:
        start_s = gateway.start()
        log(f"gateway_kill: a gateway alone on port {gateway.port}, ready after {start_s:.1f} s")
        summary = run_round(bench, "gateway_kill", gateway.port, inject, ready, max_retries=GATEWAY_RETRIES,
                            restarts_gateway=True)
    finally:
        gateway.stop()
    summary["counters_note"] = "the restarted gateway's counters, since it started"
    summary["first_start_s"] = round(start_s, 2)
    return summary


# ---- fleets ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def mocker_fleet(bench: Bench, name: str, flags: list[str], env: dict[str, str] | None = None
                 ) -> Iterator[DynctlServer]:
    started_s = time.monotonic()
    with dynctl_serve(name, [*MOCKER_FLAGS, *flags], log_dir=bench.log_dir, env=env) as server:
        log(f"{name}: serving on port {server.port} after {time.monotonic() - started_s:.1f} s")
        warm_up(bench, server.port)
        yield server


def leak_check(server: DynctlServer) -> dict[str, Any]:
    held, waited_s, per_worker = fleet.wait_no_used_blocks(server.port, KV_LEASE_S + 15.0)
    log(f"{server.name}: {held:g} KV blocks still held by requests after {waited_s:.1f} s with no load")
    return {"leaked_blocks": int(held), "waited_s": round(waited_s, 1), "per_worker": per_worker}


def embedded_fleet(bench: Bench) -> tuple[dict[str, Any], dict[str, Any]]:
    ray_tmp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    # the fleet's cluster token (its internal sockets serve only those presenting it), given to both processes
    # through the environment: `dynctl serve` would make up its own, and the second gateway could not join
    fleet_env = {"RAY_TMPDIR": str(ray_tmp), "DYN_CLUSTER_TOKEN": secrets.token_urlsafe(24)}
    env = {**os.environ, "PYTHONPATH": str(fleet.REPO_ROOT), "RAY_AUTH_MODE": "disabled", **fleet_env}
    env.pop("RAY_ADDRESS", None)
    rounds: dict[str, Any] = {}
    try:
        with mocker_fleet(bench, "embedded", [], env=fleet_env) as server:
            for name, role in (("decode_worker_kill", "decode"), ("prefill_worker_kill", "prefill")):
                rounds[name] = guarded(name, functools.partial(worker_round, bench, server, name, role,
                                                               NUM_MOCKERS))
            rounds["gateway_kill"] = guarded("gateway_kill",
                                             lambda: gateway_round(bench, server, ray_tmp, env))

            def kill_plane() -> dict[str, Any]:
                pid = fleet.actor_pid(server.process.pid, "ray::EventPlaneActor")
                if pid is None:
                    raise RuntimeError("no ray::EventPlaneActor process in the fleet")
                fleet.kill(pid)
                return {"pid": pid}

            rounds["event_plane_kill"] = guarded("event_plane_kill", lambda: plane_round(
                bench, server, "event_plane_kill", kill_plane))
            leaks = leak_check(server)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return rounds, leaks


def redis_fleet(bench: Bench) -> tuple[dict[str, Any], dict[str, Any]]:
    redis, url = start_redis(bench.log_dir)
    services = [redis]
    try:
        with mocker_fleet(bench, "redis", ["--redis-url", url]) as server:
            def restart() -> dict[str, Any]:
                services.append(fleet.restart_redis(services[-1], bench.log_dir, bench.plan.redis_down_s))
                return {"port": redis.port, "down_s": bench.plan.redis_down_s}

            rounds = {"redis_restart": guarded("redis_restart", lambda: plane_round(
                bench, server, "redis_restart", restart))}
            # what the workers published to the restarted (empty) Redis: the routers' feed was there
            rounds["redis_restart"]["kv_event_batches_in_redis_after_restart"] = fleet.redis_xlen(
                redis.port, "dynserve:kv_events")
            leaks = leak_check(server)
    finally:
        for service in services:
            service.stop()
    return rounds, leaks


def transfer_fleet(bench: Bench, fault: str,
                   baseline: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    name = f"transfer_{fault}"
    flags = ["--transfer-fault", fault] + (["--transfer-timeout-s", "1"] if fault == "timeout" else [])
    with mocker_fleet(bench, name, flags) as server:
        def inject() -> dict[str, Any]:
            return {"flags": flags, "workers": "every decode worker's KV reads"}

        def ready() -> bool:
            return fleet.worker_up(server.port) == NUM_MOCKERS

        summary = guarded(name, lambda: run_round(bench, name, server.port, inject, ready,
                                                  fault_at_start=True))
        leaks = leak_check(server)
    summary["ttft_p99_s"]["before"] = baseline.get("ttft_p99_s", {}).get("before")
    summary["req_per_s"]["before"] = baseline.get("req_per_s", {}).get("before")
    summary["before_note"] = "the embedded fleet's before-window of decode_worker_kill (same layout and load)"
    return {name: summary}, leaks


def real_fleet(bench: Bench) -> tuple[dict[str, Any], dict[str, Any]]:
    started_s = time.monotonic()
    with dynctl_serve("real", REAL_FLAGS, log_dir=bench.log_dir) as server:
        log(f"real: serving on port {server.port} after {time.monotonic() - started_s:.1f} s")
        warm_up(bench, server.port, real=True)
        rounds = {"real_worker_kill": guarded("real_worker_kill", lambda: worker_round(
            bench, server, "real_worker_kill", None, NUM_REAL, real=True))}
        leaks = leak_check(server)
    return rounds, leaks


# ---- main --------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="short windows, one transfer fault (5-6 minutes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-real", action="store_true", help="leave out the real model's round")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--log-dir", type=Path, default=None, help="keep the fleets' logs here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    plan = QUICK if args.quick else FULL
    path = default_model_path()
    start_s = time.monotonic()
    faults: dict[str, Any] = {}
    leaks: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        log_dir = args.log_dir or Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="chaos-bench-")))
        log_dir.mkdir(parents=True, exist_ok=True)
        bench = Bench(plan, model_id_of(path), plain_word_ids(Tokenizer.load(path)), log_dir,
                      args.seed * 1000, [], [])
        rounds, leaks["embedded"] = embedded_fleet(bench)
        faults.update(rounds)
        rounds, leaks["redis"] = redis_fleet(bench)
        faults.update(rounds)
        for fault in plan.transfer_faults:
            rounds, leaks[f"transfer_{fault}"] = transfer_fleet(bench, fault, faults["decode_worker_kill"])
            faults.update(rounds)
        if not args.skip_real:
            rounds, leaks["real"] = real_fleet(bench)
            faults.update(rounds)
    output = args.output or RESULTS_DIR / f"chaos-{time.strftime('%Y%m%d-%H%M%S')}.json"
    png = output.with_suffix(".png")
    png.parent.mkdir(parents=True, exist_ok=True)
    plot(png, bench.outcomes, bench.faults, start_s)
    result: dict[str, Any] = {
        **headline(faults, leaks), "benchmark": "chaos", "quick": args.quick, "seed": args.seed,
        "commit": git_commit(), "machine": machine_info(), "plan": asdict(plan), "speedup": SPEEDUP,
        "mocker_flags": MOCKER_FLAGS, "real_flags": REAL_FLAGS, "faults": faults, "leaks": leaks,
        "num_requests": len(bench.outcomes), "plot": str(png), "wall_s": round(time.monotonic() - start_s, 1),
    }
    write_result("chaos", result, output)
    return result


if __name__ == "__main__":
    main()
