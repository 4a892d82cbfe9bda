"""The standalone mocker: one simulated worker (`dynserve.workers.mocker`) behind dynserve's gateway, as an
OpenAI-compatible server other routers can front:

    dynctl mocker --profile cpu --speedup 10 --http-port 9001    (or python -m dynserve.cli.mocker ...)

With `--redis-url` it registers in `--namespace` there and publishes its KV events, so dynserve's KV router
can use it too. Exit codes as `dynctl`'s.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from dynserve.cli.options import EXIT_USAGE, add_settings_group, dump_stacks_on_sigusr1, settings_from
from dynserve.config import Settings
from dynserve.errors import InvalidRequestError
from dynserve.gateway.server import make_gateway_app, serve_app_async
from dynserve.workers.worker import EngineWorker

__all__ = ["main", "serve_standalone"]

_ENGINE_FLAGS = {"model", "block_size", "kv_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                 "enable_prefix_caching", "seed"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dynctl mocker",
        description="One simulated worker (real scheduler and prefix cache, profiled step times, no model) "
                    "behind dynserve's gateway: an OpenAI-compatible server other routers can front.",
        epilog="The profile defaults to cpu. Engine limits left unset (--kv-blocks, --max-num-seqs, "
               "--max-num-batched-tokens, --max-model-len) are the profile's. With --redis-url the mocker "
               "registers there (in --namespace) and publishes its KV events, so dynserve's KV router can use "
               "it too.")
    parser.add_argument("--log-level", default="WARNING", help="logging level [default: WARNING]")
    add_settings_group(parser, "mocker", aliases={"mocker": ["--profile"], "mocker_speedup": ["--speedup"]})
    add_settings_group(parser, "gateway", aliases={"port": ["--http-port"]})
    add_settings_group(parser, "engine", only=_ENGINE_FLAGS)
    add_settings_group(parser, "cluster", only={"redis_url", "namespace", "advertise_host", "bind_host"})
    add_settings_group(parser, "metrics", only={"worker_metrics", "worker_metrics_port"})
    return parser


async def serve_standalone(settings: Settings) -> None:
    """Run a mocker worker and the gateway over its channel on this loop until the gateway stops; then drain
    the worker (channel clients get 5 s to finish their streams) and stop it. With `settings.redis_url` the
    worker registers in `settings.namespace` there and publishes its KV events."""
    worker = EngineWorker(settings, f"mocker-{os.getpid()}", publish_events=settings.redis_url is not None)
    info = await worker.start()
    app = make_gateway_app(settings, [info], worker.engine.tokenizer)

    def on_ready(port: int) -> None:
        print(f"dynserve mocker ({settings.mocker}, speedup {settings.mocker_speedup:g}) is serving "
              f"{info.model_id} at http://{settings.host}:{port}/v1. Ctrl-C stops it.",
              file=sys.stderr, flush=True)

    try:
        await serve_app_async(app, settings, on_ready)
    finally:
        await worker.drain(timeout_s=5.0)  # leaves the registry now, not when its lease runs out
        await worker.stop()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    dump_stacks_on_sigusr1()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = settings_from(args)
    except InvalidRequestError as exc:
        print(f"mocker: invalid input: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if settings.mocker is None:
        settings = settings.model_copy(update={"mocker": "cpu"})
    import uvloop

    uvloop.run(serve_standalone(settings))  # returns after SIGINT/SIGTERM and a graceful shutdown
    print("mocker: stopped", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
