"""The completion routes (`POST /v1/chat/completions`, `POST /v1/completions`) on a lean ASGI path.

These two routes carry all the traffic, so they skip the web framework's per-request machinery (dependency
resolution, middleware stack, response classes): the body is read with a size limit, validated by the
pydantic schemas in one `model_validate_json` call, preprocessed, admitted, and answered with raw ASGI
messages. Measured here, that is about a tenth of the framework path's CPU per request, which is what a
burst of requests waits on. Everything else (models, health, metrics, OpenAPI) stays on FastAPI.

A request's choices run as one `_Run`: fan-out over prompts and `n`, merged deltas, metrics, and the
admission slot released exactly once. While a response is in progress a watcher listens for the client's
disconnect; when it comes, the run is cancelled, which aborts every choice on its worker at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import pydantic
from starlette.types import Receive, Scope, Send

from dynserve.config import Settings
from dynserve.engine.tokenizer import Tokenizer
from dynserve.errors import InvalidRequestError, WorkerUnavailableError
from dynserve.gateway.backend import WorkerSet
from dynserve.gateway.errors import ApiError, validation_error
from dynserve.gateway.metrics import GatewayMetrics
from dynserve.gateway.preprocess import Prepared, prepare_chat, prepare_completion
from dynserve.gateway.responses import DONE, ChoiceState, ResponseBuilder, sse
from dynserve.gateway.schemas import ChatCompletionRequest, CompletionRequest
from dynserve.protocol import GenerateRequest, TokenDelta

__all__ = ["COMPLETION_ROUTES", "CompletionRoutes", "GatewayState"]

logger = logging.getLogger(__name__)

Kind = Literal["chat", "completion"]
COMPLETION_ROUTES: dict[str, Kind] = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
_JSON = msgspec.json.Encoder()
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]
_JSON_HEADERS = [(b"content-type", b"application/json")]


@dataclass(slots=True)
class GatewayState:
    settings: Settings
    workers: WorkerSet
    tokenizer: Tokenizer
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    num_inflight: int = 0

    @property
    def model_id(self) -> str:
        return self.workers.model_id

    def check_api_key(self, authorization: str | None) -> None:
        key = self.settings.api_key
        if key is None:
            return
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise ApiError(401, "Incorrect API key provided." if authorization else "You didn't provide an API key.",
                           code="invalid_api_key")

    def check_model(self, model: str) -> None:
        if model != self.model_id:
            raise ApiError(404, f"The model `{model}` does not exist. This server serves `{self.model_id}`.",
                           param="model", code="model_not_found")

    def admit(self) -> None:
        if not self.workers.is_ready():
            self.metrics.rejected.labels("not_ready").inc()
            raise ApiError.unavailable("no worker is ready yet; retry shortly", retry_after_s=2)
        if self.num_inflight >= self.settings.max_queue:
            self.metrics.rejected.labels("queue_full").inc()
            raise ApiError(429, f"the server is at its limit of {self.settings.max_queue} requests in flight; "
                           "retry shortly", type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"})


class CompletionRoutes:
    """ASGI handler of the two completion routes (`COMPLETION_ROUTES`)."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = COMPLETION_ROUTES[scope["path"]]
        endpoint = scope["path"].removeprefix("/v1/")
        status = 500
        try:
            headers = dict(scope["headers"])
            self.state.check_api_key(_header(headers, b"authorization"))
            body = await _read_body(headers, receive, self.state.settings.max_body_bytes)
            run, stream = self._start(kind, body)
            status = 200
            if stream:
                await _until_disconnect(self._send_stream(run, send), receive)
            else:
                payload = await _until_disconnect(run.collect(), receive)
                if payload is not None:
                    await _send_whole(send, 200, payload, _JSON_HEADERS)
        except _ClientGone:
            status = 499  # nginx's "client closed request": nobody is left to answer
        except Exception as exc:  # every failure before the first byte becomes an OpenAI error response
            error = _as_api_error(exc)
            status = error.status
            await _send_whole(send, error.status, error.body(), _JSON_HEADERS + error.raw_headers())
        finally:
            self.state.metrics.requests.labels(endpoint, str(status)).inc()

    def _start(self, kind: Kind, body: bytes) -> tuple[_Run, bool]:
        state = self.state
        model_cls = ChatCompletionRequest if kind == "chat" else CompletionRequest
        try:
            request = model_cls.model_validate_json(body)
        except pydantic.ValidationError as exc:
            raise validation_error(exc.errors()) from None
        state.check_model(request.model)
        max_len = state.workers.max_model_len
        if isinstance(request, ChatCompletionRequest):
            prepared = prepare_chat(request, state.tokenizer, max_len)
        else:
            prepared = prepare_completion(request, state.tokenizer, max_len)
        state.admit()
        return _Run.create(state, kind, request, prepared), request.stream

    async def _send_stream(self, run: _Run, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        try:
            async with contextlib.aclosing(run.stream()) as chunks:
                async for chunk in chunks:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except Exception as exc:  # a bug after the headers went out: end the stream with an error event
            error = _as_api_error(exc)
            await send({"type": "http.response.body", "body": _error_event(error) + DONE, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class _ClientGone(Exception):
    """The client disconnected before its request was read."""


def _header(headers: dict[bytes, bytes], name: bytes) -> str | None:
    value = headers.get(name)
    return value.decode("latin-1") if value is not None else None


async def _read_body(headers: dict[bytes, bytes], receive: Receive, max_body_bytes: int) -> bytes:
    too_large = ApiError(413, f"the request body is over the {max_body_bytes}-byte limit", code="request_too_large")
    length = headers.get(b"content-length")
    if length is not None and length.isdigit() and int(length) > max_body_bytes:
        raise too_large
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_body_bytes:
            raise too_large
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


async def _until_disconnect(work: Awaitable[Any], receive: Receive) -> Any:
    """Run `work`; if the client disconnects first, cancel it (aborting its requests) and return None."""
    task = asyncio.ensure_future(work)

    async def client_gone() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(client_gone())
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return None
    return task.result()


async def _send_whole(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _as_api_error(exc: Exception) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return ApiError.from_invalid(exc)
    if isinstance(exc, WorkerUnavailableError):
        return ApiError.unavailable(str(exc))
    logger.error("unhandled error in a completion request", exc_info=exc)
    return ApiError(500, "internal server error", type="server_error")


class _Run:
    """One HTTP request's choices in flight: fan-out, metrics, and the release of the admission slot."""

    @classmethod
    def create(cls, state: GatewayState, kind: Kind, body: ChatCompletionRequest | CompletionRequest,
               prepared: Prepared) -> _Run:
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        response_id = f"{prefix}-{secrets.token_hex(12)}"
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        builder = ResponseBuilder(kind, response_id, body.model, state.tokenizer, include_usage=include_usage,
                                  num_prompts=len(prepared.prompts))
        requests = [GenerateRequest(request_id=f"{response_id}-{p * prepared.n + i}", token_ids=prompt,
                                    params=params)
                    for p, prompt in enumerate(prepared.prompts) for i, params in enumerate(prepared.params)]
        state.num_inflight += 1
        state.metrics.inflight.inc()
        return cls(state, kind, requests, builder)

    def __init__(self, state: GatewayState, kind: Kind, requests: list[GenerateRequest],
                 builder: ResponseBuilder) -> None:
        self.state, self.kind, self.requests, self.builder = state, kind, requests, builder
        self.endpoint = "chat/completions" if kind == "chat" else "completions"
        self.choices = [ChoiceState(i) for i in range(len(requests))]
        self.start_s = time.perf_counter()
        self.first_token_s: float | None = None
        self.last_token_s: list[float | None] = [None] * len(requests)
        self._released = False

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        self.state.num_inflight -= 1
        self.state.metrics.inflight.dec()
        m = self.state.metrics
        if all(c.finish_reason is not None for c in self.choices):
            m.e2e.labels(self.endpoint).observe(time.perf_counter() - self.start_s)
        firsts = self.builder.first_per_prompt(self.choices)
        m.prompt_tokens.inc(sum(c.num_prompt_tokens for c in firsts))
        m.cached_tokens.inc(sum(c.num_cached_tokens for c in firsts))

    def _observe(self, index: int, delta: TokenDelta) -> None:
        now = time.perf_counter()
        num_tokens = len(delta.token_ids)
        if self.first_token_s is None:
            self.first_token_s = now
            self.state.metrics.ttft.labels(self.endpoint).observe(now - self.start_s)
        previous = self.last_token_s[index]
        if previous is not None and num_tokens:
            gap_s = (now - previous) / num_tokens
            for _ in range(num_tokens):
                self.state.metrics.itl.labels(self.endpoint).observe(gap_s)
        self.last_token_s[index] = now
        self.state.metrics.generated_tokens.inc(num_tokens)
        self.choices[index].absorb(delta)

    async def _deltas(self) -> AsyncIterator[tuple[int, TokenDelta]]:
        workers = self.state.workers
        if len(self.requests) == 1:
            async with contextlib.aclosing(workers.generate(self.requests[0])) as stream:
                async for delta in stream:
                    yield 0, delta
            return
        queue: asyncio.Queue[tuple[int, TokenDelta | BaseException | None]] = asyncio.Queue()

        async def pump(index: int, request: GenerateRequest) -> None:
            try:
                async with contextlib.aclosing(workers.generate(request)) as stream:
                    async for delta in stream:
                        queue.put_nowait((index, delta))
                queue.put_nowait((index, None))
            except Exception as exc:  # delivered to the consumer, which raises it
                queue.put_nowait((index, exc))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(self.requests)]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def stream(self) -> AsyncIterator[bytes]:
        """SSE bytes, one piece per merged delta (its chunks written together); the last delta, the usage
        chunk and `[DONE]` go out as one piece, so a short answer costs the fewest socket writes."""
        builder = self.builder
        tail = b""
        try:
            if self.kind == "chat":
                yield b"".join(builder.role_chunk(i) for i in range(len(self.requests)))
            async with contextlib.aclosing(self._deltas()) as deltas:
                async for index, delta in deltas:
                    self._observe(index, delta)
                    piece = b"".join(builder.delta_chunks(self.choices[index], delta))
                    if all(c.finish_reason is not None for c in self.choices):
                        tail = piece
                    elif piece:
                        yield piece
            if builder.include_usage:
                tail += builder.usage_chunk(self.choices)
        except InvalidRequestError as exc:
            tail += _error_event(ApiError.from_invalid(exc))
        except WorkerUnavailableError as exc:
            tail += _error_event(ApiError.unavailable(str(exc)))
        finally:
            self._release()
        yield tail + DONE

    async def collect(self) -> bytes:
        """The whole response body; raises InvalidRequestError / WorkerUnavailableError."""
        try:
            async with contextlib.aclosing(self._deltas()) as deltas:
                async for index, delta in deltas:
                    self._observe(index, delta)
        finally:
            self._release()
        return _JSON.encode(self.builder.full_response(self.choices))


def _error_event(error: ApiError) -> bytes:
    return sse({"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}})
