"""The TCP backend, for machines without NIXL: each agent serves its registered cache's bytes on a socket,
and a reader asks for regions and receives them straight into its own cache.

It owns a listening socket with one server thread per accepted connection, a client connection per peer,
and an inbox of received notifications. Frames are a 4-byte big-endian length and a msgpack body. A
connection opens with a `_Hello` carrying the token the server's agent published in its metadata and the
cluster's token (`Settings.cluster_token`; a server that has one requires both); a read is one
`_ReadRequest` (the coalesced runs as byte regions), answered by a `_ReadReply` header and then the regions'
raw bytes in order, sent from and received into the tensors' memory without extra Python copies (a CUDA
cache is staged through host memory).

Why both: the agent's token reaches readers through the registry, which the embedded event plane opens only
to holders of the cluster token, but a Redis registry is guarded by Redis's own credentials, and a
`WorkerInfo` travels further (Ray calls, a pool's records). Requiring the cluster token as well keeps the
page server closed to anyone outside the fleet, whichever registry it uses.

Invariants: a server sends nothing on a connection that has not presented its tokens (within
`_HELLO_TIMEOUT_S`), and only bytes inside its registered cache (requests outside it get an error reply);
a client connection that saw any error or timeout is closed and dropped, so a later read never consumes a
stale reply; nothing writes to the local cache after `_read` returns.
"""

from __future__ import annotations

import collections
import hmac
import logging
import secrets
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING

import msgspec
import torch

from dynserve.config import Settings
from dynserve.errors import KVTransferError
from dynserve.kv_transfer.connector import KVConnector, ReadPlan
from dynserve.kv_transfer.descriptors import KVLayout, Notification, TcpAgentMetadata

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

__all__ = ["TcpConnector"]

logger = logging.getLogger(__name__)

_HEADER = struct.Struct(">I")
_MAX_FRAME_BYTES = 16 * 2**20  # a control frame; the bytes of a read follow their header unframed
_HELLO_TIMEOUT_S = 5.0  # a connection that has not presented its token by then is dropped
_MAX_HELLO_BYTES = 256


class _Hello(msgspec.Struct, tag="hello", array_like=True):
    token: str  # the serving agent's, from its metadata
    cluster_token: str | None = None  # Settings.cluster_token

    def __repr__(self) -> str:  # never the tokens, should one be logged
        return "_Hello(<tokens hidden>)"


class _ReadRequest(msgspec.Struct, tag="read", array_like=True):
    regions: list[tuple[int, int]]  # (offset_bytes, size_bytes) in the server's cache


class _NotifyRequest(msgspec.Struct, tag="notify", array_like=True):
    sender: str
    message: bytes


class _ReadReply(msgspec.Struct, array_like=True):
    size_bytes: int
    error: str | None = None


_HELLO = msgspec.msgpack.Decoder(_Hello)
_REQUEST = msgspec.msgpack.Decoder(_ReadRequest | _NotifyRequest)
_REPLY = msgspec.msgpack.Decoder(_ReadReply)
_ENCODER = msgspec.msgpack.Encoder()


