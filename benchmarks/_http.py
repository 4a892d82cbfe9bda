"""A lean HTTP/1.1 client for load generation: one keep-alive connection per simulated user, bodies encoded
before the clock starts, and the send time taken when the request bytes are handed to the socket.

General-purpose clients spend a millisecond or more of Python per request building it; in a burst of 16
that piles up on the client side and gets charged to the server. This client measures what the server
adds. It speaks just enough HTTP for our gateway: a POST with a JSON body, a response with either a
Content-Length or chunked transfer encoding, and server-sent events inside it. `http_get`: one blocking GET
of a small text body (metrics, discovery) for the benchmarks' readers.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import time
from collections.abc import AsyncIterator
from typing import Any

__all__ = ["HttpError", "RawConnection", "http_get", "read_chunked_body", "stream_chat"]


def http_get(address: str, path: str, timeout_s: float = 10.0) -> str:
    """The body of `GET path` from `address` (`host:port`, an IPv6 host in brackets); raises on a non-200."""
    host, _, port = address.rpartition(":")
    conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout_s)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        body = response.read().decode()
        if response.status != 200:
            raise RuntimeError(f"GET {address}{path} answered {response.status}")
        return body
    finally:
        conn.close()


async def read_chunked_body(reader: asyncio.StreamReader) -> bytes:
    """A chunked response body, whole (its head already read): the chunks joined, up to the last one."""
    body = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
        piece = await reader.readexactly(size + 2)
        if size == 0:
            return bytes(body)
        body += piece[:-2]


class HttpError(RuntimeError):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:300]!r}")
        self.status, self.body = status, body


class RawConnection:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def open(self) -> RawConnection:
        self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def request_bytes(self, path: str, body: bytes) -> bytes:
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nAccept: text/event-stream\r\n\r\n")
        return head.encode() + body

    async def post_events(self, request: bytes) -> tuple[float, AsyncIterator[bytes]]:
        """Send a pre-encoded request; returns (monotonic send time, iterator over the SSE `data:` payloads)."""
        assert self._writer is not None and self._reader is not None
        self._writer.write(request)
        sent_s = time.monotonic()
        return sent_s, self._events()

    async def _events(self) -> AsyncIterator[bytes]:
        reader = self._reader
        assert reader is not None
        status_line = await reader.readline()
        status = int(status_line.split()[1])
        headers: dict[bytes, bytes] = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        if status != 200:
            raise HttpError(status, await self._read_body(headers))
        buffer = b""
        async for piece in self._body_pieces(headers):
            buffer += piece
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                if event.startswith(b"data: "):
                    yield event[6:]

    async def _read_body(self, headers: dict[bytes, bytes]) -> bytes:
        return b"".join([piece async for piece in self._body_pieces(headers)])

    async def _body_pieces(self, headers: dict[bytes, bytes]) -> AsyncIterator[bytes]:
        reader = self._reader
        assert reader is not None
        if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            while True:
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    await reader.readline()  # the CRLF after the last chunk
                    return
                yield await reader.readexactly(size)
                await reader.readexactly(2)
        else:
            yield await reader.readexactly(int(headers.get(b"content-length", b"0")))


async def stream_chat(port: int, model: str, messages: list[dict[str, str]],
                      max_tokens: int) -> tuple[str, float, dict[str, Any]]:
    """One greedy streamed chat completion to 127.0.0.1:`port`, on a connection of its own: (the answer, TTFT in
    s, the usage). RuntimeError on an error event or a stream without an answer or usage."""
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    conn = await RawConnection("127.0.0.1", port).open()
    try:
        sent_s, events = await conn.post_events(conn.request_bytes("/v1/chat/completions", body))
        first_s, usage, parts = None, None, []
        async for data in events:
            if data == b"[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"error event: {chunk['error']}")
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if content:
                    parts.append(content)
                if first_s is None and (content or choice.get("finish_reason")):  # an empty answer: its end
                    first_s = time.monotonic()
    finally:
        await conn.close()
    if first_s is None or usage is None:
        raise RuntimeError("no answer or no usage in the stream")
    return "".join(parts), first_s - sent_s, usage
