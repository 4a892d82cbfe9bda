"""`dynctl gateway`: a gateway alone, for a fleet another process runs (the head of a Kubernetes deployment
runs `dynctl serve`; its extra gateway pods run this). It joins the fleet's Ray cluster (`--ray-address`) or
reads its Redis event plane (`--redis-url`), waits for the first worker to register, then serves the OpenAI
API over every worker of the registry, following them as they come and go, with its own router fed by the
workers' KV events. It starts and stops no worker, and runs no planner.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from dynserve.config import Settings
from dynserve.errors import InvalidRequestError

__all__ = ["gateway"]

EXIT_OK = 0


def gateway(settings: Settings) -> int:
    import uvloop

    from dynserve.cli.serve import start_ray
    from dynserve.model.resolve import resolve_model_path
    from dynserve.model.tokenizer import Tokenizer

    if settings.ray_address is None and settings.redis_url is None:
        raise InvalidRequestError("dynctl gateway serves a fleet that runs elsewhere: give its --ray-address "
                                  "(or --redis-url)", param="ray_address")
    tokenizer = Tokenizer.load(resolve_model_path(settings.model))
    if settings.redis_url is None:
        start_ray(settings)
    uvloop.run(_gateway(settings, tokenizer))
    print("dynserve: gateway stopped", file=sys.stderr)
    return EXIT_OK


async def _gateway(settings: Settings, tokenizer: Any) -> None:
    from dynserve.events.ray_plane import connect_event_plane
    from dynserve.gateway.server import make_gateway_app, serve_app_async

    registry = connect_event_plane(settings.redis_url, settings.namespace,
                                   cluster_token=settings.secret("cluster_token"))
    try:
        print("waiting for the fleet's first worker to register...", file=sys.stderr, flush=True)
        while not (infos := await registry.workers()):
            await asyncio.sleep(1.0)
        app = make_gateway_app(settings, infos, tokenizer, registry=registry)

        def on_ready(port: int) -> None:
            print(f"dynserve gateway: serving {infos[0].model_id} at http://{settings.host}:{port}/v1 over the "
                  f"fleet's workers", file=sys.stderr, flush=True)

        await serve_app_async(app, settings, on_ready)
    finally:
        await registry.close()
