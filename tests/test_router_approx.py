"""The approximate router: its memory of where prompts went (TTL, size bound) against a plain model, and the
`approximate` mode end to end in a `Router` with an injected clock (no sleeps)."""

from __future__ import annotations

from collections import OrderedDict
from typing import get_args

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from dynserve.config import Settings
from dynserve.router.approx import RouteMemory
from dynserve.router.router import ROUTER_MODES, Router

TTL_S = 10.0
MAX_BLOCKS = 6
WORKERS = ["w0", "w1", "w2"]
HASHES = st.integers(min_value=0, max_value=15)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def test_a_remembered_prefix_matches_until_its_ttl_runs_out() -> None:
    memory = RouteMemory(ttl_s=TTL_S, max_blocks_per_worker=100)
    memory.remember("a", [1, 2, 3], now_s=0.0)
    memory.remember("b", [1, 9], now_s=4.0)
    assert memory.match([1, 2, 3, 4], now_s=9.9) == {"a": 3, "b": 1}
    assert memory.match([1, 2, 3, 4], now_s=10.0) == {"b": 1}  # a's blocks are 10 s old: forgotten
    assert memory.match([1, 2], now_s=14.0) == {}
    assert memory.index.num_blocks == 0
    memory.check_integrity()


def test_routing_a_prefix_again_refreshes_it() -> None:
    memory = RouteMemory(ttl_s=TTL_S, max_blocks_per_worker=100)
    memory.remember("a", [1, 2, 3], now_s=0.0)
    memory.remember("a", [1, 2, 7], now_s=8.0)  # shares blocks 1 and 2
    assert memory.match([1, 2, 3], now_s=12.0) == {"a": 2}  # 3 expired at 10, 1 and 2 live until 18
    assert memory.match([1, 2, 7], now_s=17.9) == {"a": 3}
    assert memory.match([1], now_s=18.0) == {}
    memory.check_integrity()


def test_a_worker_remembers_at_most_its_bound_oldest_forgotten_first() -> None:
    memory = RouteMemory(ttl_s=TTL_S, max_blocks_per_worker=4)
    memory.remember("a", [1, 2, 3], now_s=0.0)
    memory.remember("a", [5, 6], now_s=1.0)  # 5 blocks: 1 goes
    assert memory.num_blocks("a") == 4
    assert memory.match([1, 2], now_s=2.0) == {}
    assert memory.match([2, 3], now_s=2.0) == {"a": 2}
    memory.check_integrity()


def test_forgetting_a_worker_drops_its_memory_and_its_pending_deadlines_are_harmless() -> None:
    memory = RouteMemory(ttl_s=TTL_S, max_blocks_per_worker=100)
    memory.remember("a", [1, 2], now_s=0.0)
    memory.forget_worker("a")
    assert memory.match([1, 2], now_s=1.0) == {}
    memory.remember("a", [1], now_s=5.0)
    assert memory.match([1, 2], now_s=11.0) == {"a": 1}  # the old deadline (10) passed; the new one holds
    memory.check_integrity()


def test_memory_rejects_a_bound_or_ttl_that_means_nothing() -> None:
    with pytest.raises(ValueError):
        RouteMemory(ttl_s=0, max_blocks_per_worker=10)
    with pytest.raises(ValueError):
        RouteMemory(ttl_s=1, max_blocks_per_worker=0)


class MemoryMachine(RuleBasedStateMachine):
    """Routes, clock steps and forgotten workers in random order; the memory must always answer like a
    model that keeps, per worker, every routed block with the time it was last routed, and reads it as: the
    `MAX_BLOCKS` most recently routed blocks, less those routed `TTL_S` or more ago."""

    def __init__(self) -> None:
        super().__init__()
        self.memory = RouteMemory(ttl_s=TTL_S, max_blocks_per_worker=MAX_BLOCKS)
        self.routed_s: dict[str, OrderedDict[int, float]] = {}
        self.now_s = 0.0

    def _model(self) -> dict[str, set[int]]:
        live = {}
        for worker, routed in self.routed_s.items():
            newest = list(routed.items())[-MAX_BLOCKS:]
            live[worker] = {h for h, at_s in newest if at_s + TTL_S > self.now_s}
        return live

    @rule(worker=st.sampled_from(WORKERS), hashes=st.lists(HASHES, min_size=1, max_size=5))
    def route(self, worker: str, hashes: list[int]) -> None:
        self.memory.remember(worker, hashes, self.now_s)
        routed = self.routed_s.setdefault(worker, OrderedDict())
        for h in hashes:
            routed.pop(h, None)
            routed[h] = self.now_s

    @rule(step_s=st.sampled_from([0.0, 0.5, 3.0, TTL_S - 0.5, TTL_S, 2 * TTL_S]))
    def time_passes(self, step_s: float) -> None:
        self.now_s += step_s

    @rule(worker=st.sampled_from(WORKERS))
    def forget(self, worker: str) -> None:
        self.memory.forget_worker(worker)
        self.routed_s.pop(worker, None)

    @rule(prompt=st.lists(HASHES, min_size=1, max_size=6))
    def match_agrees_with_the_model(self, prompt: list[int]) -> None:
        expected = {}
        for worker, blocks in self._model().items():
            depth = 0
            while depth < len(prompt) and prompt[depth] in blocks:
                depth += 1
            if depth:
                expected[worker] = depth
        assert self.memory.match(prompt, self.now_s) == expected

    @invariant()
    def holds_what_the_model_holds_once_expired(self) -> None:
        self.memory.expire(self.now_s)
        self.memory.check_integrity()
        for worker, blocks in self._model().items():
            assert self.memory.index.worker_blocks(worker) == blocks


