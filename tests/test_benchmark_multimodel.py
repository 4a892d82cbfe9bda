"""The multimodel benchmark's planner half, its pure parts: the trace of models taking turns, the fleets sized
for it, the flags each fleet gets, and the accounting of a replay (worker-seconds, attainment, scale events);
and its poller against a stand-in `GET /planner`. No fleet."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks._multimodel_planner import (
    FULL_TURNS,
    QUICK_TURNS,
    FleetRun,
    ModelsPoller,
    TurnsPlan,
    fleet_flags,
    summarize_planner,
    summarize_static,
    worker_starts,
    worst_windows,
)
from benchmarks._multimodel_trace import (
    TurnsShape,
    TurnsTrace,
    generate,
    model_rate_per_s,
    models_busy_at_once,
    rates_by_model,
    size_fleets,
)
from benchmarks._pressure import PressureSampler, Reading, around, read_counters
from benchmarks._streaming import StreamedCompletion
from benchmarks.planner import fleet_for_rate
from benchmarks.planner_trace import TraceRequest
from conftest import http_get_standin
from dynserve.planner import profile as profiles

PROFILE = profiles.shipped("llama-3.1-70b-h100-tp4")
TARGETS = {"ttft_target_s": 1.0, "itl_target_s": 0.02}


def _shape(**changes: object) -> TurnsShape:
    return TurnsShape(**{"num_models": 4, "phase_s": 20.0, "peak_rate_per_s": 8.0, "trickle_rate_per_s": 0.3,
                         **changes})  # type: ignore[arg-type]


# ---- the trace ---------------------------------------------------------------------------------------------


def test_the_trace_is_a_function_of_its_seed() -> None:
    shape = _shape()
    first, again, other = generate(shape, 0), generate(shape, 0), generate(shape, 1)
    assert first == again != other
    stamps = [r.timestamp_s for r in first.requests]
    assert stamps == sorted(stamps) and stamps[0] >= 0 and stamps[-1] < shape.duration_s == 100.0
    assert set(first.model_indexes) == {0, 1, 2, 3}
    assert len(first.requests) == len(first.model_indexes)


def test_each_model_rises_to_its_peak_and_hands_over_to_the_next() -> None:
    shape = _shape()
    assert model_rate_per_s(shape, 1, 20.0) == pytest.approx(0.3)  # model 1 starts rising at one phase
    assert model_rate_per_s(shape, 1, 40.0) == pytest.approx(8.3)  # and peaks one phase later
    assert model_rate_per_s(shape, 1, 70.0) == pytest.approx(0.3)  # back to its trickle
    for t_s in (25.0, 33.0, 47.5, 59.0, 71.0):  # past the first phase, the busy load is constant
        total = sum(model_rate_per_s(shape, m, t_s) for m in range(4))
        assert total == pytest.approx(8.0 + 4 * 0.3)


def test_at_any_time_one_or_two_models_carry_most_of_the_load() -> None:
    shape = _shape(num_models=5, phase_s=30.0)
    trace = generate(shape, 2)
    rates = rates_by_model(trace, 10.0)
    for k in range(len(rates[0])):
        window = sorted((rates[m][k] for m in range(5)), reverse=True)
        if sum(window) > 4:  # all but the start of the first rise and the end of the last fall
            assert window[0] + window[1] >= 0.75 * sum(window)
    for m in range(5):  # each model's busiest window is around its own peak, (m + 1) phases in
        busiest_s = max(range(len(rates[m])), key=lambda k: rates[m][k]) * 10.0 + 5.0
        assert abs(busiest_s - (m + 1) * 30.0) <= 20.0


def test_lengths_come_from_the_shape() -> None:
    trace = generate(_shape(), 0)
    isls = sorted(r.input_length for r in trace.requests)
    osls = sorted(r.output_length for r in trace.requests)
    assert 2400 < isls[len(isls) // 2] < 3200 and 120 < osls[len(osls) // 2] < 160
    assert isls[0] >= 1024 and isls[-1] <= 6144 and osls[0] >= 32 and osls[-1] <= 384


def test_a_bad_shape_is_refused() -> None:
    with pytest.raises(ValueError):
        _shape(num_models=0)
    with pytest.raises(ValueError):
        _shape(phase_s=0.0)


# ---- sizing ------------------------------------------------------------------------------------------------


def _handmade_trace() -> TurnsTrace:
    """Two models over 8 s: model 0 sends 40 requests in the first 4 s, model 1 one; then model 1 sends 20."""
    requests = [(i * 0.1, 0) for i in range(40)] + [(2.0, 1)] + [(4.0 + i * 0.2, 1) for i in range(20)]
    requests.sort()
    return TurnsTrace(tuple(TraceRequest(t * 1000, 3000, 150) for t, _ in requests),
                      tuple(m for _, m in requests), duration_s=8.0, num_models=2)


def test_the_static_fleet_carries_each_models_busiest_window() -> None:
    sizing = size_fleets(PROFILE, _handmade_trace(), 4.0, **TARGETS)
    assert sizing.peak_rate_by_model == [10.0, 5.0]
    busiest = fleet_for_rate(PROFILE, 10.0, 3000.0, 150.0, **TARGETS)
    assert sizing.static_fleet == busiest == {"prefill": 3, "decode": 2}
    assert sizing.static_workers == 2 * 5  # every model gets the busiest model's pools
    # per window, what both models' loads need: 10 + 0.25 req/s, then 0 + 5
    first = sum(busiest.values()) + sum(fleet_for_rate(PROFILE, 0.25, 3000.0, 150.0, **TARGETS).values())
    second = 2 + sum(fleet_for_rate(PROFILE, 5.0, 3000.0, 150.0, **TARGETS).values())
    assert sizing.oracle_workers == [first, second] == [7, 5]
    assert sizing.budget == 7 + 2


def test_the_benchmarks_static_fleet_is_more_than_twice_what_the_load_needs_on_average() -> None:
    """The headroom the planner can win back: the quick trace's static fleet against the oracle's mean."""
    trace = generate(QUICK_TURNS.shape, 0)
    sizing = size_fleets(PROFILE, trace, QUICK_TURNS.sizing_window_s, **TARGETS)
    mean_need = sum(sizing.oracle_workers) / len(sizing.oracle_workers)
    assert mean_need < 0.7 * sizing.static_workers
    assert max(sizing.oracle_workers) < sizing.budget <= sizing.static_workers


def test_the_planners_budget_holds_the_floors_and_the_models_busy_at_once() -> None:
    """A model holds workers over its floors from its rise to a down delay after its fall: with 30 s phases
    and a 10 s down delay three models do at once (the rising one, the one falling from its peak, the one before
    it in its down delay), so the full plan's budget is three static models, seven at their floors, plus 2:
    more than the oracle's busiest window (which no planner with floors and a down delay can keep to), less
    than the static fleet."""
    assert models_busy_at_once(FULL_TURNS.shape, FULL_TURNS.down_delay_s) == 3
    assert models_busy_at_once(FULL_TURNS.shape, 0.0) == 2  # no down delay: the rising and the falling one
    assert models_busy_at_once(_shape(num_models=2), 30.0) == 2  # never more than the models
    trace = generate(FULL_TURNS.shape, 0)
    sizing = size_fleets(PROFILE, trace, FULL_TURNS.sizing_window_s, **TARGETS,
                         busy_at_once=models_busy_at_once(FULL_TURNS.shape, FULL_TURNS.down_delay_s))
    assert sizing.static_fleet == {"prefill": 3, "decode": 2}
    assert sizing.budget == 3 * 5 + 7 * 2 + 2 == 31
    # the benchmark's floors (2 prefill + 1 decode a model): the seven others hold three workers each
    at_floors = size_fleets(PROFILE, trace, FULL_TURNS.sizing_window_s, **TARGETS, floors=FULL_TURNS.floors,
                            busy_at_once=models_busy_at_once(FULL_TURNS.shape, FULL_TURNS.down_delay_s))
    assert FULL_TURNS.floors == {"prefill": 2, "decode": 1}
    assert at_floors.budget == 3 * 5 + 7 * 3 + 2 == 38 < at_floors.static_workers
    assert max(sizing.oracle_workers) + 2 < sizing.budget < sizing.static_workers
    # two models busy at once on the hand-made trace: their static pools and the margin exceed the static
    # fleet, which caps it
    assert size_fleets(PROFILE, _handmade_trace(), 4.0, **TARGETS, busy_at_once=2).budget == 10


def test_each_fleet_gets_its_models_and_the_planner_its_bounds_and_budget(tmp_path: Path) -> None:
    links = [tmp_path / "model-00.gguf", tmp_path / "model-01.gguf"]
    sizing = size_fleets(PROFILE, _handmade_trace(), 4.0, **TARGETS)
    flags = fleet_flags(TurnsPlan(_shape(num_models=2)), links, sizing)

    def value(argv: list[str], flag: str) -> str:
        return argv[argv.index(flag) + 1]

    for argv in flags.values():
        assert [argv[i + 1] for i, f in enumerate(argv) if f == "--model"] == [str(link) for link in links]
        assert value(argv, "--mocker") == "llama-3.1-70b-h100-tp4"
    static, planner = flags["static"], flags["planner"]
    assert "--planner" not in static
    assert (value(static, "--prefill-workers"), value(static, "--decode-workers")) == ("3", "2")
    # the planner starts at its floors: 2 prefill workers (one a standing spare, no rise spare) and 1 decode
    assert (value(planner, "--prefill-workers"), value(planner, "--decode-workers")) == ("2", "1")
    assert value(planner, "--planner-max-prefill-workers") == "3"
    assert value(planner, "--planner-max-decode-workers") == "2"
    assert (value(planner, "--planner-min-prefill-workers"), value(planner, "--planner-min-decode-workers")) == (
        "2", "1")
    assert value(planner, "--planner-rise-spare-workers") == "0"
    assert value(planner, "--planner-max-total-workers") == "9"
    one = fleet_flags(TurnsPlan(_shape(num_models=2), prefill_floor=1), links, sizing)["planner"]
    assert value(one, "--prefill-workers") == value(one, "--planner-min-prefill-workers") == "1"
    assert (value(planner, "--planner-interval-s"), value(planner, "--planner-window-s")) == ("1", "3")


# ---- accounting --------------------------------------------------------------------------------------------


def _completion(ttft_s: float, itl_s: float, num_tokens: int = 10) -> StreamedCompletion:
    times = [ttft_s + i * itl_s for i in range(num_tokens)]
    return StreamedCompletion(0.0, sent_s=0.0, chunk_times_s=times, chunk_num_tokens=[1] * num_tokens)


def test_worker_seconds_attainment_and_scale_events_per_model() -> None:
    trace = _handmade_trace()  # 61 requests, 8 s
    names = ["model-00", "model-01"]
    # model 0's requests all meet the SLO; model 1's first one misses TTFT (3 s > 2 s), the rest meet it
    results = []
    seen_model_1 = False
    for m in trace.model_indexes:
        late = m == 1 and not seen_model_1
        seen_model_1 = seen_model_1 or m == 1
        results.append(_completion(3.0 if late else 0.5, 0.02))
    one, two = {"prefill": 1, "decode": 1}, {"prefill": 2, "decode": 1}
    samples = [(0.0, {"model-00": two, "model-01": one}, {"model-00": one, "model-01": one}),
               (2.0, {"model-00": two, "model-01": one}, {"model-00": two, "model-01": one}),
               (5.0, {"model-00": one, "model-01": two}, {"model-00": one, "model-01": two})]
    run = FleetRun(results, ready_s=1.0, replay_wall_s=8.5, server_cpu_cores=1.0, samples=samples)
    planner = summarize_planner(run, trace, names, window_s=4.0)
    # model 0: 2 workers for 2 s, 3 for 3 s, 2 for 3 s; model 1: 2 for 5 s, 3 for 3 s
    assert planner["worker_s_by_model"] == {"model-00": 4 + 9 + 6, "model-01": 10 + 9}
    assert planner["worker_s"] == 38
    assert planner["scale_events_by_model"] == {"model-00": {"prefill": 1}, "model-01": {"prefill": 1}}
    assert planner["worker_starts_by_model"] == {"model-00": 0, "model-01": 1} and planner["worker_starts"] == 1
    assert planner["max_serving_by_model"]["model-01"] == {"prefill": 2, "decode": 1}
    assert planner["attainment"] == pytest.approx(60 / 61)
    assert planner["attainment_by_model"] == {"model-00": 1.0, "model-01": pytest.approx(20 / 21)}
    assert planner["attainment_by_window"] == [pytest.approx(40 / 41), 1.0]
    sizing = size_fleets(PROFILE, trace, 4.0, **TARGETS)
    static = summarize_static(run, trace, names, sizing, window_s=4.0)
    assert static["worker_s"] == sizing.static_workers * 8.0 == 80.0
    assert math.isclose(planner["worker_s"] / static["worker_s"], 0.475)


def test_a_request_misses_the_slo_on_mean_itl_or_an_error() -> None:
    trace = TurnsTrace((TraceRequest(0, 3000, 10),) * 3, (0, 0, 0), duration_s=1.0, num_models=1)
    slow = _completion(0.5, 0.030)  # 30 ms > 25 ms
    failed = StreamedCompletion(0.0, error="no end of stream within 60 s")
    run = FleetRun([_completion(0.5, 0.02), slow, failed], ready_s=1.0, replay_wall_s=1.0, server_cpu_cores=1.0)
    summary = summarize_planner(run, trace, ["model-00"], window_s=1.0)
    assert summary["attainment"] == pytest.approx(1 / 3)
    assert summary["ttft_attainment"] == pytest.approx(2 / 3) and summary["num_errors"] == 1
    assert (summary["num_missed_ttft"], summary["num_missed_itl"], summary["num_missed"]) == (1, 2, 2)


def test_the_send_lag_and_ttft_are_read_by_window() -> None:
    trace = TurnsTrace(tuple(TraceRequest(t_ms, 3000, 10) for t_ms in (0, 500, 1500)), (0, 0, 0), duration_s=2.0,
                       num_models=1)
    late = StreamedCompletion(0.5, sent_s=0.9, chunk_times_s=[1.0 + 0.02 * i for i in range(10)],
                              chunk_num_tokens=[1] * 10)  # sent 400 ms late; its first token 100 ms after
    unsent = StreamedCompletion(1.5, error="connection refused")
    run = FleetRun([_completion(0.3, 0.02), late, unsent], ready_s=1.0, replay_wall_s=2.0, server_cpu_cores=1.0)
    summary = summarize_planner(run, trace, ["model-00"], window_s=1.0)
    assert summary["send_lag_p99_ms_by_window"][1] is None  # nothing was sent in the second second
    assert 390 < summary["send_lag_p99_ms_by_window"][0] <= 400
    # TTFT from when each was sent: 300 ms and 100 ms
    assert 100 < summary["ttft_p95_ms_by_window"][0] <= 300 and summary["ttft_p95_ms_by_window"][1] is None


def test_worker_starts_count_what_the_targets_added_and_the_trickles_apart() -> None:
    one, three = {"prefill": 1, "decode": 1}, {"prefill": 3, "decode": 2}
    samples = [(0.0, {"a": one, "b": one}, {}), (1.0, {"a": three, "b": one}, {}),
               (2.0, {"a": one, "b": {"prefill": 2, "decode": 1}}, {}), (3.0, {"a": three, "b": one}, {})]
    by_model, outside = worker_starts(samples, ["a", "b"], bumps=[(0.0, 1.5), (0.0, 10.0)])
    assert by_model == {"a": 6, "b": 1}  # a: +3 at 1 s, +3 at 3 s; b: +1 at 2 s; shrinks start nothing
    assert outside == 3  # a's second rise, after its bump
    assert worker_starts(samples, ["a", "b"]) == (by_model, 0)


# ---- the poller --------------------------------------------------------------------------------------------


@pytest.fixture
def planner_standin() -> Iterator[tuple[int, list[dict[str, object]]]]:
    """An HTTP server answering `GET /planner` with the last of `states` (a list the test appends to)."""
    states: list[dict[str, object]] = []
    with http_get_standin(lambda: json.dumps(states[-1]).encode()) as port:
        yield port, states


def test_the_poller_reads_every_models_pools(planner_standin: tuple[int, list[dict[str, object]]]) -> None:
    port, states = planner_standin
    decision = {"now_s": 100.0, "targets": {"prefill": 2, "decode": 1}}
    model = {"pools": ["prefill", "decode"], "targets": {"prefill": 2, "decode": 1},
             "serving": {"prefill": 1, "decode": 1}, "overrides": {}, "last_decision": decision}
    other = {**model, "targets": {"prefill": 1, "decode": 1}, "last_decision": None}
    states.append({"mode": "sla", "targets": model["targets"], "serving": model["serving"],
                   "models": {"model-00": model, "model-01": other}})
    with ModelsPoller(port, start_s=time.monotonic(), period_s=0.02) as poller:
        deadline_s = time.monotonic() + 5.0
        while len(poller.model_samples) < 2 and time.monotonic() < deadline_s:
            time.sleep(0.05)
    t_s, targets, serving = poller.model_samples[0]
    assert t_s > 0 and targets == {"model-00": {"prefill": 2, "decode": 1}, "model-01": {"prefill": 1, "decode": 1}}
    assert serving["model-00"] == {"prefill": 1, "decode": 1}
    assert [d["now_s"] for d in poller.model_decisions["model-00"]] == [100.0]  # read twice, kept once
    assert "model-01" not in poller.model_decisions or not poller.model_decisions["model-01"]


def test_the_quick_plan_is_short_and_the_flags_change_the_planner_half() -> None:
    from benchmarks.multimodel import parse_args, turns_plan

    quick, full = turns_plan(parse_args(["--quick"])), turns_plan(parse_args([]))
    assert quick.shape.duration_s <= 90 and quick.shape.num_models >= 3
    assert full.shape.num_models == 10 and full.shape.phase_s > quick.shape.phase_s
    changed = turns_plan(parse_args(["--turn-models", "6", "--phase-s", "25", "--planner-window-s", "4"]))
    assert (changed.shape.num_models, changed.shape.phase_s, changed.window_s) == (6, 25.0, 4.0)
    assert changed.interval_s == full.interval_s and changed.shape.peak_rate_per_s == full.shape.peak_rate_per_s


def test_the_replays_client_runs_above_the_fleets_priority_and_gives_it_back() -> None:
    import os

    from benchmarks._common import client_priority

    before = os.getpriority(os.PRIO_PROCESS, 0)
    seen: list[int] = []
    with client_priority(-5) as niceness:
        thread = threading.Thread(target=lambda: seen.append(os.getpriority(os.PRIO_PROCESS, 0)))
        thread.start()
        thread.join()
        inside = os.getpriority(os.PRIO_PROCESS, 0)
    assert os.getpriority(os.PRIO_PROCESS, 0) == before
    if niceness is None:  # not root: nothing changed, and the caller is told so
        assert inside == before == seen[0]
    else:  # the client's thread and the threads it starts (the planner poller's) run at -5
        assert inside == niceness == -5 == seen[0]


def test_the_pressure_rows_are_differences_of_the_machines_counters() -> None:
    from benchmarks._pressure import _row

    psi = dict.fromkeys(("cpu_some", "io_some", "io_full", "memory_some", "memory_full"), 0)
    before = Reading(10.0, psi, major_faults=100, new_tasks=7, busy_ticks=1000)
    after = Reading(12.0, {**psi, "cpu_some": 250_000, "io_some": 1_500, "memory_full": None}, 160, 9, 1300)
    row = _row(3.0, before, after, clock_ticks=100)
    assert row == {"t_s": 3.0, "cpu_some_ms": 250.0, "io_some_ms": 1.5, "io_full_ms": 0.0,
                   "memory_some_ms": 0.0, "memory_full_ms": None, "major_faults": 60, "new_tasks": 2,
                   "busy_cores": 1.5}
    rows = [{**row, "t_s": 0.0}, {**row, "t_s": 1.0, "busy_cores": 2.0}, {**row, "t_s": 2.0}]
    summed = around(rows, 0.0, 2.0)  # the rows of seconds 0 and 1
    assert summed["seconds"] == 2 and summed["cpu_some_ms"] == 500.0 and summed["major_faults"] == 120
    assert summed["busy_cores_max"] == 2.0 and summed["busy_cores_mean"] == 1.75
    assert summed["memory_full_ms"] is None  # a column the kernel lacks stays unknown, not 0
    assert around(rows, 10.0, 20.0)["cpu_some_ms"] is None  # so does a window the sampler never saw


def test_the_sampler_sees_this_process_fork_and_keep_a_core_busy() -> None:
    import subprocess
    import sys

    first = read_counters()
    with PressureSampler(period_s=0.02) as sampler:
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        deadline = time.monotonic() + 1.1
        while time.monotonic() < deadline:
            sum(range(1000))
    assert read_counters().new_tasks > first.new_tasks
    assert len(sampler.rows) >= 1 and sum(row["new_tasks"] for row in sampler.rows) >= 1
    assert max(row["busy_cores"] for row in sampler.rows) >= 0.5


def test_the_worst_windows_come_with_their_lag_and_the_machines_stalls() -> None:
    summary = {"attainment_by_window": [1.0, 0.4, None, 0.9],
               "send_lag_p99_ms_by_window": [5.0, 900.0, None, 20.0],
               "pressure_by_second": [{"t_s": float(t), "cpu_some_ms": 10.0 * t, "io_some_ms": 0.0,
                                       "io_full_ms": 0.0, "memory_some_ms": 0.0, "memory_full_ms": 0.0,
                                       "major_faults": t,
                                       "new_tasks": 0, "busy_cores": 1.0} for t in range(8)]}
    worst = worst_windows(summary, window_s=2.0, count=2)
    assert [(w["window"], w["attainment"], w["send_lag_p99_ms"]) for w in worst] == [
        (1, 0.4, 900.0), (3, 0.9, 20.0)]
    assert worst[0]["cpu_some_ms"] == 50.0 and worst[0]["major_faults"] == 5  # seconds 2 and 3
