"""dynserve across machines: a Ray head and the gateway on host a, Ray worker nodes on hosts b and c, Redis on
host d, each host a network and PID namespace of its own (`benchmarks/_hosts.py`) on 198.18.0.0/24, with UCX
held to tcp. The test's own clients (the official `openai` client, httpx) run inside host a's network.

The tests run in file order on one cluster; the last one stops host c for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import needs

from benchmarks._hosts import Host, Hosts, RayCluster, dynctl_serve, missing
from dynserve.protocol import SamplingParams

pytestmark = pytest.mark.skipif(missing() is not None, reason=missing() or "")

DYNCTL = str(Path(sys.executable).parent / "dynctl")
MODEL = "SmolLM2-135M-Instruct"
# The head's GCS declares a node dead after 3 missed health checks a second apart (Ray's default: 5 of 3 s).
FAST_NODE_DEATH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3",
                   "RAY_health_check_timeout_ms": "1000"}


@pytest.fixture(scope="module")
@needs('netns', 'ray', 'fleet')
def fleet() -> Iterator[tuple[Hosts, RayCluster]]:
    """Hosts a-d; Ray: the head on a (0 CPUs), one worker node with 1 CPU on each of b and c."""
    with Hosts(4) as hosts, RayCluster(hosts, nodes={1: 1, 2: 1}, env=FAST_NODE_DEATH) as cluster:
        cluster.wait_for_nodes(3)
        yield hosts, cluster


@pytest.fixture(scope="module")
@needs('services')
def redis_on_d(fleet: tuple[Hosts, RayCluster]) -> Iterator[str]:
    """A real redis-server on host d, reachable by the other hosts at d's address only."""
    hosts, _cluster = fleet
    d = hosts[3]
    binary = shutil.which("redis-server")
    assert binary is not None, "redis-server is not installed (make setup installs it)"
    process = d.popen([binary, "--bind", d.ip, "--port", "6379", "--save", "", "--appendonly", "no",
                       "--protected-mode", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while (d.ip, 6379) not in [(address, port) for address, port, _name in d.listening()]:
        assert process.poll() is None and time.monotonic() < deadline, "redis-server did not start on host d"
        time.sleep(0.05)
    yield f"redis://{d.ip}:6379/0"
    process.terminate()
    process.wait(10)


@contextlib.contextmanager
def serving(fleet: tuple[Hosts, RayCluster], *flags: str) -> Iterator[str]:
    """`dynctl serve --ray-address` on host a with `flags`; yields the gateway's URL (on a's address)."""
    hosts, cluster = fleet
    with dynctl_serve(cluster, hosts[0], *flags) as url:
        yield url


def _metric(text: str, name: str, **labels: str) -> float:
    """Sum of `name`'s samples whose labels include `labels`."""
    total = 0.0
    for match in re.finditer(rf"^{name}(?:\{{([^}}]*)\}})? (\S+)$", text, re.MULTILINE):
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(2))
    return total


def _metrics(a: Host, url: str) -> str:
    return a.call(lambda: httpx.get(f"{url}/metrics", timeout=10).text)


def _dynserve_sockets(host: Host) -> list[tuple[str, int, str]]:
    """(address, port, process) of the listening sockets of dynserve's Ray actors on `host`."""
    return [s for s in host.listening() if s[2].startswith(("ray::EngineWork", "ray::EventPlane"))]


def _is_loopback(address: str) -> bool:
    return address.startswith("127.") or address in ("::1", "localhost")


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


# ---- aggregated: mockers on b and c ------------------------------------------------------------------------

def _aggregated_checks(url: str) -> dict[str, Any]:
    """Chat, streaming and completions through the official client; repeated long prompts. Runs on host a."""
    client = _client(url)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello!"}],
                                          max_tokens=8)
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 8
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count."}],
                                            max_tokens=8, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 8
    completion = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8)
    assert completion.choices[0].text and completion.usage.completion_tokens == 8
    # Distinct long prompts sent together (the router spreads them), then each again: a repeat goes to the
    # worker whose KV events said it holds the prompt, whichever host that is.
    prompts = [" ".join(f"topic{t} word{i}" for i in range(150)) for t in range(6)]

    async def first_round() -> list[Any]:
        async_client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(async_client.completions.create(model=MODEL, prompt=p, max_tokens=32)
                                          for p in prompts))
        finally:
            await async_client.close()

    firsts = asyncio.run(first_round())
    time.sleep(0.5)  # the workers' KV events reach the router
    repeats = [client.completions.create(model=MODEL, prompt=p, max_tokens=2) for p in prompts]
    return {"firsts": firsts, "repeats": repeats}


