"""vLLM as a worker, without vLLM: its KV-event wire shapes decoded and re-hashed so a router hit is a hit in
its cache, gaps recovered, its completion stream read back as dynserve deltas (from exchanges recorded from a
real vLLM run in `tests/fixtures/vllm/<version>/`, made by `python -m benchmarks.record_vllm`), worker URLs,
and a fleet of vLLM stand-ins (`benchmarks.vllm_standin`, named as such: vLLM's API and event wire format,
arithmetic for a model) behind `dynctl gateway --worker-url`. The real vLLM runs in `make test-peers`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest
from conftest import banner_port, needs, stop_by_sigint, wait_for_line

from dynserve.errors import InvalidRequestError
from dynserve.events.vllm import (
    VllmCleared,
    VllmDecodeError,
    VllmEventRelay,
    VllmRemoved,
    VllmStored,
    VllmTranslator,
    decode_batch,
)
from dynserve.hashing import hash_blocks, model_salt
from dynserve.protocol import AllBlocksCleared, BlockRemoved, BlockStored, WorkerInfo
from dynserve.router.indexer import KVIndex
from dynserve.workers.attached import parse_worker_url
from dynserve.workers.openai_channel import _StreamState, completion_body, parse_load

FIXTURES = Path(__file__).parent / "fixtures" / "vllm"
RECORDED = sorted(FIXTURES.glob("*/server.json"))
MODEL = "SmolLM2-135M-Instruct"


def _recorded() -> Path:
    assert RECORDED, f"no recorded vLLM run under {FIXTURES} (python -m benchmarks.record_vllm)"
    return RECORDED[-1].parent


def _pack(events: list[Any]) -> bytes:
    return msgspec.msgpack.encode([1.5, events, 0])


# ---- the event wire ----------------------------------------------------------------------------------------


def test_both_wire_shapes_decode_to_the_same_events() -> None:
    tagged = {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None, "token_ids": list(range(8)),
              "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": None}
    positional = ["BlockStored", [11, 12], None, list(range(8)), 4, None, "GPU", None, None]
    removed = [{"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU"}, ["BlockRemoved", [12], "GPU"]]
    cleared = [{"type": "AllBlocksCleared"}, ["AllBlocksCleared"]]
    a = decode_batch(_pack([tagged, removed[0], cleared[0]]))
    b = decode_batch(_pack([positional, removed[1], cleared[1]]))
    assert a.events == b.events and a.ts == 1.5 and a.data_parallel_rank == 0
    assert a.events[0] == VllmStored([11, 12], None, list(range(8)), 4, None, "GPU", None)
    assert isinstance(a.events[2], VllmCleared)


@pytest.mark.parametrize("payload", [b"\xc1", msgspec.msgpack.encode({"ts": 1}), _pack([["Unknown", 1]]),
                                     _pack([{"type": "BlockStored", "block_hashes": 3}])])
def test_what_is_not_a_vllm_batch_is_refused_by_name(payload: bytes) -> None:
    with pytest.raises(VllmDecodeError):
        decode_batch(payload)


def test_recorded_events_rehash_to_the_routers_hashes_of_the_same_prompts() -> None:
    """vLLM's own events (a real run): every stored block re-hashed from its tokens, chained, equals what the
    router computes for a prompt with those tokens, so the index answers a hit where vLLM has one."""
    run = _recorded()
    server = json.loads((run / "server.json").read_text())
    recorded = json.loads((run / "events.json").read_text())
    translator = VllmTranslator(server["model"], server["block_size"])
    index = KVIndex()
    seqs = [m["seq"] for m in recorded["messages"]]
    assert seqs == list(range(len(seqs))) and seqs, "the recording has numbered messages from 0"
    for message in recorded["messages"]:
        events = translator.translate(decode_batch(bytes.fromhex(message["payload"])).events)
        assert index.apply("v0", events)
    assert translator.num_orphans == 0
    exchanges = json.loads((run / "exchanges.json").read_text())
    salt, block_size = model_salt(server["model"]), server["block_size"]
    prompts = [e["request"]["prompt"] for e in exchanges[:3] if len(e["request"]["prompt"]) >= block_size]
    assert len(prompts) == 2  # the two that share a prefix (the third is under a block)
    for prompt in prompts:
        overlap = index.match(hash_blocks(prompt, block_size, salt))
        assert overlap.get("v0") == len(prompt) // block_size, overlap
    # the replay socket answered the same messages (each as (b"", topic, seq, payload)) and its end marker
    replayed = recorded["replay_from_0"]
    assert [r["seq"] for r in replayed] == [*seqs, -1]
    assert [r["payload"] for r in replayed[:-1]] == [m["payload"] for m in recorded["messages"]]


def test_blocks_of_an_unseen_parent_other_media_and_removals() -> None:
    translator = VllmTranslator(MODEL, 4)
    salt = model_salt(MODEL)
    first = translator.translate([VllmStored([b"a", b"b"], None, list(range(8)), 4, medium="GPU")])
    assert first == [BlockStored(0, None, hash_blocks(list(range(8)), 4, salt))]
    child = translator.translate([VllmStored([b"c"], b"b", [8, 9, 10, 11], 4)])
    assert child == [BlockStored(1, first[0].block_hashes[-1], hash_blocks(list(range(12)), 4, salt)[2:])]
    assert translator.translate([VllmStored([b"x"], b"never-seen", [1, 2, 3, 4], 4)]) == []
    assert translator.translate([VllmStored([b"y"], None, [1, 2, 3, 4], 4, medium="NVLINK")]) == []
    assert (translator.num_orphans, translator.num_unknown_medium) == (1, 1)
    removed = translator.translate([VllmRemoved([b"c", b"zz"], "GPU")])
    assert removed == [BlockRemoved(2, [child[0].block_hashes[0]])]
    lora = translator.translate([VllmStored([b"l"], None, [1, 2, 3, 4], 4, lora_name="ad")])
    assert lora == [BlockStored(3, None, hash_blocks([1, 2, 3, 4], 4, model_salt(MODEL, "ad")))]
    with pytest.raises(VllmDecodeError, match="blocks of 8 tokens"):
        translator.translate([VllmStored([b"q"], None, list(range(8)), 8)])


def test_a_gap_without_a_replay_clears_the_workers_index_and_rebuilds_it() -> None:
    emitted: list[Any] = []
    gaps: list[tuple[int, bool]] = []
    relay = VllmEventRelay(emitted.extend, "v0", VllmTranslator(MODEL, 4), "tcp://127.0.0.1:1",
                           on_gap=lambda n, replayed: gaps.append((n, replayed)))

    def stored(h: bytes, parent: bytes | None, tokens: list[int]) -> bytes:
        return _pack([{"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parent, "token_ids": tokens,
                       "block_size": 4, "lora_id": None, "medium": None}])

    async def go() -> None:
        await relay.receive(0, stored(b"a", None, [1, 2, 3, 4]))
        await relay.receive(3, stored(b"b", b"a", [5, 6, 7, 8]))  # 1 and 2 lost: the parent is forgotten too
        await relay.receive(2, stored(b"z", None, [9, 9, 9, 9]))  # older than what was seen: dropped
        await relay.receive(4, b"\xc1")  # unreadable: cleared again

    asyncio.run(go())
    assert gaps == [(2, False)]
    assert [type(e) for e in emitted] == [BlockStored, AllBlocksCleared, AllBlocksCleared]
    assert [e.event_id for e in emitted] == [0, 1, 2]  # numbered without gaps: the router applies each


def test_a_relay_that_joins_late_learns_what_the_server_cached_before_it_from_the_replay() -> None:
    """A gateway restarted in front of a warm vLLM server (or a server attached after it took traffic): the
    relay reads the server's replay socket from 0 before the live stream, so the router answers a hit for the
    prefixes cached before it joined (here vLLM's own recorded messages, served as its replay socket serves
    them) and goes on from the next sequence number without calling that a gap."""
    import zmq
    import zmq.asyncio

    from benchmarks._services import free_port
    from benchmarks.vllm_standin import answer_replay

    run = _recorded()
    server = json.loads((run / "server.json").read_text())
    recorded = json.loads((run / "events.json").read_text())
    messages = [(m["seq"], bytes.fromhex(m["payload"])) for m in recorded["messages"]]
    pub_endpoint, replay_endpoint = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    emitted: list[Any] = []
    gaps: list[tuple[int, bool]] = []
    relay = VllmEventRelay(emitted.extend, "v0", VllmTranslator(server["model"], server["block_size"]),
                           pub_endpoint, replay_endpoint=replay_endpoint,
                           on_gap=lambda n, replayed: gaps.append((n, replayed)))

    async def go() -> None:
        context = zmq.asyncio.Context.instance()
        pub, router = context.socket(zmq.PUB), context.socket(zmq.ROUTER)
        pub.bind(pub_endpoint)
        router.bind(replay_endpoint)

        replaying = asyncio.create_task(answer_replay(router, messages))  # as vLLM's replay socket answers
        following = asyncio.create_task(relay.run())
        try:
            await asyncio.wait_for(replaying, 10)
            while relay.next_seq != len(messages):
                await asyncio.sleep(0.01)
            # the next live message follows on: no gap, nothing replayed again
            last_seq, last_payload = messages[-1]
            for _ in range(100):  # until the subscription has reached the publisher
                await pub.send_multipart((b"", (last_seq + 1).to_bytes(8, "big"), last_payload))
                await asyncio.sleep(0.02)
                if relay.next_seq == len(messages) + 1:
                    break
        finally:
            following.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await following
            pub.close(linger=0)
            router.close(linger=0)

    asyncio.run(go())
    assert relay.next_seq == len(messages) + 1 and gaps == []
    index = KVIndex()
    assert index.apply("v0", emitted)
    exchanges = json.loads((run / "exchanges.json").read_text())
    salt, block_size = model_salt(server["model"]), server["block_size"]
    prompts = [e["request"]["prompt"] for e in exchanges[:3] if len(e["request"]["prompt"]) >= block_size]
    for prompt in prompts:
        assert index.match(hash_blocks(prompt, block_size, salt)).get("v0") == len(prompt) // block_size


# ---- the completion stream ---------------------------------------------------------------------------------


def _info(engine: str = "vllm") -> WorkerInfo:
    return WorkerInfo(worker_id="v0", role="both", host="127.0.0.1", port=1, model_id=MODEL, max_model_len=512,
                      block_size=32, num_blocks=100, engine=engine)


def _sse(body: str) -> Iterator[dict[str, Any]]:
    for line in body.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def test_recorded_streams_read_back_as_the_prompts_tokens_text_and_usage(tokenizer: Any) -> None:
    from dynserve.protocol import GenerateRequest, SamplingParams

    exchanges = json.loads((_recorded() / "exchanges.json").read_text())
    for exchange in exchanges[:3]:
        body = exchange["request"]
        assert exchange["status"] == 200
        request = GenerateRequest(request_id="r", token_ids=body["prompt"], params=SamplingParams(
            max_tokens=body["max_tokens"], temperature=0, logprobs=body.get("logprobs")))
        assert completion_body(_info(), request, body["prompt"])["return_token_ids"] is True
        state = _StreamState(request, tokenizer, tokens_out=True)
        deltas = [d for chunk in _sse(exchange["body"]) if (d := state.chunk(chunk)) is not None]
        tokens = [t for d in deltas for t in d.token_ids]
        vllm_tokens = [t for c in _sse(exchange["body"]) for choice in c["choices"] for t in choice["token_ids"]]
        assert tokens == vllm_tokens and deltas[-1].finished
        text = "".join(d.text for d in deltas)
        assert text == tokenizer.decode(tokens)  # dynserve's detokenizer over vLLM's tokens
        usage = next(c["usage"] for c in _sse(exchange["body"]) if c.get("usage"))
        assert (len(body["prompt"]), len(tokens)) == (usage["prompt_tokens"], usage["completion_tokens"])
        if body.get("logprobs"):
            assert all(d.logprobs and d.logprobs[0].token_id == d.token_ids[0] for d in deltas if d.token_ids)
    assert exchanges[1]["status"] == 200 and exchanges[3]["status"] == 400  # too long: refused by vLLM
    assert json.loads(exchanges[3]["body"])["error"]["param"] == "max_tokens"


def test_a_stop_string_ends_the_stream_at_it(tokenizer: Any) -> None:
    from dynserve.protocol import GenerateRequest, SamplingParams

    ids = tokenizer.encode("one two three four five")
    request = GenerateRequest(request_id="r", token_ids=[1, 2], params=SamplingParams(max_tokens=20, stop=(" three",)))
    state = _StreamState(request, tokenizer, tokens_out=True)
    done = []
    for token in ids:  # as the channel reads: up to the delta that finishes
        delta = state.chunk({"choices": [{"token_ids": [token], "finish_reason": None}]})
        if delta is not None:
            done.append(delta)
            if delta.finished:
                break
    assert done[-1].finish_reason == "stop" and state.cut and len(done) < len(ids)
    assert "".join(d.text for d in done) == "one two"


def test_recorded_metrics_give_the_load() -> None:
    text = (_recorded() / "metrics.txt").read_text()
    load = parse_load(_info(), text)
    assert (load.num_running, load.num_waiting, load.num_blocks_total) == (0, 0, 100)
    assert re.search(r"^vllm:cache_config_info\{.*block_size=\"32\"", text, re.MULTILINE)


@pytest.mark.parametrize(("spec", "problem"), [
    ("http://h:1", "start with vllm=URL"), ("vllm=h:1", "is not http://HOST:PORT"),
    ("vllm=http://h:1;color=red", "unknown option"), ("openai=http://h:1;events=tcp://h:2", "only vLLM"),
    ("vllm=http://h:1;replay=tcp://h:3", "replay= needs events="),
])
def test_bad_worker_urls_are_refused_by_name(spec: str, problem: str) -> None:
    with pytest.raises(InvalidRequestError, match=problem):
        parse_worker_url(spec)


def test_a_worker_url_with_events() -> None:
    url = parse_worker_url("vllm=http://10.0.0.5:8000/;events=tcp://10.0.0.5:5557;replay=tcp://10.0.0.5:5558;id=a")
    assert (url.engine, url.url, url.events, url.replay, url.worker_id) == (
        "vllm", "http://10.0.0.5:8000", "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", "a")


# ---- a fleet of stand-ins behind dynctl gateway ------------------------------------------------------------


@pytest.fixture(scope="module")
@needs("fleet")
def standin_gateway(dynctl: str) -> Iterator[tuple[str, list[Any]]]:
    from benchmarks.vllm_standin import standin_fleet

    with standin_fleet(2, MODEL, extra=["--decode-ms", "3"]) as servers:
        urls = [f"vllm={s.url};events={s.kv_events};replay={s.replay};id=v{i}" for i, s in enumerate(servers)]
        command = [dynctl, "gateway", "--port", "0", "--router", "kv", "--migration-limit", "3",
                   *(f"--worker-url={u}" for u in urls)]
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True)
        try:
            banner = wait_for_line(process, "dynserve gateway: serving", timeout_s=60)
            assert "attached vllm worker v0" in banner and "blocks of 32" in banner
            yield f"http://127.0.0.1:{banner_port(banner)}", servers
        finally:
            stop_by_sigint(process)


def _hits(server: Any) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return float(re.search(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$", text, re.MULTILINE).group(1))


def test_the_channel_streams_over_one_kept_connection_per_server(standin_gateway: tuple[str, list[Any]],
                                                                  tokenizer: Any) -> None:
    """Each stream read to its `[DONE]` leaves its connection to the server kept for the next (a spy on the
    channel's pool counts the connections it opens); what each stream carries is unchanged."""
    from dynserve.protocol import GenerateRequest, SamplingParams
    from dynserve.workers.openai_channel import OpenAIChannel

    _url, servers = standin_gateway
    channel = OpenAIChannel(msgspec.structs.replace(_info(), port=servers[0].port), tokenizer)
    opened = []
    open_connection = channel._pool._open

    async def spy() -> Any:
        opened.append(1)
        return await open_connection()

    channel._pool._open = spy  # type: ignore[method-assign]

    async def go() -> list[list[int]]:
        await channel.connect()
        outputs = []
        for i in range(5):
            request = GenerateRequest(request_id=f"kept-{i}", token_ids=[7, 8, 9, i],
                                      params=SamplingParams(max_tokens=4, temperature=0))
            deltas = [delta async for delta in channel.generate(request)]
            assert deltas[-1].finished and deltas[-1].num_prompt_tokens == 4
            outputs.append([t for d in deltas for t in d.token_ids])
            for _ in range(5):  # the chunked end may be read in the background
                await asyncio.sleep(0.002)
        await channel.close()
        return outputs

    outputs = asyncio.run(go())
    assert [len(tokens) for tokens in outputs] == [4] * 5
    assert len(opened) == 1


def test_attaching_waits_for_a_server_still_starting_and_gives_up_naming_the_wait() -> None:
    """A sidecar's `dynctl attach` starts beside a server still loading its model: it waits for the server
    to answer, saying so, and after `attach_wait_s` fails naming the wait."""
    import threading

    from benchmarks._services import free_port
    from dynserve.errors import WorkerUnavailableError
    from dynserve.workers.attached import describe_when_up

    heard: list[str] = []
    port = free_port()
    with pytest.raises(WorkerUnavailableError, match=r"waited 0\.5 s"):
        asyncio.run(describe_when_up(parse_worker_url(f"vllm=http://127.0.0.1:{port}"), worker_id="w",
                                     block_size=32, wait_s=0.5, poll_s=0.1, say=heard.append))
    assert heard and f"waiting for http://127.0.0.1:{port}" in heard[0]

    # a server that comes up a second after the attacher started waiting for it
    repo = Path(__file__).resolve().parent.parent
    argv = [sys.executable, "-m", "benchmarks.vllm_standin", "--port", str(port), "--model", "SmolLM2"]
    started: list[subprocess.Popen[bytes]] = []
    later = threading.Timer(1.0, lambda: started.append(subprocess.Popen(
        argv, cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)}, stdin=subprocess.DEVNULL)))
    later.start()
    try:
        info = asyncio.run(describe_when_up(parse_worker_url(f"vllm=http://127.0.0.1:{port}"), worker_id="w",
                                            block_size=16, wait_s=60, poll_s=0.2))
    finally:
        later.join()
        for process in started:
            process.kill()
            process.wait()
    assert info.engine == "vllm" and (info.block_size, info.num_blocks) == (32, 256)  # the server's own


