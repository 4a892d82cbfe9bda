"""Worker pools: the pure policy (sizes, draining, restart backoff and budget) without Ray, then a real pool
of workers on Ray behind a gateway that follows the registry: a worker added becomes routable, a drained
one finishes its stream and takes nothing new, a killed one leaves routing within 1 s and is replaced, and
the requests it was serving finish on the survivor.

The pool's workers serve a tiny random-weight Llama with SmolLM2's vocabulary: the pool is what is tested,
and they start as the real model's do (the process, torch, Ray) but load and decode in a fraction of its
time."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import threading
import time
from collections.abc import Coroutine, Iterator
from typing import Any

import httpx
import pytest
from conftest import needs

from dynserve.errors import PoolError
from dynserve.gateway.directory import membership_changes
from dynserve.protocol import WorkerInfo
from dynserve.workers.pool import PoolPolicy, RestartPolicy, worker_resources
from dynserve.workers.ray_start import worker_runtime_env

NAMESPACE = "pooltest"  # its own registry and event stream: other tests' workers stay out of this pool's view


def _info(worker_id: str, port: int = 1) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role="both", host="127.0.0.1", port=port, model_id="m",
                      max_model_len=64, block_size=16, num_blocks=8)


def _serving_policy(num_workers: int, **restart: Any) -> PoolPolicy:
    policy = PoolPolicy("p", RestartPolicy(**restart), unresponsive_s=10.0)
    for _ in range(num_workers):
        worker_id = policy.add(0.0)
        assert policy.ready(worker_id, _info(worker_id), 0.0)
    return policy


# ---- the pure policy -------------------------------------------------------------------------------------

def test_workers_get_fresh_ids_and_serve_once_ready() -> None:
    policy = PoolPolicy("decode")
    first, second = policy.add(0.0), policy.add(0.0)
    assert (first, second, policy.target) == ("decode-0", "decode-1", 2)
    assert policy.serving() == []  # starting workers take no requests
    assert policy.ready(first, _info(first), 1.0)
    assert [i.worker_id for i in policy.serving()] == ["decode-0"]
    policy.died(first, 2.0)
    assert policy.replacements(10.0) == ["decode-2"]  # ids are never reused
    policy.check_integrity()


def test_remove_prefers_a_starting_worker_then_the_newest_and_never_replaces_it() -> None:
    policy = _serving_policy(2)
    starting = policy.add(0.0)
    assert policy.remove().worker_id == starting
    assert policy.remove().worker_id == "p-1"
    assert (policy.target, policy.num_active) == (1, 1)
    assert not policy.ready(starting, _info(starting), 1.0)  # removed while starting: not wanted any more
    for worker_id in (starting, "p-1"):  # draining workers that exit are not failures
        policy.died(worker_id, 1.0)
    assert policy.replacements(100.0) == []
    with pytest.raises(PoolError) as error:
        policy.remove("p-1")
    assert (error.value.pool, error.value.worker_id) == ("p", "p-1")
    policy.check_integrity()


def test_a_dead_worker_is_replaced_after_a_doubling_backoff_within_a_budget() -> None:
    policy = _serving_policy(2, max_restarts=3, window_s=100.0, backoff_s=1.0, backoff_max_s=3.0)
    delays_s = []
    now_s = 0.0
    for _ in range(3):  # the same slot keeps dying as soon as it is replaced
        victim = policy.serving()[-1].worker_id
        policy.died(victim, now_s)
        died_s = now_s
        while not (replacement := policy.replacements(now_s)):
            now_s += 0.25
        delays_s.append(now_s - died_s)
        policy.ready(replacement[0], _info(replacement[0]), now_s)
        policy.check_integrity()
    assert delays_s == [1.0, 2.0, 3.0]  # 1, 2, then capped at 3
    policy.died(policy.serving()[-1].worker_id, now_s)
    assert policy.replacements(now_s + 50.0) == []  # budget spent within the window
    assert policy.is_short(now_s + 50.0)
    assert len(policy.replacements(now_s + 100.0)) == 1  # the oldest restarts aged out of the window
    assert not policy.is_short(now_s + 100.0)


def test_following_nodes_starts_one_worker_per_node_and_drops_only_what_never_started() -> None:
    policy = PoolPolicy("decode")
    new, dropped = policy.follow(2, 0.0)  # two pods joined
    assert (new, dropped, policy.target) == (["decode-0", "decode-1"], [], 2)
    assert policy.ready("decode-0", _info("decode-0"), 1.0)
    assert policy.follow(2, 1.0) == ([], [])  # nothing changed: nothing to do
    # one pod left before its worker started: once that lasts node_grace_s, that worker is dropped, the serving
    # one stays (a node missing from the count for a moment drops nothing)
    assert policy.follow(1, 2.0) == ([], [])
    assert policy.follow(2, 3.0) == ([], [])  # back: nothing to do
    assert policy.follow(1, 4.0) == ([], [])
    assert policy.follow(1, 4.0 + policy.node_grace_s) == ([], ["decode-1"])
    policy.died("decode-1", 9.0)
    assert (policy.target, policy.num_active) == (1, 1)
    # the serving worker's pod leaves: it stays until its death is seen, and is not replaced after it
    assert policy.follow(0, 10.0) == ([], [])
    assert (policy.target, policy.num_active) == (0, 1)
    policy.check_integrity()  # more workers than target is allowed while following
    policy.died("decode-0", 10.5)
    assert policy.replacements(100.0) == []
    # a worker that dies while its pod stays is replaced under the restart policy
    new, _ = policy.follow(1, 200.0)
    assert policy.ready(new[0], _info(new[0]), 200.0)
    policy.died(new[0], 201.0)
    assert policy.follow(1, 201.5) == ([], [])  # its pod still counts: the replacement is the restart policy's
    assert len(policy.replacements(210.0)) == 1
    policy.check_integrity()


def test_an_unresponsive_worker_is_reported_and_an_answer_keeps_it() -> None:
    policy = _serving_policy(2)
    policy.seen("p-0", 8.0)
    assert policy.unresponsive(12.0) == ["p-1"]


def test_membership_changes_follow_the_registry() -> None:
    current = {"a": _info("a"), "b": _info("b")}
    added, removed = membership_changes(current, [_info("b"), _info("c")])
    assert ([i.worker_id for i in added], removed) == (["c"], ["a"])
    added, removed = membership_changes(current, [_info("a"), _info("b", port=2)])  # b restarted elsewhere
    assert ([(i.worker_id, i.port) for i in added], removed) == ([("b", 2)], ["b"])


def test_workers_take_a_gpu_each_where_the_cluster_has_them() -> None:
    assert worker_resources(num_cluster_gpus=8, num_cpus=1.0) == {"num_cpus": 1.0, "num_gpus": 1.0}
    assert worker_resources(num_cluster_gpus=0, num_cpus=0.25) == {"num_cpus": 0.25, "num_gpus": 0.0}


def test_what_a_worker_asks_ray_for_and_why_it_waits_in_words() -> None:
    from dynserve.config import Settings
    from dynserve.workers.pool import placement_shortfall, ray_needs

    settings = Settings(worker_num_cpus=2.0)
    assert ray_needs(settings, {"num_cpus": 0.5, "num_gpus": 0.0}) == {"CPU": 0.5}
    assert ray_needs(settings, {"num_gpus": 1.0, "resources": {"dynserve_pool_decode": 1.0}}) == {
        "CPU": 2.0, "GPU": 1.0, "dynserve_pool_decode": 1.0}
    nodes = [{"CPU": 2.0, "memory": 1e9}, {"CPU": 4.0}]
    busy = placement_shortfall({"CPU": 3.0}, nodes, {"CPU": 0.5})
    assert "asks for CPU 3" in busy and "free in the cluster now: CPU 0.5" in busy
    never = placement_shortfall({"CPU": 1.0, "GPU": 1.0}, nodes, {"CPU": 6.0})
    assert "no live node has that much (the nodes: CPU 2, GPU 0; CPU 4, GPU 0)" in never
    assert "no live node has that much (the nodes: none)" in placement_shortfall({"CPU": 1.0}, [], {})


# ---- a real pool on Ray ------------------------------------------------------------------------------------

@needs("fleet")
def test_a_worker_ray_cannot_place_is_reported_with_what_it_asks_for(ray_instance: Any, monkeypatch: Any,
                                                                       caplog: Any) -> None:
    """A mocker asking for more CPUs than any node of the test Ray has: the pool says so while it waits
    (no worker process starts), and closing the pool ends the wait."""
    from dynserve.config import Settings
    from dynserve.workers import pool as pool_module

    monkeypatch.setattr(pool_module, "UNPLACED_WARN_S", 0.3)
    settings = Settings(mocker="cpu", worker_num_cpus=64.0, namespace="pool-unplaced")
    worker_pool = pool_module.WorkerPool(settings, name="huge")

    async def scenario() -> None:
        adding = asyncio.create_task(worker_pool.add())
        deadline_s = time.monotonic() + 30
        while "is not placed by Ray yet" not in caplog.text:
            assert time.monotonic() < deadline_s and not adding.done(), caplog.text
            await asyncio.sleep(0.05)
        adding.cancel()
        await worker_pool.close()

    with caplog.at_level("WARNING", logger="dynserve.workers.pool"):
        asyncio.run(scenario())
    assert "worker huge-0 is not placed by Ray yet: it asks for CPU 64 and no live node has that much" in caplog.text
    assert "CPU 8" in caplog.text  # the test Ray's one node


@needs("fleet")
def test_a_fleet_the_cluster_cannot_hold_is_refused_before_any_worker_starts(ray_instance: Any) -> None:
    """What `dynctl serve` checks on a Ray it started: the test Ray's one node of 8 CPUs holds two workers of
    3 CPUs, not three, and no worker of 9."""
    from dynserve.config import Settings
    from dynserve.workers.pool import check_placeable

    check_placeable(Settings(worker_num_cpus=3.0), num_workers=2)
    with pytest.raises(PoolError, match="3 workers cannot start on this Ray at once: each asks for CPU 3, and "
                                        "its nodes hold 2"):
        check_placeable(Settings(worker_num_cpus=3.0), num_workers=3)
    with pytest.raises(PoolError, match="no worker can start on this Ray: it asks for CPU 9 and no live node"):
        check_placeable(Settings(worker_num_cpus=9.0))
    check_placeable(Settings(mocker="cpu"), num_workers=500)  # a mocker reserves a hundredth of a CPU

class _LoopThread:
    """An asyncio loop on a thread of its own, where the pool and its health monitor live across tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="pool-loop", daemon=True)
        self._thread.start()

    def submit(self, coroutine: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def run(self, coroutine: Coroutine[Any, Any, Any], timeout_s: float = 300.0) -> Any:
        return self.submit(coroutine).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
@needs('fleet')
def pool(ray_instance: Any) -> Iterator[tuple[_LoopThread, Any]]:
    """A pool of two workers (a quarter CPU and one thread each, small KV cache) in its own namespace. Their
    engines run at normal priority: on a machine shared with other work a niced engine loads very slowly."""
    from _tiny_models import tiny_model

    from dynserve.config import Settings
    from dynserve.workers.pool import WorkerPool

    settings = Settings(model=str(tiny_model("llama")), dtype="float32", device="cpu", kv_blocks=192,
                        num_threads=1, engine_nice=0, worker_num_cpus=0.25, namespace=NAMESPACE,
                        pool_restart_backoff_s=0.2,
                        pool_health_interval_s=5.0)  # a death is seen by the watch, not these checks
    runner = _LoopThread()
    worker_pool = WorkerPool(settings, name="pt")
    try:
        runner.run(worker_pool.start(2))
        yield runner, worker_pool
    finally:
        runner.run(worker_pool.close())
        runner.close()


@pytest.fixture(scope="module")
def pool_gateway(pool: tuple[_LoopThread, Any], make_gateway: Any) -> Any:
    from dynserve.events.ray_plane import connect_event_plane

    _runner, worker_pool = pool
    return make_gateway(infos=worker_pool.workers(), registry=connect_event_plane(None, NAMESPACE),
                        router="round_robin", namespace=NAMESPACE, model=worker_pool.settings.model)


def _members(gateway: Any) -> Any:
    return gateway.app.state.backend


def _model(gateway: Any) -> str:
    """The id the gateway serves its model under."""
    return _members(gateway).model_id  # type: ignore[no-any-return]


def _wait_until(condition: Any, timeout_s: float, what: str) -> float:
    """Seconds until `condition()` held; fails the test after `timeout_s`."""
    start_s = time.monotonic()
    while not condition():
        assert time.monotonic() - start_s < timeout_s, f"{what} did not happen within {timeout_s} s"
        time.sleep(0.01)
    return time.monotonic() - start_s


def _chat(gateway: Any, content: str, max_tokens: int = 2, ignore_eos: bool = False) -> httpx.Response:
    body = {"model": _model(gateway), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": ignore_eos,
            "messages": [{"role": "user", "content": content}]}
    return httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=120)


