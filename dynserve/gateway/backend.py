"""The gateway's view of its workers: who they are, one channel each, their polled loads, and which one gets
a request.

Membership. With a `registry` (the event plane's, `EventPlane.workers()`), the registry is the source of
truth: every `registry_interval_s` the set is brought in line with the workers it lists
(`membership_changes`), so workers a pool adds become routable, and workers that leave it (drained ones
deregister themselves, the pool deregisters dead ones, a lease that is not renewed runs out) stop getting
requests (except when several vanish at once, channels up: a registry that restarted lists nobody until the
workers' next heartbeats, so those leave only if still missing after `registry_grace_s`). Without one, the
workers given at construction are the members for good. Either way the channel is the fastest signal of
death: a worker whose connection drops is left out of picking at once, reconnected on the next load poll if
it still answers, and forgotten by the router.

A worker that leaves keeps its channel until the streams it is serving end, so draining never cuts a
response; it gets no new request.

`WorkerSet.generate` picks a worker (the router's choice, else least loaded: its reported running + waiting
requests plus what this gateway has sent it since), streams the request from it, and, when the worker fails
before the first token reaches the client, retries on another worker, so a dead or draining worker costs a
retry, not a request. When it fails mid-stream (its channel drops, or it cuts the request), the request
migrates: another worker continues it from the prompt plus the tokens already sent, and the client's stream
goes on with no gap and no repeat, its usage counted over both (at most `migration_limit` times).

Disaggregated serving: a set of decode workers (`roles={"decode"}`) holds a second set, its prefill workers
(`prefill=`), each with its own router over the same registry. `generate` then decides where the prompt is
prefilled (`disagg.prefill_path`). Remote: the prefill set runs it `prefill_only` (retried across prefill
workers), the decode set runs it with the returned `RemotePrefill` (retried across decode workers), and the
prefill worker is told to release its blocks once the decode worker's first delta shows it has them (or the
request ends, whichever is first). The prefill's first token goes to the client at once (the decode
worker's first delta repeats it and is trimmed), so the transfer and the decode worker's queue are not in
the time to first token. A prefill that fails on every prefill worker falls back to prefilling on
the decode worker; a failed read falls back there too (the decode worker does it and says so in its first
delta). Both are counted (`on_fallback`); the client sees neither.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

import msgspec

from dynserve.errors import WorkerUnavailableError
from dynserve.events.base import EventPlane
from dynserve.gateway.disagg import prefill_path
from dynserve.protocol import GenerateRequest, KVSnapshot, RemotePrefill, TokenDelta, WorkerInfo, WorkerLoad
from dynserve.router.router import Router
from dynserve.workers.channel import WorkerConnection

__all__ = ["WorkerSet", "membership_changes", "without_first_token"]

logger = logging.getLogger(__name__)

_PREFILL = frozenset({"prefill"})


def without_first_token(delta: TokenDelta, first: TokenDelta) -> TokenDelta:
    """A decode worker's first delta (after a remote prefill) less the first token, which `first`, the prefill
    worker's delta, already gave the client: the same token, its text and its logprob."""
    text = delta.text
    if text.startswith(first.text):
        text = text[len(first.text):]
    else:  # both workers detokenize the same prompt and token, so this does not happen; keep the text whole
        logger.warning("request %s: the decode worker's first text %r does not start with the prefill's %r",
                       delta.request_id, text, first.text)
    return msgspec.structs.replace(delta, token_ids=delta.token_ids[1:], text=text,
                                   logprobs=delta.logprobs[1:] if delta.logprobs else delta.logprobs)


def membership_changes(current: Mapping[str, WorkerInfo],
                       listed: Sequence[WorkerInfo]) -> tuple[list[WorkerInfo], list[str]]:
    """(workers to add, ids to remove) to turn `current` into `listed`. A worker listed with a different
    address or identity than the one held (a restart under the same id) is removed and added again."""
    by_id = {info.worker_id: info for info in listed}
    removed = [wid for wid, info in current.items() if by_id.get(wid) != info]
    added = [info for wid, info in by_id.items() if current.get(wid) != info]
    return added, removed


