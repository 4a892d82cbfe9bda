"""Every error the gateway returns, in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

    400 invalid_request_error   a bad parameter (`param` names it), `context_length_exceeded`, bad JSON
    401 invalid_request_error   `invalid_api_key`: an API key is configured and missing or wrong
    404 invalid_request_error   `model_not_found`, or an unknown path
    413 invalid_request_error   `request_too_large`: the body is over the limit
    429 rate_limit_error        the request queue is full (with Retry-After)
    503 server_error            no worker is ready, or every worker failed the request (with Retry-After)

A malformed body is a 400, never a 500; a 500 means a bug in dynserve and is logged with its traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from dynserve.errors import InvalidRequestError, WorkerUnavailableError

__all__ = ["ApiError", "error_body", "install_error_handlers", "validation_error"]

logger = logging.getLogger(__name__)
_JSON = msgspec.json.Encoder()


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    @classmethod
    def from_invalid(cls, exc: InvalidRequestError) -> ApiError:
        return cls(400, str(exc), param=exc.param, code=exc.code)

    @classmethod
    def unavailable(cls, message: str, retry_after_s: int = 1) -> ApiError:
        return cls(503, message, type="server_error", code="service_unavailable",
                   headers={"Retry-After": str(retry_after_s)})

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.param, self.code)

    def raw_headers(self) -> list[tuple[bytes, bytes]]:
        return [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in self.headers.items()]

    def response(self) -> Response:
        return Response(self.body(), status_code=self.status, media_type="application/json", headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> bytes:
    return _JSON.encode({"error": {"message": message, "type": type, "param": param, "code": code}})


def _param_from_loc(loc: tuple[Any, ...]) -> str | None:
    parts = [p for p in loc if p != "body"]
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif str(part).startswith(("str", "list[", "function-", "constrained-")) or part in ("int", "float"):
            continue  # pydantic's union-member labels are not part of the user's parameter
        else:
            out += f".{part}" if out else str(part)
    return out or None


def validation_error(errors: Sequence[Any]) -> ApiError:
    """The 400 for pydantic/FastAPI validation errors: the first error, its location as an OpenAI `param`."""
    if not errors:
        return ApiError(400, "the request body is invalid")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return ApiError(400, f"We could not parse the JSON body of your request: {first.get('msg')}")
    if first.get("type") == "missing" and tuple(first.get("loc", ())) == ("body",):
        return ApiError(400, "the request needs a JSON body")
    param = _param_from_loc(tuple(first.get("loc", ())))
    if first.get("type") == "extra_forbidden":
        return ApiError(400, f"Unrecognized request argument supplied: {param}", param=param)
    if first.get("type") in ("model_attributes_type", "model_type") and not _param_from_loc(tuple(first["loc"])):
        return ApiError(400, "the request body must be a JSON object")
    return ApiError(400, f"{param}: {first.get('msg')}" if param else str(first.get("msg")), param=param)


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return exc.response()

    async def on_validation(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return validation_error(exc.errors()).response()

    async def on_invalid(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, InvalidRequestError)
        return ApiError.from_invalid(exc).response()

    async def on_unavailable(_request: Request, exc: Exception) -> Response:
        return ApiError.unavailable(str(exc)).response()

    async def on_http(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        kind = {404: "not_found", 413: "request_too_large"}.get(exc.status_code)
        return ApiError(exc.status_code, str(exc.detail), code=kind).response()

    async def on_bug(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return ApiError(500, "internal server error", type="server_error").response()

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(InvalidRequestError, on_invalid)
    app.add_exception_handler(WorkerUnavailableError, on_unavailable)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_bug)
