"""`benchmarks.engines` without vLLM: its runs rotate the order of the phases, so no router is always measured
first (on servers that have just warmed up) or last."""

from __future__ import annotations

from benchmarks.engines import PHASES, phase_order


def test_each_phase_comes_first_and_last_once_in_three_runs() -> None:
    orders = [phase_order(run) for run in range(3)]
    assert all(sorted(order) == sorted(PHASES) for order in orders)
    assert sorted(order[0] for order in orders) == sorted(PHASES)
    assert sorted(order[-1] for order in orders) == sorted(PHASES)
    assert phase_order(0) == PHASES == phase_order(3)
