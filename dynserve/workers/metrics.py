"""A worker's Prometheus metrics, measured where they happen and served on the worker's own HTTP port.

Every series carries `worker_id`, `role` and `model`. What the engine already counts (prefix-cache lookups
and hits, evictions, preemptions, generated tokens: plain integers) is read at scrape time, so it costs the
serving path nothing, and so is the time each constrained token's grammar mask took (the engine's
`MaskTimings` histogram); the queue and KV gauges are the driver's snapshot after each step (a scrape must
not read the scheduler's queues while a step rebuilds them). What only the driver sees is recorded as it
happens, into `StepHistogram`s (a bucket search and two additions, no lock): per step its duration, batch
size, prefill and decode tokens and the inter-token latency of the step's decodes; per request the time to
its first token. The transfer side
counts KV reads: bytes, seconds and failures by reason (reads run on several threads: those counters take a
lock, once a read). The KV tiers' series (`tier_families`, labelled `medium`: blocks held and capacity per
medium, blocks offloaded and onboarded per lower medium, onboard bytes and seconds, disk bytes written and
read, corrupt disk files) are read at scrape time from the block manager and its `KVTiers`; a worker without
tiers exports them too, at 0 below the device, so dashboards and rates have a series everywhere.

Invariants: recording happens on one thread at a time per histogram (the engine's driver: its thread, or
the loop for a mocker), so a histogram's buckets are never written concurrently; a scrape copies the
buckets before summing them, so each bucket and `_count` it reports is one the histogram really had (the
sum may be a step behind). Names follow Prometheus's conventions: base units in the name, `_total` on
counters; `promtool check metrics` is clean on the output (tests run it).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from dynserve.engine.structured import MASK_BUCKETS_S
from dynserve.protocol import MEDIA

if TYPE_CHECKING:
    from dynserve.engine.block_manager import BlockManager
    from dynserve.engine.core import EngineCore, EngineStats

__all__ = ["TRANSFER_FAILURE_REASONS", "StepHistogram", "WorkerMetrics", "serve_metrics", "tier_families"]

logger = logging.getLogger(__name__)

TRANSFER_FAILURE_REASONS = ("transfer_timeout", "transfer_error")  # as the gateway names them
_STEP_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0,
                   2.0, 5.0)
_TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_TOKEN_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class StepHistogram:
    """A Prometheus histogram without locks, for a single writer thread (see the module's invariants)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        """`count` observations of `value`."""
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def family(self, name: str, documentation: str, label_values: list[str]) -> HistogramMetricFamily:
        return _histogram(name, documentation, label_values, self.bounds, self.counts, self.sum)


def _histogram(name: str, documentation: str, label_values: list[str], bounds: tuple[float, ...],
               counts: list[int], total: float) -> HistogramMetricFamily:
    """A histogram family of per-bucket (not cumulative) `counts`, the last one +Inf's."""
    counts = list(counts)  # one consistent copy: another thread may be observing
    buckets, running = [], 0
    for bound, count in zip((*bounds, float("inf")), counts, strict=True):
        running += count
        buckets.append((_le(bound), running))
    family = HistogramMetricFamily(name, documentation, labels=["worker_id", "role", "model"])
    family.add_metric(label_values, buckets, total)
    return family


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


class _Reads:
    """The counters of one kind of KV read (from prefill workers, or prefixes pulled from peers), and their
    families: `<prefix>_bytes`, `_seconds`, `_reads` (succeeded) and `_failures` by reason."""

    __slots__ = ("docs", "failures", "num_bytes", "num_reads", "prefix", "seconds")

    def __init__(self, prefix: str, docs: tuple[str, str, str, str]) -> None:
        self.prefix, self.docs = prefix, docs  # help of bytes, seconds, reads, failures
        self.num_bytes, self.seconds, self.num_reads = 0, 0.0, 0
        self.failures = dict.fromkeys(TRANSFER_FAILURE_REASONS, 0)

    def families(self, labels: list[str], names: list[str]) -> Iterator[Metric]:
        """Call with the lock the counters are updated under held."""
        for suffix, doc, value in zip(("bytes", "seconds", "reads"), self.docs[:3],
                                      (self.num_bytes, self.seconds, self.num_reads), strict=True):
            family = CounterMetricFamily(f"{self.prefix}_{suffix}", doc, labels=names)
            family.add_metric(labels, value)
            yield family
        failures = CounterMetricFamily(f"{self.prefix}_failures", self.docs[3], labels=[*names, "reason"])
        for reason, count in self.failures.items():
            failures.add_metric([*labels, reason], count)
        yield failures


class WorkerMetrics:
    """One worker's metrics. `engine` is read at scrape time; the driver calls `record_step` after each step
    and `record_first_token` at each request's first token; the transfer side calls `record_read` and
    `record_read_failure`. `registry` is what `serve_metrics` serves."""

    def __init__(self, worker_id: str, role: str, engine: EngineCore) -> None:
        self.labels = [worker_id, role, engine.model_id]
        self.engine = engine
        self.step_duration = StepHistogram(_STEP_BUCKETS_S)
        self.batch_size = StepHistogram(_BATCH_BUCKETS)
        self.prefill_tokens = StepHistogram(_TOKEN_BUCKETS)
        self.decode_tokens = StepHistogram(_TOKEN_BUCKETS)
        self.itl = StepHistogram(_ITL_BUCKETS_S)
        self.ttft = StepHistogram(_TTFT_BUCKETS_S)
        # (waiting, running, KV blocks used) as the driver left them after its last step: a scrape on the HTTP
        # thread must not read the scheduler's queues while a step rebuilds them
        self.queue: tuple[int, int, int] | None = None
        self._last_step_end_s: float | None = None
        self._transfer_lock = threading.Lock()
        self._transfers = _Reads("dynserve_worker_kv_transfer", (
            "KV bytes read from prefill workers", "Time spent reading KV from prefill workers",
            "KV reads from prefill workers that succeeded",
            "KV reads that failed (the request was prefilled here instead), by reason"))
        self._pulls = _Reads("dynserve_worker_kv_pull", (  # prefixes pulled from peers (Settings.kv_peer_pulls)
            "KV bytes of prompt prefixes pulled from peers' caches (peer pulls)",
            "Time spent pulling prompt prefixes from peers", "Prefix pulls from peers that succeeded",
            "Prefix pulls that failed (the request prefilled those blocks here), by reason"))
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        ProcessCollector(registry=self.registry)  # the worker process's CPU and memory

    # ---- the driver's side ---------------------------------------------------------------------------

    def record_step(self, stats: EngineStats, duration_s: float, ended_s: float, after_idle: bool) -> None:
        """One step that ran a batch: `duration_s` long, ending at `ended_s` (`time.monotonic()`).

        Its decodes' inter-token latency is the time since the previous step ended (each decoded sequence's
        last token came out of that step, or was its first after a prefill there); after the driver idled
        there was no previous step for them (a sequence prefilled elsewhere), and none is recorded."""
        self.step_duration.observe(duration_s)
        self.batch_size.observe(stats.last_batch_size)
        self.prefill_tokens.observe(stats.last_prefill_tokens)
        num_decode = stats.last_decode_tokens
        self.decode_tokens.observe(num_decode)
        last_end_s, self._last_step_end_s = self._last_step_end_s, ended_s
        if num_decode and not after_idle and last_end_s is not None:
            self.itl.observe(ended_s - last_end_s, num_decode)
        self.snapshot_queue()

    def snapshot_queue(self) -> None:
        """Take the queue and KV gauges now, on the driver's side: after each step, and before it waits idle
        (requests aborted or finished since the last step are gone from them then)."""
        engine = self.engine
        self.queue = (len(engine.scheduler.waiting) + engine.num_receiving, len(engine.scheduler.running),
                      engine.block_manager.num_used_blocks)

    def record_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    # ---- the transfer side (read threads) ------------------------------------------------------------

    def record_read(self, num_bytes: int, seconds: float, *, pull: bool = False) -> None:
        """A KV read that succeeded: from a prefill worker, or (`pull`) a prefix pulled from a peer."""
        reads = self._pulls if pull else self._transfers
        with self._transfer_lock:
            reads.num_bytes += num_bytes
            reads.seconds += seconds
            reads.num_reads += 1

    def record_read_failure(self, reason: str, *, pull: bool = False) -> None:
        failures = (self._pulls if pull else self._transfers).failures
        with self._transfer_lock:
            failures[reason] = failures.get(reason, 0) + 1

    # ---- exposition ----------------------------------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        labels, names = self.labels, ["worker_id", "role", "model"]
        engine = self.engine
        scheduler, blocks, stats = engine.scheduler, engine.block_manager, engine.stats

        def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, documentation, labels=names)
            family.add_metric(labels, value)
            return family

        def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, documentation, labels=names)
            family.add_metric(labels, value)
            return family

        num_waiting, num_running, num_used = self.queue if self.queue is not None else (0, 0, 0)
        yield gauge("dynserve_worker_waiting_requests", "Requests queued on the worker (including those whose "
                    "KV is being read from a prefill worker), after its last step", num_waiting)
        yield gauge("dynserve_worker_running_requests", "Requests in the worker's running batch, after its last "
                    "step", num_running)
        yield gauge("dynserve_worker_kv_blocks_used", "KV blocks held by requests (cached but free blocks are "
                    "not counted), after the worker's last step", num_used)
        yield gauge("dynserve_worker_kv_blocks_capacity", "KV blocks the worker's cache has",
                    blocks.num_blocks)
        yield counter("dynserve_worker_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix "
                      "cache at admission", scheduler.num_queried_prompt_tokens)
        yield counter("dynserve_worker_prefix_cache_hit_tokens", "Prompt tokens the prefix cache held at "
                      "admission", scheduler.num_cached_prompt_tokens)
        yield counter("dynserve_worker_kv_evictions", "Cached KV blocks evicted to make room",
                      blocks.num_evictions)
        yield counter("dynserve_worker_preemptions", "Running requests preempted (recomputed later) for lack "
                      "of KV blocks", stats.num_preemptions)
        yield counter("dynserve_worker_generated_tokens", "Tokens the worker generated", stats.num_generated_tokens)
        yield self.step_duration.family("dynserve_worker_step_duration_seconds",
                                        "Time of one engine step (forward pass)", labels)
        yield self.batch_size.family("dynserve_worker_step_batch_size", "Requests in one engine step", labels)
        yield self.prefill_tokens.family("dynserve_worker_step_prefill_tokens",
                                         "Prompt tokens computed in one engine step", labels)
        yield self.decode_tokens.family("dynserve_worker_step_decode_tokens",
                                        "Tokens decoded in one engine step", labels)
        yield self.ttft.family("dynserve_worker_time_to_first_token_seconds",
                               "Time from a request's arrival at the worker to its first token", labels)
        yield self.itl.family("dynserve_worker_inter_token_latency_seconds",
                              "Time between a request's consecutive tokens on the worker", labels)
        with self._transfer_lock:  # one consistent copy each: a read thread may be counting
            read_families = [*self._transfers.families(labels, names), *self._pulls.families(labels, names)]
        yield from read_families
        mask_timings = engine.mask_timings  # None: this engine computes no masks ahead (a mocker): all zeros
        yield _histogram("dynserve_worker_grammar_mask_seconds", "Time to compute the allowed-token mask of one "
                         "token of a request with a grammar (structured output, tools), on the mask thread while "
                         "the forward runs", labels, MASK_BUCKETS_S,
                         mask_timings.bucket_counts if mask_timings else [0] * (len(MASK_BUCKETS_S) + 1),
                         mask_timings.total_s if mask_timings else 0.0)
        eager = sys.modules.get("dynserve.engine.kernels.eager")  # never imported: nothing ran, and no torch
        yield counter("dynserve_worker_engine_op_fallbacks", "Calls of engine ops that ran in eager torch because "
                      "the step ops in use have no kernel for them yet (e.g. the Triton ops' q/k norm; which ops: "
                      "the worker's log warns once per op)",
                      sum(eager.fallback_counts().values()) if eager is not None else 0)
        yield from tier_families(labels, blocks)


