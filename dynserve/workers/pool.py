"""Worker pools: N engine workers of one role (`prefill`, `decode` or `both`) as Ray actors, grown, shrunk by
draining, watched, and replaced when they die.

Two parts. `PoolPolicy` is the pure core: which workers the pool has and in which state, what its target
size is, and when a dead worker may be replaced; it does no I/O and takes the time as an argument, so tests
drive it directly. `WorkerPool` is the thin shell that carries its decisions out with Ray (`launch_worker`)
and the event plane (the worker registry), on one asyncio loop.

Membership is published through the registry, not by the pool: a worker registers itself once its channel
listens and heartbeats its lease; a draining worker deregisters itself; the pool deregisters a worker it
finds dead, so gateways that follow the registry (`gateway.directory.WorkerDirectory`) stop routing to it
at once instead of when its lease runs out.

Restart policy: a worker that dies without being asked to (or fails to start) is replaced after a backoff
of `backoff_s * 2**k`, capped at `backoff_max_s`, where k counts the replacements made in the last
`window_s`; once `max_restarts` replacements fall in that window the pool stays short (and says so in its
log) until the oldest ages out. A worker being drained that dies is not replaced. A worker that answers no
health check for `unresponsive_s` is killed and counts as dead.

Invariants (`PoolPolicy.check_integrity`): worker ids are never reused; the starting and serving workers
never outnumber the target; a serving worker has its `WorkerInfo`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

from dynserve.config import Settings
from dynserve.errors import PoolError
from dynserve.events.base import EventPlane
from dynserve.protocol import WorkerInfo
from dynserve.workers.worker import Role, launch_worker, reserved_cpus

__all__ = ["Member", "PoolPolicy", "RestartPolicy", "WorkerPool", "check_placeable", "node_resource",
           "placement_shortfall", "ray_needs", "worker_resources"]

logger = logging.getLogger(__name__)

MemberState = Literal["starting", "serving", "draining"]

# A worker whose actor Ray has not placed this long after its launch is reported, and again every
# UNPLACED_REPEAT_S while it waits: what it asks for against what the cluster's nodes have, so that a start
# waiting on resources (held by other actors, or more than any node has) is seen, not a silent hang.
UNPLACED_WARN_S = 10.0
UNPLACED_REPEAT_S = 60.0


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    max_restarts: int = 5
    window_s: float = 300.0
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0

    @classmethod
    def from_settings(cls, settings: Settings) -> RestartPolicy:
        return cls(max_restarts=settings.pool_max_restarts, window_s=settings.pool_restart_window_s,
                   backoff_s=settings.pool_restart_backoff_s,
                   backoff_max_s=settings.pool_restart_backoff_max_s)

    def delay_s(self, num_recent_restarts: int) -> float:
        return min(self.backoff_s * 2.0**num_recent_restarts, self.backoff_max_s)


@dataclass(slots=True)
class Member:
    worker_id: str
    state: MemberState
    seen_s: float  # when it was launched or last answered a health check
    info: WorkerInfo | None = None


@dataclass(slots=True)
class PoolPolicy:
    """The pool's state and decisions, with no I/O. Every method that depends on time takes `now_s`."""

    name: str
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    unresponsive_s: float = 15.0
    target: int = 0
    members: dict[str, Member] = field(default_factory=dict)
    _ids: itertools.count[int] = field(default_factory=itertools.count)
    _restarts_s: deque[float] = field(default_factory=deque)
    _last_failure_s: float | None = None
    following: bool = False  # follow mode: nodes leave before their workers are seen dead (see `follow`)
    # follow mode: how long fewer nodes than starting and serving workers must last before a starting worker
    # is dropped (a node's resources can drop out of the cluster's count for a moment under load)
    node_grace_s: float = 5.0
    _fewer_nodes_since_s: float | None = None

    @property
    def num_active(self) -> int:
        """Workers starting or serving: those that count towards the target."""
        return sum(m.state != "draining" for m in self.members.values())

    def serving(self) -> list[WorkerInfo]:
        return [m.info for m in self.members.values() if m.state == "serving" and m.info is not None]

    def add(self, now_s: float) -> str:
        """Grow the target by one and start a worker for it now; returns its id."""
        self.target += 1
        return self._new_member(now_s)

    def ready(self, worker_id: str, info: WorkerInfo, now_s: float) -> bool:
        """A starting worker is serving; False when the pool no longer wants it (removed while starting)."""
        member = self.members.get(worker_id)
        if member is None or member.state != "starting":
            return False
        member.state, member.info, member.seen_s = "serving", info, now_s
        return True

    def remove(self, worker_id: str | None = None) -> Member:
        """Shrink the target by one and mark a worker draining: `worker_id`, or else a starting one (no work
        is lost), or else the newest serving one. Raises PoolError when there is no such worker."""
        if worker_id is None:
            active = [m for m in self.members.values() if m.state != "draining"]
            if not active:
                raise PoolError(f"pool {self.name} has no worker to remove", pool=self.name)
            starting = [m for m in active if m.state == "starting"]
            member = (starting or active)[-1]
        else:
            found = self.members.get(worker_id)
            if found is None or found.state == "draining":
                raise PoolError(f"pool {self.name} has no worker {worker_id} to remove", pool=self.name,
                                worker_id=worker_id)
            member = found
        member.state = "draining"
        self.target -= 1
        return member

    def follow(self, num_nodes: int, now_s: float) -> tuple[list[str], list[str]]:
        """Follow mode: the target is the number of nodes made for this pool (one worker each). Returns (ids of
        workers to start now for nodes that joined, ids of starting workers to drop for nodes that left, once
        there have been fewer nodes than such workers for `node_grace_s`). A serving worker whose node left is not dropped here: it dies with its node and its death is seen by
        the health check (so `num_active` may exceed `target` until then). A worker that dies while its node
        stays is replaced by `replacements`, under the restart policy."""
        new = [self._new_member(now_s) for _ in range(num_nodes - max(self.target, self.num_active))]
        self.target, self.following = num_nodes, True
        dropped: list[str] = []
        if self.num_active <= num_nodes:
            self._fewer_nodes_since_s = None
            return new, dropped
        if self._fewer_nodes_since_s is None:
            self._fewer_nodes_since_s = now_s
        if now_s - self._fewer_nodes_since_s < self.node_grace_s:
            return new, dropped
        for member in reversed([m for m in self.members.values() if m.state == "starting"]):
            if self.num_active <= self.target:
                break
            member.state = "draining"
            dropped.append(member.worker_id)
        return new, dropped

    def seen(self, worker_id: str, now_s: float) -> None:
        if (member := self.members.get(worker_id)) is not None:
            member.seen_s = now_s

    def unresponsive(self, now_s: float) -> list[str]:
        """Serving workers that have answered no health check for `unresponsive_s`."""
        return [m.worker_id for m in self.members.values()
                if m.state == "serving" and now_s - m.seen_s > self.unresponsive_s]

    def died(self, worker_id: str, now_s: float) -> Member | None:
        """A worker is gone (crashed, killed, failed to start, or exited after draining); None if unknown.
        Only an unexpected death counts as a failure towards a replacement."""
        member = self.members.pop(worker_id, None)
        if member is not None and member.state != "draining":
            self._last_failure_s = now_s
        return member

    def replacements(self, now_s: float) -> list[str]:
        """Ids of the workers to start now to make up for dead ones, as far as the restart policy allows."""
        while self._restarts_s and now_s - self._restarts_s[0] >= self.restart.window_s:
            self._restarts_s.popleft()
        missing = self.target - self.num_active
        budget = self.restart.max_restarts - len(self._restarts_s)
        if missing <= 0 or budget <= 0:
            return []
        last_failure_s = now_s if self._last_failure_s is None else self._last_failure_s
        if now_s < last_failure_s + self.restart.delay_s(len(self._restarts_s)):
            return []
        started = [self._new_member(now_s) for _ in range(min(missing, budget))]
        self._restarts_s.extend(now_s for _ in started)
        return started

    def is_short(self, now_s: float) -> bool:
        """Below target with the restart budget spent (the pool waits for the window to move on)."""
        recent = sum(now_s - t < self.restart.window_s for t in self._restarts_s)
        return self.num_active < self.target and recent >= self.restart.max_restarts

    def check_integrity(self) -> None:
        assert self.target >= 0, self.target
        assert self.num_active <= self.target or self.following, (self.num_active, self.target)
        for worker_id, member in self.members.items():
            assert member.worker_id == worker_id
            assert member.state != "serving" or member.info is not None, worker_id

    def _new_member(self, now_s: float) -> str:
        worker_id = f"{self.name}-{next(self._ids)}"
        self.members[worker_id] = Member(worker_id, "starting", now_s)
        return worker_id


