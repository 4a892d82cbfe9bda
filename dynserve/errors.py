"""The root of dynserve's exception tree.

    DynserveError
    ├── ModelLoadError          a weights file is missing, unreadable or of an unsupported kind
    ├── TokenizerError          a tokenizer cannot be built or a template cannot be rendered
    ├── InvalidRequestError     a request's parameters are wrong (the user's fault)
    │   └── CacheCapacityError  a request can never fit in the KV cache
    ├── WorkerError             a worker cannot take or finish a request (not the user's fault)
    │   ├── WorkerUnavailableError  its channel is closed or it is stopping: retry elsewhere
    │   └── ChannelError            a malformed frame on a worker channel
    ├── PoolError               a worker pool cannot do what was asked (unknown worker, a failed start)
    ├── KVTransferError         a KV-page transfer (or its setup: registration, a peer) failed
    │   └── KVTransferTimeoutError  a read did not finish within its deadline
    ├── PrometheusError         Prometheus cannot be reached or refused a query
    └── KubernetesError         the Kubernetes API refused or failed a call (`retryable` says if a retry may
                                succeed: a conflict, throttling, a server error, no connection)

Each error carries structured fields next to its message so callers (the gateway, the CLI) can map it
to a status code or exit code without parsing strings.
"""

from __future__ import annotations

__all__ = [
    "CacheCapacityError",
    "DynserveError",
    "InvalidRequestError",
    "KVTransferError",
    "KVTransferTimeoutError",
    "ModelLoadError",
    "ChannelError",
    "PoolError",
    "KubernetesError",
    "PrometheusError",
    "WorkerError",
    "WorkerUnavailableError",
    "TokenizerError",
]


class DynserveError(Exception):
    """Root of every error dynserve raises on purpose."""


class ModelLoadError(DynserveError):
    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class TokenizerError(DynserveError):
    pass


class InvalidRequestError(DynserveError):
    """A request parameter is invalid; `param` names it, `code` classifies it (e.g. context_length_exceeded)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class CacheCapacityError(InvalidRequestError):
    """A request needs more KV blocks than the whole cache holds."""

    def __init__(self, message: str, *, num_blocks_needed: int, num_blocks_total: int) -> None:
        super().__init__(message, param="max_tokens")
        self.num_blocks_needed = num_blocks_needed
        self.num_blocks_total = num_blocks_total


class WorkerError(DynserveError):
    def __init__(self, message: str, *, worker_id: str | None = None) -> None:
        super().__init__(message)
        self.worker_id = worker_id


class WorkerUnavailableError(WorkerError):
    """The worker cannot serve: its channel closed, it died, or it is draining. Safe to retry elsewhere
    when no token of the request has been streamed yet."""


class ChannelError(WorkerError):
    """A frame on a worker channel was malformed or too large; the connection is closed."""


class PoolError(DynserveError):
    """A worker pool could not do what was asked: `pool` names it, `worker_id` the worker concerned, if any."""

    def __init__(self, message: str, *, pool: str, worker_id: str | None = None) -> None:
        super().__init__(message)
        self.pool = pool
        self.worker_id = worker_id


class KVTransferError(DynserveError):
    """A KV-page transfer failed: `backend` ("nixl" or "tcp") names the transport, `peer` the remote agent
    (None for local setup such as registering the cache), `num_blocks` how many blocks the read asked for
    (0 outside a read). The decode worker answers it by prefilling locally; the request never fails for it.
    After it, the local blocks named in the read hold undefined data."""

    def __init__(self, message: str, *, backend: str, peer: str | None = None, num_blocks: int = 0) -> None:
        super().__init__(message)
        self.backend = backend
        self.peer = peer
        self.num_blocks = num_blocks


class KVTransferTimeoutError(KVTransferError):
    """A read did not finish within `timeout_s` (it gave up after `elapsed_s`). `cancelled` is False when the
    backend could not cancel the read in flight: the local blocks may still be written until the connector
    is closed, so they must not be reused before then."""

    def __init__(self, message: str, *, backend: str, peer: str | None, num_blocks: int, timeout_s: float,
                 elapsed_s: float, cancelled: bool) -> None:
        super().__init__(message, backend=backend, peer=peer, num_blocks=num_blocks)
        self.timeout_s = timeout_s
        self.elapsed_s = elapsed_s
        self.cancelled = cancelled


class PrometheusError(DynserveError):
    """Prometheus could not be reached, or refused a query (`query`: the PromQL, when there was one)."""

    def __init__(self, message: str, *, url: str, query: str | None = None) -> None:
        super().__init__(message)
        self.url, self.query = url, query


class KubernetesError(DynserveError):
    """A Kubernetes API call failed: `status` is the HTTP status (None: no answer), `reason` the API's reason
    (NotFound, Conflict, Invalid, ...), `retryable` whether the same call may succeed later (409, 429, 5xx,
    no connection) or not (bad input, forbidden, not found)."""

    def __init__(self, message: str, *, status: int | None, reason: str | None = None) -> None:
        super().__init__(message)
        self.status, self.reason = status, reason

    @property
    def retryable(self) -> bool:
        return self.status is None or self.status in (409, 429) or self.status >= 500
