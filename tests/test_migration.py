"""Migration end to end: a real model worker killed while it streams a request costs the client nothing. The
gateway resubmits the request to another worker with the prompt plus the tokens already sent; the client's
stream goes on with no gap and no repeat, its usage counted over both workers, and a greedy answer equals an
undisturbed run (which needs a real model). The dispatch itself (migration limits, aborts, a decode worker
lost after a remote prefill) is proved on scripted channels in `test_dispatcher.py`."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from conftest import needs

from dynserve.config import Settings
from dynserve.protocol import SamplingParams

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Here is a long story about a dragon who learned to bake bread. Once upon a time,"
MAX_TOKENS = 40
REAL = {"dtype": "float32", "device": "cpu", "kv_blocks": 256, "num_threads": 1, "namespace": "migration"}


@pytest.fixture(scope="module")
@needs('model')
def workers(ray_instance: Any) -> Iterator[list[tuple[Any, Any]]]:
    """Two real workers in their own namespace: (handle, info) each."""
    from dynserve.workers.worker import launch_worker

    settings = Settings(**REAL)
    launched = [launch_worker(settings, f"mig-{i}", "both", num_cpus=0.1, publish_events=False) for i in range(2)]
    infos = ray_instance.get([ref for _handle, ref in launched], timeout=600)
    yield [(handle, info) for (handle, _ref), info in zip(launched, infos, strict=True)]
    for handle, _ref in launched:
        ray_instance.kill(handle)


def _busy(ray: Any, candidates: list[tuple[Any, Any]]) -> Any:
    """The handle of the candidate running a request now."""
    for handle, _info in candidates:
        if ray.get(handle.load.remote()).num_running > 0:
            return handle
    raise AssertionError("no worker is running the request")


def _stream_killing_midway(url: str, ray: Any, candidates: list[tuple[Any, Any]]) -> tuple[str, Any]:
    """Stream the greedy completion; after its 4th piece of text, kill the worker serving it."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    pieces, usage, killed = [], None, False
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            pieces.append(chunk.choices[0].text)
        if chunk.usage is not None:
            usage = chunk.usage
        if len(pieces) == 4 and not killed:
            ray.kill(_busy(ray, candidates))
            killed = True
    assert killed, "the stream ended before the kill"
    return "".join(pieces), usage


def _migrations(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    match = re.search(r'^dynserve_migrations_total\{reason="worker_failed"\} (\S+)$', text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


@pytest.fixture(scope="module")
def undisturbed(make_engine: Any) -> str:
    engine = make_engine(kv_blocks=256)
    out = engine.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0]
    assert len(out.token_ids) == MAX_TOKENS  # long enough to be cut midway
    return out.text


def _usage_of_an_undisturbed_run(url: str) -> tuple[str, Any]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    return whole.choices[0].text, whole.usage


def test_a_worker_killed_mid_stream_costs_the_client_nothing(workers: Any, make_gateway: Any, ray_instance: Any,
                                                              undisturbed: str) -> None:
    server = make_gateway(infos=[info for _h, info in workers], namespace=REAL["namespace"])
    whole, whole_usage = _usage_of_an_undisturbed_run(server.url)
    text, usage = _stream_killing_midway(server.url, ray_instance, workers)
    assert text == whole == undisturbed
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole_usage.prompt_tokens, MAX_TOKENS)
    assert _migrations(server.url) == 1
