"""What every route of one gateway shares: `GatewayState` (settings, backend, tokenizer, metrics, the
admission count), with the checks made before a request runs (API key, model, readiness, queue)."""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dynserve.config import Settings
from dynserve.gateway.admission import Admission
from dynserve.gateway.dispatcher import Backend
from dynserve.gateway.errors import ApiError
from dynserve.gateway.metrics import GatewayMetrics
from dynserve.gateway.tool_formats import ToolFormat, select_tool_format
from dynserve.model.tokenizer import Tokenizer

__all__ = ["GatewayState"]


@dataclass(slots=True)
class GatewayState:
    settings: Settings
    backend: Backend
    tokenizer: Tokenizer
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    num_inflight: int = 0
    # called when a request starts waiting for a worker (`Settings.worker_wait_s`): a planner's wake-up
    on_waiting_for_worker: Callable[[], None] | None = None
    num_waiting_for_worker: int = 0
    admission: Admission | None = None  # with Settings.admission_ttft_ms: the TTFT-keeping admission limit
    tool_format: ToolFormat = field(init=False)  # how the model writes tool calls (Settings.tool_call_parser)

    def __post_init__(self) -> None:
        self.tool_format = select_tool_format(self.tokenizer, self.settings.tool_call_parser)

    @property
    def model_id(self) -> str:
        return self.backend.model_id

    def check_api_key(self, authorization: str | None) -> None:
        """Raise ApiError 401 unless `authorization` is 'Bearer <api_key>' (compared in constant time) or no
        key is configured."""
        key = self.settings.secret("api_key")
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

    async def wait_for_worker(self) -> None:
        """While no worker is ready, hold for one up to `worker_wait_s` (a fleet scaling up from zero), so the
        request is served rather than refused; counted in `dynserve_gateway_waiting_for_worker_requests`."""
        wait_s = self.settings.worker_wait_s
        if wait_s <= 0 or self.backend.is_ready():
            return
        gauge = self.metrics.waiting_for_worker
        gauge.inc()
        self.num_waiting_for_worker += 1
        try:
            if self.on_waiting_for_worker is not None:
                self.on_waiting_for_worker()
            deadline_s = time.monotonic() + wait_s
            while not self.backend.is_ready() and time.monotonic() < deadline_s:
                await asyncio.sleep(0.05)
        finally:
            gauge.dec()
            self.num_waiting_for_worker -= 1

    def admit(self) -> None:
        if not self.backend.is_ready():
            self.metrics.rejected.labels("not_ready").inc()
            raise ApiError.unavailable("no worker is ready yet; retry shortly", retry_after_s=2)
        if self.num_inflight >= self.settings.max_queue:
            self.metrics.rejected.labels("queue_full").inc()
            raise ApiError(429, f"the server is at its limit of {self.settings.max_queue} requests in flight; "
                           "retry shortly", type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"})
