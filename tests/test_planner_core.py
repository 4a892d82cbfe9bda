"""The planner's pure core on synthetic observations, with a hand-built capacity profile: it scales up under
rising load and down under falling, goes to zero when idle and back on demand, holds still on noisy flat
load, and keeps the manual override, the bounds and the budget. Also the predictors."""

from __future__ import annotations

import math
import random

import pytest

from dynserve.planner.core import Decision, Observation, PlannerConfig, PlannerCore, PoolObservation, SharedBudget
from dynserve.planner.predictors import ConstantPredictor, EwmaPredictor, HoltPredictor, make_predictor
from dynserve.planner.profile import CapacityProfile, DecodePoint, PrefillPoint

ISL, OSL = 1024, 128
INTERVAL_S = 10.0


def _profile() -> CapacityProfile:
    """A worker that prefills 8k tokens/s (TTFT alone 20 ms + 125 us a token) and decodes a step in 10 ms +
    1 ms a sequence + 1 us a context token."""
    prefill = tuple(PrefillPoint(isl, 0.02 + isl / 8_000, 8_000.0) for isl in (128, 512, 1024, 2048, 4096, 8192))
    decode = tuple(DecodePoint(context, batch, 0.01 + 0.001 * batch + context * 1e-6)
                   for context in (512, 2048, 8192) for batch in (1, 2, 4, 8, 16, 32, 64))
    return CapacityProfile(name="synthetic", source="hand-built for tests", created="2026-11-24", block_size=16,
                           max_num_seqs=64, max_num_batched_tokens=8192, max_model_len=16384,
                           num_kv_blocks=10_000, prefill=prefill, decode=decode)


def _config(**overrides: object) -> PlannerConfig:
    base = dict(ttft_target_s=0.3, itl_target_s=0.03, interval_s=INTERVAL_S, predictor="ewma",
                min_workers={"prefill": 1, "decode": 1}, max_workers={"prefill": 10, "decode": 10})
    base.update(overrides)
    return PlannerConfig(**base)  # type: ignore[arg-type]


def _observe(core: PlannerCore, step: int, rate: float, *, waiting_for_worker: int = 0,
             running: float | None = None) -> dict[str, int]:
    targets = core.targets or {p: 1 for p in core.pools}
    busy = rate > 0
    pools = {p: PoolObservation(num_workers=targets[p], num_running=(rate * 2 if running is None else running)
                                if busy else 0.0) for p in core.pools}
    observation = Observation(now_s=step * INTERVAL_S, pools=pools, request_rate_per_s=rate if busy else math.nan,
                              mean_isl=ISL if busy else math.nan, mean_osl=OSL if busy else math.nan,
                              num_waiting_for_worker=waiting_for_worker)
    return core.decide(observation).targets


def _run(core: PlannerCore, rates: list[float], start: int = 0) -> list[dict[str, int]]:
    return [_observe(core, start + i, rate) for i, rate in enumerate(rates)]


def test_sla_mode_scales_up_under_rising_load_and_down_under_falling() -> None:
    core = PlannerCore(_config(), ("prefill", "decode"), _profile())
    rising = _run(core, [1, 2, 4, 6, 8, 10, 12, 14, 16, 16, 16])
    assert [t["prefill"] for t in rising] == sorted(t["prefill"] for t in rising)
    assert rising[-1]["prefill"] >= 3 and rising[-1]["decode"] >= 3, rising[-1]
    assert rising[-1]["prefill"] > rising[0]["prefill"] and rising[-1]["decode"] > rising[0]["decode"]
    falling = _run(core, [12, 8, 5, 3, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], start=len(rising))
    assert [t["decode"] for t in falling] == sorted((t["decode"] for t in falling), reverse=True)
    assert falling[-1] == {"prefill": 1, "decode": 1}


def test_the_need_matches_the_profile() -> None:
    profile = _profile()
    core = PlannerCore(_config(predictor="constant"), ("prefill", "decode"), profile)
    decision = core.decide(Observation(0.0, {p: PoolObservation(1) for p in core.pools}, 16.0, ISL, OSL))
    prefill_need = 16 * ISL / profile.prefill_capacity_tokens_per_s(ISL, 0.3)
    decode_need = 16 * OSL / profile.decode_capacity_tokens_per_s(ISL + OSL / 2, 0.03)
    assert decision.needs["prefill"] == pytest.approx(prefill_need)
    assert decision.needs["decode"] == pytest.approx(decode_need)
    assert decision.targets == {"prefill": min(1 + 4, math.ceil(prefill_need)),
                                "decode": min(1 + 4, math.ceil(decode_need))}