def test_an_added_worker_becomes_routable(pool: tuple[_LoopThread, Any], pool_gateway: Any,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    runner, worker_pool = pool
    members = _members(pool_gateway)
    assert members.directory.routable_ids() == ["pt-0", "pt-1"]
    manager = ray._private.worker.global_worker.function_actor_manager
    exports: list[Any] = []  # Ray's export of the actor class: once a job, with the first workers
    export = manager.export_actor_class
    monkeypatch.setattr(manager, "export_actor_class", lambda *args: exports.append(args) or export(*args))
    info = runner.run(worker_pool.add())
    assert info.worker_id == "pt-2"
    assert exports == []  # launching a worker did not export (hash every method of) the class again
    _wait_until(lambda: "pt-2" in members.directory.routable_ids(), 1.0, "the new worker becoming routable")
    # the process never ran at Ray's niceness of 15 (its start is what a scale-up waits for), which the test
    # Ray's system config says, as every Ray dynserve starts: the actor carried no runtime env (whose
    # setup_worker would have cost its start one more import of ray)
    niceness = worker_pool.handle("pt-2").__ray_call__.remote(lambda _w: os.getpriority(os.PRIO_PROCESS, 0))
    assert ray.get(niceness, timeout=30) == 0
    assert worker_runtime_env() is None
    for i in range(3):  # round robin over three workers: one of these goes to the new one
        assert _chat(pool_gateway, f"Say {i}.").status_code == 200
    assert members.num_routed["pt-2"] >= 1


def test_a_draining_worker_finishes_its_stream_and_takes_no_new_request(pool: tuple[_LoopThread, Any],
                                                                        pool_gateway: Any) -> None:
    import ray
    from ray.exceptions import RayActorError

    runner, worker_pool = pool
    members = _members(pool_gateway)
    body = {"model": _model(pool_gateway), "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True, "messages": [{"role": "user", "content": "Tell me a story about a lighthouse."}]}
    with httpx.stream("POST", f"{pool_gateway.url}/v1/chat/completions", json=body, timeout=120) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # streaming has begun
        draining = next(w for w, c in members.directory.channels.items() if c.num_open_streams)
        handle = worker_pool.handle(draining)
        removal = runner.submit(worker_pool.remove(draining))
        _wait_until(lambda: draining not in members.directory.routable_ids(), 1.0, "the drained worker leaving routing")
        routed_before = members.num_routed[draining]
        for i in range(3):
            assert _chat(pool_gateway, f"Count to {i}.").status_code == 200
        assert members.num_routed[draining] == routed_before  # new requests went elsewhere
        rest = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]"
    finish_reasons = [c["finish_reason"] for chunk in rest[:-1] for c in json.loads(chunk)["choices"]]
    assert finish_reasons[-1] == "length"  # all 400 tokens (long enough to outlast the drain), no error
    assert removal.result(60) == draining
    assert draining not in {i.worker_id for i in worker_pool.workers()}
    with pytest.raises(RayActorError):  # the actor has exited
        ray.get(handle.is_healthy.remote(), timeout=30)


def test_a_killed_worker_leaves_routing_within_1s_and_is_replaced(pool: tuple[_LoopThread, Any],
                                                                  pool_gateway: Any) -> None:
    import ray

    _runner, worker_pool = pool
    members = _members(pool_gateway)
    survivors = sorted(i.worker_id for i in worker_pool.workers())
    assert len(survivors) == 2 and members.directory.routable_ids() == survivors
    victim = survivors[0]
    num_routed_before = members.num_routed.total()
    # long answers: the victim is still generating when it is killed (200 steps, against the 10 ms the wait
    # below polls at); each must reach its client whole, migrated to the survivor
    prompts = [f"{i}: Explain every step of how a bicycle is built, in detail." for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as executor:
        routed_before = members.num_routed[victim]
        answers = [executor.submit(_chat, pool_gateway, prompt, 200, True) for prompt in prompts]
        _wait_until(lambda: members.num_routed[victim] > routed_before, 30.0, "a request reaching the victim")
        ray.kill(worker_pool.handle(victim))
        killed_s = time.monotonic()
        _wait_until(lambda: victim not in members.directory.routable_ids(), 1.0, "the gateway dropping the dead worker")
        _wait_until(lambda: victim not in {i.worker_id for i in worker_pool.workers()}, 1.0,
                    "the pool noticing the death")
        print(f"dead worker out of the gateway and the pool after {time.monotonic() - killed_s:.3f} s")
        done = [answer.result(120) for answer in answers]
        assert [r.status_code for r in done] == [200] * len(prompts)  # retried or migrated on the survivor
        assert [r.json()["usage"]["completion_tokens"] for r in done] == [200] * len(prompts)
    assert members.num_routed.total() - num_routed_before > len(prompts)  # some were sent twice: retried
    replacement = _wait_until(lambda: len(worker_pool.workers()) == 2, 180.0, "a replacement serving")
    # a worker under a new id (which one depends on how many the module's earlier tests started)
    (new_id,) = {i.worker_id for i in worker_pool.workers()} - set(survivors)
    assert new_id.startswith("pt-"), new_id
    _wait_until(lambda: new_id in members.directory.routable_ids(), 1.0, "the replacement becoming routable")
    print(f"replacement serving {replacement:.1f} s after the death was seen")
    worker_pool.policy.check_integrity()