_LABEL_NAMES = ["worker_id", "role", "model"]
_LOWER_MEDIA = MEDIA[1:]


def tier_families(labels: list[str], blocks: BlockManager) -> Iterator[Metric]:
    """The KV tiers' series of a worker labelled `labels` (worker_id, role, model), read from its block
    manager now (safe from the scrape thread: lengths and counters, no iteration of the engine's maps). A
    block manager without tiers yields the same series, at 0 on the lower media."""
    tiers = blocks.tiers
    names = [*_LABEL_NAMES, "medium"]
    held = GaugeMetricFamily("dynserve_worker_kv_tier_blocks", "Cached KV blocks (hashed, reusable) the "
                             "worker holds per medium: device, host and disk tiers", labels=names)
    capacity = GaugeMetricFamily("dynserve_worker_kv_tier_blocks_capacity", "KV blocks each medium of the "
                                 "worker can hold (host and disk: 0 without that tier)", labels=names)
    held.add_metric([*labels, MEDIA[0]], blocks.num_cached_blocks)
    capacity.add_metric([*labels, MEDIA[0]], blocks.num_blocks)
    for medium in _LOWER_MEDIA:
        held.add_metric([*labels, medium], tiers.num_blocks(medium) if tiers is not None else 0)
        if tiers is None:
            limit = 0
        else:
            limit = tiers.num_host_slots if medium == "host" else tiers.num_disk_blocks_max
        capacity.add_metric([*labels, medium], limit)
    yield held
    yield capacity
    stats = tiers.stats if tiers is not None else None  # (kv_tiers imports torch: a mocker's worker does not)
    onboarded = dict(stats.num_onboarded) if stats is not None else {}
    offloaded = dict(stats.num_offloaded) if stats is not None else {}
    by_medium = (("onboarded", "Blocks found in the tier at admission and copied into the KV cache instead "
                  "of prefilled (tier hits)", onboarded),
                 ("offloaded", "Blocks stored into the tier (evicted from the tier above)", offloaded))
    for kind, documentation, counts in by_medium:
        family = CounterMetricFamily(f"dynserve_worker_kv_tier_{kind}_blocks", documentation, labels=names)
        for medium in _LOWER_MEDIA:
            family.add_metric([*labels, medium], counts.get(medium, 0))
        yield family
    for name, documentation, field in (
            ("dynserve_worker_kv_tier_dropped_blocks", "Blocks dropped off the last KV tier", "num_dropped"),
            ("dynserve_worker_kv_onboard_bytes", "KV bytes copied from the host and disk tiers into the KV "
             "cache", "onboard_bytes"),
            ("dynserve_worker_kv_onboard_seconds", "Time spent bringing blocks from the host and disk tiers "
             "into the KV cache (a disk block's file read and checked, then copied)", "onboard_s"),
            ("dynserve_worker_kv_disk_write_bytes", "Bytes of block files written to the disk tier",
             "disk_write_bytes"),
            ("dynserve_worker_kv_disk_read_bytes", "Bytes of block files read from the disk tier",
             "disk_read_bytes"),
            ("dynserve_worker_kv_disk_corrupt_files", "Disk-tier block files found corrupt or short at read "
             "(dropped; their blocks were prefilled)", "num_corrupt_files")):
        family = CounterMetricFamily(name, documentation, labels=_LABEL_NAMES)
        family.add_metric(labels, getattr(stats, field) if stats is not None else 0)
        yield family


