"""The planner benchmark's trace (generator, Mooncake reader and writer, rates) and its accounting
(attainment, worker-seconds, scale events, static fleet sizes): pure functions, no fleet."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from benchmarks.planner import (
    attainment,
    attainment_by_window,
    fleet_for_rate,
    scale_events,
    worker_seconds,
)
from benchmarks.planner_trace import (
    DayShape,
    LengthDistribution,
    TraceRequest,
    compress,
    day_rate_per_s,
    generate,
    mean_rate_per_s,
    peak_rate_per_s,
    read_mooncake,
    summarize,
    trace_shape,
    windowed_rates_per_s,
    write_mooncake,
)
from dynserve.planner.core import Observation, PlannerConfig, PlannerCore, PoolObservation
from dynserve.planner.profile import CapacityProfile, DecodePoint, PrefillPoint

# ---- the generated day -------------------------------------------------------------------------------------


def _day(**changes: object) -> DayShape:
    return DayShape(**{"duration_s": 240.0, "peak_rate_per_s": 20.0, **changes})  # type: ignore[arg-type]


def test_the_day_is_a_function_of_its_seed() -> None:
    shape = _day()
    first, again, other = generate(shape, 0), generate(shape, 0), generate(shape, 1)
    assert first == again != other
    stamps = [r.timestamp_ms for r in first]
    assert stamps == sorted(stamps) and stamps[0] >= 0 and stamps[-1] < 240_000


def test_the_day_peaks_at_midday_far_above_its_trough() -> None:
    shape = _day(num_bursts=0)
    requests = generate(shape, 3)
    rates = windowed_rates_per_s([r.timestamp_s for r in requests], 240.0 / 8, 240.0)  # 3 hours a window
    assert max(rates) in rates[3:5]  # 9:00-15:00
    assert rates[0] < 0.2 * max(rates) and rates[-1] < 0.2 * max(rates)
    info = summarize(requests, 240.0, window_s=10.0)
    assert 2.3 < info["peak_over_mean"] < 3.2  # the benchmark's "peak / mean about 2.6", with window noise
    assert day_rate_per_s(shape, 120.0) == pytest.approx(20.0)
    assert day_rate_per_s(shape, 0.0) == pytest.approx(2.0)  # the trough: 10% of the peak


def test_bursts_add_load_the_curve_does_not_predict() -> None:
    calm, bursty = generate(_day(num_bursts=0), 5), generate(_day(num_bursts=3), 5)
    assert len(bursty) > len(calm) * 1.02


def test_lengths_are_lognormal_around_their_medians_and_clipped() -> None:
    requests = generate(_day(), 0)
    isls = sorted(r.input_length for r in requests)
    osls = sorted(r.output_length for r in requests)
    assert 1600 < isls[len(isls) // 2] < 2000 and 130 < osls[len(osls) // 2] < 170
    assert isls[0] >= 256 and isls[-1] <= 6144 and osls[0] >= 32 and osls[-1] <= 512
    clipped = LengthDistribution(median=1000, sigma=2.0, min_tokens=900, max_tokens=1100)
    rng = random.Random(0)
    assert {clipped.draw(rng) for _ in range(200)} <= set(range(900, 1101))


def test_the_benchmark_plays_the_same_load_per_second_quick_or_full() -> None:
    quick, full = trace_shape(quick=True), trace_shape(quick=False)
    assert quick.peak_rate_per_s == full.peak_rate_per_s and quick.duration_s < full.duration_s


# ---- Mooncake's format -------------------------------------------------------------------------------------


def test_mooncake_round_trip_and_extra_keys_ignored(tmp_path: Path) -> None:
    requests = generate(_day(duration_s=30.0), 0)
    path = tmp_path / "day.jsonl"
    write_mooncake(requests, path)
    assert read_mooncake(path) == requests  # whole milliseconds, as generated
    mooncake = tmp_path / "mooncake.jsonl"
    mooncake.write_text(
        '{"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47]}\n'
        "\n"
        '{"timestamp": 0, "input_length": 6472, "output_length": 26, "hash_ids": [0, 1, 2]}\n')
    assert read_mooncake(mooncake) == [TraceRequest(0, 6472, 26), TraceRequest(27482, 6955, 52)]


@pytest.mark.parametrize("line", ['{"timestamp": 1, "input_length": 5}', "not json",
                                  '{"timestamp": -1, "input_length": 5, "output_length": 5}',
                                  '{"timestamp": 1, "input_length": 0, "output_length": 5}'])
def test_a_bad_line_is_named(tmp_path: Path, line: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 1, "output_length": 1}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_mooncake(path)


def test_compress_maps_the_span_onto_the_replay_and_keeps_every_request() -> None:
    requests = [TraceRequest(1000, 10, 1), TraceRequest(4000, 20, 2), TraceRequest(31000, 30, 3)]
    played = compress(requests, 60.0)
    assert [r.timestamp_ms for r in played] == [0.0, 6000.0, 60000.0]
    assert [(r.input_length, r.output_length) for r in played] == [(10, 1), (20, 2), (30, 3)]
    assert compress([TraceRequest(500, 1, 1)], 10.0)[0].timestamp_ms == 0.0


# ---- rates -------------------------------------------------------------------------------------------------


def test_windowed_rates_and_the_peak_of_whole_windows() -> None:
    assert windowed_rates_per_s([0.0, 0.5, 1.0, 2.5, 9.9], 2.0, 5.0) == [1.5, 0.5, 1.0]  # last window: 1 s
    requests = [TraceRequest(t * 1000, 1, 1) for t in (0.0, 0.5, 1.0, 4.5)]
    assert peak_rate_per_s(requests, 2.0, 5.0) == 1.5  # the 1 s tail's 1/s would be 1.0; 2 of 4 s is not
    assert mean_rate_per_s(requests, 5.0) == 0.8


# ---- accounting --------------------------------------------------------------------------------------------


def test_worker_seconds_integrate_a_step_function_over_the_replay() -> None:
    samples = [(-1.0, 2), (1.0, 3), (4.0, 1)]
    assert worker_seconds(samples, 0.0, 10.0) == pytest.approx(2 * 1 + 3 * 3 + 1 * 6)
    assert worker_seconds(samples, 2.0, 3.0) == pytest.approx(3.0)
    assert worker_seconds([(5.0, 4)], 0.0, 10.0) == pytest.approx(20.0)  # nothing known before a sample
    assert worker_seconds([], 0.0, 10.0) == 0.0


def test_scale_events_count_changes_of_each_pools_target() -> None:
    targets = [{"prefill": 1, "decode": 1}, {"prefill": 1, "decode": 1}, {"prefill": 3, "decode": 1},
               {"prefill": 2, "decode": 2}, {"prefill": 2, "decode": 2}]
    assert scale_events(targets) == {"prefill": 2, "decode": 1}
    assert scale_events(targets[:1]) == {}


def test_attainment_overall_and_by_arrival_window() -> None:
    met = [True, False, True, True]
    assert attainment(met) == 0.75 and attainment([]) == 0.0
    by_window = attainment_by_window([0.5, 1.5, 1.7, 9.0], met, 2.0, 6.0)  # 9.0: late, in the last window
    assert by_window == [pytest.approx(2 / 3), None, 1.0]


def _profile() -> CapacityProfile:
    """A small made-up profile: prefill 10k tokens/s saturated, 0.1 s for 1,000 tokens alone; decode steps
    of 10 ms plus 0.2 ms a sequence."""
    return CapacityProfile(
        name="test", source="made up", created="2026-11-24", block_size=16, max_num_seqs=256,
        max_num_batched_tokens=8192, max_model_len=32768, num_kv_blocks=100_000,
        prefill=(PrefillPoint(1000, 0.1, 10_000.0), PrefillPoint(4000, 0.4, 10_000.0)),
        decode=tuple(DecodePoint(c, b, 0.010 + 0.0002 * b) for c in (1000, 4000) for b in (1, 16, 64, 256)))


def test_static_fleets_are_sized_by_the_planners_own_capacity_math() -> None:
    profile = _profile()
    fleet = fleet_for_rate(profile, 12.0, 1000.0, 200.0, ttft_target_s=0.5, itl_target_s=0.02)
    prefill_per_worker = profile.prefill_capacity_tokens_per_s(1000, 0.5)  # M/D/1 at k = 5: rho 8/9
    decode_per_worker = profile.decode_capacity_tokens_per_s(1100, 0.02)  # 50 sequences a 20 ms step
    assert fleet == {"prefill": math.ceil(12 * 1000 / prefill_per_worker),
                     "decode": math.ceil(12 * 200 / decode_per_worker)} == {"prefill": 2, "decode": 1}
    assert fleet_for_rate(profile, 0.01, 1000.0, 200.0, ttft_target_s=0.5, itl_target_s=0.02) == {
        "prefill": 1, "decode": 1}
    # the planner, fed the same load held steady, wants the same fleet
    config = PlannerConfig(ttft_target_s=0.5, itl_target_s=0.02, predictor="constant",
                           max_workers={"prefill": 16, "decode": 16})
    core = PlannerCore(config, ("prefill", "decode"), profile)
    for now_s in range(5):
        decision = core.decide(Observation(now_s=float(now_s), request_rate_per_s=30.0, mean_isl=1000.0,
                                           mean_osl=200.0, pools={"prefill": PoolObservation(num_workers=1),
                                                                  "decode": PoolObservation(num_workers=1)}))
    steady = fleet_for_rate(profile, 30.0, 1000.0, 200.0, ttft_target_s=0.5, itl_target_s=0.02)
    assert decision.targets == steady == {"prefill": 4, "decode": 3}
