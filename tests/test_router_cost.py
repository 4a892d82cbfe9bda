"""The routing cost and pick: pure functions. `choose` (the router's decision) against the plain
definition (`costs` + `select`), and the hot-spot guard."""

from __future__ import annotations

import random
from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from dynserve.router.cost import Decision, RoutingPolicy, choose, costs, is_hot_spot, select


def test_overlap_lowers_cost_and_load_raises_it() -> None:
    worker_costs = costs(100, {"a": 80, "b": 10}, {"a": 30, "b": 0, "c": 0}, overlap_weight=1.0)
    assert worker_costs == {"a": 20 + 30, "b": 90 + 0, "c": 100 + 0}
    assert select(worker_costs) == "a"
    assert select(costs(100, {"a": 80}, {"a": 300, "b": 0})) == "b"  # too busy: load wins over cache


def test_overlap_weight_scales_the_prefill_term() -> None:
    assert select(costs(100, {"a": 50}, {"a": 40, "b": 0}, overlap_weight=0.5)) == "b"
    assert select(costs(100, {"a": 50}, {"a": 40, "b": 0}, overlap_weight=2.0)) == "a"


def test_temperature_spreads_picks_towards_cheaper_workers() -> None:
    rng = random.Random(0)
    picks = Counter(select({"a": 10.0, "b": 12.0, "c": 50.0}, temperature=0.5, rng=rng) for _ in range(3000))
    assert picks["a"] > picks["b"] > picks["c"] > 0


def test_no_candidates_is_an_error() -> None:
    with pytest.raises(ValueError):
        select({})


# ---- choose: the decision the router makes -------------------------------------------------------------

NO_GUARD = RoutingPolicy(hot_spot_ratio=100.0)  # max/mean can not exceed the 8 candidates used below
WORKERS = [f"w{i}" for i in range(8)]


DecisionInputs = tuple[int, dict[str, int], list[str], dict[str, int], float]


@st.composite
def decision_inputs(draw: st.DrawFn) -> DecisionInputs:
    num_prompt_blocks = draw(st.integers(0, 200))
    candidates = draw(st.lists(st.sampled_from(WORKERS), min_size=1, max_size=8, unique=True))
    overlap = st.integers(1, num_prompt_blocks) if num_prompt_blocks else st.nothing()
    overlaps = draw(st.dictionaries(st.sampled_from(WORKERS), overlap, max_size=8))  # may name non-candidates
    load = st.sampled_from([0, 1, 5, 16, 17, 100]) | st.integers(0, 10**6)  # small values: ties
    loads = draw(st.dictionaries(st.sampled_from(WORKERS), load))
    weight = draw(st.sampled_from([0.0, 0.3, 0.5, 1.0, 2.0]) | st.floats(0, 1000))
    return num_prompt_blocks, overlaps, candidates, loads, weight


@given(decision_inputs())
@settings(max_examples=500, deadline=None)
def test_choose_picks_what_costs_and_select_define(inputs: DecisionInputs) -> None:
    """The fast path (only workers with overlap, plus the least loaded) gives the plain definition's answer,
    ties included."""
    num_prompt_blocks, overlaps, candidates, loads, weight = inputs
    policy = RoutingPolicy(overlap_weight=weight, hot_spot_ratio=100.0)
    decision = choose(num_prompt_blocks, overlaps, candidates, loads, policy)
    expected = select(costs(num_prompt_blocks, overlaps, {w: loads.get(w, 0) for w in candidates}, weight))
    assert decision == Decision(expected, overlaps.get(expected, 0), hot_spot=False)


def test_choose_samples_like_select_when_temperature_is_positive() -> None:
    loads = {"a": 10, "b": 12, "c": 50}
    policy = RoutingPolicy(temperature=0.5, hot_spot_ratio=100.0)
    rng_a, rng_b = random.Random(3), random.Random(3)
    ours = [choose(4, {"a": 1}, list(loads), loads, policy, rng_a).worker_id for _ in range(200)]
    plain = [select(costs(4, {"a": 1}, loads), 0.5, rng_b) for _ in range(200)]
    assert ours == plain and len(set(ours)) > 1


