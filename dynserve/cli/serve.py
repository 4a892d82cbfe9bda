"""`dynctl serve`: Ray (a local instance, or the cluster at `--ray-address`), `--workers` engine workers (with
several, the gateway routes by `--router`, `kv` by default), and the gateway. With `--mocker PROFILE` the
workers are mockers (simulated step times, no model; see `dynserve/workers/mocker.py`). With
`--prefill-workers N --decode-workers M` it serves disaggregated: a pool of N prefill workers and a pool of M
decode workers, KV pages moving between them (see `gateway/backend.py`).

Thin: it starts the parts the library provides (a `WorkerPool`, which replaces a worker that dies, and a
gateway that follows the pool through the worker registry), shows progress while the workers load their
model, prints where to send requests (and, with `--prometheus`, the URL of a Prometheus it runs that
scrapes the fleet: `observability/prometheus.py`), and on Ctrl-C (or SIGTERM) stops the gateway, the
Prometheus, the workers and the Ray instance it started, in that order.

Starting its own local Ray without a `cluster_token`, it makes a random one for the fleet it starts (the
workers, their event plane and the gateway get it with the settings), so even a laptop's internal sockets
serve only that fleet; a fleet joining `--ray-address` uses the token it is given, if any.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import sys
import time
from typing import Any

from dynserve import shutdown
from dynserve.config import Settings, ray_system_config
from dynserve.errors import ModelLoadError

__all__ = ["serve", "start_ray", "with_fleet_token"]

logger = logging.getLogger(__name__)

EXIT_OK = 0
# How long each shutdown step of `dynctl serve` (the planner, Prometheus, each pool) may take before it is
# left behind (`shutdown.step`; all of them together: `shutdown.STEPS_BUDGET_S`); a pool's close only ends its
# workers and deregisters them
SHUTDOWN_STEP_S = 15.0


def start_ray(settings: Settings) -> bool:
    """Join `settings.ray_address`, or start a local Ray instance; True if this call started one."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local instance needs no token
    import ray

    if ray.is_initialized():
        return False
    if settings.ray_address:
        ray.init(address=settings.ray_address, logging_level=logging.WARNING, log_to_driver=True)
        return False
    # Everything runs on this host by construction: workers and the event plane serve on loopback, so a local
    # `dynctl serve` opens no port to the network but the gateway's (--host). The addresses go in this
    # process's environment, which the Ray processes it starts inherit: a runtime env saying them would cost
    # every worker's start (`workers/ray_start.py`), as would one saying the workers' niceness.
    os.environ["DYN_ADVERTISE_HOST"] = settings.advertise_host or "127.0.0.1"
    if settings.bind_host:
        os.environ["DYN_BIND_HOST"] = settings.bind_host
    ray.init(include_dashboard=False, object_store_memory=256 * 2**20, logging_level=logging.WARNING,
             log_to_driver=True, _system_config=ray_system_config())
    return True


async def _start_pools(pools: list[tuple[Any, int]]) -> list[Any]:
    """Start each pool's workers, with a live elapsed-time line on a terminal while their models load."""
    from dynserve.errors import PoolError

    start_s = time.monotonic()
    num_workers = sum(n for _pool, n in pools)
    if pools and pools[0][0].settings.pools_follow_nodes:  # serve once any pool has a worker; all keep following
        return await _first_workers([pool for pool, _n in pools])
    starting = asyncio.ensure_future(asyncio.gather(*(pool.start(n) for pool, n in pools)))
    interactive = sys.stderr.isatty()
    while not starting.done():
        await asyncio.wait([starting], timeout=0.25)
        if interactive and not starting.done():
            print(f"\rstarting {num_workers} worker(s)... {time.monotonic() - start_s:4.0f} s",
                  end="", file=sys.stderr, flush=True)
    if interactive:
        print(file=sys.stderr)
    try:
        return [info for infos in starting.result() for info in infos]
    except PoolError as exc:
        raise ModelLoadError(f"a worker failed to start: {exc}") from exc


