"""The planner against static fleets: one day of load replayed on simulated H100s, three ways.

**The day** (`planner_trace.py`, seed 0): a diurnal curve from a trough at 10% of its peak (20 req/s) up to
the peak at midday and back, plus three bursts of 20-35% of the peak where the seed puts them. Prompts are
lognormal around 1,800 tokens (256-6,144), answers around 150 (32-512), each prompt unique (no prefix-cache
hits). The day is played in `Plan.duration_s` modelled seconds (120 for `--quick`, 360 for the full run:
one second is 12 or 4 minutes of the day), and at speedup S in that divided by S of wall time. `--trace
FILE` replays a Mooncake JSONL trace instead, its span compressed to the same length, every request kept
(rates scale with the compression: check the logged peak against this machine).

**The fleets**, each a fresh `dynctl serve --mocker llama-3.1-70b-h100-tp4 --mocker-speedup S`,
disaggregated, kv router, and in all three modes a Prometheus scraping every second (the planner's reads
cost the same everywhere) and `--disagg-max-prefill-queue 100000`: prompts wait for a prefill worker and
never prefill on a decode worker, which is what the planner's capacity model assumes (with the default,
a prefill pool behind the load sends prompts to the decode workers, whose decodes then stall behind each
prefill; docs/benchmarks.md):

1. **planner**: `--planner --planner-mode sla`, from one prefill and one decode worker, each pool bounded
   by [1, the peak fleet's size], deciding every `Plan.interval_s` on a `Plan.window_s` read window;
2. **peak**: a static fleet sized for the trace's busiest window of `Plan.window_s`;
3. **mean**: a static fleet sized for its mean rate.

The static fleets are sized by the capacity math the planner uses (`fleet_for_rate`: the prompt tokens/s
a prefill worker sustains at the TTFT target, the output tokens/s a decode worker sustains at the ITL
target, from the shipped capacity profile of the mocker profile, at the trace's mean ISL and OSL).

**Targets.** Each request is judged by `SLO`: TTFT <= 2 s and mean ITL <= 25 ms (40 tokens/s a user),
modelled time. The planner, and the static fleets' sizing, get `SIZING`: TTFT 1 s, ITL 20 ms. The planner
holds the *mean* TTFT (by an M/D/1 model) and the mean step time at its targets, so a request-level SLO
most requests must meet needs a margin above them; at 20 ms a decode worker holds about 32 sequences of
2,100 tokens, at 25 ms about 68. With `--speedup S` the planner gets targets, interval and window divided
by S (it scales its profile by S itself).

Why these settings: the busiest window stays within what this 2-core machine carries beside the client and
the mockers, every pool needs a few workers, so the mean fleet is a real fraction of the peak fleet, and
the day is long against the planner's reaction time (its read window, its interval, a worker's start and
the requests' own duration: the rate it reads counts requests as they finish). The figures behind them:
docs/benchmarks.md (planner).

**Reported** (last stdout line, and `benchmarks/results/planner-<timestamp>.json`): `planner_attainment`,
`peak_attainment`, `mean_attainment` (the fraction of the day's requests meeting both SLO targets),
`worker_s_<mode>` (serving workers integrated over the replay, wall seconds: the planner's from
`GET /planner` every 0.5 s, a static fleet's its size times the replay), `worker_s_ratio_vs_peak` (planner
over peak), `scale_events` (changes of each pool's target), the fleet sizes; per mode attainment per hour
of the day (overall, TTFT, ITL), TTFT and mean-ITL percentiles, the server's CPU cores, how late the
client sent requests (`send_lag_p99_real_ms`: past 50 ms the machine, not the fleet, was the bottleneck),
the planner's decisions; and a PNG next to the JSON (`benchmarks/results/planner-<timestamp>.png`, path in
`plot`): offered load, workers per pool of each mode, attainment per hour.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.planner [--quick] [--trace FILE]

`--quick` plays three 2-minute replays (servers started and stopped between them), the full run three of
6 minutes. `--modes` runs a subset (ratios are then null); `--log-dir` keeps the servers' logs.

Measurements: `docs/benchmarks.md` (planner).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import itertools
import json
import math
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks._common import (
    RESULTS_DIR,
    BackgroundLoop,
    git_commit,
    log,
    machine_info,
    percentile,
    write_result,
)
from benchmarks._dynctl import dynctl_serve
from benchmarks._goodput import Slo
from benchmarks._streaming import StreamedCompletion, completion_body, stream_completion
from benchmarks.planner_trace import (
    FULL_PLAN,
    QUICK_PLAN,
    Plan,
    TraceRequest,
    compress,
    generate,
    read_mooncake,
    summarize,
    trace_shape,
    windowed_rates_per_s,
)

PROFILE = "llama-3.1-70b-h100-tp4"
SLO = Slo(ttft_ms=2000.0, itl_ms=25.0)  # every request, modelled time
SIZING = Slo(ttft_ms=1000.0, itl_ms=20.0)  # the planner's (mean) targets, and the static fleets' sizing
MODES = ("planner", "peak", "mean")
POOLS = ("prefill", "decode")
POLL_PERIOD_S = 0.5
NUM_WARM_UP = 4
LATE_SEND_MS = 50.0
NO_PREFILL_OVERFLOW = 100_000  # prompts wait for a prefill worker, never prefill on a decode worker


# ---- accounting (pure) -------------------------------------------------------------------------------------


def fleet_for_rate(profile: Any, rate_per_s: float, mean_isl: float, mean_osl: float, *, ttft_target_s: float,
                   itl_target_s: float) -> dict[str, int]:
    """Workers per pool (at least one each) that carry `rate_per_s` requests of `mean_isl` / `mean_osl`
    tokens at the targets, by the planner's own capacity math (`PlannerCore._sla_needs`, rounded up)."""
    prefill = rate_per_s * mean_isl / profile.prefill_capacity_tokens_per_s(mean_isl, ttft_target_s)
    context = mean_isl + mean_osl / 2
    decode = rate_per_s * mean_osl / profile.decode_capacity_tokens_per_s(context, itl_target_s)
    return {"prefill": max(1, math.ceil(prefill - 1e-9)), "decode": max(1, math.ceil(decode - 1e-9))}


