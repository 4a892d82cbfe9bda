"""The planner half's offline what-if (`benchmarks/_multimodel_whatif.py`): the real planner cores against a
model of the fleet, on the quick plan's trace. It is deterministic for a seed, it misses nothing where
workers start at once and the budget never binds, it misses where a model cannot grow, and a budget of the
floors alone holds every model at its floors."""

from __future__ import annotations

from benchmarks._multimodel_planner import QUICK_TURNS
from benchmarks._multimodel_trace import generate, models_busy_at_once, size_fleets
from benchmarks._multimodel_whatif import planner_config, replay
from dynserve.planner import profile as profiles

PROFILE = profiles.shipped("llama-3.1-70b-h100-tp4")
TRACE = generate(QUICK_TURNS.shape, 0)
SIZING = size_fleets(PROFILE, TRACE, QUICK_TURNS.sizing_window_s, ttft_target_s=1.0, itl_target_s=0.02,
                     busy_at_once=models_busy_at_once(QUICK_TURNS.shape, QUICK_TURNS.down_delay_s))


def _config(**changes: object):  # type: ignore[no-untyped-def]
    return planner_config(SIZING, ttft_target_s=0.6, itl_target_s=0.02, interval_s=1.0, read_window_s=3.0,
                          down_delay_s=10.0, **changes)


def test_a_replay_is_a_function_of_its_seed() -> None:
    first, again = (replay(TRACE, SIZING, PROFILE, _config(), budget=SIZING.budget, seed=1) for _ in range(2))
    assert first == again
    assert replay(TRACE, SIZING, PROFILE, _config(), budget=SIZING.budget, seed=2) != first


def test_workers_that_start_at_once_miss_nothing_and_a_model_that_cannot_grow_misses() -> None:
    quick = replay(TRACE, SIZING, PROFILE, _config(), budget=SIZING.static_workers, lag_median_s=0.01, seed=1)
    assert quick.num_missed == 0 and quick.num_budget_cuts == 0
    assert 0.3 < quick.ratio < 1.0
    stuck = replay(TRACE, SIZING, PROFILE, _config(max_workers={"prefill": 1, "decode": 1}),
                   budget=SIZING.static_workers, lag_median_s=0.01, seed=1)
    assert stuck.num_missed > 0.1 * len(TRACE.requests)
    assert {m for m, _ in stuck.missed} == {0, 1, 2}  # every model's peak is more than one worker's


def test_a_budget_of_the_floors_holds_every_model_at_them() -> None:
    floors = 2 * TRACE.num_models
    held = replay(TRACE, SIZING, PROFILE, _config(), budget=floors, seed=1)
    assert held.num_budget_cuts > 0
    assert abs(held.worker_s - floors * TRACE.duration_s) < 1e-6