TestMemoryMachine = MemoryMachine.TestCase
TestMemoryMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


# ---- the approximate mode of the Router ------------------------------------------------------------------

def _router(clock: FakeClock, **overrides: object) -> Router:
    return Router("approximate", block_size=4, salt=1, approx_ttl_s=TTL_S, clock=clock,
                  **overrides)  # type: ignore[arg-type]


def test_approximate_mode_sends_a_prefix_back_to_where_it_went_until_the_ttl() -> None:
    clock = FakeClock()
    router = _router(clock)
    prompt = list(range(40))  # 10 blocks
    first, overlap = router.pick(prompt, ["a", "b"], {})
    assert overlap == 0
    router.routed("r1", first, 12)
    router.finished("r1")
    other = "b" if first == "a" else "a"
    router.routed("busy", first, 5)  # some load on the first worker: the 10 cached blocks outweigh it
    assert router.pick(prompt[:36] + [99, 98, 97, 96], ["a", "b"], {}) == (first, 9)
    clock.now_s += TTL_S
    assert router.pick(prompt, ["a", "b"], {}) == (other, 0)  # forgotten: the least loaded wins
    assert router.index_size() == (10, 1)  # the last pick remembered the prompt on the other worker


def test_approximate_mode_has_the_hot_spot_guard_too() -> None:
    prompt = list(range(40))  # 10 blocks
    for min_blocks, expected in ((100, ("a", 10)), (8, ("b", 0))):
        router = _router(FakeClock(), hot_spot_ratio=1.5, hot_spot_min_blocks=min_blocks)
        assert router.pick(prompt, ["a", "b"], {}) == ("a", 0)  # both idle: the first
        router.routed("r1", "a", 9)  # a: 9 to do, 10 cached, so cost 9 against b's 10; but 9 * 2 / 9 > 1.5
        assert router.pick(prompt, ["a", "b"], {}) == expected  # with the guard armed at 8 blocks, b


def test_every_router_mode_is_a_setting_and_the_settings_build_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert get_args(Settings.model_fields["router"].annotation) == ROUTER_MODES
    monkeypatch.setenv("DYN_ROUTER_HOT_SPOT_RATIO", "2.5")
    monkeypatch.setenv("DYN_ROUTER_APPROX_TTL_S", "9")
    from_env = Router.from_settings(Settings(router="approximate"), block_size=16, salt=0)
    assert from_env.memory is not None
    assert (from_env.policy.hot_spot_ratio, from_env.memory.ttl_s) == (2.5, 9.0)
    monkeypatch.delenv("DYN_ROUTER_HOT_SPOT_RATIO")
    monkeypatch.delenv("DYN_ROUTER_APPROX_TTL_S")
    settings_ = Settings(router="approximate", router_approx_ttl_s=5.0, router_approx_max_blocks=7,
                         router_hot_spot_ratio=3.0, router_hot_spot_min_blocks=11)
    router = Router.from_settings(settings_, block_size=16, salt=0)
    assert router.mode == "approximate" and router.memory is not None
    assert (router.memory.ttl_s, router.memory.max_blocks_per_worker) == (5.0, 7)
    assert (router.policy.hot_spot_ratio, router.policy.hot_spot_min_blocks) == (3.0, 11)
    with pytest.raises(ValueError):
        Router("nearest", block_size=16, salt=0)  # type: ignore[arg-type]
