"""Two real vLLM servers (its CPU build, `.venv-vllm`: `scripts/setup-peers.sh vllm`) behind dynserve's gateway
(`dynctl gateway --worker-url`, KV events on), through the official `openai` client: chat, streaming and
completions; a repeated prefix lands on the server that caches it; a server killed mid-stream costs the client
nothing (greedy: the text equals the undisturbed run's). `make test-peers` runs these; `make test` leaves them
out (they need vLLM and a few minutes)."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import banner_port, needs, stop_by_sigint, wait_for_line

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
@needs("peers")
def vllm_gateway(dynctl: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[Any], str]]:
    from benchmarks._vllm import VLLM_VENV, vllm_fleet, worker_url
    from benchmarks.vs_vllm import ensure_model_dir

    python = VLLM_VENV / "bin" / "python"
    assert (VLLM_VENV / ".dynserve-vllm").exists(), "vLLM is not set up: run scripts/setup-peers.sh vllm"
    model_dir = ensure_model_dir(None, "float32")  # float32: a continuation elsewhere is greedy-exact
    flags = ["--dtype", "float32", "--block-size", "32", "--enable-prefix-caching", "--max-model-len", "2048",
             "--enable-prompt-tokens-details", "--seed", "0"]
    # one core each, 1 GiB of KV cache each
    envs = [{"VLLM_CPU_OMP_THREADS_BIND": str(i), "VLLM_CPU_KVCACHE_SPACE": "1"} for i in range(2)]
    log_dir = tmp_path_factory.mktemp("vllm")
    with vllm_fleet(python, model_dir, model_dir.name, flags, num=2, log_dir=log_dir, envs=envs) as servers:
        command = [dynctl, "gateway", "--port", "0", "--model", str(model_dir), "--router", "kv",
                   *(f"--worker-url={worker_url(s, f'vllm-{i}')}" for i, s in enumerate(servers))]
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True)
        try:
            banner = wait_for_line(process, "dynserve gateway: serving", timeout_s=120)
            print(banner)
            yield f"http://127.0.0.1:{banner_port(banner)}", servers, model_dir.name
        finally:
            stop_by_sigint(process)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def _series(server: Any, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE))


def test_chat_streaming_and_completions(vllm_gateway: tuple[str, list[Any], str]) -> None:
    url, _servers, model = vllm_gateway
    client = _client(url)
    chat = client.chat.completions.create(model=model, max_tokens=12, temperature=0,
                                          messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert chat.choices[0].message.content and chat.usage.completion_tokens <= 12
    print("chat:", repr(chat.choices[0].message.content), chat.usage)
    chunks = list(client.chat.completions.create(model=model, max_tokens=8, temperature=0, stream=True,
                                                 stream_options={"include_usage": True},
                                                 messages=[{"role": "user", "content": "Count to five."}]))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage.completion_tokens == 8
    print("stream:", repr(text))
    completion = client.completions.create(model=model, prompt="The three primary colors are", max_tokens=10,
                                           temperature=0, logprobs=2)
    assert completion.choices[0].text and len(completion.choices[0].logprobs.tokens) == 10
    print("completion:", repr(completion.choices[0].text))


def test_a_repeated_prefix_lands_on_the_server_that_caches_it(vllm_gateway: tuple[str, list[Any], str]) -> None:
    url, servers, model = vllm_gateway
    client = _client(url)
    system = "You are a meticulous assistant for a library. " + "Keep answers short and factual. " * 20
    before = [_series(s, "vllm:prefix_cache_hits_total") for s in servers]
    for question in ("Who wrote Hamlet?", "When did it open?", "Where is it?"):
        client.chat.completions.create(model=model, max_tokens=4, temperature=0, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": question}])
    hits = [_series(s, "vllm:prefix_cache_hits_total") - b for s, b in zip(servers, before, strict=True)]
    print("prefix-cache hits per server:", hits)
    assert sorted(hits)[0] == 0 and sorted(hits)[1] >= 2 * 128  # one server had all of them: the later turns


def test_a_server_killed_mid_stream_costs_the_client_nothing(vllm_gateway: tuple[str, list[Any], str]) -> None:
    from benchmarks._vllm import kill

    url, servers, model = vllm_gateway
    client = _client(url)
    prompt = "Here is a long story about a dragon who learned to bake bread. Once upon a time,"
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=48, temperature=0).choices[0].text
    pieces, killed = [], None
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=48, temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].text:
            pieces.append(chunk.choices[0].text)
        if len(pieces) == 6 and killed is None:
            killed = next(s for s in servers if _series(s, "vllm:num_requests_running") > 0)
            kill(killed)
    print("undisturbed:", repr(whole))
    print("migrated:   ", repr("".join(pieces)))
    assert killed is not None and "".join(pieces) == whole
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert re.search(r'^dynserve_migrations_total\{reason="worker_failed"\} 1\.0$', metrics, re.MULTILINE)