def test_an_aggregated_pool_needs_both_prefill_and_decode() -> None:
    profile = _profile()
    config = _config(predictor="constant", min_workers={"both": 1}, max_workers={"both": 20}, max_step_up=20)
    core = PlannerCore(config, ("both",), profile)
    decision = core.decide(Observation(0.0, {"both": PoolObservation(1)}, 16.0, ISL, OSL))
    need = (16 * ISL / profile.prefill_capacity_tokens_per_s(ISL, 0.3)
            + 16 * OSL / profile.decode_capacity_tokens_per_s(ISL + OSL / 2, 0.03))
    assert decision.needs["both"] == pytest.approx(need)
    assert decision.targets["both"] == math.ceil(need)


def test_idle_goes_to_zero_and_the_first_request_wakes_it() -> None:
    core = PlannerCore(_config(idle_s=60.0), ("prefill", "decode"), _profile())
    _run(core, [5, 5, 5])
    quiet = _run(core, [0] * 10, start=3)
    zero_at = next(i for i, t in enumerate(quiet) if t == {"prefill": 0, "decode": 0})
    assert 5 <= zero_at <= 7  # 60 s (6 intervals) after the last request, not before
    assert all(t == {"prefill": 0, "decode": 0} for t in quiet[zero_at:])
    woken = _observe(core, 20, 0, waiting_for_worker=1)  # a request the gateway holds
    assert woken["decode"] >= 1
    assert core.decide(Observation(21 * INTERVAL_S, {p: PoolObservation(woken[p]) for p in core.pools},
                                   0.5, ISL, OSL)).targets["decode"] >= 1


def test_noisy_flat_load_changes_the_fleet_at_most_twice_in_30_intervals() -> None:
    for predictor in ("constant", "ewma", "holt"):
        for seed in range(5):
            noise = random.Random(seed)
            core = PlannerCore(_config(predictor=predictor), ("prefill", "decode"), _profile())
            _run(core, [10.0] * 3)  # settled on the load
            history = _run(core, [10.0 * noise.uniform(0.85, 1.15) for _ in range(30)], start=3)
            changes = sum(a != b for a, b in zip(history, history[1:], strict=False))
            assert changes <= 2, (predictor, seed, history)


def test_load_mode_grows_an_overloaded_pool_and_shrinks_a_comfortable_one_after_a_delay() -> None:
    config = _config(mode="load", down_delay_s=3 * INTERVAL_S)
    core = PlannerCore(config, ("prefill", "decode"))

    def decide(step: int, ttft_s: float, itl_s: float, waiting: float = 0.0) -> dict[str, int]:
        targets = core.targets or {"prefill": 2, "decode": 2}
        pools = {"prefill": PoolObservation(targets["prefill"], ttft_s=ttft_s, num_waiting=waiting),
                 "decode": PoolObservation(targets["decode"], itl_s=itl_s, num_running=4)}
        return core.decide(Observation(step * INTERVAL_S, pools, 5.0, ISL, OSL)).targets

    assert decide(0, ttft_s=0.6, itl_s=0.02) == {"prefill": 6, "decode": 2}  # TTFT 2x over: up by the step
    assert decide(1, ttft_s=0.1, itl_s=0.05)["decode"] == 6  # ITL over
    assert decide(2, ttft_s=0.2, itl_s=0.02, waiting=40) == {"prefill": 10, "decode": 6}  # queue; max 10
    held = [decide(3 + i, ttft_s=0.05, itl_s=0.005) for i in range(2)]
    assert held == [{"prefill": 10, "decode": 6}] * 2  # comfortable, but not yet for 3 intervals
    assert decide(5, ttft_s=0.05, itl_s=0.005) == {"prefill": 9, "decode": 5}


def test_an_override_holds_until_released_and_the_budget_binds_the_rest() -> None:
    core = PlannerCore(_config(max_total_workers=6, max_step_up=10), ("prefill", "decode"), _profile())
    core.override("decode", 2)
    for targets in _run(core, [30.0] * 4):
        assert targets["decode"] == 2  # the override holds under any load
        assert sum(targets.values()) <= 6  # and the planner's pools share what the budget leaves
    assert core.targets == {"prefill": 4, "decode": 2}
    core.release("decode")
    after = _run(core, [30.0] * 3, start=4)[-1]
    assert after["decode"] > 2 and sum(after.values()) == 6
    with pytest.raises(ValueError, match="outside"):
        core.override("decode", 11)
    with pytest.raises(ValueError, match="no pool"):
        core.override("both", 1)


