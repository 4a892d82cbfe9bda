"""Framing, the wire format under every dynserve TCP stream (the worker channel, the embedded event plane):
each message is a 4-byte big-endian length, then that many bytes of MessagePack. A frame is at most
`MAX_FRAME_BYTES`; a longer one, or a stream that ends inside a frame, is a `ChannelError`.
"""

from __future__ import annotations

import asyncio
import struct

import msgspec

from dynserve.errors import ChannelError

__all__ = ["MAX_FRAME_BYTES", "encode_frame", "read_frame"]

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
