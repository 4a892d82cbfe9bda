"""Several models behind one gateway: each answers under its own name, with its own workers, router and cache.

The fleet is a real `dynctl serve` of two real models (the default SmolLM2 and a tiny random-weight Llama from
tests/_tiny_models.py, which has no chat template, so it is asked for text completions), one worker each, its
registry and KV events on a real Redis, where a standalone `dynctl mocker` of a third model joins and leaves.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from _tiny_models import tiny_model
from conftest import REPO, default_model_path, stop_by_sigint, wait_for_line

SMOL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def two_models(dynctl_serve_on_test_ray: Any, dynctl: str, redis_url: str) -> Any:
    tiny = tiny_model("llama", "hf")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [dynctl, "serve", "--model", str(default_model_path()), "--model", str(tiny), "--port", "0",
            "--kv-blocks", "256", "--worker-num-cpus", "0.5", "--redis-url", redis_url, "--served-model-name", "smol",
            "--served-model-name", f"tiny={tiny.name}"]
    with dynctl_serve_on_test_ray(argv, 180, env) as served:
        yield served, tiny.name
    assert served.code == 0 and "stopped" in served.rest


def test_each_model_answers_under_its_own_name_streamed_and_not(two_models: Any) -> None:
    served, tiny = two_models
    assert f"serving {SMOL}, {tiny} at" in served.banner and "each: 1 worker" in served.banner
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key="unused")
    listed = {m.id: m for m in client.models.list().data}
    assert {name: m.model_extra["root"] for name, m in listed.items()} == {
        SMOL: SMOL, "smol": SMOL, tiny: tiny, "tiny": tiny}  # each model's id and its alias
    assert all(m.model_extra["ready"] for m in listed.values())
    ready = httpx.get(f"http://127.0.0.1:{served.port}/ready", timeout=10).json()
    assert ready["model"] == SMOL and ready["models"] == {SMOL: True, tiny: True}
    assert listed[tiny].model_extra["max_model_len"] != listed[SMOL].model_extra["max_model_len"]
    by_alias = client.completions.create(model="tiny", prompt="one two three", max_tokens=5, temperature=0)
    assert by_alias.model == "tiny"

    chat = client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": "Say hi."}],
                                          max_tokens=6, temperature=0)
    assert chat.model == SMOL and chat.choices[0].message.content and chat.usage.completion_tokens <= 6
    text = client.completions.create(model=tiny, prompt="one two three", max_tokens=5, temperature=0)
    assert text.model == tiny and text.usage.completion_tokens == 5
    pieces = [c.choices[0].text for c in client.completions.create(model=tiny, prompt="one two three", max_tokens=5,
                                                                   temperature=0, stream=True) if c.choices]
    assert "".join(pieces) == text.choices[0].text == by_alias.choices[0].text  # greedy: the same text
    metrics = httpx.get(f"http://127.0.0.1:{served.port}/metrics", timeout=10).text
    for model in (SMOL, tiny):  # each model's requests counted under its own label
        generated = next(line for line in metrics.splitlines()
                         if line.startswith(f'dynserve_generated_tokens_total{{model="{model}"}}'))
        assert float(generated.split()[-1]) >= 5
        assert f'dynserve_time_to_first_token_seconds_count{{endpoint="completions",model="{model}"}}' in metrics
    # the tiny model has no chat template: its own refusal, not the default model's answer
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client.chat.completions.create(model=tiny, messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_no_cache_hit_crosses_models(two_models: Any) -> None:
    served, tiny = two_models
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key="unused")
    prompt = "A long shared prefix, long enough to fill several KV blocks of sixteen tokens each: " * 3
    for expected_cached in (False, True):
        first = client.completions.create(model=SMOL, prompt=prompt, max_tokens=1, temperature=0)
        assert (first.usage.prompt_tokens_details.cached_tokens > 0) == expected_cached
    other = client.completions.create(model=tiny, prompt=prompt, max_tokens=1, temperature=0)
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # the same token ids, another model's cache


def test_an_unknown_model_is_a_404_naming_those_served(two_models: Any) -> None:
    served, tiny = two_models
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(base_url=f"http://127.0.0.1:{served.port}") as http:
        http.post("/v1/chat/completions", json=body)  # a warm connection
        start_s = time.perf_counter()
        answer = http.post("/v1/chat/completions", json=body)
        elapsed_s = time.perf_counter() - start_s
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "model_not_found"
    assert SMOL in answer.json()["error"]["message"] and tiny in answer.json()["error"]["message"]
    assert elapsed_s < 0.1  # a round trip on loopback: nothing waits for a worker


def test_a_model_whose_worker_joins_is_served_within_a_second_and_leaves_with_it(two_models: Any,
                                                                                   redis_url: str) -> None:
    served, _tiny = two_models
    third = tiny_model("qwen3", "hf")
    dynctl = str(Path(sys.executable).parent / "dynctl")
    mocker = subprocess.Popen([dynctl, "mocker", "--model", str(third), "--redis-url", redis_url, "--http-port", "0",
                               "--speedup", "10", "--namespace", served.namespace],  # the fleet's registry
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    with httpx.Client(base_url=f"http://127.0.0.1:{served.port}", timeout=30) as http:
        def listed() -> dict[str, bool]:
            return {m["id"]: m["ready"] for m in http.get("/v1/models").json()["data"]}

        try:
            wait_for_line(mocker, "is serving", 90)  # registered before its banner
            joined_s = time.monotonic()
            # Within a second is the gateway's promise: 0.36 s alone on this machine (the registry read every
            # 0.25 s, the tokenizer read, the backend's start), but 1.05 s once in a clean clone's run beside
            # the other xdist worker and its Ray (docs/testing.md); the test allows the suite's load 2 s.
            while third.name not in listed():
                assert time.monotonic() - joined_s < 2.0, listed()
                time.sleep(0.05)
            print(f"the joining model listed {time.monotonic() - joined_s:.3f} s after its worker's banner")
            answer = http.post("/v1/completions", json={"model": third.name, "prompt": "one two", "max_tokens": 4})
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
        finally:
            code, _rest = stop_by_sigint(mocker)
        assert code == 0
        left_s = time.monotonic()
        while third.name in listed():
            assert time.monotonic() - left_s < 10, listed()
            time.sleep(0.1)
        assert set(listed()) == {SMOL, _tiny, "smol", "tiny"}
        gone = http.post("/v1/completions", json={"model": third.name, "prompt": "one", "max_tokens": 1})
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(("extra", "words"), [
    (["--planner", "--planner-kubernetes", "ns/fleet"], "--planner-kubernetes scales the DynServePools of one"),
    ([], "is given twice"),
])
def test_serve_refuses_what_several_models_cannot_do_before_ray_starts(extra: list[str], words: str) -> None:
    dynctl = str(Path(sys.executable).parent / "dynctl")
    model = str(default_model_path())
    second = model if words == "is given twice" else str(tiny_model("llama", "hf"))
    done = subprocess.run([dynctl, "serve", "--model", model, "--model", second, "--mocker", "cpu", *extra],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and words in done.stderr, done.stderr


def test_model_given_twice_on_the_command_line_is_the_model_then_the_extra_models() -> None:
    import argparse

    from dynserve.cli.options import add_settings_group, settings_from

    parser = argparse.ArgumentParser()
    add_settings_group(parser, "engine")
    add_settings_group(parser, "cluster")
    settings = settings_from(parser.parse_args(["--model", "a.gguf", "--model", "b", "--extra-model", "c"]))
    assert (settings.model, settings.extra_models) == ("a.gguf", ["b", "c"])
    assert settings_from(parser.parse_args(["--model", "a.gguf"])).extra_models == []


def test_a_pools_router_reads_only_its_members_kv_events() -> None:
    """Every model's workers publish on one plane; each pool's router is fed only its own members' batches
    (the others' would fill its index with blocks it can never route to)."""
    import asyncio

    from dynserve.events.memory import MemoryEventPlane
    from dynserve.gateway.app import _MembersEvents
    from dynserve.protocol import BlockStored

    async def scenario() -> tuple[list[str], list[str]]:
        plane = MemoryEventPlane()
        members: dict[str, object] = {"a-0": object()}
        view = _MembersEvents(plane, members)
        for worker_id in ("a-0", "b-0", "a-0"):
            await plane.publish(worker_id, [BlockStored(1, None, [7])])
        first, cursor = await view.read("0", block_s=0.1)
        members["b-0"] = object()  # b-0 joins the pool: its batches from now on
        await plane.publish("b-0", [BlockStored(2, None, [8])])
        then, _cursor = await view.read(cursor, block_s=0.1)
        return [b.worker_id for b in first], [b.worker_id for b in then]

    assert asyncio.run(scenario()) == (["a-0", "a-0"], ["b-0"])


def test_a_gateway_of_several_models_waits_for_a_worker_of_its_default_model() -> None:
    """`dynctl gateway --model A --model B` over a fleet's registry: the default model's backend takes A's
    workers, whichever model registered first (B's join through model discovery)."""
    import asyncio

    from dynserve.cli.gateway import default_model_id, first_workers
    from dynserve.config import Settings
    from dynserve.events.memory import MemoryEventPlane
    from dynserve.protocol import WorkerInfo

    def info(worker_id: str, model_id: str) -> WorkerInfo:
        return WorkerInfo(worker_id=worker_id, role="both", host="127.0.0.1", port=1, model_id=model_id,
                          max_model_len=2048, block_size=16, num_blocks=64)

    async def scenario() -> tuple[list[str], list[str]]:
        plane = MemoryEventPlane()
        await plane.register(info("b-0", "tiny"), ttl_s=60)
        anyone = await first_workers(plane, None, poll_s=0.01)
        waiting = asyncio.ensure_future(first_workers(plane, SMOL, poll_s=0.01))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # only the other model's worker so far
        await plane.register(info("a-0", SMOL), ttl_s=60)
        return [i.worker_id for i in anyone], [i.worker_id for i in await asyncio.wait_for(waiting, 5)]

    assert asyncio.run(scenario()) == (["b-0"], ["a-0"])
    assert default_model_id(Settings(model=str(default_model_path()), extra_models=["b"])) == SMOL
    assert default_model_id(Settings(model=str(default_model_path()))) is None  # one model: the fleet names it
