"""The router: which worker gets a request. Modes (`ROUTER_MODES`):

- `kv`: hash the prompt's full blocks (the engine's own function, so a router hit is an engine hit), look up
  each worker's prefix overlap, on every KV medium, in the `TieredIndex` that `consume` keeps current from
  the workers' KV events, and decide with `cost.choose` (overlap credited by tier, against load, with the
  hot-spot guard);
- `approximate`: the same decision, but the overlaps come from the router's own memory of which prompts it
  sent where (`approx.RouteMemory`, forgotten after a TTL), for deployments without an event plane;
- `round_robin`, `random`, `least_loaded` (fewest active blocks): baselines that ignore the cache.

Load ("active blocks") counts what this router sent and has not seen finish. `consume` resyncs a worker from
its snapshot when its event numbers jump: its device blocks and, where the snapshot carries them, its host
and disk blocks (`KVSnapshot.lower_block_hashes`; a worker that sends none has its lower media dropped until
their events come again: an undercount, never a stale hit). This module is the shell around the pure parts
(`cost`, `indexer`, `tiers`, `approx`); what it measures (decision time, overlap, event lag, routed requests)
goes to a `RouterObserver` (the gateway's Prometheus metrics), so the router itself has no metrics dependency.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Literal, Protocol

from dynserve.events.base import EventBatch, EventPlane
from dynserve.hashing import hash_blocks
from dynserve.protocol import MEDIA, KVSnapshot, WorkerLoad
from dynserve.router.approx import RouteMemory
from dynserve.router.cost import Decision, RoutingPolicy, choose
from dynserve.router.indexer import KVIndex
from dynserve.router.tiers import TieredIndex

if TYPE_CHECKING:
    from dynserve.config import Settings

__all__ = ["ROUTER_MODES", "Router", "RouterMode", "RouterObserver"]

logger = logging.getLogger(__name__)

RouterMode = Literal["kv", "approximate", "round_robin", "random", "least_loaded"]
ROUTER_MODES: tuple[str, ...] = ("kv", "approximate", "round_robin", "random", "least_loaded")
CACHE_AWARE_MODES: frozenset[str] = frozenset({"kv", "approximate"})


class RouterObserver(Protocol):
    """Receives what the router measures; every method must be cheap and must not raise."""

    def observe_decision(self, decision: Decision, num_prompt_blocks: int | None, decision_s: float) -> None:
        """A pick; `num_prompt_blocks` is None in the modes that do not hash the prompt."""

    def observe_routed(self, worker_id: str) -> None:
        """A request was sent to `worker_id` (one per attempt, retries included)."""

    def observe_event_lag(self, lag_s: float) -> None:
        """A batch of KV events was applied `lag_s` after its worker published it."""


class Router:
    def __init__(self, mode: RouterMode, *, block_size: int, salt: int, overlap_weight: float = 1.0,
                 temperature: float = 0.0, seed: int = 0, hot_spot_ratio: float = 2.0,
                 hot_spot_min_blocks: int = 1024, approx_ttl_s: float = 120.0, approx_max_blocks: int = 65_536,
                 host_hit_weight: float = 0.9, disk_hit_weight: float = 0.5, pull_hit_weight: float = 0.0,
                 pull_min_blocks: int = 4, clock: Callable[[], float] = time.monotonic) -> None:
        """`clock` times the approximate memory's TTL (tests pass a fake one); the other knobs are
        `RoutingPolicy`'s."""
        if mode not in ROUTER_MODES:
            raise ValueError(f"unknown router mode {mode!r}; choose one of {', '.join(ROUTER_MODES)}")
        self.mode, self.block_size, self.salt = mode, block_size, salt
        self.policy = RoutingPolicy(overlap_weight=overlap_weight, temperature=temperature,
                                    hot_spot_ratio=hot_spot_ratio, hot_spot_min_blocks=hot_spot_min_blocks,
                                    host_hit_weight=host_hit_weight, disk_hit_weight=disk_hit_weight,
                                    pull_hit_weight=pull_hit_weight if mode == "kv" else 0.0,
                                    pull_min_blocks=pull_min_blocks)
        self.memory: RouteMemory | None = None
        # kv (and the baselines): every medium, fed by events; approximate: the memory's own device-only
        # index (what it remembers routing)
        self.index: TieredIndex | KVIndex
        if mode == "approximate":
            self.memory = RouteMemory(ttl_s=approx_ttl_s, max_blocks_per_worker=approx_max_blocks)
            self.index = self.memory.index
            self._cached_blocks: Callable[[str], int] = self.index.num_worker_blocks
        else:
            self.index = TieredIndex()
            self._cached_blocks = self.index.device.num_worker_blocks  # new prefixes fill the device first
        self.observer: RouterObserver | None = None
        self._clock = clock
        self._rng = random.Random(seed)
        self._turn = itertools.count()
        self._inflight: dict[str, tuple[str, int]] = {}  # request id -> (worker, blocks)
        self._active: dict[str, int] = {}

    @classmethod
    def from_settings(cls, settings: Settings, *, block_size: int, salt: int) -> Router:
        return cls(settings.router, block_size=block_size, salt=salt, overlap_weight=settings.overlap_weight,
                   temperature=settings.router_temperature, seed=settings.seed,
                   hot_spot_ratio=settings.router_hot_spot_ratio,
                   hot_spot_min_blocks=settings.router_hot_spot_min_blocks,
                   approx_ttl_s=settings.router_approx_ttl_s,
                   approx_max_blocks=settings.router_approx_max_blocks,
                   host_hit_weight=settings.router_host_hit_weight,
                   disk_hit_weight=settings.router_disk_hit_weight,
                   pull_hit_weight=settings.router_pull_hit_weight if settings.kv_peer_pulls else 0.0,
                   pull_min_blocks=settings.kv_pull_min_blocks)

    # ---- decisions -------------------------------------------------------------------------------------

    def pick(self, token_ids: Sequence[int], candidates: Sequence[str],
             loads: Mapping[str, WorkerLoad]) -> tuple[str, int]:
        """(worker, its prefix overlap in blocks) for a prompt; `candidates` must not be empty."""
        decision = self.decide(token_ids, candidates, loads)
        return decision.worker_id, decision.overlap_blocks

    def decide(self, token_ids: Sequence[int], candidates: Sequence[str],
               loads: Mapping[str, WorkerLoad]) -> Decision:
        """`pick`'s whole decision: with peer pulls (kv mode), also whom the chosen worker should pull the
        prompt's prefix from (`Decision.pull_from`)."""
        # Load is what this router sent and has not seen finish. Worker reports (`loads`) are polled and
        # stale by up to a poll interval, which is longer than most decisions care about: they break ties
        # only. (With several gateways sharing workers, a fresher shared signal is still to come.)
        if self.mode in CACHE_AWARE_MODES:
            return self._pick_by_cache(token_ids, candidates)
        start_s = time.perf_counter()
        if self.mode == "round_robin":
            chosen = candidates[next(self._turn) % len(candidates)]
        elif self.mode == "random":
            chosen = self._rng.choice(list(candidates))
        else:  # least_loaded
            active = self._active
            chosen = min(candidates,
                         key=lambda w: (active.get(w, 0), loads[w].num_running if w in loads else 0))
        decision = Decision(chosen, 0)
        if self.observer is not None:
            self.observer.observe_decision(decision, None, time.perf_counter() - start_s)
        return decision

    def _pick_by_cache(self, token_ids: Sequence[int], candidates: Sequence[str]) -> Decision:
        hashes = hash_blocks(token_ids, self.block_size, self.salt)
        now_s = self._clock() if self.memory is not None else 0.0
        start_s = time.perf_counter()
        if self.memory is not None:
            overlaps, lower = self.memory.match(hashes, now_s), None
        else:
            overlaps, lower = self.index.match(hashes)
        decision = choose(len(hashes), overlaps, candidates, self._active, self.policy, self._rng,
                          cached_blocks=self._cached_blocks, lower=lower)
        decision_s = time.perf_counter() - start_s
        if self.memory is not None:
            self.memory.remember(decision.worker_id, hashes, now_s)
        if self.observer is not None:
            self.observer.observe_decision(decision, len(hashes), decision_s)
        return decision

    def routed(self, request_id: str, worker_id: str, num_blocks: int) -> None:
        self._inflight[request_id] = (worker_id, num_blocks)
        self._active[worker_id] = self._active.get(worker_id, 0) + num_blocks
        if self.observer is not None:
            self.observer.observe_routed(worker_id)

    def active_blocks(self, worker_id: str) -> int:
        """The load this router counts on `worker_id`: the blocks of what it sent there and has not seen finish."""
        return self._active.get(worker_id, 0)

    def finished(self, request_id: str) -> None:
        """The request's load leaves its worker; idempotent (a request already finished is ignored)."""
        entry = self._inflight.pop(request_id, None)
        if entry is not None:
            worker_id, num_blocks = entry
            self._active[worker_id] = self._active.get(worker_id, 0) - num_blocks

    def forget_worker(self, worker_id: str) -> None:
        if self.memory is not None:
            self.memory.forget_worker(worker_id)
        else:
            self.index.remove_worker(worker_id)

    def index_size(self) -> tuple[int, int]:
        """(distinct blocks, workers) the router's index knows now; in approximate mode expired blocks are
        dropped first, so call it from the thread that routes."""
        if self.memory is not None:
            self.memory.expire(self._clock())
        return self.index.num_blocks, sum(1 for w in self.index.worker_ids if self.index.num_worker_blocks(w))

    def index_blocks_by_medium(self) -> dict[str, int]:
        """Blocks the router's index knows per KV medium (`protocol.MEDIA`), for a per-tier gauge; the
        approximate memory knows only the device (expired blocks are dropped first, as `index_size`)."""
        if isinstance(self.index, TieredIndex):
            return self.index.num_blocks_by_medium()
        if self.memory is not None:
            self.memory.expire(self._clock())
        return {medium: self.index.num_blocks if medium == MEDIA[0] else 0 for medium in MEDIA}

    # ---- keeping the index current ---------------------------------------------------------------------

    async def consume(self, plane: EventPlane, snapshot: Callable[[str], Awaitable[KVSnapshot]],
                      cursor: str = "0") -> None:
        """Apply the plane's events forever; on a gap, resync that worker from `snapshot(worker_id)`. A plane
        that cannot be read (Redis restarting, the embedded plane's actor replaced) is read again after a
        backoff of up to 2 s, from the same cursor: events missed meanwhile show as gaps, resynced."""
        failures = 0
        while True:
            try:
                batches, cursor = await plane.read(cursor, block_s=1.0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the index keeps what it knows; routing goes on meanwhile
                failures += 1
                if failures == 1:
                    logger.warning("router: cannot read the event plane (%s); retrying", exc)
                await asyncio.sleep(min(0.05 * 2**failures, 2.0))
                continue
            if failures:
                logger.info("router: reading the event plane again after %d failed reads", failures)
                failures = 0
            for batch in batches:
                await self._apply(batch, snapshot)
                if self.observer is not None:
                    self.observer.observe_event_lag(max(0.0, time.time() - batch.published_s))

    async def _apply(self, batch: EventBatch, snapshot: Callable[[str], Awaitable[KVSnapshot]]) -> None:
        if self.index.apply(batch.worker_id, batch.events):
            return
        try:
            state = await snapshot(batch.worker_id)
        except Exception as exc:  # the worker is gone or unreachable: forget what it held
            logger.warning("router: no snapshot from %s (%s); dropping it from the index",
                           batch.worker_id, exc)
            self.index.remove_worker(batch.worker_id)
            return
        if isinstance(self.index, TieredIndex):
            # a medium this router does not know (a newer worker's) is left out: an undercount, not a stale hit
            lower = {medium: hashes for medium, hashes in state.lower_block_hashes.items()
                     if medium in MEDIA[1:]}
            self.index.resync(batch.worker_id, state.block_hashes, state.last_event_id, lower=lower)
        else:
            self.index.resync(batch.worker_id, state.block_hashes, state.last_event_id)
        self.index.apply(batch.worker_id, batch.events)  # what is newer than the snapshot
