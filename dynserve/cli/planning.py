"""`dynctl serve --planner`: the planner wired into a running fleet. Builds the core from `Settings`
(targets, bounds, budget, idle time, predictor, capacity profile), reads the fleet's Prometheus, scales the
`WorkerPool`s, exports `dynserve_planner_*` on the gateway's `/metrics`, wakes up when the gateway holds a
request for a fleet at zero, and serves the manual override on the gateway:

    GET    /planner                  the pools' targets, serving workers, overrides, the last decision
    PUT    /planner/pools/{pool}     {"workers": N}: hold the pool at N until released
    DELETE /planner/pools/{pool}     release the override

(behind the API key when one is set).
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
from dynserve.planner.core import PlannerConfig, PlannerCore
from dynserve.planner.live import PlannerLoop, PlannerMetrics, PoolActuator, PrometheusReader

__all__ = ["Planning", "planner_config", "planner_settings"]

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
        predictor=settings.planner_predictor)


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


class Planning:
    """The planner of one `dynctl serve`: `start(prometheus_url)` once Prometheus is up, `stop()` on the way
    out."""

    def __init__(self, settings: Settings, pools: dict[str, Any], app: Any) -> None:
        self.settings = settings
        self.core = PlannerCore(planner_config(settings), tuple(pools), _profile(settings))
        self.actuator: Any = PoolActuator(pools)
        if settings.planner_kubernetes:  # the operator's fleet: pools follow pods; the planner scales the pods
            self.actuator = _kubernetes_actuator(settings.planner_kubernetes, self.core, self.actuator.serving)
        self.metrics = PlannerMetrics(self.core, self.actuator.serving)
        self.loop: PlannerLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._client: PrometheusClient | None = None
        self._gateway = app.state
        app.state.metrics.registry.register(self.metrics)
        app.state.on_waiting_for_worker = self.wake
        self._add_routes(app)

    def start(self, prometheus_url: str) -> None:
        self._client = PrometheusClient(prometheus_url)
        statistic = "mean" if self.settings.planner_mode == "sla" else "0.9"
        reader = PrometheusReader(self._client, self.core.pools, window_s=self.settings.planner_window_s,
                                  statistic=statistic)
        self.loop = PlannerLoop(self.core, reader, self.actuator, metrics=self.metrics,
                                serving=self.actuator.serving,
                                waiting_for_worker=lambda: self._gateway.num_waiting_for_worker)
        self._task = asyncio.get_running_loop().create_task(self.loop.run(), name="planner")
        logger.info("planner: %s mode, pools %s, every %g s", self.settings.planner_mode,
                    ", ".join(self.core.pools), self.settings.planner_interval_s)

    def wake(self) -> None:
        if self.loop is not None:
            self.loop.wake()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._client is not None:
            self._client.close()

    def state(self) -> dict[str, Any]:
        decision = self.loop.decisions[-1] if self.loop is not None and self.loop.decisions else None
        return {
            "mode": self.settings.planner_mode, "pools": list(self.core.pools),
            "targets": self.actuator.current(), "serving": self.actuator.serving(),
            "overrides": self.core.overrides,
            "last_decision": None if decision is None else finite_or_none(dataclasses.asdict(decision)),
        }

    def _add_routes(self, app: Any) -> None:
        api, gateway_state = app.api, app.state

        def check(request: Request, pool: str | None = None) -> None:
            gateway_state.check_api_key(request.headers.get("authorization"))
            if pool is not None and pool not in self.core.pools:
                raise ApiError(404, f"no pool {pool!r}; pools: {', '.join(self.core.pools)}", param="pool")

        async def get_state(request: Request) -> dict[str, Any]:
            check(request)
            return self.state()

        async def put_override(pool: str, request: Request) -> dict[str, Any]:
            check(request, pool)
            try:
                body = await request.json()
            except ValueError:
                body = None
            workers = body.get("workers") if isinstance(body, dict) else None
            if not isinstance(workers, int) or isinstance(workers, bool):
                raise ApiError(400, 'the body must be {"workers": N}', param="workers")
            try:
                self.core.override(pool, workers)
            except ValueError as exc:
                raise ApiError.from_invalid(InvalidRequestError(str(exc), param="workers")) from None
            self.wake()
            return self.state()

        async def delete_override(pool: str, request: Request) -> dict[str, Any]:
            check(request, pool)
            self.core.release(pool)
            self.wake()
            return self.state()

        api.add_api_route("/planner", get_state, methods=["GET"], tags=["planner"],
                          summary="the planner's pools, overrides and last decision")
        api.add_api_route("/planner/pools/{pool}", put_override, methods=["PUT"], tags=["planner"],
                          summary='hold a pool at {"workers": N} until released')
        api.add_api_route("/planner/pools/{pool}", delete_override, methods=["DELETE"], tags=["planner"],
                          summary="release a pool's override")

