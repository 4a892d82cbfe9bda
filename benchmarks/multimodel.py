"""Several models behind one gateway, in two halves (issue 36). **Throughput**: does the gateway's per-request
cost grow with the number of models it serves? **Planner**: does a planner per model, sharing one budget,
serve models that take turns being busy with fewer workers than a static fleet sized for each model's peak?

## The throughput half

A fleet of 10 models with 1 mocker worker each, sent a Zipf mix of requests, against a fleet of 1 model with
10 mocker workers, sent the very same requests, in one run. Both fleets are a real `dynctl serve --mocker cpu
--mocker-speedup 1000` (gateway with its `kv` router in its own process, mocker workers as Ray actors, the
embedded event plane, a Ray instance each), both up together:

1. **one model**: `--model model-00 --workers 10`: one backend, one router choosing among 10 workers;
2. **10 models**: `--model model-00 ... --model model-09 --workers 1`: ten backends (dispatcher, router, KV
   index, tokenizer each), each with its one worker; each request's model drawn from a Zipf mix (exponent
   1: the hottest model takes 34% of the requests, the coldest 3.4%).

The models are symlinks, under distinct names in a temporary directory, to the bundled SmolLM2 GGUF: a
model's id is its file name up to the first dot, and a mocker reads only the tokenizer from it. At speedup
1000 a mocker's modelled step is a fraction of a millisecond, so the time that is measured is the serving
path (HTTP, chat template, tokenizer, routing, worker channel, detokenizing, SSE), as in
`benchmarks.frontend`; the two fleets have the same number of worker processes, so the machine's two cores
carry the same fleet in both.

The workload: 32 users (c=32), each on its own keep-alive connection, each sending its next streamed chat
completion when the last one's `[DONE]` arrives; short distinct prompts, outputs of 8..24 tokens. Both fleets
get the same prompts, lengths and order (`_multimodel_load.py`); the one-model fleet gets every request
under its one name. After a warm-up of each fleet (every model sent requests), 5 rounds of 3,000 fresh
requests, each round played on both fleets, the order turned round every round (one model first, then 10
models first, ...), so that the machine's drift hits both alike; the fleet not played sits idle (its idle
CPU, measured before the warm-up, is reported: `idle_cpu_percent`, % of one core).

Reported per fleet: `req_per_s` (the median of its rounds) and every round's, the latency (send to
`[DONE]`) p50/p90/p99 over all rounds, and the CPU each part spent per request: the gateway (the `dynctl
serve` process itself), the rest of the fleet (mockers, Ray, event plane) and this client. Then
`req_per_s_ratio_10_models_over_1` (the issue's target: >= 0.9, median of 3 full runs),
`latency_p50_added_ms` / `latency_p99_added_ms` (10 models minus 1) and `gateway_cpu_ratio_10_models_over_1`,
which the machine's phases move less than req/s.

## The planner half

**The trace** (`_multimodel_trace.py`): 10 models, each sent a trickle of 0.3 req/s plus a bump that rises
to 7.5 req/s over 30 s and falls back over the next 30 s, each model's bump starting as the one before it
peaks: at any time one model carries most of the load (two while they hand over) and the others a trickle;
11 phases, 330 s. Prompts lognormal around 2,800 tokens, answers around 140, every prompt its own, each
request to its model as a streamed completion of exactly its length. The mockers simulate Llama-3.1-70B on
4 H100s (`--mocker llama-3.1-70b-h100-tp4`, speedup 1: modelled time is wall time), disaggregated, as
`benchmarks.planner` runs them: long prompts and short answers, so that the prefill pool, the one that
scales most, needs 3 workers at a model's peak while the tokens streamed (what costs this machine's CPU)
stay near 1,200 a second.

**The fleets**, one after the other (static first), each a fresh `dynctl serve` (`_multimodel_planner.py`):

1. **static**: every model with the pools its own busiest 10 s window needs, by the planner's capacity math
   (`benchmarks.planner.fleet_for_rate` at the sizing targets, 1 s TTFT and 20 ms ITL, and the trace's mean
   ISL and OSL): 3 prefill + 2 decode at seed 0, 50 workers for 10 models. (Shorter windows size for
   Poisson noise: on 4 s windows seed 0's busiest model reads 12 req/s and every model would get 4 + 2.)
2. **planner**: every model from its floors, 2 prefill + 1 decode workers, `--planner --planner-mode sla`
   with the mocker profile's shipped capacity profile, the same targets and no rise spare, each model's
   pools bounded by [its floor, the static fleet's], all models within `--planner-max-total-workers`: what
   the planner's own floors and down delay hold while models overlap, plus 2 (38 at seed 0: three models busy
   at once, the rising one, the one falling from its peak and the one before it inside its 10 s down delay,
   each with the static fleet's 5 workers, and the other seven at their floors of 2 + 1). Until 2026-11-29
   the floors were 1 + 1 (budget 31) with the rise spare: a full run started about 54 workers, 16-23 of them
   on trickles' blips, each a process start costing 1.4-2.9 s of CPU on the 2 cores, and 3-15 requests a
   run missed where the static fleet's met theirs (docs/benchmarks.md); the second prefill worker a model
   takes a burst or a rise's first step without a start. The planner decides every second on a 3 s read
   window: at 2 s and 4 s
   (`benchmarks.planner`'s clock) it added a rising model's second prefill worker about 5 s after one
   worker stopped keeping up, and 4-7% of the requests missed the SLO where the static fleet's met it; a
   2 s window, with Prometheus scraping every second, read a busy model at under half its rate in 14% of
   the decisions of a full run on a loaded machine.

Why 10 models fit this 2-core machine: the fleets run one after the other, so it holds one at a time; 50
mockers idle at about 0.9 of a core (Ray included, Prometheus scraping each every second) and start in
about 70 s. Why 30 s: a busy phase long against the planner's reaction (a 3 s window, a decision every
second, a worker started in 2-5 s), and both fleets' replays, their starts and the throughput half
within about 15 minutes.

Each request is judged by `benchmarks.planner.SLO` (TTFT <= 2 s, mean ITL <= 25 ms). Reported:
`worker_s_planner` (serving workers integrated over the replay, from `GET /planner`'s `models` read every
0.5 s), `worker_s_static` (its size times the replay), `worker_s_ratio_planner_over_static` (the issue's
target: <= 0.7 at equal or better attainment), `worker_s_oracle` (every 10 s window's need, as if the
planner knew the load and workers started at once), `attainment_planner`, `attainment_static` and their
difference, `scale_events_by_model` (changes of each pool's target); under `planner_half`, per fleet:
attainment per model and per 10 s window, TTFT p95 per window, latency percentiles, the server's CPU, the
client's send lag; the planner's samples and decisions per model; and a PNG
(`benchmarks/results/multimodel-<timestamp>-planner.png`): offered load per model, the planner's workers per
model against the static fleet's, all workers (stacked by model, static, the oracle), attainment per window.

## Running it

`--quick` (about 4 minutes) serves 4 models in the throughput half (4 workers in both fleets, 3 rounds of
800 requests instead of 5 of 3,000; its ratio is `req_per_s_ratio_4_models_over_1`) and 3 models rising
over 20 s in the planner half (80 s a fleet). `--half throughput|planner|both` runs one half or both;
`--fleets` the planner half's fleets (one alone: the ratio is null); `--turn-models`, `--phase-s`,
`--planner-window-s`, `--planner-interval-s` change the planner half's plan; `--log-dir` keeps the servers'
logs. The full run takes about 15 minutes. The last stdout line is the JSON result; a copy goes to
`benchmarks/results/multimodel-<timestamp>.json`, the throughput half's PNG (req/s by round, latency
percentiles) beside it.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.multimodel [--quick] [--half throughput|planner|both]

The measurements and their history: `docs/benchmarks.md` (multimodel).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil

from benchmarks._common import RESULTS_DIR, git_commit, log, machine_info, percentile, write_result
from benchmarks._dynctl import DynctlServer, dynctl_serve
from benchmarks._multimodel_load import Workload, make_workload, play, zipf_weights
from benchmarks._multimodel_planner import FULL_TURNS, QUICK_TURNS, TurnsPlan, run_planner_half

SPEEDUP = 1000.0
CONCURRENCY = 32
ZIPF_EXPONENT = 1.0
MAX_TOKENS = (8, 24)
PROMPT_WORDS = (4, 24)


@dataclass(frozen=True)
class Plan:
    num_models: int  # the many-model fleet's models; the one-model fleet gets as many workers
    num_requests: int  # per round
    num_rounds: int
    num_warmup: int


FULL = Plan(num_models=10, num_requests=3000, num_rounds=5, num_warmup=320)
QUICK = Plan(num_models=4, num_requests=800, num_rounds=3, num_warmup=128)


def model_links(directory: Path, num_models: int) -> list[Path]:
    """`num_models` distinct model ids (`model-00`, ...): symlinks to the bundled SmolLM2 GGUF."""
    from dynserve.model.resolve import default_model_path

    target = default_model_path().resolve()
    links = []
    for i in range(num_models):
        link = directory / f"model-{i:02d}.gguf"
        link.symlink_to(target)
        links.append(link)
    return links


def fleet_flags(links: list[Path], *, num_models: int) -> list[str]:
    """`dynctl serve` flags for the first `num_models` of `links`, with as many workers in all as links."""
    per_model = len(links) // num_models
    models = [flag for link in links[:num_models] for flag in ("--model", str(link))]
    return [*models, "--workers", str(per_model), "--mocker", "cpu", "--mocker-speedup", f"{SPEEDUP:g}"]


def _process_cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def _round(server: DynctlServer, workload: Workload, names: list[str]) -> dict[str, Any]:
    """One round of `workload` against `server`: req/s, latencies and CPU per request by part."""
    import uvloop

    bodies = workload.bodies(names)
    gateway_before_s, stack_before_s, client_before_s = (_process_cpu_s(server.process.pid), server.cpu_s(),
                                                         time.process_time())
    result = uvloop.run(play(server.port, bodies, workload.max_tokens, CONCURRENCY))
    gateway_s = _process_cpu_s(server.process.pid) - gateway_before_s
    fleet_s = server.cpu_s() - stack_before_s - gateway_s
    client_s = time.process_time() - client_before_s
    per_request_ms = 1000 / workload.num_requests
    return {
        "req_per_s": workload.num_requests / result.wall_s, "wall_s": result.wall_s,
        "latency_ms": [1000 * s for s in result.latency_s],
        "cpu_ms_per_request": {"gateway": gateway_s * per_request_ms, "fleet": fleet_s * per_request_ms,
                               "client": client_s * per_request_ms},
    }


def _idle_cpu_percent(server: DynctlServer, window_s: float = 2.0) -> float:
    """The CPU a whole fleet (gateway, mockers, Ray) uses while nothing is sent, in % of one core."""
    before_s = server.cpu_s()
    time.sleep(window_s)
    return 100 * (server.cpu_s() - before_s) / window_s


def summarize(num_models: int, start_s: float, idle_cpu_percent: float, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    latency_ms = [ms for r in rounds for ms in r["latency_ms"]]
    return {
        "num_models": num_models, "start_s": round(start_s, 1), "idle_cpu_percent": round(idle_cpu_percent, 1),
        "req_per_s": statistics.median(r["req_per_s"] for r in rounds),
        "req_per_s_rounds": [round(r["req_per_s"], 1) for r in rounds],
        "latency_p50_ms": percentile(latency_ms, 50), "latency_p90_ms": percentile(latency_ms, 90),
        "latency_p99_ms": percentile(latency_ms, 99),
        "cpu_ms_per_request": {part: statistics.median(r["cpu_ms_per_request"][part] for r in rounds)
                               for part in ("gateway", "fleet", "client")},
        "gateway_cpu_ms_per_request_rounds": [round(r["cpu_ms_per_request"]["gateway"], 3) for r in rounds],
    }


def run_fleets(fleets: dict[str, tuple[list[str], list[str]]], plan: Plan, seed: int,
               log_dir: Path) -> dict[str, dict[str, Any]]:
    """Start every fleet (label -> (flags, model names)), warm each up (every model, uniform mix), then play
    the rounds, each round on every fleet, the order turned round each time so that the machine's drift hits
    them alike (the fleet not played sits idle); each fleet's summary."""
    servers: dict[str, DynctlServer] = {}
    start_s: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        for label, (flags, names) in fleets.items():
            log(f"{label}: starting {' '.join(flags[-6:])} for {len(names)} model(s)")
            started_s = time.monotonic()
            servers[label] = stack.enter_context(dynctl_serve(label, flags, log_dir=log_dir))
            start_s[label] = time.monotonic() - started_s
            log(f"{label}: serving after {start_s[label]:.0f} s")
        idle = {label: _idle_cpu_percent(server) for label, server in servers.items()}
        warmup = make_workload(plan.num_warmup, plan.num_models, exponent=0.0, max_tokens=MAX_TOKENS,
                               prompt_words=PROMPT_WORDS, seed=seed + 1000)
        for label, server in servers.items():
            _round(server, warmup, fleets[label][1])
        rounds: dict[str, list[dict[str, Any]]] = {label: [] for label in fleets}
        for r in range(plan.num_rounds):
            workload = round_workload(plan, seed + r)
            labels = list(fleets) if r % 2 == 0 else list(reversed(fleets))
            for label in labels:
                rounds[label].append(_round(servers[label], workload, fleets[label][1]))
                done = rounds[label][-1]
                log(f"{label}: round {r + 1}/{plan.num_rounds}: {done['req_per_s']:.0f} req/s, gateway "
                    f"{done['cpu_ms_per_request']['gateway']:.3f} ms CPU a request")
    return {label: summarize(len(fleets[label][1]), start_s[label], idle[label], rounds[label])
            for label in fleets}


