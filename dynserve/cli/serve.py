"""`dynctl serve`: Ray (a local instance, or the cluster at `--ray-address`), `--workers` engine workers (with
several, the gateway routes by `--router`, `kv` by default), and the gateway. With `--mocker PROFILE` the
workers are mockers (simulated step times, no model; see `dynserve/workers/mocker.py`).

Thin: it starts the parts the library provides, shows progress while the worker loads its model, prints
where to send requests, and on Ctrl-C (or SIGTERM) stops the gateway, the worker and the Ray instance it
started, in that order.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from dynserve.config import Settings
from dynserve.errors import ModelLoadError

__all__ = ["serve", "start_ray"]

logger = logging.getLogger(__name__)

EXIT_OK = 0


def start_ray(settings: Settings) -> bool:
    """Join `settings.ray_address`, or start a local Ray instance; True if this call started one."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local instance needs no token
    import ray

    if ray.is_initialized():
        return False
    if settings.ray_address:
        ray.init(address=settings.ray_address, logging_level=logging.WARNING, log_to_driver=True)
        return False
    ray.init(include_dashboard=False, object_store_memory=256 * 2**20, logging_level=logging.WARNING,
             log_to_driver=True)
    return True


def _wait_for_worker(handle: Any, info_ref: Any, worker_id: str) -> Any:
    """Wait for the worker's model to load, with a live elapsed-time line on a terminal."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    start_s = time.monotonic()
    interactive = sys.stderr.isatty()
    while True:
        ready, _ = ray.wait([info_ref], timeout=0.25)
        if ready:
            break
        if interactive:
            print(f"\rstarting worker {worker_id}... {time.monotonic() - start_s:4.0f} s",
                  end="", file=sys.stderr, flush=True)
    if interactive:
        print(file=sys.stderr)
    try:
        return ray.get(info_ref)
    except (RayActorError, RayTaskError) as exc:
        raise ModelLoadError(f"worker {worker_id} failed to start: {exc}") from exc


def _banner(settings: Settings, model_id: str, port: int) -> str:
    kind = "worker" if settings.mocker is None else "mocker worker"
    workers = f"1 {kind}" if settings.workers == 1 else f"{settings.workers} {kind}s, router {settings.router}"
    if settings.mocker is not None:
        workers += f", profile {settings.mocker}, speedup {settings.mocker_speedup:g}"
    host = "localhost" if settings.host in ("127.0.0.1", "0.0.0.0") else settings.host
    base = f"http://{host}:{port}"
    auth = ' -H "Authorization: Bearer $DYN_API_KEY"' if settings.api_key else ""
    return (
        f"dynserve is serving {model_id} at {base}/v1 ({workers}). Ctrl-C stops it.\n"
        f"Try:\n  curl {base}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
        f"    -d '{{\"model\": \"{model_id}\", \"messages\": [{{\"role\": \"user\", \"content\": "
        f"\"Hello! Who are you?\"}}], \"max_tokens\": 64}}'\n"
    )


def serve(settings: Settings) -> int:
    import ray

    from dynserve.engine.loader import resolve_model_path
    from dynserve.engine.tokenizer import Tokenizer
    from dynserve.gateway.app import build_app
    from dynserve.gateway.backend import WorkerSet
    from dynserve.gateway.server import make_router, serve_app
    from dynserve.workers.worker import launch_worker, reserved_cpus

    tokenizer = Tokenizer.load(resolve_model_path(settings.model))  # fails fast on a bad --model
    started_ray = start_ray(settings)
    handles = []
    try:
        # several workers on one host share its cores: each gets its part of the threads
        threads = settings.num_threads or max(1, (os.cpu_count() or 1) // settings.workers)
        worker_settings = settings.model_copy(update={"num_threads": threads})
        launched = [launch_worker(worker_settings, f"w{i}", num_cpus=reserved_cpus(settings),
                                  publish_events=settings.workers > 1) for i in range(settings.workers)]
        handles = [handle for handle, _ in launched]
        infos = [_wait_for_worker(handle, ref, f"w{i}") for i, (handle, ref) in enumerate(launched)]
        app = build_app(settings, WorkerSet(infos, router=make_router(settings, infos)), tokenizer)

        def on_ready(port: int) -> None:
            print(_banner(settings, infos[0].model_id, port), file=sys.stderr, flush=True)

        serve_app(app, settings, on_ready)  # returns after SIGINT/SIGTERM and a graceful shutdown
        print("dynserve: stopped", file=sys.stderr)
        return EXIT_OK
    finally:
        for handle in handles:
            ray.kill(handle)
        if started_ray:
            ray.shutdown()
