"""`dynctl profile --worker-url vllm=http://HOST:PORT`: the capacity profile of a worker that is an
OpenAI-compatible server (a vLLM worker), measured through its HTTP API, for the planner to scale a pool of
such workers by (the same `CapacityProfile` as `dynctl profile` measures in-process).

- prefill, per ISL: TTFT of one streamed request alone (`max_tokens=1`, the median of a few runs), and the
  prompt tokens/s the server sustains with enough such requests sent at once to keep it busy;
- decode, per (context, batch size): `batch_size` streams with `context`-token prompts; the ITL is the median
  over the streams of each one's mean time between tokens after its first.
Every prompt is fresh random token ids, so none is served from the prefix cache. Times include the HTTP
round trip, as a gateway in front of the server sees them.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from dynserve.planner.profile import DecodePoint, PrefillPoint
from dynserve.protocol import WorkerInfo

__all__ = ["measure_server"]

_VOCAB = 32_000  # prompt ids are drawn below this: every model dynserve serves has at least as many tokens


class _Server:
    def __init__(self, info: WorkerInfo, client: Any, seed: int = 0) -> None:
        self.info, self.client = info, client
        self.rng = random.Random(seed)

    def prompt(self, num_tokens: int) -> list[int]:
        return [self.rng.randrange(100, _VOCAB) for _ in range(num_tokens)]

    async def stream(self, num_prompt: int, max_tokens: int) -> list[float]:
        """The arrival times (perf_counter) of each streamed token of one request."""
        body = {"model": self.info.model_id, "prompt": self.prompt(num_prompt), "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        if self.info.engine != "vllm":
            body.pop("ignore_eos")
        times: list[float] = []
        async with self.client.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: {") and '"choices":[{' in line.replace(" ", ""):
                    times.append(time.perf_counter())
        return times

    async def ttft_s(self, isl: int) -> float:
        start = time.perf_counter()
        times = await self.stream(isl, 1)
        return times[0] - start

    async def saturated_tokens_per_s(self, isl: int, num: int) -> float:
        start = time.perf_counter()
        await asyncio.gather(*(self.stream(isl, 1) for _ in range(num)))
        return isl * num / (time.perf_counter() - start)

    async def itl_s(self, context: int, batch_size: int, num_tokens: int) -> float:
        streams = await asyncio.gather(*(self.stream(context, num_tokens) for _ in range(batch_size)))
        gaps = [(t[-1] - t[0]) / (len(t) - 1) for t in streams if len(t) > 1]
        return statistics.median(gaps)


async def measure_server(info: WorkerInfo, url: str, *, isls: tuple[int, ...], contexts: tuple[int, ...],
                         batch_sizes: tuple[int, ...], num_ttft_runs: int, num_decode_tokens: int,
                         progress: Callable[[str], None]) -> tuple[list[PrefillPoint], list[DecodePoint]]:
    """The prefill and decode points that fit the server's context (`info.max_model_len`); more work never
    measured as taking less time (a lower value is raised to the previous point's, as `dynctl profile`
    does)."""
    import httpx

    prefill: list[PrefillPoint] = []
    decode: list[DecodePoint] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        server = _Server(info, client)
        await server.ttft_s(16)  # warm-up
        for isl in isls:
            if isl + 1 > info.max_model_len:
                progress(f"prefill isl={isl}: skipped (over the context of {info.max_model_len})")
                continue
            ttft_s = statistics.median([await server.ttft_s(isl) for _ in range(num_ttft_runs)])
            tokens_per_s = await server.saturated_tokens_per_s(isl, max(4, 8192 // isl))
            if prefill and ttft_s < prefill[-1].ttft_s:
                ttft_s = prefill[-1].ttft_s
            prefill.append(PrefillPoint(isl=isl, ttft_s=round(ttft_s, 6), tokens_per_s=round(tokens_per_s, 1)))
            progress(f"prefill isl={isl}: ttft {ttft_s:.4g} s alone, {tokens_per_s:,.0f} tokens/s saturated")
        for context in contexts:
            if context + num_decode_tokens > info.max_model_len:
                progress(f"decode context={context}: skipped (over the context of {info.max_model_len})")
                continue
            points: list[DecodePoint] = []
            for batch_size in batch_sizes:
                itl_s = await server.itl_s(context, batch_size, num_decode_tokens)
                if points and itl_s < points[-1].itl_s:
                    itl_s = points[-1].itl_s
                points.append(DecodePoint(context=context, batch_size=batch_size, itl_s=round(itl_s, 7)))
                progress(f"decode context={context} batch={batch_size}: itl {itl_s * 1e3:.4g} ms")
            decode += points
    return prefill, decode