async def _first_workers(pools: list[Any]) -> list[Any]:
    """Follow mode: the workers serving once each serving pool (decode, or aggregated) of the default model has
    one; every pool keeps following its nodes. A disaggregated gateway cannot answer without a decode worker
    (its prompts prefill there while the prefill pool has none), so a prefill worker alone is not enough: a
    decode worker that failed to start while the prefill one served left the gateway with no decode pool to
    build."""
    print("waiting for the pools' nodes to join and their first worker to serve...", file=sys.stderr, flush=True)
    default_model = pools[0].settings.model
    needed = [pool for pool in pools if pool.role != "prefill" and pool.settings.model == default_model]
    started = {pool: asyncio.ensure_future(pool.start(0)) for pool in pools}
    await asyncio.gather(*(started[pool] for pool in needed or pools[:1]))
    for task in started.values():
        if task.done():
            task.result()  # raises what a pool hit
        else:
            task.cancel()  # only the wait: the pool's monitor keeps following its nodes
    return [info for pool in pools for info in pool.workers()]


def _owned(infos: list[Any], pools: list[tuple[Any, int]]) -> list[tuple[Any, tuple[Any, int]]]:
    """Each started worker's info with its pool (a worker's id begins with its pool's name)."""
    by_name = {pool.name: (pool, n) for pool, n in pools}
    return [(info, by_name[info.worker_id.rsplit("-", 1)[0]]) for info in infos]


def _banner(settings: Settings, model_ids: list[str], port: int, prometheus_url: str | None = None) -> str:
    kind = "worker" if settings.mocker is None else "mocker worker"
    if _disaggregated(settings):
        workers = (f"{settings.prefill_workers} prefill + {settings.decode_workers} decode {kind}s, "
                   f"router {settings.router}")
    elif settings.workers == 1:
        workers = f"1 {kind}"
    else:
        workers = f"{settings.workers} {kind}s, router {settings.router}"
    if settings.mocker is not None:
        workers += f", profile {settings.mocker}, speedup {settings.mocker_speedup:g}"
    host = "localhost" if settings.host in ("127.0.0.1", "0.0.0.0") else settings.host
    base = f"http://{host}:{port}"
    auth = ' -H "Authorization: Bearer $DYN_API_KEY"' if settings.api_key else ""
    metrics = ""
    if prometheus_url is not None:
        own = "" if settings.prometheus_url else " (scraping this fleet)"
        metrics = (f"Prometheus: {prometheus_url}{own}; scrape targets: {base}/metrics/targets; watch it live: "
                   f"dynctl top --prometheus-url {prometheus_url}\n")
    if settings.planner:
        metrics += (f"Planner: {settings.planner_mode} mode, TTFT {settings.planner_ttft_ms:g} ms, ITL "
                    f"{settings.planner_itl_ms:g} ms, every {settings.planner_interval_s:g} s; its state and "
                    f"overrides: {base}/planner\n")
    model_id = model_ids[0]
    if len(model_ids) > 1:  # "serving A, B at URL (each: 2 workers, router kv)"
        workers = f"each: {workers}"
    return (
        f"dynserve is serving {', '.join(model_ids)} at {base}/v1 ({workers}). Ctrl-C stops it.\n{metrics}"
        f"Try:\n  curl {base}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
        f"    -d '{{\"model\": \"{model_id}\", \"messages\": [{{\"role\": \"user\", \"content\": "
        f"\"Hello! Who are you?\"}}], \"max_tokens\": 64}}'\n"
    )


def serve(settings: Settings) -> int:
    import uvloop

    from dynserve.model.resolve import check_engine_architecture, resolve_model_path
    from dynserve.model.tokenizer import Tokenizer

    check_layout(settings)
    if settings.planner:
        from dynserve.cli.planning import planner_settings

        settings = planner_settings(settings)
    tokenizers = []
    for model in [settings.model, *settings.extra_models]:
        model_path = resolve_model_path(model)
        tokenizers.append(Tokenizer.load(model_path))  # fails fast on a bad --model, or a tokenizer we cannot match
        if settings.engine == "dynserve" and settings.mocker is None:
            check_engine_architecture(model_path)  # before Ray: else every worker would fail to load it
    settings = with_fleet_token(settings)
    started_ray = start_ray(settings)
    try:
        with shutdown.budget():  # the gateway's shutdown steps and the fleet's share one (`shutdown.py`)
            uvloop.run(_serve(settings, tokenizers, check_fit=started_ray))
        print("dynserve: stopped", file=sys.stderr)
        return EXIT_OK
    finally:
        if started_ray:
            import ray

            ray.shutdown()


