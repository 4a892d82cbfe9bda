"""The worker channel: its frames, both of its ends, and a worker actor streaming over it."""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

import msgspec
import pytest
import uvloop

from dynserve.errors import ChannelError, InvalidRequestError, WorkerUnavailableError
from dynserve.framing import MAX_FRAME_BYTES, accept_hello, read_frame
from dynserve.protocol import GenerateRequest, SamplingParams, TokenDelta, TokenLogprob, WorkerInfo
from dynserve.workers.channel import FrameWriter, WorkerConnection, merge_deltas

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def test_merge_deltas_joins_in_order_and_keeps_the_last_state() -> None:
    lp = [TokenLogprob(i, -0.1 * i, []) for i in range(3)]
    deltas = [TokenDelta(request_id="r", token_ids=[1], text="a", logprobs=[lp[0]], num_output_tokens=1),
              TokenDelta(request_id="r", token_ids=[2], text="", logprobs=[lp[1]], num_output_tokens=2),
              TokenDelta(request_id="r", token_ids=[3], text="bc", logprobs=[lp[2]], num_output_tokens=3,
                         finished=True, finish_reason="stop")]
    merged = merge_deltas(deltas)
    assert (merged.token_ids, merged.text, merged.logprobs) == ([1, 2, 3], "abc", lp)
    assert (merged.finished, merged.finish_reason, merged.num_output_tokens) == (True, "stop", 3)


def test_oversized_or_truncated_frames_are_channel_errors() -> None:
    async def read(data: bytes) -> bytes | None:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await read_frame(reader)

    assert asyncio.run(read(b"")) is None  # a clean end of stream
    with pytest.raises(ChannelError):
        asyncio.run(read(struct.pack("!I", MAX_FRAME_BYTES + 1)))
    with pytest.raises(ChannelError):
        asyncio.run(read(struct.pack("!I", 10) + b"abc"))


