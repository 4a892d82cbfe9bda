"""`dynctl gateway`: a gateway alone, for a fleet another process runs (the head of a Kubernetes deployment
runs `dynctl serve`; its extra gateway pods run this). It joins the fleet's Ray cluster (`--ray-address`) or
reads its Redis event plane (`--redis-url`), waits for the first worker to register, then serves the OpenAI
API over every worker of the registry, following them as they come and go, with its own router fed by the
workers' KV events. It starts and stops no worker, and runs no planner. With several `--model`s (the fleet's
`dynctl serve` got the same), the first is the default model: the gateway waits for one of its workers, and
the others' workers add their models as they register (`gateway/discovery.py`).

`--worker-url` attaches servers others run (vLLM, any OpenAI-compatible one: `workers.attached`) as
workers: on the fleet's registry when one is given, else on an event plane of this process alone.

`dynctl attach --worker-url ...` does only that half: it puts servers on a fleet's registry (its Ray cluster
or Redis) and relays their KV events there, for every gateway of the fleet (`dynctl serve` and `dynctl
gateway` follow the registry); a vLLM pod's sidecar on Kubernetes runs it.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from dynserve.config import Settings
from dynserve.errors import InvalidRequestError
from dynserve.events.base import EventPlane
from dynserve.protocol import WorkerInfo
from dynserve.workers.attached import AttachedWorker, WorkerUrl, describe_when_up, parse_worker_url

__all__ = ["attach", "default_model_id", "first_workers", "gateway"]

EXIT_OK = 0


def gateway(settings: Settings) -> int:
    import uvloop

    from dynserve.cli.serve import start_ray
    from dynserve.model.resolve import resolve_model_path
    from dynserve.model.tokenizer import Tokenizer

    if settings.ray_address is None and settings.redis_url is None and not settings.worker_urls:
        raise InvalidRequestError("dynctl gateway serves a fleet that runs elsewhere: give its --ray-address "
                                  "(or --redis-url), or the servers to attach (--worker-url)", param="ray_address")
    specs = [parse_worker_url(spec) for spec in settings.worker_urls]
    tokenizer = Tokenizer.load(resolve_model_path(settings.model))
    if settings.redis_url is None and settings.ray_address is not None:
        start_ray(settings)
    uvloop.run(_gateway(settings, tokenizer, specs))
    print("dynserve: gateway stopped", file=sys.stderr)
    return EXIT_OK


async def _gateway(settings: Settings, tokenizer: Any, specs: list[WorkerUrl]) -> None:
    from dynserve.events.memory import MemoryEventPlane
    from dynserve.events.ray_plane import connect_event_plane
    from dynserve.gateway.server import make_gateway_app, serve_app_async

    if settings.ray_address is None and settings.redis_url is None:  # attached servers only: the plane is ours
        registry: EventPlane = MemoryEventPlane()
    else:
        registry = connect_event_plane(settings.redis_url, settings.namespace,
                                       cluster_token=settings.secret("cluster_token"))
    attached = await _attach(settings, registry, specs)
    try:
        infos = await first_workers(registry, default_model_id(settings))
        own_plane = isinstance(registry, MemoryEventPlane)  # the router reads the relayed events from it too
        app = make_gateway_app(settings, infos, tokenizer, registry=registry, events=registry if own_plane else None)

        def on_ready(port: int) -> None:
            print(f"dynserve gateway: serving {infos[0].model_id} at http://{settings.host}:{port}/v1 over the "
                  f"fleet's workers", file=sys.stderr, flush=True)

        await serve_app_async(app, settings, on_ready)
    finally:
        await asyncio.gather(*(worker.stop() for worker in attached), return_exceptions=True)
        await registry.close()


def default_model_id(settings: Settings) -> str | None:
    """The id of the model a gateway of several models (`--model` given twice or more) serves by default, the
    first; None with one model (the fleet's first worker names it: an attached server's id may be its own)."""
    if not settings.extra_models:
        return None
    from dynserve.model.resolve import model_id_of, resolve_model_path

    return model_id_of(resolve_model_path(settings.model))


async def first_workers(registry: EventPlane, model_id: str | None, poll_s: float = 1.0) -> list[WorkerInfo]:
    """The registry's workers of `model_id` (any model when None) once there is one. The other models' workers
    join the gateway through model discovery: the default model's backend and tokenizer are its own."""
    of = "" if model_id is None else f" of {model_id}"
    print(f"waiting for the fleet's first worker{of} to register...", file=sys.stderr, flush=True)
    while not (infos := [info for info in await registry.workers() if model_id in (None, info.model_id)]):
        await asyncio.sleep(poll_s)
    return infos


async def _attach(settings: Settings, registry: EventPlane, specs: list[WorkerUrl]) -> list[AttachedWorker]:
    """The `--worker-url` servers described (each waited for up to `attach_wait_s`), registered on `registry`
    and their KV events relayed."""
    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    infos = await asyncio.gather(*(
        describe_when_up(spec, worker_id=spec.worker_id or f"{spec.engine}-{i}", block_size=settings.block_size,
                         max_model_len=settings.max_model_len, wait_s=settings.attach_wait_s, say=say)
        for i, spec in enumerate(specs)))
    attached = [AttachedWorker(registry, info, spec, lease_s=settings.worker_lease_s)
                for info, spec in zip(infos, specs, strict=True)]
    for worker in attached:
        await worker.start()
        print(f"attached {worker.info.engine} worker {worker.info.worker_id} at {worker.spec.url} "
              f"(model {worker.info.model_id}, blocks of {worker.info.block_size})", file=sys.stderr, flush=True)
    return attached


def attach(settings: Settings) -> int:
    """`dynctl attach`: the `--worker-url` servers on the fleet's registry until SIGINT/SIGTERM."""
    import signal

    import uvloop

    from dynserve.cli.serve import start_ray

    if not settings.worker_urls:
        raise InvalidRequestError("dynctl attach needs the servers to attach (--worker-url)", param="worker_urls")
    if settings.ray_address is None and settings.redis_url is None:
        raise InvalidRequestError("dynctl attach puts servers on a fleet's registry: give its --ray-address (or "
                                  "--redis-url)", param="ray_address")
    specs = [parse_worker_url(spec) for spec in settings.worker_urls]
    if settings.redis_url is None:
        start_ray(settings)

    async def run() -> None:
        from dynserve.events.ray_plane import connect_event_plane

        registry = connect_event_plane(settings.redis_url, settings.namespace,
                                       cluster_token=settings.secret("cluster_token"))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        attached = await _attach(settings, registry, specs)
        try:
            await stop.wait()
        finally:
            await asyncio.gather(*(worker.stop() for worker in attached), return_exceptions=True)
            await registry.close()

    uvloop.run(run())
    print("dynserve: attached workers left the registry", file=sys.stderr)
    return EXIT_OK
