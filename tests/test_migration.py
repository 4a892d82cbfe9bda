"""Migration end to end: a model worker killed while it streams a request costs the client nothing. The
gateway resubmits the request to another worker with the prompt plus the tokens already sent; the client's
stream goes on with no gap and no repeat, its usage counted over both workers, and a greedy answer equals an
undisturbed run. The workers serve a tiny random-weight Llama with the real model's vocabulary
(`tests/_tiny_models.py`): greedy equality holds for any weights, and with untied embeddings its greedy tokens
vary (a random tied model's repeat the last one), so a token lost, repeated or misplaced at the migration
changes the rest of the answer; a step costs milliseconds, so the answer is 160 tokens, still streaming when
its worker is killed. The dispatch itself (migration limits, aborts, a decode worker lost after a remote
prefill) is proved on scripted channels in `test_dispatcher.py`."""

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

PROMPT = "Once upon a time, a dragon learned to bake bread."
MAX_TOKENS = 160
TINY = {"dtype": "float32", "device": "cpu", "kv_blocks": 256, "num_threads": 1, "namespace": "migration"}


@pytest.fixture(scope="module")
def tiny_path() -> str:
    """The tiny model's directory (built once per machine)."""
    from _tiny_models import tiny_model

    return str(tiny_model("llama", tie_word_embeddings=False))


@pytest.fixture(scope="module")
@needs("fleet")
def workers(ray_instance: Any, tiny_path: str) -> Iterator[list[tuple[Any, Any]]]:
    """Two workers of the tiny model in their own namespace: (handle, info) each."""
    from dynserve.workers.worker import launch_worker

    settings = Settings(**TINY, model=tiny_path)
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


def _stream_killing_midway(url: str, model: str, ray: Any,
                           candidates: list[tuple[Any, Any]]) -> tuple[str, Any]:
    """Stream the greedy completion; after its 4th piece of text, kill the worker serving it."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
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
def undisturbed(tiny_path: str) -> str:
    from dynserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(Settings(**TINY, model=tiny_path))
    out = engine.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0]
    assert len(out.token_ids) == MAX_TOKENS  # long enough to be cut midway
    assert len(set(out.token_ids)) > MAX_TOKENS // 2  # varied: a token lost or repeated changes what follows
    # every token whole characters: a worker killed while holding back half of one would lose it (by design)
    assert not [t for t in out.token_ids if "\ufffd" in engine.tokenizer.decode([t])]
    return out.text


def _usage_of_an_undisturbed_run(url: str, model: str) -> tuple[str, Any]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    return whole.choices[0].text, whole.usage


def test_a_worker_killed_mid_stream_costs_the_client_nothing(workers: Any, make_gateway: Any, ray_instance: Any,
                                                              undisturbed: str) -> None:
    server = make_gateway(infos=[info for _h, info in workers], namespace=TINY["namespace"])
    model = workers[0][1].model_id
    whole, whole_usage = _usage_of_an_undisturbed_run(server.url, model)
    text, usage = _stream_killing_midway(server.url, model, ray_instance, workers)
    assert text == whole == undisturbed
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole_usage.prompt_tokens, MAX_TOKENS)
    assert _migrations(server.url) == 1