def worker_seconds(samples: Sequence[tuple[float, int]], start_s: float, end_s: float) -> float:
    """The integral over [start_s, end_s] of a worker count sampled as (time, count), in time order: each
    count holds from its sample to the next (the last to `end_s`); before the first sample counts nothing."""
    total = 0.0
    for (t_s, count), (next_s, _) in itertools.pairwise([*samples, (end_s, 0)]):
        low, high = max(t_s, start_s), min(next_s, end_s)
        if high > low:
            total += count * (high - low)
    return total


def scale_events(targets: Sequence[Mapping[str, int]]) -> dict[str, int]:
    """Per pool, how often its target changed from one sample to the next."""
    events: dict[str, int] = {}
    for before, after in itertools.pairwise(targets):
        for pool, count in after.items():
            if pool in before and before[pool] != count:
                events[pool] = events.get(pool, 0) + 1
    return events


def attainment(met: Sequence[bool]) -> float:
    return sum(met) / len(met) if met else 0.0


def attainment_by_window(arrivals_s: Sequence[float], met: Sequence[bool], window_s: float,
                         duration_s: float) -> list[float | None]:
    """The attainment of the requests arriving in each window of `window_s` from 0 (None: no arrival);
    arrivals at or past `duration_s` count in the last window."""
    num_windows = max(1, math.ceil(duration_s / window_s - 1e-9))
    good, total = [0] * num_windows, [0] * num_windows
    for t_s, ok in zip(arrivals_s, met, strict=True):
        index = min(num_windows - 1, max(0, int(t_s // window_s)))
        total[index] += 1
        good[index] += ok
    return [g / n if n else None for g, n in zip(good, total, strict=True)]


# ---- the workload and its replay ---------------------------------------------------------------------------


@dataclass
class Workload:
    trace: list[TraceRequest]  # modelled seconds from the replay's start
    bodies: list[bytes]  # one streamed completion a request, its prompt unique
    warm_up_bodies: list[bytes]  # short requests with prompts of their own
    duration_s: float


def make_workload(trace: list[TraceRequest], duration_s: float, seed: int) -> Workload:
    """Each request's body: its own prompt of plain-word token ids (no two share a block: the prefix cache
    never helps), exactly its output length (`ignore_eos`)."""
    import numpy as np

    from benchmarks.disagg import plain_word_ids
    from dynserve.model.resolve import default_model_path
    from dynserve.model.tokenizer import Tokenizer

    word_ids = np.array(plain_word_ids(Tokenizer.load(default_model_path())))
    rng = np.random.default_rng(seed)
    model = _model_id()
    bodies = [completion_body(model, rng.choice(word_ids, r.input_length).tolist(), r.output_length)
              for r in trace]
    warm_up = [completion_body(model, rng.choice(word_ids, 2000).tolist(), 8) for _ in range(NUM_WARM_UP)]
    return Workload(trace, bodies, warm_up, duration_s)


async def replay(port: int, workload: Workload, speedup: float, timeout_s: float) -> list[StreamedCompletion]:
    """Send every request at its time (modelled, so `speedup` times sooner in wall time) and read it."""
    start_s = time.monotonic() + 0.2
    done = [0]

    async def one(request: TraceRequest, body: bytes) -> StreamedCompletion:
        scheduled_s = start_s + request.timestamp_s / speedup
        await asyncio.sleep(max(0.0, scheduled_s - time.monotonic()))
        result = await stream_completion(port, body, scheduled_s=scheduled_s, timeout_s=timeout_s)
        done[0] += 1
        return result

    async def progress() -> None:
        while True:
            await asyncio.sleep(15.0)
            elapsed_s = (time.monotonic() - start_s) * speedup
            sent = sum(r.timestamp_s <= elapsed_s for r in workload.trace)
            log(f"  {elapsed_s:.0f}/{workload.duration_s:.0f} s: {sent} sent, {done[0]} done")

    reporter = asyncio.create_task(progress())
    try:
        pairs = zip(workload.trace, workload.bodies, strict=True)
        return await asyncio.gather(*(one(request, body) for request, body in pairs))
    finally:
        reporter.cancel()


class PlannerPoller(BackgroundLoop):
    """Reads `GET /planner` every `POLL_PERIOD_S` on a thread of its own: (wall seconds since `start_s`,
    targets, serving) per read, and the planner's decisions (deduplicated)."""

    def __init__(self, port: int, start_s: float) -> None:
        super().__init__("planner-poller")
        self.port, self.start_s = port, start_s
        self.samples: list[tuple[float, dict[str, int], dict[str, int]]] = []
        self.decisions: list[dict[str, Any]] = []

    def _run(self) -> None:
        while not self._stop.wait(POLL_PERIOD_S):
            with contextlib.suppress(OSError, ValueError, http.client.HTTPException):
                state = self._get()
                t_s = time.monotonic() - self.start_s
                self.samples.append((t_s, state["targets"], state["serving"]))
                decision = state.get("last_decision")
                if decision and (not self.decisions or self.decisions[-1]["now_s"] != decision["now_s"]):
                    self.decisions.append({**decision, "t_s": decision["now_s"] - self.start_s})

    def _get(self) -> dict[str, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5.0)
        try:
            conn.request("GET", "/planner")
            response = conn.getresponse()
            body = response.read()
            if response.status != 200:
                raise ValueError(f"GET /planner answered {response.status}")
            return json.loads(body)
        finally:
            conn.close()


# ---- one mode ----------------------------------------------------------------------------------------------


@dataclass
class ModeRun:
    results: list[StreamedCompletion]
    ready_s: float
    replay_wall_s: float
    server_cpu_cores: float
    samples: list[tuple[float, dict[str, int], dict[str, int]]] = field(default_factory=list)
    decisions: list[dict[str, Any]] = field(default_factory=list)


def serve_and_replay(mode: str, flags: list[str], workload: Workload, *, speedup: float, poll: bool,
                     log_dir: Path) -> ModeRun:
    """A fresh `dynctl serve` with `flags`, a warm-up, the replay (with the planner polled when `poll`)."""
    started_s = time.monotonic()
    with dynctl_serve(f"planner-bench-{mode}", flags, log_dir=log_dir) as server:
        ready_s = time.monotonic() - started_s
        log(f"{mode}: serving on port {server.port} after {ready_s:.1f} s; warming up")
        asyncio.run(warm_up(server.port, workload.warm_up_bodies))
        timeout_s = max(60.0, workload.duration_s / speedup / 2)
        cpu_before_s, start_s = server.cpu_s(), time.monotonic()
        poller = PlannerPoller(server.port, start_s) if poll else contextlib.nullcontext()
        with poller:
            results = asyncio.run(replay(server.port, workload, speedup, timeout_s))
        wall_s = time.monotonic() - start_s
        cpu_cores = (server.cpu_s() - cpu_before_s) / wall_s
        if any(r.error for r in results):
            log(f"{mode}: {sum(bool(r.error) for r in results)} requests failed; the server's log ends:\n"
                f"{server.log_tail()}")
    run = ModeRun(results, ready_s, wall_s, cpu_cores)
    if isinstance(poller, PlannerPoller):
        run.samples, run.decisions = poller.samples, poller.decisions
    return run


async def warm_up(port: int, bodies: Sequence[bytes]) -> None:
    """A few short requests, side by side, so first-use costs stay out of the replay."""
    results = await asyncio.gather(*(stream_completion(port, b) for b in bodies))
    failed = [r.error for r in results if r.error is not None]
    if failed:
        raise RuntimeError(f"warm-up request(s) failed: {failed}")


def summarize_mode(run: ModeRun, workload: Workload, fleet: Mapping[str, int] | None, *,
                   speedup: float, num_windows: int) -> dict[str, Any]:
    """Attainment (overall and per window), latencies, worker-seconds (wall), scale events of one mode."""
    met = [all(SLO.met_by(r, speedup)) for r in run.results]
    ttft_met = [SLO.met_by(r, speedup)[0] for r in run.results]
    itl_met = [SLO.met_by(r, speedup)[1] for r in run.results]
    arrivals_s = [r.timestamp_s for r in workload.trace]
    window_s = workload.duration_s / num_windows

    def by_window(flags: Sequence[bool]) -> list[float | None]:
        return attainment_by_window(arrivals_s, flags, window_s, workload.duration_s)

    replay_wall_s = workload.duration_s / speedup
    scale_ms = speedup * 1e3
    ttfts = [r.ttft_s * scale_ms for r in run.results if r.ttft_s is not None]
    itls = [r.mean_itl_s * scale_ms for r in run.results if r.mean_itl_s is not None]
    lags = [(r.sent_s - r.scheduled_s) * 1e3 for r in run.results if r.sent_s is not None]
    summary: dict[str, Any] = {
        "attainment": attainment(met), "ttft_attainment": attainment(ttft_met),
        "itl_attainment": attainment(itl_met), "num_requests": len(met),
        "num_errors": sum(r.error is not None for r in run.results),
        "errors": sorted({r.error for r in run.results if r.error})[:5],
        "attainment_by_window": by_window(met), "ttft_attainment_by_window": by_window(ttft_met),
        "itl_attainment_by_window": by_window(itl_met),
        "ttft_p50_ms": percentile(ttfts, 50), "ttft_p95_ms": percentile(ttfts, 95),
        "mean_itl_p50_ms": percentile(itls, 50), "mean_itl_p95_ms": percentile(itls, 95),
        "send_lag_p99_real_ms": percentile(lags, 99), "server_cpu_cores": run.server_cpu_cores,
        "ready_s": run.ready_s, "replay_wall_s": run.replay_wall_s, "load_avg_1m": os.getloadavg()[0],
    }
    if fleet is not None:
        summary["fleet"] = dict(fleet)
        summary["worker_s"] = sum(fleet.values()) * replay_wall_s
        return summary
    serving = [(t, sum(s.values())) for t, _, s in run.samples]
    summary["worker_s"] = worker_seconds(serving, 0.0, replay_wall_s)
    summary["scale_events"] = scale_events([targets for _, targets, _ in run.samples])
    summary["max_serving"] = {p: max((s.get(p, 0) for _, _, s in run.samples), default=0) for p in POOLS}
    summary["replicas"] = [[round(t, 2), targets, serving] for t, targets, serving in run.samples]
    summary["decisions"] = [{k: d.get(k) for k in ("t_s", "targets", "reasons", "needs", "corrections",
                                                   "predicted_rate_per_s", "predicted_isl", "predicted_osl", "horizon_s")}
                            for d in run.decisions]
    return summary


# ---- the picture -------------------------------------------------------------------------------------------


def plot(path: Path, workload: Workload, modes: Mapping[str, dict[str, Any]], *, speedup: float,
         window_s: float, num_windows: int) -> None:
    """Offered load, replicas per pool and attainment per window, against the hour of the day."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    duration_s = workload.duration_s
    hours_per_s = 24.0 / duration_s
    figure, (load_ax, replicas_ax, attainment_ax) = plt.subplots(3, 1, figsize=(12, 9), sharex=True)
    rates = windowed_rates_per_s([r.timestamp_s for r in workload.trace], window_s, duration_s)
    load_ax.step([i * window_s * hours_per_s for i in range(len(rates))], rates, where="post", color="black")
    load_ax.set_ylabel("offered load (req/s)")
    colors = {"planner": "tab:blue", "peak": "tab:green", "mean": "tab:red"}
    styles = {"prefill": "-", "decode": "--"}
    for mode, summary in modes.items():
        if "fleet" in summary:
            for pool, count in summary["fleet"].items():
                replicas_ax.hlines(count, 0, 24, colors=colors[mode], linestyles=styles[pool],
                                   label=f"{mode} {pool}")
            continue
        times_h = [t * speedup * hours_per_s for t, _, _ in summary["replicas"]]
        for pool in POOLS:
            replicas_ax.step(times_h, [s.get(pool, 0) for _, _, s in summary["replicas"]], where="post",
                             color=colors[mode], linestyle=styles[pool], linewidth=2.0,
                             label=f"{mode} {pool} (serving)")
            replicas_ax.step(times_h, [t.get(pool, 0) for _, t, _ in summary["replicas"]], where="post",
                             color=colors[mode], linestyle=styles[pool], linewidth=0.8, alpha=0.6,
                             label=f"{mode} {pool} (target)")
    replicas_ax.set_ylabel("workers")
    replicas_ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    replicas_ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    width_h = 24.0 / num_windows
    for mode, summary in modes.items():
        values = [math.nan if a is None else a for a in summary["attainment_by_window"]]
        attainment_ax.step([i * width_h for i in range(len(values))], values, where="post",
                           color=colors[mode], label=f"{mode} ({summary['attainment']:.3f})")
    attainment_ax.axhline(0.95, color="grey", linewidth=0.8, linestyle=":")
    attainment_ax.set_ylabel("attainment (both SLOs)")
    attainment_ax.set_ylim(-0.02, 1.02)
    attainment_ax.set_xlabel("hour of the day")
    attainment_ax.set_xlim(0, 24)
    attainment_ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.suptitle(f"planner vs static fleets: {PROFILE}, speedup {speedup:g}, SLO TTFT {SLO.ttft_ms:g} ms, "
                    f"ITL {SLO.itl_ms:g} ms")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


# ---- main --------------------------------------------------------------------------------------------------


def _model_id() -> str:
    from dynserve.model.resolve import default_model_path, model_id_of

    return model_id_of(default_model_path())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.planner", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 120 s day (about 7 minutes in all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", type=Path, default=None,
                        help="replay this Mooncake JSONL trace (compressed to the day's length) instead")
    parser.add_argument("--duration-s", type=float, default=None,
                        help="the replayed day, modelled seconds [default: the plan's]")
    parser.add_argument("--speedup", type=float, default=1.0,
                        help="the mockers' speedup: the day plays S times faster in wall time [default: 1]")
    parser.add_argument("--profile", default=PROFILE,
                        help="the capacity profile (shipped name or file) [default: the mocker profile's]")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="keep the servers' logs here [default: a temporary directory, removed]")
    return parser.parse_args(argv)


def _capacity_profile(name: str) -> Any:
    from dynserve.planner import profile

    return profile.load(Path(name)) if Path(name).is_file() else profile.shipped(name)


def mode_flags(plan: Plan, speedup: float, fleets: Mapping[str, Mapping[str, int]], profile_name: str, *,
               prefill_floor: int = 1) -> dict[str, tuple[list[str], dict[str, int] | None]]:
    """Each mode's `dynctl serve` flags, and its static fleet (None: the planner's, from `prefill_floor`
    prefill workers and one decode worker, bounded by the peak fleet's sizes)."""
    common = ["--mocker", PROFILE, "--mocker-speedup", f"{speedup:g}", "--router", "kv", "--prometheus",
              "--scrape-interval-s", "1", "--disagg-max-prefill-queue", str(NO_PREFILL_OVERFLOW)]

    def static(fleet: Mapping[str, int]) -> list[str]:
        return [*common, "--prefill-workers", str(fleet["prefill"]), "--decode-workers", str(fleet["decode"])]

    planner = [*static({"prefill": prefill_floor, "decode": 1}), "--planner", "--planner-mode", "sla",
               "--planner-ttft-ms", f"{SIZING.ttft_ms / speedup:g}", "--planner-itl-ms",
               f"{SIZING.itl_ms / speedup:g}", "--planner-interval-s", f"{plan.interval_s / speedup:g}",
               "--planner-window-s", f"{plan.window_s / speedup:g}",
               "--planner-min-prefill-workers", str(prefill_floor),
               "--planner-max-prefill-workers", str(fleets["peak"]["prefill"]),
               "--planner-min-decode-workers", "1",
               "--planner-max-decode-workers", str(fleets["peak"]["decode"])]
    if profile_name != PROFILE:
        planner += ["--planner-profile", profile_name]
    statics = {mode: (static(fleet), dict(fleet)) for mode, fleet in fleets.items()}
    return {"planner": (planner, None), **statics}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    plan = QUICK_PLAN if args.quick else FULL_PLAN
    duration_s = args.duration_s or plan.duration_s
    stamp = time.strftime("%Y%m%d-%H%M%S")
    output = args.output or RESULTS_DIR / f"planner-{stamp}.json"
    if args.trace is not None:
        trace = compress(read_mooncake(args.trace), duration_s)
    else:
        trace = generate(replace(trace_shape(quick=args.quick), duration_s=duration_s), args.seed)
    window_s = plan.window_s
    trace_info = summarize(trace, duration_s, window_s)
    profile = _capacity_profile(args.profile)
    targets = {"ttft_target_s": SIZING.ttft_ms / 1000, "itl_target_s": SIZING.itl_ms / 1000}
    peak_fleet = fleet_for_rate(profile, trace_info["peak_rate_per_s"], trace_info["mean_isl"],
                                trace_info["mean_osl"], **targets)
    mean_fleet = fleet_for_rate(profile, trace_info["mean_rate_per_s"], trace_info["mean_isl"],
                                trace_info["mean_osl"], **targets)
    info = trace_info
    log(f"trace: {info['num_requests']} requests in {duration_s:g} s, peak {info['peak_rate_per_s']:.1f} "
        f"req/s over {window_s:g} s, mean {info['mean_rate_per_s']:.1f} req/s, ISL {info['mean_isl']:.0f}, "
        f"OSL {info['mean_osl']:.0f}; fleets: peak {peak_fleet}, mean {mean_fleet}")
    workload = make_workload(trace, duration_s, args.seed)
    flags = mode_flags(plan, args.speedup, {"peak": peak_fleet, "mean": mean_fleet}, args.profile)
    start_s = time.monotonic()
    modes: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="planner-bench-") as tmp:
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        for mode in args.modes:
            mode_args, fleet = flags[mode]
            log(f"{mode}: replaying the day ({duration_s / args.speedup:.0f} s)")
            run = serve_and_replay(mode, mode_args, workload, speedup=args.speedup, poll=fleet is None,
                                   log_dir=log_dir)
            modes[mode] = summarize_mode(run, workload, fleet, speedup=args.speedup,
                                         num_windows=plan.num_attainment_windows)
            modes[mode]["flags"] = mode_args
            _log_mode(mode, modes[mode])
    png = output.with_suffix(".png")
    png.parent.mkdir(parents=True, exist_ok=True)
    plot(png, workload, modes, speedup=args.speedup, window_s=window_s,
         num_windows=plan.num_attainment_windows)
    result = _result(args, plan, duration_s, trace_info, peak_fleet, mean_fleet, modes)
    result.update(plot=str(png), wall_s=time.monotonic() - start_s)
    write_result("planner", result, output)
    return result


def _log_mode(mode: str, summary: Mapping[str, Any]) -> None:
    lag_ms = summary["send_lag_p99_real_ms"] or 0.0
    log(f"{mode}: attainment {summary['attainment']:.3f} (TTFT {summary['ttft_attainment']:.3f}, ITL "
        f"{summary['itl_attainment']:.3f}), {summary['worker_s']:.0f} worker-s, TTFT p95 "
        f"{summary['ttft_p95_ms'] or 0:.0f} ms, mean ITL p95 {summary['mean_itl_p95_ms'] or 0:.1f} ms, "
        f"{summary['server_cpu_cores']:.2f} cores, send lag p99 {lag_ms:.0f} ms"
        + (f", scale events {summary['scale_events']}" if "scale_events" in summary else ""))
    if lag_ms > LATE_SEND_MS:
        log(f"{mode}: the client sent requests up to {lag_ms:.0f} ms late: the machine was a bottleneck")


def _result(args: argparse.Namespace, plan: Plan, duration_s: float, trace_info: Mapping[str, Any],
            peak_fleet: Mapping[str, int], mean_fleet: Mapping[str, int],
            modes: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    def figure(mode: str, key: str) -> Any:
        return modes[mode][key] if mode in modes else None

    planner_s, peak_s = figure("planner", "worker_s"), figure("peak", "worker_s")
    return {
        "benchmark": "planner", "quick": args.quick, "seed": args.seed, "commit": git_commit(),
        "machine": machine_info(), "mocker_profile": PROFILE, "capacity_profile": args.profile,
        "speedup": args.speedup, "trace": str(args.trace) if args.trace else "generated",
        "plan": asdict(plan),
        "duration_s": duration_s, "trace_summary": dict(trace_info),
        "slo": {"ttft_ms": SLO.ttft_ms, "itl_ms": SLO.itl_ms, "kind": "every request, modelled time"},
        "sizing_targets": {"ttft_ms": SIZING.ttft_ms, "itl_ms": SIZING.itl_ms,
                           "kind": "the planner's mean targets and the static fleets' sizing, modelled time"},
        "peak_fleet": dict(peak_fleet), "mean_fleet": dict(mean_fleet),
        "planner_attainment": figure("planner", "attainment"),
        "peak_attainment": figure("peak", "attainment"),
        "mean_attainment": figure("mean", "attainment"),
        "worker_s_planner": planner_s, "worker_s_peak": peak_s, "worker_s_mean": figure("mean", "worker_s"),
        "worker_s_ratio_vs_peak": planner_s / peak_s if planner_s is not None and peak_s else None,
        "scale_events": figure("planner", "scale_events"),
        "send_lag_p99_real_ms_max": max((m["send_lag_p99_real_ms"] or 0.0 for m in modes.values()),
                                        default=None),
        "modes": dict(modes),
    }


if __name__ == "__main__":
    main()