def with_fleet_token(settings: Settings) -> Settings:
    """`settings` with a random `cluster_token` when this command starts its own Ray and none was given: the
    fleet it starts shares it (through these settings), and nothing else on the host can use its sockets."""
    if settings.ray_address is not None or settings.cluster_token is not None:
        return settings
    from pydantic import SecretStr

    return settings.model_copy(update={"cluster_token": SecretStr(secrets.token_urlsafe(32))})


def _disaggregated(settings: Settings) -> bool:
    return settings.prefill_workers > 0 or settings.decode_workers > 0


def check_layout(settings: Settings) -> None:
    """Raise InvalidRequestError for a worker layout that cannot serve (prefill without decode workers, an
    unknown mocker profile, vLLM workers without their command or model, or disaggregated)."""
    from dynserve.errors import InvalidRequestError
    from dynserve.workers.mocker_profiles import get_profile

    if settings.mocker is not None:
        get_profile(settings.mocker)  # names the known profiles

    if settings.engine == "vllm":
        if _disaggregated(settings):
            raise InvalidRequestError("disaggregated serving moves KV pages between dynserve's own workers; vLLM "
                                      "workers serve aggregated (--workers N, no --prefill-workers)",
                                      param="prefill_workers")
        if settings.mocker is not None:
            raise InvalidRequestError("--mocker simulates dynserve's engine, not vLLM's", param="mocker")
        from dynserve.workers.vllm_worker import vllm_argv

        vllm_argv(settings, host="127.0.0.1", port=0, events_port=0, replay_port=0)  # names what is missing
    if _disaggregated(settings) and (settings.prefill_workers < 1 or settings.decode_workers < 1):
        raise InvalidRequestError("disaggregated serving needs at least one prefill and one decode worker "
                                  "(--prefill-workers N --decode-workers M)", param="prefill_workers")
    if settings.extra_models:
        from dynserve.model.resolve import model_id_of, resolve_model_path

        if settings.planner and settings.planner_kubernetes:
            raise InvalidRequestError("--planner-kubernetes scales the DynServePools of one model; with several "
                                      "models run the planner in `dynctl serve` (one loop per model)",
                                      param="planner_kubernetes")
        ids = [model_id_of(resolve_model_path(m)) for m in [settings.model, *settings.extra_models]]
        twice = sorted({i for i in ids if ids.count(i) > 1})
        if twice:
            raise InvalidRequestError(f"the model {twice[0]!r} is given twice: each model is served once",
                                      param="extra_models")
    several = settings.planner or bool(settings.extra_models) or (
        settings.prefill_workers + settings.decode_workers if _disaggregated(settings) else settings.workers) > 1
    if settings.worker_metrics_port and settings.ray_address is None and several:
        raise InvalidRequestError("--worker-metrics-port fixes one port for every worker: several workers on "
                                  "this one host would take the same port (leave it at 0: each worker announces "
                                  "its own)", param="worker_metrics_port")