def test_standins_serve_through_the_gateway_and_repeated_prefixes_land_where_they_are_cached(
        standin_gateway: tuple[str, list[Any]], tokenizer: Any) -> None:
    url, servers = standin_gateway
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    systems = [f"You are assistant number {n}. " + "Answer briefly and precisely. " * 12 for n in range(4)]
    hits_before, cacheable = sum(map(_hits, servers)), 0
    for turn in range(3):
        for system in systems:
            messages = [{"role": "system", "content": system}, {"role": "user", "content": f"question {turn}"}]
            answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
            assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 4
            if turn:  # what it shares with the first turn, in whole blocks
                first = [{"role": "system", "content": system}, {"role": "user", "content": "question 0"}]
                a, b = (tokenizer.encode(tokenizer.apply_chat_template(m)) for m in (first, messages))
                shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
                cacheable += shared // 32 * 32
    # every later turn went where its conversation's blocks are cached, and found all of them
    assert cacheable >= 2 * len(systems) * 32
    assert sum(map(_hits, servers)) - hits_before == cacheable
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 6 and sum(1 for c in chunks if c.choices and c.choices[0].text)


def test_a_standin_killed_mid_stream_migrates_and_the_text_is_the_undisturbed_one(
        standin_gateway: tuple[str, list[Any]]) -> None:
    url, servers = standin_gateway
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    prompt = "A long story: " + "and then " * 20
    # 160 tokens at the stand-in's 3 ms a step: the stream is still running when a client that lags its
    # server by up to 0.4 s (a loaded machine) has read 5 pieces
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=160, temperature=0).choices[0].text
    before = [_admitted_tokens(s) for s in servers]
    pieces, killed = [], False
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=160, temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].text:
            pieces.append(chunk.choices[0].text)
        if len(pieces) == 5 and not killed:  # the server that admitted the stream
            busy = next(s for s, b in zip(servers, before, strict=True) if _admitted_tokens(s) > b)
            assert _running_total(busy) == 1
            busy.process.kill()
            killed = True
    assert killed and "".join(pieces) == whole
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert re.search(r'^dynserve_migrations_total\{reason="worker_failed"\} 1\.0$', metrics, re.MULTILINE)
    # the dead server stops answering /health: its attacher takes it off the registry, so it leaves the fleet
    deadline_s = time.monotonic() + 10
    while len(httpx.get(f"{url}/metrics/targets", timeout=10).json()) != 2:  # the gateway and the survivor
        assert time.monotonic() < deadline_s, httpx.get(f"{url}/metrics/targets", timeout=10).json()
        time.sleep(0.1)


