"""What the front end costs: the gateway with its KV router in front of 2 mockers, against a mocker's own
HTTP endpoint, in one run.

The mockers (`dynserve.workers.mocker`: the real scheduler, block manager and KV events, no model) run at
a high speedup, so the model's time is near zero and what is measured is the serving layer itself:
HTTP, validation, chat template, tokenization, routing, the worker channel, detokenization and SSE.

1. **c32**: the gateway (its own process, `kv` router over the embedded event plane, as `dynctl serve`
   runs it) in front of 2 mocker workers (Ray actors); `--requests` streamed chat completions (16-token
   outputs, short distinct prompts) with 32 in flight. Reported: `req_per_s_c32`, `p50_ms_c32`,
   `p90_ms_c32` (request latency to `[DONE]`), and `cpu_ms_per_request_c32`: the CPU time each process
   (gateway, each mocker, the embedded event plane's actor, the client) spent per request, and their
   `total`, which, unlike wall time, other load on the machine barely moves. On 2 cores the total bounds
   the rate: 2,000 ms / total.
2. **c1**: 500 requests one after another through the same gateway, and 500 straight to one standalone
   mocker server (`python -m dynserve.workers.mocker --http-port`, the same mocker behind the same HTTP
   code in one process). `added_p50_ms_c1` is the difference of the two p50 latencies: what the gateway
   hop and the router add.

The client keeps one connection per user, encodes every request before the clock starts, and reads a
streamed response by its chunk framing only (the first few responses of each phase are parsed in full
and checked: 16 tokens, a usage chunk, `[DONE]`), so its own CPU, which shares this machine's two cores,
stays small. The last stdout line is the JSON result; a copy goes to `benchmarks/results/`.

Measured here after the inline loop began coalescing a fast engine's tokens (2026-11-22, full runs; this
VM runs in a fast and a slow phase a few minutes long, and every process's CPU per request, the client's
too, moves with it):
- 2 mockers at speedup 1000 step every 0.1-0.2 ms with 2-3 sequences (5,000-7,000 steps per 1,000
  requests): one frame per step cost the worker's write, the gateway's read and wake-ups and the
  client's writes per step. With the tokens of up to 0.5 ms of steps sent together (and the engine's
  per-token work cut to 0.68x): 1,048, 1,374, 1,200 req/s against 1,012, 998, 990 at the commit before,
  interleaved (1 ms window); 0.5 ms window: 981, 880, 764 (slow phase, CPU total 2.0-2.5 ms), 828 and
  1,400 (total 2.33 and 1.41 ms).
- `added_p50_ms_c1` rose with it: the single-process mocker, which read every frame on the loop that
  also steps its engine, got faster (p50 3.0 to 1.7-2.0 ms) more than the gateway's path (3.0 to 1.8-3.4
  ms), whose two extra wake-ups it now pays alone: 0.12 to 1.22 ms (0.12 in the fast-phase run, 0.48
  to 1.22 in slow ones), against -0.51 to 0.19 before.
- With the gateway's frames to a worker written once per pass of its loop (dae4e93), three full runs:
  1,290, 1,296 and 1,194 req/s (p50 24.7, 23.4, 27.0 ms; CPU total 1.44, 1.39, 1.53 ms: gateway
  0.61-0.70, mockers 0.24-0.28 each, event plane 0.14-0.16, client 0.12-0.14), `added_p50_ms_c1` 0.06,
  0.07 and 0.33 (direct 1.71-1.79 ms, gateway 1.77-2.27). Three more, in a slow phase (the client's
  CPU 0.15-0.17 ms a request against 0.12-0.14): 986, 1,070, 1,197 req/s, c1 0.72, 0.39, -0.03.
- KV events published at most every 50 ms (1f9cf28), three full runs in a slow phase: 1,073, 1,058, 964
  req/s (CPU total 1.66-1.75 ms: gateway 0.80-0.86, mockers 0.26-0.30 each, event plane 0.12-0.14, client
  0.16-0.17), c1 0.72, 0.22, 0.08. The gateway, one process, now uses 0.85 of a core at 1,070 req/s: it is
  the next bound, ahead of the machine's two cores.
- 2026-11-23, the worker's engine-thread writes (`FrameWriter`, used by the mockers from their loop):
  full run at 6d4e1d3 in a slow phase (client 0.18 ms a request): 891 req/s, CPU total 1.87 ms, c1 1.16
  (direct 2.25 and 2.12 ms, gateway 3.28 and 3.31). Quick runs interleaved with 3f8e63e: c1 0.54 and
  1.02 against -0.05 and 0.43 (and 0.55, 0.97, 0.41, 0.45 against 0.65, 0.37, 0.67, 0.56 in four pairs
  with requests also sent one by one); req/s 986 and 1,105 against 749 and 865. Sending each request at
  once doubled the mockers' steps (see `WorkerConnection._send`), so requests still wait for the end of
  the gateway's pass.
- 2026-11-23, later: the embedded event plane called over its own socket, not as Ray calls (its actor's
  CPU 0.11-0.15 -> 0.02-0.05 ms a request), chat role chunks sent with the first token, ASCII prompts
  tokenized without the library's regex, lighter per-request metrics. Full runs at d5deb60 in a fast
  phase: 1,195, 1,251 and 1,579 req/s (CPU total 1.39, 1.30, 1.10 ms; in the last: gateway 0.55, mockers
  0.22 and 0.21, event plane 0.02, client 0.10), c1 0.32, 0.08, 0.24 (direct 1.81-4.09 ms); interleaved
  with 92832fe (before the metrics and validation changes): 1,144, 1,553, 1,038 req/s, c1 0.20, 0.00,
  0.35. In a slow phase half an hour before (client 0.13-0.18 ms a request): 1,064, 661, 879 and 625
  req/s, c1 2.13, 3.67, 2.29, 1.54, with the direct mocker's own p50 moving between 1.8 and 6.6 ms from
  one round to the next. At 695295d (fast phase): 1,294 and 1,349 req/s (CPU total 1.32, 1.25 ms), c1
  -0.07 and 0.00.

Measured here earlier (2026-11-22, `--quick`, a slow day on this VM: steal and load from the host):
- mockers stepping on their event loop (`InlineEngineLoop`) against their own engine thread, 4 interleaved
  pairs: 594-670 req/s (mean 641) against 458-732 (mean 593); a mocker's CPU 0.57-0.76 ms per request
  against 0.64-0.96; `added_p50_ms_c1` 0.10-1.27 (mean 0.70) against 0.94-1.87 (mean 1.43);
- one run: 576 req/s, CPU ms per request gateway 1.28, mockers 0.84 + 0.71, event plane 0.32, client 0.25,
  total 3.40, so 2,000 / 3.40 = 588 req/s is all two cores can do. 1,100 req/s needs a total under about
  1.8 ms; the gateway alone is 1.1-1.3 ms today (0.75-0.8 ms on a quiet day), two thirds of it Python per
  request (validation, chat template, tokenizer, routing, SSE) and the rest socket writes;
- a full run (af6076b): 646 req/s at c32 (p50 48 ms), CPU total 2.94 ms per request (gateway 1.20);
  `added_p50_ms_c1` 0.43 (direct 3.97 and 4.45 ms, gateway 4.52 and 4.40 in the two interleaved rounds:
  the rounds differ by as much as the gateway adds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._common import git_commit, log, machine_info, percentile, write_result
from benchmarks._services import free_port

SPEEDUP = 1000.0
NUM_TOKENS = 16
CONCURRENCY = 32
MODEL = "SmolLM2-135M-Instruct"
_DONE = b"data: [DONE]\n\n"


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _bodies(num: int, seed: int) -> list[bytes]:
    """Short chat requests, each with its own first words (distinct prompts, as users send)."""
    return [json.dumps({"model": MODEL, "messages": [{"role": "user", "content": f"Request {seed}-{i}: say hello."}],
                        "max_tokens": NUM_TOKENS, "stream": True, "stream_options": {"include_usage": True}}).encode()
            for i in range(num)]


class _Client:
    """One keep-alive HTTP/1.1 connection reading streamed answers by their chunk framing."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> _Client:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    def request(self, body: bytes) -> bytes:
        return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n" % len(body)) + body

    async def send(self, request: bytes, check: bool = False) -> float:
        """Send one request and read its whole answer; returns the seconds it took."""
        assert self.reader is not None and self.writer is not None
        start = time.perf_counter()
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"status {head.splitlines()[0]!r}: {await self.reader.read(500)!r}")
        body = bytearray()
        while True:
            size = int((await self.reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
            piece = await self.reader.readexactly(size + 2)
            if size == 0:
                break
            body += piece[:-2]
        elapsed = time.perf_counter() - start
        if not body.endswith(_DONE):
            raise RuntimeError(f"the stream did not end with [DONE]: {bytes(body[-200:])!r}")
        if check:
            _check_stream(bytes(body))
        return elapsed

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _check_stream(body: bytes) -> None:
    chunks = [json.loads(e[6:]) for e in body.split(b"\n\n") if e.startswith(b"data: {")]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    if not usage or usage[-1]["completion_tokens"] != NUM_TOKENS:
        raise RuntimeError(f"expected a usage chunk with {NUM_TOKENS} completion tokens, got {usage}")


async def _load(host: str, port: int, bodies: list[bytes], concurrency: int) -> dict[str, Any]:
    clients = [await _Client(host, port).open() for _ in range(concurrency)]
    requests = [clients[0].request(b) for b in bodies]
    for client, request in zip(clients, requests, strict=False):  # each connection warmed, answers checked
        await client.send(request, check=True)
    latencies: list[float] = []
    next_index = 0

    async def user(client: _Client) -> None:
        nonlocal next_index
        while next_index < len(requests):
            index, next_index = next_index, next_index + 1
            latencies.append(await client.send(requests[index]))

    start = time.perf_counter()
    await asyncio.gather(*(user(c) for c in clients))
    wall_s = time.perf_counter() - start
    for client in clients:
        await client.close()
    return {"req_per_s": len(latencies) / wall_s, "wall_s": wall_s,
            "p50_ms": 1000 * percentile(latencies, 50), "p90_ms": 1000 * percentile(latencies, 90)}


def _gateway_process(settings_json: str, infos_bytes: bytes, ray_address: str, ports: Any) -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import msgspec
    import ray

    from dynserve.config import Settings
    from dynserve.gateway.server import make_gateway_app, serve_app
    from dynserve.protocol import WorkerInfo

    ray.init(address=ray_address, log_to_driver=False)  # the embedded event plane lives in Ray
    settings = Settings.model_validate_json(settings_json)
    infos = msgspec.msgpack.decode(infos_bytes, type=list[WorkerInfo])
    serve_app(make_gateway_app(settings, infos), settings, on_ready=ports.put)


def _start_standalone_mocker(port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "DYN_MOCKER_SPEEDUP": str(SPEEDUP)}
    process = subprocess.Popen([sys.executable, "-m", "dynserve.workers.mocker", "--profile", "cpu",
                                "--http-port", str(port)], env=env, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return process
        except OSError:
            if process.poll() is not None:
                raise RuntimeError("the standalone mocker exited") from None
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("the standalone mocker did not start")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.frontend", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1,000 requests at c32 and 200 at c1 (about a minute)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import msgspec
    import ray
    import uvloop

    from dynserve.config import Settings
    from dynserve.events.ray_plane import ACTOR_NAME, RAY_NAMESPACE
    from dynserve.workers.mocker import launch_mocker

    num_c32, num_c1 = (1000, 200) if args.quick else (2000, 500)
    settings = Settings(mocker="cpu", mocker_speedup=SPEEDUP, router="kv", port=0, seed=args.seed)
    start = time.perf_counter()
    ray.init(num_cpus=2, object_store_memory=80 * 2**20, include_dashboard=False, log_to_driver=False)
    launched = [launch_mocker(settings, f"m{i}", publish_events=True) for i in range(2)]
    infos = ray.get([ref for _, ref in launched])
    ports: Any = multiprocessing.get_context("spawn").Queue()
    gateway = multiprocessing.get_context("spawn").Process(
        target=_gateway_process, daemon=True,
        args=(settings.model_dump_json(), msgspec.msgpack.encode(infos), ray.get_runtime_context().gcs_address, ports))
    gateway.start()
    direct_port = free_port()
    direct = _start_standalone_mocker(direct_port)
    try:
        port = ports.get(timeout=120)
        log(f"2 mockers, gateway and a standalone mocker ready in {time.perf_counter() - start:.1f}s")
        plane = ray.get_actor(ACTOR_NAME, namespace=RAY_NAMESPACE)  # the mockers' KV events go through it
        pids = {"gateway": gateway.pid, "client": os.getpid(),
                **{f"mocker{i}": ray.get(h.__ray_call__.remote(lambda _self: os.getpid()))
                   for i, (h, _) in enumerate(launched)},
                "event_plane": ray.get(plane.__ray_call__.remote(lambda _self: os.getpid()))}
        cpu_before = {name: _cpu_s(pid) for name, pid in pids.items()}
        c32 = uvloop.run(_load("127.0.0.1", port, _bodies(num_c32, args.seed), CONCURRENCY))
        cpu_ms_per_request = {name: round(1000 * (_cpu_s(pid) - cpu_before[name]) / (num_c32 + CONCURRENCY), 3)
                              for name, pid in pids.items()}
        cpu_ms_per_request["total"] = round(sum(cpu_ms_per_request.values()), 3)
        log(f"c32 through the gateway: {c32['req_per_s']:.0f} req/s, p50 {c32['p50_ms']:.1f} ms; "
            f"CPU ms per request: {cpu_ms_per_request}")
        c1_rounds: dict[str, list[dict[str, Any]]] = {"gateway": [], "direct": []}
        for round_index in range(2):  # interleaved, so drift in machine speed hits both alike
            for name, target in (("gateway", port), ("direct", direct_port)):
                bodies = _bodies(num_c1 // 2, args.seed + 10 * round_index + (name == "direct"))
                c1_rounds[name].append(uvloop.run(_load("127.0.0.1", target, bodies, 1)))
        gw_c1 = min(r["p50_ms"] for r in c1_rounds["gateway"])
        direct_c1 = min(r["p50_ms"] for r in c1_rounds["direct"])
        log(f"c1: gateway p50 {gw_c1:.2f} ms, direct p50 {direct_c1:.2f} ms")
    finally:
        direct.terminate()
        gateway.terminate()
        gateway.join(10)
        direct.wait(10)
        ray.shutdown()
    result = {
        "benchmark": "frontend", "quick": args.quick, "seed": args.seed, "commit": git_commit(),
        "machine": machine_info(), "mocker_speedup": SPEEDUP, "output_tokens": NUM_TOKENS,
        "requests_c32": num_c32, "requests_c1": num_c1, "concurrency": CONCURRENCY,
        "req_per_s_c32": c32["req_per_s"], "cpu_ms_per_request_c32": cpu_ms_per_request, "p50_ms_c32": c32["p50_ms"], "p90_ms_c32": c32["p90_ms"],
        "p50_ms_c1_gateway": gw_c1, "p50_ms_c1_direct": direct_c1, "added_p50_ms_c1": gw_c1 - direct_c1,
        "c1_p50_ms_rounds": {k: [r["p50_ms"] for r in v] for k, v in c1_rounds.items()},
    }
    write_result("frontend", result, args.output)
    return result


if __name__ == "__main__":
    main()
