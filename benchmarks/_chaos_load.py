"""The chaos benchmark's steady load: a closed loop of streamed `/v1/completions` through the official
`openai` async client, `concurrency` requests in flight at all times, each outcome recorded with its times.

The load runs its own event loop in a thread of its own, so the benchmark's main thread is free to inject a
fault and watch the fleet recover while requests keep flowing. Each request is a unique prompt of token ids
(no two share a first block: the prefix cache never hides a worker's loss) asking for exactly `max_tokens`
tokens (`ignore_eos`) with `logprobs: 0`, so every chunk lists the tokens it carries.

A request succeeded when its stream ended with finish reason `length`, its chunks carried exactly
`max_tokens` tokens and its usage said so too: a migration that repeated or dropped a token fails it. The
client does not retry (`max_retries=0`) unless told to: the gateway-kill round retries as a user's client
would (the SDK retries connection errors and 5xx answers before the stream starts; a stream cut midway
raises).

Invariants: times are `time.monotonic()` of this process; `outcomes` only grows, and is complete once
`stop` has returned.
"""

from __future__ import annotations

import asyncio
import contextvars
import random
import threading
import time
from dataclasses import dataclass
from typing import Self

import httpx
import openai

from benchmarks._common import percentile

__all__ = ["Outcome", "SteadyLoad", "ttft_p99_s"]


@dataclass(slots=True)
class Outcome:
    """What the client saw of one request."""

    label: str  # the round it belongs to
    start_s: float
    end_s: float
    first_token_s: float | None
    num_tokens: int
    error: str | None
    num_attempts: int  # HTTP requests the client sent for it (more than 1: it retried)
    statuses: tuple[int, ...]  # the statuses other than 200 it was answered, in order

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.start_s


# the HTTP attempts of the request the current task is making, and their statuses (httpx's hooks run in it)
_ATTEMPTS: contextvars.ContextVar[list[int]] = contextvars.ContextVar("attempts")


async def _on_request(_request: httpx.Request) -> None:
    if (attempts := _ATTEMPTS.get(None)) is not None:
        attempts.append(0)


async def _on_response(response: httpx.Response) -> None:
    if (attempts := _ATTEMPTS.get(None)) is not None and attempts and response.status_code != 200:
        attempts[-1] = response.status_code


def ttft_p99_s(outcomes: list[Outcome]) -> float | None:
    """TTFT p99 of the requests that got a first token (failed ones included: they waited too)."""
    return percentile([o.ttft_s for o in outcomes if o.ttft_s is not None], 99)


class SteadyLoad:
    """`concurrency` streams against `port`, each starting its next request when the last ends, until
    `stop`. Use as a context manager (stopped on exit)."""

    def __init__(self, label: str, port: int, model: str, word_ids: list[int], *, concurrency: int,
                 prompt_tokens: int, max_tokens: int, seed: int, max_retries: int = 0,
                 timeout_s: float = 60.0) -> None:
        self.label, self.port, self.model = label, port, model
        self.concurrency, self.prompt_tokens, self.max_tokens = concurrency, prompt_tokens, max_tokens
        self.max_retries, self.timeout_s = max_retries, timeout_s
        self.outcomes: list[Outcome] = []
        self._word_ids = word_ids
        self._rng = random.Random(seed)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name=f"load-{label}",
                                        daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Start no new request, and wait for those in flight to end (each within its timeout)."""
        self._stopping.set()
        self._thread.join(self.timeout_s + 30)

    async def _run(self) -> None:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused", max_retries=self.max_retries,
            timeout=httpx.Timeout(self.timeout_s, connect=2.0),
            http_client=openai.DefaultAsyncHttpxClient(event_hooks={"request": [_on_request],
                                                                    "response": [_on_response]}))
        try:
            await asyncio.gather(*(self._loop(client) for _ in range(self.concurrency)))
        finally:
            await client.close()

    async def _loop(self, client: openai.AsyncOpenAI) -> None:
        while not self._stopping.is_set():
            prompt = self._rng.choices(self._word_ids, k=self.prompt_tokens)
            self.outcomes.append(await self._one(client, prompt))

    async def _one(self, client: openai.AsyncOpenAI, prompt: list[int]) -> Outcome:
        attempts: list[int] = []
        _ATTEMPTS.set(attempts)  # this task's own context: each loop is a task of its own
        start_s = time.monotonic()
        first_s: float | None = None
        num_tokens, usage_tokens, finish, error = 0, None, None, None
        try:
            stream = await client.completions.create(
                model=self.model, prompt=prompt, max_tokens=self.max_tokens, temperature=0, logprobs=0,
                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            async for chunk in stream:
                if chunk.usage is not None:
                    usage_tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    tokens = choice.logprobs.tokens if choice.logprobs is not None else None
                    if tokens:
                        first_s = first_s or time.monotonic()
                        num_tokens += len(tokens)
                    finish = choice.finish_reason or finish
        # every failure is an outcome, counted and shown (a stream cut midway raises httpx's errors)
        except (openai.OpenAIError, httpx.HTTPError, OSError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"[:300]
        if error is None and (finish != "length" or num_tokens != self.max_tokens
                              or usage_tokens != self.max_tokens):
            error = (f"incomplete: finish {finish!r}, {num_tokens} tokens in chunks, usage {usage_tokens}, "
                     f"asked {self.max_tokens}")
        return Outcome(self.label, start_s, time.monotonic(), first_s, num_tokens, error, len(attempts),
                       tuple(status for status in attempts if status))
