"""Step times of the real engine on this machine, and the affine fit the mocker's `cpu` profile uses.

What it measures (SmolLM2-135M-Instruct, fp32, `--threads` torch threads, greedy, random token ids):

1. **Prefill**: one request of `n` new tokens after `k` cached ones, scheduled in one step; the step's
   wall time, best of `--repeats`. Points: k = 0 with n in 16..1024, and n = 256 after k in 256..1792.
2. **Decode**: `B` running requests of context about `L` tokens each; the median of 8 decode steps, best
   of `--repeats`.
   The requests share all but their last block, so setting a point up costs one prefill, not B; each still
   attends over its whole context, so the step does the same work as B unrelated requests.
3. **Mixed**: 16 decodes plus a 256-token prefill chunk in one step, to check that the fitted terms add.

Each step is timed twice: wall time and the process's CPU time. With one torch thread the CPU time is what
the step takes on a core of its own, whatever else the (shared) machine runs; the fits use it, and the wall
times are kept next to it to show how much contention there was.

Fits (least squares on relative error, milliseconds of CPU time):
- prefill_ms = prefill_fixed + per_token * n + per_token_context * (n * k + n * (n + 1) / 2)
- decode_ms  = decode_fixed + per_seq * B + per_context_token * (total context tokens of the batch)

Run: `PYTHONPATH=$PWD .venv/bin/python -m benchmarks.mocker_profile` (a few minutes on a 2-core CPU). The
last stdout line is the JSON result (points, fits, residuals); paste `fit` into
`dynserve/workers/mocker_profiles.py`, and the run (date, commit, load average, points, residuals) into
`docs/benchmarks.md` (mocker_profile), which holds the run the current profile was fitted to.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._common import git_commit, log, machine_info, write_result
from dynserve.config import Settings
from dynserve.engine.llm_engine import LLMEngine
from dynserve.protocol import SamplingParams

NUM_SPECIAL_IDS = 17
PREFILL_NEW = (16, 64, 128, 256, 512, 1024)
PREFILL_AFTER_CACHED = (256, 768, 1792)  # 256 new tokens after this many cached
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64)
DECODE_CONTEXTS = (128, 512, 1024)
NUM_DECODE_STEPS = 8


def _tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(NUM_SPECIAL_IDS, vocab_size) for _ in range(n)]


def _timed_step(engine: LLMEngine) -> tuple[list[Any], float, float]:
    """(deltas, wall ms, CPU ms) of one engine step."""
    wall_start, cpu_start = time.perf_counter(), time.process_time()
    deltas = engine.step()
    return deltas, (time.perf_counter() - wall_start) * 1e3, (time.process_time() - cpu_start) * 1e3


def _run_to_end(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def measure_prefill(engine: LLMEngine, rng: random.Random, vocab: int, repeats: int) -> list[dict[str, Any]]:
    once = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    points = [(0, n) for n in PREFILL_NEW] + [(k, 256) for k in PREFILL_AFTER_CACHED]
    out = []
    for num_cached, num_new in points:
        wall_ms, cpu_ms = [], []
        for _ in range(repeats):
            engine.reset_prefix_cache()
            prefix = _tokens(rng, num_cached, vocab)
            if num_cached:
                engine.generate([prefix + _tokens(rng, 1, vocab)], once)  # caches the prefix's full blocks
            engine.add_request(prefix + _tokens(rng, num_new, vocab), once)
            deltas, wall, cpu = _timed_step(engine)
            wall_ms.append(wall)
            cpu_ms.append(cpu)
            assert deltas and deltas[0].num_cached_tokens == num_cached, "the prefix was not cached"
        out.append({"num_cached": num_cached, "num_new": num_new, "step_ms": round(min(cpu_ms), 3),
                    "wall_ms": round(min(wall_ms), 3)})
        log(f"prefill k={num_cached} n={num_new}: {min(cpu_ms):.1f} ms CPU, {min(wall_ms):.1f} ms wall")
    return out


def _start_batch(engine: LLMEngine, rng: random.Random, vocab: int, batch: int, context: int,
                 max_tokens: int) -> None:
    """`batch` running requests of `context` tokens sharing all but their last block, prefilled."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    shared = _tokens(rng, context - 16, vocab)
    engine.add_request(shared + _tokens(rng, 16, vocab), params)
    while engine.stats.num_generated_tokens == 0 or engine.scheduler.waiting:
        engine.step()
    for _ in range(batch - 1):
        engine.add_request(shared + _tokens(rng, 16, vocab), params)
    while engine.scheduler.waiting or any(s.num_output_tokens == 0 for s in engine.scheduler.running):
        engine.step()


def _decode_context(engine: LLMEngine) -> int:
    return sum(s.num_tokens for s in engine.scheduler.running)


