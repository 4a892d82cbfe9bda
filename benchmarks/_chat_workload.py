"""A shared-prefix multi-turn chat workload, and a client that plays it against any OpenAI-compatible server.

The workload is what KV-aware routing is for: a few long system prompts, each shared by many
conversations; each conversation runs several turns, and every turn resends the whole history (system
prompt, earlier user turns and the assistant's earlier answers) plus a new user message. Conversations
start as a Poisson process; a conversation's next turn is sent a think time after its previous answer.
Everything is drawn from one seeded RNG, so two runs (two routers) play the same script.

The client streams `/v1/chat/completions` with usage, one keep-alive connection per conversation, and
records per turn: TTFT (send to first content), the prompt and cached token counts from the usage chunk,
and end-to-end time. Answers are fed back into the history as the server produced them, so each router is
measured on its own conversation history, exactly as a user would see it.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from benchmarks._common import percentile
from benchmarks._http import HttpError, RawConnection

__all__ = ["ChatWorkload", "TurnResult", "make_chat_workload", "play", "summarize"]

_MAX_RETRIES = 3
_IDLE_REOPEN_S = 4.0  # a connection idle this long is replaced (servers close idle ones after ~5 s)
_RETRY_DELAY_S = 0.1
_WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case point "
    "government company number group problem fact be have do say get make go know take see come think look "
    "want give use find tell ask seem feel try leave call good new first last long great little own other "
    "old right big high different small large next early young important few public bad same able system "
    "model cache router worker request token prefix block memory latency throughput cluster server queue "
    "stream engine batch kernel attention layer vector tensor schedule policy metric deploy scale pool"
).split()


@dataclass(frozen=True, slots=True)
class Conversation:
    system_index: int
    start_s: float
    user_turns: tuple[str, ...]
    max_tokens: tuple[int, ...]
    think_s: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class ChatWorkload:
    system_prompts: tuple[str, ...]
    conversations: tuple[Conversation, ...]

    @property
    def num_turns(self) -> int:
        return sum(len(c.user_turns) for c in self.conversations)


@dataclass(slots=True)
class TurnResult:
    conversation: int
    turn: int
    ttft_s: float
    e2e_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


def _text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


def make_chat_workload(*, seed: int, num_system_prompts: int, system_words: int, num_conversations: int,
                       num_turns: int, user_words: tuple[int, int], max_tokens: tuple[int, int],
                       arrival_rate_per_s: float, think_s: float) -> ChatWorkload:
    rng = random.Random(seed)
    systems = tuple(f"You are assistant number {i}. " + _text(rng, system_words) for i in range(num_system_prompts))
    conversations, clock_s = [], 0.0
    for _ in range(num_conversations):
        clock_s += rng.expovariate(arrival_rate_per_s)
        conversations.append(Conversation(
            system_index=rng.randrange(num_system_prompts), start_s=clock_s,
            user_turns=tuple(_text(rng, rng.randint(*user_words)) for _ in range(num_turns)),
            max_tokens=tuple(rng.randint(*max_tokens) for _ in range(num_turns)),
            think_s=tuple(rng.expovariate(1 / think_s) for _ in range(num_turns)),
        ))
    return ChatWorkload(systems, tuple(conversations))


@dataclass(slots=True)
class _Player:
    host: str
    port: int
    model: str
    path: str = "/v1/chat/completions"
    results: list[TurnResult] = field(default_factory=list)
    num_retries: int = 0

    async def conversation(self, index: int, conv: Conversation, workload: ChatWorkload, t0: float) -> None:
        await asyncio.sleep(max(0.0, t0 + conv.start_s - time.monotonic()))
        conn = await RawConnection(self.host, self.port).open()
        messages: list[dict[str, str]] = [{"role": "system", "content": workload.system_prompts[conv.system_index]}]
        try:
            for turn, user in enumerate(conv.user_turns):
                messages.append({"role": "user", "content": user})
                body = json.dumps({"model": self.model, "messages": messages,
                                   "max_tokens": conv.max_tokens[turn], "temperature": 0, "ignore_eos": True,
                                   "stream": True, "stream_options": {"include_usage": True}}).encode()
                conn, answer, result = await self._turn(conn, body, index, turn)
                self.results.append(result)
                messages.append({"role": "assistant", "content": answer})
                await asyncio.sleep(conv.think_s[turn])
                if conv.think_s[turn] > _IDLE_REOPEN_S:  # as a client's pool does before the server's keep-alive
                    await conn.close()
                    conn = await RawConnection(self.host, self.port).open()
        finally:
            await conn.close()

    async def _turn(self, conn: RawConnection, body: bytes, index: int,
                    turn: int) -> tuple[RawConnection, str, TurnResult]:
        """One turn; a 429 or 503 is retried (as OpenAI's clients do) on a fresh connection after
        `_RETRY_DELAY_S`, at most `_MAX_RETRIES` times; the turn's times count from the first send."""
        first_sent_s: float | None = None
        for attempt in range(_MAX_RETRIES + 1):
            sent_s, events = await conn.post_events(conn.request_bytes(self.path, body))
            first_sent_s = first_sent_s or sent_s
            try:
                answer, first_s, usage = await _read_answer(events)
                break
            except HttpError as exc:
                if exc.status not in (429, 503) or attempt == _MAX_RETRIES:
                    raise
                self.num_retries += 1
                await conn.close()
                await asyncio.sleep(_RETRY_DELAY_S)
                conn = await RawConnection(self.host, self.port).open()
        end_s = time.monotonic()
        if usage is None or first_s is None:
            raise RuntimeError(f"conversation {index} turn {turn}: no content or no usage in the stream")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return conn, answer, TurnResult(index, turn, first_s - first_sent_s, end_s - first_sent_s,
                                        usage["prompt_tokens"], cached, usage["completion_tokens"])


async def _read_answer(events: AsyncIterator[bytes]) -> tuple[str, float | None, dict[str, Any] | None]:
    """(the answer's text, when its first content arrived, the usage) from a chat completion's SSE stream."""
    first_s, usage, parts = None, None, []
    async for data in events:
        if data == b"[DONE]":
            continue  # read on to the end of the body: the connection is reused
        chunk = json.loads(data)
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            content = (choice.get("delta") or {}).get("content")
            if content:
                parts.append(content)
                if first_s is None:
                    first_s = time.monotonic()
    return "".join(parts), first_s, usage


async def play(workload: ChatWorkload, host: str, port: int, model: str) -> tuple[list[TurnResult], int]:
    """Run every conversation on its schedule against the server at host:port; returns one result per turn
    and the number of requests retried after a 429 or 503."""
    player = _Player(host, port, model)
    t0 = time.monotonic() + 0.2
    await asyncio.gather(*(player.conversation(i, c, workload, t0) for i, c in enumerate(workload.conversations)))
    return player.results, player.num_retries


def summarize(results: list[TurnResult], block_size: int = 16) -> dict[str, Any]:
    """TTFT percentiles (overall and p50 per turn index), cache hit ratio (cached / prompt tokens, from the
    usage the server reported), and `history_hit`: the share of follow-up turns that found at least their
    conversation's previous prompt, less a block, in the cache, i.e. that went back to a worker holding
    their history."""
    ttfts_ms = [1000 * r.ttft_s for r in results]
    prompt = sum(r.prompt_tokens for r in results)
    by_turn: dict[int, list[float]] = {}
    for r in results:
        by_turn.setdefault(r.turn, []).append(1000 * r.ttft_s)
    prompt_of = {(r.conversation, r.turn): r.prompt_tokens for r in results}
    followups = [r for r in results if (r.conversation, r.turn - 1) in prompt_of]
    on_history = sum(1 for r in followups
                     if r.cached_tokens >= prompt_of[r.conversation, r.turn - 1] - block_size)
    return {
        "turns": len(results),
        "ttft_p50_ms": percentile(ttfts_ms, 50),
        "ttft_p90_ms": percentile(ttfts_ms, 90),
        "ttft_p50_ms_by_turn": [percentile(by_turn[t], 50) for t in sorted(by_turn)],
        "e2e_p50_ms": percentile([1000 * r.e2e_s for r in results], 50),
        "prompt_tokens": prompt,
        "cache_hit": sum(r.cached_tokens for r in results) / prompt if prompt else 0.0,
        "history_hit": on_history / len(followups) if followups else None,
    }
