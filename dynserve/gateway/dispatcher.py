"""Dispatch over one pool: which worker gets a request, and what happens when it fails.

`Dispatcher.generate` picks a worker (the router's choice, else the least loaded by
`WorkerDirectory.pending`), streams the request from it, and, when the worker fails before the first token
reaches the client, retries on another worker, so a dead or draining worker costs a retry, not a request.
When it fails mid-stream (its channel drops, or it cuts the request with `finish_reason="abort"`), the
request migrates: another worker continues it from the prompt plus the tokens already sent, and the client's
stream goes on with no gap and no repeat, its usage counted over both (at most `migration_limit` times). A
prefill-only request (the first half of a disaggregated one) does not migrate: its caller falls back.

Peer pulls (`Settings.kv_peer_pulls`, the router's `Decision.pull_from`): when the router picks a worker other
than the one holding the prompt's longest prefix, the dispatcher first asks the holder to export that prefix
(`GenerateRequest.export_prefix`: its blocks held under a lease, nothing computed; at most
`EXPORT_TIMEOUT_S`), then sends the request to the chosen worker with the handle (`peer_prefix`): it reads
the blocks it lacks from the holder and prefills the rest. The holder is told to release them once the chosen
worker's first delta shows the read is over, or the attempt ends, exactly once. A holder that cannot export
(gone, busy past the timeout, its blocks evicted meanwhile) costs the pull, not the request: the chosen
worker prefills, as it does after a failed read. Each outcome is counted (`BackendObserver.on_pull`).

Hand-back: when a worker joins the pool, the directory asks the busier members to hand back requests queued
on them that have not started (`WorkerDirectory`'s hand-back); each such stream ends with one `REQUEUE`
delta before any token, and the request goes to another worker (not the one that handed it back, unless no
other is open), where the router sees the joiner's low load. Counted (`BackendObserver.on_requeue`); the
client sees nothing of it.

A `Dispatcher` is also the aggregated `Backend`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator
from typing import Protocol

import msgspec

from dynserve.errors import WorkerUnavailableError
from dynserve.gateway.backend import BackendObserver, WorkerChannel
from dynserve.gateway.directory import WorkerDirectory
from dynserve.protocol import (
    REQUEUE,
    GenerateRequest,
    KVHandle,
    KVSnapshot,
    SamplingParams,
    TokenDelta,
    WorkerInfo,
)
from dynserve.router.router import Router

__all__ = ["EXPORT_TIMEOUT_S", "Backend", "Dispatcher", "pull_outcome"]

logger = logging.getLogger(__name__)

EXPORT_TIMEOUT_S = 2.0  # a holder that takes longer to export a prefix (busy in a long step) is not pulled from


def pull_outcome(delta: TokenDelta) -> str:
    """What became of a peer pull, from the chosen worker's first delta: `pulled`, the reason it read nothing
    (`transfer_error`, `transfer_timeout`, `no_blocks`, `lease_expired`), or `not_needed` (its own cache held
    the blocks by the time the request arrived)."""
    if delta.kv_pulled_blocks:
        return "pulled"
    return delta.kv_fallback or "not_needed"


class Backend(Protocol):
    """What the gateway's routes and app use."""

    @property
    def model_id(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    def pools(self) -> list[tuple[str, Dispatcher]]:
        """Each pool's dispatcher with its label: `both` (aggregated), or `prefill` and `decode`."""
        ...

    def add_observer(self, observer: BackendObserver) -> None: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def is_ready(self) -> bool: ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]: ...

    async def snapshot(self, worker_id: str) -> KVSnapshot: ...


