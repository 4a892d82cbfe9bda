"""The gateway's HTTP client to OpenAI-server workers (`dynserve.workers.http_client`) against a small real
HTTP/1.1 server on a loopback port (asyncio streams, chunked SSE bodies as vLLM's uvicorn sends them): keep-alive
connections are reused, a response cut short or marked `connection: close` takes its connection down."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from dynserve.workers.http_client import HttpPool


class _SseServer:
    """Answers every POST with a chunked SSE stream of two events and `[DONE]`; counts connections. A request
    path of `/close` answers with `connection: close` (and closes after it). With `drop_second`, the second
    request on a connection is read and the connection closed unanswered: what a client sees when it sends on
    a kept-alive connection just as the server's idle timeout closes it."""

    def __init__(self, drop_second: bool = False) -> None:
        self.connections = 0
        self.port = 0
        self.drop_second = drop_second

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            for number in range(1, 1000):
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                if self.drop_second and number == 2:
                    break
                close = head.startswith(b"POST /close ")
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
                             + (b"connection: close\r\n" if close else b"") + b"\r\n")
                for event in (b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"):
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                    await writer.drain()
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                if close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @asynccontextmanager
    async def running(self) -> AsyncIterator[_SseServer]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        async with server:
            yield self


async def _stream(pool: HttpPool, path: str = "/v1/completions", *, stop_after: int | None = None) -> list[bytes]:
    """The stream's `data:` lines, read as the OpenAI channel reads them: to `[DONE]`, then the rest drained;
    or closed after `stop_after` lines (a client that went away)."""
    response = await pool.request("POST", path, b"{}")
    lines: list[bytes] = []
    try:
        async for line in response.lines():
            if not line.startswith(b"data: "):
                continue
            lines.append(line)
            if line == b"data: [DONE]":
                await response.drain()
                break
            if stop_after is not None and len(lines) >= stop_after:
                break
    finally:
        response.close()
    return lines


def test_streams_read_to_their_end_reuse_one_connection() -> None:
    async def scenario() -> tuple[int, list[bytes]]:
        async with _SseServer().running() as server:
            pool = HttpPool("127.0.0.1", server.port)
            for _ in range(5):
                lines = await _stream(pool)
            pool.close()
            return server.connections, lines

    connections, lines = asyncio.run(scenario())
    assert lines == [b'data: {"n": 1}', b'data: {"n": 2}', b"data: [DONE]"]
    assert connections == 1


def test_a_stream_cut_short_or_marked_close_takes_its_connection_down() -> None:
    async def scenario() -> tuple[int, int]:
        async with _SseServer().running() as server:
            pool = HttpPool("127.0.0.1", server.port)
            await _stream(pool, stop_after=1)  # closed mid-body: the server must see it go
            await _stream(pool)
            await _stream(pool, "/close")  # the server ends the connection after it
            after_close = len(pool._idle)
            await _stream(pool)
            pool.close()
            return server.connections, after_close

    connections, idle_after_close = asyncio.run(scenario())
    assert idle_after_close == 0
    # 1: cut short; 2: a new one, kept and reused for /close; 3: after the server closed it
    assert connections == 3


def test_connections_the_server_closed_while_idle_cost_a_resend_not_a_request() -> None:
    async def scenario() -> tuple[int, list[bytes]]:
        async with _SseServer(drop_second=True).running() as server:
            pool = HttpPool("127.0.0.1", server.port)
            await asyncio.gather(*(_stream(pool) for _ in range(3)))  # three idle connections, each to be dropped
            lines = await _stream(pool)  # the first idle one fails: sent again on a new one, not another idle
            pool.close()
            return server.connections, lines

    connections, lines = asyncio.run(scenario())
    assert lines[-1] == b"data: [DONE]"
    assert connections == 4


def test_an_idle_connection_older_than_the_servers_keep_alive_is_not_used() -> None:
    async def scenario() -> tuple[int, int]:
        async with _SseServer().running() as server:
            pool = HttpPool("127.0.0.1", server.port, max_idle_s=0.05)
            await _stream(pool)
            await _stream(pool)
            reused = server.connections
            await asyncio.sleep(0.1)
            await _stream(pool)
            pool.close()
            return reused, server.connections

    assert asyncio.run(scenario()) == (1, 2)