def node_resource(role: str, model_index: int = 0) -> str:
    """The Ray resource a node made for a pool of `role` offers (one unit: one worker), in follow mode: the first
    (default) model's `dynserve_pool_ROLE`, the I-th model's `dynserve_pool_mI_ROLE` (counting from 0), so each
    model's pools follow only the nodes made for them (the operator's pods offer the same: its `pool_resource`)."""
    return f"dynserve_pool_{role}" if model_index == 0 else f"dynserve_pool_m{model_index}_{role}"


def worker_resources(num_cluster_gpus: float, num_cpus: float) -> dict[str, float]:
    """Ray resources of one worker, whatever its role: a whole GPU each when the cluster has GPUs, else only
    `num_cpus` (fractional on a small CPU machine, so several workers fit)."""
    return {"num_cpus": num_cpus, "num_gpus": 1.0 if num_cluster_gpus > 0 else 0.0}


class WorkerPool:
    """Ray actors running `PoolPolicy`'s decisions. Use from one asyncio loop; Ray must be initialized.

    `start(n)` and `add()` return once the new workers serve (they have registered by then); `remove()`
    drains a worker and ends its actor; `workers()` lists the serving ones; `close()` ends them all.

    Follow mode (`settings.pools_follow_nodes`, how the operator runs a fleet): the pool's size is not asked
    for but read from the cluster: one worker on each node offering the resource `node_resource(role,
    model_index)` (a Kubernetes pod of the pool's Deployment: `model_index` is the pool's model among those one
    gateway serves), taking that node's CPUs and GPUs; `start` returns the workers serving once the first of
    them does, and the monitor follows nodes as they join and leave.
    """

    def __init__(self, settings: Settings, *, name: str = "pool", role: Role = "both",
                 registry: EventPlane | None = None, model_index: int = 0) -> None:
        self.settings, self.role = settings, role
        self.node_resource = node_resource(role, model_index)  # the nodes it follows (follow mode)
        self.policy = PoolPolicy(name, RestartPolicy.from_settings(settings), settings.pool_unresponsive_s)
        self._registry = registry
        self._owns_registry = registry is None  # then `registry` connects on first use and `close` closes it
        self._handles: dict[str, Any] = {}
        self._watches: dict[str, asyncio.Task[None]] = {}  # each serving worker's `_watch`
        self._monitor: asyncio.Task[None] | None = None
        self._resources: dict[str, float] | None = None
        self._said_short = False

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def registry(self) -> EventPlane:
        if self._registry is None:
            from dynserve.events.ray_plane import connect_event_plane

            self._registry = connect_event_plane(self.settings.redis_url, self.settings.namespace,
                                                 cluster_token=self.settings.secret("cluster_token"))
        return self._registry

    def workers(self) -> list[WorkerInfo]:
        return self.policy.serving()

    def handle(self, worker_id: str) -> Any:
        """The Ray actor handle of a live worker; raises PoolError for an unknown one."""
        if worker_id not in self._handles:
            raise PoolError(f"pool {self.name} has no worker {worker_id}", pool=self.name,
                            worker_id=worker_id)
        return self._handles[worker_id]

    async def start(self, num_workers: int) -> list[WorkerInfo]:
        """Start `num_workers` more workers; returns their infos once all serve. In follow mode, one worker per
        node made for the pool instead (`num_workers` is ignored): returns once one serves."""
        if self.settings.pools_follow_nodes:
            return await self._start_following()
        return list(await asyncio.gather(*(self.add() for _ in range(num_workers))))

    async def _start_following(self) -> list[WorkerInfo]:
        if self._monitor is None:
            self._monitor = asyncio.create_task(self._monitor_forever(), name=f"pool-{self.name}")
        while not self.policy.serving():
            await asyncio.sleep(self.settings.pool_health_interval_s)
        return self.policy.serving()

    async def _follow_nodes(self) -> None:
        """Follow mode: grow or shrink to the nodes offering this pool's resource."""
        import ray

        total = await asyncio.to_thread(ray.cluster_resources)
        new, dropped = self.policy.follow(int(total.get(self.node_resource, 0)), time.monotonic())
        for worker_id in dropped:
            logger.info("pool %s: its node left before %s started; dropping it", self.name, worker_id)
            self.policy.died(worker_id, time.monotonic())
            self._end(worker_id)
        for worker_id in new:
            logger.info("pool %s: a node joined; starting %s", self.name, worker_id)
            asyncio.create_task(self._replace(worker_id), name=f"start-{worker_id}")

    async def add(self) -> WorkerInfo:
        """Start one more worker; its info once it serves. Raises PoolError if it fails to start (the pool
        then replaces it per its restart policy)."""
        if self._monitor is None:  # watching starts with the first worker
            self._monitor = asyncio.create_task(self._monitor_forever(), name=f"pool-{self.name}")
        worker_id = self.policy.add(time.monotonic())
        return await self._launch(worker_id)

    async def remove(self, worker_id: str | None = None, *, timeout_s: float | None = None) -> str:
        """Drain a worker (see `PoolPolicy.remove` for which), wait for its in-flight requests for up to
        `timeout_s` (default: the pool's drain timeout), end its actor, and return its id once the actor
        has exited (its resources are free)."""
        member = self.policy.remove(worker_id)
        handle = self._handles.get(member.worker_id)
        await self._deregister(member.worker_id)
        if handle is not None and member.info is not None:
            drain_timeout_s = self.settings.pool_drain_timeout_s if timeout_s is None else timeout_s
            try:
                num_cut = await handle.drain.remote(drain_timeout_s)
                logger.info("pool %s: worker %s drained (%d requests cut)", self.name, member.worker_id,
                            num_cut)
            except Exception as exc:  # it died while draining: nothing left to wait for
                logger.warning("pool %s: worker %s died while draining: %s", self.name, member.worker_id, exc)
        self.policy.died(member.worker_id, time.monotonic())
        self._end(member.worker_id)
        if handle is not None:
            await _wait_for_exit(handle)
        return member.worker_id

    async def close(self) -> None:
        """End the monitor and every worker (no draining)."""
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        worker_ids = list(self.policy.members)
        for worker_id in worker_ids:
            self.policy.died(worker_id, time.monotonic())
            self._end(worker_id)
        self.policy.target = 0
        await asyncio.gather(*(self._deregister(w) for w in worker_ids))
        if self._owns_registry and self._registry is not None:
            await self._registry.close()

    # ---- the shell -------------------------------------------------------------------------------------

    async def _launch(self, worker_id: str) -> WorkerInfo:
        settings = self.settings
        if settings.pools_follow_nodes:  # the whole node is the worker's
            cpus, gpus = await asyncio.to_thread(self._node_size)
            settings = settings.model_copy(update={"num_threads": settings.num_threads or max(1, int(cpus))})
            resources: dict[str, Any] = {"num_cpus": cpus, "num_gpus": gpus,
                                         "resources": {self.node_resource: 1.0}}
        else:
            if self._resources is None:
                self._resources = _launch_resources(settings)
            resources = dict(self._resources)
        try:
            handle, info_ref = launch_worker(settings, worker_id, self.role, publish_events=True, **resources)
            self._handles[worker_id] = handle
            needs = ray_needs(settings, resources)
            info: WorkerInfo = await self._started(worker_id, handle, info_ref, needs)
        except Exception as exc:
            logger.error("pool %s: worker %s failed to start: %s", self.name, worker_id, exc)
            self._on_death(worker_id)
            raise PoolError(f"worker {worker_id} of pool {self.name} failed to start: {exc}", pool=self.name,
                            worker_id=worker_id) from exc
        if not self.policy.ready(worker_id, info, time.monotonic()):  # removed or dead while starting
            raise PoolError(f"worker {worker_id} of pool {self.name} was removed while starting",
                            pool=self.name, worker_id=worker_id)
        logger.info("pool %s: worker %s serving at %s:%d", self.name, worker_id, info.host, info.port)
        self._watches[worker_id] = asyncio.create_task(self._watch(worker_id, handle),
                                                       name=f"watch-{worker_id}")
        return info

    async def _watch(self, worker_id: str, handle: Any) -> None:
        """A call the worker's actor never answers: when it fails on the actor's death, the worker is dead to
        the pool at once rather than at the next health check (which is for an engine that stopped or a
        worker that hangs, and so can be rare: each check is an actor call, about 1 ms of CPU on each
        side)."""
        from ray.exceptions import RayActorError

        try:
            await handle.until_dead.remote()
        except RayActorError:
            if self._handles.get(worker_id) is handle:
                self._on_death(worker_id)
        except Exception as exc:  # e.g. unreachable for a while: the health checks take it from here
            logger.debug("pool %s: stopped watching %s: %s", self.name, worker_id, exc)

    async def _started(self, worker_id: str, handle: Any, info_ref: Any,
                       needs: dict[str, float]) -> WorkerInfo:
        """`info_ref` awaited; while the worker's actor is not placed, say so (`UNPLACED_WARN_S`)."""
        waiting = asyncio.ensure_future(info_ref)
        timeout_s = UNPLACED_WARN_S
        try:
            while True:
                try:
                    info: WorkerInfo = await asyncio.wait_for(asyncio.shield(waiting), timeout_s)
                    return info
                except TimeoutError:
                    pass
                timeout_s = UNPLACED_REPEAT_S
                if await asyncio.to_thread(_is_placed, handle):
                    continue  # placed: its model is loading
                nodes, free = await asyncio.to_thread(_cluster_resources)
                logger.warning("pool %s: worker %s is not placed by Ray yet: %s", self.name, worker_id,
                               placement_shortfall(needs, nodes, free))
        finally:
            waiting.cancel()

    def _node_size(self) -> tuple[float, float]:
        """(CPUs, GPUs) of a node made for this pool (they are alike: one pod template)."""
        import ray

        for node in ray.nodes():
            if node.get("Alive") and self.node_resource in node.get("Resources", {}):
                gpus = 0.0 if self.settings.mocker is not None else node["Resources"].get("GPU", 0.0)
                return node["Resources"].get("CPU", 0.0), gpus
        return 0.0, 0.0

    async def _monitor_forever(self) -> None:
        next_follow_s = 0.0
        while True:
            await asyncio.sleep(self.settings.pool_health_interval_s)
            try:
                if self.settings.pools_follow_nodes and time.monotonic() >= next_follow_s:
                    next_follow_s = time.monotonic() + 1.0  # reads the cluster's resources from Ray's GCS
                    await self._follow_nodes()
                await self._check_once()
            except Exception:  # keep watching whatever one round hit
                logger.exception("pool %s: health check round failed", self.name)

    async def _check_once(self) -> None:
        members = [m for m in self.policy.members.values() if m.state != "starting"]
        dead = await asyncio.gather(*(self._is_dead(m.worker_id) for m in members))
        now_s = time.monotonic()
        for member, is_dead in zip(members, dead, strict=True):
            if is_dead:
                self._on_death(member.worker_id)
        for worker_id in self.policy.unresponsive(now_s):
            logger.error("pool %s: worker %s unresponsive for %.0f s; replacing it", self.name, worker_id,
                         self.policy.unresponsive_s)
            self._on_death(worker_id)
        for worker_id in self.policy.replacements(now_s):
            logger.warning("pool %s: starting %s to replace a dead worker", self.name, worker_id)
            asyncio.create_task(self._replace(worker_id), name=f"start-{worker_id}")
        short = self.policy.is_short(now_s)
        if short and not self._said_short:
            logger.error("pool %s: %d of %d workers; the restart budget (%d per %.0f s) is spent", self.name,
                         self.policy.num_active, self.policy.target, self.policy.restart.max_restarts,
                         self.policy.restart.window_s)
        self._said_short = short

    async def _is_dead(self, worker_id: str) -> bool:
        """True when the actor is gone or its engine has stopped; a slow answer is not death (see
        `PoolPolicy.unresponsive`)."""
        from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

        handle = self._handles.get(worker_id)
        if handle is None:
            return False
        try:
            timeout_s = self.settings.pool_health_interval_s * 4
            healthy = await asyncio.wait_for(handle.is_healthy.remote(), timeout_s)
        except (TimeoutError, GetTimeoutError, ActorUnavailableError):
            return False
        except RayActorError:
            return True
        self.policy.seen(worker_id, time.monotonic())
        return not healthy

    async def _replace(self, worker_id: str) -> None:
        with contextlib.suppress(PoolError):  # logged; the next round decides again
            await self._launch(worker_id)

    def _on_death(self, worker_id: str) -> None:
        member = self.policy.died(worker_id, time.monotonic())
        if member is None:
            return
        if member.state != "draining":
            logger.warning("pool %s: worker %s (%s) is dead", self.name, worker_id, member.state)
        self._end(worker_id)
        asyncio.create_task(self._deregister(worker_id), name=f"deregister-{worker_id}")

    def _end(self, worker_id: str) -> None:
        """Kill the actor if it still runs and forget its handle."""
        import ray

        watch = self._watches.pop(worker_id, None)
        if watch is not None and watch is not asyncio.current_task():
            watch.cancel()
        handle = self._handles.pop(worker_id, None)
        if handle is not None:
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)

    async def _deregister(self, worker_id: str) -> None:
        try:
            await self.registry.deregister(worker_id)
        except Exception as exc:  # the lease runs out instead
            logger.warning("pool %s: could not deregister %s: %s", self.name, worker_id, exc)