@pytest.mark.parametrize("plane", ["embedded", pytest.param("redis", marks=pytest.mark.services)])
def test_aggregated_mockers_on_two_hosts(fleet: tuple[Hosts, RayCluster], plane: str,
                                         request: pytest.FixtureRequest) -> None:
    hosts, _cluster = fleet
    a, b, c = hosts[0], hosts[1], hosts[2]
    flags = ["--mocker", "cpu", "--workers", "2", "--mocker-speedup", "10"]
    if plane == "redis":
        flags += ["--redis-url", request.getfixturevalue("redis_on_d")]
    with serving(fleet, *flags) as url:
        # one worker on each of b and c (the pool spreads its workers), serving on its host's address only
        for host in (b, c):
            sockets = _dynserve_sockets(host)
            assert any(address == host.ip and "EngineWork" in process for address, _port, process in sockets), \
                (host.name, sockets)
            assert not [s for s in sockets if _is_loopback(s[0])], sockets
        result = a.call(lambda: _aggregated_checks(url))
        for first, repeat in zip(result["firsts"], result["repeats"], strict=True):
            assert first.usage.prompt_tokens == repeat.usage.prompt_tokens
            assert repeat.usage.prompt_tokens_details.cached_tokens >= repeat.usage.prompt_tokens - 16, repeat.usage
        metrics = _metrics(a, url)
        assert _metric(metrics, "dynserve_router_index_workers") == 2  # both hosts' events are in the index
        routed = {m.group(1) for m in re.finditer(
            r'dynserve_router_routed_requests_total\{pool="both",worker_id="([^"]+)"\}', metrics)}
        assert len(routed) == 2, metrics
        # the workers' metrics: announced at their hosts' addresses, scraped from the gateway's host
        targets = a.call(lambda: httpx.get(f"{url}/metrics/targets", timeout=10).json())
        workers = [t["targets"][0] for t in targets if t["labels"]["component"] == "worker"]
        assert sorted(w.rsplit(":", 1)[0] for w in workers) == sorted([b.ip, c.ip]), targets
        for address in workers:
            text = a.call(lambda address=address: httpx.get(f"http://{address}/metrics", timeout=10).text)
            assert "dynserve_worker_step_duration_seconds_count" in text


# ---- disaggregated: prefill on one host, decode on the other ------------------------------------------------

# prompts of 5, 49 and 81 tokens: under one block of 16, then three and five whole blocks with a partial one
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea. " * 6,
    "The quick brown fox jumps over the lazy dog. " * 8,
]
# A tiny random-weight Llama with the real model's vocabulary and its KV geometry (30 layers, 3 KV heads of 64,
# fp32: 737,280 bytes a block), so a read moves the bytes the real model's would. Untied embeddings and weights
# of 0.3 (not 0.1) make its greedy tokens follow the context: with a block of the 49- or 81-token prompt zeroed
# after prefill, its decode differs within four tokens (the real model's within two, or not at all for the
# 81-token prompt's first block), where a tied or 0.1 one let a missing last block through.
TINY_LLAMA = {"hidden_size": 96, "num_hidden_layers": 30, "num_attention_heads": 3, "num_key_value_heads": 3,
              "head_dim": 64, "tie_word_embeddings": False, "initializer_range": 0.3}


@pytest.fixture(scope="module")
def tiny_llama() -> tuple[str, list[str]]:
    """The tiny Llama's path and its greedy answers to `PROMPTS` from an aggregated engine in this process
    (the reference both transfer backends must match)."""
    from _tiny_models import tiny_model

    from dynserve.config import Settings
    from dynserve.engine.llm_engine import LLMEngine

    path = str(tiny_model("llama", **TINY_LLAMA))
    engine = LLMEngine(Settings(model=path, dtype="float32", device="cpu", kv_blocks=256))
    return path, [engine.generate([p], SamplingParams(max_tokens=12, temperature=0))[0].text for p in PROMPTS]


