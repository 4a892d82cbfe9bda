"""Routing decision latency and KV-event ingest rate of the router's index, in-process.

- **Decision** = `KVIndex.match` on a 128-block prompt + `costs` + `select`, timed one by one
  (perf_counter_ns) at index sizes of 10k, 100k and 1M blocks, with 8 and 64 workers. Each prompt shares
  a random-length prefix (0..128 blocks) with a chain some worker holds, so matches stop at every depth.
- **Ingest** = `KVIndex.apply` of `BlockStored` events of 16 blocks each (a request's worth), in blocks/s.
- **Baseline, same run**: a plain per-worker-set index (for each worker, count leading blocks found in its
  set), the obvious implementation; reported as `*_speedup_vs_sets`.

Last stdout line: JSON with `decision_p50_us_<size>_<workers>w`, `decision_p99_us_...`, `ingest_blocks_per_s`.
`--quick` skips the 1M-block index for 8 workers and uses fewer decisions.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

from benchmarks._common import git_commit, log, machine_info, percentile, write_result
from dynserve.protocol import BlockStored
from dynserve.router.cost import costs, select
from dynserve.router.indexer import KVIndex

PROMPT_BLOCKS = 128
CHAIN_BLOCKS = 128
EVENT_BLOCKS = 16


def build(num_blocks: int, num_workers: int, rng: random.Random) -> tuple[KVIndex, list[list[int]]]:
    """An index of about `num_blocks` distinct hashes in 128-block chains, each chain on 1-2 workers."""
    index = KVIndex()
    chains = []
    next_ids = [0] * num_workers
    for _ in range(max(1, num_blocks // CHAIN_BLOCKS)):
        chain = [rng.getrandbits(63) for _ in range(CHAIN_BLOCKS)]
        chains.append(chain)
        for w in rng.sample(range(num_workers), k=min(num_workers, rng.choice((1, 1, 2)))):
            events = [BlockStored(next_ids[w] + i, None, chain[i * EVENT_BLOCKS:(i + 1) * EVENT_BLOCKS])
                      for i in range(CHAIN_BLOCKS // EVENT_BLOCKS)]
            next_ids[w] += len(events)
            index.apply(f"w{w}", events)
    return index, chains


def prompts_for(chains: list[list[int]], count: int, rng: random.Random) -> list[list[int]]:
    out = []
    for _ in range(count):
        shared = rng.randint(0, PROMPT_BLOCKS)
        out.append(rng.choice(chains)[:shared] + [rng.getrandbits(63) for _ in range(PROMPT_BLOCKS - shared)])
    return out


def time_decisions(index: KVIndex, prompts: list[list[int]], active: dict[str, int]) -> list[float]:
    samples_us = []
    for prompt in prompts:
        start = time.perf_counter_ns()
        select(costs(len(prompt), index.match(prompt), active))
        samples_us.append((time.perf_counter_ns() - start) / 1000)
    return samples_us


def time_set_baseline(index: KVIndex, prompts: list[list[int]], active: dict[str, int]) -> list[float]:
    sets = {w: index.worker_blocks(w) for w in index.worker_ids}
    samples_us = []
    for prompt in prompts:
        start = time.perf_counter_ns()
        overlaps = {}
        for worker, blocks in sets.items():
            depth = 0
            for block_hash in prompt:
                if block_hash not in blocks:
                    break
                depth += 1
            if depth:
                overlaps[worker] = depth
        select(costs(len(prompt), overlaps, active))
        samples_us.append((time.perf_counter_ns() - start) / 1000)
    return samples_us


def ingest_rate(num_blocks: int, rng: random.Random) -> float:
    events = [BlockStored(i, None, [rng.getrandbits(63) for _ in range(EVENT_BLOCKS)])
              for i in range(num_blocks // EVENT_BLOCKS)]
    index = KVIndex()
    start = time.perf_counter()
    index.apply("w0", events)
    return num_blocks / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.router_micro", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    num_decisions = 1000 if args.quick else 5000
    result: dict[str, Any] = {"benchmark": "router_micro", "quick": args.quick, "seed": args.seed,
                              "commit": git_commit(), "machine": machine_info(), "prompt_blocks": PROMPT_BLOCKS}
    for num_blocks, label in ((10_000, "10k"), (100_000, "100k"), (1_000_000, "1m")):
        for num_workers in (8, 64):
            if args.quick and num_blocks == 1_000_000 and num_workers == 8:
                continue
            index, chains = build(num_blocks, num_workers, rng)
            active = {f"w{w}": rng.randrange(0, 500) for w in range(num_workers)}
            prompts = prompts_for(chains, num_decisions, rng)
            time_decisions(index, prompts[:100], active)  # warm-up
            ours = time_decisions(index, prompts, active)
            sets = time_set_baseline(index, prompts, active)
            key = f"{label}_{num_workers}w"
            result[f"index_blocks_{key}"] = index.num_blocks
            result[f"decision_p50_us_{key}"] = percentile(ours, 50)
            result[f"decision_p99_us_{key}"] = percentile(ours, 99)
            result[f"sets_p50_us_{key}"] = percentile(sets, 50)
            result[f"p50_speedup_vs_sets_{key}"] = percentile(sets, 50) / percentile(ours, 50)
            log(f"{key}: {index.num_blocks} blocks, decision p50 {result[f'decision_p50_us_{key}']:.1f} us, "
                f"p99 {result[f'decision_p99_us_{key}']:.1f} us (per-worker sets: p50 {percentile(sets, 50):.1f} us)")
    result["ingest_blocks_per_s"] = max(ingest_rate(200_000 if args.quick else 1_000_000, rng) for _ in range(3))
    log(f"ingest: {result['ingest_blocks_per_s'] / 1e6:.2f} M blocks/s")
    write_result("router_micro", result, args.output)
    return result


if __name__ == "__main__":
    main()