def test_dynctl_profile_measures_a_vllm_worker_through_its_api(standin_gateway: tuple[str, list[Any]],
                                                               dynctl: str, tmp_path: Path) -> None:
    from dynserve.planner.profile import load

    _url, servers = standin_gateway
    server = next(s for s in servers if s.process.poll() is None)
    done = subprocess.run([dynctl, "profile", "--worker-url", f"vllm={server.url}", "--quick", "--isl", "64,512",
                           "--context", "128", "--batch", "1,4", "--output", str(tmp_path / "p.json")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    profile = load(tmp_path / "p.json")
    assert [p.isl for p in profile.prefill] == [64, 512] and len(profile.decode) == 2
    assert (profile.block_size, profile.num_kv_blocks) == (32, 256)  # from the server's cache_config_info
    # the stand-in's cost model: 0.05 ms per prompt token, 3 ms per decode step
    assert profile.prefill[1].ttft_s >= 512 * 0.05e-3 and 3e-3 <= profile.decode[0].itl_s < 30e-3


def test_any_openai_server_serves_text_in_and_out_with_approximate_routing(
        standin_gateway: tuple[str, list[Any]], dynctl: str, tokenizer: Any) -> None:
    _url, servers = standin_gateway
    server = next(s for s in servers if s.process.poll() is None)
    command = [dynctl, "gateway", "--port", "0", "--router", "approximate", f"--worker-url=openai={server.url}"]
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True)
    try:
        banner = wait_for_line(process, "dynserve gateway: serving", timeout_s=60)
        assert "attached openai worker openai-0" in banner
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{banner_port(banner)}/v1", api_key="unused",
                               max_retries=0, timeout=60)
        answer = client.completions.create(model=MODEL, prompt="Tell me", max_tokens=6)
        # the server's own text; its token count re-encoded from that text by the gateway's tokenizer
        assert re.fullmatch(r"(<\d+>){6}", answer.choices[0].text), answer.choices[0].text
        assert answer.usage.completion_tokens == len(tokenizer.encode(answer.choices[0].text))
        assert answer.usage.prompt_tokens == len(tokenizer.encode("Tell me"))
    finally:
        stop_by_sigint(process)


