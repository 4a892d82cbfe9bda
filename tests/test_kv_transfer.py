"""KV-page transfer: coalescing as a pure function, then both backends (NIXL and TCP) between two real
processes: this test process reads from a peer process that owns a random block-major cache. Reads of
random block lists (runs and scattered blocks) land byte for byte, the peer receives our notifications, a
stopped peer makes a read time out within its deadline (and the next read works), a dead or unknown peer
raises the failure error, and a failed setup call leaves nothing behind.

UCX runs on loopback with cma: the settings below put UCX_TLS=cma,tcp,self and UCX_NET_DEVICES=lo into
each process's environment before its agent starts.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import random
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import msgspec
import pytest
from conftest import lazy_import
from hypothesis import given
from hypothesis import settings as hypothesis_settings

from dynserve.config import Settings
from dynserve.errors import KVTransferError, KVTransferTimeoutError
from dynserve.kv_transfer import KVConnector, coalesce_block_runs, make_connector
from dynserve.kv_transfer.descriptors import (
    BlockRun,
    KVLayout,
    NixlAgentMetadata,
    TcpAgentMetadata,
    decode_metadata,
    encode_metadata,
)
from dynserve.kv_transfer.nixl_backend import apply_ucx_settings

torch = lazy_import("torch")
# (find_spec, not nixl_available(): importing nixl imports torch, and collection imports neither)
BACKENDS = [pytest.param("nixl", marks=pytest.mark.skipif(importlib.util.find_spec("nixl") is None,
                                                         reason="nixl not installed")),
            "tcp"]
SHAPE = (24, 2, 2, 4, 2, 8)  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
DTYPE_NAME = "float16"
BLOCK_BYTES = 512


def transfer_settings(backend: str) -> Settings:
    return Settings(transfer_backend=backend, transfer_timeout_s=5.0, transfer_ucx_tls="cma,tcp,self",
                    transfer_ucx_net_devices="lo")


def test_the_test_cache_has_the_block_size_the_tests_assume() -> None:
    assert random_cache(0)[0].numel() * random_cache(0).element_size() == BLOCK_BYTES


def random_cache(seed: int) -> torch.Tensor:
    """A cache whose every byte is random (fp16 NaN patterns included: compared as bytes)."""
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (*SHAPE[:-1], SHAPE[-1] * 2), dtype=torch.uint8, generator=generator)
    return raw.view(getattr(torch, DTYPE_NAME))


def as_bytes(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.uint8)


# ---- the peer process --------------------------------------------------------------------------------------

def _serve_peer(pipe: Connection, backend: str, name: str, seed: int) -> None:
    """Own a random cache, publish its metadata, then answer commands until told to close."""
    connector = make_connector(transfer_settings(backend), name)
    kv_cache = random_cache(seed)
    connector.register_kv_cache(kv_cache)
    pipe.send(connector.metadata())
    while True:
        command, argument = pipe.recv()
        if command == "notifications":
            pipe.send([(n.peer, n.message) for n in connector.get_notifications()])
        elif command == "close":
            connector.close()
            pipe.send("closed")
            return


@dataclass
class Peer:
    process: Any
    pipe: Connection
    name: str
    seed: int
    metadata: bytes

    def notifications(self, expected: int, timeout_s: float = 5.0) -> list[tuple[str, bytes]]:
        received: list[tuple[str, bytes]] = []
        deadline = time.monotonic() + timeout_s
        while len(received) < expected and time.monotonic() < deadline:
            self.pipe.send(("notifications", None))
            received += self.pipe.recv()
            time.sleep(0.02)
        return received

    def stop(self) -> None:
        if self.process.is_alive():
            self.pipe.send(("close", None))
            self.pipe.recv()
            self.process.join(10)


def start_peers(backend: str, names: list[str]) -> list[Peer]:
    """Start one peer process per name and wait for their metadata. They fork from a clean server process
    that imported torch once (no UCX state of ours inherited, no torch import per peer)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "dynserve.kv_transfer.connector"])
    started = []
    for index, name in enumerate(names):
        ours, theirs = context.Pipe()
        process = context.Process(target=_serve_peer, args=(theirs, backend, name, 1000 + index), daemon=True)
        process.start()
        started.append((process, ours, name, 1000 + index))
    peers = []
    for process, pipe, name, seed in started:
        if not pipe.poll(60):
            raise RuntimeError(f"peer {name} did not start")
        peers.append(Peer(process, pipe, name, seed, pipe.recv()))
    return peers


