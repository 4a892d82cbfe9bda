"""What every route of one gateway shares: `GatewayState` (settings, the models it serves, metrics, the
admission count), with the checks made before a request runs (API key, model, readiness, queue).

A gateway serves one model or several. Each is a `ServedModel`: the names clients ask for it by, its
tokenizer and tool-call format, and its own backend (pools, router and KV index over the workers that serve
that model), so routing, cache hits and load never cross models. The first model is the default one (the
ops routes and the planner's wake-up speak of it).
"""

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

__all__ = ["GatewayState", "ServedModel"]


@dataclass(slots=True)
class ServedModel:
    """One model: its id (what its workers announce), its tokenizer, its backend; `tool_format` is set by the
    gateway's `Settings.tool_call_parser` when none is given."""

    model_id: str
    backend: Backend
    tokenizer: Tokenizer
    tool_format: ToolFormat | None = None

    def is_ready(self) -> bool:
        return self.backend.is_ready()


@dataclass(slots=True)
class GatewayState:
    settings: Settings
    backend: Backend  # the default model's
    tokenizer: Tokenizer  # the default model's
    more_models: list[ServedModel] = field(default_factory=list)
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    num_inflight: int = 0
    # called with the model's id when a request starts waiting for a worker of it (`Settings.worker_wait_s`):
    # a planner's wake-up
    on_waiting_for_worker: Callable[[str], None] | None = None
    waiting_for_worker_by_model: dict[str, int] = field(default_factory=dict)
    # requests admitted per model since the start: a planner's arrival count, fresher than a scraped rate
    admitted_by_model: dict[str, int] = field(default_factory=dict)
    admission: Admission | None = None  # with Settings.admission_ttft_ms: the TTFT-keeping admission limit
    models: dict[str, ServedModel] = field(init=False)  # by id, the default first
    names: dict[str, ServedModel] = field(init=False)  # by every name a client may send: ids and aliases

    def __post_init__(self) -> None:
        self.models, self.names = {}, {}
        for served in [ServedModel(self.backend.model_id, self.backend, self.tokenizer), *self.more_models]:
            self.add_model(served)

    def aliases(self, model_id: str) -> list[str]:
        """The other names `Settings.served_model_names` gives a model: `NAME` the default one, `NAME=ID` any."""
        out = []
        for entry in self.settings.served_model_names:
            name, _, target = entry.partition("=")
            if (target or self.backend.model_id) == model_id:
                out.append(name)
        return out

    def add_model(self, served: ServedModel) -> None:
        """Serve one more model from now on, under its id and aliases (its backend's observer: the metrics)."""
        names = [served.model_id, *self.aliases(served.model_id)]
        taken = [name for name in names if name in self.names]
        if taken:
            raise ValueError(f"the name {taken[0]!r} is given to two models")
        if served.tool_format is None:
            served.tool_format = select_tool_format(served.tokenizer, self.settings.tool_call_parser)
        served.backend.add_observer(self.metrics)
        self.metrics.expect_model(served.model_id)
        self.models[served.model_id] = served
        self.names.update(dict.fromkeys(names, served))

    def remove_model(self, model_id: str) -> ServedModel:
        """Stop serving a model that is not the default one; its requests in flight finish on its backend."""
        if model_id == self.model_id:
            raise ValueError("the default model is always served")
        served = self.models.pop(model_id)
        for name in [name for name, other in self.names.items() if other is served]:
            del self.names[name]
        return served

    @property
    def model_id(self) -> str:
        return self.backend.model_id

    @property
    def tool_format(self) -> ToolFormat:
        """The default model's tool-call format."""
        return self.models[self.model_id].tool_format  # type: ignore[return-value]

    def model(self, name: str) -> ServedModel:
        """The model a request names; ApiError 404 `model_not_found` naming those served."""
        served = self.names.get(name)
        if served is None:
            names = ", ".join(f"`{n}`" for n in self.names)
            raise ApiError(404, f"The model `{name}` does not exist. This server serves {names}.",
                           param="model", code="model_not_found")
        return served

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
        self.model(model)

    async def wait_for_worker(self, served: ServedModel | None = None) -> None:
        """While no worker of `served` (default: the default model) is ready, hold for one up to
        `worker_wait_s` (a fleet scaling up from zero), so the request is served rather than refused; counted
        in `dynserve_gateway_waiting_for_worker_requests`."""
        backend = self.backend if served is None else served.backend
        wait_s = self.settings.worker_wait_s
        if wait_s <= 0 or backend.is_ready():
            return
        model_id = backend.model_id
        gauge = self.metrics.waiting_for_worker
        gauge.inc()
        self.waiting_for_worker_by_model[model_id] = self.waiting_for_worker_by_model.get(model_id, 0) + 1
        try:
            if self.on_waiting_for_worker is not None:
                self.on_waiting_for_worker(model_id)
            deadline_s = time.monotonic() + wait_s
            while not backend.is_ready() and time.monotonic() < deadline_s:
                await asyncio.sleep(0.05)
        finally:
            gauge.dec()
            self.waiting_for_worker_by_model[model_id] -= 1

    def admit(self, served: ServedModel | None = None) -> None:
        if not (self.backend if served is None else served.backend).is_ready():
            self.metrics.rejected.labels("not_ready").inc()
            raise ApiError.unavailable("no worker is ready yet; retry shortly", retry_after_s=2)
        if self.num_inflight >= self.settings.max_queue:
            self.metrics.rejected.labels("queue_full").inc()
            raise ApiError(429, f"the server is at its limit of {self.settings.max_queue} requests in flight; "
                           "retry shortly", type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"})
