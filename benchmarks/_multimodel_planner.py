"""The multimodel benchmark's planner half: the same trace of models taking turns (`_multimodel_trace.py`)
replayed on a static fleet and on a planner's fleet, one after the other, each a fresh `dynctl serve`.

Both fleets: `--mocker llama-3.1-70b-h100-tp4 --mocker-speedup 1`, disaggregated, kv router, a Prometheus
scraping every second and `--disagg-max-prefill-queue 100000`, as `benchmarks/planner.py` runs them (its
`mode_flags`, with the models in front):

- **static**: every model with the workers its own busiest window needs (`Sizing.static_fleet`);
- **planner**: every model from its floors, 2 prefill workers (`TurnsPlan.prefill_floor`) + 1 decode worker,
  `--planner --planner-mode sla` with the mocker profile's shipped capacity profile and no rise spare (the
  floor's second prefill worker is a standing one), each model's pools
  bounded by [its floor, the static fleet's], all models within `--planner-max-total-workers`
  (`Sizing.budget`: the floors of every model and the static fleet's pools for the models busy at once,
  `models_busy_at_once` of the plan's phase and down delay); it is polled (`GET /planner`, each model's
  `targets` and `serving` under `models`) every 0.5 s.

Each request's body is a streamed completion of its own prompt (plain-word token ids, no two alike) of
exactly its output length, to its model; both fleets get the same bodies at the same times. A request meets
the SLO (`benchmarks.planner.SLO`, modelled time) when its TTFT and mean ITL are within the targets.
Worker-seconds are wall seconds of serving workers over the replay's length: the planner's integrated from
the polled `serving`, the static fleet's its size times the replay. Worker starts: what the polled targets
added, each model's and those added outside its bump (a trickle's; each start is about 1.4 s of CPU on the
benchmark's 2 cores).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._common import client_priority, log, percentile
from benchmarks._dynctl import dynctl_serve, scrape_counters
from benchmarks._multimodel_trace import (
    Sizing,
    TurnsShape,
    TurnsTrace,
    bump_s,
    generate,
    models_busy_at_once,
    rates_by_model,
    size_fleets,
)
from benchmarks._pressure import PressureSampler, around
from benchmarks._streaming import StreamedCompletion, completion_body
from benchmarks.planner import (
    POLL_PERIOD_S,
    POOLS,
    SLO,
    PlannerPoller,
    Workload,
    attainment,
    attainment_by_window,
    replay,
    scale_events,
    warm_up,
    worker_seconds,
)

__all__ = ["FULL_TURNS", "QUICK_TURNS", "FleetRun", "ModelsPoller", "TurnsPlan", "fleet_flags", "make_workload",
           "plot", "run_fleet", "run_planner_half", "summarize_planner", "summarize_static", "worker_starts",
           "worst_windows"]

LOAD_WINDOW_S = 5.0  # the offered load as the picture draws it


class ModelsPoller(PlannerPoller):
    """`PlannerPoller` for a planner of several models: every `period_s`, (wall seconds since `start_s`,
    {model: targets}, {model: serving}) from `GET /planner`'s `models`, and each model's decisions
    (deduplicated)."""

    def __init__(self, port: int, start_s: float, *, period_s: float = POLL_PERIOD_S) -> None:
        super().__init__(port, start_s)
        self.period_s = period_s
        self.model_samples: list[tuple[float, dict[str, dict[str, int]], dict[str, dict[str, int]]]] = []
        self.model_decisions: dict[str, list[dict[str, Any]]] = {}

    def _run(self) -> None:
        import http.client

        while not self._stop.wait(self.period_s):
            with contextlib.suppress(OSError, ValueError, KeyError, http.client.HTTPException):
                models = self._get()["models"]
                t_s = time.monotonic() - self.start_s
                self.model_samples.append((t_s, {m: dict(s["targets"]) for m, s in models.items()},
                                           {m: dict(s["serving"]) for m, s in models.items()}))
                for model, state in models.items():
                    decision, seen = state.get("last_decision"), self.model_decisions.setdefault(model, [])
                    if decision and (not seen or seen[-1]["now_s"] != decision["now_s"]):
                        seen.append({**decision, "t_s": decision["now_s"] - self.start_s})


def make_workload(trace: TurnsTrace, shape: TurnsShape, names: Sequence[str], seed: int) -> Workload:
    """`benchmarks.planner.Workload` of `trace` (generated from `shape`): each request's body to its model,
    its prompt unique; one warm-up request per model, of the shape's median lengths."""
    import numpy as np

    from benchmarks.disagg import plain_word_ids
    from dynserve.model.resolve import default_model_path
    from dynserve.model.tokenizer import Tokenizer

    word_ids = np.array(plain_word_ids(Tokenizer.load(default_model_path())))
    rng = np.random.default_rng(seed)
    bodies = [completion_body(names[m], rng.choice(word_ids, r.input_length).tolist(), r.output_length)
              for r, m in zip(trace.requests, trace.model_indexes, strict=True)]
    # the warm-up's lengths are the trace's medians: a quiet model's planner predicts from the few lengths it
    # has seen, and the warm-up's are the first
    isl, osl = round(shape.isl.median), round(shape.osl.median)
    warm_up = [completion_body(name, rng.choice(word_ids, isl).tolist(), osl) for name in names]
    return Workload(list(trace.requests), bodies, warm_up, trace.duration_s)


