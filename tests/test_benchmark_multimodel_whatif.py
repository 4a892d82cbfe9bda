"""The planner half's offline what-if (`benchmarks/_multimodel_whatif.py`): the real planner cores against a
model of the fleet, on the quick plan's trace. It is deterministic for a seed, it misses nothing where
workers start at once and the budget never binds, it misses where a model cannot grow, a budget of the
floors alone holds every model at its floors (which it starts at), it counts the workers started (inside
and outside the models' bumps), and a start's lag does not depend on the other starts."""

from __future__ import annotations

from benchmarks._multimodel_planner import QUICK_TURNS
from benchmarks._multimodel_trace import bump_s, generate, models_busy_at_once, size_fleets
from benchmarks._multimodel_whatif import planner_config, replay, start_lag_s
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
    assert held.num_starts == 0


def test_models_start_at_their_floors_and_a_budget_of_them_holds_them_there() -> None:
    floors = {"prefill": 2, "decode": 1}
    held = replay(TRACE, SIZING, PROFILE, _config(floors=floors), budget=3 * TRACE.num_models, seed=1)
    assert held.num_starts == 0 and held.num_budget_cuts > 0
    assert abs(held.worker_s - 3 * TRACE.num_models * TRACE.duration_s) < 1e-6
    # a spare prefill worker a model takes the rises' first steps: fewer starts than from a floor of one
    roomy = replay(TRACE, SIZING, PROFILE, _config(floors=floors), budget=SIZING.static_workers, seed=1)
    lean = replay(TRACE, SIZING, PROFILE, _config(), budget=SIZING.static_workers, seed=1)
    assert roomy.num_starts < lean.num_starts and roomy.worker_s > lean.worker_s


def test_starts_are_counted_and_those_outside_the_bumps_are_the_trickles() -> None:
    bumps = [bump_s(QUICK_TURNS.shape, m) for m in range(TRACE.num_models)]
    seen = replay(TRACE, SIZING, PROFILE, _config(), budget=SIZING.budget, seed=1, bumps=bumps)
    assert seen.num_starts >= 2 * TRACE.num_models  # every model's bump needs more than its floors
    assert 0 < seen.num_trickle_starts < seen.num_starts
    everywhere = [(0.0, TRACE.duration_s)] * TRACE.num_models
    assert replay(TRACE, SIZING, PROFILE, _config(), budget=SIZING.budget, seed=1,
                  bumps=everywhere).num_trickle_starts == 0
    nowhere = [(-2.0, -1.0)] * TRACE.num_models
    assert replay(TRACE, SIZING, PROFILE, _config(), budget=SIZING.budget, seed=1,
                  bumps=nowhere).num_trickle_starts == seen.num_starts


def test_a_start_lag_is_its_own_draw() -> None:
    """Common random numbers: a start's lag depends on its key alone (seed, model, pool, slot, decision time),
    not on how many starts came before it, and the draws are lognormal around the median."""
    lag = start_lag_s(1, 2, "prefill", 2, 101.2, median_s=3.0, sigma=0.45)
    start_lag_s(1, 0, "decode", 3, 50.0, median_s=3.0, sigma=0.45)  # another start in between
    assert start_lag_s(1, 2, "prefill", 2, 101.2, median_s=3.0, sigma=0.45) == lag
    others = {start_lag_s(*key, median_s=3.0, sigma=0.45) for key in [(2, 2, "prefill", 2, 101.2),
              (1, 3, "prefill", 2, 101.2), (1, 2, "decode", 2, 101.2), (1, 2, "prefill", 3, 101.2),
              (1, 2, "prefill", 2, 102.2)]}
    assert lag not in others and len(others) == 5
    draws = sorted(start_lag_s(0, 0, "prefill", 2, float(t), median_s=3.0, sigma=0.45) for t in range(401))
    assert 2.7 < draws[200] < 3.3 and draws[0] > 0