def _admitted_tokens(server: Any) -> float:
    """The prompt tokens the server has admitted (its prefix cache's queries): grows when a request starts."""
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    return float(re.search(r"^vllm:prefix_cache_queries_total\{[^}]*\} (\S+)$", text, re.MULTILINE).group(1))


def _running_total(server: Any) -> float:
    try:
        text = httpx.get(f"{server.url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0.0
    return float(re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.MULTILINE).group(1))


# ---- vLLM workers that a pool starts and replaces (dynctl serve --engine vllm), stand-ins for vLLM --------


def test_dynctl_serve_engine_vllm_starts_attaches_and_replaces_its_workers(
        dynctl: str, dynctl_serve_on_test_ray: Any) -> None:
    import sys

    from dynserve.model.resolve import default_model_path

    repo = Path(__file__).resolve().parent.parent
    # the stand-in takes vLLM's server flags, so the pool starts it where it would start vLLM
    command = [dynctl, "serve", "--port", "0", "--engine", "vllm", "--workers", "1", "--block-size", "32",
               "--model", str(default_model_path()), "--worker-num-cpus", "0.1",
               "--vllm-command", f"env PYTHONPATH={repo} {sys.executable} -m benchmarks.vllm_standin",
               "--vllm-args", "--decode-ms 1"]
    env = {**os.environ, "DYN_POOL_RESTART_BACKOFF_S": "0"}
    with dynctl_serve_on_test_ray(command, 240, env) as served:
        url = f"http://127.0.0.1:{served.port}"
        ready = httpx.get(f"{url}/ready", timeout=10).json()
        assert len(ready["workers"]) == 1, ready
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        answer = client.completions.create(model=ready["model"], prompt="Hello there", max_tokens=5)
        assert answer.usage.completion_tokens == 5
        # a vLLM server that dies (its whole process group) is replaced by the pool, under a new worker id
        victim = next(t for t in httpx.get(f"{url}/metrics/targets", timeout=10).json()
                      if t["labels"]["component"] == "worker")["targets"][0]
        subprocess.run(["pkill", "-9", "-f", f"vllm_standin .*--port {victim.rsplit(':', 1)[1]}"], check=True)
        deadline_s = time.monotonic() + 60
        while True:
            workers = httpx.get(f"{url}/ready", timeout=10).json().get("workers", [])  # none ready: a 503
            if len(workers) == 1 and workers != ready["workers"]:
                break
            assert time.monotonic() < deadline_s, workers
            time.sleep(0.2)
        assert client.completions.create(model=ready["model"], prompt="Again", max_tokens=3).usage.completion_tokens == 3
    assert served.code == 0, served.rest


