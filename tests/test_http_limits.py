"""The gateway's edge as a careless or hostile client meets it, over mocker workers: HEAD, OpenAI's default
`max_tokens` for legacy completions, the generation-time cap (the workers free what a capped request held),
and `dynctl serve` draining on SIGTERM. The HTTP server's own limits (sizes, timeouts) are in
test_http_server.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

MODEL = "SmolLM2-135M-Instruct"
REPO = Path(__file__).resolve().parents[1]
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}]}


@pytest.fixture(scope="module")
def mocker(make_mocker: Any) -> tuple[Any, Any]:
    """A mocker at 10x the cpu profile: about 11 ms a token, so seconds of generation are hundreds of tokens."""
    return make_mocker("edge0", mocker_speedup=10)


@pytest.fixture(scope="module")
def gateway(make_gateway: Any, mocker: tuple[Any, Any]) -> Any:
    return make_gateway(infos=[mocker[1]])


def _wait_idle(handle: Any, ray: Any) -> Any:
    """The worker's load once it runs and queues nothing (10 s at most)."""
    deadline_s = time.monotonic() + 10
    while True:
        load = ray.get(handle.load.remote())
        if load.num_running == 0 and load.num_waiting == 0 or time.monotonic() > deadline_s:
            return load
        time.sleep(0.05)


def test_head_answers_with_gets_headers_and_no_body(gateway: Any) -> None:
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as sock:
        sock.sendall(b"HEAD /health HTTP/1.1\r\nhost: x\r\n\r\nGET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        time.sleep(0.3)
        received = sock.recv(65536)
    head, _, rest = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    get = httpx.get(f"{gateway.url}/health", timeout=10)
    assert f"content-length: {len(get.content)}".encode() in head.lower()
    assert rest.startswith(b"HTTP/1.1 200")  # the HEAD's answer carried no body: the GET's comes next


def test_a_legacy_completion_without_max_tokens_gets_16_tokens(gateway: Any) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "ignore_eos": True}
    answer = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=60).json()
    assert answer["usage"]["completion_tokens"] == 16 and answer["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_ends_at_its_generation_cap_and_frees_its_worker(gateway: Any, mocker: Any, ray_instance: Any,
                                                                   stream: bool) -> None:
    # a chat keeps its default (the rest of the context: minutes at this speed); it asks for 0.6 s at most
    body = {**CHAT, "ignore_eos": True, "max_generation_s": 0.6, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    start = time.monotonic()
    response = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=60)
    elapsed_s = time.monotonic() - start
    assert response.status_code == 200
    if stream:
        events = [line[6:] for line in response.text.split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        usage = chunks[-1]["usage"]
        assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    else:
        answer = response.json()
        usage = answer["usage"]
        assert answer["choices"][0]["finish_reason"] == "length" and answer["choices"][0]["message"]["content"]
    assert 0.5 < elapsed_s < 5 and usage["completion_tokens"] > 16
    load = _wait_idle(*mocker[:1], ray_instance)
    assert (load.num_running, load.num_waiting) == (0, 0)  # aborted on the worker, not left generating


def test_the_server_cap_bounds_what_a_request_asks(make_gateway: Any, mocker: Any) -> None:
    capped = make_gateway(infos=[mocker[1]], max_generation_s=0.5)
    start = time.monotonic()
    answer = httpx.post(f"{capped.url}/v1/chat/completions", timeout=60,
                        json={**CHAT, "ignore_eos": True, "max_generation_s": 3600}).json()
    assert time.monotonic() - start < 4 and answer["choices"][0]["finish_reason"] == "length"


def test_a_cap_no_request_reaches_changes_nothing(gateway: Any) -> None:
    answer = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=60,
                        json={**CHAT, "ignore_eos": True, "max_tokens": 5, "max_generation_s": 30}).json()
    assert answer["usage"]["completion_tokens"] == 5 and answer["choices"][0]["finish_reason"] == "length"


def test_dynctl_serve_drains_on_sigterm(dynctl_serve_on_test_ray: Any, dynctl: str) -> None:
    """SIGTERM mid-stream: the listener closes at once, the stream runs to its end, the process exits 0."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # at 10x, 60 tokens take about 0.7 s: the stream is still running when the signal comes
    command = [dynctl, "serve", "--mocker", "cpu", "--mocker-speedup", "10", "--port", "0", "--shutdown-grace-s",
               "30"]
    with dynctl_serve_on_test_ray(command, 120, env) as served:
        url = f"http://127.0.0.1:{served.port}/v1/completions"
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 60, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        events: list[str] = []
        with httpx.stream("POST", url, json=body, timeout=60) as response:
            lines = response.iter_lines()
            events.append(next(line for line in lines if line.startswith("data: ")))
            process = _serving_process(served.port)
            os.kill(process, signal.SIGTERM)
            refused = threading.Event()
            threading.Thread(target=_until_refused, args=(served.port, refused), daemon=True).start()
            events.extend(line for line in lines if line.startswith("data: "))
        assert refused.wait(5), "the listener was still accepting after SIGTERM"
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 60 and chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert served.code == 0, served.rest


def _serving_process(port: int) -> int:
    """The pid listening on `port` (the dynctl process itself)."""
    import psutil

    for conn in psutil.net_connections("tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
            return conn.pid
    raise AssertionError(f"nothing listens on {port}")


def _until_refused(port: int, refused: threading.Event) -> None:
    deadline_s = time.monotonic() + 5
    while time.monotonic() < deadline_s:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        except ConnectionRefusedError:
            refused.set()
            return
        time.sleep(0.02)