# ---- the hot-spot guard ----------------------------------------------------------------------------------

def test_hot_spot_is_max_over_mean_above_the_ratio_with_a_minimum_load() -> None:
    policy = RoutingPolicy(hot_spot_ratio=1.5, hot_spot_min_blocks=100)
    assert is_hot_spot([400, 100], policy)  # 400 / 250 = 1.6
    assert not is_hot_spot([300, 200], policy)  # 300 / 250 = 1.2
    assert is_hot_spot([400, 100, 100, 0], policy)  # 400 / 150 = 2.7
    assert not is_hot_spot([200, 150, 150, 100], policy)  # 200 / 150 = 1.3
    assert not is_hot_spot([90, 0], policy)  # lopsided, but below the minimum load
    assert not is_hot_spot([0, 0, 0, 0], RoutingPolicy(hot_spot_min_blocks=0))  # an idle pool never is


def test_under_a_hot_spot_load_wins_over_cache() -> None:
    policy = RoutingPolicy(hot_spot_ratio=1.5, hot_spot_min_blocks=100)
    overlaps = {"a": 512}  # a holds the whole 512-block prompt
    # a's cost (0 to prefill + 300 active) still beats b's (512 + 0): the cost alone keeps piling onto a
    assert select(costs(512, overlaps, {"a": 300, "b": 0})) == "a"
    assert choose(512, overlaps, ["a", "b"], {"a": 300, "b": 0}, policy) == Decision("b", 0, hot_spot=True)
    # balanced enough (300 / 275 = 1.09): the cost decides, and a keeps its cache hit
    assert choose(512, overlaps, ["a", "b"], {"a": 300, "b": 250}, policy) == Decision("a", 512)
    # as lopsided, but below the minimum load: the cost decides
    assert choose(512, overlaps, ["a", "b"], {"a": 90, "b": 0}, policy) == Decision("a", 512)


def test_under_a_hot_spot_ties_go_to_more_overlap_then_the_first() -> None:
    policy = RoutingPolicy(hot_spot_ratio=1.5, hot_spot_min_blocks=100)
    loads = {"hot": 1000, "b": 0, "c": 0, "d": 0}
    assert choose(64, {"hot": 64, "c": 8, "d": 8}, list(loads), loads, policy) == Decision("c", 8, True)
    assert choose(64, {"hot": 64}, list(loads), loads, policy) == Decision("b", 0, hot_spot=True)
    assert choose(64, {"hot": 64, "x": 64}, list(loads), loads, policy).worker_id == "b"  # x is no candidate


def test_policy_rejects_values_that_mean_nothing() -> None:
    for bad in ({"hot_spot_ratio": 1.0}, {"overlap_weight": -1.0}, {"hot_spot_min_blocks": -1}):
        with pytest.raises(ValueError):
            RoutingPolicy(**bad)
    with pytest.raises(ValueError):
        choose(1, {}, [], {}, NO_GUARD)


def test_a_new_prompt_goes_to_the_emptiest_cache_among_the_least_loaded() -> None:
    """Equally loaded workers holding none of the prompt: the one whose cache holds the fewest blocks, so
    new prefixes spread over the caches; load and overlap still come first."""
    cached = {"a": 300, "b": 40, "c": 10, "d": 0}.__getitem__
    idle = {"a": 0, "b": 0, "c": 0, "d": 5}
    assert choose(8, {}, ["a", "b", "c", "d"], idle, NO_GUARD, cached_blocks=cached) == Decision("c", 0)
    assert choose(8, {}, ["a", "b", "c", "d"], idle, NO_GUARD) == Decision("a", 0)  # without it: the first
    # load first: d's cache is empty but it is busier
    assert choose(8, {}, ["a", "d"], idle, NO_GUARD, cached_blocks=cached).worker_id == "a"
    # overlap first: a holds most of the prompt
    assert choose(8, {"a": 6}, ["a", "b", "c"], idle, NO_GUARD, cached_blocks=cached) == Decision("a", 6)