def _launch_resources(settings: Settings) -> dict[str, float]:
    """`launch_worker`'s resource arguments for a worker of `settings` (a GPU each where the cluster has
    GPUs, a mocker never). Ray must be initialized."""
    import ray

    num_gpus = 0.0 if settings.mocker is not None else ray.cluster_resources().get("GPU", 0.0)
    return worker_resources(num_gpus, reserved_cpus(settings))


def ray_needs(settings: Settings, launch: dict[str, Any]) -> dict[str, float]:
    """What a worker launched with `launch` (`launch_worker`'s resource arguments) asks Ray for, by Ray's
    resource names; its CPUs default as `launch_worker`'s do."""
    num_cpus = launch.get("num_cpus")
    needs = {"CPU": reserved_cpus(settings) if num_cpus is None else float(num_cpus),
             "GPU": float(launch.get("num_gpus") or 0.0), **launch.get("resources", {})}
    return {name: amount for name, amount in needs.items() if amount > 0}


def _num_fitting(needs: dict[str, float], node: dict[str, float]) -> int:
    """How many actors asking for `needs` the resources of `node` hold at once."""
    return min((int(node.get(name, 0.0) / amount + 1e-9) for name, amount in needs.items()), default=1 << 30)


def _amounts(names: dict[str, float], resources: dict[str, float]) -> str:
    """`resources`' amounts of the resources `names` names, in words ("CPU 2, GPU 0")."""
    return ", ".join(f"{name} {resources.get(name, 0.0):g}" for name in names)