async def _connect_to_stand_in(handler: Any) -> tuple[asyncio.Server, WorkerConnection]:
    """A server running `handler` for each connection (a stand-in peer, not a worker) once the client's hello
    has come, as a worker does, and a channel to it."""

    async def admit(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert await accept_hello(reader, None)
        await handler(reader, writer)

    server = await asyncio.start_server(admit, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    info = WorkerInfo(worker_id="peer", role="both", host="127.0.0.1", port=port, model_id="m",
                      max_model_len=64, block_size=16, num_blocks=4)
    connection = WorkerConnection(info)
    await connection.connect()
    return server, connection


def test_a_peer_that_drops_the_connection_ends_streams_retryably() -> None:
    """A stand-in peer (not a worker) that reads one frame and hangs up, as a crashing worker would."""

    async def scenario() -> None:
        async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_frame(reader)
            writer.close()

        server, connection = await _connect_to_stand_in(hang_up)
        with pytest.raises(WorkerUnavailableError):
            async for _ in connection.generate(GenerateRequest(request_id="r", token_ids=[1, 2], params=GREEDY)):
                pass
        assert not connection.is_open
        with pytest.raises(WorkerUnavailableError):
            await connection.load()
        server.close()

    asyncio.run(scenario())


def _no_delay_flag(writer: asyncio.StreamWriter) -> int:
    return writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_both_ends_of_a_channel_send_without_nagle(loop: str) -> None:
    """Neither the channel, the event plane nor the HTTP server sets TCP_NODELAY: the loops do it on every
    TCP stream, which this checks on both ends, so a frame never waits for the peer's ACK."""

    async def scenario() -> list[int]:
        accepted: list[int] = []
        ended = asyncio.Event()

        async def note(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.append(_no_delay_flag(writer))
            await read_frame(reader)
            writer.close()
            ended.set()

        server, connection = await _connect_to_stand_in(note)
        assert connection._writer is not None
        flags = [_no_delay_flag(connection._writer)]
        await connection.close()
        await asyncio.wait_for(ended.wait(), 5)
        server.close()
        return flags + accepted

    flags = uvloop.run(scenario()) if loop == "uvloop" else asyncio.run(scenario())
    assert len(flags) == 2 and all(flags)


def test_frames_sent_in_one_pass_of_the_loop_go_out_in_one_write_in_order() -> None:
    """A stand-in peer (not a worker) that records the frames it reads: a burst of requests and an abort
    sent together cost the gateway one socket write, and arrive whole and in order."""

    async def scenario() -> None:
        frames: list[bytes] = []
        got_all, ended = asyncio.Event(), asyncio.Event()

        async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while (body := await read_frame(reader)) is not None:
                frames.append(body)
                if len(frames) == 4:
                    got_all.set()
            writer.close()
            ended.set()

        server, connection = await _connect_to_stand_in(record)
        writes: list[bytes] = []
        assert connection._writer is not None
        write = connection._writer.write

        def counted(data: bytes) -> None:
            writes.append(data)
            write(data)

        connection._writer.write = counted  # type: ignore[method-assign]
        streams = [connection.generate(GenerateRequest(request_id=f"r{i}", token_ids=[i], params=GREEDY))
                   for i in range(3)]
        tasks = [asyncio.ensure_future(anext(stream)) for stream in streams]
        await asyncio.sleep(0)  # each stream sends its request and waits for its first delta
        connection.abort("r1")
        await asyncio.wait_for(got_all.wait(), 5)
        assert len(writes) == 1 and b"".join(writes).count(b"r1") == 2
        assert [f.count(b"r0") + 2 * f.count(b"r1") + 4 * f.count(b"r2") for f in frames] == [1, 2, 4, 2]
        for task in tasks:
            task.cancel()
        await connection.close()
        await asyncio.wait_for(ended.wait(), 5)
        server.close()

    asyncio.run(scenario())


def test_the_frame_writer_keeps_order_across_threads_and_a_backlog_and_closing_it_ends_the_stream() -> None:
    """The worker's side (`FrameWriter`): frames written on the loop and on another thread (as the engine
    thread writes a step's tokens), one of them far bigger than the socket's buffers while the peer is not
    reading, so that it and the frames after it wait in the backlog: all arrive whole and in order. The
    connection ends once the stream and the writer are both closed."""

    def frame(body: bytes) -> bytes:
        return struct.pack("!I", len(body)) + body

    async def scenario() -> None:
        accepted: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Future()

        async def keep(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.set_result((reader, writer))

        server = await asyncio.start_server(keep, "127.0.0.1", 0)
        peer, peer_writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        _, writer = await asyncio.wait_for(accepted, 5)
        frames = FrameWriter(writer.get_extra_info("socket"), asyncio.get_running_loop())
        big = bytes(range(256)) * (32 * 2**10)  # 8 MiB
        frames.write(frame(b"first"))
        frames.write(frame(big))
        assert frames._backlog  # the peer reads nothing yet: most of `big` waits

        def from_another_thread() -> None:
            for i in range(100):
                frames.write(frame(b"t%d" % i))

        await asyncio.to_thread(from_another_thread)
        frames.write(frame(b"last"))
        got = [await asyncio.wait_for(read_frame(peer), 10) for _ in range(103)]
        assert got == [b"first", big, *(b"t%d" % i for i in range(100)), b"last"]
        writer.close()
        await frames.close()
        assert await asyncio.wait_for(read_frame(peer), 5) is None
        peer_writer.close()
        server.close()

    asyncio.run(scenario())


def test_a_worker_at_a_gone_workers_address_serves_none_of_its_requests(
        caplog: pytest.LogCaptureFixture) -> None:
    """A channel meant for worker `gone` that reaches another worker at the same address (it took the port
    since): the worker refuses it, so the request fails over as from a worker that is down (a retry), not
    runs on another engine; a channel meant for the worker there is served. The gateway would try again each
    poll: the worker warns once."""
    import logging

    from dynserve.config import Settings
    from dynserve.workers.worker import EngineWorker

    worker = EngineWorker(Settings(mocker="cpu", kv_blocks=64, worker_metrics=False), "here")
    request = GenerateRequest(request_id="r", token_ids=[1, 2, 3], params=GREEDY)

    async def scenario() -> list[TokenDelta]:
        info = await worker.start()
        try:
            for _ in range(3):  # as a gateway's poller reconnects
                stale = WorkerConnection(msgspec.structs.replace(info, worker_id="gone"))
                await stale.connect()  # the address answers: the refusal comes as the connection's end
                with pytest.raises(WorkerUnavailableError):
                    async for _ in stale.generate(request):
                        pass
                assert not stale.is_open
            connection = WorkerConnection(info)
            await connection.connect()
            try:
                return [d async for d in connection.generate(request)]
            finally:
                await connection.close()
        finally:
            await worker.stop()

    with caplog.at_level(logging.DEBUG, logger="dynserve.workers.worker"):
        deltas = asyncio.run(scenario())
    assert deltas[-1].finished and sum(len(d.token_ids) for d in deltas) == 8
    refusals = [r.levelno for r in caplog.records if "meant for worker gone" in r.getMessage()]
    assert refusals == [logging.WARNING, logging.DEBUG, logging.DEBUG]


def test_unreachable_worker_is_unavailable() -> None:
    info = WorkerInfo(worker_id="none", role="both", host="127.0.0.1", port=1, model_id="m", max_model_len=64,
                      block_size=16, num_blocks=4)
    with pytest.raises(WorkerUnavailableError):
        asyncio.run(WorkerConnection(info).connect(timeout_s=1))


def _channel_run(info: WorkerInfo, requests: list[GenerateRequest]) -> list[list[TokenDelta]]:
    async def scenario() -> list[list[TokenDelta]]:
        connection = WorkerConnection(info)
        await connection.connect()

        async def collect(request: GenerateRequest) -> list[TokenDelta]:
            return [d async for d in connection.generate(request)]

        try:
            return list(await asyncio.gather(*(collect(r) for r in requests)))
        finally:
            await connection.close()

    return asyncio.run(scenario())


def test_channel_streams_what_the_engine_generates_offline(worker: Any, tokenizer: Any,
                                                           make_engine: Any) -> None:
    _, info = worker
    prompt = tokenizer.encode("The quick brown fox")
    (via_channel,) = _channel_run(info, [GenerateRequest(request_id="chan-1", token_ids=prompt, params=GREEDY)])
    assert via_channel[-1].finished and via_channel[-1].num_output_tokens == 8
    offline = make_engine().generate([prompt], GREEDY)[0]
    assert [t for d in via_channel for t in d.token_ids] == offline.token_ids
    assert "".join(d.text for d in via_channel) == offline.text


def test_many_requests_share_one_connection(worker: Any, tokenizer: Any) -> None:
    _, info = worker
    requests = [GenerateRequest(request_id=f"multi-{i}", token_ids=tokenizer.encode(f"Count to {i}:"),
                                params=GREEDY) for i in range(6)]
    results = _channel_run(info, requests)
    for request, deltas in zip(requests, results, strict=True):
        assert all(d.request_id == request.request_id for d in deltas)
        assert sum(len(d.token_ids) for d in deltas) == 8 and deltas[-1].finished


def test_the_worker_refuses_invalid_requests_by_name(worker: Any) -> None:
    _, info = worker
    with pytest.raises(InvalidRequestError) as error:
        _channel_run(info, [GenerateRequest(request_id="bad-1", token_ids=[10**7], params=GREEDY)])
    assert error.value.param == "prompt"