async def _serve(settings: Settings, tokenizers: list[Any], *, check_fit: bool = False) -> None:
    """The pools of workers (each model's), then the gateway following them through the registry, until
    SIGINT/SIGTERM. `check_fit`: refuse, before any worker starts, a fleet the cluster cannot hold at once
    (a Ray this command started: one node, nothing to add another)."""
    from dynserve.gateway.server import make_gateway_app, serve_app_async
    from dynserve.workers.pool import WorkerPool, check_placeable

    if _disaggregated(settings):
        layout = [("p", "prefill", settings.prefill_workers), ("d", "decode", settings.decode_workers)]
    else:
        layout = [("w", "both", settings.workers)]
    models = [settings.model, *settings.extra_models]
    if settings.planner:  # the pools start within the planner's bounds, and the planner takes it from there
        bounds = {"both": (settings.planner_min_workers, settings.planner_max_workers),
                  "prefill": (settings.planner_min_prefill_workers, settings.planner_max_prefill_workers),
                  "decode": (settings.planner_min_decode_workers, settings.planner_max_decode_workers)}
        layout = [(name, role, min(max(n, bounds[role][0]), bounds[role][1])) for name, role, n in layout]
    # several workers on one host share its cores: each gets its part of the threads
    num_workers = sum(n for _name, _role, n in layout) * len(models)
    if check_fit and not settings.pools_follow_nodes:
        await asyncio.to_thread(check_placeable, settings, num_workers)
    threads = settings.num_threads or max(1, (os.cpu_count() or 1) // num_workers)
    # following nodes, a worker has its node to itself and takes the node's CPUs (workers/pool.py)
    worker_settings = settings if settings.pools_follow_nodes else settings.model_copy(update={"num_threads": threads})
    # the first model's pools are w (or p and d); the next models' m1-w, m2-w, ... (following nodes, model i's
    # pools follow the nodes that offer its resources: workers/pool.py's node_resource)
    pools = [(WorkerPool(worker_settings.model_copy(update={"model": model, "extra_models": []}),
                         name=name if i == 0 else f"m{i}-{name}", role=role,  # type: ignore[arg-type]
                         model_index=i), n)
             for i, model in enumerate(models) for name, role, n in layout]
    registry = pools[0][0].registry  # before any worker: the embedded event plane starts on this node
    prometheus: list[Any] = []  # the Prometheus this command runs (--prometheus), once started
    announced: list[asyncio.Task[None]] = []
    planning: Any = None
    try:
        infos = await _start_pools(pools)
        by_model = [[info for info, (pool, _n) in _owned(infos, pools) if pool.settings.model == model]
                    for model in models]
        app = make_gateway_app(settings, by_model[0], tokenizers[0], registry=registry,
                               more_models=list(zip(by_model[1:], tokenizers[1:], strict=True)))
        if settings.planner:
            from dynserve.cli.planning import Planning

            from dynserve.model.resolve import model_id_of, resolve_model_path

            per_model = len(layout)  # each model's pools, in `pools`' order: one planner per model
            planning = Planning(settings, {
                model_id_of(resolve_model_path(model)): {
                    pool.role: pool for pool, _n in pools[i * per_model:(i + 1) * per_model]}
                for i, model in enumerate(models)}, app)

        async def announce(port: int) -> None:
            prometheus_url = settings.prometheus_url
            if settings.prometheus:
                prometheus_url = await _start_prometheus(settings, port, prometheus)
            if planning is not None:
                if prometheus_url is None:
                    print("dynserve: the planner has no Prometheus to read; the pools keep their size",
                          file=sys.stderr, flush=True)
                else:
                    planning.start(prometheus_url)
            model_ids = [model_infos[0].model_id for model_infos in by_model]
            print(_banner(settings, model_ids, port, prometheus_url), file=sys.stderr, flush=True)

        def on_ready(port: int) -> None:
            announced.append(asyncio.get_running_loop().create_task(announce(port)))

        await serve_app_async(app, settings, on_ready)  # returns after SIGINT/SIGTERM and a graceful shutdown
    finally:  # each step bounded (`shutdown.step`): one that never ends must not keep the fleet up
        for task in announced:
            task.cancel()
        if planning is not None:
            await shutdown.step("the planner", planning.stop(), SHUTDOWN_STEP_S)
        for server in prometheus:
            await shutdown.step("Prometheus", asyncio.to_thread(server.stop), SHUTDOWN_STEP_S)
        await asyncio.gather(*(shutdown.step(f"pool {pool.name}", pool.close(), SHUTDOWN_STEP_S)
                               for pool, _n in pools))


async def _start_prometheus(settings: Settings, port: int, started: list[Any]) -> str | None:
    """Run a Prometheus that scrapes this fleet through the gateway's `/metrics/targets`; its URL, or None
    (and a warning: serving goes on) when it cannot start."""
    from dynserve.errors import PrometheusError
    from dynserve.observability.prometheus import PrometheusServer

    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(settings.host, settings.host)  # this machine's loopback
    if ":" in host:
        host = f"[{host}]"
    key = settings.secret("api_key") if settings.metrics_require_key else None  # the gateway's /metrics asks for it
    server = PrometheusServer(f"http://{host}:{port}/metrics/targets", scrape_interval_s=settings.scrape_interval_s,
                              bearer_token=key)
    started.append(server)
    try:
        server.launch()  # on this (the main) thread: the process ends with it, however this one ends
        return await asyncio.to_thread(server.wait_ready)
    except PrometheusError as exc:
        print(f"dynserve: Prometheus did not start ({exc}); serving without it", file=sys.stderr, flush=True)
        return None
