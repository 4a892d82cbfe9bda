"""The gateway's HTTP/1.1 server on raw sockets: framing, keep-alive, pipelining, HEAD, limits (sizes and
timeouts), failures and the drain at shutdown, with a small echo handler (the completion routes over it are tested end to end in test_gateway.py)."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from dynserve.gateway.http import Exchange, HttpLimits, HttpServer


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
    if exchange.path == b"/slow":
        await asyncio.sleep(0.8)
    body = json.dumps({"method": exchange.method.decode(), "path": exchange.path.decode(),
                       "query": exchange.query.decode(), "body": exchange.body.decode(),
                       "x": exchange.headers.get(b"x-test", b"").decode()}).encode()
    exchange.respond(200, body, [(b"content-type", b"application/json")])


async def _server(**limits: Any) -> HttpServer:
    server = HttpServer(_echo, host="127.0.0.1", port=0, limits=HttpLimits(**{"max_body_bytes": 1000, **limits}))
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


# ---- limits: what one client may send, and how long it may take ------------------------------------------


async def _closed_by_server(reader: asyncio.StreamReader, within_s: float) -> bool:
    """True when the server closes the connection (EOF) within `within_s` without sending anything."""
    try:
        return await asyncio.wait_for(reader.read(1), within_s) == b""
    except (TimeoutError, ConnectionResetError):
        return False


async def _refusal(request: bytes, **limits: Any) -> tuple[int, dict[str, str], dict[str, Any], bool]:
    """Send `request` to a server with `limits`; (status, headers, error JSON, whether it then closed)."""
    server = await _server(**limits)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(request)
    status, headers, body = await asyncio.wait_for(_read_response(reader), 5)
    closed = await _closed_by_server(reader, 2)
    writer.close()
    await server.close()
    return status, headers, json.loads(body)["error"], closed


@_sync
@pytest.mark.parametrize("oversized", ["header", "request_line", "unterminated_header", "header_count"])
async def test_oversized_request_heads_get_431_in_openai_shape(oversized: str) -> None:
    request = {
        "header": b"GET /a HTTP/1.1\r\nhost: x\r\nx-big: " + b"v" * 3000 + b"\r\n\r\n",
        "request_line": b"GET /" + b"a" * 3000 + b" HTTP/1.1\r\nhost: x\r\n\r\n",
        # never ends: the bytes the parser holds for a field still count
        "unterminated_header": b"GET /a HTTP/1.1\r\nhost: x\r\nx-big: " + b"v" * 20_000,
        "header_count": b"GET /a HTTP/1.1\r\n" + b"".join(b"x-%d: 1\r\n" % i for i in range(11)) + b"\r\n",
    }[oversized]
    status, headers, error, closed = await _refusal(request, max_header_bytes=2048, max_headers=10)
    assert (status, headers["connection"], error["code"], closed) == (431, "close", "request_header_fields_too_large",
                                                                      True)
    assert "2048-byte" in error["message"] or "10 header fields" in error["message"]


@_sync
async def test_heads_within_the_limits_are_served() -> None:
    server = await _server(max_header_bytes=2048, max_headers=10)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    # 9 fields and ~2000 bytes in all, split over several writes: just under both limits
    head = b"GET /a HTTP/1.1\r\nhost: x\r\n" + b"".join(b"x-%d: %s\r\n" % (i, b"v" * 200) for i in range(8)) + b"\r\n"
    for start in range(0, len(head), 500):
        writer.write(head[start:start + 500])
        await writer.drain()
        await asyncio.sleep(0.01)
    status, _, body = await asyncio.wait_for(_read_response(reader), 5)
    assert status == 200 and json.loads(body)["path"] == "/a"
    writer.close()
    await server.close()


@_sync
@pytest.mark.parametrize("stalls_in", ["head", "body"])
async def test_a_request_that_stalls_gets_408_and_is_closed(stalls_in: str) -> None:
    partial = (b"GET /a HTTP/1.1\r\nhost: x\r\nx-slow: "
               if stalls_in == "head" else b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\nabc")
    status, headers, error, closed = await _refusal(partial, header_timeout_s=0.3)
    assert (status, headers["connection"], error["code"], closed) == (408, "close", "request_timeout", True)


@_sync
async def test_a_slow_head_is_timed_from_its_first_byte_not_per_byte() -> None:
    server = await _server(header_timeout_s=0.5)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    start = time.monotonic()
    # read while dripping: the answer is taken as it arrives, before a byte written after the server closed
    # breaks the pipe (which would fail the reader too)
    response = asyncio.ensure_future(_read_response(reader))
    for byte in b"GET /a HTTP/1.1\r\nhost: x\r\nx-drip: " + b"v" * 100:  # a byte every 20 ms: slowloris
        if response.done():  # the server has answered
            break
        writer.write(bytes([byte]))
        try:
            await writer.drain()
        except (ConnectionResetError, BrokenPipeError):
            break
        await asyncio.sleep(0.02)
    status, _, _ = await asyncio.wait_for(response, 5)
    assert status == 408 and time.monotonic() - start < 1.5
    writer.close()
    await server.close()


@_sync
async def test_idle_connections_are_closed_but_a_long_answer_is_not_cut() -> None:
    server = await _server(keep_alive_timeout_s=0.3, header_timeout_s=0.3)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    assert await _closed_by_server(reader, 2)  # a connection that never sends a request
    writer.close()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")  # answered after 0.8 s: longer than both timeouts
    status, _, body = await asyncio.wait_for(_read_response(reader), 5)
    assert status == 200 and json.loads(body)["path"] == "/slow"
    start = time.monotonic()
    assert await _closed_by_server(reader, 2)  # then idle on keep-alive
    assert 0.2 < time.monotonic() - start < 1.0
    writer.close()
    await server.close()


@_sync
async def test_head_gets_the_headers_get_would_and_no_body() -> None:
    server = await _server()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n")
    _, get_headers, get_body = await _read_response(reader)
    # HEAD, then a GET pipelined behind it: a body after the HEAD's head would corrupt the second answer
    writer.write(b"HEAD /a HTTP/1.1\r\nhost: x\r\n\r\nHEAD /stream HTTP/1.1\r\nhost: x\r\n\r\nGET /b HTTP/1.1\r\n"
                 b"host: x\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200") and f"content-length: {len(get_body)}".encode() in head
    assert json.loads(get_body)["method"] == "GET"  # the handler answers HEAD as a GET
    stream_head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert stream_head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in stream_head
    status, _, body = await asyncio.wait_for(_read_response(reader), 5)
    assert status == 200 and json.loads(body)["path"] == "/b"
    assert get_headers["content-length"] == str(len(get_body))
    writer.close()
    await server.close()


@_sync
async def test_close_drains_refusing_new_requests_and_finishing_those_in_flight() -> None:
    server = await _server()
    port = server.port
    busy_reader, busy_writer = await asyncio.open_connection("127.0.0.1", port)
    busy_writer.write(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
    late_reader, late_writer = await asyncio.open_connection("127.0.0.1", port)
    late_writer.write(b"GET /late HTTP/1.1\r\n")  # a request begun, not finished, when the drain starts
    idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
    await asyncio.sleep(0.1)
    closing = asyncio.create_task(server.close(grace_s=5))
    await asyncio.sleep(0.1)
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)  # no longer accepting
    assert await _closed_by_server(idle_reader, 1)
    late_writer.write(b"host: x\r\n\r\n")
    status, headers, body = await asyncio.wait_for(_read_response(late_reader), 2)
    assert (status, headers["connection"], headers["retry-after"]) == (503, "close", "1")
    assert json.loads(body)["error"]["code"] == "service_unavailable"
    status, headers, body = await asyncio.wait_for(_read_response(busy_reader), 2)  # finishes in its grace
    assert (status, headers["connection"], json.loads(body)["path"]) == (200, "close", "/slow")
    await asyncio.wait_for(closing, 2)
    for writer in (busy_writer, late_writer, idle_writer):
        writer.close()


@_sync
async def test_close_cuts_what_outlives_the_grace_period() -> None:
    server = await _server()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /hang HTTP/1.1\r\nhost: x\r\n\r\n")
    await asyncio.sleep(0.1)
    [task] = [c.active for c in server.connections if c.active is not None]
    start = time.monotonic()
    await server.close(grace_s=0.3)
    assert 0.25 < time.monotonic() - start < 2 and task.cancelled()
    assert await _closed_by_server(reader, 1)
    writer.close()
