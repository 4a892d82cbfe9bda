"""The router: which worker gets a request. Modes:

- `kv`: hash the prompt's full blocks (the engine's own function, so a router hit is an engine hit), look up
  each worker's prefix overlap in the `KVIndex`, and pick by `cost.costs`/`cost.select`;
- `round_robin`, `random`, `least_loaded` (fewest active blocks): baselines that ignore the cache.

Load ("active blocks") counts what this router sent and has not seen finish. `consume` keeps the index current from an event plane and
resyncs a worker from its snapshot when its event numbers jump.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Literal

from dynserve.events.base import EventPlane
from dynserve.hashing import hash_blocks
from dynserve.protocol import KVSnapshot, WorkerLoad
from dynserve.router.cost import costs, select
from dynserve.router.indexer import KVIndex

__all__ = ["ROUTER_MODES", "Router"]

logger = logging.getLogger(__name__)

RouterMode = Literal["kv", "round_robin", "random", "least_loaded"]
ROUTER_MODES: tuple[str, ...] = ("kv", "round_robin", "random", "least_loaded")


class Router:
    def __init__(self, mode: RouterMode, *, block_size: int, salt: int, overlap_weight: float = 1.0,
                 temperature: float = 0.0, seed: int = 0) -> None:
        if mode not in ROUTER_MODES:
            raise ValueError(f"unknown router mode {mode!r}; choose one of {', '.join(ROUTER_MODES)}")
        self.mode, self.block_size, self.salt = mode, block_size, salt
        self.overlap_weight, self.temperature = overlap_weight, temperature
        self.index = KVIndex()
        self._rng = random.Random(seed)
        self._turn = itertools.count()
        self._inflight: dict[str, tuple[str, int]] = {}  # request id -> (worker, blocks)
        self._active: dict[str, int] = {}

    # ---- decisions -------------------------------------------------------------------------------------

    def pick(self, token_ids: Sequence[int], candidates: Sequence[str],
             loads: Mapping[str, WorkerLoad]) -> tuple[str, int]:
        """(worker, its prefix overlap in blocks) for a prompt; `candidates` must not be empty."""
        # Load is what this router sent and has not seen finish. Worker reports (`loads`) are polled and
        # stale by up to a poll interval, which is longer than most decisions care about: they break ties
        # only. (With several gateways sharing workers, a fresher shared signal is still to come.)
        active = {w: self._active.get(w, 0) for w in candidates}
        if self.mode == "round_robin":
            return candidates[next(self._turn) % len(candidates)], 0
        if self.mode == "random":
            return self._rng.choice(list(candidates)), 0
        if self.mode == "least_loaded":
            return min(candidates, key=lambda w: (active[w], loads[w].num_running if w in loads else 0)), 0
        hashes = hash_blocks(token_ids, self.block_size, self.salt)
        overlaps = self.index.match(hashes)
        chosen = select(costs(len(hashes), overlaps, active, self.overlap_weight), self.temperature, self._rng)
        return chosen, overlaps.get(chosen, 0)

    def routed(self, request_id: str, worker_id: str, num_blocks: int) -> None:
        self._inflight[request_id] = (worker_id, num_blocks)
        self._active[worker_id] = self._active.get(worker_id, 0) + num_blocks

    def finished(self, request_id: str) -> None:
        entry = self._inflight.pop(request_id, None)
        if entry is not None:
            worker_id, num_blocks = entry
            self._active[worker_id] = self._active.get(worker_id, 0) - num_blocks

    def forget_worker(self, worker_id: str) -> None:
        self.index.remove_worker(worker_id)

    # ---- keeping the index current ---------------------------------------------------------------------

    async def consume(self, plane: EventPlane, snapshot: Callable[[str], Awaitable[KVSnapshot]],
                      cursor: str = "0") -> None:
        """Apply the plane's events forever; on a gap, resync that worker from `snapshot(worker_id)`."""
        while True:
            batches, cursor = await plane.read(cursor, block_s=1.0)
            for batch in batches:
                if self.index.apply(batch.worker_id, batch.events):
                    continue
                try:
                    state = await snapshot(batch.worker_id)
                except Exception as exc:  # the worker is gone or unreachable: forget what it held
                    logger.warning("router: no snapshot from %s (%s); dropping it from the index",
                                   batch.worker_id, exc)
                    self.index.remove_worker(batch.worker_id)
                    continue
                self.index.resync(batch.worker_id, state.block_hashes, state.last_event_id)
                self.index.apply(batch.worker_id, batch.events)  # what is newer than the snapshot
