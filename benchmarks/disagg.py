"""Disaggregated prefill/decode against aggregated serving: goodput under TTFT and ITL targets on simulated
H100s, and the same two modes on the real model on this CPU.

**Mocker part.** `dynctl serve --mocker llama-3.1-70b-h100-tp4 --mocker-speedup 2`: four workers, each a
simulated Llama-3.1-70B on four H100s (`dynserve/workers/mocker_profiles.py`), served two ways, one after
the other, each on a fresh server, both with the kv router and the gateway's defaults otherwise:

1. **disagg**: `--prefill-workers 2 --decode-workers 2`: a prompt prefills on a prefill worker, its KV moves
   to a decode worker, which streams the answer (the gateway still prefills a prompt on the decode worker
   while the prefill workers have `--disagg-max-prefill-queue`, default 2, requests each queued or running);
2. **agg**: `--workers 4`, each worker prefilling and decoding (chunked prefill, up to 8,192 tokens a step).

Workload (fixed seed): prompts of exactly 3,000 token ids drawn at random from the vocabulary's plain words,
unique per request (no two share even a first block: the prefix cache never helps), 150 output tokens
(`ignore_eos`), streamed from `/v1/completions`. At each rate, requests arrive as a Poisson process for a
window; those of its first seconds (the ramp) load the servers but are not counted, so a rate is judged
at its steady state. Both modes play the same requests at the same moments. Arrivals follow the mockers'
clock (a rate of 4 req/s is 4 per modelled second, 8 per real second at speedup 2), and every time
reported is modelled (the client's measurement times the speedup) unless its name ends in `_real_ms`.

Targets, per request, in modelled time (the client checks them divided by the speedup):
- **TTFT <= 1,000 ms**, which leaves room for a few prompts queued ahead of a lone prompt's prefill and its
  KV's move to a decode worker.
- **ITL <= 25 ms**, the mean inter-token latency of the request ((last token - first token) / 149, vLLM's
  TPOT), i.e. 40 tokens/s per user: an interactive target, where the speed of the stream is what the user
  (or the agent reading it) waits on. A worker that only decodes meets it at any batch it holds; a step
  that also prefills a 3,000-token prompt takes 262-272 ms, and every sequence decoding in it waits that
  long for its next token. So in agg mode each prompt that lands on a worker stalls that worker's decodes
  once, and the mean ITL grows with the rate; decode workers of the disagg mode only decode, at the price
  of only two of the four workers prefilling. Every run also reports the goodputs at ITL targets of 20,
  25, 30, 40, 50 and 100 ms (`goodput_by_itl_target`); `--slo-itl-ms 50` plays the earlier target.

Goodput at a rate is the rate x the fraction of its counted requests that completed within both targets
(requests per modelled second meeting both). A mode's goodput (`goodput_disagg`, `goodput_agg`) is its
best over the rates played, `goodput_ratio` disagg over agg; `max_rate_at_goal_*` is the highest rate at
which 90% met both (DistServe's goodput); `past_knee_*` false means even the highest rate met the goal, so
that mode's goodput is only a lower bound. Per rate: TTFT and mean-ITL percentiles, per-token ITL
percentiles (the p99 shows agg's stalls, which a mean spreads out), how late the client sent requests
(`send_lag_p99_real_ms`; past 50 ms the run warns that the machine was too busy to trust that rate, as
when another benchmark or the test suite runs beside it; `send_lag_p99_real_ms_max` is the worst rate's),
the server's CPU cores, and for disagg the gateway's `dynserve_disagg_requests_total{path}` and
`dynserve_disagg_fallbacks_total{reason}` over the rate (`disagg_requests`, `disagg_fallbacks`: totals).

**Real-model part.** `dynctl serve` with SmolLM2-135M on this CPU, one torch thread per worker in both modes
so a step costs the same: `--workers 1` (agg), then `--prefill-workers 1 --decode-workers 1
--disagg-local-prefill-tokens 0` (disagg: every prompt prefilled remotely, KV pages moved by NIXL over UCX,
`UCX_TLS=cma,tcp,self UCX_NET_DEVICES=lo`). A few greedy prompts of a few hundred tokens, one at a time:
TTFT p50 and ITL p50 per mode (wall-clock ms) and `outputs_identical`, every output text equal in the two.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.disagg [--quick]

The last stdout line is the JSON result; a copy goes to `benchmarks/results/disagg-<timestamp>.json`.
`--quick` plays rates 4, 6 and 8 for 10 modelled seconds each (3 of ramp) and 3 real prompts; its windows
are too short for queues to build up fully, so past a knee its goodputs come out higher than the full
run's. The full run plays 2 to 12 req/s for 25 s each (5 of ramp) and 8 real prompts. `--rates`,
`--prefill-workers`, `--decode-workers` and the `--slo-*` flags change the experiment; the defaults are the
acceptance one. Near its ceiling a mode's goodput swings from run to run (Poisson bursts stall some workers
more than others), and with it the ratio: compare the median of 3 runs.

What the profile allows each mode at each ITL target (worked out from its step times), the measurements at
this target and the earlier one, and their history: `docs/benchmarks.md` (disagg).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks._common import git_commit, log, machine_info, percentile, write_result
from benchmarks._dynctl import DynctlServer, dynctl_serve, scrape_counters
from benchmarks._goodput import ATTAINMENT_GOAL, Slo, goodput_by_itl_target, summarize_mode, summarize_rate
from benchmarks._streaming import StreamedCompletion, completion_body, stream_completion
from dynserve.model.resolve import default_model_path, model_id_of
from dynserve.model.tokenizer import Tokenizer

PROFILE = "llama-3.1-70b-h100-tp4"
NUM_WORKERS = 4
PROMPT_TOKENS = 3000
OUTPUT_TOKENS = 150
SLO = Slo(ttft_ms=1000.0, itl_ms=25.0)
NUM_WARM_UP = 4
WARM_UP_TOKENS = 8
REAL_UCX_ENV = {"UCX_TLS": "cma,tcp,self", "UCX_NET_DEVICES": "lo"}
LATE_SEND_MS = 50.0  # a client this late (p99, real ms) behind its schedule was starved of CPU


@dataclass(frozen=True)
class Plan:
    rates_per_s: tuple[float, ...]  # modelled requests per second, played in this order
    window_s: float  # modelled seconds of arrivals per rate
    ramp_s: float  # the first part of the window, whose requests load the servers but are not counted
    num_real_prompts: int
    real_prompt_tokens: int
    real_max_tokens: int


FULL_PLAN = Plan(rates_per_s=(2.0, 4.0, 6.0, 8.0, 10.0, 12.0), window_s=25.0, ramp_s=5.0,
                 num_real_prompts=8, real_prompt_tokens=300, real_max_tokens=32)
QUICK_PLAN = Plan(rates_per_s=(4.0, 6.0, 8.0), window_s=10.0, ramp_s=3.0, num_real_prompts=3,
                  real_prompt_tokens=200, real_max_tokens=12)


# ---- the workload ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RatePhase:
    rate_per_s: float
    arrivals_s: list[float]  # modelled offsets from the phase's start
    prompts: list[list[int]]
    num_ramp: int  # the first requests, sent during the ramp: not counted


def plain_word_ids(tokenizer: Tokenizer) -> list[int]:
    """Token ids that are a space and two or more ASCII letters: prompts of them read as (odd) text."""
    specials = tokenizer.special_token_ids
    return [i for i in range(tokenizer.vocab_size)
            if i not in specials and _is_plain_word(tokenizer.token_bytes(i))]


def _is_plain_word(raw: bytes) -> bool:
    return len(raw) >= 3 and raw[:1] == b" " and raw[1:].isalpha() and raw[1:].isascii()


def random_prompts(word_ids: list[int], num_prompts: int, num_tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.choice(word_ids) for _ in range(num_tokens)] for _ in range(num_prompts)]


def make_phases(plan: Plan, word_ids: list[int], seed: int) -> list[RatePhase]:
    """Per rate: rate x window Poisson arrivals (the first rate x ramp of them the ramp) and as many unique
    prompts, each rate seeded on its own."""
    phases = []
    for index, rate in enumerate(plan.rates_per_s):
        rng = random.Random(seed * 1000 + index)
        num_requests = max(1, round(rate * plan.window_s))
        arrivals_s, now_s = [], 0.0
        for _ in range(num_requests):
            arrivals_s.append(now_s)
            now_s += rng.expovariate(rate)
        prompts = random_prompts(word_ids, num_requests, PROMPT_TOKENS, seed * 1000 + 500 + index)
        num_ramp = min(round(rate * plan.ramp_s), num_requests - 1)
        phases.append(RatePhase(rate, arrivals_s, prompts, num_ramp))
    return phases


# ---- one mode on the mockers -------------------------------------------------------------------------------


async def _play(port: int, model: str, phase: RatePhase, speedup: float,
                timeout_s: float) -> list[StreamedCompletion]:
    """Send the phase's requests at their arrival times (on the mockers' clock) and read every stream."""
    bodies = [completion_body(model, prompt, OUTPUT_TOKENS) for prompt in phase.prompts]  # before the clock
    start_s = time.monotonic() + 0.1  # time to start every task before the first is due

    async def one(offset_s: float, body: bytes) -> StreamedCompletion:
        scheduled_s = start_s + offset_s / speedup
        await asyncio.sleep(max(0.0, scheduled_s - time.monotonic()))
        return await stream_completion(port, body, scheduled_s=scheduled_s, timeout_s=timeout_s)

    return await asyncio.gather(*(one(t, b) for t, b in zip(phase.arrivals_s, bodies, strict=True)))


async def _warm_up(port: int, model: str, prompts: list[list[int]], max_tokens: int) -> None:
    """Short requests, side by side, with prompts the measurement never uses: first-use costs stay out."""
    results = await asyncio.gather(*(stream_completion(port, completion_body(model, p, max_tokens))
                                     for p in prompts))
    failed = [r.error for r in results if r.error is not None]
    if failed:
        raise RuntimeError(f"warm-up request(s) failed: {failed}")


def _disagg_counts(port: int) -> dict[str, float]:
    """The gateway's disaggregation counters: `requests{path=...}`, `fallbacks{reason=...}`."""
    samples = scrape_counters(port, "dynserve_disagg_")
    return {name.removeprefix("dynserve_disagg_").replace("_total{", "{"): value
            for name, value in samples.items() if "_total{" in name}


