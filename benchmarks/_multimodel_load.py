"""The multimodel benchmark's workload and load generator: short streamed chat completions, each request's
model drawn from a Zipf mix over the served models' names, played by a fixed number of users that each keep
one connection and send their next request as soon as the last one's `[DONE]` arrives (closed loop).

Invariants kept here:
- The workload is a pure function of its seed: the prompts, the output lengths and the Zipf draws. Two
  fleets played with the same seed get the same prompts and lengths in the same order; only the `model`
  field differs (`Workload.bodies(names)`), so what one fleet's gateway does more is its own.
- Every request body is encoded before the clock starts; an answer is read by its chunk framing only, and
  one in every `_CHECK_EVERY` is parsed in full (its usage chunk must count the tokens asked for).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks._http import read_chunked_body

__all__ = ["LoadResult", "Workload", "make_workload", "play", "zipf_weights"]

_DONE = b"data: [DONE]\n\n"
_CHECK_EVERY = 50
_WORDS = ("cache", "token", "worker", "router", "prefix", "stream", "batch", "gateway", "block", "model",
          "queue", "decode", "prefill", "latency", "page", "shard")


def zipf_weights(num_models: int, exponent: float) -> list[float]:
    """P(the i-th model) proportional to 1 / (i + 1) ** exponent, normalised: the first model is the hottest."""
    raw = [1.0 / (i + 1) ** exponent for i in range(num_models)]
    total = sum(raw)
    return [w / total for w in raw]


@dataclass(frozen=True)
class Workload:
    """Per request: its prompt, its output length and the index of its model in the mix."""

    prompts: tuple[str, ...]
    max_tokens: tuple[int, ...]
    model_indexes: tuple[int, ...]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    def bodies(self, names: Sequence[str]) -> list[bytes]:
        """The requests as JSON bodies for a fleet serving `names`; with one name every request goes to it."""
        return [json.dumps({"model": names[m % len(names)], "messages": [{"role": "user", "content": p}],
                            "max_tokens": n, "stream": True, "stream_options": {"include_usage": True}}).encode()
                for p, n, m in zip(self.prompts, self.max_tokens, self.model_indexes, strict=True)]

    def share_by_model(self, num_models: int) -> list[float]:
        counts = [0] * num_models
        for m in self.model_indexes:
            counts[m] += 1
        return [c / self.num_requests for c in counts]


def make_workload(num_requests: int, num_models: int, *, exponent: float, max_tokens: tuple[int, int],
                  prompt_words: tuple[int, int], seed: int) -> Workload:
    """`num_requests` distinct chat prompts of `prompt_words` words and outputs of `max_tokens` tokens
    (inclusive ranges), each for a model drawn from `zipf_weights(num_models, exponent)`."""
    rng = random.Random(seed)
    prompts = tuple(f"Request {seed}-{i}: " + " ".join(rng.choices(_WORDS, k=rng.randint(*prompt_words)))
                    for i in range(num_requests))
    lengths = tuple(rng.randint(*max_tokens) for _ in range(num_requests))
    indexes = tuple(rng.choices(range(num_models), weights=zipf_weights(num_models, exponent), k=num_requests))
    return Workload(prompts, lengths, indexes)


@dataclass(frozen=True)
class LoadResult:
    wall_s: float
    latency_s: list[float]  # per request, send to `[DONE]`, in the order they finished


class _User:
    """One keep-alive HTTP/1.1 connection to the gateway."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def send(self, request: bytes, expected_tokens: int | None) -> float:
        """Send one request, read its whole streamed answer; the seconds it took."""
        start_s = time.perf_counter()
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        body = await read_chunked_body(self.reader)
        elapsed_s = time.perf_counter() - start_s
        if not head.startswith(b"HTTP/1.1 200") or not body.endswith(_DONE):
            raise RuntimeError(f"{head.splitlines()[0]!r}: {body[-300:]!r}")
        if expected_tokens is not None:
            _check_usage(body, expected_tokens)
        return elapsed_s


def _check_usage(body: bytes, expected_tokens: int) -> None:
    chunks = [json.loads(e[6:]) for e in body.split(b"\n\n") if e.startswith(b"data: {")]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    if not usage or usage[-1]["completion_tokens"] != expected_tokens:
        raise RuntimeError(f"expected a usage chunk with {expected_tokens} completion tokens, got {usage}")


async def play(port: int, bodies: Sequence[bytes], max_tokens: Sequence[int], concurrency: int) -> LoadResult:
    """`concurrency` users take the requests in order until none is left."""
    users = [_User(*await asyncio.open_connection("127.0.0.1", port)) for _ in range(concurrency)]
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
    requests = [head % len(b) + b for b in bodies]
    latency_s: list[float] = []
    next_index = 0

    async def run(user: _User) -> None:
        nonlocal next_index
        while next_index < len(requests):
            i = next_index
            next_index += 1
            latency_s.append(await user.send(requests[i], max_tokens[i] if i % _CHECK_EVERY == 0 else None))

    start_s = time.perf_counter()
    try:
        await asyncio.gather(*(run(u) for u in users))
    finally:
        for user in users:
            user.writer.close()
    return LoadResult(time.perf_counter() - start_s, latency_s)
