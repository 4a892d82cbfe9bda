"""A small HTTP/1.1 client for the gateway's hot path to OpenAI-server workers (`openai_channel.py`): requests
over keep-alive connections held in a pool per server, responses parsed by httptools (the gateway's own
server's parser), streamed bodies read as they arrive, chunked or not. It does what a streamed completion
needs and no more (no redirects, TLS, cookies, proxies); general HTTP clients cost milliseconds per request
in Python that a gateway in front of a worker cannot spend.

Invariants: a connection goes back to the pool only after its response was read to the end and the server
kept it alive; a response closed early (an aborted stream) closes its connection, which is how the server
learns of the abort. Every failure to connect, send or read is a `ConnectionError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections import deque
from collections.abc import AsyncIterator

import httptools

__all__ = ["HttpPool", "Response"]


class _Message:
    """httptools' callbacks for one response."""

    def __init__(self) -> None:
        self.headers: dict[bytes, bytes] = {}
        self.body: deque[bytes] = deque()
        self.headers_done = self.done = self.keep_alive = False
        self.parser: httptools.HttpResponseParser | None = None

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        self.headers_done = True
        # asked here: once the message is complete the parser has moved on and says false
        self.keep_alive = self.parser is not None and self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.done = True


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.idle_since_s = 0.0

    def close(self) -> None:
        self.writer.close()


class Response:
    """A response whose head has arrived; read its body with `chunks`, `lines` or `read`, or `close` it."""

    def __init__(self, pool: HttpPool, conn: _Connection, message: _Message, parser: httptools.HttpResponseParser,
                 status: int) -> None:
        self._pool, self._conn, self._message, self._parser = pool, conn, message, parser
        self.status, self.headers = status, message.headers
        self._closed = False

    async def chunks(self) -> AsyncIterator[bytes]:
        message = self._message
        while True:
            while message.body:
                yield message.body.popleft()
            if message.done:
                self._release()
                return
            await self._pool._fill(self._conn, self._parser)

    async def lines(self) -> AsyncIterator[bytes]:
        """The body's lines, without their line ends (an SSE stream's `data: ...` lines and blank lines)."""
        pending = b""
        async for chunk in self.chunks():
            pending += chunk
            *complete, pending = pending.split(b"\n")
            for line in complete:
                yield line.rstrip(b"\r")
        if pending:
            yield pending

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    async def drain(self, timeout_s: float = 1.0) -> None:
        """Read and drop the rest of the body (a stream whose last event has come), so its connection can be
        kept; a body that does not end within `timeout_s` is closed instead."""
        message = self._message
        message.body.clear()
        if message.done:
            self._release()
            return
        try:
            async with asyncio.timeout(timeout_s):
                while not message.done:
                    await self._pool._fill(self._conn, self._parser)
        except TimeoutError:
            self.close()
            return
        message.body.clear()
        self._release()

    def _release(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._message.keep_alive and len(self._pool._idle) < self._pool._max_idle:
            self._conn.idle_since_s = time.monotonic()
            self._pool._idle.append(self._conn)
        else:
            self._conn.close()

    def close(self) -> None:
        """Done with it: a response not read to the end takes its connection down (the server sees it go)."""
        if not self._closed:
            self._closed = True
            self._conn.close()


class HttpPool:
    """Keep-alive connections to one server (host, port). One asyncio loop only."""

    def __init__(self, host: str, port: int, *, connect_timeout_s: float = 5.0, max_idle: int = 64,
                 max_idle_s: float = 4.0) -> None:
        self.host, self.port = host, port
        self._connect_timeout_s, self._max_idle, self._max_idle_s = connect_timeout_s, max_idle, max_idle_s
        self._idle: deque[_Connection] = deque()
        self._authority = f"{host}:{port}".encode() if ":" not in host else f"[{host}]:{port}".encode()

    async def _open(self) -> _Connection:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port),
                                                    self._connect_timeout_s)
        except (OSError, TimeoutError) as exc:
            raise ConnectionError(f"cannot connect to {self.host}:{self.port}: {exc or type(exc).__name__}") from exc
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _Connection(reader, writer)

    async def _fill(self, conn: _Connection, parser: httptools.HttpResponseParser) -> None:
        try:
            data = await conn.reader.read(65536)
        except OSError as exc:
            conn.close()
            raise ConnectionError(f"{self.host}:{self.port}: {exc}") from exc
        if not data:
            conn.close()
            raise ConnectionError(f"{self.host}:{self.port} closed the connection mid-response")
        try:
            parser.feed_data(data)
        except httptools.HttpParserError as exc:
            conn.close()
            raise ConnectionError(f"{self.host}:{self.port} sent malformed HTTP: {exc}") from exc

    async def request(self, method: str, path: str, body: bytes = b"",
                      content_type: bytes = b"application/json") -> Response:
        """Send a request and return its response once the head has arrived. A kept-alive connection that the
        server closed meanwhile is dropped and the request sent once more on a new connection."""
        head = (b"%s %s HTTP/1.1\r\nhost: %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
                % (method.encode(), path.encode(), self._authority, content_type, len(body)))
        for attempt in range(2):
            conn = self._take_idle() if attempt == 0 else None
            reused = conn is not None
            if conn is None:
                conn = await self._open()
            message = _Message()
            parser = message.parser = httptools.HttpResponseParser(message)
            try:
                conn.writer.write(head + body)
                while not message.headers_done:
                    await self._fill(conn, parser)
            except ConnectionError:
                if reused and attempt == 0:  # a stale keep-alive connection: nothing reached the server
                    continue
                raise
            return Response(self, conn, message, parser, parser.get_status_code())
        raise AssertionError("unreachable")

    def _take_idle(self) -> _Connection | None:
        """The most recently used idle connection that may still be open, or None. Servers close idle
        keep-alive connections after a few seconds (uvicorn's default, and so vLLM's: 5 s), so one idle for
        `max_idle_s` is dropped, as is one whose server already closed it (its FIN has arrived)."""
        now_s = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if now_s - conn.idle_since_s < self._max_idle_s and not conn.reader.at_eof():
                return conn
            conn.close()
        return None

    def close(self) -> None:
        while self._idle:
            with contextlib.suppress(Exception):
                self._idle.pop().close()
