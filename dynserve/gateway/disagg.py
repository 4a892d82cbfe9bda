"""Disaggregated serving: where a request's prompt is prefilled (`prefill_path`, a pure decision), and the
backend that composes a prefill and a decode `Dispatcher` through their public calls.

A disaggregated gateway sends a prompt to a prefill worker, and its KV on to a decode worker, only when that
pays: a prompt with few uncached tokens (by the prefill router's view of the prefill workers' caches) costs
less to prefill on its decode worker than to prefill elsewhere and move; and while the prefill workers are
backed up, waiting for them costs more than prefilling on the decode worker (which then stalls its decodes
for one prefill step instead of leaving the prompt waiting behind others). Each outcome is a path name the
gateway counts (`dynserve_disagg_requests_total{path}`).

Remote: the prefill dispatcher runs the request `prefill_only` (retried across prefill workers; the one the
router picks may pull the prompt's prefix from a busier prefill worker, as in an aggregated pool), the decode
dispatcher runs it with the returned `RemotePrefill` (retried and migrated across decode workers), and the
prefill worker is told to release its blocks once the decode worker's first delta shows it has them (or the
request ends, whichever is first: exactly once). The prefill's first token goes to the client at once (the
decode worker's first delta repeats it and is trimmed), so the transfer and the decode worker's queue are
not in the time to first token. A prefill that fails on every prefill worker falls back to prefilling on the
decode worker; a failed read falls back there too (the decode worker does it and says so in its first
delta). Both are counted (`BackendObserver.on_fallback`); the client sees neither.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Literal

import msgspec

from dynserve.errors import WorkerUnavailableError
from dynserve.gateway.backend import BackendObserver, WorkerChannel
from dynserve.gateway.dispatcher import Dispatcher
from dynserve.protocol import GenerateRequest, KVSnapshot, RemotePrefill, TokenDelta

__all__ = ["DisaggregatedBackend", "PrefillPath", "prefill_path", "without_first_token"]

logger = logging.getLogger(__name__)

PrefillPath = Literal["remote", "short_prompt", "prefill_queue", "no_prefill_worker"]


def prefill_path(*, num_uncached_tokens: int, num_prefill_queued: int, num_prefill_workers: int,
                 local_prefill_tokens: int, max_prefill_queue: int) -> PrefillPath:
    """`remote` (prefill on a prefill worker) or why the decode worker prefills this prompt itself.

    `num_prefill_queued`: requests queued or running on the prefill workers, all together; the queue is
    over its limit when a new one would make them more than `max_prefill_queue` per worker."""
    if num_prefill_workers <= 0:
        return "no_prefill_worker"
    if num_uncached_tokens < local_prefill_tokens:
        return "short_prompt"
    if num_prefill_queued >= max_prefill_queue * num_prefill_workers:
        return "prefill_queue"
    return "remote"


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


class DisaggregatedBackend:
    """The `Backend` of a disaggregated deployment: `prefill` and `decode` dispatchers, each over its own
    directory and router."""

    def __init__(self, prefill: Dispatcher, decode: Dispatcher, *, local_prefill_tokens: int = 0,
                 max_prefill_queue: int = 2) -> None:
        """`local_prefill_tokens` and `max_prefill_queue` decide which prompts prefill on the decode worker
        anyway (see `prefill_path`)."""
        self.prefill, self.decode = prefill, decode
        self.local_prefill_tokens, self.max_prefill_queue = local_prefill_tokens, max_prefill_queue
        self.observers: list[BackendObserver] = []

    @property
    def model_id(self) -> str:
        """The decode pool's model, or the prefill pool's while no decode worker has registered yet (a
        gateway may start on the fleet's first prefill worker)."""
        return self._serving().model_id

    @property
    def max_model_len(self) -> int:
        return self._serving().max_model_len

    def _serving(self) -> Dispatcher:
        """The pool that names what this backend serves: decode once any decode worker was seen."""
        return self.decode if self.decode.directory.has_identity else self.prefill

    def pools(self) -> list[tuple[str, Dispatcher]]:
        return [("decode", self.decode), ("prefill", self.prefill)]

    def add_observer(self, observer: BackendObserver) -> None:
        self.observers.append(observer)
        self.prefill.add_observer(observer)
        self.decode.add_observer(observer)

    async def start(self) -> None:
        await self.prefill.start()
        await self.decode.start()

    async def stop(self) -> None:
        await asyncio.gather(self.prefill.stop(), self.decode.stop())

    def is_ready(self) -> bool:
        return self.decode.is_ready()

    async def snapshot(self, worker_id: str) -> KVSnapshot:
        dispatcher = self.prefill if worker_id in self.prefill.directory.channels else self.decode
        return await dispatcher.snapshot(worker_id)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Prefill where `prefill_path` says, then decode (see the module's docstring)."""
        channel, overlap_blocks, pull = self.prefill.pick_with_pull(set(), request.token_ids)
        block_size = channel.info.block_size if channel is not None else 1
        directory = self.prefill.directory
        path = prefill_path(
            num_uncached_tokens=len(request.token_ids) - overlap_blocks * block_size,
            num_prefill_queued=directory.num_queued(), num_prefill_workers=len(directory.routable_ids()),
            local_prefill_tokens=self.local_prefill_tokens, max_prefill_queue=self.max_prefill_queue)
        for observer in self.observers:
            observer.on_disagg(path)
        prefilled = await self._prefill_remotely(request, channel, pull) if path == "remote" else None
        if prefilled is not None and prefilled.kv_handle is None:  # the first token ended it (stop, length)
            yield prefilled
            return
        if prefilled is None:  # prefilled on the decode worker: by choice, or after the prefill failed
            async with contextlib.aclosing(self.decode.generate(request)) as stream:
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
            async with contextlib.aclosing(self.decode.generate(
                    msgspec.structs.replace(request, remote_prefill=remote))) as stream:
                async for delta in stream:
                    if not released:
                        released = True
                        self.prefill.release(handle.worker_id, request.request_id)
                        if delta.kv_fallback is not None:
                            for observer in self.observers:
                                observer.on_fallback(delta.kv_fallback)
                        delta = without_first_token(delta, prefilled)
                        if not delta.token_ids and not delta.finished:
                            continue
                    yield delta
        finally:
            if not released:
                self.prefill.release(handle.worker_id, request.request_id)

    async def _prefill_remotely(self, request: GenerateRequest, channel: WorkerChannel | None,
                                pull: tuple[WorkerChannel, int] | None = None) -> TokenDelta | None:
        """Run `request` prefill-only on the prefill pool (`channel` first, pulling the prompt's prefix from
        another prefill worker as `pull` says); its one delta, or None when no prefill worker could (counted
        as a fallback)."""
        prefilled: TokenDelta | None = None
        try:
            async with contextlib.aclosing(self.prefill.generate(
                    msgspec.structs.replace(request, prefill_only=True), first=channel,
                    first_pull=pull)) as stream:
                async for delta in stream:
                    prefilled = delta
        except WorkerUnavailableError as exc:  # no prefill worker could do it: the decode worker will
            logger.warning("request %s: prefill failed on every prefill worker (%s); prefilling on a decode "
                           "worker", request.request_id, exc)
            for observer in self.observers:
                observer.on_fallback("prefill_failed")
        return prefilled