class _Collector:
    def __init__(self, metrics: WorkerMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return self._metrics.collect()


# How long the worker's metrics server waits on a scraper: for the whole of each request (its line and
# headers, from when the server starts to wait for it), and for each write of the answer (the fleet's
# Prometheus scrapes every 5 s: `Settings.scrape_interval_s`)
SCRAPE_CLIENT_TIMEOUT_S = 5.0
# How many connections the worker's metrics server serves at once; one more is answered 503 and closed as it
# comes (a Prometheus keeps one, a `dynctl top` or a person's curl another)
MAX_SCRAPE_CONNECTIONS = 16


_OVER_THE_CAP = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n"
                 b"too many connections to this worker's metrics server\n")


class _DeadlineReader(socket.SocketIO):
    """A connection's reading side that gives each request one deadline in all, not a timeout per read: a
    client that trickles bytes is cut off when its request's time is up. Each read waits for what is left of
    it; the socket's timeout is then put back to `timeout_s` for the writes of the answer."""

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        super().__init__(sock, "rb")
        self._timeout_s = timeout_s
        self.deadline_s = time.monotonic() + timeout_s

    def readinto(self, buffer: Any) -> int | None:
        left_s = self.deadline_s - time.monotonic()
        if left_s <= 0:
            raise TimeoutError("the request was not read whole within its deadline")
        self._sock.settimeout(left_s)  # type: ignore[attr-defined]
        try:
            return super().readinto(buffer)
        finally:
            self._sock.settimeout(self._timeout_s)  # type: ignore[attr-defined]