@dataclass
class FleetRun:
    results: list[StreamedCompletion]
    ready_s: float
    replay_wall_s: float
    server_cpu_cores: float
    load_avg_1m_after: float | None = None  # the machine's, as the replay ended: other work shares the cores
    requeues: float | None = None  # requests handed back unstarted to a joining worker (the gateway's count)
    client_niceness: int | None = None  # the replay's (`client_priority`); None: the fleet's own
    pressure: list[dict[str, Any]] = field(default_factory=list)  # the machine's, a row a second
    samples: list[tuple[float, dict[str, dict[str, int]], dict[str, dict[str, int]]]] = field(default_factory=list)
    decisions: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def run_fleet(label: str, flags: list[str], workload: Workload, *, poll: bool, log_dir: Path) -> FleetRun:
    """A fresh `dynctl serve` with `flags`, a warm-up of every model, the replay (polling the planner when
    `poll`)."""
    started_s = time.monotonic()
    with dynctl_serve(f"multimodel-{label}", flags, log_dir=log_dir) as server:
        ready_s = time.monotonic() - started_s
        log(f"{label}: serving on port {server.port} after {ready_s:.0f} s; warming up every model")
        asyncio.run(warm_up(server.port, workload.warm_up_bodies))
        cpu_before_s, start_s = server.cpu_s(), time.monotonic()
        poller = ModelsPoller(server.port, start_s) if poll else contextlib.nullcontext()
        # the poller's and the sampler's threads start at the client's priority
        with client_priority() as niceness, poller, PressureSampler(start_s) as pressure:
            results = asyncio.run(replay(server.port, workload, 1.0, max(60.0, workload.duration_s / 2)))
        wall_s = time.monotonic() - start_s
        cpu_cores = (server.cpu_s() - cpu_before_s) / wall_s
        requeues = None
        with contextlib.suppress(OSError, ValueError):
            requeues = sum(scrape_counters(server.port, "dynserve_gateway_requeues_total").values())
        if any(r.error for r in results):
            log(f"{label}: {sum(bool(r.error) for r in results)} requests failed; the server's log ends:\n"
                f"{server.log_tail()}")
    run = FleetRun(results, ready_s, wall_s, cpu_cores, os.getloadavg()[0], requeues, niceness, pressure.rows)
    if isinstance(poller, ModelsPoller):
        run.samples, run.decisions = poller.model_samples, poller.model_decisions
    return run


