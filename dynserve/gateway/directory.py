"""The gateway's directory of workers: who they are, one channel each, their polled loads, and readiness.

Membership. With a `registry` (the event plane's, `EventPlane.workers()`), the registry is the source of
truth: every `registry_interval_s` the members are brought in line with the workers it lists
(`membership_changes`), so workers a pool adds become routable, and workers that leave it (drained ones
deregister themselves, the pool deregisters dead ones, a lease that is not renewed runs out) stop getting
requests (except when several vanish at once, channels up: a registry that restarted lists nobody until the
workers' next heartbeats, so those leave only if still missing after `registry_grace_s`). Without one, the
workers given at construction are the members for good. Either way the channel is the fastest signal of
death: a worker whose channel drops is out of picking at once (`BackendObserver.on_down`: the router
forgets it), reconnected on the next load poll if it still answers.

A worker that leaves keeps its channel until the streams it is serving end, so draining never cuts a
response; it gets no new request.

Hand-back (`hand_back_on_join`): requests are bound to a worker when they are sent, so one queued on a busy
member would wait there while a member that just joined (a pool scaling up) idles. When members join, every
load is read again and each member with more requests than the pool's mean (the joiners' none included)
is asked to hand back that excess of its queued, never started ones (`hand_back_shares`); the dispatcher
sends each on to another worker (`Dispatcher.generate`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence

from dynserve.errors import WorkerUnavailableError
from dynserve.events.base import EventPlane
from dynserve.gateway.backend import BackendObserver, WorkerChannel, make_channel
from dynserve.protocol import KVSnapshot, WorkerInfo, WorkerLoad
from dynserve.workers.channel import WarnOnce

__all__ = ["WorkerDirectory", "hand_back_shares", "membership_changes"]

logger = logging.getLogger(__name__)


def membership_changes(current: Mapping[str, WorkerInfo],
                       listed: Sequence[WorkerInfo]) -> tuple[list[WorkerInfo], list[str]]:
    """(workers to add, ids to remove) to turn `current` into `listed`. A worker listed with a different
    address or identity than the one held (a restart under the same id) is removed and added again."""
    by_id = {info.worker_id: info for info in listed}
    removed = [wid for wid, info in current.items() if by_id.get(wid) != info]
    added = [info for wid, info in by_id.items() if current.get(wid) != info]
    return added, removed


def hand_back_shares(pending: Mapping[str, int], waiting: Mapping[str, int],
                     joined: Collection[str]) -> dict[str, int]:
    """How many queued requests each member should hand back when `joined` join the pool: what it holds
    (`pending`: queued or running) above the mean over every member, joiners included, at most what it has
    queued (`waiting`). Members without an excess, and the joiners, are left out."""
    if not pending:
        return {}
    mean = sum(pending.values()) / len(pending)
    shares = {wid: min(waiting.get(wid, 0), math.floor(num - mean)) for wid, num in pending.items()
              if wid not in joined}
    return {wid: share for wid, share in shares.items() if share > 0}


class WorkerDirectory:
    """The members of one pool and a channel to each. Safe to use from one asyncio loop only."""

    def __init__(
        self,
        infos: list[WorkerInfo],
        *,
        registry: EventPlane | None = None,
        roles: frozenset[str] | None = None,
        model_id: str | None = None,
        channel_factory: Callable[[WorkerInfo], WorkerChannel] = make_channel,
        registry_interval_s: float = 0.25,
        poll_interval_s: float = 0.5,
        registry_grace_s: float = 3.0,
        cluster_token: str | None = None,
        hand_back_on_join: bool = True,
    ) -> None:
        """`roles`: only workers of these roles are members (None: any); `model_id`: only workers serving that
        model (None: any; a gateway serving several models has a directory per model). `registry_grace_s`: how long members
        that vanished from the registry together stay (Settings.worker_lease_s). `cluster_token` is presented
        to every worker on connecting (Settings.cluster_token). `hand_back_on_join`: when workers join, the busier
        members hand back queued requests that have not started (see the module's docstring)."""
        self.roles, self.model_id = roles, model_id
        infos = [info for info in infos if self._admits(info)]
        if not infos and registry is None:
            raise ValueError("a worker directory needs at least one worker or a registry to find them in")
        self.registry = registry
        self._channel_factory = channel_factory
        self.channels: dict[str, WorkerChannel] = {info.worker_id: channel_factory(info) for info in infos}
        self.loads: dict[str, WorkerLoad] = {}
        self.observers: list[BackendObserver] = []
        self._leaving: list[WorkerChannel] = []  # left the directory, still finishing streams
        self._identity: WorkerInfo | None = infos[0] if infos else None
        self._load_seen_s: dict[str, float] = {}
        self._strangers = WarnOnce()  # (worker meant, worker that answered)
        self._poll_interval_s, self._registry_interval_s = poll_interval_s, registry_interval_s
        self.registry_grace_s = registry_grace_s
        self._cluster_token = cluster_token
        self.hand_back_on_join = hand_back_on_join
        self._missing_since: dict[str, float] = {}
        self._tasks: list[asyncio.Task[None]] = []

    def add_observer(self, observer: BackendObserver) -> None:
        self.observers.append(observer)

    @property
    def identity(self) -> WorkerInfo:
        """The first worker ever seen: what this pool serves (one model) even when no worker is up."""
        if self._identity is None:
            raise WorkerUnavailableError("no worker has registered yet", worker_id=None)
        return self._identity

    @property
    def has_identity(self) -> bool:
        """Whether any worker has been seen (then `identity` answers)."""
        return self._identity is not None

    @property
    def max_model_len(self) -> int:
        if not self.channels:
            return self.identity.max_model_len
        return min(c.info.max_model_len for c in self.channels.values())

    async def start(self) -> None:
        await asyncio.gather(*(self._connect(c) for c in self.channels.values()))
        if self.registry is not None:
            await self.refresh_members()
            self._tasks.append(asyncio.create_task(self._follow_registry(), name="worker-registry"))
        await self.poll_once()
        self._tasks.append(asyncio.create_task(self._poll_forever(), name="worker-load-poller"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.gather(*(c.close() for c in [*self.channels.values(), *self._leaving]))

    async def snapshot(self, worker_id: str) -> KVSnapshot:
        channel = self.channels.get(worker_id)
        if channel is None:
            raise WorkerUnavailableError(f"unknown worker {worker_id}", worker_id=worker_id)
        return await channel.snapshot()

    def is_ready(self) -> bool:
        """True when some member's channel is open and it reported a load within the last 10 polls (5 s at
        least: on a busy host a load reply can take a second or more, and that is no reason to refuse)."""
        now = time.monotonic()
        horizon_s = max(10 * self._poll_interval_s, 5.0)
        return any(c.is_open and now - self._load_seen_s.get(wid, -1e9) <= horizon_s
                   for wid, c in self.channels.items())

    def open_channels(self, exclude: set[str] | frozenset[str] = frozenset()) -> list[WorkerChannel]:
        """Members whose channel is open and whose worker has answered a load as itself since it connected,
        but those in `exclude`: where a new request may go (a reconnection to a gone worker's address that
        another worker took is never one: `_disown`)."""
        return [c for wid, c in self.channels.items()
                if c.is_open and wid in self._load_seen_s and wid not in exclude]

    def routable_ids(self) -> list[str]:
        return sorted(c.worker_id for c in self.open_channels())

    def pending(self, channel: WorkerChannel) -> int:
        """Requests queued or running on the worker: what it last reported, or what this gateway has open on
        it when that is more (requests sent since the report)."""
        load = self.loads.get(channel.worker_id)
        reported = load.num_running + load.num_waiting if load is not None else 0
        return max(reported, channel.num_open_streams)

    def num_queued(self) -> int:
        return sum(map(self.pending, self.channels.values()))

    # ---- membership ------------------------------------------------------------------------------------

    def _admits(self, info: WorkerInfo) -> bool:
        return (self.roles is None or info.role in self.roles) and self.model_id in (None, info.model_id)

    async def refresh_members(self) -> None:
        """Bring the members in line with the registry (a no-op without one, or when it cannot be read)."""
        if self.registry is None:
            return
        try:
            listed = await self.registry.workers()
        except Exception as exc:  # keep the members we have: a registry blip must not empty the gateway
            logger.warning("cannot read the worker registry: %s", exc)
            return
        listed = [info for info in listed if self._admits(info)]
        added, removed = membership_changes({w: c.info for w, c in self.channels.items()}, listed)
        listed_ids, now_s = {info.worker_id for info in listed}, time.monotonic()
        missing = [w for w in removed if w not in listed_ids and self.channels[w].is_open]
        # A registry that restarted (Redis, the embedded plane) lists nobody until the workers' next heartbeats,
        # and that must not empty the pool: when several members (or all) vanish from the listing at once while
        # their channels are up, they leave only if still missing after `registry_grace_s`. One that vanishes
        # alone (it drained, its lease ran out), is listed anew (restarted under its id) or is down leaves now.
        mass = len(missing) > 1 or (missing and len(missing) == len(self.channels))
        for worker_id in removed:
            if not mass or worker_id not in missing:
                self._leave(worker_id)
                continue
            since_s = self._missing_since.setdefault(worker_id, now_s)
            if now_s - since_s >= self.registry_grace_s:
                self._leave(worker_id)
        self._missing_since = {w: t for w, t in self._missing_since.items()
                               if w in self.channels and w not in listed_ids}
        joined = [self._join(info) for info in added]
        if not self.hand_back_on_join or not joined:
            await asyncio.gather(*(self._poll(c) for c in joined))
            return
        # the joiners connect, and every open member's load is read now, not up to a poll old (a member that
        # is down is left to the poller: its reconnection may take seconds)
        others = [c for c in self.channels.values() if c.is_open and c not in joined]
        await asyncio.gather(*(self._poll(c) for c in [*joined, *others]))
        self._hand_back_to({c.worker_id for c in joined if c.is_open})

    def _hand_back_to(self, joined: set[str]) -> None:
        """Ask the members with more than their share to hand back queued requests (`hand_back_shares`)."""
        if not joined:
            return
        members = self.open_channels()
        waiting = {wid: load.num_waiting for wid, load in self.loads.items()}
        shares = hand_back_shares({c.worker_id: self.pending(c) for c in members}, waiting, joined)
        for worker_id, share in shares.items():
            logger.info("worker %s: asking it to hand back up to %d queued requests for %s", worker_id, share,
                        ", ".join(sorted(joined)))
            with contextlib.suppress(WorkerUnavailableError):
                self.channels[worker_id].hand_back(share)

    def _join(self, info: WorkerInfo) -> WorkerChannel:
        logger.info("worker %s (%s, %s) joined at %s:%d", info.worker_id, info.role, info.engine, info.host,
                    info.port)
        self._identity = self._identity or info
        channel = self.channels[info.worker_id] = self._channel_factory(info)
        return channel

    def _leave(self, worker_id: str) -> None:
        channel = self.channels.pop(worker_id)
        logger.info("worker %s left (%d streams to finish)", worker_id, channel.num_open_streams)
        self._mark_down(channel)
        self._leaving.append(channel)
        for observer in self.observers:
            observer.on_leave(channel.info)

    async def _follow_registry(self) -> None:
        while True:
            await asyncio.sleep(self._registry_interval_s)
            await self.refresh_members()
            await self._close_finished_leavers()

    async def _close_finished_leavers(self) -> None:
        done = [c for c in self._leaving if not c.num_open_streams or not c.is_open]
        self._leaving = [c for c in self._leaving if c not in done]
        await asyncio.gather(*(c.close() for c in done))

    # ---- loads and reconnection ------------------------------------------------------------------------

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(c) for c in list(self.channels.values())))

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self._poll_interval_s)
            await self.poll_once()

    async def _poll(self, channel: WorkerChannel) -> None:
        if not channel.is_open and not await self._connect(channel):
            return
        try:
            load = await channel.load(timeout_s=max(2 * self._poll_interval_s, 1.0))
        except WorkerUnavailableError as exc:
            if channel.is_open:  # a slow answer (a busy host), not a dead worker: keep what we know
                logger.debug("worker %s: %s", channel.worker_id, exc)
                return
            self._mark_down(channel)
            return
        if self.channels.get(channel.worker_id) is not channel:
            return  # it left while we asked
        if load.worker_id != channel.worker_id:
            await self._disown(channel, load.worker_id)
            return
        self.loads[channel.worker_id] = load
        self._load_seen_s[channel.worker_id] = time.monotonic()
        for observer in self.observers:
            observer.on_load(load)

    async def _connect(self, channel: WorkerChannel) -> bool:
        self._load_seen_s.pop(channel.worker_id, None)  # not picked until its worker answers as itself
        try:
            await channel.connect(timeout_s=2.0, cluster_token=self._cluster_token)
            return True
        except WorkerUnavailableError as exc:
            logger.debug("worker %s unreachable: %s", channel.worker_id, exc)
            self._mark_down(channel)
            return False

    async def _disown(self, channel: WorkerChannel, answered: str) -> None:
        """Another worker answers at `channel`'s address (it took a gone worker's port, and is older than the
        `Hello` that names the worker meant, which a newer one refuses): close the channel and leave it down,
        so nothing meant for the gone worker goes there (perhaps to another model): a channel is picked only
        once its worker has answered as itself since it connected (`open_channels`). Warned of once a pair."""
        logger.log(self._strangers.level((channel.worker_id, answered)),
                   "worker %s: worker %s answers at its address %s:%d; closing the channel",
                   channel.worker_id, answered, channel.info.host, channel.info.port)
        await channel.close()
        self._mark_down(channel)

    def _mark_down(self, channel: WorkerChannel) -> None:
        """Out of picking until it answers again: its load goes, and the observers hear it (the dispatcher's
        router forgets what it caches)."""
        if self.channels.get(channel.worker_id, channel) is not channel:
            return  # an old channel of a worker that has since joined again
        self.loads.pop(channel.worker_id, None)
        self._load_seen_s.pop(channel.worker_id, None)
        for observer in self.observers:
            observer.on_down(channel.info)