def _decode_steps(engine: LLMEngine, rng: random.Random, vocab: int, batch: int,
                  context: int) -> tuple[float, float, int]:
    """(median step CPU ms, median wall ms, mean total context) of `NUM_DECODE_STEPS` decode steps."""
    engine.reset_prefix_cache()
    engine.stats.num_generated_tokens = 0
    _start_batch(engine, rng, vocab, batch, context, max_tokens=NUM_DECODE_STEPS + 4)
    contexts, wall_ms, cpu_ms = [], [], []
    for _ in range(NUM_DECODE_STEPS):
        contexts.append(_decode_context(engine))
        deltas, wall, cpu = _timed_step(engine)
        wall_ms.append(wall)
        cpu_ms.append(cpu)
        assert len(deltas) == batch, "not every request decoded in the step"
    _run_to_end(engine)
    return statistics.median(cpu_ms), statistics.median(wall_ms), int(statistics.mean(contexts))


def measure_decode(engine: LLMEngine, rng: random.Random, vocab: int, repeats: int) -> list[dict[str, Any]]:
    out = []
    for context in DECODE_CONTEXTS:
        for batch in DECODE_BATCHES:
            runs = [_decode_steps(engine, rng, vocab, batch, context) for _ in range(repeats)]
            step_ms, wall_ms, total_context = min(runs)
            out.append({"batch": batch, "context_per_seq": context, "total_context": total_context,
                        "step_ms": round(step_ms, 3), "wall_ms": round(wall_ms, 3)})
            log(f"decode B={batch} L={context}: {step_ms:.1f} ms CPU, {wall_ms:.1f} ms wall")
    return out


def measure_mixed(engine: LLMEngine, rng: random.Random, vocab: int) -> dict[str, Any]:
    engine.reset_prefix_cache()
    engine.stats.num_generated_tokens = 0
    _start_batch(engine, rng, vocab, 16, 512, max_tokens=8)
    context = _decode_context(engine)
    engine.add_request(_tokens(rng, 256, vocab), SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    deltas, wall_ms, cpu_ms = _timed_step(engine)
    assert len(deltas) == 17
    _run_to_end(engine)
    return {"batch": 16, "total_context": context, "num_prefill_new": 256, "step_ms": round(cpu_ms, 3),
            "wall_ms": round(wall_ms, 3)}


def _relative_fit(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least squares on relative error (rows weighted by 1/y): a 100 ms step off by 20 ms counts as much as a
    1 s step off by 200 ms. Returns the coefficients and each point's relative error."""
    coefficients = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)[0]
    return coefficients, (x @ coefficients - y) / y


def fit(prefill: list[dict[str, Any]], decode: list[dict[str, Any]]) -> dict[str, Any]:
    new, cached = np.array([p["num_new"] for p in prefill]), np.array([p["num_cached"] for p in prefill])
    px = np.stack([np.ones(len(prefill)), new, new * cached + new * (new + 1) / 2], axis=1).astype(float)
    pc, perr = _relative_fit(px, np.array([p["step_ms"] for p in prefill]))
    dx = np.array([[1.0, d["batch"], d["total_context"]] for d in decode])
    dc, derr = _relative_fit(dx, np.array([d["step_ms"] for d in decode]))
    return {
        "prefill_fixed_ms": float(pc[0]), "prefill_ms_per_token": float(pc[1]),
        "prefill_ms_per_token_context": float(pc[2]),
        "decode_fixed_ms": float(dc[0]), "decode_ms_per_seq": float(dc[1]),
        "decode_ms_per_context_token": float(dc[2]),
        "prefill_max_rel_error": float(np.max(np.abs(perr))),
        "prefill_rms_rel_error": float(np.sqrt(np.mean(perr**2))),
        "decode_max_rel_error": float(np.max(np.abs(derr))), "decode_rms_rel_error": float(np.sqrt(np.mean(derr**2))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: what each of 2 workers gets here, and immune to the OpenMP "
                             "barrier stalls a busy shared machine causes with 2) [default: 1]")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--refit", metavar="RESULT_JSON",
                        help="recompute the fit of a stored result, measure nothing")
    args = parser.parse_args()
    if args.refit:
        result = json.loads(Path(args.refit).read_text())
        result["fit"] = fit(result["prefill"], result["decode"])
        print(json.dumps(result["fit"], sort_keys=True))
        return
    load_at_start = os.getloadavg()[0]
    settings = Settings(dtype="float32", device="cpu", num_threads=args.threads, kv_blocks=1024,
                        max_num_batched_tokens=2048, max_num_seqs=64)
    engine = LLMEngine(settings)
    vocab = engine.model_config.vocab_size
    rng = random.Random(args.seed)
    engine.generate([_tokens(rng, 64, vocab)], SamplingParams(max_tokens=4, temperature=0))  # warm up
    prefill = measure_prefill(engine, rng, vocab, args.repeats)
    decode = measure_decode(engine, rng, vocab, args.repeats)
    mixed = measure_mixed(engine, rng, vocab)
    machine = machine_info()
    machine["load_avg_1m_at_start"] = load_at_start
    result = {"benchmark": "mocker_profile", "commit": git_commit(), "machine": machine,
              "settings": {"dtype": "float32", "num_threads": args.threads}, "prefill": prefill,
              "decode": decode, "mixed": mixed, "fit": fit(prefill, decode)}
    write_result("mocker_profile", result)


if __name__ == "__main__":
    main()
