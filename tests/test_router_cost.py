"""The routing cost and pick: pure functions."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from dynserve.router.cost import costs, select


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
