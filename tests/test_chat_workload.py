"""The routing benchmark's workload and the summary its verdict rests on (pure helpers: no server)."""

from __future__ import annotations

import pytest

from benchmarks._chat_workload import ChatWorkload, TurnResult, make_chat_workload, summarize
from benchmarks.routing import Phase, parse_phase


def _workload(seed: int) -> ChatWorkload:
    return make_chat_workload(seed=seed, num_system_prompts=3, system_words=50, num_conversations=10,
                              num_turns=4, user_words=(5, 10), max_tokens=(8, 16), arrival_rate_per_s=2.0,
                              think_s=0.5)


def test_the_workload_is_a_function_of_its_seed() -> None:
    first, again, other = _workload(1), _workload(1), _workload(2)
    assert first == again != other
    assert first.num_turns == 40 and len(first.system_prompts) == 3
    starts = [c.start_s for c in first.conversations]
    assert starts == sorted(starts) and starts[0] > 0  # Poisson arrivals, in order
    assert len({c.system_index for c in first.conversations}) > 1  # prompts are shared, by several


def _turn(conversation: int, turn: int, prompt: int, cached: int, ttft_s: float = 0.1) -> TurnResult:
    return TurnResult(conversation, turn, ttft_s, 1.0, prompt, cached, 10)


def test_history_hit_counts_follow_ups_that_found_their_previous_prompt_cached() -> None:
    results = [
        _turn(0, 0, prompt=100, cached=32),
        _turn(0, 1, prompt=200, cached=96),   # previous prompt 100, less a block of 16: on its history
        _turn(0, 2, prompt=300, cached=150),  # previous 200: only the system prompt and a bit, elsewhere
        _turn(1, 0, prompt=120, cached=0, ttft_s=0.3),
        _turn(1, 1, prompt=240, cached=240),
    ]
    summary = summarize(results, block_size=16)
    assert summary["history_hit"] == pytest.approx(2 / 3)
    assert summary["cache_hit"] == pytest.approx((32 + 96 + 150 + 0 + 240) / (100 + 200 + 300 + 120 + 240))
    assert summary["ttft_p50_ms_by_turn"] == pytest.approx([200.0, 100.0, 100.0])
    assert summary["turns"] == 5


def test_phases_name_the_router_and_its_overlap_weight() -> None:
    assert parse_phase("kv") == Phase("kv", "kv", None)
    assert parse_phase("kv", default_overlap_weight=2.0) == Phase("kv", "kv", 2.0)
    assert parse_phase("kv:4") == Phase("kv:4", "kv", 4.0)
    assert parse_phase("sglang") == Phase("sglang", "sglang")
    for bad in ("kv:x", "rr:2", "random", ""):
        with pytest.raises(ValueError, match="bad phase"):
            parse_phase(bad)
