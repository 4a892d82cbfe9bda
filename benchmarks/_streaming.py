"""One streamed `/v1/completions` request, timed token by token on the client.

The request asks for `logprobs: 0`, so every chunk lists the tokens it carries: when the gateway merges
several tokens into one chunk (it does when the client reads slower than tokens come), each of them is
still counted, and the chunk's gap since the previous one is shared evenly among them.

Definitions (every time on the client's monotonic clock, from the moment the request bytes went out):
- TTFT: until the first chunk that carries a token;
- inter-token latencies: one per token after the first (tokens that came in the first chunk with it count
  0); they add up to the time from the first token to the last;
- mean ITL (per request): (last token - first token) / (tokens - 1), vLLM's TPOT.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from benchmarks._http import HttpError, RawConnection

__all__ = ["StreamedCompletion", "completion_body", "stream_completion"]


@dataclass(slots=True)
class StreamedCompletion:
    """What the client saw of one request. `error` is set when it did not complete."""

    scheduled_s: float  # when it was meant to go out
    sent_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)  # each chunk that carried tokens
    chunk_num_tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_completion_tokens: int | None = None  # from the usage chunk
    error: str | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.chunk_num_tokens)

    @property
    def ttft_s(self) -> float | None:
        if self.sent_s is None or not self.chunk_times_s:
            return None
        return self.chunk_times_s[0] - self.sent_s

    @property
    def mean_itl_s(self) -> float | None:
        if len(self.chunk_times_s) < 2 or self.num_tokens < 2:
            return None
        return (self.chunk_times_s[-1] - self.chunk_times_s[0]) / (self.num_tokens - 1)

    def itls_s(self) -> list[float]:
        """The inter-token latencies (see the module's docstring)."""
        if not self.chunk_times_s:
            return []
        gaps = [0.0] * (self.chunk_num_tokens[0] - 1)
        times_s, counts = self.chunk_times_s, self.chunk_num_tokens
        for previous_s, now_s, num in zip(times_s, times_s[1:], counts[1:], strict=False):
            gaps.extend([(now_s - previous_s) / num] * num)
        return gaps


def completion_body(model: str, prompt_token_ids: list[int], max_tokens: int) -> bytes:
    """A greedy streamed completion of exactly `max_tokens` tokens (`ignore_eos`), with per-chunk tokens."""
    return json.dumps({"model": model, "prompt": prompt_token_ids, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "logprobs": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()


async def stream_completion(port: int, body: bytes, *, scheduled_s: float | None = None,
                            timeout_s: float = 120.0, host: str = "127.0.0.1") -> StreamedCompletion:
    """Send `body` to /v1/completions on a connection of its own and read the stream to its end; failures
    (an HTTP error, an error event, a dropped connection, `timeout_s` passing) land in `error`."""
    result = StreamedCompletion(scheduled_s if scheduled_s is not None else time.monotonic())
    conn = RawConnection(host, port)
    try:
        await asyncio.wait_for(_read(conn, body, result), timeout_s)
    except TimeoutError:  # before OSError, its base class
        result.error = f"no end of stream within {timeout_s:g} s"
    except (OSError, HttpError, asyncio.IncompleteReadError, ValueError, KeyError, IndexError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"  # IndexError: closed before a status line came
    finally:
        await conn.close()
    if result.error is None and result.num_completion_tokens != result.num_tokens:
        result.error = (f"usage says {result.num_completion_tokens} tokens, "
                        f"the chunks carried {result.num_tokens}")
    return result


async def _read(conn: RawConnection, body: bytes, result: StreamedCompletion) -> None:
    await conn.open()
    result.sent_s, events = await conn.post_events(conn.request_bytes("/v1/completions", body))
    async for data in events:
        now_s = time.monotonic()
        if data == b"[DONE]":
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            raise ValueError(f"error event: {chunk['error']}")
        if chunk.get("usage"):
            result.num_completion_tokens = chunk["usage"]["completion_tokens"]
        for choice in chunk["choices"]:
            num_tokens = len(choice["logprobs"]["tokens"]) if choice.get("logprobs") else 0
            if num_tokens:
                result.chunk_times_s.append(now_s)
                result.chunk_num_tokens.append(num_tokens)
            result.text += choice["text"]
            result.finish_reason = choice["finish_reason"] or result.finish_reason