def run_mocker_mode(mode: str, flags: list[str], phases: list[RatePhase], warm_up: list[list[int]], *,
                    slo: Slo, speedup: float, log_dir: Path) -> dict[str, Any]:
    """A fresh `dynctl serve` with `flags`, a warm-up, then every rate in turn; the mode's summary."""
    started_s = time.monotonic()
    with dynctl_serve(f"mocker-{mode}", flags, log_dir=log_dir) as server:
        ready_s = time.monotonic() - started_s
        log(f"{mode}: serving on port {server.port} after {ready_s:.1f} s")
        model = _model_id()
        asyncio.run(_warm_up(server.port, model, warm_up, WARM_UP_TOKENS))
        rates = [_run_rate(mode, server, model, phase, slo=slo, speedup=speedup) for phase in phases]
    return {"flags": flags, "ready_s": ready_s, **summarize_mode(rates), "rates": rates}


def _run_rate(mode: str, server: DynctlServer, model: str, phase: RatePhase, *, slo: Slo,
              speedup: float) -> dict[str, Any]:
    timeout_s = max(60.0, 20.0 * phase.arrivals_s[-1] / speedup)
    counts_before = _disagg_counts(server.port)
    cpu_before_s, start_s = server.cpu_s(), time.monotonic()
    results = asyncio.run(_play(server.port, model, phase, speedup, timeout_s))
    wall_s = time.monotonic() - start_s
    cpu_cores = (server.cpu_s() - cpu_before_s) / wall_s
    counts_after = _disagg_counts(server.port)
    summary = summarize_rate(phase.rate_per_s, results[phase.num_ramp:], slo, speedup)
    ramp_errors = [r.error for r in results[: phase.num_ramp] if r.error is not None]
    summary.update(num_ramp_requests=phase.num_ramp, num_ramp_errors=len(ramp_errors), wall_real_s=wall_s,
                   server_cpu_cores=cpu_cores, load_avg_1m=os.getloadavg()[0])
    counts = {k: v - counts_before.get(k, 0.0) for k, v in counts_after.items() if v != counts_before.get(k)}
    if counts_after:
        summary["disagg_counts"] = counts
    if summary["errors"] or ramp_errors:  # what the server said about them
        summary["server_log_tail"] = server.log_tail()
        log(f"{mode} @ {phase.rate_per_s:g}/s: requests failed ({(summary['errors'] or ramp_errors)[:3]}); "
            f"the server's log ends:\n{summary['server_log_tail']}")
    lag_ms = summary["send_lag_p99_real_ms"] or 0.0
    if lag_ms > LATE_SEND_MS:
        log(f"{mode} @ {phase.rate_per_s:g}/s: the client sent requests up to {lag_ms:.0f} ms late "
            f"(load average {summary['load_avg_1m']:.1f}): the machine was too busy to trust this rate")
    log(f"{mode} @ {phase.rate_per_s:g}/s: goodput {summary['goodput_per_s']:.2f}/s "
        f"({summary['num_good']}/{summary['num_requests']} met both; TTFT {summary['num_ttft_met']}, "
        f"ITL {summary['num_itl_met']}); TTFT p50 {_ms(summary['ttft_p50_ms'])}, mean ITL p50 "
        f"{_ms(summary['mean_itl_p50_ms'])}, ITL p99 {_ms(summary['itl_p99_ms'])}; {cpu_cores:.2f} cores, "
        f"{wall_s:.1f} s" + (f"; {counts}" if counts_after else ""))
    return summary


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


