"""`benchmarks.engines` without vLLM: its runs rotate the order of the phases, so no router is always measured
first (on servers that have just warmed up) or last; a phase's CPU counts a front end's child processes; what
each vLLM worker was given is read from its own `/metrics` series."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil

from benchmarks._dynctl import tree_cpu_s
from benchmarks.engines import PHASES, QueueSampler, parse_series, phase_order


def test_each_phase_comes_first_and_last_once_in_three_runs() -> None:
    orders = [phase_order(run) for run in range(3)]
    assert all(sorted(order) == sorted(PHASES) for order in orders)
    assert sorted(order[0] for order in orders) == sorted(PHASES)
    assert sorted(order[-1] for order in orders) == sorted(PHASES)
    assert phase_order(0) == PHASES == phase_order(3)


def test_vllm_series_are_summed_over_their_label_sets() -> None:
    # recorded from vLLM 0.32.0 after three requests: two stopped by length, one by a stop condition
    recorded = Path(__file__).parent / "fixtures" / "vllm" / "0.32.0" / "metrics.txt"
    series = parse_series(recorded.read_text())
    assert series["request_success_total"] == 3.0
    assert (series["prompt_tokens_total"], series["prefix_cache_queries_total"]) == (139.0, 139.0)
    assert series["prefix_cache_hits_total"] == 32.0
    assert series["num_requests_running"] == series["num_requests_waiting"] == 0.0


def test_a_process_trees_cpu_counts_its_childrens_work() -> None:
    # a parent that only waits on a child, which spins for half a second of CPU and then sleeps
    child = ("import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass\n"
             "time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c",
                               f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"])
    try:
        deadline_s = time.monotonic() + 10
        parent_alone = psutil.Process(parent.pid)
        while tree_cpu_s(parent.pid) - sum(parent_alone.cpu_times()[:2]) < 0.45:
            assert time.monotonic() < deadline_s, "the child's CPU never showed in its parent's tree"
            time.sleep(0.05)
    finally:
        for process in psutil.Process(parent.pid).children(recursive=True):
            process.kill()
        parent.kill()
        parent.wait()
    assert tree_cpu_s(parent.pid) == 0.0  # gone: nothing to count


def test_the_queue_sampler_reads_each_servers_queue_until_its_block_ends() -> None:
    """`QueueSampler` polls each server's `/metrics` (here one serving the recorded vLLM page) from its
    block's start to its end, and sums up what it saw per server and across them."""
    from types import SimpleNamespace

    from conftest import http_get_standin

    page = (Path(__file__).parent / "fixtures" / "vllm" / "0.32.0" / "metrics.txt").read_bytes()
    with http_get_standin(lambda: page) as port:
        fake = SimpleNamespace(port=port)
        with QueueSampler([fake, fake], interval_s=0.02) as sampler:  # type: ignore[list-item]
            deadline_s = time.monotonic() + 10
            while len(sampler.samples) < 3:  # a sample reads and parses two pages: slow on a busy machine
                assert time.monotonic() < deadline_s, sampler.samples
                time.sleep(0.02)
        count = len(sampler.samples)
        time.sleep(0.1)
        assert count >= 3 and len(sampler.samples) == count  # it stopped with its block
    series = parse_series(page.decode())
    queue = series["num_requests_running"] + series["num_requests_waiting"]
    summary = sampler.summary()
    assert summary["queue_mean_by_worker"] == [queue, queue]
    assert summary["queue_imbalance_mean"] == 0.0
    assert summary["waiting_mean"] == 2 * series["num_requests_waiting"]


def test_the_floor_plays_each_conversation_alone_and_reports_turns() -> None:
    """`--floor`: the plan's first conversations, each alone and starting at once (played one after another,
    no turn ever shares a worker), and TTFT p50 overall, of the returning turns and per turn."""
    from benchmarks._chat_workload import TurnResult
    from benchmarks.engines import FULL_PLAN, floor_summary, one_at_a_time

    workload = FULL_PLAN.workload(0, speedup=1.0)
    alone = one_at_a_time(workload, 3)
    assert [len(w.conversations) for w in alone] == [1, 1, 1]
    assert all(w.conversations[0].start_s == 0.0 for w in alone)
    assert all(w.system_prompts == workload.system_prompts for w in alone)
    assert [w.conversations[0].user_turns for w in alone] == [c.user_turns for c in workload.conversations[:3]]
    ttfts_s = [(1.9, 0.2, 0.21), (1.8, 0.19, 0.3)]  # two conversations of three turns
    results = [TurnResult(c, t, ttft_s, 1.0, 100, 0, 10)
               for c, ttfts in enumerate(ttfts_s) for t, ttft_s in enumerate(ttfts)]
    summary = floor_summary(results)
    assert summary["ttft_p50_ms_by_turn"] == [1850.0, 195.0, 255.0]
    assert summary["ttft_p50_ms_returning"] == 205.0 and summary["ttft_p50_ms"] == 255.0