def test_bounds_hold_and_a_correction_follows_a_slower_fleet() -> None:
    core = PlannerCore(_config(max_workers={"prefill": 3, "decode": 3}), ("prefill", "decode"), _profile())
    assert all(t["prefill"] <= 3 and t["decode"] <= 3 for t in _run(core, [100.0] * 5))
    slow = PlannerCore(_config(predictor="constant"), ("prefill", "decode"), _profile())
    expected = _profile().expected_ttft_s(ISL, 4 * ISL / 1)
    for step in range(8):  # the prefill pool answers twice as slowly as its profile says
        slow.decide(Observation(step * INTERVAL_S, {"prefill": PoolObservation(1, ttft_s=2 * expected),
                                                    "decode": PoolObservation(1)}, 4.0, ISL, OSL))
    assert 1.8 < slow.corrections["prefill"] <= 2.0
    assert slow.corrections["decode"] == 1.0


def test_predictors() -> None:
    constant, ewma, holt = ConstantPredictor(), EwmaPredictor(alpha=0.5), HoltPredictor()
    assert constant.predict() is None and ewma.predict() is None and holt.predict() is None
    for value in (10.0, 20.0, 30.0, 40.0, 50.0, math.nan):
        for predictor in (constant, ewma, holt):
            predictor.observe(value)
    assert constant.predict() == 50.0  # NaN skipped
    assert ewma.predict() == pytest.approx(40.625)  # lags the trend
    holt_prediction = holt.predict()
    assert holt_prediction is not None and 50.0 < holt_prediction < 65.0  # extrapolates it
    falling = HoltPredictor()
    for value in (50.0, 30.0, 10.0, 0.0, 0.0):
        falling.observe(value)
    assert falling.predict() == 0.0  # never negative
    with pytest.raises(ValueError, match="unknown predictor"):
        make_predictor("kalman")


def test_the_budget_never_takes_the_last_worker_of_a_serving_pool() -> None:
    core = PlannerCore(_config(max_total_workers=2), ("prefill", "decode"), _profile())
    core.override("prefill", 2)
    targets = _observe(core, 0, 5.0)
    assert targets == {"prefill": 2, "decode": 1}  # over the budget: the override and the floor hold


def test_a_busy_serving_pool_keeps_a_worker_even_with_a_min_of_zero() -> None:
    config = _config(mode="load", min_workers={"prefill": 0, "decode": 0}, down_delay_s=INTERVAL_S)
    core = PlannerCore(config, ("prefill", "decode"))
    for step in range(6):  # steady, comfortable traffic: shrink, but never the decode pool to zero
        targets = core.targets or {"prefill": 1, "decode": 1}
        pools = {"prefill": PoolObservation(targets["prefill"], ttft_s=0.01),
                 "decode": PoolObservation(targets["decode"], itl_s=0.001, num_running=1)}
        decided = core.decide(Observation(step * INTERVAL_S, pools, 2.0, ISL, OSL)).targets
        assert decided["decode"] == 1, (step, decided)
    assert decided["prefill"] == 0  # a prefill pool may empty: its prompts prefill on the decode workers


def test_wake_ups_between_intervals_do_not_count_toward_a_shrink() -> None:
    core = PlannerCore(_config(down_delay_s=3 * INTERVAL_S), ("prefill", "decode"), _profile())
    _run(core, [20.0] * 3)
    high = dict(core.targets or {})
    for i in range(6):  # six quick decisions (requests waking the planner) within one interval of low load
        pools = {p: PoolObservation(high[p]) for p in core.pools}
        decided = core.decide(Observation(3 * INTERVAL_S + 0.1 * (i + 1), pools, 1.0, ISL, OSL)).targets
        assert decided == high, (i, decided)
    assert _observe(core, 4, 1.0) == high  # the first full interval of low load: one of three


