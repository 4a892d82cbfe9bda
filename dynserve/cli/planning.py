"""`dynctl serve --planner`: the planner wired into a running fleet. Builds the core from `Settings`
(targets, bounds, budget, idle time, predictor, capacity profile), reads the fleet's Prometheus, scales the
`WorkerPool`s, exports `dynserve_planner_*` on the gateway's `/metrics`, wakes up when the gateway holds a
request for a fleet at zero, and serves the manual override on the gateway:

    GET    /planner                  the pools' targets, serving workers, overrides, the last decision
    PUT    /planner/pools/{pool}     {"workers": N}: hold the pool at N until released
    DELETE /planner/pools/{pool}     release the override

(behind the API key when one is set). Serving several models, each has its own planner (its pools, read from
its own series by their `model` label) and all share `--planner-max-total-workers`: `GET /planner` gives the
default model's at the top and every model's under `models`; the override routes take `?model=ID`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from pathlib import Path
from typing import Any

from fastapi import Request

from dynserve.cli.top import finite_or_none
from dynserve.config import Settings
from dynserve.errors import InvalidRequestError
from dynserve.gateway.errors import ApiError
from dynserve.observability.promql import PrometheusClient
from dynserve.planner.core import PlannerConfig, PlannerCore, SharedBudget
from dynserve.planner.live import (ArrivalRate, FleetPlannerMetrics, PlannerLoop, PlannerMetrics, PoolActuator,
                                   PrometheusReader)

__all__ = ["ModelPlanner", "Planning", "planner_config", "planner_settings"]

logger = logging.getLogger(__name__)


def planner_settings(settings: Settings) -> Settings:
    """`settings` as `--planner` needs them: a Prometheus (its own unless --prometheus-url), and requests
    held for a worker (120 s unless --worker-wait-s) so a scale from zero answers instead of refusing."""
    if not settings.planner:
        return settings
    update: dict[str, Any] = {}
    if settings.prometheus_url is None:
        update["prometheus"] = True
    if "worker_wait_s" not in settings.model_fields_set:
        update["worker_wait_s"] = 120.0
    return settings.model_copy(update=update)


def planner_config(settings: Settings) -> PlannerConfig:
    return PlannerConfig(
        mode=settings.planner_mode, ttft_target_s=settings.planner_ttft_ms / 1000,
        itl_target_s=settings.planner_itl_ms / 1000, interval_s=settings.planner_interval_s,
        min_workers={"both": settings.planner_min_workers, "prefill": settings.planner_min_prefill_workers,
                     "decode": settings.planner_min_decode_workers},
        max_workers={"both": settings.planner_max_workers, "prefill": settings.planner_max_prefill_workers,
                     "decode": settings.planner_max_decode_workers},
        max_total_workers=settings.planner_max_total_workers, idle_s=settings.planner_idle_s,
        predictor=settings.planner_predictor, read_window_s=settings.planner_window_s,
        start_s=settings.planner_start_s, down_delay_s=settings.planner_down_delay_s,
        rise_spare_workers=settings.planner_rise_spare_workers)


def _profile(settings: Settings) -> Any:
    if settings.planner_mode != "sla":
        return None
    from dynserve.planner import profile

    name = settings.planner_profile or settings.mocker or "cpu"
    loaded = profile.load(Path(name)) if Path(name).is_file() else profile.shipped(name)
    if settings.mocker is not None and settings.mocker_speedup != 1:
        return sped_up(loaded, settings.mocker_speedup)
    return loaded


def sped_up(capacity: Any, speedup: float) -> Any:
    """`capacity` (a `CapacityProfile` of the hardware a mocker profile models) for mockers running
    `speedup` times faster than that hardware: every time divided by it, every rate multiplied."""
    import msgspec

    prefill = tuple(msgspec.structs.replace(p, ttft_s=p.ttft_s / speedup, tokens_per_s=p.tokens_per_s * speedup)
                    for p in capacity.prefill)
    decode = tuple(msgspec.structs.replace(d, itl_s=d.itl_s / speedup) for d in capacity.decode)
    return msgspec.structs.replace(capacity, prefill=prefill, decode=decode,
                                   source=f"{capacity.source}; time scaled by 1/{speedup:g} (mocker speedup)")


def _kubernetes_actuator(where: str, core: PlannerCore, serving: Any) -> Any:
    """The actuator of the DynServeDeployment `NAMESPACE/NAME`, through the pod's service account."""
    from dynserve.operator.kube import KubeClient
    from dynserve.planner.kubernetes import KubernetesActuator, planner_pools

    namespace, _, name = where.partition("/")
    if not namespace or not name:
        raise InvalidRequestError(f"--planner-kubernetes must be NAMESPACE/NAME, not {where!r}",
                                  param="planner_kubernetes")

    def hand_set(pool: str, replicas: int) -> None:
        held = min(replicas, core.config.max_of(pool))
        if held != replicas:
            logger.warning("planner: pool %s set to %d by hand, over its max %d: holding it at %d", pool, replicas,
                           held, held)
        core.override(pool, held)

    return KubernetesActuator(KubeClient.connect(), namespace, planner_pools(name, core.pools),
                              on_hand_set=hand_set, serving=serving)