# ---- the real model on this CPU ----------------------------------------------------------------------------


def run_real_mode(mode: str, flags: list[str], prompts: list[list[int]], max_tokens: int,
                  log_dir: Path) -> dict[str, Any]:
    """A fresh `dynctl serve` on the real model; a warm-up, then the prompts one at a time, greedy."""
    started_s = time.monotonic()
    with dynctl_serve(f"real-{mode}", flags, log_dir=log_dir, env=REAL_UCX_ENV) as server:
        ready_s = time.monotonic() - started_s
        log(f"real {mode}: serving on port {server.port} after {ready_s:.1f} s")
        model = _model_id()

        async def run_all() -> list[StreamedCompletion]:
            await _warm_up(server.port, model, [prompts[0][: len(prompts[0]) // 2]], 4)
            return [await stream_completion(server.port, completion_body(model, prompt, max_tokens))
                    for prompt in prompts]

        results = asyncio.run(run_all())
        counts = _disagg_counts(server.port)
    failed = [r.error for r in results if r.error is not None]
    if failed:
        raise RuntimeError(f"real {mode}: {len(failed)} request(s) failed: {failed[:3]}")
    ttfts = [r.ttft_s * 1e3 for r in results if r.ttft_s is not None]
    itls = [gap * 1e3 for r in results for gap in r.itls_s()]
    summary: dict[str, Any] = {
        "flags": flags, "ready_s": ready_s, "num_prompts": len(prompts), "max_tokens": max_tokens,
        "ttft_p50_ms": percentile(ttfts, 50), "itl_p50_ms": percentile(itls, 50),
        "itl_p90_ms": percentile(itls, 90), "texts": [r.text for r in results]}
    if counts:
        summary["disagg_counts"] = counts  # the warm-up request included
    log(f"real {mode}: TTFT p50 {_ms(summary['ttft_p50_ms'])}, ITL p50 {summary['itl_p50_ms']:.1f} ms"
        + (f"; {counts}" if counts else ""))
    return summary


# ---- main --------------------------------------------------------------------------------------------------


def _model_id() -> str:
    return model_id_of(default_model_path())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.disagg", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="3 rates for 10 modelled s each, 3 real prompts (about 2 minutes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--speedup", type=float, default=2.0,
                        help="the mockers' speedup, which arrivals and targets follow [default: 2]")
    parser.add_argument("--rates", type=float, nargs="+", default=None,
                        help="modelled requests/s to play, in order [default: the plan's]")
    parser.add_argument("--slo-ttft-ms", type=float, default=SLO.ttft_ms,
                        help=f"modelled TTFT target [default: {SLO.ttft_ms:g}]")
    parser.add_argument("--slo-itl-ms", type=float, default=SLO.itl_ms,
                        help=f"modelled mean inter-token latency target [default: {SLO.itl_ms:g}]")
    parser.add_argument("--prefill-workers", type=int, default=NUM_WORKERS // 2,
                        help="disagg mode's prefill workers; agg mode gets prefill + decode workers")
    parser.add_argument("--decode-workers", type=int, default=NUM_WORKERS // 2,
                        help="disagg mode's decode workers")
    parser.add_argument("--skip-real", action="store_true",
                        help="leave out the real-model part (outputs_identical is then null)")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.prefill_workers < 1 or args.decode_workers < 1:
        parser.error("--prefill-workers and --decode-workers must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    plan = QUICK_PLAN if args.quick else FULL_PLAN
    if args.rates:
        plan = replace(plan, rates_per_s=tuple(args.rates))
    slo = Slo(args.slo_ttft_ms, args.slo_itl_ms)
    word_ids = plain_word_ids(Tokenizer.load(default_model_path()))
    phases = make_phases(plan, word_ids, args.seed)
    warm_up = random_prompts(word_ids, NUM_WARM_UP, PROMPT_TOKENS, args.seed * 1000 + 999)
    mocker = ["--mocker", PROFILE, "--mocker-speedup", f"{args.speedup:g}", "--router", "kv"]
    layouts = {"disagg": [*mocker, "--prefill-workers", str(args.prefill_workers),
                          "--decode-workers", str(args.decode_workers)],
               "agg": [*mocker, "--workers", str(args.prefill_workers + args.decode_workers)]}
    log(f"rates {', '.join(f'{r:g}' for r in plan.rates_per_s)} req/s, {plan.window_s:g} modelled s each "
        f"(the first {plan.ramp_s:g} s not counted), speedup {args.speedup:g}; "
        f"targets TTFT <= {slo.ttft_ms:g} ms, mean ITL <= {slo.itl_ms:g} ms "
        f"(on the client: {slo.ttft_ms / args.speedup:g} and {slo.itl_ms / args.speedup:g} ms)")
    start_s = time.monotonic()
    modes: dict[str, Any] = {}
    real: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="disagg-bench-") as tmp:
        log_dir = Path(tmp)
        for mode, flags in layouts.items():
            modes[mode] = run_mocker_mode(mode, flags, phases, warm_up, slo=slo, speedup=args.speedup,
                                          log_dir=log_dir)
        if not args.skip_real:
            prompts = random_prompts(word_ids, plan.num_real_prompts, plan.real_prompt_tokens, args.seed + 7)
            one_thread = ["--num-threads", "1"]
            real_layouts = {"agg": ["--workers", "1", *one_thread],
                            "disagg": ["--prefill-workers", "1", "--decode-workers", "1",
                                       "--disagg-local-prefill-tokens", "0", *one_thread]}
            for mode, flags in real_layouts.items():
                real[mode] = run_real_mode(mode, flags, prompts, plan.real_max_tokens, log_dir)
    result = _result(args, plan, slo, modes, real)
    result["wall_s"] = time.monotonic() - start_s
    write_result("disagg", result, args.output)
    return result


def _result(args: argparse.Namespace, plan: Plan, slo: Slo, modes: dict[str, Any],
            real: dict[str, Any]) -> dict[str, Any]:
    disagg, agg = modes["disagg"], modes["agg"]
    counts: dict[str, float] = {}
    for rate in disagg["rates"]:
        for name, value in rate.get("disagg_counts", {}).items():
            counts[name] = counts.get(name, 0.0) + value
    result: dict[str, Any] = {
        "benchmark": "disagg", "quick": args.quick, "seed": args.seed, "commit": git_commit(),
        "machine": machine_info(), "profile": PROFILE, "speedup": args.speedup,
        "prefill_workers": args.prefill_workers, "decode_workers": args.decode_workers,
        "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS, "plan": asdict(plan),
        "slo": {"ttft_ms": slo.ttft_ms, "itl_ms": slo.itl_ms, "itl_kind": "mean per request",
                "ttft_client_ms": slo.ttft_ms / args.speedup, "itl_client_ms": slo.itl_ms / args.speedup,
                "attainment_goal": ATTAINMENT_GOAL},
        "goodput_disagg": disagg["goodput_per_s"], "goodput_agg": agg["goodput_per_s"],
        "goodput_ratio": disagg["goodput_per_s"] / agg["goodput_per_s"] if agg["goodput_per_s"] else None,
        "rates_per_s": list(plan.rates_per_s),
        "goodput_per_rate_disagg": [r["goodput_per_s"] for r in disagg["rates"]],
        "goodput_per_rate_agg": [r["goodput_per_s"] for r in agg["rates"]],
        "max_rate_at_goal_disagg": disagg["max_rate_at_goal_per_s"],
        "max_rate_at_goal_agg": agg["max_rate_at_goal_per_s"],
        "past_knee_disagg": disagg["past_knee"], "past_knee_agg": agg["past_knee"],
        "goodput_by_itl_target": goodput_by_itl_target({"disagg": disagg["rates"], "agg": agg["rates"]}),
        "disagg_requests": {k: v for k, v in counts.items() if k.startswith("requests{")},
        "disagg_fallbacks": sum(v for k, v in counts.items() if k.startswith("fallbacks{")),
        "send_lag_p99_real_ms_max": max(r["send_lag_p99_real_ms"] or 0.0
                                        for mode in modes.values() for r in mode["rates"]),
        "outputs_identical": None,
        "modes": modes, "real": real,
    }
    if real:
        result["outputs_identical"] = real["agg"]["texts"] == real["disagg"]["texts"]
        for mode in ("agg", "disagg"):
            result[f"real_ttft_p50_ms_{mode}"] = real[mode]["ttft_p50_ms"]
            result[f"real_itl_p50_ms_{mode}"] = real[mode]["itl_p50_ms"]
    return result


if __name__ == "__main__":
    main()
