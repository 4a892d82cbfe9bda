"""The bridge from the gateway's own HTTP server to an ASGI app (FastAPI: every route but the completions)."""

from __future__ import annotations

from typing import Any

from dynserve.gateway.http import Exchange

__all__ = ["AsgiHandler"]


class AsgiHandler:
    """Answers an `Exchange` with an ASGI app (FastAPI here): one `http.request` message carrying the whole
    body, then `http.disconnect` when the client goes; the response is streamed chunked unless the app set a
    content-length."""

    def __init__(self, app: Any, server_address: tuple[str, int]) -> None:
        self.app, self.server_address = app, server_address

    async def __call__(self, exchange: Exchange) -> None:
        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": exchange.method.decode(), "scheme": "http", "path": exchange.path.decode("utf-8", "replace"),
            "raw_path": exchange.path, "query_string": exchange.query, "root_path": "",
            "headers": list(exchange.headers.items()), "client": None, "server": self.server_address,
            "state": {},
        }
        delivered = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": exchange.body, "more_body": False}
            await exchange.gone
            return {"type": "http.disconnect"}

        start: dict[str, Any] = {}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
                return
            if message["type"] != "http.response.body":
                return
            body, more = message.get("body", b""), message.get("more_body", False)
            if not exchange.answered:
                headers = [(bytes(k).lower(), bytes(v)) for k, v in start.get("headers", [])]
                headers = [(k, v) for k, v in headers if k != b"content-length"]
                if not more:
                    exchange.respond(start["status"], body, headers)
                    return
                exchange.start_stream(start["status"], headers, body)
            else:
                exchange.write(body)
            if more:
                await exchange.drain()
            else:
                exchange.end()

        await self.app(scope, receive, send)
