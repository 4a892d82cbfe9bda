"""Routing decision latency and KV-event ingest rate of the router's index, in-process.

- **Decision** = what `Router` runs per cache-aware pick after hashing the prompt: `KVIndex.match` on a
  128-block prompt + `cost.choose` over all workers as candidates, timed one by one (perf_counter_ns) at
  index sizes of 10k, 100k and 1M blocks, with 8 and 64 workers. Each prompt shares a random-length prefix
  (0..128 blocks) with a chain some worker holds, so matches stop at every depth. Loads are random
  (0..500 active blocks); the hot-spot guard is set off (ratio = worker count) so every decision takes the
  cost path and both paths below decide alike (checked).
- **Ingest** = `KVIndex.apply` of `BlockStored` events of 16 blocks each (a request's worth), in blocks/s.
- **Baselines, same run**: `previous` is the decision path before it was optimized (a hash -> worker-mask
  dict walked block by block, a cost dict over every candidate, then `select`), fed the same events in the
  same order; `sets` is a plain per-worker-set index (for each worker, count leading blocks found in its
  set), the obvious implementation. Reported as `*_speedup_vs_previous` and `*_speedup_vs_sets`.

Last stdout line: JSON with `decision_p50_us_<size>_<workers>w`, `decision_p99_us_...`, `previous_p50_us_...`,
`ingest_blocks_per_s`. `--quick` skips the 1M-block index for 8 workers and uses fewer decisions.
Record a run in `docs/benchmarks.md` (router_micro), which keeps the history.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

from benchmarks._common import git_commit, log, machine_info, percentile, write_result
from dynserve.protocol import BlockStored
from dynserve.router.cost import RoutingPolicy, choose, costs, select
from dynserve.router.indexer import KVIndex

PROMPT_BLOCKS = 128
CHAIN_BLOCKS = 128
EVENT_BLOCKS = 16


class PreviousIndex:
    """The index as it was before runs, for the baseline: block hash -> bitmask of workers, fed in the same
    order as the `KVIndex` (so its dict lies in memory as the old one did)."""

    def __init__(self) -> None:
        self.holders: dict[int, int] = {}
        self.owners: dict[int, str] = {}  # bit -> worker id
        self._bits: dict[str, int] = {}

    def store(self, worker_id: str, block_hashes: list[int]) -> None:
        bit = self._bits.get(worker_id)
        if bit is None:
            bit = self._bits[worker_id] = 1 << len(self._bits)
            self.owners[bit] = worker_id
        holders = self.holders
        for block_hash in block_hashes:
            holders[block_hash] = holders.get(block_hash, 0) | bit

    def match(self, block_hashes: list[int]) -> dict[str, int]:
        """The previous `KVIndex.match`: walk every block of the prompt ANDing holder masks."""
        holders, candidates, depth = self.holders, 0, 0
        dropped_at: list[tuple[int, int]] = []  # (mask of workers that stopped matching, their overlap)
        for block_hash in block_hashes:
            mask = holders.get(block_hash, 0)
            remaining = mask if depth == 0 else candidates & mask
            if depth and remaining != candidates:
                dropped_at.append((candidates & ~remaining, depth))
            candidates = remaining
            if not candidates:
                break
            depth += 1
        if candidates:
            dropped_at.append((candidates, depth))
        overlaps: dict[str, int] = {}
        for mask, overlap in dropped_at:
            while mask:
                low = mask & -mask
                overlaps[self.owners[low]] = overlap
                mask ^= low
        return overlaps


def build(num_blocks: int, num_workers: int,
          rng: random.Random) -> tuple[KVIndex, PreviousIndex, list[list[int]]]:
    """An index of about `num_blocks` distinct hashes in 128-block chains, each chain on 1-2 workers (and
    the same in the previous index)."""
    index, previous = KVIndex(), PreviousIndex()
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
            for event in events:
                previous.store(f"w{w}", event.block_hashes)
    return index, previous, chains


def prompts_for(chains: list[list[int]], count: int, rng: random.Random) -> list[list[int]]:
    out = []
    for _ in range(count):
        shared = rng.randint(0, PROMPT_BLOCKS)
        out.append(rng.choice(chains)[:shared] + [rng.getrandbits(63) for _ in range(PROMPT_BLOCKS - shared)])
    return out


def time_decisions(index: KVIndex, prompts: list[list[int]], candidates: list[str], active: dict[str, int],
                   policy: RoutingPolicy) -> tuple[list[float], list[str]]:
    samples_us, chosen = [], []
    for prompt in prompts:
        start = time.perf_counter_ns()
        decision = choose(len(prompt), index.match(prompt), candidates, active, policy)
        samples_us.append((time.perf_counter_ns() - start) / 1000)
        chosen.append(decision.worker_id)
    return samples_us, chosen


def time_previous(previous: PreviousIndex, prompts: list[list[int]], candidates: list[str],
                  active: dict[str, int]) -> tuple[list[float], list[str]]:
    """The decision as this benchmark timed it before: the mask walk, a cost for every candidate, `select`
    (the router also built the candidates' load dict per pick; not counted, as before)."""
    candidate_loads = {w: active.get(w, 0) for w in candidates}
    samples_us, chosen = [], []
    for prompt in prompts:
        start = time.perf_counter_ns()
        chosen.append(select(costs(len(prompt), previous.match(prompt), candidate_loads)))
        samples_us.append((time.perf_counter_ns() - start) / 1000)
    return samples_us, chosen


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
            index, previous_index, chains = build(num_blocks, num_workers, rng)
            active = {f"w{w}": rng.randrange(0, 500) for w in range(num_workers)}
            candidates = list(active)
            policy = RoutingPolicy(hot_spot_ratio=float(num_workers))  # max/mean never exceeds it: guard off
            prompts = prompts_for(chains, num_decisions, rng)
            time_decisions(index, prompts[:100], candidates, active, policy)  # warm-up
            ours, ours_chosen = time_decisions(index, prompts, candidates, active, policy)
            time_previous(previous_index, prompts[:100], candidates, active)
            previous, previous_chosen = time_previous(previous_index, prompts, candidates, active)
            if ours_chosen != previous_chosen:
                raise AssertionError("the optimized decision disagrees with the previous one")
            sets = time_set_baseline(index, prompts, active)
            key = f"{label}_{num_workers}w"
            result[f"index_blocks_{key}"] = index.num_blocks
            for name, samples in (("decision", ours), ("previous", previous), ("sets", sets)):
                result[f"{name}_p50_us_{key}"] = percentile(samples, 50)
                result[f"{name}_p99_us_{key}"] = percentile(samples, 99)
            for q in (50, 99):
                result[f"p{q}_speedup_vs_previous_{key}"] = percentile(previous, q) / percentile(ours, q)
            result[f"p50_speedup_vs_sets_{key}"] = percentile(sets, 50) / percentile(ours, 50)
            log(f"{key}: {index.num_blocks} blocks, decision p50 {percentile(ours, 50):.1f} us, "
                f"p99 {percentile(ours, 99):.1f} us (previous: p50 {percentile(previous, 50):.1f}, "
                f"p99 {percentile(previous, 99):.1f}; per-worker sets: p50 {percentile(sets, 50):.1f})")
    result["ingest_blocks_per_s"] = max(ingest_rate(200_000 if args.quick else 1_000_000, rng) for _ in range(3))
    log(f"ingest: {result['ingest_blocks_per_s'] / 1e6:.2f} M blocks/s")
    write_result("router_micro", result, args.output)
    return result


if __name__ == "__main__":
    main()
