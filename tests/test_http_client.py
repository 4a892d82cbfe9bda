"""The gateway's HTTP client to OpenAI-server workers (`dynserve.workers.http_client`) against a small real
HTTP server on a loopback port (asyncio streams; chunked SSE bodies as vLLM's uvicorn sends them, or an
HTTP/1.0 body ended by closing): kept connections are reused, and a response cut short, marked
`connection: close`, closed by its server or left idle too long takes its connection down, never a request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from dynserve.workers.http_client import HttpPool

EVENTS = (b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n")


class _SseServer:
    """Answers every POST with an SSE stream of two events and `[DONE]`, chunked; counts connections.

    Paths: `/close` answers with `connection: close` (and closes after it); `/http10` answers as HTTP/1.0
    with a body the server ends by closing; `/late-end` sends the chunked body's end only when `release_end`
    is set. With `drop_second`, the second request on a connection is read and the connection closed
    unanswered: what a client sees when it sends on a kept connection just as the server's idle timeout
    closes it."""

    def __init__(self, drop_second: bool = False) -> None:
        self.connections = 0
        self.port = 0
        self.drop_second = drop_second
        self.release_end = asyncio.Event()

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
                path = head.split(b" ")[1]
                if path == b"/http10":
                    writer.write(b"HTTP/1.0 200 OK\r\ncontent-type: text/event-stream\r\n\r\n" + b"".join(EVENTS))
                    await writer.drain()
                    break
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
                             + (b"connection: close\r\n" if path == b"/close" else b"") + b"\r\n")
                for event in EVENTS:
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                    await writer.drain()
                if path == b"/late-end":
                    await self.release_end.wait()
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                if path == b"/close":
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
    """The stream's `data:` lines, read as the OpenAI channel reads them: to `[DONE]`, then `finish`; or
    closed after `stop_after` lines (a client that went away)."""
    response = await pool.request("POST", path, b"{}")
    lines: list[bytes] = []
    try:
        async for line in response.lines():
            if not line.startswith(b"data: "):
                continue
            lines.append(line)
            if line == b"data: [DONE]":
                response.finish()
                break
            if stop_after is not None and len(lines) >= stop_after:
                break
    finally:
        response.close()
    return lines


async def _settle() -> None:
    """Let the pool's background reads of bodies' ends and the server's closes run."""
    for _ in range(5):
        await asyncio.sleep(0.002)


def test_streams_read_to_their_end_reuse_one_connection() -> None:
    async def scenario() -> tuple[int, list[bytes]]:
        async with _SseServer().running() as server:
            pool = HttpPool("127.0.0.1", server.port)
            for _ in range(5):
                lines = await _stream(pool)
                await _settle()
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
            await _settle()
            await _stream(pool, "/close")  # the server ends the connection after it
            await _settle()
            after_close = pool.num_idle
            await _stream(pool)
            pool.close()
            return server.connections, after_close

    connections, idle_after_close = asyncio.run(scenario())
    assert idle_after_close == 0
    # 1: cut short; 2: a new one, kept and reused for /close; 3: after the server closed it
    assert connections == 3


def test_a_body_the_server_ends_by_closing_finishes_without_an_error() -> None:
    """HTTP/1.0 with no framing: not kept alive, so `finish` closes it rather than read to an end that only
    the close brings (which would read as a broken stream)."""
    async def scenario() -> tuple[list[bytes], int, list[bytes]]:
        async with _SseServer().running() as server:
            pool = HttpPool("127.0.0.1", server.port)
            lines = await _stream(pool, "/http10")
            await _settle()
            idle = pool.num_idle
            after = await _stream(pool)
            pool.close()
            return lines, idle, after

    lines, idle, after = asyncio.run(scenario())
    assert lines[-1] == b"data: [DONE]" and idle == 0 and after[-1] == b"data: [DONE]"


def test_a_body_whose_end_comes_late_is_kept_once_it_comes_and_closed_when_too_late() -> None:
    async def scenario() -> tuple[int, int, int]:
        async with _SseServer().running() as server:
            pool = HttpPool("127.0.0.1", server.port, finish_timeout_s=0.2)
            await _stream(pool, "/late-end")  # `finish` returns at once: the end is read in the background
            idle_before_end = pool.num_idle
            server.release_end.set()
            await _settle()
            idle_after_end = pool.num_idle
            server.release_end.clear()
            await _stream(pool, "/late-end")  # its end never comes in time
            await asyncio.sleep(0.3)
            idle_after_timeout = pool.num_idle
            server.release_end.set()
            pool.close()
            return idle_before_end, idle_after_end, idle_after_timeout

    assert asyncio.run(scenario()) == (0, 1, 0)


def test_connections_the_server_closed_while_idle_cost_a_resend_not_a_request() -> None:
    async def scenario() -> tuple[int, list[bytes]]:
        async with _SseServer(drop_second=True).running() as server:
            pool = HttpPool("127.0.0.1", server.port)
            await asyncio.gather(*(_stream(pool) for _ in range(3)))  # three idle connections, each to be dropped
            await _settle()
            lines = await _stream(pool)  # the first idle one fails: sent again on a new one, not another idle
            pool.close()
            return server.connections, lines

    connections, lines = asyncio.run(scenario())
    assert lines[-1] == b"data: [DONE]"
    assert connections == 4


def test_idle_connections_older_than_max_idle_are_not_used_and_expire_oldest_first() -> None:
    now = [0.0]

    async def scenario() -> tuple[int, int, int]:
        async with _SseServer().running() as server:
            pool = HttpPool("127.0.0.1", server.port, max_idle_s=4.0, clock=lambda: now[0])
            await asyncio.gather(*(_stream(pool) for _ in range(2)))  # two idle, kept at t=0
            await _settle()
            now[0] = 3.0
            await _stream(pool)  # reuses one, kept again at t=3
            await _settle()
            reused = server.connections
            now[0] = 5.0  # the one kept at t=0 has expired; the one kept at t=3 has not
            await _stream(pool)
            await _settle()
            idle = pool.num_idle
            pool.close()
            return reused, server.connections, idle

    assert asyncio.run(scenario()) == (2, 2, 1)
