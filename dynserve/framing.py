"""Framing, the wire format under every dynserve TCP stream (the worker channel, the embedded event plane):
each message is a 4-byte big-endian length, then that many bytes of MessagePack. A frame is at most
`MAX_FRAME_BYTES`; a longer one, or a stream that ends inside a frame, is a `ChannelError`.

Liveness: `keep_alive` sets TCP keepalive (and a user timeout for unacknowledged data) on such a stream, so a
peer whose machine vanished without closing its connections (power, network) is noticed within
`DEAD_PEER_S` as a connection error, not waited on forever.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

import msgspec

from dynserve.errors import ChannelError

__all__ = ["DEAD_PEER_S", "MAX_FRAME_BYTES", "encode_frame", "keep_alive", "read_frame"]

MAX_FRAME_BYTES = 64 * 2**20
_HEADER = struct.Struct("!I")
_ENCODER = msgspec.msgpack.Encoder()


def encode_frame(message: msgspec.Struct) -> bytes:
    body = _ENCODER.encode(message)
    return _HEADER.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """The next frame's body; None on a clean end of stream. Raises ChannelError on a bad frame."""
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise ChannelError("connection closed inside a frame header") from exc
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise ChannelError(f"frame of {size} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    try:
        return await reader.readexactly(size)
    except asyncio.IncompleteReadError as exc:
        raise ChannelError("connection closed inside a frame") from exc


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