def _common_summary(run: FleetRun, trace: TurnsTrace, names: Sequence[str], window_s: float) -> dict[str, Any]:
    """Attainment (overall, per model, per window), latencies, CPU and lag of one fleet's replay."""
    met_pairs = [SLO.met_by(r, 1.0) for r in run.results]
    met = [ttft_ok and itl_ok for ttft_ok, itl_ok in met_pairs]
    by_model = {name: attainment([ok for ok, m in zip(met, trace.model_indexes, strict=True) if m == i])
                for i, name in enumerate(names)}
    ttfts = [r.ttft_s * 1e3 for r in run.results if r.ttft_s is not None]
    itls = [r.mean_itl_s * 1e3 for r in run.results if r.mean_itl_s is not None]
    lags = [(r.sent_s - r.scheduled_s) * 1e3 for r in run.results if r.sent_s is not None]
    return {
        "attainment": attainment(met), "ttft_attainment": attainment([t for t, _ in met_pairs]),
        "itl_attainment": attainment([i for _, i in met_pairs]), "attainment_by_model": by_model,
        "attainment_by_window": attainment_by_window([r.timestamp_s for r in trace.requests], met, window_s,
                                                     trace.duration_s),
        "num_requests": len(met), "num_errors": sum(r.error is not None for r in run.results),
        "errors": sorted({r.error for r in run.results if r.error})[:5],
        "ttft_p50_ms": percentile(ttfts, 50), "ttft_p95_ms": percentile(ttfts, 95),
        "mean_itl_p50_ms": percentile(itls, 50), "mean_itl_p95_ms": percentile(itls, 95),
        "ttft_p95_ms_by_window": _by_window(
            trace, [None if r.ttft_s is None else r.ttft_s * 1e3 for r in run.results], window_s, 95),
        # the client's lateness by window: where it is high the machine, not the fleet, was behind
        "send_lag_p99_ms_by_window": _by_window(
            trace, [None if r.sent_s is None else (r.sent_s - r.scheduled_s) * 1e3 for r in run.results],
            window_s, 99),
        "send_lag_p99_real_ms": percentile(lags, 99), "server_cpu_cores": run.server_cpu_cores,
        "ready_s": run.ready_s, "replay_wall_s": run.replay_wall_s, "load_avg_1m_after": run.load_avg_1m_after,
        "num_missed": len(met) - sum(met), "requeues": run.requeues, "client_niceness": run.client_niceness,
        "num_missed_ttft": sum(not t for t, _ in met_pairs), "num_missed_itl": sum(not i for _, i in met_pairs),
        "pressure_by_second": run.pressure,
    }


def worst_windows(summary: Mapping[str, Any], window_s: float, count: int = 3) -> list[dict[str, Any]]:
    """The `count` windows of lowest attainment, each with its client's send lag (p99) and what the machine
    did in it (`_pressure.around`): whether a fleet's misses came with the cores, the disk or memory
    behind."""
    windows = [(a, w) for w, a in enumerate(summary["attainment_by_window"]) if a is not None]
    out = []
    for attained, w in sorted(windows)[:count]:
        out.append({"window": w, "attainment": attained,
                    "send_lag_p99_ms": summary["send_lag_p99_ms_by_window"][w],
                    **around(summary["pressure_by_second"], w * window_s, (w + 1) * window_s)})
    return out


