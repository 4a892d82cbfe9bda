"""A small HTTP/1.1 client for the gateway's hot path to OpenAI-server workers (`openai_channel.py`): requests
over keep-alive connections held in a pool per server, responses parsed by httptools (the gateway's own
server's parser), streamed bodies read as they arrive, chunked or not. It does what a streamed completion
needs and no more (no redirects, TLS, cookies, proxies); general HTTP clients cost milliseconds per request
in Python that a gateway in front of a worker cannot spend.

Invariants:
- a connection goes back to the pool only after its response was read to the end and the server kept it
  alive; a response closed early (an aborted stream, a request cancelled before its head came) closes its
  connection, which is how the server learns of the abort;
- an idle connection is used again only while it is younger than `max_idle_s` (under the servers' own idle
  timeouts: uvicorn's, and so vLLM's, is 5 s) and its server has not closed it; a request whose kept
  connection turns out closed before any answer came is sent once more, on a new connection (a server that
  had read it saw its connection go, which aborts it there);
- every failure to connect, send or read is a `ConnectionError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

import httptools

__all__ = ["HttpPool", "Response"]


class _Message:
    """httptools' callbacks for one response, and its parser."""

    def __init__(self) -> None:
        self.headers: dict[bytes, bytes] = {}
        self.body: deque[bytes] = deque()
        self.headers_done = self.done = self.keep_alive = False
        self.parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)

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
        self.parser = None  # no cycle left for the garbage collector (the reader keeps its own reference)


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.idle_since_s: float | None = None  # set while it waits in the pool

    def close(self) -> None:
        self.writer.close()


class Response:
    """A response whose head has arrived; read its body with `chunks`, `lines` or `read`, then `finish` or
    `close` it."""

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

    def finish(self) -> None:
        """Done with a body whose last event has come (an SSE stream's `[DONE]`): what is left of it (a
        chunked body's end) is read and dropped, at once when it is here, else by a task of the pool's, and
        the connection kept; closed instead when the server does not keep it alive (a body it ends by
        closing), or the rest fails or takes over the pool's `finish_timeout_s`. Never raises or waits."""
        if self._closed:
            return
        self._closed = True
        message = self._message
        message.body.clear()
        if not message.keep_alive:
            self._conn.close()
        elif message.done:
            self._pool._keep(self._conn)
        else:
            self._pool._finish_later(self._conn, message, self._parser)

    def _release(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._message.keep_alive:
            self._pool._keep(self._conn)
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
                 max_idle_s: float = 4.0, finish_timeout_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.host, self.port = host, port
        self._connect_timeout_s, self._max_idle, self._max_idle_s = connect_timeout_s, max_idle, max_idle_s
        self._finish_timeout_s, self._clock = finish_timeout_s, clock
        self._idle: deque[_Connection] = deque()  # the oldest on the left
        self._finishing: set[asyncio.Task[None]] = set()
        self._closed = False
        self._authority = f"{host}:{port}".encode() if ":" not in host else f"[{host}]:{port}".encode()

    @property
    def num_idle(self) -> int:
        """Connections waiting in the pool now (some may have expired: they go when next looked at)."""
        return len(self._idle)

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
        """Send a request and return its response once the head has arrived (see the module's invariants
        for kept connections that turn out closed)."""
        head = (b"%s %s HTTP/1.1\r\nhost: %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
                % (method.encode(), path.encode(), self._authority, content_type, len(body)))
        for attempt in range(2):
            conn = self._take_idle() if attempt == 0 else None
            reused = conn is not None
            if conn is None:
                conn = await self._open()
            message = _Message()
            parser = message.parser
            assert parser is not None
            try:
                conn.writer.write(head + body)
                while not message.headers_done:
                    await self._fill(conn, parser)
            except ConnectionError:
                if reused:  # the kept connection was closed under it, before any answer: once more, on a new one
                    continue
                raise
            except BaseException:  # cancelled while waiting for the head: the server must see the request go
                conn.close()
                raise
            return Response(self, conn, message, parser, parser.get_status_code())
        raise AssertionError("unreachable")

    def _usable(self, conn: _Connection, now_s: float) -> bool:
        """Young enough, and its server has not closed it (a FIN or a reset has not arrived)."""
        assert conn.idle_since_s is not None
        return (now_s - conn.idle_since_s < self._max_idle_s and not conn.reader.at_eof()
                and conn.reader.exception() is None)

    def _expire(self, now_s: float) -> None:
        """Close the idle connections past `max_idle_s`, oldest first (they sit in the order they came)."""
        idle = self._idle
        while idle and not self._usable(idle[0], now_s):
            idle.popleft().close()

    def _take_idle(self) -> _Connection | None:
        """The most recently used idle connection that is still usable, or None."""
        now_s = self._clock()
        self._expire(now_s)
        while self._idle:
            conn = self._idle.pop()
            if self._usable(conn, now_s):
                conn.idle_since_s = None
                return conn
            conn.close()
        return None

    def _keep(self, conn: _Connection) -> None:
        """A connection whose response was read to its end, kept alive by its server: idle in the pool."""
        now_s = self._clock()
        self._expire(now_s)
        if self._closed or len(self._idle) >= self._max_idle:
            conn.close()
            return
        conn.idle_since_s = now_s
        self._idle.append(conn)

    def _finish_later(self, conn: _Connection, message: _Message, parser: httptools.HttpResponseParser) -> None:
        task = asyncio.get_running_loop().create_task(self._read_to_end(conn, message, parser))
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

    async def _read_to_end(self, conn: _Connection, message: _Message, parser: httptools.HttpResponseParser) -> None:
        try:
            async with asyncio.timeout(self._finish_timeout_s):
                while not message.done:
                    await self._fill(conn, parser)
                    message.body.clear()
        except (TimeoutError, ConnectionError):
            conn.close()
            return
        except asyncio.CancelledError:
            conn.close()
            raise
        self._keep(conn)

    def close(self) -> None:
        self._closed = True
        for task in list(self._finishing):
            task.cancel()
        while self._idle:
            with contextlib.suppress(Exception):
                self._idle.pop().close()