def test_load_mode_waits_for_starting_workers_before_growing_again() -> None:
    core = PlannerCore(_config(mode="load"), ("prefill", "decode"))
    slow = {"prefill": PoolObservation(1, ttft_s=1.0), "decode": PoolObservation(1, itl_s=0.01)}
    assert core.decide(Observation(0.0, slow, 5.0, ISL, OSL)).targets["prefill"] == 5
    starting = {"prefill": PoolObservation(1, ttft_s=1.0, num_starting=4), "decode": PoolObservation(1, itl_s=0.01)}
    assert core.decide(Observation(INTERVAL_S, starting, 5.0, ISL, OSL)).targets["prefill"] == 5


def test_models_sharing_a_budget_hand_workers_to_the_one_with_load() -> None:
    budget = SharedBudget(8)
    chat, coder = (PlannerCore(_config(max_step_up=10, predictor="constant"),
                               ("prefill", "decode"), _profile(), budget=budget, member=name)
                   for name in ("chat", "coder"))
    for name in ("chat", "coder"):  # what each starts with
        budget.record(name, 2, squeezed=False)
    chat_busy = _run(chat, [40.0] * 3)  # chat alone is busy: it takes all the coder leaves
    _run(coder, [0.5] * 3)
    assert chat_busy[-1] == {"prefill": 3, "decode": 3} and budget.decided() == {"chat": 6, "coder": 2}
    # the load moves to the coder: it wants more than the budget leaves, and is cut
    wanted = _observe(coder, 3, 40.0)
    assert wanted == {"prefill": 1, "decode": 1} and budget.others_squeezed("chat")
    # chat, now quiet, gives its spare workers at once (no down delay), and the coder takes them
    yielded = core_decision(chat, 4, 0.5)
    assert yielded.targets == {"prefill": 1, "decode": 1}
    assert set(yielded.reasons.values()) == {"yield"}
    assert _observe(coder, 4, 40.0) == {"prefill": 3, "decode": 3}
    assert budget.decided() == {"chat": 2, "coder": 6}  # chat at its floor: the coder has all the rest
    for step in range(5, 12):  # whoever decides, the total stays within the budget
        core_decision(chat, step, 0.5 if step < 8 else 40.0)
        _observe(coder, step, 40.0)
        assert sum(budget.decided().values()) <= 8, budget.decided()
    with pytest.raises(ValueError, match="at least one"):
        SharedBudget(0)


def core_decision(core: PlannerCore, step: int, rate: float) -> Decision:
    targets = core.targets or {p: 1 for p in core.pools}
    pools = {p: PoolObservation(num_workers=targets[p], num_running=rate * 2) for p in core.pools}
    return core.decide(Observation(step * INTERVAL_S, pools, rate, ISL, OSL))


def test_a_window_of_longer_prompts_than_predicted_is_sized_for_them() -> None:
    core = PlannerCore(_config(predictor="ewma", max_step_up=10), ("prefill", "decode"), _profile())
    _run(core, [20.0] * 4)  # ISL 1024 all along
    pools = {p: PoolObservation(n, num_running=40.0) for p, n in (core.targets or {}).items()}
    decision = core.decide(Observation(4 * INTERVAL_S, pools, 20.0, 2 * ISL, OSL))
    # the smoothed prediction is still well below 2048; the need is that of the prompts the window held
    assert decision.predicted_isl < 1.8 * ISL
    assert decision.needs["prefill"] == pytest.approx(
        20.0 * 2 * ISL / _profile().prefill_capacity_tokens_per_s(2 * ISL, 0.3), rel=1e-6)


def test_the_core_measures_how_long_its_scale_ups_take_to_serve() -> None:
    core = PlannerCore(_config(predictor="constant", read_window_s=4.0, interval_s=1.0), ("prefill", "decode"),
                       _profile())
    assert core.start_s == 1.0 and core.horizon_s == 3.0  # nothing measured: one interval, plus half the window

    def decide(now_s: float, serving: int) -> dict[str, int]:
        pools = {"prefill": PoolObservation(serving), "decode": PoolObservation(1, num_running=4)}
        return core.decide(Observation(now_s, pools, 20.0, ISL, OSL)).targets

    grown = decide(0.0, 1)["prefill"]
    assert grown > 1
    for now_s in (1.0, 2.0, 3.0):  # the new workers are still starting
        decide(now_s, 1)
    assert core.measured_start_s is None
    decide(4.0, grown)  # all serve four seconds after the decision
    assert core.measured_start_s == pytest.approx(4.0)
    assert core.horizon_s == pytest.approx(4.0 + 2.0)
    assert core.decide(Observation(5.0, {"prefill": PoolObservation(grown), "decode": PoolObservation(1)}, 20.0,
                                   ISL, OSL)).horizon_s == pytest.approx(6.0)


