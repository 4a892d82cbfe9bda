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
   mocker server (`python -m dynserve.cli.mocker --http-port`, the same mocker behind the same HTTP
   code in one process). `added_p50_ms_c1` is the difference of the two p50 latencies: what the gateway
   hop and the router add.

The client keeps one connection per user, encodes every request before the clock starts, and reads a
streamed response by its chunk framing only (the first few responses of each phase are parsed in full
and checked: 16 tokens, a usage chunk, `[DONE]`), so its own CPU, which shares this machine's two cores,
stays small. The last stdout line is the JSON result; a copy goes to `benchmarks/results/`.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.frontend [--quick] [--worker-metrics on|off]
                                                            [--server ours|uvicorn|both]

`--server` picks the HTTP server in front of the same gateway app: ours (`gateway/http.py`, as served), or
uvicorn (httptools, uvloop) through `_UvicornGateway`, a benchmark-only ASGI adapter that hands the
completion routes the same `Exchange` calls; `both` runs a gateway process of each over the same mockers
and alternates their c32 and c1 phases (3 c32 rounds each; the medians and `uvicorn_over_ours` ratios).

With `--worker-metrics on` (the default, as served) the mockers record and serve their Prometheus metrics, and
a process of its own scrapes both endpoints every 50 ms during c32 (c32 lasts about a second: a production
scrape every 15 s would never land in it); `off` is the baseline `benchmarks.metrics_cost` compares it
with.

This VM's speed swings between phases a few minutes long, and req/s and every process's CPU per request,
the client's too, move with it: compare runs by the median of 3, and `added_p50_ms_c1` only against the
direct mocker of the same run. The measurements and their history: `docs/benchmarks.md` (frontend).
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

from benchmarks._http import read_chunked_body
from benchmarks._common import git_commit, log, machine_info, percentile, start_local_ray, write_result
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
        body = await read_chunked_body(self.reader)
        elapsed = time.perf_counter() - start
        if not body.endswith(_DONE):
            raise RuntimeError(f"the stream did not end with [DONE]: {body[-200:]!r}")
        if check:
            _check_stream(body)
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


def _gateway_process(settings_json: str, infos_bytes: bytes, ray_address: str, ports: Any,
                     server: str = "ours") -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import msgspec
    import ray

    from dynserve.config import Settings
    from dynserve.gateway.server import make_gateway_app, serve_app
    from dynserve.protocol import WorkerInfo

    ray.init(address=ray_address, log_to_driver=False)  # the embedded event plane lives in Ray
    settings = Settings.model_validate_json(settings_json)
    infos = msgspec.msgpack.decode(infos_bytes, type=list[WorkerInfo])
    app = make_gateway_app(settings, infos)
    if server == "ours":
        serve_app(app, settings, on_ready=ports.put)
    else:
        _serve_uvicorn(app, free_port(), ports)


