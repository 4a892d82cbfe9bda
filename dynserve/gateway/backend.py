"""The interfaces under the gateway's backend (`dispatcher.Backend`, which serves `GenerateRequest`s as streams
of `TokenDelta`s): a `WorkerChannel` is one worker as the backend sees it; a `BackendObserver` hears what
the backend does (metrics implement it).

Two backends exist. `dispatcher.Dispatcher` is an aggregated fleet: a `directory.WorkerDirectory` (the
members, one channel each, their loads) and the dispatch over it (pick, retry before the first token,
migration after it). `disagg.DisaggregatedBackend` composes two dispatchers, prefill and decode, through
their public calls. `make_channel` picks a channel class by the worker's `WorkerInfo.engine`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from dynserve.protocol import GenerateRequest, KVSnapshot, TokenDelta, WorkerInfo, WorkerLoad

if TYPE_CHECKING:
    from dynserve.model.tokenizer import Tokenizer

__all__ = ["BackendObserver", "ENGINES", "WorkerChannel", "make_channel"]

# what a worker may run: dynserve's own engine (its channel), vLLM (its OpenAI server, token ids in and out),
# any other OpenAI-compatible server (text in and out)
ENGINES = ("dynserve", "vllm", "openai")


@runtime_checkable
class WorkerChannel(Protocol):
    """One worker as the dispatcher sees it. Every failure of the worker (unreachable, gone, stopping, too
    slow) is a `WorkerUnavailableError`; a request the worker refuses as invalid an `InvalidRequestError`."""

    info: WorkerInfo

    @property
    def worker_id(self) -> str: ...

    @property
    def is_open(self) -> bool:
        """Connected and not failed since: the worker may get new requests."""
        ...

    @property
    def num_open_streams(self) -> int: ...

    async def connect(self, timeout_s: float = 5.0, *, cluster_token: str | None = None) -> None: ...

    async def close(self) -> None: ...

    async def load(self, timeout_s: float = 2.0) -> WorkerLoad: ...

    async def snapshot(self, timeout_s: float = 10.0) -> KVSnapshot:
        """The worker's cached block hashes (a router's resync); channels without one raise
        `WorkerUnavailableError`."""
        ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """`request`'s deltas; closing the iterator early aborts it on the worker."""
        ...

    def abort(self, request_id: str) -> None: ...

    def release(self, request_id: str) -> None:
        """Free the KV a prefill worker holds for `request_id` (harmless when it holds none)."""
        ...

    def hand_back(self, max_requests: int) -> None:
        """Ask the worker to hand back up to `max_requests` of the requests this gateway queued on it that have
        not started: each of their streams ends with one delta of reason `protocol.REQUEUE` and no tokens, for
        the dispatcher to send elsewhere. Harmless when none is queued; a no-op for channels whose worker
        cannot (an OpenAI server)."""
        ...


def make_channel(info: WorkerInfo, tokenizer: Tokenizer | None = None) -> WorkerChannel:
    """The channel to `info`'s worker, by its engine (an OpenAI server's needs the gateway's `tokenizer`)."""
    if info.engine == "dynserve":
        from dynserve.workers.channel import WorkerConnection

        return WorkerConnection(info)
    if info.engine in ("vllm", "openai"):
        from dynserve.workers.openai_channel import OpenAIChannel

        return OpenAIChannel(info, tokenizer)
    raise ValueError(f"worker {info.worker_id}: unknown engine {info.engine!r} (known: {', '.join(ENGINES)})")


class BackendObserver:
    """What a backend reports as it works; every method does nothing here, so an observer overrides only
    what it counts. Called on the gateway's loop; must not block."""

    def on_load(self, load: WorkerLoad) -> None:
        """A member reported its load."""

    def on_down(self, info: WorkerInfo) -> None:
        """A member's channel failed or did not connect: it is out of picking until it answers again."""

    def on_leave(self, info: WorkerInfo) -> None:
        """A member left the fleet (the registry no longer lists it)."""

    def on_retry(self) -> None:
        """A request failed on a worker before its first token and goes to another."""

    def on_migration(self, reason: str) -> None:
        """A request moved to another worker mid-stream (`worker_failed`, `worker_aborted`)."""

    def on_requeue(self) -> None:
        """A worker handed back a queued request before starting it (a member joined the pool) and it goes to
        another worker."""

    def on_disagg(self, path: str) -> None:
        """Where a disaggregated request was prefilled (`disagg.prefill_path`)."""

    def on_pull(self, outcome: str) -> None:
        """A peer pull was tried (`dispatcher.pull_outcome`'s outcomes, or `export_failed`, `nothing_held`
        when the holder gave no blocks to read)."""

    def on_fallback(self, reason: str) -> None:
        """A disaggregated request prefilled on its decode worker after all (`prefill_failed`, or the decode
        worker's read failure)."""
