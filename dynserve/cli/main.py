"""`dynctl`: the command line. Subcommands are thin: parse, build `Settings`, call the library.

Every engine flag is generated from a `Settings` field and has an environment twin (`--kv-blocks` /
`DYN_KV_BLOCKS`), shown in `--help` (`options.py`). Exit codes: 0 success, 1 runtime failure, 2 bad usage or
input. `kill -USR1 <pid>` makes a running `dynctl` write every thread's Python stack to stderr and go on
(`options.dump_stacks_on_sigusr1`).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from dynserve.cli.options import (EXIT_FAILURE, EXIT_OK, EXIT_USAGE, add_settings_group,
                                  dump_stacks_on_sigusr1, settings_from)
from dynserve.errors import DynserveError, InvalidRequestError
from dynserve.protocol import SamplingParams

__all__ = ["main"]


def _add_settings_flags(parser: argparse.ArgumentParser, *groups: str) -> None:
    for group_name in groups:
        add_settings_group(parser, group_name)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dynctl", description="dynserve: distributed LLM serving")
    parser.add_argument("--log-level", default="WARNING", help="logging level [default: WARNING]")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt and stream it to the terminal")
    gen.add_argument("prompt", help="the user message (or raw text with --raw)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy [default: 0]")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--system", default=None, help="system prompt (chat mode)")
    gen.add_argument("--raw", action="store_true", help="complete the text as is, no chat template")
    gen.add_argument("--output", choices=["text", "json"], default="text")
    _add_settings_flags(gen, "engine")

    top = sub.add_parser("top", help="a live view of a running fleet, from its Prometheus metrics")
    top.add_argument("--prometheus-url", default=None, metavar="URL",
                     help="Prometheus's base URL [env: DYN_PROMETHEUS_URL; default: http://127.0.0.1:9090]")
    top.add_argument("--interval", type=float, default=2.0, metavar="S",
                     help="seconds between frames [default: 2]")
    top.add_argument("--once", action="store_true", help="print one frame and exit (1 if Prometheus fails)")
    top.add_argument("--output", choices=["text", "json"], default="text",
                     help="json: the view as JSON (live: one object per line) [default: text]")

    sub.add_parser("mocker", add_help=False,
                   help="one simulated worker behind the gateway, an OpenAI server (dynctl mocker --help)")
    profile = sub.add_parser("profile", help="measure one worker's engine (or a mocker profile) into the "
                             "capacity profile the planner scales by (dynctl profile --help)")
    from dynserve.cli.profile import add_profile_arguments

    add_profile_arguments(profile)
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API: local Ray, a worker and the gateway")
    _add_settings_flags(serve, "gateway", "engine", "cluster", "mocker", "transfer", "metrics", "planner")
    gateway = sub.add_parser("gateway", help="a gateway alone over a fleet that runs elsewhere (its Ray cluster "
                             "or Redis event plane): more gateways for one fleet")
    _add_settings_flags(gateway, "gateway", "cluster")
    # its tokenizer; for attached servers, what their API may not say
    add_settings_group(gateway, "engine", only={"model", "block_size", "max_model_len"})
    attach = sub.add_parser("attach", help="put OpenAI servers others run (vLLM: its KV events too) on a fleet's "
                            "registry as workers (--worker-url, repeated)")
    _add_settings_flags(attach, "cluster")
    add_settings_group(attach, "engine", only={"block_size", "max_model_len"})
    from dynserve.cli.deploy import add_kube_commands

    add_kube_commands(sub)  # deploy, status, delete
    return parser


def _generate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from dynserve.engine.llm_engine import LLMEngine

    settings = settings_from(args)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k
    )
    params.validate()
    stages = ["loading tokenizer", "loading weights", "building model", "ready"]
    with tqdm(total=len(stages), desc="loading model", file=sys.stderr, disable=args.output == "json",
              bar_format="{desc}: {n}/{total} {bar} {elapsed}") as bar:

        def progress(message: str) -> None:
            bar.set_description(message)
            bar.update(1)

        engine = LLMEngine(settings, progress=progress)
    if args.raw:
        prompt = args.prompt
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
        prompt = engine.tokenizer.apply_chat_template(messages)
    start = time.perf_counter()
    request_id = engine.add_request(prompt, params)
    pieces, last = [], None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.request_id != request_id:
                continue
            pieces.append(delta.text)
            last = delta
            if args.output == "text":
                print(delta.text, end="", flush=True)
    elapsed_s = time.perf_counter() - start
    assert last is not None
    if args.output == "json":
        print(json.dumps({
            "text": "".join(pieces), "finish_reason": last.finish_reason,
            "prompt_tokens": last.num_prompt_tokens, "completion_tokens": last.num_output_tokens,
            "elapsed_s": round(elapsed_s, 3),
        }))
    else:
        print()
        print(f"[{last.num_output_tokens} tokens in {elapsed_s:.2f} s, "
              f"{last.num_output_tokens / elapsed_s:.1f} tok/s, finish: {last.finish_reason}]", file=sys.stderr)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["mocker"]:  # its own parser: the mocker's flags, aliases and help
        from dynserve.cli.mocker import main as mocker_main

        return mocker_main(argv[1:])
    args = _build_parser().parse_args(argv)
    dump_stacks_on_sigusr1()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "top":
            from dynserve.cli.top import top

            return top(prometheus_url=args.prometheus_url, interval_s=args.interval, once=args.once,
                       output=args.output)
        if args.command == "profile":
            from dynserve.cli.profile import profile

            return profile(args)
        if args.command == "serve":
            from dynserve.cli.serve import serve

            return serve(settings_from(args))
        if args.command == "gateway":
            from dynserve.cli.gateway import gateway

            return gateway(settings_from(args))
        if args.command == "attach":
            from dynserve.cli.gateway import attach

            return attach(settings_from(args))
        if args.command in ("deploy", "status", "delete"):
            from dynserve.cli.deploy import run

            return run(args)
    except InvalidRequestError as exc:
        print(f"dynctl: invalid input: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except DynserveError as exc:
        print(f"dynctl: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return 130
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