@dataclass
class Setup:
    backend: str
    reader: KVConnector  # ours, registered over `cache`
    cache: torch.Tensor
    live: Peer
    doomed: Peer  # the dead-peer test kills it


@pytest.fixture(scope="module", params=BACKENDS)
def setup(request: pytest.FixtureRequest) -> Iterator[Setup]:
    backend = request.param
    live, doomed = start_peers(backend, [f"{backend}-live", f"{backend}-doomed"])
    reader = make_connector(transfer_settings(backend), f"{backend}-reader")
    cache = torch.zeros(SHAPE, dtype=getattr(torch, DTYPE_NAME))
    reader.register_kv_cache(cache)
    for peer in (live, doomed):
        assert reader.add_peer(peer.metadata) == peer.name
    yield Setup(backend, reader, cache, live, doomed)
    reader.close()
    for peer in (live, doomed):
        peer.stop()
        if peer.process.is_alive():
            peer.process.kill()


# ---- coalescing (pure) -------------------------------------------------------------------------------------

def test_adjacent_blocks_on_both_sides_become_one_descriptor() -> None:
    assert coalesce_block_runs([4, 5, 6, 9, 10], [0, 1, 2, 7, 8]) == [BlockRun(4, 0, 3), BlockRun(9, 7, 2)]


def test_a_run_breaks_where_either_side_is_not_adjacent() -> None:
    # remote adjacent but local not, then local adjacent but remote not
    assert coalesce_block_runs([1, 2, 3, 7], [0, 5, 6, 7]) == [
        BlockRun(1, 0, 1), BlockRun(2, 5, 2), BlockRun(7, 7, 1)]


def test_unordered_pairs_coalesce_by_local_block_and_bad_lists_are_refused() -> None:
    assert coalesce_block_runs([12, 10, 11], [2, 0, 1]) == [BlockRun(10, 0, 3)]
    assert coalesce_block_runs([], []) == []
    with pytest.raises(ValueError, match="appears twice"):
        coalesce_block_runs([1, 2], [3, 3])
    with pytest.raises(ValueError, match="2 remote blocks but 1 local"):
        coalesce_block_runs([1, 2], [3])


@hypothesis_settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), unique_by=lambda p: p[1], max_size=30))
def test_runs_cover_every_pair_once_and_no_two_runs_could_merge(pairs: list[tuple[int, int]]) -> None:
    runs = coalesce_block_runs([r for r, _ in pairs], [local for _, local in pairs])
    covered = [(run.remote_start + i, run.local_start + i) for run in runs for i in range(run.num_blocks)]
    assert sorted(covered) == sorted(pairs)
    for before, after in zip(runs, runs[1:]):
        assert not (after.remote_start == before.remote_start + before.num_blocks
                    and after.local_start == before.local_start + before.num_blocks)


# ---- settings (pure) ---------------------------------------------------------------------------------------

def test_ucx_settings_go_to_the_environment_only_where_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    environ = {"UCX_TLS": "rc,self"}
    applied = apply_ucx_settings(transfer_settings("nixl"), environ)
    assert applied == {"UCX_NET_DEVICES": "lo"}
    assert environ == {"UCX_TLS": "rc,self", "UCX_NET_DEVICES": "lo"}
    monkeypatch.setenv("DYN_TRANSFER_BACKEND", "tcp")
    monkeypatch.setenv("DYN_TRANSFER_TIMEOUT_S", "2.5")
    assert (Settings().transfer_backend, Settings().transfer_timeout_s) == ("tcp", 2.5)
    assert "transfer_backend" in Settings.field_names("transfer")


# ---- two processes -----------------------------------------------------------------------------------------

def test_random_block_lists_land_byte_for_byte(setup: Setup) -> None:
    reader, live = setup.reader, setup.live
    source = random_cache(live.seed)
    rng = random.Random(7)
    num_blocks = SHAPE[0]
    cases = [([3, 4, 5, 6], [10, 11, 12, 13]),  # one run on both sides
             ([0, 23], [23, 0])]  # the ends of the cache, crossed
    for _ in range(6):
        count = rng.randint(1, num_blocks)
        cases.append((rng.choices(range(num_blocks), k=count), rng.sample(range(num_blocks), count)))
    assert reader.read_blocks(live.name, *cases[0]).num_descriptors == 1
    for remote_ids, local_ids in cases:
        result = reader.read_blocks(live.name, remote_ids, local_ids, timeout_s=5.0)
        assert torch.equal(as_bytes(setup.cache[local_ids]), as_bytes(source[remote_ids])), remote_ids
        assert result.num_blocks == len(local_ids)
        assert result.num_descriptors == len(coalesce_block_runs(remote_ids, local_ids))