def round_workload(plan: Plan, seed: int) -> Workload:
    return make_workload(plan.num_requests, plan.num_models, exponent=ZIPF_EXPONENT, max_tokens=MAX_TOKENS,
                         prompt_words=PROMPT_WORDS, seed=seed)


def plot(path: Path, one: dict[str, Any], many: dict[str, Any]) -> None:
    """req/s by round (and the medians), and the latency percentiles, of both fleets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"1 model x {many['num_models']} workers", f"{many['num_models']} models x 1 worker"]
    colors = ["tab:blue", "tab:orange"]
    figure, (rate_ax, latency_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    for x, (fleet, color) in enumerate(zip((one, many), colors, strict=True)):
        rate_ax.bar(x, fleet["req_per_s"], color=color, alpha=0.5)
        rate_ax.scatter([x] * len(fleet["req_per_s_rounds"]), fleet["req_per_s_rounds"], color=color, zorder=3)
    rate_ax.set_xticks([0, 1], labels)
    rate_ax.set_ylabel(f"req/s at c={CONCURRENCY} (bar: median; dots: rounds)")
    for offset, (fleet, color, label) in enumerate(zip((one, many), colors, labels, strict=True)):
        values = [fleet[f"latency_p{q}_ms"] for q in (50, 90, 99)]
        latency_ax.bar([i + 0.38 * offset for i in range(3)], values, width=0.38, color=color, label=label)
    latency_ax.set_xticks([0.19, 1.19, 2.19], ["p50", "p90", "p99"])
    latency_ax.set_ylabel("request latency to [DONE] (ms)")
    latency_ax.legend(fontsize="small")
    figure.suptitle(f"one gateway, 1 vs {many['num_models']} models (Zipf mix), mocker cpu x{SPEEDUP:g}")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.multimodel", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="4 models, 3 rounds of 800 requests; 3 models taking turns (about 5 minutes)")
    parser.add_argument("--half", choices=("throughput", "planner", "both"), default="both",
                        help="run the throughput half, the planner half, or both [default: both]")
    parser.add_argument("--fleets", nargs="+", choices=("static", "planner"), default=["static", "planner"],
                        help="the planner half's fleets, in this order (one alone: the ratio is null)")
    parser.add_argument("--turn-models", type=int, default=None,
                        help="the planner half's models [default: the plan's, 3 quick, 10 full]")
    parser.add_argument("--phase-s", type=float, default=None,
                        help="the planner half's rise (and fall) of each model, seconds [default: the plan's]")
    parser.add_argument("--planner-window-s", type=float, default=None,
                        help="the planner's read window, seconds [default: the plan's]")
    parser.add_argument("--planner-interval-s", type=float, default=None,
                        help="the planner's decision interval, seconds [default: the plan's]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="keep the servers' logs here [default: a temporary directory, removed]")
    return parser.parse_args(argv)


def throughput_half(plan: Plan, seed: int, temp: Path, log_dir: Path) -> tuple[dict[str, Any], Any]:
    """The 1-model and N-model fleets' rounds: the result's fields, and a function drawing their PNG."""
    links = model_links(temp, plan.num_models)
    names = [link.name.split(".")[0] for link in links]
    fleets = {"one_model": (fleet_flags(links, num_models=1), names[:1]),
              f"{plan.num_models}_models": (fleet_flags(links, num_models=plan.num_models), names)}
    summaries = run_fleets(fleets, plan, seed, log_dir)
    n = plan.num_models
    one, many = summaries["one_model"], summaries[f"{n}_models"]
    ratio = many["req_per_s"] / one["req_per_s"]
    mix = round_workload(plan, seed)
    fields = {
        "concurrency": CONCURRENCY, "mocker": {"profile": "cpu", "speedup": SPEEDUP},
        "workload": {"requests_per_round": plan.num_requests, "rounds": plan.num_rounds, "warmup": plan.num_warmup,
                     "max_tokens": MAX_TOKENS, "prompt_words": PROMPT_WORDS, "zipf_exponent": ZIPF_EXPONENT,
                     "zipf_weights": [round(w, 4) for w in zipf_weights(n, ZIPF_EXPONENT)],
                     "share_by_model_round_1": [round(s, 4) for s in mix.share_by_model(n)]},
        "one_model": one, f"{n}_models": many,
        "req_per_s_ratio": ratio, f"req_per_s_ratio_{n}_models_over_1": ratio,
        "latency_p50_added_ms": many["latency_p50_ms"] - one["latency_p50_ms"],
        "latency_p99_added_ms": many["latency_p99_ms"] - one["latency_p99_ms"],
        f"gateway_cpu_ratio_{n}_models_over_1": many["cpu_ms_per_request"]["gateway"]
        / one["cpu_ms_per_request"]["gateway"],
    }
    return fields, lambda path: plot(path, one, many)


def planner_half(turns: TurnsPlan, seed: int, temp: Path, log_dir: Path, fleets: list[str],
                 png: Path) -> dict[str, Any]:
    """The static and the planner's fleet on the models-taking-turns trace: the result's fields (the
    planner half's figures at the top, the rest under `planner_half`); its PNG at `png` when both ran."""
    links = model_links(temp, turns.shape.num_models)
    half = run_planner_half(turns, links, seed, log_dir, fleets, png=png)
    top = ("worker_s_ratio_planner_over_static", "worker_s_planner", "worker_s_static", "worker_s_oracle",
           "attainment_planner", "attainment_static", "attainment_planner_minus_static", "scale_events_by_model",
           "png_planner")
    fields = {key: half.pop(key) for key in top}
    return {**fields, "planner_half": half}


def turns_plan(args: argparse.Namespace) -> TurnsPlan:
    """The planner half's plan: the quick or full one, with what the flags change."""
    turns = QUICK_TURNS if args.quick else FULL_TURNS
    shape = replace(turns.shape, num_models=args.turn_models or turns.shape.num_models,
                    phase_s=args.phase_s or turns.shape.phase_s)
    return replace(turns, shape=shape, window_s=args.planner_window_s or turns.window_s,
                   interval_s=args.planner_interval_s or turns.interval_s)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    plan = QUICK if args.quick else FULL
    turns = turns_plan(args)
    output = args.output or RESULTS_DIR / f"multimodel-{time.strftime('%Y%m%d-%H%M%S')}.json"
    start_s = time.monotonic()
    load_avg_before = os.getloadavg()[0]
    result: dict[str, Any] = {
        "benchmark": "multimodel", "quick": args.quick, "half": args.half, "seed": args.seed, "commit": git_commit(),
        "machine": {**machine_info(), "load_avg_1m_before": load_avg_before},
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    draw_throughput = None
    with tempfile.TemporaryDirectory(prefix="multimodel-") as temp:
        log_dir = args.log_dir or Path(temp)
        log_dir.mkdir(parents=True, exist_ok=True)
        if args.half in ("throughput", "both"):
            fields, draw_throughput = throughput_half(plan, args.seed, Path(temp), log_dir)
            result.update(fields)
        if args.half in ("planner", "both"):
            turns_dir = Path(temp) / "turns"
            turns_dir.mkdir()
            result.update(planner_half(turns, args.seed, turns_dir, log_dir, args.fleets,
                                       output.with_name(f"{output.stem}-planner.png")))
        else:
            result.update(worker_s_ratio_planner_over_static=None,
                          worker_s_ratio_planner_over_static_reason="the planner half was not run (--half)")
    result["wall_s"] = round(time.monotonic() - start_s, 1)
    if draw_throughput is not None:
        draw_throughput(output.with_suffix(".png"))
        result["png"] = str(output.with_suffix(".png"))
    write_result("multimodel", result, output)
    return result


if __name__ == "__main__":
    main()