class _ForgetDownWorkers(BackendObserver):
    """The router forgets what a worker caches once the directory finds it down or gone."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def on_down(self, info: WorkerInfo) -> None:
        self.router.forget_worker(info.worker_id)


class Dispatcher:
    def __init__(self, directory: WorkerDirectory, *, router: Router | None = None, migration_limit: int = 3,
                 pool: str = "both") -> None:
        """`router`: picks among the open members (None: the least loaded). `migration_limit`: migrations of
        one request at most (Settings.migration_limit). `pool`: its label in metrics (`both`, `prefill`,
        `decode`)."""
        self.directory, self.router, self.pool = directory, router, pool
        self.migration_limit = migration_limit
        self.observers: list[BackendObserver] = []
        self.num_routed: Counter[str] = Counter()  # requests sent to each worker, retries included
        if router is not None:
            directory.add_observer(_ForgetDownWorkers(router))

    # ---- as a Backend ----------------------------------------------------------------------------------

    @property
    def model_id(self) -> str:
        return self.directory.identity.model_id

    @property
    def max_model_len(self) -> int:
        return self.directory.max_model_len

    def pools(self) -> list[tuple[str, Dispatcher]]:
        return [(self.pool, self)]

    def add_observer(self, observer: BackendObserver) -> None:
        self.observers.append(observer)
        self.directory.add_observer(observer)

    async def start(self) -> None:
        await self.directory.start()

    async def stop(self) -> None:
        await self.directory.stop()

    def is_ready(self) -> bool:
        return self.directory.is_ready()

    async def snapshot(self, worker_id: str) -> KVSnapshot:
        return await self.directory.snapshot(worker_id)

    # ---- picking ---------------------------------------------------------------------------------------

    def pick(self, exclude: set[str], token_ids: list[int] | None = None) -> WorkerChannel | None:
        """An open member not in `exclude`: the router's choice when there is one, else the least busy."""
        return self.pick_with_overlap(exclude, token_ids)[0]

    def pick_with_overlap(self, exclude: set[str],
                          token_ids: list[int] | None = None) -> tuple[WorkerChannel | None, int]:
        """`pick`, and how many of the prompt's blocks the chosen worker caches (0 when no router knows)."""
        channel, overlap, _pull = self.pick_with_pull(exclude, token_ids)
        return channel, overlap

    def pick_with_pull(self, exclude: set[str], token_ids: list[int] | None
                       ) -> tuple[WorkerChannel | None, int, tuple[WorkerChannel, int] | None]:
        """`pick_with_overlap`, and the holder to pull the prompt's prefix from with the blocks it holds,
        when the router says so and both workers can (dynserve's engine, the same block size); hand both
        to `generate` as `first` and `first_pull`."""
        candidates = self.directory.open_channels(exclude)
        if not candidates:
            return None, 0, None
        if self.router is not None and token_ids is not None and (len(candidates) > 1 or self.pool == "prefill"):
            decision = self.router.decide(token_ids, [c.worker_id for c in candidates], self.directory.loads)
            chosen = self.directory.channels[decision.worker_id]
            pull = None
            if decision.pull_from is not None:
                holder = self.directory.channels.get(decision.pull_from)
                if (holder is not None and holder.info.engine == chosen.info.engine == "dynserve"
                        and holder.info.block_size == chosen.info.block_size):
                    pull = (holder, decision.pull_blocks)
            return chosen, decision.overlap_blocks, pull
        return min(candidates, key=self.directory.pending), 0, None

    async def _export(self, request: GenerateRequest, holder: WorkerChannel, num_blocks: int) -> KVHandle | None:
        """Ask `holder` to hold the first `num_blocks` blocks of `request`'s prompt for a peer to read; their
        handle, or None (it holds none of them now, fails, or takes over `EXPORT_TIMEOUT_S`: counted)."""
        export = GenerateRequest(request_id=f"{request.request_id}/export", export_prefix=True,
                                 token_ids=request.token_ids[:num_blocks * holder.info.block_size],
                                 params=SamplingParams(max_tokens=1))
        handle = None
        try:
            async with asyncio.timeout(EXPORT_TIMEOUT_S):
                async with contextlib.aclosing(holder.generate(export)) as stream:
                    async for delta in stream:
                        handle = delta.kv_handle or handle
        except (WorkerUnavailableError, TimeoutError) as exc:
            logger.warning("request %s: worker %s could not export its prefix (%s); prefilling it instead",
                           request.request_id, holder.worker_id, exc or "timed out")
            if handle is not None:  # it came, but the stream's end did not
                self.release(holder.worker_id, export.request_id)
            for observer in self.observers:
                observer.on_pull("export_failed")
            return None
        if handle is None:
            for observer in self.observers:
                observer.on_pull("nothing_held")
        return handle

    def release(self, worker_id: str, request_id: str) -> None:
        """Tell a member to free what it holds for `request_id` (a prefill's KV); harmless when it is gone."""
        channel = self.directory.channels.get(worker_id)
        if channel is not None:
            with contextlib.suppress(WorkerUnavailableError):
                channel.release(request_id)

    # ---- streaming -------------------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest, first: WorkerChannel | None = None,
                       first_pull: tuple[WorkerChannel, int] | None = None) -> AsyncIterator[TokenDelta]:
        """Stream `request` from one of the pool's workers (`first` if given, pulling its prefix as
        `first_pull` says: `pick_with_pull`), retrying elsewhere until its first delta arrives, and migrating
        it when its worker fails mid-stream (see `_migration`)."""
        tried: set[str] = set()
        sent: list[int] = []  # the tokens the client has had, over every worker the request ran on
        num_migrations, current = 0, request
        num_cached: int | None = None
        handed_back: str | None = None  # the last worker that handed the request back unstarted
        while True:
            pull = None
            if first is None:
                exclude = tried if handed_back is None else tried | {handed_back}
                channel, _overlap, pull = self.pick_with_pull(exclude, current.token_ids)
                if channel is None and handed_back is not None:  # no other worker is open: back where it was
                    channel, _overlap, pull = self.pick_with_pull(tried, current.token_ids)
            else:
                channel, pull, first, first_pull = first, first_pull, None, None
            if channel is None:
                raise WorkerUnavailableError(
                    f"no worker can take the request (tried {sorted(tried) or 'none'})", worker_id=None
                )
            to_send, exported = current, None
            if pull is not None and current is request and not request.remote_prefill:
                holder, num_blocks = pull
                handle = await self._export(request, holder, num_blocks)
                if handle is not None:
                    to_send = msgspec.structs.replace(current, peer_prefix=handle)
                    exported = (holder.worker_id, f"{request.request_id}/export")
            started, base = False, len(sent) if current is not request else 0
            self.num_routed[channel.worker_id] += 1
            if self.router is not None:
                block_size = channel.info.block_size
                self.router.routed(request.request_id, channel.worker_id,
                                   (len(current.token_ids) + current.params.max_tokens) // block_size + 1)
            reason: str | None = None
            requeued = False
            try:
                async with contextlib.aclosing(channel.generate(to_send)) as stream:
                    async for delta in stream:
                        if delta.finish_reason == REQUEUE:
                            if not started:  # handed back before it started: another worker takes it
                                requeued = True
                                break
                            # never after a token (the engine sheds only unstarted requests): a cut, as a drain's
                            delta = msgspec.structs.replace(delta, finish_reason="abort")
                        started = True
                        if exported is not None:  # the chosen worker's read is over: the holder may let go
                            self.release(*exported)
                            exported = None
                            for observer in self.observers:
                                observer.on_pull(pull_outcome(delta))
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
                        if delta.finished and self.router is not None:
                            # its load leaves the worker now, not when the caller next pulls (it may first send
                            # the end to its client, whose next request must see the worker as free)
                            self.router.finished(request.request_id)
                        if delta.token_ids or reason is None:
                            yield delta
                        if reason is not None:
                            break
                if reason is None and not requeued:
                    return
            except WorkerUnavailableError as exc:
                if not started:
                    tried.add(channel.worker_id)
                    logger.warning("request %s: worker %s failed before its first token (%s); retrying",
                                   request.request_id, channel.worker_id, exc)
                    for observer in self.observers:
                        observer.on_retry()
                    continue
                if request.prefill_only or num_migrations >= self.migration_limit:
                    raise
                reason = "worker_failed"
            finally:
                if exported is not None:
                    self.release(*exported)
                if self.router is not None:
                    self.router.finished(request.request_id)
            if requeued:
                handed_back = channel.worker_id
                logger.info("request %s: worker %s handed it back unstarted; sending it to another worker",
                            request.request_id, channel.worker_id)
                for observer in self.observers:
                    observer.on_requeue()
                continue
            num_migrations += 1
            tried = {channel.worker_id}
            current = self._migration(request, sent, channel.worker_id, reason)
            if current is None:  # it had every token already: only the end was lost
                yield TokenDelta(request_id=request.request_id, token_ids=[], finished=True, finish_reason="length",
                                 num_prompt_tokens=len(request.token_ids), num_cached_tokens=num_cached or 0,
                                 num_output_tokens=len(sent))
                return

    def _migration(self, request: GenerateRequest, sent: list[int], worker_id: str,
                   reason: str) -> GenerateRequest | None:
        """The request that continues `request` elsewhere after its worker failed mid-stream: its prompt and
        the tokens already sent as the new prompt, the tokens left to generate as its budget, no remote
        prefill (the new worker prefills it; its prefix cache may hold part of it), and a grammar told that the
        tokens sent are its own (the new worker's matcher consumes them first). None when nothing is left.
        A greedy request continues exactly as it would have; sampled ones continue from the same text. Text a
        worker held back (half a UTF-8 character, a possible start of a stop string) is not recovered."""
        left = request.params.max_tokens - len(sent)
        logger.warning("request %s: worker %s %s after %d tokens; migrating it (%d tokens left)",
                       request.request_id, worker_id, reason.replace("_", " "), len(sent), left)
        for observer in self.observers:
            observer.on_migration(reason)
        if left <= 0:
            return None
        params = msgspec.structs.replace(request.params, max_tokens=left)
        if params.grammar is not None:  # the new worker's grammar starts from the tokens already sent
            params = msgspec.structs.replace(
                params, grammar=msgspec.structs.replace(params.grammar, num_prior_tokens=len(sent)))
        return msgspec.structs.replace(request, token_ids=[*request.token_ids, *sent], remote_prefill=None,
                                       params=params)