def placement_shortfall(needs: dict[str, float], nodes: list[dict[str, float]],
                        free: dict[str, float]) -> str:
    """Why an actor asking for `needs` may wait, in words: when no live node's total (`nodes`, one dict of
    resources each) holds it, that no node can; else what the whole cluster has free now (`free`)."""
    asked = _amounts(needs, needs)
    if not any(_num_fitting(needs, node) for node in nodes):
        listed = "; ".join(_amounts(needs, node) for node in nodes) if nodes else "none"
        return (f"it asks for {asked} and no live node has that much (the nodes: {listed}); it starts only "
                f"if such a node joins")
    return (f"it asks for {asked}; free in the cluster now: {_amounts(needs, free)} (other actors hold the "
            f"rest); it starts once they free it")


def check_placeable(settings: Settings, num_workers: int = 1) -> None:
    """Raise PoolError, in words, when the live nodes of the cluster cannot hold `num_workers` of `settings`'
    workers at once. For a Ray this process started (one node, no autoscaler to add one), before any worker
    starts: else a start would wait forever. Ray must be initialized."""
    needs = ray_needs(settings, _launch_resources(settings))
    nodes, free = _cluster_resources()
    fits = sum(_num_fitting(needs, node) for node in nodes)
    if fits >= num_workers:
        return
    if fits == 0:
        raise PoolError(f"no worker can start on this Ray: {placement_shortfall(needs, nodes, free)}; set "
                        f"--worker-num-cpus to at most a node's CPUs", pool="fleet")
    raise PoolError(f"{num_workers} workers cannot start on this Ray at once: each asks for "
                    f"{_amounts(needs, needs)}, and its nodes hold {fits}; start fewer workers or set "
                    f"--worker-num-cpus lower", pool="fleet")


def _is_placed(handle: Any) -> bool:
    """Whether Ray has given the actor of `handle` a worker process (True when that cannot be told)."""
    from ray._private import state

    try:
        info = state.actors(actor_id=handle._actor_id.hex())
    except Exception:  # a private API: never let it stop a start
        return True
    return bool(info.get("Pid")) or info.get("State") not in ("DEPENDENCIES_UNREADY", "PENDING_CREATION")


def _cluster_resources() -> tuple[list[dict[str, float]], dict[str, float]]:
    """Each live node's total resources, and what the cluster has free now."""
    import ray

    nodes = [dict(node.get("Resources", {})) for node in ray.nodes() if node.get("Alive")]
    return nodes, dict(ray.available_resources())


async def _wait_for_exit(handle: Any, timeout_s: float = 30.0) -> None:
    """Return once a killed actor no longer answers (`ray.kill` only asks for the kill)."""
    from ray.exceptions import RayActorError

    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        try:
            await asyncio.wait_for(handle.is_healthy.remote(), 1.0)
        except RayActorError:
            return
        except TimeoutError:
            pass
        await asyncio.sleep(0.05)
    logger.warning("an actor asked to exit still answers after %.0f s", timeout_s)
