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
  engine, gateway, engine, gateway so that drift in the machine's speed, which reaches ±30% between
  consecutive minutes on this VM, hits both alike) and `throughput_ratio` (gateway / engine); every
  round is listed in `*_tok_s_rounds`;
- `ttft_p50_added_ms`: the time the serving path adds before the first token, per request: the client's
  TTFT minus the worker's own arrival-to-first-token time for that very request (the worker records both
  on one monotonic clock), p50 over requests. This isolates HTTP, the gateway, tokenization and the
  channel from queueing inside the engine, which at 16 in flight is seconds long and varies by ±10% from
  run to run on this machine, far more than the few ms being measured;
- `ttft_p50_ms_gateway` / `ttft_p50_ms_engine` (and their difference, `ttft_p50_diff_ms`) for reference;
- `ttft_p50_added_ms_c1`: the same per-request measure at concurrency 1 with short prompts.

The client (`_http.py`) keeps one connection per simulated user and takes the send time when the request
bytes go to the socket, so the client's own request building is not charged to the server.

`--quick` (about 90 s) runs 16 requests with outputs of 32..64 tokens instead of 32 requests with 32..128.
The last stdout line is the JSON result; a copy goes to `benchmarks/results/gateway-<timestamp>.json`.

What moves `ttft_p50_added_ms` here (2026-11-22, per-request timestamps in the gateway and the worker):
- Half the requests of a full run, and all of a quick one, are sent 16 at once. The gateway takes them one
  after another, about 0.25 ms each (validation, preprocessing, routing, the channel write), so the
  16th leaves it about 4 ms after the first.
- Timestamps of the gateway's channel writes (one quick run, 2026-11-22, second session) put the wait in the
  gateway, not the worker: the worker read each request within 0.05-0.3 ms of the gateway writing it, while
  the gateway's first write of a burst came 1.0 and 3.9 ms after the client sent it (its wake-up, and the
  burst's requests parsed before the first one's task runs), then one every 0.1-0.3 ms. An earlier
  reading of the worker's arrival times alone had blamed its I/O thread. Tried that session, with no gain
  beyond the noise: engine niceness 19 against 5 (3 pairs; niceness 0 was worse, 12 ms), 0.1 ms EEVDF
  slices for the gateway's and the worker's loop threads, first tokens ahead of decode tokens in a step's
  output, the engine thread waiting up to 2 ms for the loop to take each step's output, and 1 torch thread
  (way in still 6 ms). On this VM a thread that sleeps for 0.2 ms wakes up to 4 ms late even on an idle
  machine (p99 0.64 ms), and the path has several such wake-ups (client, gateway, worker I/O).
- The way out (first token to client) is 2 to 3 ms at 16 in flight. Timestamped hop by hop in one quick run
  (medians after the engine thread made the token): the worker's loop wrote it at 1.0 ms, the gateway read
  it at 1.9 ms and wrote it at 2.0 ms, the client read it at 3.0 ms: each wake-up of the next process costs
  0.5-1.2 ms here, the work between them well under 0.1 ms.
- Full runs at one commit (7e55a70..37c627a) gave 5.4, 6.4 and 7.2 ms, quick runs 4.7 to 10.5 ms; at
  37b4a7c full runs gave 4.79, 7.10 and 7.11 ms (way in 1.9-4.1, way out 2.1-2.9), quick runs 4.6 to 10.2.
- Since ee96420 the engine thread writes each step's tokens to the connection itself (`FrameWriter`), so
  the worker's loop no longer wakes for them: the way out fell to 1.3-1.8 ms (probe rounds 1.33-1.63
  against 2.1-3.6 before; quick run 1.72 against 3.38 that morning). Full run at 6d4e1d3: 5.71 ms (way in
  4.27, way out 1.82), `throughput_ratio` 1.0. The way in is now most of it: the burst's requests leave
  the gateway together at the end of its loop pass (see `WorkerConnection._send` for why they are not sent
  one by one).
- 2026-11-23, per-request timestamps (the gateway's channel writes against the worker's arrivals), full
  run: in a burst the first request goes alone and the engine starts on it at once; the other 15 then
  cost the gateway 0.4-0.5 ms each (their validation and preparation alone take 0.09 ms on an idle
  machine), and went to the worker in one write 6.8-7.9 ms after the client sent them; in one burst the
  worker's loop read them 2.8 ms after that write, its engine thread computing. Requests sent one at a
  time while the engine decodes for the other 15 (the second half of a full run) reach the worker 0.2-4
  ms after they were sent, most of it in the gateway (0.4-3.2 ms), and their first token reaches the
  client 1.5-6 ms after the engine made it. So the p50 of a full run is set by requests arriving alone at
  a busy machine, and both of its hops are CPU contention with the engine on this machine's two cores.
  Full runs: at d5deb60 5.29 ms (way in 1.67, way out 2.23; `throughput_ratio` 0.87 in a run whose
  second rounds ran at 60% of the first: engine 54.8 then 33.2 tok/s, gateway 47.5 then 29.7) and 6.51
  (way in 4.87); at 695295d, in a fast phase of this VM, 4.49 (way in 2.26, way out 1.77, ratio 1.07)
  and 4.15 (1.38, 1.67, ratio 0.92). Quick runs that hour: 3.38 to 4.83.
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

from benchmarks._common import git_commit, log, machine_info, percentile, write_result
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
    ray.init(num_cpus=threads, object_store_memory=80 * 2**20, include_dashboard=False, log_to_driver=False)
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
