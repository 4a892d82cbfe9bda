"""The gateway's HTTP/1.1 server on raw sockets: framing, keep-alive, pipelining, limits and failures, with a
small echo handler (the completion routes over it are tested end to end in test_gateway.py)."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from dynserve.gateway.http import Exchange, HttpServer


def _sync(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test on a fresh event loop (the server under test lives on it)."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


async def _echo(exchange: Exchange) -> None:
    if exchange.path == b"/boom":
        raise RuntimeError("a handler bug")
    if exchange.path == b"/stream":
        exchange.start_stream(200, [(b"content-type", b"text/plain")], b"one,")
        exchange.write(b"two,")
        await exchange.drain()
        exchange.end(b"three")
        return
    if exchange.path == b"/hang":
        await asyncio.sleep(3600)
    body = json.dumps({"method": exchange.method.decode(), "path": exchange.path.decode(),
                       "query": exchange.query.decode(), "body": exchange.body.decode(),
                       "x": exchange.headers.get(b"x-test", b"").decode()}).encode()
    exchange.respond(200, body, [(b"content-type", b"application/json")])


async def _server(**kwargs: object) -> HttpServer:
    server = HttpServer(_echo, host="127.0.0.1", port=0, max_body_bytes=kwargs.pop("max_body_bytes", 1000),
                        **kwargs)  # type: ignore[arg-type]
    await server.start()
    return server


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v for k, _, v in (line.partition(": ") for line in lines[1:] if line)}
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    body = b""
    while True:
        size = int((await reader.readline()).strip(), 16)
        chunk = await reader.readexactly(size + 2)
        if size == 0:
            return status, headers, body
        body += chunk[:-2]


def _post(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n{extra}\r\n").encode() + body


@_sync
async def test_keep_alive_and_pipelined_requests_are_answered_in_order() -> None:
    server = await _server()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(_post("/a?q=1", b"first", "x-test: yes\r\n") + _post("/b", b"second") + _post("/c", b""))
    answers = [await _read_response(reader) for _ in range(3)]
    assert [json.loads(body)["path"] for _, _, body in answers] == ["/a", "/b", "/c"]
    first = json.loads(answers[0][2])
    assert (first["query"], first["body"], first["x"], first["method"]) == ("q=1", "first", "yes", "POST")
    writer.close()
    await server.close()


@_sync
async def test_chunked_response_and_chunked_request_body() -> None:
    server = await _server()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
    status, headers, body = await _read_response(reader)
    assert (status, headers["transfer-encoding"], body) == (200, "chunked", b"one,two,three")
    writer.write(b"POST /e HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
    _, _, body = await _read_response(reader)
    assert json.loads(body)["body"] == "abcde"
    writer.close()
    await server.close()


@_sync
async def test_expect_100_continue_is_answered_before_the_body() -> None:
    server = await _server()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"POST /e HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\nexpect: 100-continue\r\n\r\n")
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2) == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(b"body")
    status, _, body = await _read_response(reader)
    assert (status, json.loads(body)["body"]) == (200, "body")
    writer.close()
    await server.close()


@_sync
@pytest.mark.parametrize("chunked", [False, True])
async def test_a_body_over_the_limit_gets_413_in_openai_shape(chunked: bool) -> None:
    server = await _server(max_body_bytes=10)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    if chunked:  # no content-length: the limit is enforced while the body arrives
        writer.write(b"POST /e HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n10\r\n" + b"x" * 16 + b"\r\n")
    else:
        writer.write(_post("/e", b"x" * 11))
    status, headers, body = await _read_response(reader)
    assert status == 413 and headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "request_too_large"
    writer.close()
    await server.close()


@_sync
async def test_malformed_http_gets_400_and_a_handler_bug_gets_500() -> None:
    server = await _server()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"NOT HTTP AT ALL\r\n\r\n")
    status, _, _ = await _read_response(reader)
    assert status == 400
    writer.close()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /boom HTTP/1.1\r\nhost: x\r\n\r\n")
    status, _, body = await _read_response(reader)
    assert status == 500 and json.loads(body)["error"]["type"] == "server_error"
    writer.close()
    await server.close()


@_sync
async def test_a_client_that_leaves_cancels_its_handler() -> None:
    server = await _server()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /hang HTTP/1.1\r\nhost: x\r\n\r\n")
    for _ in range(100):
        active = [c.active for c in server.connections if c.active is not None]
        if active:
            break
        await asyncio.sleep(0.01)
    writer.close()
    await asyncio.wait_for(asyncio.gather(*active, return_exceptions=True), 2)
    assert all(task.cancelled() for task in active)
    await server.close()