def test_the_peer_receives_the_release_notification(setup: Setup) -> None:
    reader, live = setup.reader, setup.live
    reader.notify(live.name, b"release 3 4 5")
    reader.notify(live.name, b"release 9")
    assert live.notifications(expected=2) == [(reader.agent_name, b"release 3 4 5"),
                                              (reader.agent_name, b"release 9")]


def _stop(pid: int, timeout_s: float = 5.0) -> None:
    """SIGSTOP `pid` and wait until every one of its threads is stopped: the signal returns before the
    threads running on another core have stopped, and a page server thread could still answer a read."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:  # the state follows the command name, which is in parentheses and may hold spaces
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
            except (FileNotFoundError, ProcessLookupError):
                continue  # a thread that just ended
        if states and all(state in ("T", "t") for state in states):
            return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} did not stop within {timeout_s} s")


def test_a_stopped_peer_times_out_within_the_deadline_and_reads_work_again(setup: Setup) -> None:
    backend, reader, live = setup.backend, setup.reader, setup.live
    _stop(live.process.pid)
    try:
        # A NIXL read is one-sided, but one posted after a notification waits until the peer has taken
        # that notification (UCX orders them on the connection): the stopped peer never does.
        reader.notify(live.name, b"release 0..7")
        start = time.monotonic()
        with pytest.raises(KVTransferTimeoutError) as caught:
            reader.read_blocks(live.name, list(range(8)), list(range(8)), timeout_s=0.5)
        elapsed_s = time.monotonic() - start
    finally:
        os.kill(live.process.pid, signal.SIGCONT)
    error = caught.value
    assert 0.5 <= elapsed_s < 1.5, elapsed_s
    assert (error.backend, error.peer, error.num_blocks, error.timeout_s, error.cancelled) == (
        backend, live.name, 8, 0.5, True)
    reader.read_blocks(live.name, [20, 21], [0, 1], timeout_s=5.0)
    assert torch.equal(as_bytes(setup.cache[[0, 1]]), as_bytes(random_cache(live.seed)[[20, 21]]))


def test_a_dead_peer_raises_the_failure_error_well_before_the_timeout(setup: Setup) -> None:
    backend, reader, doomed = setup.backend, setup.reader, setup.doomed
    reader.read_blocks(doomed.name, [0], [0])  # it was alive
    doomed.process.kill()
    doomed.process.join(10)
    start = time.monotonic()
    with pytest.raises(KVTransferError) as caught:
        reader.read_blocks(doomed.name, [1, 2], [1, 2], timeout_s=5.0)
    assert time.monotonic() - start < 2.0
    assert not isinstance(caught.value, KVTransferTimeoutError)
    assert (caught.value.backend, caught.value.peer, caught.value.num_blocks) == (backend, doomed.name, 2)


def test_the_tcp_page_server_sends_nothing_without_the_agents_token(setup: Setup) -> None:
    if setup.backend != "tcp":
        pytest.skip("UCX has no token of its own; the TCP backend's server checks one")
    from dynserve.kv_transfer.tcp_backend import _Hello, _ReadRequest, _send_frame

    live = setup.live
    meta = decode_metadata(live.metadata)
    assert isinstance(meta, TcpAgentMetadata) and len(meta.token) == 32
    whole_cache = [(0, BLOCK_BYTES * SHAPE[0])]
    # no token, a wrong one, a prefix of the right one
    for hello in ([], [_Hello("0" * 32)], [_Hello(meta.token[:-1])]):
        with socket.create_connection((meta.host, meta.port), timeout=10) as sock:
            for frame in (*hello, _ReadRequest(whole_cache)):
                _send_frame(sock, frame)
            try:  # closed without a byte of the cache (reset: our request was still unread)
                assert sock.recv(1) == b"", hello
            except ConnectionResetError:
                pass
    with socket.create_connection((meta.host, meta.port), timeout=10) as sock:  # announces a 16 MiB "token"
        sock.sendall((2**24).to_bytes(4, "big"))
        start = time.monotonic()
        assert sock.recv(1) == b""
        assert time.monotonic() - start < 2.0  # dropped at once, not after waiting for the bytes
    intruder = make_connector(transfer_settings("tcp"), "tcp-intruder")
    try:
        intruder.register_kv_cache(torch.zeros(SHAPE, dtype=getattr(torch, DTYPE_NAME)))
        intruder.add_peer(encode_metadata(msgspec.structs.replace(meta, token="f" * 32)))
        start = time.monotonic()
        with pytest.raises(KVTransferError) as caught:
            intruder.read_blocks(live.name, [0], [0], timeout_s=5.0)
        assert time.monotonic() - start < 2.0 and not isinstance(caught.value, KVTransferTimeoutError)
    finally:
        intruder.close()
    setup.reader.read_blocks(live.name, [5], [5], timeout_s=5.0)  # a reader with the token still reads
    assert torch.equal(as_bytes(setup.cache[[5]]), as_bytes(random_cache(live.seed)[[5]]))


def test_an_unknown_peer_and_bad_arguments_are_refused(setup: Setup) -> None:
    backend, reader, live = setup.backend, setup.reader, setup.live
    with pytest.raises(KVTransferError, match="unknown peer") as caught:
        reader.read_blocks("nobody", [0], [0])
    assert (caught.value.backend, caught.value.peer) == (backend, "nobody")
    with pytest.raises(KVTransferError, match="unknown peer"):
        reader.notify("nobody", b"x")
    with pytest.raises(ValueError, match="remote block id 24"):
        reader.read_blocks(live.name, [24], [0])
    with pytest.raises(ValueError, match="appears twice"):
        reader.read_blocks(live.name, [1, 2], [0, 0])


def test_failed_setup_leaves_nothing_behind(setup: Setup) -> None:
    backend, reader, live = setup.backend, setup.reader, setup.live
    peers_before = reader.peers
    with pytest.raises(KVTransferError, match="malformed"):
        reader.add_peer(b"not metadata")
    other_backend = "tcp" if backend == "nixl" else "nixl"
    with pytest.raises(KVTransferError, match="another transfer backend"):
        reader.add_peer(_metadata_of_backend(other_backend))
    with pytest.raises(KVTransferError, match="1024-byte blocks"):
        reader.add_peer(_tcp_metadata(1024) if backend == "tcp" else _nixl_garbage(1024))
    # the same block size in another dtype (bfloat16 pages read as float16 would be garbage)
    other_dtype = "float16" if DTYPE_NAME != "float16" else "bfloat16"
    with pytest.raises(KVTransferError, match=f"holds {other_dtype} KV"):
        reader.add_peer(_tcp_metadata(BLOCK_BYTES, other_dtype) if backend == "tcp"
                        else _nixl_garbage(BLOCK_BYTES, other_dtype))
    if backend == "nixl":
        with pytest.raises(KVTransferError, match="loading peer"):
            reader.add_peer(_nixl_garbage(BLOCK_BYTES))
    assert reader.peers == peers_before
    with pytest.raises(ValueError, match="already registered"):
        reader.register_kv_cache(torch.zeros(SHAPE, dtype=getattr(torch, DTYPE_NAME)))
    fresh = make_connector(transfer_settings(backend), f"{backend}-fresh")
    with pytest.raises(ValueError, match="contiguous"):
        fresh.register_kv_cache(torch.zeros(SHAPE, dtype=getattr(torch, DTYPE_NAME)).transpose(0, 1))
    assert fresh.layout is None
    fresh.close()
    fresh.close()  # idempotent
    with pytest.raises(KVTransferError, match="closed"):
        fresh.read_blocks(live.name, [0], [0])


# ---- helpers -----------------------------------------------------------------------------------------------

def _tcp_metadata(block_size_bytes: int, dtype: str = "") -> bytes:
    layout = KVLayout(num_blocks=4, block_size_bytes=block_size_bytes, device="cpu", dtype=dtype)
    return encode_metadata(TcpAgentMetadata(agent_name="odd", layout=layout, host="127.0.0.1", port=9,
                                            token="0" * 32))


def _nixl_garbage(block_size_bytes: int, dtype: str = "") -> bytes:
    layout = KVLayout(num_blocks=4, block_size_bytes=block_size_bytes, device="cpu", dtype=dtype)
    return encode_metadata(NixlAgentMetadata(agent_name="odd", layout=layout, base_address=4096, device_id=0,
                                             nixl_metadata=b"garbage"))


def _metadata_of_backend(backend: str) -> bytes:
    return _tcp_metadata(BLOCK_BYTES) if backend == "tcp" else _nixl_garbage(BLOCK_BYTES)