@dataclasses.dataclass(slots=True)
class ModelPlanner:
    """One model's planner: its core, the actuator of its pools, its series, and its loop once started."""

    model_id: str
    core: PlannerCore
    actuator: Any
    metrics: PlannerMetrics
    loop: PlannerLoop | None = None
    task: asyncio.Task[None] | None = None

    def state(self, mode: str) -> dict[str, Any]:
        decision = self.loop.decisions[-1] if self.loop is not None and self.loop.decisions else None
        return {
            "mode": mode, "pools": list(self.core.pools),
            "targets": self.actuator.current(), "serving": self.actuator.serving(),
            "overrides": self.core.overrides,
            "last_decision": None if decision is None else finite_or_none(dataclasses.asdict(decision)),
        }


class Planning:
    """The planners of one `dynctl serve`, one per model (`pools`: model id -> pool name -> pool, the default
    model first), sharing `--planner-max-total-workers` when there are several; `start(prometheus_url)` once
    Prometheus is up, `stop()` on the way out."""

    def __init__(self, settings: Settings, pools: dict[str, dict[str, Any]], app: Any) -> None:
        self.settings = settings
        config = planner_config(settings)
        budget = None
        if len(pools) > 1 and config.max_total_workers is not None:  # one budget across the models' planners
            budget = SharedBudget(config.max_total_workers)
            config = dataclasses.replace(config, max_total_workers=None)
        profile = _profile(settings)
        self.models: dict[str, ModelPlanner] = {}
        for model_id, model_pools in pools.items():
            core = PlannerCore(config, tuple(model_pools), profile, budget=budget, member=model_id)
            actuator: Any = PoolActuator(model_pools)
            if settings.planner_kubernetes:  # the operator's fleet: pools follow pods; the planner scales the pods
                actuator = _kubernetes_actuator(settings.planner_kubernetes, core, actuator.serving)
            self.models[model_id] = ModelPlanner(model_id, core, actuator,
                                                 PlannerMetrics(core, actuator.serving, model=model_id))
        self.default = next(iter(self.models.values()))
        self.budget = budget
        if budget is not None:  # until a model's first decision, the workers its pools start with are its share
            for planner in self.models.values():
                budget.record(planner.model_id, sum(planner.actuator.current().values()), squeezed=False)
        self._client: PrometheusClient | None = None
        self._gateway = app.state
        app.state.metrics.registry.register(FleetPlannerMetrics([p.metrics for p in self.models.values()]))
        app.state.on_waiting_for_worker = self.wake
        self._add_routes(app)

    def start(self, prometheus_url: str) -> None:
        self._client = PrometheusClient(prometheus_url)
        statistic = "mean" if self.settings.planner_mode == "sla" else "0.9"
        several = len(self.models) > 1
        for planner in self.models.values():
            reader = PrometheusReader(self._client, planner.core.pools, window_s=self.settings.planner_window_s,
                                      statistic=statistic, model=planner.model_id if several else None)
            model_id = planner.model_id
            planner.loop = PlannerLoop(
                planner.core, reader, planner.actuator, metrics=planner.metrics, serving=planner.actuator.serving,
                waiting_for_worker=lambda m=model_id: self._gateway.waiting_for_worker_by_model.get(m, 0),
                arrivals=ArrivalRate(lambda m=model_id: self._gateway.admitted_by_model.get(m, 0),
                                     self.settings.planner_window_s))
            planner.task = asyncio.get_running_loop().create_task(planner.loop.run(),
                                                                  name=f"planner-{planner.model_id}")
        budget = "" if self.budget is None else f", sharing a budget of {self.budget.total} workers"
        logger.info("planner: %s mode, %s, every %g s%s", self.settings.planner_mode,
                    "; ".join(f"{p.model_id}: pools {', '.join(p.core.pools)}" for p in self.models.values()),
                    self.settings.planner_interval_s, budget)

    def wake(self, model_id: str | None = None) -> None:
        """Decide now for `model_id` (default: every model): a request waits for one of its workers."""
        for planner in self.models.values():
            if planner.loop is not None and model_id in (None, planner.model_id):
                planner.loop.wake()

    async def stop(self) -> None:
        for planner in self.models.values():
            if planner.task is not None:
                planner.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await planner.task
        if self._client is not None:
            self._client.close()

    def state(self) -> dict[str, Any]:
        """The default model's planner (its keys at the top), and every model's under `models`."""
        mode = self.settings.planner_mode
        return {**self.default.state(mode), "models": {m: p.state(mode) for m, p in self.models.items()},
                "budget": None if self.budget is None else {"total": self.budget.total,
                                                            "decided": self.budget.decided()}}

    def _add_routes(self, app: Any) -> None:
        api, gateway_state = app.api, app.state

        def check(request: Request, pool: str | None = None) -> ModelPlanner:
            gateway_state.check_api_key(request.headers.get("authorization"))
            model = request.query_params.get("model")
            planner = self.default if model is None else self.models.get(model)
            if planner is None:
                raise ApiError(404, f"no planner for model {model!r}; models: {', '.join(self.models)}",
                               param="model")
            if pool is not None and pool not in planner.core.pools:
                raise ApiError(404, f"no pool {pool!r}; pools: {', '.join(planner.core.pools)}", param="pool")
            return planner

        async def get_state(request: Request) -> dict[str, Any]:
            check(request)
            return self.state()

        async def put_override(pool: str, request: Request) -> dict[str, Any]:
            planner = check(request, pool)
            try:
                body = await request.json()
            except ValueError:
                body = None
            workers = body.get("workers") if isinstance(body, dict) else None
            if not isinstance(workers, int) or isinstance(workers, bool):
                raise ApiError(400, 'the body must be {"workers": N}', param="workers")
            try:
                planner.core.override(pool, workers)
            except ValueError as exc:
                raise ApiError.from_invalid(InvalidRequestError(str(exc), param="workers")) from None
            self.wake(planner.model_id)
            return self.state()

        async def delete_override(pool: str, request: Request) -> dict[str, Any]:
            planner = check(request, pool)
            planner.core.release(pool)
            self.wake(planner.model_id)
            return self.state()

        api.add_api_route("/planner", get_state, methods=["GET"], tags=["planner"],
                          summary="the planners' pools, overrides and last decisions (every model's)")
        api.add_api_route("/planner/pools/{pool}", put_override, methods=["PUT"], tags=["planner"],
                          summary='hold a pool at {"workers": N} until released (?model=ID: not the default '
                          "model's)")
        api.add_api_route("/planner/pools/{pool}", delete_override, methods=["DELETE"], tags=["planner"],
                          summary="release a pool's override (?model=ID: not the default model's)")