class _AsgiExchange:
    """Benchmark only: the `Exchange` calls the completion routes make, over an ASGI request (its body read
    whole first). Writes become ASGI sends, awaited in order at `drain()` and when the handler returns."""

    def __init__(self, scope: dict[str, Any], body: bytes, send: Any, gone: Any) -> None:
        self.method, self.path = scope["method"].encode(), scope["path"].encode()
        self.query, self.body, self.gone = scope["query_string"], body, gone
        self.headers = dict(scope["headers"])
        self.answered, self.head_only, self.status = False, False, None
        self._send, self._sends = send, []

    def respond(self, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        self.status, self.answered = status, True
        self._sends.append(self._send({"type": "http.response.start", "status": status,
                                       "headers": [*headers, (b"content-length", b"%d" % len(body))]}))
        self._sends.append(self._send({"type": "http.response.body", "body": body}))

    def start_stream(self, status: int, headers: list[tuple[bytes, bytes]], first: bytes = b"") -> None:
        self.status, self.answered = status, True
        self._sends.append(self._send({"type": "http.response.start", "status": status, "headers": headers}))
        self.write(first)

    def write(self, data: bytes) -> None:
        if data:
            self._sends.append(self._send({"type": "http.response.body", "body": data, "more_body": True}))

    def end(self, last: bytes = b"") -> None:
        self._sends.append(self._send({"type": "http.response.body", "body": last}))

    async def drain(self) -> None:
        sends, self._sends = self._sends, []
        for send in sends:
            await send


class _UvicornGateway:
    """Benchmark only: the gateway app as one ASGI app (completion routes on their lean handler, the rest on
    FastAPI, which also runs the lifespan), for uvicorn to serve."""

    def __init__(self, gateway: Any) -> None:
        from dynserve.gateway.completions import COMPLETION_ROUTES

        self.gateway, self.routes = gateway, COMPLETION_ROUTES

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"].encode() not in self.routes:
            await self.gateway.api(scope, receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        exchange = _AsgiExchange(scope, body, send, asyncio.get_running_loop().create_future())
        await self.gateway.completions(exchange)
        await exchange.drain()


def _serve_uvicorn(gateway: Any, port: int, ports: Any) -> None:
    import threading

    import uvicorn

    from dynserve.gateway.server import _settle_garbage_collector

    config = uvicorn.Config(_UvicornGateway(gateway), host="127.0.0.1", port=port, loop="uvloop", http="httptools",
                            lifespan="on", log_level="warning", access_log=False)
    server = uvicorn.Server(config)

    def announce() -> None:
        while not server.started:
            time.sleep(0.05)
        _settle_garbage_collector()  # as serve_app does
        ports.put(port)

    threading.Thread(target=announce, daemon=True).start()
    server.run()


def _start_standalone_mocker(port: int, worker_metrics: bool) -> subprocess.Popen[bytes]:
    env = {**os.environ, "DYN_MOCKER_SPEEDUP": str(SPEEDUP), "DYN_WORKER_METRICS": str(worker_metrics).lower()}
    process = subprocess.Popen([sys.executable, "-m", "dynserve.cli.mocker", "--profile", "cpu",
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
    parser.add_argument("--server", choices=["ours", "uvicorn", "both"], default="ours",
                        help="the HTTP server in front of the gateway app (both: one gateway process of each, "
                        "their phases alternated) [default: ours]")
    parser.add_argument("--worker-metrics", choices=["on", "off"], default="on",
                        help="workers record and serve their Prometheus metrics (on: each one's endpoint is "
                        "scraped every 50 ms during c32, by a process of its own) [default: on]")
    return parser.parse_args(argv)


class _Scraper:
    """Reads each worker's metrics endpoint every `interval_s`, as Prometheus would, from a process of its own
    (as Prometheus is): its CPU competes for the machine's cores, not for the client's interpreter."""

    def __init__(self, urls: list[str], interval_s: float = 0.05) -> None:
        context = multiprocessing.get_context("spawn")
        self.urls, self.interval_s = urls, interval_s
        self._count = context.Value("i", 0)
        self._stop = context.Event()
        self._process = context.Process(target=_scrape_forever, daemon=True,
                                        args=(urls, interval_s, self._count, self._stop))
        self.num_scrapes = 0

    def __enter__(self) -> _Scraper:
        """Start scraping, and return once the first round is done (the process has started): `num_scrapes`
        counts only the scrapes from here to the exit."""
        if self.urls:
            self._process.start()
            deadline_s = time.monotonic() + 60
            while self._count.value < len(self.urls) and time.monotonic() < deadline_s:
                time.sleep(0.01)
        self._first = self._count.value
        return self

    def __exit__(self, *_exc: object) -> None:
        if self.urls:
            self._stop.set()
            self._process.join(10)
        self.num_scrapes = self._count.value - self._first


def _scrape_forever(urls: list[str], interval_s: float, count: Any, stop: Any) -> None:
    import urllib.request

    while not stop.wait(interval_s):
        for url in urls:
            with urllib.request.urlopen(url, timeout=5) as response:
                response.read()
            with count.get_lock():
                count.value += 1


def _c32(port: int, bodies: list[bytes], pids: dict[str, int]) -> dict[str, Any]:
    """One c32 phase against `port`, with each process's CPU per request over it."""
    import uvloop

    cpu_before = {name: _cpu_s(pid) for name, pid in pids.items()}
    result = uvloop.run(_load("127.0.0.1", port, bodies, CONCURRENCY))
    cpu = {name: round(1000 * (_cpu_s(pid) - cpu_before[name]) / (len(bodies) + CONCURRENCY), 3)
           for name, pid in pids.items()}
    cpu["total"] = round(sum(cpu.values()), 3)
    return {**result, "cpu_ms_per_request": cpu}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import msgspec
    import ray
    import uvloop

    from dynserve.config import Settings
    from dynserve.events.ray_plane import ACTOR_NAME, RAY_NAMESPACE
    from dynserve.workers.worker import launch_mocker

    num_c32, num_c1 = (1000, 200) if args.quick else (2000, 500)
    servers = ["ours", "uvicorn"] if args.server == "both" else [args.server]
    num_rounds = 3 if len(servers) > 1 else 1
    worker_metrics = args.worker_metrics == "on"
    settings = Settings(mocker="cpu", mocker_speedup=SPEEDUP, router="kv", port=0, seed=args.seed,
                        worker_metrics=worker_metrics)
    start = time.perf_counter()
    start_local_ray(num_cpus=2, object_store_memory=80 * 2**20, include_dashboard=False, log_to_driver=False)
    launched = [launch_mocker(settings, f"m{i}", publish_events=True) for i in range(2)]
    infos = ray.get([ref for _, ref in launched])
    context = multiprocessing.get_context("spawn")
    gateways: dict[str, Any] = {}
    ports: dict[str, int] = {}
    direct_port = free_port()
    direct = _start_standalone_mocker(direct_port, worker_metrics)
    try:
        for name in servers:
            queue: Any = context.Queue()
            gateways[name] = context.Process(target=_gateway_process, daemon=True, args=(
                settings.model_dump_json(), msgspec.msgpack.encode(infos), ray.get_runtime_context().gcs_address,
                queue, name))
            gateways[name].start()
            ports[name] = queue.get(timeout=120)
        log(f"2 mockers, gateway ({', '.join(servers)}) and a standalone mocker ready in "
            f"{time.perf_counter() - start:.1f}s")
        plane = ray.get_actor(ACTOR_NAME, namespace=RAY_NAMESPACE)  # the mockers' KV events go through it
        shared_pids = {"client": os.getpid(),
                       **{f"mocker{i}": ray.get(h.__ray_call__.remote(lambda _self: os.getpid()))
                          for i, (h, _) in enumerate(launched)},
                       "event_plane": ray.get(plane.__ray_call__.remote(lambda _self: os.getpid()))}
        scrape_urls = [f"http://{i.host}:{i.metrics_port}/metrics" for i in infos if i.metrics_port is not None]
        assert len(scrape_urls) == (2 if worker_metrics else 0), infos
        c32_rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
        with _Scraper(scrape_urls) as scraper:
            for round_index in range(num_rounds):  # alternated, so drift in machine speed hits both alike
                for name in servers:
                    bodies = _bodies(num_c32, args.seed + 1000 * round_index)
                    c32_rounds[name].append(_c32(ports[name], bodies,
                                                 {"gateway": gateways[name].pid, **shared_pids}))
                    last = c32_rounds[name][-1]
                    log(f"c32 through the gateway ({name}): {last['req_per_s']:.0f} req/s, p50 {last['p50_ms']:.1f} "
                        f"ms; CPU ms per request: {last['cpu_ms_per_request']}")
        c1_rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in [*servers, "direct"]}
        for round_index in range(2):  # interleaved, so drift in machine speed hits both alike
            for offset, name in enumerate(c1_rounds):
                target = direct_port if name == "direct" else ports[name]
                bodies = _bodies(num_c1 // 2, args.seed + 10 * round_index + offset)
                c1_rounds[name].append(uvloop.run(_load("127.0.0.1", target, bodies, 1)))
        c1_p50 = {name: min(r["p50_ms"] for r in rounds) for name, rounds in c1_rounds.items()}
        log(f"c1 p50 ms: {c1_p50}")
    finally:
        direct.terminate()
        for process in gateways.values():
            process.terminate()
            process.join(10)
        direct.wait(10)
        ray.shutdown()
    by_server = {}
    for name, rounds in c32_rounds.items():
        middle = sorted(rounds, key=lambda r: r["req_per_s"])[len(rounds) // 2]  # the median round
        by_server[name] = {
            "req_per_s_c32": middle["req_per_s"], "p50_ms_c32": middle["p50_ms"], "p90_ms_c32": middle["p90_ms"],
            "cpu_ms_per_request_c32": middle["cpu_ms_per_request"],
            "req_per_s_c32_rounds": [r["req_per_s"] for r in rounds],
            "gateway_cpu_ms_per_request_c32_rounds": [r["cpu_ms_per_request"]["gateway"] for r in rounds],
            "p50_ms_c1": c1_p50[name], "added_p50_ms_c1": c1_p50[name] - c1_p50["direct"],
        }
    first = by_server[servers[0]]
    result = {
        "benchmark": "frontend", "quick": args.quick, "seed": args.seed, "commit": git_commit(),
        "machine": machine_info(), "mocker_speedup": SPEEDUP, "output_tokens": NUM_TOKENS,
        "requests_c32": num_c32, "requests_c1": num_c1, "concurrency": CONCURRENCY, "server": args.server,
        "worker_metrics": worker_metrics, "worker_scrapes_c32": scraper.num_scrapes,
        "req_per_s_c32": first["req_per_s_c32"], "cpu_ms_per_request_c32": first["cpu_ms_per_request_c32"],
        "p50_ms_c32": first["p50_ms_c32"], "p90_ms_c32": first["p90_ms_c32"],
        "p50_ms_c1_gateway": first["p50_ms_c1"], "p50_ms_c1_direct": c1_p50["direct"],
        "added_p50_ms_c1": first["added_p50_ms_c1"],
        "c1_p50_ms_rounds": {k: [r["p50_ms"] for r in v] for k, v in c1_rounds.items()},
        "by_server": by_server,
    }
    if len(servers) > 1:
        ours, theirs = by_server["ours"], by_server["uvicorn"]
        result["uvicorn_over_ours"] = {
            "req_per_s_c32": theirs["req_per_s_c32"] / ours["req_per_s_c32"],
            "gateway_cpu_ms_per_request_c32": (theirs["cpu_ms_per_request_c32"]["gateway"]
                                               / ours["cpu_ms_per_request_c32"]["gateway"]),
            "p50_ms_c1": theirs["p50_ms_c1"] / ours["p50_ms_c1"]}
    write_result("frontend", result, args.output)
    return result


if __name__ == "__main__":
    main()
