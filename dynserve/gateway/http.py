"""The gateway's HTTP/1.1 server: an asyncio protocol over the httptools parser, with no framework between
the socket and the completion routes.

Every request is read whole and handed to the `Handler` as an `Exchange`. The handler answers once
(`respond`) or streams (`start_stream`, `write`, `end`: chunked transfer encoding), and can wait on
`exchange.gone`, a future that completes when the client disconnects. Requests on one connection are
answered in order; a pipelined request waits for the one before it. Other routes go through an ASGI bridge
(`asgi.AsgiHandler`) to the FastAPI app, whose lifespan the server runs.

What a client may send is bounded (`HttpLimits`, from the gateway's settings); past a bound the client gets
an OpenAI-shaped error and the connection is closed:
- request line and header fields over `max_header_bytes`, or more than `max_headers` fields: 431;
- a body over `max_body_bytes`: 413 (before the body is read when Content-Length already says too much);
- a request line and headers not complete `header_timeout_s` after the request's first byte, or a body
  that pauses longer than that: 408;
- malformed HTTP, or an upgrade: 400.
A connection with nothing in flight is closed after `keep_alive_timeout_s` of silence between requests, and
after `header_timeout_s` when it never sent a request. A request being answered has no timeout here (the
completion routes bound generation themselves). HEAD is answered as GET would be: the same headers,
Content-Length included, and no body. `HttpServer.close` drains: it stops accepting, answers any new
request 503 with `connection: close`, and gives responses in progress a grace period.

Invariants: a connection writes at most one response at a time, in request order (an error found while
reading a pipelined request is queued behind the responses before it); `gone` completes exactly once, when
the connection is lost; a handler that raises before answering gets a 500 written for it, never a hang.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httptools

from dynserve.gateway.errors import error_body
from dynserve.gateway.exchange import Exchange, closing_response

__all__ = ["Exchange", "Handler", "HttpLimits", "HttpServer"]

logger = logging.getLogger(__name__)

Handler = Callable[["Exchange"], Awaitable[None]]
_JSON = [(b"content-type", b"application/json")]


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """What one client may send (see the module's docstring; `Settings` documents each default)."""

    max_body_bytes: int = 8 * 2**20
    max_header_bytes: int = 16 * 2**10
    max_headers: int = 100
    header_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0


class _Stop(Exception):
    """Raised from a parser callback once the request is refused: nothing after it is parsed."""


class _Connection(asyncio.Protocol):
    """One client connection: parse within the limits, queue, dispatch in order, time out the silent, and
    the transport's flow control. One timer at a time: waiting for a request (idle), or reading one."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.limits = server.limits
        self.loop = server.loop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.gone: asyncio.Future[None] = self.loop.create_future()
        self.pending: deque[Exchange | bytes] = deque()  # requests waiting their turn, or a final error
        self.active: asyncio.Task[None] | None = None
        self.current: Exchange | None = None  # the exchange `active` answers
        self._url = b""
        self._headers: dict[bytes, bytes] = {}
        self._body: list[bytes] = []
        self._body_size = 0
        self._num_headers = 0
        self._num_head_bytes = 0  # request line and complete header fields so far
        self._num_raw_head_bytes = 0  # chunks received inside the head (fields the parser still holds)
        self._completed_one = False  # a request ended in the chunk being parsed
        self._reading = False  # a request has begun and is not complete
        self._in_head = False  # ... and its head is not complete
        self._refused = False  # an error response is written or queued: nothing more is read
        self._last_read_s = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._write_paused = False
        self._drained: asyncio.Future[None] | None = None

    # ---- transport callbacks -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (uvloop has already turned Nagle off)
        self.server.connections.add(self)
        if self.server.draining:
            transport.close()
            return
        self._timer = self.loop.call_later(self.limits.header_timeout_s, self._on_timer)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        was_in_head, self._completed_one = self._in_head, False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if not self._refused:
                self._refuse(400, "upgrades are not supported")
            return
        except httptools.HttpParserError as exc:
            if not self._refused:
                self._refuse(400, f"malformed HTTP request: {exc}")
            return
        if self._reading:  # a request in progress: its clock runs
            # a chunk that ends inside a head is all head unless an earlier request ended in it
            if self._in_head and (was_in_head or not self._completed_one):
                self._num_raw_head_bytes += len(data)
                if self._num_raw_head_bytes > self.limits.max_header_bytes:
                    self._refuse_head()
                    return
            self._last_read_s = self.loop.time()
            if self._timer is None:
                self._timer = self.loop.call_later(self.limits.header_timeout_s, self._on_timer)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        if not self.gone.done():
            self.gone.set_result(None)
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._cancel_timer()
        self.pending.clear()
        if self.active is not None:  # nobody is left to answer: stop the work (aborting its requests)
            self.active.cancel()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    # ---- parser callbacks ----------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url, self._headers, self._body, self._body_size = b"", {}, [], 0
        self._num_headers = self._num_head_bytes = self._num_raw_head_bytes = 0
        self._reading = self._in_head = True
        self._cancel_timer()  # the idle wait is over; data_received starts the request's clock

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._num_head_bytes += len(url)
        if self._num_head_bytes > self.limits.max_header_bytes:
            self._refuse_head()
            raise _Stop

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower()] = value
        self._num_headers += 1
        self._num_head_bytes += len(name) + len(value) + 4  # ": " and CRLF
        if self._num_head_bytes > self.limits.max_header_bytes:
            self._refuse_head()
            raise _Stop
        if self._num_headers > self.limits.max_headers:
            self._refuse(431, f"the request has more than {self.limits.max_headers} header fields",
                         code="request_header_fields_too_large")
            raise _Stop

    def on_headers_complete(self) -> None:
        self._in_head = False
        length = self._headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limits.max_body_bytes:
            self._refuse_body()
            raise _Stop
        if self._headers.get(b"expect", b"").lower() == b"100-continue" and not self.server.draining:
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body_size += len(body)
        if self._body_size > self.limits.max_body_bytes:
            self._refuse_body()
            raise _Stop
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._reading, self._completed_one = False, True
        self._cancel_timer()
        url = httptools.parse_url(self._url)
        method = self.parser.get_method()
        head_only = method == b"HEAD"
        exchange = Exchange(self, b"GET" if head_only else method, url.path, url.query or b"", self._headers,
                            b"".join(self._body), self.parser.should_keep_alive(), head_only)
        if self.active is None:
            self._dispatch(exchange)
        else:
            self.pending.append(exchange)

    # ---- dispatch -----------------------------------------------------------------------------------

    def _dispatch(self, exchange: Exchange) -> None:
        self.current = exchange
        self.active = self.loop.create_task(self._run(exchange))

    async def _run(self, exchange: Exchange) -> None:
        if self.server.draining:  # shutting down: new requests are refused, and the connection closed
            exchange._keep_alive = False
            exchange.respond(503, error_body("the server is shutting down; retry on another connection",
                                             "server_error", code="service_unavailable"),
                             [*_JSON, (b"retry-after", b"1")])
        else:
            try:
                await self.server.handler(exchange)
            except Exception:  # a handler bug must still answer the client
                logger.exception("unhandled error answering %s %s", exchange.method.decode(),
                                 exchange.path.decode("utf-8", "replace"))
                if not exchange.answered and not self.gone.done():
                    exchange._keep_alive = False
                    exchange.respond(500, error_body("internal server error", "server_error"), _JSON)
        self.active = self.current = None
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if not exchange.keep_alive or not exchange.answered:
            transport.close()
        elif self.pending:  # (while draining, the next request gets its 503)
            following = self.pending.popleft()
            if isinstance(following, bytes):  # the error that ended reading: the last response
                self.write(following)
                transport.close()
            else:
                self._dispatch(following)
        elif self.server.draining:
            transport.close()
        elif not self._reading:
            self._timer = self.loop.call_later(self.limits.keep_alive_timeout_s, self._on_timer)

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    async def drain(self) -> None:
        if self._write_paused and not self.gone.done():
            self._drained = self.loop.create_future()
            await self._drained

    def start_draining(self) -> None:
        """The server is shutting down: an idle connection closes now; a response not yet begun says it
        closes the connection; the request being answered may finish (it is closed after it)."""
        if self.transport is None or self.transport.is_closing():
            return
        if self.active is None and not self._reading:
            self.transport.close()
        elif self.current is not None and not self.current.answered:
            self.current._keep_alive = False

    # ---- limits -------------------------------------------------------------------------------------

    def _refuse(self, status: int, message: str, *, code: str | None = None) -> None:
        """Answer `status` with an OpenAI error and close the connection: now, or after the responses
        already owed on it. Nothing more is read."""
        self._refused = True
        self._reading = self._in_head = False
        self._cancel_timer()
        response = closing_response(status, error_body(message, "invalid_request_error", code=code), _JSON)
        if self.transport is None or self.transport.is_closing():
            return
        if self.active is None:
            self.write(response)
            self.transport.close()
        else:
            self.pending.append(response)
            self.transport.pause_reading()

    def _refuse_head(self) -> None:
        self._refuse(431, f"the request line and headers are over the {self.limits.max_header_bytes}-byte limit",
                     code="request_header_fields_too_large")

    def _refuse_body(self) -> None:
        self._refuse(413, f"the request body is over the {self.limits.max_body_bytes}-byte limit",
                     code="request_too_large")

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        self._timer = None
        if self.transport is None or self.transport.is_closing():
            return
        timeout_s = self.limits.header_timeout_s
        if self._reading and self._in_head:
            self._refuse(408, f"the request line and headers did not arrive within {timeout_s:g} s",
                         code="request_timeout")
        elif self._reading:
            silent_s = self.loop.time() - self._last_read_s
            if silent_s >= timeout_s:
                self._refuse(408, f"the request body paused for more than {timeout_s:g} s", code="request_timeout")
            else:
                self._timer = self.loop.call_later(timeout_s - silent_s, self._on_timer)
        elif self.active is None and not self.pending:  # silent between requests (or since connecting)
            self.transport.close()


class HttpServer:
    """Serves `handler` on (host, port) within `limits`; `start()` binds (port 0 picks a free one), `close()`
    drains: it stops accepting, closes idle connections, refuses new requests (503, `connection: close`), and
    waits up to `grace_s` (less if `hurry` is set meanwhile) for responses in progress before cutting them
    (their handlers are cancelled, which aborts their requests)."""

    def __init__(self, handler: Handler, *, host: str, port: int, limits: HttpLimits | None = None,
                 backlog: int = 2048) -> None:
        self.handler, self.host, self.port = handler, host, port
        self.limits, self.backlog = limits or HttpLimits(), backlog
        self.connections: set[_Connection] = set()
        self.loop = asyncio.get_running_loop()
        self.draining = False
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> int:
        self._server = await self.loop.create_server(lambda: _Connection(self), self.host, self.port,
                                                     backlog=self.backlog, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def num_in_flight(self) -> int:
        """Responses in progress (the requests being answered)."""
        return sum(1 for conn in self.connections if conn.active is not None)

    async def close(self, grace_s: float = 5.0, hurry: asyncio.Event | None = None) -> None:
        self.draining = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.start_draining()
        deadline_s = self.loop.time() + grace_s
        while self.num_in_flight() and self.loop.time() < deadline_s and not (hurry and hurry.is_set()):
            await asyncio.sleep(0.02)
        cut = [conn.active for conn in self.connections if conn.active is not None]
        if cut:
            logger.warning("shutting down: %d responses still in progress after the grace period are cut", len(cut))
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        for task in cut:
            task.cancel()  # (connection_lost does too, a loop pass later)
        if cut:
            await asyncio.wait(cut, timeout=2.0)  # their requests are aborted on the workers