# NIXL (what `--transfer-backend auto` picks) and TCP, both over the tiny Llama: its pages cross hosts as the
# real model's would (the same layers, KV heads and bytes a block), and its workers start and decode in a
# fraction of the real model's time (the NIXL case took 40 s with the real model in a clean clone,
# 2026-11-29).
@pytest.mark.parametrize("backend", ["nixl", "tcp"])
def test_disaggregated_decode_reads_pages_across_hosts(fleet: tuple[Hosts, RayCluster], backend: str,
                                                       tiny_llama: tuple[str, list[str]]) -> None:
    from dynserve.model.resolve import model_id_of

    hosts, _cluster = fleet
    a, b, c = hosts[0], hosts[1], hosts[2]
    path, expected = tiny_llama
    model, model_flags = model_id_of(Path(path)), ["--model", path]
    flags = ["--prefill-workers", "1", "--decode-workers", "1", "--kv-blocks", "256", "--transfer-backend", backend,
             "--disagg-local-prefill-tokens", "0", "--dtype", "float32", *model_flags]
    with serving(fleet, *flags) as url:
        placed = {host.name: _dynserve_sockets(host) for host in (b, c)}
        assert all(placed.values()), placed  # prefill on one host, decode on the other
        # the channel and, with tcp, the KV page server: on the host's address, never loopback
        assert not [s for sockets in placed.values() for s in sockets if _is_loopback(s[0])], placed
        if backend == "tcp":
            assert all(len({port for address, port, _p in sockets if address == host.ip}) >= 2
                       for host, sockets in zip((b, c), placed.values(), strict=True)), placed

        def run() -> list[tuple[str, str]]:
            client = _client(url)
            answers = []
            for prompt in PROMPTS:
                whole = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
                chunks = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                                   stream=True)
                answers.append((whole.choices[0].text, "".join(c.choices[0].text for c in chunks if c.choices)))
            return answers

        for (whole, streamed), want in zip(a.call(run), expected, strict=True):
            assert whole == want and streamed == want
        metrics = _metrics(a, url)
        assert _metric(metrics, "dynserve_disagg_requests_total", path="remote") == 2 * len(PROMPTS)
        assert _metric(metrics, "dynserve_disagg_fallbacks_total") == 0, metrics


# ---- a host lost under load ---------------------------------------------------------------------------------

class _Load:
    """Streaming chats from host a, `concurrency` at a time, until stopped; each outcome with its times."""

    def __init__(self, a: Host, url: str, concurrency: int = 6) -> None:
        self.a, self.url, self.concurrency = a, url, concurrency
        self.outcomes: list[tuple[float, float, bool, int, str]] = []  # start, end, ok, tokens seen, error
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: a.call(lambda: asyncio.run(self._run()), timeout_s=900))

    def __enter__(self) -> _Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(120)

    async def _run(self) -> None:
        client = openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)
        try:
            await asyncio.gather(*(self._loop(client, i) for i in range(self.concurrency)))
        finally:
            await client.close()

    async def _loop(self, client: openai.AsyncOpenAI, index: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            start, tokens, error = time.monotonic(), 0, ""
            try:
                stream = await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"client {index} request {n}"}],
                    max_tokens=24, stream=True)
                async for chunk in stream:
                    tokens += bool(chunk.choices and chunk.choices[0].delta.content)
                ok = tokens > 0
            except Exception as exc:  # counted: the test bounds which requests may fail
                ok, error = False, repr(exc)
            self.outcomes.append((start, time.monotonic(), ok, tokens, error))


def test_a_lost_host_is_replaced_and_serving_goes_on(fleet: tuple[Hosts, RayCluster]) -> None:
    hosts, _cluster = fleet
    a, b, c = hosts[0], hosts[1], hosts[2]
    with serving(fleet, "--mocker", "cpu", "--workers", "2", "--mocker-speedup", "4") as url:
        assert _dynserve_sockets(c), "no worker on host c"
        with _Load(a, url) as load:
            time.sleep(4)
            lost_at = time.monotonic()
            hosts.pull_plug(c)  # silently: its link first, then raylet, workers and every socket of the host
            deadline = lost_at + 60
            while True:  # the pool starts a replacement on the host that remains
                engines = [s for s in _dynserve_sockets(b) if "EngineWork" in s[2] and s[0] == b.ip]
                # two workers, each listening on its channel and its metrics port
                if len(engines) == 4 and _metric(_metrics(a, url), "dynserve_gateway_worker_up") == 2:
                    break
                assert time.monotonic() < deadline, (engines, _metrics(a, url))
                time.sleep(0.5)
            replaced_s = time.monotonic() - lost_at
            time.sleep(3)  # serving goes on with both workers on b
        after = [o for o in load.outcomes if o[0] > lost_at + replaced_s]
        assert len(after) >= 10 and all(ok for _s, _e, ok, _t, _err in after), after
        # only requests in flight on c when it went, that had streamed tokens already, may fail
        failed = [o for o in load.outcomes if not o[2]]
        assert all(start <= lost_at <= end and tokens > 0 for start, end, _ok, tokens, _err in failed), failed
        assert len(failed) <= load.concurrency
        before = [o for o in load.outcomes if o[1] < lost_at]
        assert before and all(o[2] for o in before)
