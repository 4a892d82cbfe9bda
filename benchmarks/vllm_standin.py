"""A stand-in for a vLLM server where vLLM itself is not installed (the suite; quick benchmark runs): it answers
the parts of vLLM's API that dynserve's vLLM channel uses and publishes KV events in vLLM's wire format, so a
fleet of "vLLM workers" runs behind the gateway in milliseconds. It is not vLLM: its model is arithmetic and
its timing a cost model. What vLLM really says is recorded in `tests/fixtures/vllm/` and checked against the
same decoder; `make test-peers` runs the real one.

    python -m benchmarks.vllm_standin --port 8100 --model SmolLM2 --kv-events tcp://127.0.0.1:5557
        [--replay tcp://127.0.0.1:5558] [--shape tagged|positional] [--block-size 32] [--num-blocks 256]
        [--prefill-ms-per-token 0.05] [--decode-ms 2] [--max-model-len 2048]
        [--eos-token-id 2]

- `POST /v1/completions`, streamed, with the prompt as token ids (or text, read as its bytes): each chunk
  carries one token in `choices[0].token_ids` and as text (`<id>`); the next token is a function of the
  whole context (so greedy continuations are exact); `stop_token_ids`, the EOS (unless `ignore_eos`), `max_tokens`; a prompt over
  `max_model_len` is a 400 as vLLM words it; the usage chunk counts cached prompt tokens.
- A prefix cache of `num_blocks` blocks (LRU): a prompt's uncached tokens cost `prefill_ms_per_token` each,
  one prefill at a time (so a queue forms); each decode step `decode_ms`. Full blocks of the prompt and the
  output are stored when the request ends, and evicted least recently used first: `BlockStored` and
  `BlockRemoved` events with vLLM's fields (its own seeded block hashes, the blocks' token ids, block size,
  medium), on a ZMQ PUB socket as `(topic, seq, payload)`, with a replay ROUTER socket.
- `GET /metrics` (`vllm:cache_config_info` with its block size and count, `vllm:num_requests_running`,
  `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, `vllm:prefix_cache_queries_total`,
  `vllm:prefix_cache_hits_total`), `GET /health`, `GET /v1/models`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

__all__ = ["StandinServer", "answer_replay", "next_token", "standin_fleet"]

REPO_ROOT = Path(__file__).resolve().parent.parent


def next_token(context: list[int], vocab_size: int = 49152) -> int:
    """The stand-in's model: a function of the whole context."""
    return (len(context) * 7919 + context[-1] * 31 + (context[-2] if len(context) > 1 else 0)) % vocab_size


