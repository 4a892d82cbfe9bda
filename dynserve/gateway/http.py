"""The gateway's HTTP/1.1 server: an asyncio protocol over the httptools parser, with no framework between
the socket and the completion routes.

Every request is read whole (its body capped at `max_body_bytes`, answered 413 before the body is read
when `Content-Length` already says too much) and handed to the `Handler` as an `Exchange`. The handler
answers once (`respond`) or streams (`start_stream`, `write`, `end`: chunked transfer encoding), and can
wait on `exchange.gone`, a future that completes when the client disconnects. Requests on one connection
are answered in order; a pipelined request waits for the one before it. Other routes go through an ASGI
bridge (`AsgiHandler`) to the FastAPI app, whose lifespan the server runs.

Invariants: a connection writes at most one response at a time; `gone` completes exactly once, when the
connection is lost; a handler that raises before answering gets a 500 written for it, never a hang.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import httptools

from dynserve.gateway.errors import error_body

__all__ = ["AsgiHandler", "Exchange", "Handler", "HttpServer"]

logger = logging.getLogger(__name__)

Handler = Callable[["Exchange"], Awaitable[None]]
_REASONS = {200: b"OK", 400: b"Bad Request", 401: b"Unauthorized", 404: b"Not Found", 405: b"Method Not Allowed",
            413: b"Payload Too Large", 422: b"Unprocessable Entity", 429: b"Too Many Requests",
            500: b"Internal Server Error", 503: b"Service Unavailable"}
_SERVER = b"server: dynserve\r\n"


def _status_line(status: int) -> bytes:
    return b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Status"))


def _header_block(headers: list[tuple[bytes, bytes]]) -> bytes:
    return b"".join(name + b": " + value + b"\r\n" for name, value in headers)


class Exchange:
    """One request and its response. `headers` has lower-cased names; `gone` completes on disconnect."""

    __slots__ = ("_conn", "_keep_alive", "_streaming", "body", "gone", "headers", "method", "path", "query",
                 "status", "answered")

    def __init__(self, conn: _Connection, method: bytes, path: bytes, query: bytes,
                 headers: dict[bytes, bytes], body: bytes, keep_alive: bool) -> None:
        self._conn, self.method, self.path, self.query = conn, method, path, query
        self.headers, self.body, self._keep_alive = headers, body, keep_alive
        self.gone: asyncio.Future[None] = conn.gone
        self.status: int | None = None
        self.answered = False
        self._streaming = False

    def respond(self, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        """The whole response in one write."""
        self.status, self.answered = status, True
        connection = b"" if self._keep_alive else b"connection: close\r\n"
        self._conn.write(_status_line(status) + _SERVER + connection + _header_block(headers)
                         + b"content-length: %d\r\n\r\n" % len(body) + body)

    def start_stream(self, status: int, headers: list[tuple[bytes, bytes]], first: bytes = b"") -> None:
        """Send the head of a chunked response, and `first` as its first chunk when given."""
        self.status, self.answered, self._streaming = status, True, True
        connection = b"" if self._keep_alive else b"connection: close\r\n"
        head = (_status_line(status) + _SERVER + connection + _header_block(headers)
                + b"transfer-encoding: chunked\r\n\r\n")
        self._conn.write(head + (b"%x\r\n%s\r\n" % (len(first), first) if first else b""))

    def write(self, data: bytes) -> None:
        if data:
            self._conn.write(b"%x\r\n%s\r\n" % (len(data), data))

    def end(self, last: bytes = b"") -> None:
        """Close a chunked response, `last` being its final chunk."""
        self._conn.write((b"%x\r\n%s\r\n" % (len(last), last) if last else b"") + b"0\r\n\r\n")

    async def drain(self) -> None:
        """Wait while the client reads slower than we write (the transport's buffer is over its mark)."""
        await self._conn.drain()

    @property
    def keep_alive(self) -> bool:
        return self._keep_alive


class _Connection(asyncio.Protocol):
    """One client connection: parse, queue, dispatch in order, and the transport's flow control."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.loop = server.loop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.gone: asyncio.Future[None] = self.loop.create_future()
        self.pending: deque[Exchange] = deque()
        self.active: asyncio.Task[None] | None = None
        self._url = b""
        self._headers: dict[bytes, bytes] = {}
        self._body: list[bytes] = []
        self._body_size = 0
        self._rejected = False
        self._write_paused = False
        self._drained: asyncio.Future[None] | None = None
        self._idle: asyncio.TimerHandle | None = None

    # ---- transport callbacks -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (uvloop has already turned Nagle off)
        self.server.connections.add(self)
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(400, b"upgrades are not supported")
        except httptools.HttpParserError as exc:
            self._fail(400, b"malformed HTTP request: " + str(exc).encode(errors="replace"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        if not self.gone.done():
            self.gone.set_result(None)
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        if self._idle is not None:
            self._idle.cancel()
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
        self._url, self._headers, self._body, self._body_size, self._rejected = b"", {}, [], 0, False
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        length = self._headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.server.max_body_bytes:
            self._reject_too_large()
        elif self._headers.get(b"expect", b"").lower() == b"100-continue":
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self._rejected:
            return
        self._body_size += len(body)
        if self._body_size > self.server.max_body_bytes:
            self._reject_too_large()
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._rejected:
            return
        url = httptools.parse_url(self._url)
        exchange = Exchange(self, self.parser.get_method(), url.path, url.query or b"", self._headers,
                            b"".join(self._body), self.parser.should_keep_alive())
        if self.active is None:
            self._dispatch(exchange)
        else:
            self.pending.append(exchange)

    # ---- dispatch -----------------------------------------------------------------------------------

    def _dispatch(self, exchange: Exchange) -> None:
        self.active = self.loop.create_task(self._run(exchange))

    async def _run(self, exchange: Exchange) -> None:
        try:
            await self.server.handler(exchange)
        except Exception:  # a handler bug must still answer the client
            logger.exception("unhandled error answering %s %s", exchange.method.decode(), exchange.path.decode())
            if not exchange.answered and not self.gone.done():
                exchange.respond(500, error_body("internal server error", "server_error"),
                                 [(b"content-type", b"application/json")])
                exchange._keep_alive = False
        self.active = None
        if self.transport is None or self.transport.is_closing():
            return
        if not exchange.keep_alive or (exchange.answered is False):
            self.transport.close()
        elif self.pending:
            self._dispatch(self.pending.popleft())
        else:
            self._arm_idle()

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    async def drain(self) -> None:
        if self._write_paused and not self.gone.done():
            self._drained = self.loop.create_future()
            await self._drained

    def _reject_too_large(self) -> None:
        self._rejected = True
        limit = self.server.max_body_bytes
        body = error_body(f"the request body is over the {limit}-byte limit", "invalid_request_error",
                          code="request_too_large")
        self.write(_status_line(413) + _SERVER + b"connection: close\r\ncontent-type: application/json\r\n"
                   + b"content-length: %d\r\n\r\n" % len(body) + body)
        if self.transport is not None:
            self.transport.close()

    def _fail(self, status: int, message: bytes) -> None:
        self.write(_status_line(status) + _SERVER + b"connection: close\r\ncontent-type: text/plain\r\n"
                   + b"content-length: %d\r\n\r\n" % len(message) + message)
        if self.transport is not None:
            self.transport.close()

    def _arm_idle(self) -> None:
        if self.server.keep_alive_s > 0:
            self._idle = self.loop.call_later(self.server.keep_alive_s, self._close_idle)

    def _close_idle(self) -> None:
        if self.active is None and self.transport is not None:
            self.transport.close()


class HttpServer:
    """Serves `handler` on (host, port); `start()` binds (port 0 picks a free one), `close()` stops accepting
    and closes idle connections, waiting up to `grace_s` for responses in progress."""

    def __init__(self, handler: Handler, *, host: str, port: int, max_body_bytes: int,
                 keep_alive_s: float = 30.0, backlog: int = 2048) -> None:
        self.handler, self.host, self.port = handler, host, port
        self.max_body_bytes, self.keep_alive_s, self.backlog = max_body_bytes, keep_alive_s, backlog
        self.connections: set[_Connection] = set()
        self.loop = asyncio.get_running_loop()
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> int:
        self._server = await self.loop.create_server(lambda: _Connection(self), self.host, self.port,
                                                     backlog=self.backlog, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self, grace_s: float = 5.0) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            if conn.active is None and conn.transport is not None:
                conn.transport.close()
        active = [c.active for c in self.connections if c.active is not None]
        if active:
            await asyncio.wait(active, timeout=grace_s)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()


class AsgiHandler:
    """Answers an `Exchange` with an ASGI app (FastAPI here): one `http.request` message carrying the whole
    body, then `http.disconnect` when the client goes; the response is streamed chunked unless the app set a
    content-length."""

    def __init__(self, app: Any, server_address: tuple[str, int]) -> None:
        self.app, self.server_address = app, server_address

    async def __call__(self, exchange: Exchange) -> None:
        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": exchange.method.decode(), "scheme": "http", "path": exchange.path.decode("utf-8", "replace"),
            "raw_path": exchange.path, "query_string": exchange.query, "root_path": "",
            "headers": list(exchange.headers.items()), "client": None, "server": self.server_address,
            "state": {},
        }
        delivered = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": exchange.body, "more_body": False}
            await exchange.gone
            return {"type": "http.disconnect"}

        start: dict[str, Any] = {}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
                return
            if message["type"] != "http.response.body":
                return
            body, more = message.get("body", b""), message.get("more_body", False)
            if not exchange.answered:
                headers = [(bytes(k).lower(), bytes(v)) for k, v in start.get("headers", [])]
                headers = [(k, v) for k, v in headers if k != b"content-length"]
                if not more:
                    exchange.respond(start["status"], body, headers)
                    return
                exchange.start_stream(start["status"], headers, body)
            else:
                exchange.write(body)
            if more:
                await exchange.drain()
            else:
                exchange.end()

        await self.app(scope, receive, send)