def test_the_recording_rules_read_a_vllm_workers_series_as_a_dynserve_workers(tmp_path: Path) -> None:
    """`promtool test rules` over the shipped rules: vLLM's series, labelled by the gateway's scrape targets,
    come out as the per-pool series the dashboards and the planner read (a dynserve worker beside it)."""
    from dynserve.observability.rules import RULES_FILE

    vllm = 'worker_id="v0",role="both",model="m",worker_engine="vllm",engine="0",model_name="m",instance="a:1"'
    ours = 'worker_id="d0",role="both",model="m",instance="b:2"'
    (tmp_path / "test.yml").write_text(f"""
rule_files: [{RULES_FILE}]
evaluation_interval: 15s
tests:
  - interval: 15s
    input_series:
      - {{series: 'vllm:num_requests_running{{{vllm}}}', values: '3x8'}}
      - {{series: 'vllm:num_requests_waiting{{{vllm}}}', values: '2x8'}}
      - {{series: 'vllm:kv_cache_usage_perc{{{vllm}}}', values: '0.5x8'}}
      - {{series: 'vllm:num_requests_running{{engine="0",model_name="m",instance="c:3"}}', values: '9x8'}}
      - {{series: 'dynserve_worker_running_requests{{{ours}}}', values: '1x8'}}
      - {{series: 'dynserve_worker_waiting_requests{{{ours}}}', values: '0x8'}}
      - {{series: 'dynserve_worker_kv_blocks_used{{{ours}}}', values: '50x8'}}
      - {{series: 'dynserve_worker_kv_blocks_capacity{{{ours}}}', values: '100x8'}}
    promql_expr_test:
      - expr: role:dynserve_worker_running_requests:sum
        eval_time: 1m
        exp_samples: [{{labels: 'role:dynserve_worker_running_requests:sum{{role="both"}}', value: 4}}]
      - expr: role:dynserve_worker_waiting_requests:sum
        eval_time: 1m
        exp_samples: [{{labels: 'role:dynserve_worker_waiting_requests:sum{{role="both"}}', value: 2}}]
      - expr: worker:dynserve_worker_kv_usage:ratio{{worker_id="v0"}}
        eval_time: 1m
        exp_samples:
          - {{labels: 'worker:dynserve_worker_kv_usage:ratio{{worker_id="v0",role="both",model="m"}}', value: 0.5}}
      - expr: role:dynserve_workers:count
        eval_time: 1m
        exp_samples: [{{labels: 'role:dynserve_workers:count{{role="both"}}', value: 2}}]
""")
    done = subprocess.run(["promtool", "test", "rules", str(tmp_path / "test.yml")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