class _Cache:
    """Prefix-cache blocks keyed by the stand-in's own hash (seeded per process, as vLLM's are), LRU."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.blocks: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._seed = random.getrandbits(32)

    def hashes(self, token_ids: list[int]) -> list[tuple[int, list[int]]]:
        out, parent = [], self._seed
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            block = token_ids[start:start + self.block_size]
            parent = hash((parent, *block)) & ((1 << 63) - 1)
            out.append((parent, block))
        return out

    def cached_prefix(self, token_ids: list[int]) -> int:
        num = 0
        for block_hash, _block in self.hashes(token_ids):
            if block_hash not in self.blocks:
                break
            self.blocks.move_to_end(block_hash)
            num += 1
        return num * self.block_size


class Standin:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cache = _Cache(args.num_blocks, args.block_size)
        self.running = self.waiting = 0
        self.queries = self.hits = 0
        self.prefill_lock = asyncio.Lock()
        self.seq = 0
        self.replay_buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=10_000)
        self.pub: Any = None

    def publish(self, events: list[Any]) -> None:
        payload = msgspec.msgpack.encode([time.time(), events, 0])
        frames = (self.args.topic.encode(), self.seq.to_bytes(8, "big"), payload)
        if self.pub is not None:
            self.pub.send_multipart(frames)
        self.replay_buffer.append((self.seq, payload))
        self.seq += 1

    def _event(self, kind: str, **fields: Any) -> Any:
        if self.args.shape == "tagged":
            return {"type": kind, **fields}
        order = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                                 "lora_name"), "BlockRemoved": ("block_hashes", "medium")}[kind]
        return [kind, *(fields.get(name) for name in order)]

    def store(self, token_ids: list[int]) -> None:
        """Cache the full blocks of `token_ids` not yet cached (one BlockStored), evicting the LRU ones."""
        stored: list[tuple[int, list[int]]] = []
        parent: int | None = None
        removed: list[int] = []
        for block_hash, block in self.cache.hashes(token_ids):
            if block_hash in self.cache.blocks:
                self.cache.blocks.move_to_end(block_hash)
                parent = block_hash
                continue
            stored.append((block_hash, block))
        for block_hash, _ in stored:
            self.cache.blocks[block_hash] = None
        while len(self.cache.blocks) > self.cache.num_blocks:
            removed.append(self.cache.blocks.popitem(last=False)[0])
        events = []
        if stored:
            events.append(self._event(
                "BlockStored", block_hashes=[h for h, _ in stored], parent_block_hash=parent,
                token_ids=[t for _, block in stored for t in block], block_size=self.cache.block_size,
                lora_id=None, medium="GPU", lora_name=None))
        if removed:
            events.append(self._event("BlockRemoved", block_hashes=removed, medium="GPU"))
        if events:
            self.publish(events)

    def metrics(self) -> str:
        usage = len(self.cache.blocks) / self.cache.num_blocks
        name = self.args.model
        info = (f'vllm:cache_config_info{{block_size="{self.cache.block_size}",engine="0",'
                f'num_gpu_blocks="{self.cache.num_blocks}",enable_prefix_caching="True"}} 1.0\n')
        return info + "".join(f'{metric}{{engine="0",model_name="{name}"}} {value}\n' for metric, value in (
            ("vllm:num_requests_running", float(self.running)), ("vllm:num_requests_waiting", float(self.waiting)),
            ("vllm:kv_cache_usage_perc", usage), ("vllm:prefix_cache_queries_total", float(self.queries)),
            ("vllm:prefix_cache_hits_total", float(self.hits))))

    async def generate(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        # a text prompt (as any OpenAI server takes it) is read as its UTF-8 bytes
        prompt: list[int] = body["prompt"] if isinstance(body["prompt"], list) else list(body["prompt"].encode())
        max_tokens = int(body.get("max_tokens") or 16)
        stop_ids = set(body.get("stop_token_ids") or [])
        if not body.get("ignore_eos") and self.args.eos_token_id is not None:
            stop_ids.add(self.args.eos_token_id)
        self.waiting += 1
        try:
            async with self.prefill_lock:
                self.waiting -= 1
                self.running += 1
                cached = self.cache.cached_prefix(prompt)
                self.queries += len(prompt)
                self.hits += cached
                await asyncio.sleep((len(prompt) - cached) * self.args.prefill_ms_per_token / 1000)
        except BaseException:
            self.waiting -= 1
            raise
        context, rid = list(prompt), f"cmpl-{random.getrandbits(48):x}"
        try:
            for n in range(1, max_tokens + 1):
                if n > 1:
                    await asyncio.sleep(self.args.decode_ms / 1000)
                token = next_token(context, self.args.vocab_size)
                context.append(token)
                reason = "stop" if token in stop_ids else "length" if n == max_tokens else None
                choice: dict[str, Any] = {"index": 0, "text": f"<{token}>", "token_ids": [token], "logprobs": None,
                                          "finish_reason": reason}
                if body.get("logprobs") is not None:
                    choice["logprobs"] = {"tokens": [f"token_id:{token}"], "token_logprobs": [-0.25],
                                          "top_logprobs": [{f"token_id:{token}": -0.25}], "text_offset": [0]}
                chunk = {"id": rid, "object": "text_completion", "created": int(time.time()),
                         "model": self.args.model, "choices": [choice]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
                if reason is not None:
                    break
            self.store(context)
            usage = {"prompt_tokens": len(prompt), "completion_tokens": len(context) - len(prompt),
                     "total_tokens": len(context), "prompt_tokens_details": {"cached_tokens": cached}}
            chunk = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.args.model,
                     "choices": [], "usage": usage}
            yield f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
        finally:
            self.running -= 1


def build_app(standin: Standin) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": standin.args.model, "object": "model",
                                            "max_model_len": standin.args.max_model_len}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(standin.metrics())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        prompt = body.get("prompt")
        token_ids = isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
        if not body.get("stream") or not (token_ids or (isinstance(prompt, str) and prompt)):
            return JSONResponse({"error": {"message": "the stand-in serves streamed prompts only",
                                           "type": "BadRequestError", "param": None, "code": 400}}, 400)
        if len(prompt if token_ids else prompt.encode()) + int(body.get("max_tokens") or 16) > standin.args.max_model_len:
            message = (f"This model's maximum context length is {standin.args.max_model_len} tokens. However, you "
                       f"requested {len(prompt) + int(body.get('max_tokens') or 16)} tokens.")
            return JSONResponse({"error": {"message": message, "type": "BadRequestError", "param": None,
                                           "code": 400}}, 400)
        return StreamingResponse(standin.generate(body), media_type="text/event-stream")

    return app


async def answer_replay(router: Any, buffer: Iterable[tuple[int, bytes]], topic: bytes = b"") -> None:
    """Answer one replay request on a bound ZMQ ROUTER socket (`zmq.asyncio`) as vLLM's replay socket does:
    every buffered `(seq, payload)` whose seq is at least the one asked for, then the end (seq -1)."""
    client, _empty, start = await router.recv_multipart()
    first = int.from_bytes(start, "big")
    for seq, payload in list(buffer):
        if seq >= first:
            await router.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
    await router.send_multipart((client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""))


async def _serve_replay(standin: Standin, endpoint: str) -> None:
    import zmq
    import zmq.asyncio

    router = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    router.bind(endpoint)
    while True:
        await answer_replay(router, standin.replay_buffer, standin.args.topic.encode())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Its own flags, and vLLM's server flags that matter here (`--served-model-name`, `--block-size`,
    `--max-model-len`, `--kv-events-config`), so a pool can start it where it would start vLLM; the rest of
    vLLM's flags are accepted and ignored."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--model", required=True, help="the served name, or (as vLLM takes it) a path")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--kv-events", default=None, help="the ZMQ PUB endpoint to bind (none: no events)")
    parser.add_argument("--replay", default=None, help="the ZMQ ROUTER endpoint for replays")
    parser.add_argument("--kv-events-config", default=None, help="vLLM's: its endpoint and replay_endpoint")
    parser.add_argument("--topic", default="")
    parser.add_argument("--shape", choices=["tagged", "positional"], default="tagged")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--num-blocks", type=int, default=256)
    parser.add_argument("--prefill-ms-per-token", type=float, default=0.05)
    parser.add_argument("--decode-ms", type=float, default=2.0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--vocab-size", type=int, default=49152)
    parser.add_argument("--eos-token-id", type=int, default=None)
    args, _vllm_flags = parser.parse_known_args(argv)
    args.model = args.served_model_name or Path(args.model).name
    if args.kv_events_config:
        config = json.loads(args.kv_events_config)
        args.kv_events = args.kv_events or config.get("endpoint")
        args.replay = args.replay or config.get("replay_endpoint")
        args.topic = config.get("topic", args.topic)
    return args


def main(argv: list[str] | None = None) -> None:
    import uvicorn
    import zmq

    args = parse_args(argv)
    standin = Standin(args)

    async def run() -> None:
        if args.kv_events:
            standin.pub = zmq.Context.instance().socket(zmq.PUB)
            standin.pub.bind(args.kv_events)
        tasks = [asyncio.create_task(_serve_replay(standin, args.replay))] if args.replay else []
        server = uvicorn.Server(uvicorn.Config(build_app(standin), host=args.host, port=args.port,
                                               log_level="warning", lifespan="off"))
        await server.serve()
        for task in tasks:
            task.cancel()

    asyncio.run(run())


# ---- for tests and benchmarks: stand-ins as child processes ----------------------------------------------


@dataclass
class StandinServer:
    process: subprocess.Popen[bytes]
    port: int
    kv_events: str
    replay: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.contextmanager
def standin_fleet(num: int, model: str, *, extra: list[str] | None = None,
                  timeout_s: float = 30.0) -> Iterator[list[StandinServer]]:
    """`num` stand-ins as child processes on free loopback ports, each ready (its /health answers)."""
    from benchmarks._services import free_port

    servers = []
    try:
        for _ in range(num):
            port, pub, replay = free_port(), free_port(), free_port()
            kv, rp = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
            argv = [sys.executable, "-m", "benchmarks.vllm_standin", "--port", str(port), "--model", model,
                    "--kv-events", kv, "--replay", rp, *(extra or [])]
            process = subprocess.Popen(argv, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                                       stdin=subprocess.DEVNULL)
            servers.append(StandinServer(process, port, kv, rp))
        deadline_s = time.monotonic() + timeout_s
        for server in servers:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                        break
                if server.process.poll() is not None or time.monotonic() > deadline_s:
                    raise RuntimeError(f"the vLLM stand-in on port {server.port} did not start")
                time.sleep(0.05)
        yield servers
    finally:
        for server in servers:
            server.process.kill()
            server.process.wait()


if __name__ == "__main__":
    main()
