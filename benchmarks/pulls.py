"""Peer pulls on bursts that share one long prefix: a busy holder's prefix read by its peer instead of
prefilled there, against the same fleet without pulls.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.pulls [--quick] [--mocker PROFILE]

The workload (fixed seed): documents of their own, each first asked once (so one worker caches it), then a
burst of questions about it sent together, each question a few words after the whole document, greedy, short
answers. The kv router sends the first questions of a burst to the worker that holds the document; as its
load grows, the others go to the other worker. Without pulls that worker prefills the whole document for the
first of them (its later ones hit its own cache); with pulls (`--kv-peer-pulls`) it reads the holder's
blocks and prefills only the question, and the router moves load to it sooner (a pulled block costs it
`--router-pull-hit-weight` of a hit). Two fresh fleets play the same script, two aggregated workers each:
`no_pulls` and `pulls`.

Reported per fleet: TTFT of the burst requests (p50, mean, p90, max), prompt tokens prefilled (prompt less
cached, from each response's usage), the gateway's pull outcomes (`dynserve_kv_pulls_total`) and the workers'
pull bytes and time, every answer; then `ttft_mean_ratio_no_pulls_over_pulls`,
`prefill_tokens_saved_ratio` (1 - prefilled with pulls / without) and `outputs_identical` (greedy answers
equal across the fleets). With `--mocker PROFILE` the fleets are mocker workers at that profile (pulls are
simulated reads of the profile's transfer time; answers are pseudo-random, not compared).

The last stdout line is the JSON result; a copy goes to `benchmarks/results/pulls-<timestamp>.json`, and the
TTFT of each burst request per fleet is drawn next to it (`.png`). `--quick`: 2 documents of 400 words and
bursts of 6; the full run: 4 documents of 1,000 words and bursts of 10.
Measurements and their history: `docs/benchmarks.md` (pulls).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks._common import git_commit, log, machine_info, percentile, write_result
from benchmarks._dynctl import dynctl_serve, scrape_counters, scrape_worker_samples
from benchmarks._http import http_get, stream_chat

FLEETS = ("no_pulls", "pulls")
_WORDS = ("river", "stone", "garden", "lantern", "harbor", "meadow", "copper", "violet", "signal", "orchard",
          "canyon", "thread", "market", "winter", "ledger", "candle", "bridge", "falcon", "pepper", "marble")


@dataclass(frozen=True)
class Plan:
    num_documents: int
    document_words: int
    burst: int
    max_tokens: int


QUICK = Plan(num_documents=2, document_words=400, burst=6, max_tokens=12)
FULL = Plan(num_documents=4, document_words=1000, burst=10, max_tokens=16)


@dataclass(frozen=True)
class Result:
    document: int
    question: int
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    answer: str


def make_documents(plan: Plan, seed: int) -> list[tuple[str, list[str]]]:
    """(document, its burst's questions) for each document: a function of `plan` and `seed` alone."""
    rng = random.Random(seed)
    documents = []
    for index in range(plan.num_documents):
        text = " ".join(rng.choice(_WORDS) for _ in range(plan.document_words))
        questions = [f"Question {q + 1}: what does the report say about the {rng.choice(_WORDS)} and the "
                     f"{rng.choice(_WORDS)}?" for q in range(plan.burst)]
        documents.append((f"You answer questions about report {index}. Report: {text}", questions))
    return documents


async def _burst(port: int, model: str, system: str, questions: list[str], max_tokens: int,
                 document: int) -> list[Result]:
    """Every question about `system` at once."""
    async def one(q: int) -> Result:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": questions[q]}]
        answer, ttft_s, usage = await stream_chat(port, model, messages, max_tokens)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return Result(document, q, ttft_s, usage["prompt_tokens"], cached, answer)

    return list(await asyncio.gather(*(one(q) for q in range(len(questions)))))


async def _play(port: int, model: str, plan: Plan, documents: list[tuple[str, list[str]]], name: str) -> list[Result]:
    results: list[Result] = []
    for index, (system, questions) in enumerate(documents):
        await stream_chat(port, model, [{"role": "system", "content": system},
                                      {"role": "user", "content": "Read the report."}], 1)
        await asyncio.sleep(0.5)  # the holder's KV events reach the router
        burst = await _burst(port, model, system, questions, plan.max_tokens, index)
        results += burst
        log(f"{name}: document {index}: TTFT mean {1000 * sum(r.ttft_s for r in burst) / len(burst):.0f} ms, "
            f"max {1000 * max(r.ttft_s for r in burst):.0f} ms; prefilled "
            f"{sum(r.prompt_tokens - r.cached_tokens for r in burst)} of {sum(r.prompt_tokens for r in burst)} "
            "prompt tokens")
    return results


def _worker_pull_counters(gateway_port: int) -> dict[str, float]:
    """The workers' `dynserve_worker_kv_pull_*` series summed over the workers, keyed by name and the labels
    other than the worker's own (`reason`)."""
    totals: dict[str, float] = {}
    for name, labels, value in scrape_worker_samples(gateway_port, ("dynserve_worker_kv_pull_",)):
        kept = [f'{k}="{v}"' for k, v in sorted(labels.items()) if k not in ("worker_id", "role", "model")]
        key = name + (f"{{{','.join(kept)}}}" if kept else "")
        totals[key] = totals.get(key, 0.0) + value
    return totals


def summarize(results: list[Result]) -> dict[str, Any]:
    ttfts_ms = [1000 * r.ttft_s for r in results]
    prefilled = sum(r.prompt_tokens - r.cached_tokens for r in results)
    return {"num_requests": len(results), "ttft_p50_ms": percentile(ttfts_ms, 50),
            "ttft_mean_ms": sum(ttfts_ms) / len(ttfts_ms), "ttft_p90_ms": percentile(ttfts_ms, 90),
            "ttft_max_ms": max(ttfts_ms), "prompt_tokens": sum(r.prompt_tokens for r in results),
            "prefill_tokens": prefilled}


def run_fleet(name: str, flags: list[str], plan: Plan, documents: list[tuple[str, list[str]]],
              log_dir: Path) -> tuple[dict[str, Any], list[Result]]:
    log(f"{name}: starting dynctl serve {' '.join(flags)}")
    started_s, load_start = time.monotonic(), os.getloadavg()[0]
    with dynctl_serve(f"pulls-{name}", flags, log_dir=log_dir) as server:
        model = json.loads(http_get(f"127.0.0.1:{server.port}", "/v1/models"))["data"][0]["id"]
        for i in range(2):  # warm both workers up on prompts the script never uses
            asyncio.run(stream_chat(server.port, model, [{"role": "user", "content": f"Warm-up {i}: "
                                                        + " ".join(["warm"] * 200)}], 4))
        results = asyncio.run(_play(server.port, model, plan, documents, name))
        pulls = scrape_counters(server.port, "dynserve_kv_pulls")
        workers = _worker_pull_counters(server.port)
    summary = summarize(results)
    log(f"{name}: TTFT mean {summary['ttft_mean_ms']:.0f} ms, p90 {summary['ttft_p90_ms']:.0f} ms; prefilled "
        f"{summary['prefill_tokens']} of {summary['prompt_tokens']}; pulls {pulls}")
    return ({"flags": flags, "wall_s": time.monotonic() - started_s, "load_avg_1m_start": load_start,
             "load_avg_1m_end": os.getloadavg()[0], **summary, "gateway_pulls": pulls, "worker_pulls": workers,
             "results": [asdict(r) for r in results]}, results)


def headline(figures: dict[str, dict[str, Any]], answers_compared: bool,
             results: dict[str, list[Result]]) -> dict[str, Any]:
    without, with_pulls = figures["no_pulls"], figures["pulls"]
    identical = None
    if answers_compared:
        identical = [r.answer for r in results["no_pulls"]] == [r.answer for r in results["pulls"]]
    return {
        "ttft_mean_ratio_no_pulls_over_pulls": without["ttft_mean_ms"] / with_pulls["ttft_mean_ms"],
        "ttft_p90_ratio_no_pulls_over_pulls": without["ttft_p90_ms"] / with_pulls["ttft_p90_ms"],
        "prefill_tokens_saved_ratio": 1 - with_pulls["prefill_tokens"] / max(1, without["prefill_tokens"]),
        "pulled": with_pulls["gateway_pulls"].get('dynserve_kv_pulls_total{outcome="pulled"}', 0.0),
        "outputs_identical": identical,
    }


def plot(path: Path, results: dict[str, list[Result]], title: str) -> None:
    """Each burst request's TTFT per fleet, in the order sent, documents side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(10, 4.5))
    for name, marker in zip(FLEETS, ("o", "^"), strict=True):
        points = results[name]
        axis.plot(range(len(points)), [1000 * r.ttft_s for r in points], marker=marker, linestyle="-",
                  label=f"{name} (mean {1000 * sum(r.ttft_s for r in points) / len(points):.0f} ms)")
    axis.set_xlabel("burst request (documents one after another)")
    axis.set_ylabel("TTFT (ms)")
    axis.set_yscale("log")
    axis.set_title(title)
    axis.legend()
    axis.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pulls", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 documents of 400 words, bursts of 6")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mocker", default=None, help="play against mocker fleets at this profile")
    parser.add_argument("--mocker-speedup", type=float, default=1.0)
    parser.add_argument("--output", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    plan = QUICK if args.quick else FULL
    documents = make_documents(plan, args.seed)
    base = ["--workers", "2", "--router", "kv"]
    if args.mocker:
        base += ["--mocker", args.mocker, "--mocker-speedup", f"{args.mocker_speedup:g}"]
    figures: dict[str, dict[str, Any]] = {}
    results: dict[str, list[Result]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-pulls-") as tmp:
        for name in FLEETS:
            flags = base + (["--kv-peer-pulls"] if name == "pulls" else [])
            figures[name], results[name] = run_fleet(name, flags, plan, documents, Path(tmp))
    result = {"benchmark": "pulls", "commit": git_commit(), "quick": args.quick, "seed": args.seed,
              "plan": asdict(plan), "mocker": args.mocker, "machine": machine_info(), "fleets": figures,
              **headline(figures, args.mocker is None, results)}
    path = write_result("pulls", result, args.output)
    try:
        plot(path.with_suffix(".png"), results,
             f"Burst TTFT on a shared prefix{' (mocker ' + args.mocker + ')' if args.mocker else ''}")
    except Exception as exc:  # the figures are in the JSON already
        log(f"no picture: {exc}")


if __name__ == "__main__":
    main()
