"""What the serving path costs: the engine benchmark's workload through the gateway over HTTP, against the
same engine driven in-process, in one run.

Both systems run the same requests (random-token prompts of 64..512 tokens, outputs of 32..128, greedy,
`ignore_eos`, fp32) with the same concurrency (16 requests in flight; a finished one is replaced by the
next), on the same number of torch threads:

1. **engine**: an `LLMEngine` in this process; a request is "sent" when `add_request` is called.
2. **gateway**: an engine worker (Ray actor), the gateway in its own process (as `dynctl serve` runs it),
   and an HTTP client here streaming `/v1/completions` with token-id prompts.

Reported:
- `gateway_tok_s`, `engine_tok_s` (generated tokens / wall time, the best of 2 rounds each, run
  engine, gateway, engine, gateway so that drift in the machine's speed hits both alike) and
  `throughput_ratio` (gateway / engine); every round is listed in `*_tok_s_rounds`;
- `ttft_p50_added_ms`: the time the serving path adds before the first token, per request: the client's
  TTFT minus the worker's own arrival-to-first-token time for that very request (the worker records both
  on one monotonic clock), p50 over requests. This isolates HTTP, the gateway, tokenization and the
  channel from queueing inside the engine, which at 16 in flight is seconds long and varies from run to
  run by far more than what is being measured;
- `ttft_p50_ms_gateway` / `ttft_p50_ms_engine` (and their difference, `ttft_p50_diff_ms`) for reference;
- `ttft_p50_added_ms_c1`: the same per-request measure at concurrency 1 with short prompts.

The client (`_http.py`) keeps one connection per simulated user and takes the send time when the request
bytes go to the socket, so the client's own request building is not charged to the server.

`--quick` (about 90 s) runs 16 requests with outputs of 32..64 tokens instead of 32 requests with 32..128.
The last stdout line is the JSON result; a copy goes to `benchmarks/results/gateway-<timestamp>.json`.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.gateway [--quick]

Half the requests of a full run, and all of a quick one, are sent 16 at once: the gateway takes them one
after another while the engine computes on the first, and sends them at the end of its loop pass
(`WorkerConnection._send`); a step's tokens go out from the engine thread (`FrameWriter`). What moves
`ttft_p50_added_ms` on each hop, the experiments tried and the measurements: `docs/benchmarks.md`
(gateway).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

from benchmarks._common import git_commit, log, machine_info, percentile, start_local_ray, write_result
from benchmarks._http import RawConnection
from benchmarks.engine import FULL_PLAN, Plan, Workload, make_workload, random_prompt

CONCURRENCY = 16
NUM_ROUNDS = 2
QUICK_PLAN = Plan(16, (64, 512), (32, 64), None, None, num_prefill_repeats=1)
NUM_C1_REQUESTS = 12
C1_PROMPT_LEN = 32


# ---- the engine in-process ------------------------------------------------------------------------------


def run_engine(engine: Any, workload: Workload, concurrency: int) -> dict[str, Any]:
    """Keep `concurrency` requests in the engine; TTFT per request from its `add_request`."""
    from dynserve.protocol import SamplingParams

    engine.reset_prefix_cache()
    pending = list(range(workload.num_requests))
    added_s: dict[str, float] = {}
    index_of: dict[str, int] = {}
    ttft_s: list[float] = []
    num_tokens = 0
    start = time.perf_counter()

    def add(i: int) -> None:
        params = SamplingParams(max_tokens=workload.output_lens[i], temperature=0.0, ignore_eos=True)
        request_id = engine.add_request(workload.prompt_token_ids[i], params)
        added_s[request_id], index_of[request_id] = time.perf_counter(), i

    while pending and len(added_s) < concurrency:
        add(pending.pop(0))
    seen_first: set[str] = set()
    while engine.has_unfinished_requests():
        for delta in engine.step():
            num_tokens += len(delta.token_ids)
            if delta.request_id not in seen_first:
                seen_first.add(delta.request_id)
                ttft_s.append(time.perf_counter() - added_s[delta.request_id])
            if delta.finished and pending:
                add(pending.pop(0))
    total_s = time.perf_counter() - start
    if num_tokens != sum(workload.output_lens):
        raise RuntimeError(f"engine produced {num_tokens} tokens, expected {sum(workload.output_lens)}")
    return {"tok_s": num_tokens / total_s, "total_s": total_s, "ttft_s": ttft_s}


# ---- the gateway, in its own process ---------------------------------------------------------------------


def _gateway_process(settings_json: str, info_bytes: bytes, ports: Any) -> None:
    import msgspec

    from dynserve.config import Settings
    from dynserve.gateway.server import make_gateway_app, serve_app
    from dynserve.protocol import WorkerInfo

    settings = Settings.model_validate_json(settings_json)
    info = msgspec.msgpack.decode(info_bytes, type=WorkerInfo)
    serve_app(make_gateway_app(settings, [info]), settings, on_ready=ports.put)


def _request_body(prompt: list[int], max_tokens: int) -> bytes:
    return json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()


async def _stream_one(conn: RawConnection, request: bytes) -> dict[str, Any]:
    """One streamed completion on `conn`; TTFT is when the first chunk with text arrives."""
    sent_monotonic_s, events = await conn.post_events(request)
    first_s = None
    response_id, usage = None, None
    async for data in events:
        if data == b"[DONE]":
            continue
        chunk = json.loads(data)
        response_id = chunk["id"]
        if chunk.get("usage"):
            usage = chunk["usage"]
        elif first_s is None and chunk["choices"] and chunk["choices"][0]["text"]:
            first_s = time.monotonic() - sent_monotonic_s
    assert usage is not None and first_s is not None
    return {"ttft_s": first_s, "request_id": f"{response_id}-0", "num_tokens": usage["completion_tokens"],
            "sent_monotonic_s": sent_monotonic_s}


async def run_gateway(host: str, port: int, workload: Workload, concurrency: int) -> dict[str, Any]:
    """`concurrency` users, each with its own keep-alive connection, take the requests in order."""
    conns = [await RawConnection(host, port).open() for _ in range(concurrency)]
    requests = [conns[0].request_bytes("/v1/completions", _request_body(p, n))
                for p, n in zip(workload.prompt_token_ids, workload.output_lens, strict=True)]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(workload.num_requests):
        queue.put_nowait(i)
    results: list[dict[str, Any]] = [{} for _ in requests]

    async def user(conn: RawConnection) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            results[i] = await _stream_one(conn, requests[i])

    start = time.perf_counter()
    await asyncio.gather(*(user(c) for c in conns))
    total_s = time.perf_counter() - start
    for conn in conns:
        await conn.close()
    num_tokens = sum(r["num_tokens"] for r in results)
    if num_tokens != sum(workload.output_lens):
        raise RuntimeError(f"gateway produced {num_tokens} tokens, expected {sum(workload.output_lens)}")
    return {"tok_s": num_tokens / total_s, "total_s": total_s, "requests": results}


def added_ttft_ms(requests: list[dict[str, Any]], timings: dict[str, Any]) -> dict[str, list[float]]:
    """Per request: client TTFT minus the worker's own arrival-to-first-token time ("added"), split into the
    way in (client send to worker arrival) and the way out (worker's first token to the client)."""
    out: dict[str, list[float]] = {"added": [], "way_in": [], "way_out": []}
    for request in requests:
        timing = timings[request["request_id"]]
        added = request["ttft_s"] - (timing.first_token_s - timing.arrival_s)
        way_in = timing.arrival_s - request["sent_monotonic_s"]
        out["added"].append(1000 * added)
        out["way_in"].append(1000 * way_in)
        out["way_out"].append(1000 * (added - way_in))
    return out


async def run_c1(host: str, port: int, vocab_size: int, seed: int) -> list[dict[str, Any]]:
    """Concurrency 1, short prompts, one after another on a kept-alive connection."""
    conn = await RawConnection(host, port).open()
    results = []
    for i in range(NUM_C1_REQUESTS):
        prompt = random_prompt(C1_PROMPT_LEN, vocab_size, seed + 100 + i)
        results.append(await _stream_one(conn, conn.request_bytes("/v1/completions", _request_body(prompt, 2))))
    await conn.close()
    return results


# ---- main ------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gateway", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 requests instead of 32 (about 90 s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads for both (default: all cores)")
    parser.add_argument("--output", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import msgspec
    import ray

    from dynserve.config import Settings
    from dynserve.engine.llm_engine import LLMEngine
    from dynserve.workers.worker import launch_worker

    threads = args.threads or len(os.sched_getaffinity(0))
    plan: Plan = QUICK_PLAN if args.quick else FULL_PLAN
    settings = Settings(dtype="float32", device="cpu", num_threads=threads, seed=args.seed, port=0)
    start = time.perf_counter()
    start_local_ray(num_cpus=threads, object_store_memory=80 * 2**20, include_dashboard=False,
                    log_to_driver=False)
    handle, info_ref = launch_worker(settings, "bench", num_cpus=1)
    engine = LLMEngine(settings)
    info = ray.get(info_ref)
    ports: Any = multiprocessing.get_context("spawn").Queue()
    gateway = multiprocessing.get_context("spawn").Process(
        target=_gateway_process, args=(settings.model_dump_json(), msgspec.msgpack.encode(info), ports), daemon=True
    )
    gateway.start()
    host, port = "127.0.0.1", ports.get(timeout=120)
    log(f"worker, engine and gateway ready in {time.perf_counter() - start:.1f}s ({threads} threads)")
    try:
        vocab_size = engine.model_config.vocab_size
        workload = make_workload(plan, vocab_size, args.seed)
        warm = make_workload(Plan(4, (16, 64), (4, 4), None, None, 1), vocab_size, args.seed + 1)
        run_engine(engine, warm, CONCURRENCY)
        asyncio.run(run_gateway(host, port, warm, CONCURRENCY))
        engine_rounds, gateway_rounds = [], []
        for round_index in range(NUM_ROUNDS):  # interleaved, so drift in machine speed hits both alike
            log(f"round {round_index + 1}/{NUM_ROUNDS}: {workload.num_requests} requests, {CONCURRENCY} in flight")
            engine_rounds.append(run_engine(engine, workload, CONCURRENCY))
            log(f"  engine in-process: {engine_rounds[-1]['tok_s']:.1f} tok/s in {engine_rounds[-1]['total_s']:.1f}s")
            ray.get(handle.reset_prefix_cache.remote())  # each round starts cold, as the engine's does
            gateway_rounds.append(asyncio.run(run_gateway(host, port, workload, CONCURRENCY)))
            log(f"  gateway over HTTP: {gateway_rounds[-1]['tok_s']:.1f} tok/s in "
                f"{gateway_rounds[-1]['total_s']:.1f}s")
        eng = max(engine_rounds, key=lambda r: r["tok_s"])
        gw = max(gateway_rounds, key=lambda r: r["tok_s"])
        gw_requests = [r for run in gateway_rounds for r in run["requests"]]
        c1 = asyncio.run(run_c1(host, port, vocab_size, args.seed))
        timings = {t.request_id: t for t in ray.get(handle.recent_timings.remote())}
        added = added_ttft_ms(gw_requests, timings)
        added_c1 = added_ttft_ms(c1, timings)
    finally:
        gateway.terminate()
        gateway.join(10)
        ray.shutdown()
    gw_ttft_ms = 1000 * percentile([r["ttft_s"] for r in gw_requests], 50)
    eng_ttft_ms = 1000 * percentile([t for run in engine_rounds for t in run["ttft_s"]], 50)
    result = {
        "benchmark": "gateway", "quick": args.quick, "seed": args.seed, "commit": git_commit(),
        "machine": machine_info(), "num_threads": threads, "concurrency": CONCURRENCY,
        "workload": workload.describe(),
        "gateway_tok_s": gw["tok_s"], "engine_tok_s": eng["tok_s"], "throughput_ratio": gw["tok_s"] / eng["tok_s"],
        "gateway_total_s": gw["total_s"], "engine_total_s": eng["total_s"],
        "gateway_tok_s_rounds": [r["tok_s"] for r in gateway_rounds],
        "engine_tok_s_rounds": [r["tok_s"] for r in engine_rounds],
        "ttft_p50_added_ms": percentile(added["added"], 50), "ttft_p90_added_ms": percentile(added["added"], 90),
        "ttft_p50_added_way_in_ms": percentile(added["way_in"], 50),
        "ttft_p50_added_way_out_ms": percentile(added["way_out"], 50),
        "ttft_p50_ms_gateway": gw_ttft_ms, "ttft_p50_ms_engine": eng_ttft_ms,
        "ttft_p50_diff_ms": gw_ttft_ms - eng_ttft_ms,
        "ttft_p50_added_ms_c1": percentile(added_c1["added"], 50), "c1_requests": len(c1),
        "c1_prompt_len": C1_PROMPT_LEN,
        "wall_s": time.perf_counter() - start,
    }
    write_result("gateway", result, args.output)
    return result


if __name__ == "__main__":
    main()