def serve_metrics(registry: CollectorRegistry, host: str, port: int,
                  client_timeout_s: float = SCRAPE_CLIENT_TIMEOUT_S,
                  max_connections: int = MAX_SCRAPE_CONNECTIONS) -> tuple[Any, int]:
    """Serve `registry` at http://host:port/metrics from daemon threads (one per connection, at most
    `max_connections`), always in Prometheus's text format 0.0.4; returns (server, port bound).
    `server.shutdown()` stops it. A connection holds only its own thread, so a client that stalls, or
    trickles bytes that never make a request line (a stale peer that took the port for a worker's channel and
    sends it frames), holds off no scrape; and each request must arrive whole within `client_timeout_s` of
    when the server starts to wait for it (each write of the answer then has as long again), so neither keeps
    its thread for long. A connection over the cap is answered 503 and closed at once, so the scraper's log
    says why.

    Why not `prometheus_client.start_http_server`: it answers a scraper that accepts OpenMetrics in it, whose
    writer escapes every label value a character at a time; on a 2-core machine a mocker's 170 samples cost
    9.9 ms of the worker's CPU a scrape that way, at one scrape a second most of what an idle worker spends
    beyond Ray's own (measured 2026-11-29; docs/benchmarks.md). Nothing dynserve reads needs OpenMetrics (no
    exemplars, no `_created` series)."""
    import io
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    class Handler(BaseHTTPRequestHandler):
        timeout = client_timeout_s  # on the connection's socket: each write (reads: `_DeadlineReader`)
        _reader: _DeadlineReader

        def setup(self) -> None:
            super().setup()
            self.rfile.close()  # the plain reader's place (and its hold on the socket) goes to ours
            self._reader = _DeadlineReader(self.connection, client_timeout_s)
            self.rfile = io.BufferedReader(self._reader)

        def handle_one_request(self) -> None:
            self._reader.deadline_s = time.monotonic() + client_timeout_s
            super().handle_one_request()

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                self.send_error(404)
                return
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
            pass  # a scrape a second is not news

    class Server(ThreadingHTTPServer):  # daemon threads: a held connection never blocks exit
        slots = threading.BoundedSemaphore(max_connections)

        def process_request(self, request: Any, client_address: Any) -> None:
            if not self.slots.acquire(blocking=False):  # over the cap: answered and closed as it comes
                with contextlib.suppress(OSError):  # (a few bytes into an empty socket buffer: no wait)
                    request.sendall(_OVER_THE_CAP)
                self.shutdown_request(request)
                return
            try:
                super().process_request(request, client_address)
            except BaseException:
                self.slots.release()
                raise

        def process_request_thread(self, request: Any, client_address: Any) -> None:
            try:
                super().process_request_thread(request, client_address)
            finally:
                self.slots.release()

    server = Server((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server, server.server_port
