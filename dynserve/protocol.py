"""Wire types shared across processes: sampling parameters, token deltas, worker frames, KV events.

Everything here is a `msgspec.Struct` so it travels as MessagePack between the gateway, workers and the
router. KV events form a tagged union; each carries its worker's sequence number (`event_id`) so a consumer
can detect gaps and resync from a snapshot. The worker channel speaks two tagged unions: `ClientFrame`
(gateway to worker: generate, abort, release, hand back, load, snapshot) and `WorkerFrame` (worker to gateway: batches
of deltas, request errors, loads, snapshots). Every TCP stream of ours between dynserve processes (the worker
channel, the embedded event plane) opens with one `Hello` from the client, carrying the cluster's token.

Disaggregated serving adds three types. A prefill worker runs a `GenerateRequest` with `prefill_only` up
to its first token and answers one finished delta (`finish_reason="prefilled"`) carrying a `KVHandle`: the
blocks that hold the prompt's KV, kept under a lease until a `ReleaseRequest` (or the lease's end). The
decode worker gets the same request with a `RemotePrefill` (the handle and the first token), reads the
blocks, and streams every token from the first on, exactly as in aggregated mode.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from dynserve.errors import InvalidRequestError

__all__ = [
    "AbortRequest",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "ClientFrame",
    "DeltaBatch",
    "GenerateRequest",
    "Grammar",
    "HandBackRequest",
    "Hello",
    "KVEvent",
    "KVHandle",
    "KVSnapshot",
    "SnapshotRequest",
    "LoadRequest",
    "ReleaseRequest",
    "RemotePrefill",
    "RequestError",
    "RequestTiming",
    "MAX_TOP_LOGPROBS",
    "MEDIA",
    "REQUEUE",
    "SamplingParams",
    "TokenDelta",
    "TokenLogprob",
    "WorkerFrame",
    "WorkerInfo",
    "WorkerLoad",
]

MAX_TOP_LOGPROBS = 20
# the finish reason of a request a worker handed back before starting it (`HandBackRequest`): internal, never
# a client's; the gateway sends the request to another worker
REQUEUE = "requeue"


class Grammar(msgspec.Struct, frozen=True, kw_only=True):
    """A constraint every output token keeps: the output is a document of `source`, a JSON Schema (as JSON
    text), a regular expression or a Lark grammar (llguidance's dialects of each). `lenient`: keywords of a
    schema the engine cannot enforce are ignored instead of refused (a non-strict `json_schema`).
    `num_prior_tokens`: the prompt's last tokens that were already produced under this grammar (a migrated
    request's earlier output), which the engine feeds to the grammar before it samples."""

    kind: Literal["json_schema", "regex", "lark"]
    source: str
    lenient: bool = False
    num_prior_tokens: int = 0


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to pick tokens and when to stop. `temperature == 0` is greedy; `top_k=None` keeps all tokens;
    `logprobs=None` returns none, `0` the chosen token's only, `k` also the top k (k <= 20); `grammar`: the
    output must match it, and the request stops ("stop") once the grammar is complete."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    grammar: Grammar | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first bad parameter."""
        checks = [
            ("max_tokens", self.max_tokens >= 1, "must be at least 1"),
            ("temperature", 0.0 <= self.temperature <= 2.0, "must be between 0 and 2"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k is None or self.top_k >= 1, "must be at least 1"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be between -2 and 2"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be between -2 and 2"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
             f"must be between 0 and {MAX_TOP_LOGPROBS}"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            ("grammar", self.grammar is None or (self.grammar.kind in ("json_schema", "regex", "lark")
                                                 and self.grammar.num_prior_tokens >= 0),
             "must name json_schema, regex or lark, with num_prior_tokens >= 0"),
        ]
        for param, ok, why in checks:
            if not ok:
                raise InvalidRequestError(f"{param} {why}", param=param)


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class KVHandle(msgspec.Struct, frozen=True, kw_only=True):
    """Where a prefilled prompt's KV waits for its decode worker: blocks `block_ids` (in order, the first
    `num_tokens` tokens) of worker `worker_id`, whose transfer agent is `agent_name` (None for a mocker,
    whose transfers are simulated). Held under a lease until released or `lease_ends_unix_s`; a reader
    that gets the handle too close to that time prefills instead (a one-sided read cannot tell freed
    blocks from held ones)."""

    worker_id: str
    agent_name: str | None
    block_ids: list[int]
    num_tokens: int
    lease_ends_unix_s: float = float("inf")  # `time.time()` on the prefill worker's host when it frees them


class TokenDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What one engine step produced for one request. `text` is the newly completed text (never half a
    UTF-8 character); usage counts are cumulative. `kv_handle` is set on the one delta that ends a
    prefill-only request; `kv_fallback` on a decode worker's first delta when it could not use the
    transferred KV and prefilled locally (the reason: "transfer_error", "transfer_timeout", "no_blocks", "lease_expired").
    A request that pulled its prefix from a peer (`GenerateRequest.peer_prefix`) says on its first delta how
    many blocks it read (`kv_pulled_blocks`), or why it read none (`kv_fallback`). A request handed back
    unstarted (`HandBackRequest`) ends with one delta without tokens, finished with reason `REQUEUE`."""

    request_id: str
    token_ids: list[int]
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "prefilled" | "exported" | REQUEUE
    logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    kv_handle: KVHandle | None = None
    kv_fallback: str | None = None
    kv_pulled_blocks: int = 0


# ---- the worker channel ---------------------------------------------------------------------------------


class RemotePrefill(msgspec.Struct, frozen=True, kw_only=True):
    """A prompt another worker prefilled: where its KV is, the first token it sampled (and that token's
    logprob, when asked), and how many prompt tokens its prefix cache served."""

    handle: KVHandle
    first_token_id: int
    first_logprob: TokenLogprob | None = None
    num_cached_tokens: int = 0


class GenerateRequest(msgspec.Struct, tag="generate", kw_only=True, omit_defaults=True):
    """Run `token_ids` (already tokenized and templated by the gateway) with `params`. `prefill_only`: stop
    after the first token and hold the prompt's KV for a decode worker; `remote_prefill`: the prompt was
    prefilled elsewhere: read its KV and continue from the first token.

    Peer pulls (`Settings.kv_peer_pulls`): `export_prefix` asks a worker for the KV it caches of
    `token_ids` (whole blocks, from any of its tiers) without computing anything: its one delta (finished,
    reason "exported") carries a `KVHandle` of the leading blocks it holds, under a lease, or none; a
    `ReleaseRequest` frees them. `peer_prefix` hands another worker such a handle: it reads the blocks it
    does not cache itself and prefills only the rest (a failed read: it prefills them too)."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    prefill_only: bool = False
    remote_prefill: RemotePrefill | None = None
    export_prefix: bool = False
    peer_prefix: KVHandle | None = None


class AbortRequest(msgspec.Struct, tag="abort"):
    request_id: str


class ReleaseRequest(msgspec.Struct, tag="release"):
    """The decode worker has the KV of prefill-only request `request_id`: free its blocks (a no-op when the
    lease already ended)."""

    request_id: str


class HandBackRequest(msgspec.Struct, tag="hand_back"):
    """Hand back up to `max_requests` of this connection's queued requests that have not started (nothing
    computed, scheduled or read for them, no token produced), newest first, the head of the queue kept: each
    ends with a `REQUEUE` delta and its gateway sends it elsewhere (a worker joined the pool). No reply."""

    max_requests: int


class LoadRequest(msgspec.Struct, tag="load"):
    pass


class SnapshotRequest(msgspec.Struct, tag="snapshot"):
    pass


ClientFrame = GenerateRequest | AbortRequest | ReleaseRequest | HandBackRequest | LoadRequest | SnapshotRequest


class Hello(msgspec.Struct, tag="hello"):
    """A client's first frame on an internal socket: the cluster's token (`Settings.cluster_token`; None when
    the cluster has none), and on a worker channel the worker the client means (`worker_id`; None: whoever
    serves the address). A server with a token serves nothing to a connection whose first frame is not a
    `Hello` presenting it, and a worker nothing to one meant for another worker (a gone worker's address
    that a new one took: its requests would run on another engine, perhaps another model)
    (`framing.read_hello`, `framing.meant_for`). Its repr hides the token, so logging one leaks nothing."""

    token: str | None = None
    worker_id: str | None = None

    def __repr__(self) -> str:
        return f"Hello(token={'<hidden>' if self.token is not None else None}, worker_id={self.worker_id!r})"


class DeltaBatch(msgspec.Struct, tag="deltas"):
    """Every delta one engine step produced for one connection's requests, in one frame."""

    deltas: list[TokenDelta]


class RequestError(msgspec.Struct, tag="error", kw_only=True):
    """A request the worker refused or lost. `retryable` is true when another worker may succeed (the
    worker is draining or stopping); false for the user's own errors (bad prompt, too long)."""

    request_id: str
    message: str
    param: str | None = None
    retryable: bool = False


class WorkerLoad(msgspec.Struct, tag="load", kw_only=True):
    """A worker's load right now: what the router weighs and the gateway exports as gauges."""

    worker_id: str
    role: str
    num_blocks_used: int
    num_blocks_total: int
    num_running: int
    num_waiting: int


class KVSnapshot(msgspec.Struct, tag="kv_snapshot", kw_only=True):
    """Every block hash a worker caches, and the id of the last KV event the set reflects: `block_hashes` on
    the device, `lower_block_hashes` per lower medium of `MEDIA` ("host", "disk") that holds any (empty: a
    worker without KV tiers, or one older than the field; a medium absent holds none)."""

    worker_id: str
    block_hashes: list[int]
    last_event_id: int | None
    lower_block_hashes: dict[str, list[int]] = msgspec.field(default_factory=dict)


WorkerFrame = DeltaBatch | RequestError | WorkerLoad | KVSnapshot


class WorkerInfo(msgspec.Struct, kw_only=True, frozen=True):
    """What a started worker tells its owner: who it is, where its channel listens, what it serves."""

    worker_id: str
    role: str
    host: str
    port: int
    model_id: str
    max_model_len: int
    block_size: int
    num_blocks: int
    kv_agent: bytes | None = None  # transfer agent metadata (`KVConnector.metadata()`) of a prefill worker
    metrics_port: int | None = None  # where it serves Prometheus metrics (at `host`), when it does
    # what serves it: dynserve's engine (`host:port` is its channel), `vllm` or `openai` (`host:port` is the
    # server's OpenAI HTTP API; `metrics_port` its own port too)
    engine: str = "dynserve"
    # the model's file or directory on the worker's host (dynserve's workers): a gateway that finds a model it
    # does not serve yet reads its tokenizer there
    model_path: str | None = None


class RequestTiming(msgspec.Struct, kw_only=True, frozen=True):
    """One finished request's life on a worker, in `time.monotonic()` seconds (one clock per host)."""

    request_id: str
    arrival_s: float
    first_token_s: float | None
    finished_s: float
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    finish_reason: str | None


# ---- KV events -------------------------------------------------------------------------------------------


MEDIA = ("device", "host", "disk")  # the tiers a cached block lives in, fastest first


class BlockStored(msgspec.Struct, tag="stored", array_like=True):
    """Blocks newly cached, in chain order, on `medium` (one of `MEDIA`); `parent_hash` is the hash before the
    first (None at the root). A block moving between tiers is removed from one medium and stored on another."""

    event_id: int
    parent_hash: int | None
    block_hashes: list[int]
    medium: str = "device"  # last on the wire, so a frame without it (an older worker's) decodes as "device"


class BlockRemoved(msgspec.Struct, tag="removed", array_like=True):
    event_id: int
    block_hashes: list[int]
    medium: str = "device"


class AllBlocksCleared(msgspec.Struct, tag="cleared", array_like=True):
    event_id: int


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
