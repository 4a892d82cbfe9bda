"""The completion routes (`POST /v1/chat/completions`, `POST /v1/completions`), served straight from the
gateway's HTTP server (`http.py`) with no framework in between.

These two routes carry all the traffic, so they skip the web framework's per-request machinery: the body
(already read, size-capped, by the server) is validated by the pydantic schemas in one
`model_validate_json` call, preprocessed, admitted, and answered with whole writes. Everything else (models,
health, metrics, OpenAPI) stays on FastAPI.

A request's choices run as one `_Run`: fan-out over prompts and `n`, merged deltas, metrics, and the
admission slot released exactly once. When the client disconnects, the server cancels the handler, which
closes the run and so aborts every choice on its worker at once. A run that reaches its generation cap
(`Settings.max_generation_s`, or less when the request's `max_generation_s` asks) is closed the same way,
and its unfinished choices end with finish_reason "length": the answer so far stands, truncated by a limit
as by `max_tokens`, and the workers free its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Literal

import msgspec
import pydantic

from dynserve.errors import InvalidRequestError, WorkerUnavailableError
from dynserve.gateway.dispatcher import Backend
from dynserve.gateway.errors import ApiError, validation_error
from dynserve.gateway.http import Exchange
from dynserve.gateway.metrics import observe_many
from dynserve.gateway.preprocess import Prepared, prepare_chat, prepare_completion
from dynserve.gateway.responses import DONE, ChoiceState, ResponseBuilder, sse
from dynserve.gateway.schemas import ChatCompletionRequest, CompletionRequest
from dynserve.gateway.state import GatewayState, ServedModel
from dynserve.protocol import GenerateRequest, TokenDelta

__all__ = ["COMPLETION_ROUTES", "CompletionRoutes"]

logger = logging.getLogger(__name__)

Kind = Literal["chat", "completion"]
COMPLETION_ROUTES: dict[bytes, Kind] = {b"/v1/chat/completions": "chat", b"/v1/completions": "completion"}
_ENDPOINTS: dict[Kind, str] = {"chat": "chat/completions", "completion": "completions"}
_JSON = msgspec.json.Encoder()
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]
_JSON_HEADERS = [(b"content-type", b"application/json")]


class CompletionRoutes:
    """Handler of the two completion routes (`COMPLETION_ROUTES`) on the gateway's HTTP server."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state

    async def __call__(self, exchange: Exchange) -> None:
        kind = COMPLETION_ROUTES[exchange.path]
        endpoint = _ENDPOINTS[kind]
        status = 500
        try:
            self.state.check_api_key(_header(exchange.headers, b"authorization"))
            if self.state.settings.worker_wait_s > 0:
                _request, served = self._validate(kind, exchange.body)  # bad input is answered at once
                if not served.is_ready():
                    await self.state.wait_for_worker(served)
            run, stream = self._start(kind, exchange.body)
            status = 200
            if stream:
                await self._send_stream(run, exchange)
            else:
                exchange.respond(200, await run.collect(), _JSON_HEADERS)
        except asyncio.CancelledError:
            if not exchange.gone.done():
                raise
            status = 499  # nginx's "client closed request": the run was cancelled, its requests aborted
        except Exception as exc:  # every failure before the first byte becomes an OpenAI error response
            error = _as_api_error(exc)
            status = error.status
            exchange.respond(error.status, error.body(), _JSON_HEADERS + error.raw_headers())
        finally:
            metrics = self.state.metrics
            metrics.child(metrics.requests, endpoint, str(status)).inc()

    def _validate(self, kind: Kind, body: bytes) -> tuple[ChatCompletionRequest | CompletionRequest, ServedModel]:
        model_cls = ChatCompletionRequest if kind == "chat" else CompletionRequest
        try:
            request = model_cls.model_validate_json(body)
        except pydantic.ValidationError as exc:
            raise validation_error(exc.errors()) from None
        return request, self.state.model(request.model)

    def _start(self, kind: Kind, body: bytes) -> tuple[_Run, bool]:
        state = self.state
        request, served = self._validate(kind, body)
        max_len = served.backend.max_model_len
        if isinstance(request, ChatCompletionRequest):
            prepared = prepare_chat(request, served.tokenizer, max_len, served.tool_format)
        else:
            prepared = prepare_completion(request, served.tokenizer, max_len)
        state.admit(served)
        if state.admission is not None and not state.admission.try_admit():
            state.metrics.rejected.labels("overloaded").inc()
            raise ApiError(429, "the server is at capacity for its time-to-first-token target; retry shortly",
                           type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"})
        return _Run.create(state, served, kind, request, prepared), request.stream

    async def _send_stream(self, run: _Run, exchange: Exchange) -> None:
        """The head goes out with the first piece, and the stream's end with the last (the one ending in
        `[DONE]`), so a short answer takes one or two socket writes."""
        try:
            async with contextlib.aclosing(run.stream()) as pieces:
                async for piece in pieces:
                    last = piece.endswith(DONE)
                    if not exchange.answered:
                        if last:
                            exchange.start_stream(200, _SSE_HEADERS)
                        else:
                            exchange.start_stream(200, _SSE_HEADERS, piece)
                            continue
                    if last:
                        exchange.end(piece)
                        return
                    exchange.write(piece)
                    await exchange.drain()
        except Exception as exc:  # a bug after the head went out: end the stream with an error event
            if not exchange.answered:
                raise
            exchange.end(_error_event(_as_api_error(exc)) + DONE)


def _header(headers: dict[bytes, bytes], name: bytes) -> str | None:
    value = headers.get(name)
    return value.decode("latin-1") if value is not None else None


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
    def create(cls, state: GatewayState, served: ServedModel, kind: Kind,
               body: ChatCompletionRequest | CompletionRequest, prepared: Prepared) -> _Run:
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        response_id = f"{prefix}-{secrets.token_hex(12)}"
        options = body.stream_options
        builder = ResponseBuilder(kind, response_id, body.model, served.tokenizer,
                                  include_usage=bool(options and options.include_usage),
                                  continuous_usage=bool(options and options.continuous_usage_stats),
                                  num_prompts=len(prepared.prompts))
        requests = [GenerateRequest(request_id=f"{response_id}-{p * prepared.n + i}", token_ids=prompt,
                                    params=params)
                    for p, prompt in enumerate(prepared.prompts) for i, params in enumerate(prepared.params)]
        state.num_inflight += 1
        state.metrics.inflight.inc()
        state.metrics.child(state.metrics.admitted, _ENDPOINTS[kind], served.model_id).inc()
        state.admitted_by_model[served.model_id] = state.admitted_by_model.get(served.model_id, 0) + 1
        limit_s = state.settings.max_generation_s
        if body.max_generation_s is not None:
            limit_s = min(limit_s, body.max_generation_s)
        run = cls(state, served.backend, served.model_id, kind, requests, builder, limit_s)
        if prepared.tools is not None:
            for choice in run.choices:
                choice.tool_calls = prepared.tool_call_parser()
        return run

    def __init__(self, state: GatewayState, backend: Backend, model_id: str, kind: Kind,
                 requests: list[GenerateRequest], builder: ResponseBuilder, limit_s: float) -> None:
        self.state, self.kind, self.requests, self.builder = state, kind, requests, builder
        self.backend = backend  # the model's
        self.deadline_s = asyncio.get_running_loop().time() + limit_s
        self.expired = False  # the generation cap was reached
        self._waiting: asyncio.Task[object] | None = None  # the task awaiting the workers' next delta
        self.endpoint = _ENDPOINTS[kind]
        self.series = state.metrics.endpoint(self.endpoint, model_id)
        self.choices = [ChoiceState(i) for i in range(len(requests))]
        self.start_s = time.perf_counter()
        self.first_token_s: float | None = None
        self.last_token_s: list[float | None] = [None] * len(requests)
        self._released = False
        self._admitted = state.admission is not None  # holds an admission slot until its first token

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        if self._admitted and self.state.admission is not None:
            self._admitted = False
            self.state.admission.abandon()
        self.state.num_inflight -= 1
        self.state.metrics.inflight.dec()
        firsts = self.builder.first_per_prompt(self.choices)
        if all(c.finish_reason is not None for c in self.choices):
            series = self.series
            series.e2e.observe(time.perf_counter() - self.start_s)
            for choice in firsts:  # ISL once per prompt, OSL once per sequence generated
                series.prompt_tokens.observe(choice.num_prompt_tokens)
            for choice in self.choices:
                series.generation_tokens.observe(choice.num_output_tokens)
        self.series.cached_tokens.inc(sum(c.num_cached_tokens for c in firsts))

    def _observe(self, index: int, delta: TokenDelta) -> None:
        now = time.perf_counter()
        num_tokens = len(delta.token_ids)
        if self.first_token_s is None:
            self.first_token_s = now
            self.series.ttft.observe(now - self.start_s)
            if self._admitted and self.state.admission is not None:
                self._admitted = False
                self.state.admission.first_token(now - self.start_s)
        previous = self.last_token_s[index]
        if previous is not None and num_tokens:
            observe_many(self.series.itl, (now - previous) / num_tokens, num_tokens)
        self.last_token_s[index] = now
        self.series.generated_tokens.inc(num_tokens)
        self.choices[index].absorb(delta)

    async def _deltas(self) -> AsyncIterator[tuple[int, TokenDelta]]:
        """The workers' deltas until every choice ends or the generation cap is reached; at the cap, the
        workers' streams are closed (aborting the requests) and each unfinished choice gets a last delta
        with finish_reason "length". Only a wait for the workers is interrupted at the cap, never the
        consumer's own awaits between two deltas (it sees the cap at its next delta)."""
        loop = asyncio.get_running_loop()
        timer = loop.call_at(self.deadline_s, self._expire)
        try:
            async with contextlib.aclosing(self._worker_deltas()) as deltas:
                while not self.expired:
                    self._waiting = asyncio.current_task()
                    try:
                        item = await anext(deltas)
                    except StopAsyncIteration:
                        return
                    except asyncio.CancelledError:
                        task = asyncio.current_task()
                        if not self.expired or task is None or task.uncancel() > 0:
                            raise  # not (only) the cap: the client left
                    finally:
                        self._waiting = None
                    if not self.expired:
                        yield item
        finally:
            timer.cancel()
        logger.info("request %s: the generation cap was reached; its choices end with finish_reason length",
                    self.requests[0].request_id.rpartition("-")[0])
        for index, choice in enumerate(self.choices):
            if choice.finish_reason is None:
                yield index, TokenDelta(
                    request_id=self.requests[index].request_id, token_ids=[], finished=True, finish_reason="length",
                    num_prompt_tokens=choice.num_prompt_tokens or len(self.requests[index].token_ids),
                    num_cached_tokens=choice.num_cached_tokens, num_output_tokens=choice.num_output_tokens)

    def _expire(self) -> None:
        self.expired = True
        if self._waiting is not None:
            self._waiting.cancel()

    async def _worker_deltas(self) -> AsyncIterator[tuple[int, TokenDelta]]:
        backend = self.backend
        if len(self.requests) == 1:
            async with contextlib.aclosing(backend.generate(self.requests[0])) as stream:
                async for delta in stream:
                    yield 0, delta
            return
        queue: asyncio.Queue[tuple[int, TokenDelta | BaseException | None]] = asyncio.Queue()

        async def pump(index: int, request: GenerateRequest) -> None:
            try:
                async with contextlib.aclosing(backend.generate(request)) as stream:
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
        """SSE bytes, one piece per merged delta (its chunks written together). A chat's role chunks go out
        with the first delta, not before the request reaches its worker, and the last delta, the usage chunk
        and `[DONE]` go out as one piece, so a short answer costs the fewest socket writes (each is a
        syscall here and a wake-up of the client)."""
        builder = self.builder
        # a chat stream opens with each choice's role chunk
        head = b"".join(map(builder.role_chunk, range(len(self.choices)))) if self.kind == "chat" else b""
        tail = b""
        try:
            async with contextlib.aclosing(self._deltas()) as deltas:
                async for index, delta in deltas:
                    self._observe(index, delta)
                    usage = builder.usage(self.choices) if builder.continuous_usage else None
                    piece = b"".join(builder.delta_chunks(self.choices[index], delta, usage))
                    if all(c.finish_reason is not None for c in self.choices):
                        tail = head + piece
                        head = b""
                    elif piece:
                        yield head + piece
                        head = b""
            if builder.include_usage:
                tail += builder.usage_chunk(self.choices)
        except InvalidRequestError as exc:
            tail += _error_event(ApiError.from_invalid(exc))
        except WorkerUnavailableError as exc:
            tail += _error_event(ApiError.unavailable(str(exc)))
        finally:
            self._release()
        yield head + tail + DONE

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
