"""One request on the gateway's HTTP server and the writing of its response (`Exchange`): whole, or chunked."""

from __future__ import annotations

import asyncio
from typing import Protocol

__all__ = ["Connection", "Exchange", "closing_response"]

_REASONS = {200: b"OK", 400: b"Bad Request", 401: b"Unauthorized", 404: b"Not Found", 405: b"Method Not Allowed",
            408: b"Request Timeout", 413: b"Payload Too Large", 422: b"Unprocessable Entity",
            429: b"Too Many Requests", 431: b"Request Header Fields Too Large", 500: b"Internal Server Error",
            503: b"Service Unavailable"}
_SERVER = b"server: dynserve\r\n"


class Connection(Protocol):
    """What an exchange needs of its connection (`http._Connection`)."""

    gone: asyncio.Future[None]

    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...


def _status_line(status: int) -> bytes:
    return b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Status"))


def _header_block(headers: list[tuple[bytes, bytes]]) -> bytes:
    return b"".join(name + b": " + value + b"\r\n" for name, value in headers)


def closing_response(status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
    return (_status_line(status) + _SERVER + b"connection: close\r\n" + _header_block(headers)
            + b"content-length: %d\r\n\r\n" % len(body) + body)


class Exchange:
    """One request and its response. `headers` has lower-cased names; `gone` completes on disconnect. A HEAD
    request arrives as a GET with `head_only` set: the response's head is written, its body is not."""

    __slots__ = ("_conn", "_keep_alive", "_streaming", "answered", "body", "gone", "head_only", "headers",
                 "method", "path", "query", "status")

    def __init__(self, conn: Connection, method: bytes, path: bytes, query: bytes,
                 headers: dict[bytes, bytes], body: bytes, keep_alive: bool, head_only: bool = False) -> None:
        self._conn, self.method, self.path, self.query = conn, method, path, query
        self.headers, self.body, self._keep_alive, self.head_only = headers, body, keep_alive, head_only
        self.gone: asyncio.Future[None] = conn.gone
        self.status: int | None = None
        self.answered = False
        self._streaming = False

    def respond(self, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        """The whole response in one write."""
        self.status, self.answered = status, True
        connection = b"" if self._keep_alive else b"connection: close\r\n"
        self._conn.write(_status_line(status) + _SERVER + connection + _header_block(headers)
                         + b"content-length: %d\r\n\r\n" % len(body) + (b"" if self.head_only else body))

    def start_stream(self, status: int, headers: list[tuple[bytes, bytes]], first: bytes = b"") -> None:
        """Send the head of a chunked response, and `first` as its first chunk when given."""
        self.status, self.answered, self._streaming = status, True, True
        connection = b"" if self._keep_alive else b"connection: close\r\n"
        head = (_status_line(status) + _SERVER + connection + _header_block(headers)
                + b"transfer-encoding: chunked\r\n\r\n")
        if first and not self.head_only:
            head += b"%x\r\n%s\r\n" % (len(first), first)
        self._conn.write(head)

    def write(self, data: bytes) -> None:
        if data and not self.head_only:
            self._conn.write(b"%x\r\n%s\r\n" % (len(data), data))

    def end(self, last: bytes = b"") -> None:
        """Close a chunked response, `last` being its final chunk."""
        if not self.head_only:
            self._conn.write((b"%x\r\n%s\r\n" % (len(last), last) if last else b"") + b"0\r\n\r\n")

    async def drain(self) -> None:
        """Wait while the client reads slower than we write (the transport's buffer is over its mark)."""
        await self._conn.drain()

    @property
    def keep_alive(self) -> bool:
        return self._keep_alive