def test_a_slow_start_sizes_a_rise_sooner() -> None:
    """On a linear rise, a core whose workers take 6 s to serve decides its second prefill worker at a lower
    observed rate than one whose workers serve within the interval: it sizes for the rate when they serve."""
    ramp = [0.5 + 0.5 * step for step in range(40)]  # req/s, one a second

    def first_growth(start_s: float) -> float:
        # without the rise's spare worker (a test of its own): the horizon alone
        core = PlannerCore(_config(predictor="holt", interval_s=1.0, start_s=start_s, read_window_s=2.0,
                                   rise_spare_workers=0), ("prefill", "decode"), _profile())
        for step, rate in enumerate(ramp):
            targets = core.targets or {"prefill": 1, "decode": 1}
            pools = {p: PoolObservation(targets[p], num_running=rate) for p in core.pools}
            if core.decide(Observation(float(step), pools, rate, ISL, OSL)).targets["prefill"] > 1:
                return rate
        raise AssertionError("never grew")

    prompt_tokens_per_worker = _profile().prefill_capacity_tokens_per_s(ISL, 0.3)
    one_worker_rate = prompt_tokens_per_worker / ISL
    assert first_growth(0.0) > one_worker_rate - 0.5  # sized for now: grows once one worker is full
    assert first_growth(6.0) <= first_growth(0.0) - 2.0  # six seconds of the rise (0.5 req/s a second) ahead


def test_the_down_delay_is_time_whatever_the_interval() -> None:
    for interval_s in (1.0, 2.0):
        core = PlannerCore(_config(predictor="constant", interval_s=interval_s, down_delay_s=6.0),
                           ("prefill", "decode"), _profile())
        _observe_at = [(k * interval_s, 30.0) for k in range(3)] + [(3 * interval_s + k * interval_s, 1.0)
                                                                      for k in range(10)]
        shrunk_at = None
        for now_s, rate in _observe_at:
            targets = core.targets or {"prefill": 1, "decode": 1}
            before = targets["prefill"]
            pools = {p: PoolObservation(targets[p], num_running=rate) for p in core.pools}
            after = core.decide(Observation(now_s, pools, rate, ISL, OSL)).targets["prefill"]
            if rate == 1.0 and after < before and shrunk_at is None:
                shrunk_at = now_s - 3 * interval_s
        # the first low decision counts its interval: the shrink comes 6 s of low load after it began
        assert shrunk_at == pytest.approx(6.0 - interval_s), interval_s


def _decide_all(config: PlannerConfig, rates: list[float], isls: list[float] | None = None) -> list[Decision]:
    """One decision a second over `rates` (and the windows' mean ISLs, `ISL` by default); no latencies
    observed, so no correction: the needs depend on the load alone, whatever the targets."""
    core = PlannerCore(config, ("prefill", "decode"), _profile())
    decisions = []
    for step, rate in enumerate(rates):
        targets = core.targets or {"prefill": 1, "decode": 1}
        pools = {p: PoolObservation(targets[p], num_running=rate) for p in core.pools}
        isl = ISL if isls is None else isls[step]
        decisions.append(core.decide(Observation(float(step), pools, rate, isl, OSL)))
    return decisions


def test_the_rise_spare_is_a_serve_flag_and_an_environment_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from dynserve.cli.main import _build_parser
    from dynserve.cli.options import settings_from
    from dynserve.cli.planning import planner_config
    from dynserve.errors import InvalidRequestError

    def spare(*flags: str) -> int:
        flags = ("serve", "--planner", "--planner-mode", "sla", *flags)
        settings = settings_from(_build_parser().parse_args(flags))
        return planner_config(settings).rise_spare_workers

    assert spare() == PlannerConfig().rise_spare_workers == 1
    assert spare("--planner-rise-spare-workers", "0") == 0
    monkeypatch.setenv("DYN_PLANNER_RISE_SPARE_WORKERS", "2")
    assert spare() == 2
    with pytest.raises(InvalidRequestError, match="--planner-rise-spare-workers: Input should be greater than"):
        spare("--planner-rise-spare-workers", "-1")


