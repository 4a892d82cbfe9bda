"""Framing, the wire format under every dynserve TCP stream (the worker channel, the embedded event plane):
each message is a 4-byte big-endian length, then that many bytes of MessagePack. A frame is at most
`MAX_FRAME_BYTES`; a longer one, or a stream that ends inside a frame, is a `ChannelError`.

Admission: a stream's first frame is the client's `Hello` (`protocol.py`). A server that has the cluster's
token serves a connection only once `accept_hello` found that token in it (compared in constant time), read
within `HELLO_TIMEOUT_S` and at most `MAX_HELLO_BYTES` long, so a stranger can neither make it answer nor
make it hold a large buffer; one extra frame per connection, nothing per message. A worker also refuses a
`Hello` that names another worker (`meant_for`): a gateway still reconnecting to a gone worker's address,
which this one took since.

Liveness: `keep_alive` sets TCP keepalive (and a user timeout for unacknowledged data) on such a stream, so a
peer whose machine vanished without closing its connections (power, network) is noticed within
`DEAD_PEER_S` as a connection error, not waited on forever.
"""

from __future__ import annotations

import asyncio
import hmac
import socket
import struct
from typing import Any

import msgspec

from dynserve.errors import ChannelError
from dynserve.protocol import Hello

__all__ = ["DEAD_PEER_S", "HELLO_TIMEOUT_S", "MAX_FRAME_BYTES", "MAX_HELLO_BYTES", "accept_hello", "encode_frame",
           "keep_alive", "meant_for", "read_frame", "read_hello"]

MAX_FRAME_BYTES = 64 * 2**20
MAX_HELLO_BYTES = 1024  # a first frame, read before the peer is trusted
HELLO_TIMEOUT_S = 5.0  # a connection that has not presented its token by then is closed
_HEADER = struct.Struct("!I")
_ENCODER = msgspec.msgpack.Encoder()


def encode_frame(message: msgspec.Struct) -> bytes:
    body = _ENCODER.encode(message)
    return _HEADER.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader, max_bytes: int = MAX_FRAME_BYTES) -> bytes | None:
    """The next frame's body; None on a clean end of stream. Raises ChannelError on a bad frame or one over
    `max_bytes`."""
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise ChannelError("connection closed inside a frame header") from exc
    (size,) = _HEADER.unpack(header)
    if size > max_bytes:
        raise ChannelError(f"frame of {size} bytes exceeds the {max_bytes}-byte limit")
    try:
        return await reader.readexactly(size)
    except asyncio.IncompleteReadError as exc:
        raise ChannelError("connection closed inside a frame") from exc



_HELLO = msgspec.msgpack.Decoder(Hello)


async def read_hello(reader: asyncio.StreamReader, cluster_token: str | None,
                     timeout_s: float = HELLO_TIMEOUT_S) -> Hello | None:
    """Read a server's first frame from a new connection: the client's `Hello` when it presents
    `cluster_token` (any `Hello` when the server has no token); None for a wrong or missing token, another
    frame, garbage, a frame over `MAX_HELLO_BYTES`, or nothing within `timeout_s`. The caller closes the
    connection on None, having answered nothing."""
    try:
        body = await asyncio.wait_for(read_frame(reader, MAX_HELLO_BYTES), timeout_s)
        if body is None:
            return None
        hello = _HELLO.decode(body)
    except (TimeoutError, ChannelError, OSError, msgspec.DecodeError):
        return None
    if cluster_token is None:
        return hello
    presented = hello.token is not None and hmac.compare_digest(hello.token.encode(), cluster_token.encode())
    return hello if presented else None


async def accept_hello(reader: asyncio.StreamReader, cluster_token: str | None,
                       timeout_s: float = HELLO_TIMEOUT_S) -> bool:
    """`read_hello` as a yes or no: True when the client's `Hello` presents `cluster_token`."""
    return await read_hello(reader, cluster_token, timeout_s) is not None


def meant_for(hello: Hello, worker_id: str) -> bool:
    """Whether a channel that opened with `hello` is meant for worker `worker_id`, or for no worker in
    particular (a client from before `Hello.worker_id`)."""
    return hello.worker_id in (None, worker_id)


_KEEPALIVE_IDLE_S, _KEEPALIVE_INTERVAL_S, _KEEPALIVE_PROBES = 2, 1, 3
DEAD_PEER_S = _KEEPALIVE_IDLE_S + _KEEPALIVE_INTERVAL_S * _KEEPALIVE_PROBES


def keep_alive(sock: Any) -> None:
    """Make a silent peer an error within `DEAD_PEER_S`: keepalive probes after 2 s without traffic, and a
    user timeout for data the peer does not acknowledge. A live peer answers probes in its kernel, at no cost to
    its process. `sock` is a TCP socket (asyncio's transport socket will do); others are left alone."""
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux; elsewhere the system's keepalive timing applies
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, _KEEPALIVE_IDLE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, _KEEPALIVE_INTERVAL_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, _KEEPALIVE_PROBES)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, DEAD_PEER_S * 1000)