def _by_window(trace: TurnsTrace, values_ms: Sequence[float | None], window_s: float, q: float
               ) -> list[float | None]:
    """The `q`th percentile of `values_ms` (one per request, None: none) of the requests arriving in each
    window of `window_s` (None: no value in the window)."""
    num_windows = max(1, math.ceil(trace.duration_s / window_s - 1e-9))
    by_window: list[list[float]] = [[] for _ in range(num_windows)]
    for request, value in zip(trace.requests, values_ms, strict=True):
        if value is not None:
            by_window[min(num_windows - 1, int(request.timestamp_s // window_s))].append(value)
    return [round(p, 1) if (p := percentile(values, q)) is not None else None for values in by_window]


def summarize_static(run: FleetRun, trace: TurnsTrace, names: Sequence[str], sizing: Sizing,
                     window_s: float) -> dict[str, Any]:
    summary = _common_summary(run, trace, names, window_s)
    summary["fleet_per_model"] = dict(sizing.static_fleet)
    summary["num_workers"] = sizing.static_workers
    summary["worker_s"] = sizing.static_workers * trace.duration_s
    return summary


def worker_starts(samples: Sequence[tuple[float, Mapping[str, Mapping[str, int]], Any]], names: Sequence[str],
                  bumps: Sequence[tuple[float, float]] = ()) -> tuple[dict[str, int], int]:
    """Per model, the workers its targets added from one polled sample to the next (each a worker start,
    whether or not it came to serve), and how many of all of them a model added outside its bump (`bumps`,
    by model index: its trickle's)."""
    by_model = dict.fromkeys(names, 0)
    outside = 0
    for (_, before, _), (t_s, after, _) in itertools.pairwise(samples):
        for m, name in enumerate(names):
            added = sum(max(0, n - before.get(name, {}).get(pool, n)) for pool, n in after.get(name, {}).items())
            by_model[name] += added
            if m < len(bumps) and not bumps[m][0] <= t_s <= bumps[m][1]:
                outside += added
    return by_model, outside


def summarize_planner(run: FleetRun, trace: TurnsTrace, names: Sequence[str], window_s: float,
                      bumps: Sequence[tuple[float, float]] = ()) -> dict[str, Any]:
    """`_common_summary`, and the planner's worker-seconds (all, and per model), scale events, worker starts
    (all, per model, and outside the models' `bumps`) and largest fleet per model, the samples and the
    decisions."""
    summary = _common_summary(run, trace, names, window_s)
    serving_by_model = {name: [(t_s, sum(serving.get(name, {}).values())) for t_s, _, serving in run.samples]
                        for name in names}
    worker_s_by_model = {name: worker_seconds(samples, 0.0, trace.duration_s)
                         for name, samples in serving_by_model.items()}
    summary["worker_s"] = sum(worker_s_by_model.values())
    summary["worker_s_by_model"] = worker_s_by_model
    summary["scale_events_by_model"] = {
        name: scale_events([targets.get(name, {}) for _, targets, _ in run.samples]) for name in names}
    starts_by_model, summary["worker_starts_outside_bumps"] = worker_starts(run.samples, names, bumps)
    summary["worker_starts_by_model"] = starts_by_model
    summary["worker_starts"] = sum(starts_by_model.values())
    summary["max_serving_by_model"] = {
        name: {pool: max((s.get(name, {}).get(pool, 0) for _, _, s in run.samples), default=0) for pool in POOLS}
        for name in names}
    summary["max_serving_total"] = max((sum(sum(p.values()) for p in s.values()) for _, _, s in run.samples),
                                       default=0)
    summary["num_samples"] = len(run.samples)
    summary["replicas"] = [[round(t_s, 2), targets, serving] for t_s, targets, serving in run.samples]
    summary["decisions"] = {
        name: [{k: d.get(k) for k in ("t_s", "targets", "reasons", "needs", "corrections", "predicted_rate_per_s",
                                      "predicted_isl", "predicted_osl", "horizon_s", "rising")}
               for d in decisions] for name, decisions in run.decisions.items()}
    return summary


def plot(path: Path, trace: TurnsTrace, names: Sequence[str], sizing: Sizing, static: Mapping[str, Any],
         planner: Mapping[str, Any], *, window_s: float) -> None:
    """Offered load per model; the planner's serving workers per model against the static fleet's; all
    workers together (planner stacked by model, static, the oracle on the sizing windows of `window_s`);
    attainment per window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    colors = plt.get_cmap("tab10")
    figure, (load_ax, model_ax, total_ax, attain_ax) = plt.subplots(4, 1, figsize=(12, 12), sharex=True)
    rates = rates_by_model(trace, LOAD_WINDOW_S)
    load_starts = [k * LOAD_WINDOW_S for k in range(len(rates[0]))]
    for i, name in enumerate(names):
        load_ax.step([*load_starts, trace.duration_s], [*rates[i], rates[i][-1]], where="post",
                     color=colors(i % 10), label=name)
    load_ax.set_ylabel(f"offered load (req/s, {LOAD_WINDOW_S:g} s windows)")
    load_ax.legend(fontsize="x-small", ncol=2, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    times = [t_s for t_s, *_ in planner["replicas"]]
    per_model = static["fleet_per_model"]
    model_ax.axhline(sum(per_model.values()), color="black", linestyle="--", linewidth=1.0,
                     label=f"static, each model ({per_model['prefill']} + {per_model['decode']})")
    stacked = []
    for i, name in enumerate(names):
        counts = [sum(serving.get(name, {}).values()) for _, _, serving in planner["replicas"]]
        stacked.append(counts)
        model_ax.step(times, counts, where="post", color=colors(i % 10), label=f"planner {name}")
    model_ax.set_ylabel("serving workers per model")
    model_ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    model_ax.legend(fontsize="x-small", ncol=2, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if times:
        total_ax.stackplot(times, stacked, colors=[colors(i % 10) for i in range(len(names))], step="post",
                           alpha=0.7)
    total_ax.axhline(static["num_workers"], color="black", linestyle="--",
                     label=f"static ({static['worker_s']:.0f} worker-s)")
    starts = [k * window_s for k in range(len(sizing.oracle_workers))]
    total_ax.step([*starts, trace.duration_s], [*sizing.oracle_workers, sizing.oracle_workers[-1]], where="post",
                  color="grey", linewidth=0.8,
                  label="the load's need (oracle)")
    total_ax.plot([], [], color="tab:blue", label=f"planner, stacked by model ({planner['worker_s']:.0f} worker-s)")
    total_ax.set_ylabel("serving workers, all models")
    total_ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    attain_window_s = trace.duration_s / len(static["attainment_by_window"])
    for fleet, summary, color in (("static", static, "black"), ("planner", planner, "tab:blue")):
        values = [math.nan if a is None else a for a in summary["attainment_by_window"]]
        attain_ax.step([k * attain_window_s for k in range(len(values) + 1)], [*values, values[-1]], where="post",
                       color=color, label=f"{fleet} ({summary['attainment']:.3f})")
    attain_ax.set_ylabel("attainment (TTFT and mean ITL)")
    attain_ax.set_ylim(-0.02, 1.02)
    attain_ax.set_xlabel("replay time (s)")
    attain_ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.suptitle(f"{len(names)} models taking turns: planner vs static, SLO TTFT {SLO.ttft_ms:g} ms, "
                    f"mean ITL {SLO.itl_ms:g} ms")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


# ---- the half ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TurnsPlan:
    """A run of the planner half: the trace's shape and the planner's clock (modelled seconds = wall
    seconds: the mockers run at speedup 1)."""

    shape: TurnsShape
    interval_s: float = 1.0  # the planner's decision interval
    down_delay_s: float = 10.0  # a lower need holds this long before a pool shrinks (3 s, three intervals,
    # took a pool down on a noisy read in the middle of its model's rise)
    # the planner's TTFT target under the 2 s SLO (the static fleet is sized at 1 s): it meets each rise with the
    # workers it has while the next one starts, so it keeps the queue shorter than a fleet sized for the peak
    planner_ttft_ms: float = 600.0
    window_s: float = 3.0  # its read window (2 s, with the 1 s scrape, read a busy model at under half its rate
    # in 14% of the decisions of a full run on a loaded machine)
    sizing_window_s: float = 10.0  # the static fleet carries each model's busiest window of this length
    attainment_window_s: float = 10.0
    # the planner's least prefill workers a model: one serves a trickle, the other is a spare that takes a
    # burst or the first step of a rise while the planner starts more. With a floor of 1, a full run started
    # about 54 workers (16-23 of them on trickles' blips), each about 1.4-2.9 s of CPU on the benchmark's 2
    # cores, and the client and the fleet fell behind around them (see docs/benchmarks.md, multimodel)
    prefill_floor: int = 2
    # the sla mode's rise spare (`--planner-rise-spare-workers`): the floor's second worker is a standing spare,
    # and in the what-if (`_multimodel_whatif`) the rise spare on top of it added 4.5 starts a replay, no miss
    # fewer
    rise_spare_workers: int = 0

    @property
    def floors(self) -> dict[str, int]:
        return {"prefill": self.prefill_floor, "decode": 1}


QUICK_TURNS = TurnsPlan(TurnsShape(num_models=3, phase_s=20.0, peak_rate_per_s=7.5, trickle_rate_per_s=0.3))
FULL_TURNS = TurnsPlan(TurnsShape(num_models=10, phase_s=30.0, peak_rate_per_s=7.5, trickle_rate_per_s=0.3))


def fleet_flags(plan: TurnsPlan, links: Sequence[Path], sizing: Sizing) -> dict[str, list[str]]:
    """Each fleet's `dynctl serve` flags: `benchmarks.planner.mode_flags` (the planner's bounded by the static
    fleet's pools) after the models, and the planner's shared budget."""
    from benchmarks.planner import PROFILE, mode_flags
    from benchmarks.planner_trace import Plan

    clock = Plan(duration_s=plan.shape.duration_s, peak_rate_per_s=plan.shape.peak_rate_per_s,
                 interval_s=plan.interval_s, window_s=plan.window_s)
    flags = mode_flags(clock, 1.0, {"peak": sizing.static_fleet}, PROFILE,  # the planner's max: the "peak" fleet
                       prefill_floor=plan.prefill_floor)
    models = [flag for link in links for flag in ("--model", str(link))]
    return {"static": [*models, *flags["peak"][0]],
            "planner": [*models, *flags["planner"][0], "--planner-max-total-workers", str(sizing.budget),
                        "--planner-down-delay-s", f"{plan.down_delay_s:g}", "--planner-ttft-ms",
                        f"{plan.planner_ttft_ms:g}", "--planner-rise-spare-workers", str(plan.rise_spare_workers)]}


def run_planner_half(plan: TurnsPlan, links: Sequence[Path], seed: int, log_dir: Path,
                     fleets: Sequence[str] = ("static", "planner"), *, png: Path | None = None) -> dict[str, Any]:
    """Generate the trace, size the fleets, replay it on each of `fleets` (in that order), and report; with
    both fleets run, draw `plot` at `png`."""
    from benchmarks.planner import PROFILE, SIZING
    from dynserve.planner import profile

    names = [link.name.split(".")[0] for link in links]
    trace = generate(plan.shape, seed)
    sizing = size_fleets(profile.shipped(PROFILE), trace, plan.sizing_window_s, ttft_target_s=SIZING.ttft_ms / 1000,
                         itl_target_s=SIZING.itl_ms / 1000,
                         busy_at_once=models_busy_at_once(plan.shape, plan.down_delay_s), floors=plan.floors)
    log(f"planner half: {len(trace.requests)} requests for {len(names)} models in {trace.duration_s:g} s; "
        f"static fleet {sizing.static_fleet} a model ({sizing.static_workers} workers), planner budget "
        f"{sizing.budget}, the load's need {min(sizing.oracle_workers)}-{max(sizing.oracle_workers)}")
    workload = make_workload(trace, plan.shape, names, seed)
    flags = fleet_flags(plan, links, sizing)
    summaries: dict[str, dict[str, Any]] = {}
    for label in fleets:
        log(f"{label}: replaying {trace.duration_s:.0f} s of models taking turns")
        run = run_fleet(label, flags[label], workload, poll=label == "planner", log_dir=log_dir)
        bumps = [bump_s(plan.shape, m) for m in range(len(names))]
        summary = (summarize_planner(run, trace, names, plan.attainment_window_s, bumps) if label == "planner"
                   else summarize_static(run, trace, names, sizing, plan.attainment_window_s))
        summary["flags"] = [f for f in flags[label] if not f.startswith("/")]
        summary["worst_windows"] = worst_windows(summary, plan.attainment_window_s)
        summaries[label] = summary
        log(f"{label}: attainment {summary['attainment']:.3f} (TTFT {summary['ttft_attainment']:.3f}, ITL "
            f"{summary['itl_attainment']:.3f}), {summary['worker_s']:.0f} worker-s, "
            f"{summary['server_cpu_cores']:.2f} cores, send lag p99 {summary['send_lag_p99_real_ms'] or 0:.0f} ms, "
            f"load average {summary['load_avg_1m_after']:.1f}, {summary['num_missed']} missed "
            f"({summary['num_missed_ttft']} TTFT, {summary['num_missed_itl']} mean ITL), "
            f"{summary['requeues']} requeued")
        for w in summary["worst_windows"]:
            log(f"{label}: window {w['from_s']:.0f}-{w['to_s']:.0f} s attained {w['attainment']:.2f}, send "
                f"lag p99 {w['send_lag_p99_ms'] or 0:.0f} ms; stalled on cpu {w['cpu_some_ms']} ms, io "
                f"{w['io_some_ms']} ms, memory {w['memory_some_ms']} ms; {w['major_faults']} major faults, "
                f"{w['new_tasks']} new tasks, busiest second {w['busy_cores_max']} cores")
    result = _half_result(plan, trace, sizing, summaries)
    result["png_planner"] = None
    if png is not None and "static" in summaries and "planner" in summaries:
        plot(png, trace, names, sizing, summaries["static"], summaries["planner"], window_s=plan.sizing_window_s)
        result["png_planner"] = str(png)
    return result


def _half_result(plan: TurnsPlan, trace: TurnsTrace, sizing: Sizing,
                 summaries: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    from dataclasses import asdict

    from benchmarks.planner import PROFILE, SIZING

    static, planner = summaries.get("static"), summaries.get("planner")
    oracle_s = sum(n * min(plan.sizing_window_s, trace.duration_s - k * plan.sizing_window_s)
                   for k, n in enumerate(sizing.oracle_workers))
    both = static is not None and planner is not None
    return {
        "plan": {**asdict(plan), "duration_s": trace.duration_s, "num_requests": len(trace.requests)},
        "mocker_profile": PROFILE, "speedup": 1.0,
        "slo": {"ttft_ms": SLO.ttft_ms, "itl_ms": SLO.itl_ms, "kind": "every request (TTFT, mean ITL)"},
        "sizing_targets": {"ttft_ms": SIZING.ttft_ms, "itl_ms": SIZING.itl_ms},
        "sizing": sizing.as_dict(),
        "worker_s_planner": planner["worker_s"] if planner else None,
        "worker_s_static": static["worker_s"] if static else None,
        "worker_s_oracle": oracle_s,
        "worker_s_ratio_planner_over_static": planner["worker_s"] / static["worker_s"] if both else None,
        "attainment_planner": planner["attainment"] if planner else None,
        "attainment_static": static["attainment"] if static else None,
        "attainment_planner_minus_static": planner["attainment"] - static["attainment"] if both else None,
        "scale_events_by_model": planner["scale_events_by_model"] if planner else None,
        "fleets": dict(summaries),
    }