class WorkerSet:
    def __init__(
        self,
        infos: list[WorkerInfo],
        *,
        router: Router | None = None,
        registry: EventPlane | None = None,
        registry_interval_s: float = 0.25,
        poll_interval_s: float = 0.5,
        on_load: Callable[[WorkerLoad], None] | None = None,
        on_down: Callable[[WorkerInfo], None] | None = None,
        on_retry: Callable[[], None] | None = None,
        roles: frozenset[str] | None = None,
        prefill: WorkerSet | None = None,
        local_prefill_tokens: int = 0,
        max_prefill_queue: int = 2,
        on_disagg: Callable[[str], None] | None = None,
        on_fallback: Callable[[str], None] | None = None,
    ) -> None:
        """`roles`: only workers of these roles are members (None: any). `prefill`: the prefill workers of a
        disaggregated deployment (this set holds the decode workers); `local_prefill_tokens` and
        `max_prefill_queue` decide which prompts still prefill here (see `disagg.prefill_path`)."""
        self.roles = roles
        infos = [info for info in infos if roles is None or info.role in roles]
        if not infos and registry is None:
            raise ValueError("a WorkerSet needs at least one worker or a registry to find them in")
        self.prefill = prefill
        self.local_prefill_tokens, self.max_prefill_queue = local_prefill_tokens, max_prefill_queue
        self._on_disagg, self._on_fallback = on_disagg, on_fallback
        self.connections = {info.worker_id: WorkerConnection(info) for info in infos}  # the members
        self.router = router
        self.registry = registry
        self.loads: dict[str, WorkerLoad] = {}
        self.num_routed: Counter[str] = Counter()  # requests sent to each worker, retries included
        self._leaving: list[WorkerConnection] = []  # left the set, still finishing streams
        self._identity: WorkerInfo | None = infos[0] if infos else None
        self._load_seen_s: dict[str, float] = {}
        self._poll_interval_s, self._registry_interval_s = poll_interval_s, registry_interval_s
        self._on_load, self._on_down, self._on_retry = on_load, on_down, on_retry
        self._on_leave: Callable[[WorkerInfo], None] | None = None  # a member left the set (its series go)
        self._on_migration: Callable[[str], None] | None = None  # a request moved mid-stream (the reason)
        self.migration_limit = 3  # migrations of one request at most (Settings.migration_limit)
        self.registry_grace_s = 3.0  # a member missing from the registry leaves after this (Settings.worker_lease_s)
        self._missing_since: dict[str, float] = {}
        self.cluster_token: str | None = None  # presented to every worker on connecting (Settings.cluster_token)
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def model_id(self) -> str:
        return self._known().model_id

    @property
    def max_model_len(self) -> int:
        if not self.connections:
            return self._known().max_model_len
        return min(c.info.max_model_len for c in self.connections.values())

    def _known(self) -> WorkerInfo:
        """The first worker ever seen: what this gateway serves (one model) even when no worker is up."""
        if self._identity is None:
            raise WorkerUnavailableError("no worker has registered yet", worker_id=None)
        return self._identity

    async def start(self) -> None:
        if self.prefill is not None:
            await self.prefill.start()
        await asyncio.gather(*(self._connect(c) for c in self.connections.values()))
        if self.registry is not None:
            await self.refresh_members()
            self._tasks.append(asyncio.create_task(self._follow_registry(), name="worker-registry"))
        await self.poll_once()
        self._tasks.append(asyncio.create_task(self._poll_forever(), name="worker-load-poller"))

    async def snapshot(self, worker_id: str) -> KVSnapshot:
        connection = self.connections.get(worker_id)
        if connection is None and self.prefill is not None:
            connection = self.prefill.connections.get(worker_id)
        if connection is None:
            raise WorkerUnavailableError(f"unknown worker {worker_id}", worker_id=worker_id)
        return await connection.snapshot()

    async def stop(self) -> None:
        if self.prefill is not None:
            await self.prefill.stop()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.gather(*(c.close() for c in [*self.connections.values(), *self._leaving]))

    def is_ready(self) -> bool:
        """True when some worker's channel is open and it reported a load within the last 10 polls (5 s at
        least: on a busy host a load reply can take a second or more, and that is no reason to refuse)."""
        now = time.monotonic()
        horizon_s = max(10 * self._poll_interval_s, 5.0)
        return any(c.is_open and now - self._load_seen_s.get(wid, -1e9) <= horizon_s
                   for wid, c in self.connections.items())

    def num_queued(self) -> int:
        """Requests queued or running on the members (each counted as `_pending` counts it for picking)."""
        return sum(map(self._pending, self.connections.values()))

    def routable_ids(self) -> list[str]:
        """Members whose channel is open: the workers a new request may go to."""
        return sorted(wid for wid, c in self.connections.items() if c.is_open)

    def pick(self, exclude: set[str], token_ids: list[int] | None = None) -> WorkerConnection | None:
        """An open member not in `exclude`: the router's choice when there is one, else the least busy."""
        return self.pick_with_overlap(exclude, token_ids)[0]

    def pick_with_overlap(self, exclude: set[str],
                          token_ids: list[int] | None = None) -> tuple[WorkerConnection | None, int]:
        """`pick`, and how many of the prompt's blocks the chosen worker caches (0 when no router knows)."""
        candidates = [c for wid, c in self.connections.items() if c.is_open and wid not in exclude]
        if not candidates:
            return None, 0
        if self.router is not None and token_ids is not None and (len(candidates) > 1 or self.roles == _PREFILL):
            chosen, overlap = self.router.pick(token_ids, [c.worker_id for c in candidates], self.loads)
            return self.connections[chosen], overlap
        return min(candidates, key=self._pending), 0

    def _pending(self, connection: WorkerConnection) -> int:
        load = self.loads.get(connection.worker_id)
        reported = load.num_running + load.num_waiting if load is not None else 0
        return max(reported, connection.num_open_streams)

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Stream `request` from the best worker, retrying elsewhere until its first delta arrives; in a
        disaggregated set, prefilled where `disagg.prefill_path` says (see the module's docstring)."""
        if self.prefill is None:
            return self._generate_here(request)
        return self._generate_disaggregated(request, self.prefill)

    async def _generate_disaggregated(self, request: GenerateRequest, prefill: WorkerSet) -> AsyncIterator[TokenDelta]:
        connection, overlap_blocks = prefill.pick_with_overlap(set(), request.token_ids)
        block_size = connection.info.block_size if connection is not None else 1
        num_prefill = len(prefill.routable_ids())
        path = prefill_path(
            num_uncached_tokens=len(request.token_ids) - overlap_blocks * block_size,
            num_prefill_queued=prefill.num_queued(),
            num_prefill_workers=num_prefill, local_prefill_tokens=self.local_prefill_tokens,
            max_prefill_queue=self.max_prefill_queue)
        if self._on_disagg is not None:
            self._on_disagg(path)
        prefilled = await self._prefill_remotely(prefill, request, connection) if path == "remote" else None
        if prefilled is not None and prefilled.kv_handle is None:  # the first token ended it (stop, length)
            yield prefilled
            return
        if prefilled is None:  # prefilled on the decode worker: by choice, or after the prefill failed
            async with contextlib.aclosing(self._generate_here(request)) as stream:
                async for delta in stream:
                    yield delta
            return
        handle = prefilled.kv_handle
        assert handle is not None
        remote = RemotePrefill(handle=handle, first_token_id=prefilled.token_ids[0],
                               first_logprob=prefilled.logprobs[0] if prefilled.logprobs else None,
                               num_cached_tokens=prefilled.num_cached_tokens)
        # The first token is the prefill worker's whatever happens next, so the client gets it now, not after
        # the decode worker has been picked, read the KV and stepped once; that worker's first delta repeats it.
        yield msgspec.structs.replace(prefilled, finished=False, finish_reason=None, kv_handle=None)
        released = False
        try:
            async with contextlib.aclosing(self._generate_here(
                    msgspec.structs.replace(request, remote_prefill=remote))) as stream:
                async for delta in stream:
                    if not released:
                        released = True
                        self._release(prefill, handle.worker_id, request.request_id)
                        if delta.kv_fallback is not None and self._on_fallback is not None:
                            self._on_fallback(delta.kv_fallback)
                        delta = without_first_token(delta, prefilled)
                        if not delta.token_ids and not delta.finished:
                            continue
                    yield delta
        finally:
            if not released:
                self._release(prefill, handle.worker_id, request.request_id)

    async def _prefill_remotely(self, prefill: WorkerSet, request: GenerateRequest,
                                connection: WorkerConnection | None) -> TokenDelta | None:
        """Run `request` prefill-only on the prefill set (`connection` first); its one delta, or None when no
        prefill worker could (counted as a fallback)."""
        prefilled: TokenDelta | None = None
        try:
            async with contextlib.aclosing(prefill._generate_here(
                    msgspec.structs.replace(request, prefill_only=True), first=connection)) as stream:
                async for delta in stream:
                    prefilled = delta
        except WorkerUnavailableError as exc:  # no prefill worker could do it: the decode worker will
            logger.warning("request %s: prefill failed on every prefill worker (%s); prefilling on a decode "
                           "worker", request.request_id, exc)
            if self._on_fallback is not None:
                self._on_fallback("prefill_failed")
        return prefilled

    @staticmethod
    def _release(prefill: WorkerSet, worker_id: str, request_id: str) -> None:
        connection = prefill.connections.get(worker_id)
        if connection is not None:
            with contextlib.suppress(WorkerUnavailableError):
                connection.release(request_id)

    async def _generate_here(self, request: GenerateRequest,
                             first: WorkerConnection | None = None) -> AsyncIterator[TokenDelta]:
        """Stream `request` from one of this set's workers (`first` if given), retrying elsewhere until its
        first delta arrives, and migrating it when its worker fails mid-stream (see `_migration`)."""
        tried: set[str] = set()
        sent: list[int] = []  # the tokens the client has had, over every worker the request ran on
        num_migrations, current = 0, request
        num_cached: int | None = None
        while True:
            connection, first = first or self.pick(tried, current.token_ids), None
            if connection is None:
                raise WorkerUnavailableError(
                    f"no worker can take the request (tried {sorted(tried) or 'none'})", worker_id=None
                )
            started, base = False, len(sent) if current is not request else 0
            self.num_routed[connection.worker_id] += 1
            if self.router is not None:
                block_size = connection.info.block_size
                self.router.routed(request.request_id, connection.worker_id,
                                   (len(current.token_ids) + current.params.max_tokens) // block_size + 1)
            reason: str | None = None
            try:
                async with contextlib.aclosing(connection.generate(current)) as stream:
                    async for delta in stream:
                        started = True
                        if current is not request:  # a continuation: its usage as the client's request sees it
                            delta = msgspec.structs.replace(
                                delta, num_prompt_tokens=len(request.token_ids), num_cached_tokens=num_cached or 0,
                                num_output_tokens=base + delta.num_output_tokens)
                        elif num_cached is None:
                            num_cached = delta.num_cached_tokens
                        if (delta.finish_reason == "abort" and not request.prefill_only
                                and num_migrations < self.migration_limit):
                            # the worker cut it (its drain ran out of time): the client did not ask for that
                            reason = "worker_aborted"
                            delta = msgspec.structs.replace(delta, finished=False, finish_reason=None)
                        sent.extend(delta.token_ids)
                        if delta.token_ids or reason is None:
                            yield delta
                        if reason is not None:
                            break
                if reason is None:
                    return
            except WorkerUnavailableError as exc:
                if not started:
                    tried.add(connection.worker_id)
                    logger.warning("request %s: worker %s failed before its first token (%s); retrying",
                                   request.request_id, connection.worker_id, exc)
                    if self._on_retry is not None:
                        self._on_retry()
                    continue
                if request.prefill_only or num_migrations >= self.migration_limit:
                    raise
                reason = "worker_failed"
            finally:
                if self.router is not None:
                    self.router.finished(request.request_id)
            num_migrations += 1
            tried = {connection.worker_id}
            current = self._migration(request, sent, connection.worker_id, reason)
            if current is None:  # it had every token already: only the end was lost
                yield TokenDelta(request_id=request.request_id, token_ids=[], finished=True, finish_reason="length",
                                 num_prompt_tokens=len(request.token_ids), num_cached_tokens=num_cached or 0,
                                 num_output_tokens=len(sent))
                return

    def _migration(self, request: GenerateRequest, sent: list[int], worker_id: str,
                   reason: str) -> GenerateRequest | None:
        """The request that continues `request` elsewhere after its worker failed mid-stream: its prompt and
        the tokens already sent as the new prompt, the tokens left to generate as its budget, no remote
        prefill (the new worker prefills it; its prefix cache may hold part of it). None when nothing is left.
        A greedy request continues exactly as it would have; sampled ones continue from the same text. Text a
        worker held back (half a UTF-8 character, a possible start of a stop string) is not recovered."""
        left = request.params.max_tokens - len(sent)
        logger.warning("request %s: worker %s %s after %d tokens; migrating it (%d tokens left)",
                       request.request_id, worker_id, reason.replace("_", " "), len(sent), left)
        if self._on_migration is not None:
            self._on_migration(reason)
        if left <= 0:
            return None
        return msgspec.structs.replace(request, token_ids=[*request.token_ids, *sent], remote_prefill=None,
                                       params=msgspec.structs.replace(request.params, max_tokens=left))

    # ---- membership ------------------------------------------------------------------------------------

    async def refresh_members(self) -> None:
        """Bring the members in line with the registry (a no-op without one, or when it cannot be read)."""
        if self.registry is None:
            return
        try:
            listed = await self.registry.workers()
        except Exception as exc:  # keep the members we have: a registry blip must not empty the gateway
            logger.warning("cannot read the worker registry: %s", exc)
            return
        if self.roles is not None:
            listed = [info for info in listed if info.role in self.roles]
        added, removed = membership_changes({w: c.info for w, c in self.connections.items()}, listed)
        listed_ids, now_s = {info.worker_id for info in listed}, time.monotonic()
        missing = [w for w in removed if w not in listed_ids and self.connections[w].is_open]
        # A registry that restarted (Redis, the embedded plane) lists nobody until the workers' next heartbeats,
        # and that must not empty the set: when several members (or all) vanish from the listing at once while
        # their channels are up, they leave only if still missing after `registry_grace_s`. One that vanishes
        # alone (it drained, its lease ran out), is listed anew (restarted under its id) or is down leaves now.
        mass = len(missing) > 1 or (missing and len(missing) == len(self.connections))
        for worker_id in removed:
            if not mass or worker_id not in missing:
                self._leave(worker_id)
                continue
            since_s = self._missing_since.setdefault(worker_id, now_s)
            if now_s - since_s >= self.registry_grace_s:
                self._leave(worker_id)
        self._missing_since = {w: t for w, t in self._missing_since.items()
                               if w in self.connections and w not in listed_ids}
        joined = [self._join(info) for info in added]
        await asyncio.gather(*(self._poll(c) for c in joined))

    def _join(self, info: WorkerInfo) -> WorkerConnection:
        logger.info("worker %s (%s) joined at %s:%d", info.worker_id, info.role, info.host, info.port)
        self._identity = self._identity or info
        connection = self.connections[info.worker_id] = WorkerConnection(info)
        return connection

    def _leave(self, worker_id: str) -> None:
        connection = self.connections.pop(worker_id)
        logger.info("worker %s left (%d streams to finish)", worker_id, connection.num_open_streams)
        self._mark_down(connection)
        self._leaving.append(connection)
        if self._on_leave is not None:
            self._on_leave(connection.info)

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
        await asyncio.gather(*(self._poll(c) for c in list(self.connections.values())))

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self._poll_interval_s)
            await self.poll_once()

    async def _poll(self, connection: WorkerConnection) -> None:
        if not connection.is_open and not await self._connect(connection):
            return
        try:
            load = await connection.load(timeout_s=max(2 * self._poll_interval_s, 1.0))
        except WorkerUnavailableError as exc:
            if connection.is_open:  # a slow answer (a busy host), not a dead worker: keep what we know
                logger.debug("worker %s: %s", connection.worker_id, exc)
                return
            self._mark_down(connection)
            return
        if self.connections.get(connection.worker_id) is not connection:
            return  # it left while we asked
        self.loads[connection.worker_id] = load
        self._load_seen_s[connection.worker_id] = time.monotonic()
        if self._on_load is not None:
            self._on_load(load)

    async def _connect(self, connection: WorkerConnection) -> bool:
        try:
            await connection.connect(timeout_s=2.0, cluster_token=self.cluster_token)
            return True
        except WorkerUnavailableError as exc:
            logger.debug("worker %s unreachable: %s", connection.worker_id, exc)
            self._mark_down(connection)
            return False

    def _mark_down(self, connection: WorkerConnection) -> None:
        """Out of routing until it answers again: its load, and what the router knows it caches, go."""
        if self.connections.get(connection.worker_id, connection) is not connection:
            return  # an old connection of a worker that has since joined again
        self.loads.pop(connection.worker_id, None)
        self._load_seen_s.pop(connection.worker_id, None)
        if self.router is not None:
            self.router.forget_worker(connection.worker_id)
        if self._on_down is not None:
            self._on_down(connection.info)