def _send_frame(sock: socket.socket, message: msgspec.Struct) -> None:
    body = _ENCODER.encode(message)
    sock.sendall(_HEADER.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from the socket; ConnectionError when the peer closes first."""
    received = 0
    while received < len(view):
        count = sock.recv_into(view[received:])
        if count == 0:
            raise ConnectionError("the peer closed the connection")
        received += count


def _recv_frame(sock: socket.socket, max_bytes: int = _MAX_FRAME_BYTES) -> bytes:
    header = bytearray(_HEADER.size)
    _recv_exact(sock, memoryview(header))
    (size,) = _HEADER.unpack(header)
    if size > max_bytes:
        raise ConnectionError(f"a {size}-byte frame is over the limit")
    body = bytearray(size)
    _recv_exact(sock, memoryview(body))
    return bytes(body)


def _host_view(region: torch.Tensor) -> memoryview:
    """Writable bytes of a contiguous CPU uint8 tensor, sharing its memory."""
    return memoryview(region.numpy()).cast("B")


class _PageServer:
    """Serves one cache's bytes to readers and collects the notifications they send."""

    def __init__(self, kv_bytes: torch.Tensor, bind: tuple[str, int], inbox: collections.deque[Notification],
                 token: str, cluster_token: str | None = None):
        self._kv_bytes = kv_bytes
        self._inbox = inbox
        self._token = token.encode()
        self._cluster_token = None if cluster_token is None else cluster_token.encode()
        self._listener = socket.create_server(bind)
        self.port = self._listener.getsockname()[1]
        self._connections: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._guard = threading.Lock()
        self._stopping = False
        self._start(self._accept_loop, "accept")

    def _start(self, target: Callable[..., None], what: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=f"kv-tcp-{what}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # the listener was closed
            with self._guard:
                if self._stopping:
                    conn.close()
                    return
                self._connections.add(conn)
                self._threads = [t for t in self._threads if t.is_alive()]
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._start(self._serve, "serve", conn)

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(_HELLO_TIMEOUT_S)
            hello = _HELLO.decode(_recv_frame(conn, max_bytes=_MAX_HELLO_BYTES))  # small before it is trusted
            if not self._admits(hello):
                logger.warning("a KV page reader from %s presented a wrong token; dropped", _peer_of(conn))
                return
            conn.settimeout(None)
            while True:
                request = _REQUEST.decode(_recv_frame(conn))
                if isinstance(request, _NotifyRequest):
                    self._inbox.append(Notification(request.sender, request.message))
                else:
                    self._send_regions(conn, request.regions)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            pass  # the reader left, timed out before its token or spoke nonsense: drop the connection
        finally:
            with self._guard:
                self._connections.discard(conn)
            conn.close()

    def _admits(self, hello: _Hello) -> bool:
        """Both tokens right (the cluster's only when this server has one), each compared in constant time."""
        agent_ok = hmac.compare_digest(hello.token.encode(), self._token)
        if self._cluster_token is None:
            return agent_ok
        given = (hello.cluster_token or "").encode()
        return hmac.compare_digest(given, self._cluster_token) and agent_ok

    def _send_regions(self, conn: socket.socket, regions: list[tuple[int, int]]) -> None:
        limit = self._kv_bytes.numel()
        if any(offset < 0 or size < 1 or offset + size > limit for offset, size in regions):
            _send_frame(conn, _ReadReply(0, error="a region lies outside the registered cache"))
            return
        _send_frame(conn, _ReadReply(sum(size for _, size in regions)))
        for offset, size in regions:
            region = self._kv_bytes[offset : offset + size]
            conn.sendall(_host_view(region if region.device.type == "cpu" else region.cpu()))

    def close(self) -> None:
        with self._guard:
            self._stopping = True
            connections = list(self._connections)
        for sock in (self._listener, *connections):  # shutdown wakes a thread blocked in accept or recv
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._listener.close()
        with self._guard:
            threads = [t for t in self._threads if t is not threading.current_thread()]
        for thread in threads:
            thread.join(timeout=5)
            if thread.is_alive():
                logger.warning("a KV page server thread did not stop")


def _peer_of(conn: socket.socket) -> str:
    try:
        host, port = conn.getpeername()[:2]
    except OSError:
        return "a closed connection"
    return f"{host}:{port}"


class TcpConnector(KVConnector):
    backend = "tcp"
    metadata_type = TcpAgentMetadata

    def __init__(self, agent_name: str, settings: Settings) -> None:
        super().__init__(agent_name, settings)
        self._kv_bytes: torch.Tensor | None = None
        self._server: _PageServer | None = None
        self._inbox: collections.deque[Notification] = collections.deque()
        self._peer_metadata: dict[str, TcpAgentMetadata] = {}
        self._connections: dict[str, socket.socket] = {}
        self._token = secrets.token_hex(16)  # readers must present it: it goes out with the metadata only
        self._cluster_token = settings.secret("cluster_token")  # and this one, when the fleet has it
        # a worker passes its resolved addresses; a connector made outside one serves loopback
        self._bind_host, self._advertise_host = settings.serving_addresses(None)

    def _register(self, kv_cache: torch.Tensor, layout: KVLayout) -> None:
        kv_bytes = kv_cache.view(-1).view(torch.uint8)
        try:
            self._server = _PageServer(kv_bytes, (self._bind_host, self.settings.transfer_port), self._inbox,
                                       self._token, self._cluster_token)
        except OSError as exc:
            raise KVTransferError(f"cannot serve KV pages on {self._bind_host}:{self.settings.transfer_port}: "
                                  f"{exc}", backend=self.backend) from exc
        self._kv_bytes = kv_bytes

    def _metadata(self, layout: KVLayout) -> TcpAgentMetadata:
        assert self._server is not None
        return TcpAgentMetadata(agent_name=self.agent_name, layout=layout, host=self._advertise_host,
                                port=self._server.port, token=self._token)

    def _add_peer(self, peer: TcpAgentMetadata) -> None:  # type: ignore[override]
        self._peer_metadata[peer.agent_name] = peer  # connects lazily, on the first read or notification

    def _remove_peer(self, peer: str) -> None:
        self._peer_metadata.pop(peer, None)
        self._disconnect(peer)

    def _disconnect(self, peer: str) -> None:
        conn = self._connections.pop(peer, None)
        if conn is not None:
            conn.close()

    def _connection(self, peer: str, deadline_s: float) -> socket.socket:
        conn = self._connections.get(peer)
        if conn is None:
            meta = self._peer_metadata[peer]
            timeout_s = max(deadline_s - time.monotonic(), 1e-3)
            conn = socket.create_connection((meta.host, meta.port), timeout=timeout_s)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._connections[peer] = conn
            _send_frame(conn, _Hello(meta.token, self._cluster_token))
        conn.settimeout(max(deadline_s - time.monotonic(), 1e-3))
        return conn

    def _read(self, plan: ReadPlan) -> None:
        assert self._layout is not None and self._kv_bytes is not None
        block_bytes = self._layout.block_size_bytes
        regions = [(r.remote_offset_bytes(block_bytes), r.size_bytes(block_bytes)) for r in plan.runs]
        try:
            conn = self._connection(plan.peer, plan.deadline_s)
            _send_frame(conn, _ReadRequest(regions))
            reply = _REPLY.decode(self._recv_frame_by(conn, plan.deadline_s))
            if reply.error is not None:
                raise self._error(f"{plan.peer!r} refused the read: {reply.error}", plan)
            if reply.size_bytes != sum(size for _, size in regions):
                raise self._error(f"{plan.peer!r} announced {reply.size_bytes} bytes", plan)
            for target, staged in self._landing_regions(plan, block_bytes):
                conn.settimeout(max(plan.deadline_s - time.monotonic(), 1e-3))
                _recv_exact(conn, _host_view(staged))
                if staged is not target:
                    target.copy_(staged)
        except TimeoutError:
            self._disconnect(plan.peer)
            raise self._timeout(plan, cancelled=True) from None
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._disconnect(plan.peer)
            raise self._error(f"reading from {plan.peer!r} failed: {exc!r}", plan) from exc
        except KVTransferError:
            self._disconnect(plan.peer)
            raise

    def _recv_frame_by(self, conn: socket.socket, deadline_s: float) -> bytes:
        conn.settimeout(max(deadline_s - time.monotonic(), 1e-3))
        return _recv_frame(conn)

    def _landing_regions(self, plan: ReadPlan,
                         block_bytes: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(local region, where its bytes land) per run: the region itself on CPU, else host memory."""
        assert self._kv_bytes is not None
        for run in plan.runs:
            offset = run.local_offset_bytes(block_bytes)
            target = self._kv_bytes[offset : offset + run.size_bytes(block_bytes)]
            yield target, target if target.device.type == "cpu" else torch.empty_like(target, device="cpu")

    def _notify(self, peer: str, message: bytes) -> None:
        try:
            conn = self._connection(peer, time.monotonic() + self.settings.transfer_timeout_s)
            _send_frame(conn, _NotifyRequest(self.agent_name, message))
        except OSError as exc:
            self._disconnect(peer)
            raise KVTransferError(f"notifying {peer!r} failed: {exc!r}", backend=self.backend,
                                  peer=peer) from exc

    def _take_notifications(self) -> list[Notification]:
        taken = []
        while self._inbox:
            taken.append(self._inbox.popleft())
        return taken

    def _close(self) -> None:
        for peer in list(self._connections):
            self._disconnect(peer)
        if self._server is not None:
            self._server.close()
            self._server = None
        self._kv_bytes = None
