"""Migration: a worker killed while it streams a request costs the client nothing. The gateway resubmits the
request to another worker with the prompt plus the tokens already sent; the client's stream goes on with no
gap and no repeat, its usage counted over both workers, and a greedy answer equals an undisturbed run. Real
model workers (greedy equality needs a real model), aggregated and disaggregated (a decode worker killed)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
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
def workers(ray_instance: Any) -> Iterator[dict[str, tuple[Any, Any]]]:
    """Real workers in their own namespace: one prefill, two decode (their ids as keys). The disaggregated test
    runs first and kills a decode worker; the aggregated one then uses the other and the prefill worker,
    announced to its gateway as a worker of role both (a worker of any role serves a whole request it is
    sent: its role says what it publishes and how gateways route to it)."""
    from dynserve.workers.worker import launch_worker

    settings = Settings(**REAL)
    layout = {"prefill-0": "prefill", "decode-0": "decode", "decode-1": "decode"}
    launched = {wid: launch_worker(settings, f"mig-{wid}", role, num_cpus=0.1, publish_events=False)  # type: ignore[arg-type]
                for wid, role in layout.items()}
    infos = ray_instance.get([ref for _handle, ref in launched.values()], timeout=600)
    yield {wid: (handle, info) for (wid, (handle, _ref)), info in zip(launched.items(), infos, strict=True)}
    for handle, _ref in launched.values():
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


def test_a_decode_worker_killed_mid_stream_costs_the_client_nothing(workers: Any, make_gateway: Any,
                                                                     ray_instance: Any,
                                                                     undisturbed: str) -> None:
    decode = [workers["decode-0"], workers["decode-1"]]
    infos = [workers["prefill-0"][1], *(info for _h, info in decode)]
    server = make_gateway(infos=infos, namespace=REAL["namespace"], disagg_local_prefill_tokens=0)
    whole, whole_usage = _usage_of_an_undisturbed_run(server.url)
    text, usage = _stream_killing_midway(server.url, ray_instance, decode)
    assert text == whole == undisturbed
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole_usage.prompt_tokens, MAX_TOKENS)
    assert _migrations(server.url) == 1
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert re.search(r'^dynserve_disagg_requests_total\{path="remote"\} 2\.0$', metrics, re.MULTILINE), metrics


def test_a_worker_killed_mid_stream_costs_the_client_nothing(workers: Any, make_gateway: Any, ray_instance: Any,
                                                              undisturbed: str) -> None:
    survivor = next(w for w in (workers["decode-0"], workers["decode-1"]) if _alive(ray_instance, w[0]))
    prefill_handle, prefill_info = workers["prefill-0"]
    # told "both", the gateway sends it whole requests (which any worker serves) instead of prefills
    pair = [survivor, (prefill_handle, msgspec.structs.replace(prefill_info, role="both"))]
    server = make_gateway(infos=[info for _h, info in pair], namespace=REAL["namespace"])
    whole, whole_usage = _usage_of_an_undisturbed_run(server.url)
    text, usage = _stream_killing_midway(server.url, ray_instance, pair)
    assert text == whole == undisturbed
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole_usage.prompt_tokens, MAX_TOKENS)
    assert _migrations(server.url) == 1


def test_with_migration_off_a_mid_stream_failure_reaches_the_client(make_mocker: Any, make_gateway: Any,
                                                                     ray_instance: Any) -> None:
    mockers = [make_mocker(f"mig-off-{i}", mocker_speedup=2, namespace="migration-off") for i in range(2)]
    server = make_gateway(infos=[info for _h, info in mockers], namespace="migration-off", migration_limit=0)
    with pytest.raises(openai.APIError):
        _stream_killing_midway(server.url, ray_instance, mockers)
    assert _migrations(server.url) == 0


def _alive(ray: Any, handle: Any) -> bool:
    try:
        ray.get(handle.is_healthy.remote(), timeout=5)
        return True
    except Exception:
        return False