def test_a_rise_gets_a_spare_prefill_worker_and_a_flat_load_gives_it_back() -> None:
    """While the rate rises a prefill pool holds one worker over its need (its next worker serves only after a
    start, and a rise's next step may come first); decode pools get none; once the load is flat the spare
    goes after the down delay."""
    rates = [0.5 * step for step in range(1, 25)] + [12.0] * 30  # a ramp to 12 req/s, then flat
    config = dict(predictor="holt", interval_s=1.0, start_s=3.0, read_window_s=2.0, down_delay_s=5.0)
    spare = _decide_all(_config(**config), rates)
    plain = _decide_all(_config(**config, rise_spare_workers=0), rates)
    assert [d.targets["decode"] for d in spare] == [d.targets["decode"] for d in plain]
    assert all(s.targets["prefill"] >= p.targets["prefill"] for s, p in zip(spare, plain, strict=True))
    on_the_rise = [(s, p) for s, p in zip(spare[:24], plain[:24], strict=True)
                   if s.rising and s.needs["prefill"] >= PlannerConfig().rise_min_need
                   and math.ceil(s.needs["prefill"]) < 10]
    assert len(on_the_rise) >= 10
    assert all(s.targets["prefill"] > p.targets["prefill"] for s, p in on_the_rise)

    def second_worker_at(decisions: list[Decision]) -> float:
        return next(rate for rate, d in zip(rates, decisions, strict=True) if d.targets["prefill"] >= 2)

    assert second_worker_at(spare) < second_worker_at(plain)
    assert not spare[-1].rising and spare[-1].targets == plain[-1].targets  # flat: the spare is given back
    # ... once the down delay (5 s, counting its first interval) has passed since the rise ended
    last_rising = max(i for i, d in enumerate(spare) if d.rising)
    given_back = next(i for i in range(last_rising, len(rates)) if spare[i].targets == plain[i].targets)
    assert given_back - last_rising >= 4


def test_a_step_to_under_the_spare_threshold_starts_no_worker() -> None:
    """A pool at its floor whose rate steps up to a need of 0.7 of a worker (a trickle's blip: a few arrivals
    in a short window, which Holt's trend reads as a rise) keeps its one worker; a step to a need of 0.82 gets
    the rise's spare, one worker over the one it needs."""
    config = _config(predictor="holt", interval_s=1.0, start_s=3.0, read_window_s=2.0)
    blip = _decide_all(config, [1.0] * 10 + [2.5] * 3)[10:]
    assert all(0.55 < d.needs["prefill"] < 0.8 for d in blip) and any(d.rising for d in _decide_all(
        _config(predictor="holt", interval_s=1.0, start_s=3.0, read_window_s=2.0, rise_min_need=0.5),
        [1.0] * 10 + [2.5] * 3)[10:])
    assert [d.targets["prefill"] for d in blip] == [1, 1, 1]
    step = _decide_all(config, [1.0] * 10 + [3.5])[-1]
    assert 0.8 <= step.needs["prefill"] < 1.0 and step.rising and step.targets["prefill"] == 2


def test_no_spare_for_a_trickle_nor_without_a_trend() -> None:
    """A trickle whose rate rises a little and whose window holds one long prompt reads a need of a worker
    and more (that window's ISL, not a prediction, sizes it), but the rate alone fills a fraction of a
    worker at the ISL it usually sees: it gets the worker it needs and no spare."""
    config = dict(interval_s=1.0, start_s=3.0, read_window_s=2.0)
    rates = [0.2 + 0.1 * step for step in range(20)]
    isls = [ISL] * 12 + [2 * ISL] + [ISL] * 7  # a window with a long prompt
    trickle = _decide_all(_config(predictor="holt", **config), rates, isls)
    plain = _decide_all(_config(predictor="holt", rise_spare_workers=0, **config), rates, isls)
    assert trickle[12].needs["prefill"] > 1.0 and trickle[12].predicted_rate_per_s > rates[12]
    assert not any(d.rising for d in trickle)
    assert [d.targets for d in trickle] == [d.targets for d in plain]
    ramp = [0.5 * step for step in range(1, 25)]
    level = _decide_all(_config(predictor="ewma", **config), ramp)  # a predictor without a trend never rises
    assert not any(d.rising for d in level)
    assert [d.targets for d in level] == [d.targets for d in _decide_all(
        _config(predictor="ewma", rise_spare_workers=0, **config), ramp)]
    with pytest.raises(ValueError, match="rise_spare_workers"):
        PlannerCore(_config(rise_spare_workers=-1), ("prefill", "decode"), _profile())
