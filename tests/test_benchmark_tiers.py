"""The tiers benchmark's pure parts: the script every policy plays, the device pool sized so conversations
evict each other, each policy's flags, and the figures computed from the turns. No fleet, no model."""

from __future__ import annotations

import pytest

from benchmarks._tiers_report import TurnResult, compare_outputs, headline, summarize_policy
from benchmarks._tiers_workload import (
    CONTROLS,
    FULL_PLAN,
    POLICIES,
    QUICK_PLAN,
    WORDS,
    Plan,
    make_conversations,
    max_prompt_tokens,
    policies,
    policy_flags,
    size_fleet,
    turn_order,
)

PLAN = Plan(num_conversations=4, num_turns=3, context_words=200, user_words=(10, 20), max_tokens=16)


def _flag(flags: list[str], name: str) -> str | None:
    return flags[flags.index(name) + 1] if name in flags else None


# ---- the workload -----------------------------------------------------------------------------------------


def test_the_script_is_a_function_of_its_seed() -> None:
    first, again = make_conversations(PLAN, 0), make_conversations(PLAN, 0)
    other = make_conversations(PLAN, 1)
    assert first == again != other
    assert len(first) == PLAN.num_conversations
    assert all(len(c.questions) == PLAN.num_turns for c in first)
    assert len({c.system for c in first}) == PLAN.num_conversations  # no shared prefix beyond a few words


def test_texts_are_made_of_the_single_token_words_and_the_planned_lengths() -> None:
    vocabulary = set(WORDS)
    for conversation in make_conversations(PLAN, 0):
        notes = conversation.system.split("Notes: ", 1)[1].split()
        assert len(notes) == PLAN.context_words and set(notes) <= vocabulary
        for question in conversation.questions:
            words = question.split("what about ", 1)[1].rstrip("?").split()
            assert PLAN.user_words[0] <= len(words) <= PLAN.user_words[1] and set(words) <= vocabulary


def test_turns_go_round_robin_so_every_other_conversation_comes_between_two_turns() -> None:
    order = turn_order(3, 2)
    assert order == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert sorted(order) == [(c, t) for c in range(3) for t in range(2)]
    for c in range(3):
        between = order[order.index((c, 0)) + 1:order.index((c, 1))]
        assert {conversation for conversation, _ in between} == {0, 1, 2} - {c}


def test_a_prompt_bound_grows_with_each_turn_by_a_question_and_an_answer() -> None:
    conversation = make_conversations(PLAN, 0)[0]
    bounds = [max_prompt_tokens(conversation, turn, PLAN.max_tokens) for turn in range(PLAN.num_turns)]
    assert bounds[0] > PLAN.context_words + len(conversation.questions[0].split())
    for turn in (1, 2):
        grown = bounds[turn] - bounds[turn - 1]
        assert grown > len(conversation.questions[turn].split()) + PLAN.max_tokens


@pytest.mark.parametrize("plan", [QUICK_PLAN, FULL_PLAN, PLAN])
def test_the_device_pool_holds_the_largest_request_but_the_workload_is_several_pools(plan: Plan) -> None:
    conversations = make_conversations(plan, 0)
    sizes = size_fleet(plan, conversations)
    largest = max(max_prompt_tokens(c, plan.num_turns - 1, plan.max_tokens) for c in conversations)
    assert sizes.device_blocks * plan.block_size >= largest + plan.max_tokens
    # both workers' pools together hold at most a third of the conversations' last contexts
    assert sizes.workload_blocks >= 1.5 * 2 * sizes.device_blocks
    # and no more than about one conversation each: the next conversation on a worker evicts the previous
    assert sizes.device_blocks < 2 * sizes.workload_blocks / plan.num_conversations


# ---- the policies -----------------------------------------------------------------------------------------


def test_the_four_policies_the_control_and_their_flags() -> None:
    sizes = size_fleet(PLAN, make_conversations(PLAN, 0))
    by_name = policies(sizes)
    assert tuple(by_name) == POLICIES + CONTROLS
    page, file = 1000, 1100
    flags = {name: policy_flags(policy, sizes, page_bytes=page, disk_file_bytes=file, disk_dir="/tmp/d")
             for name, policy in by_name.items()}
    for name in POLICIES:
        assert _flag(flags[name], "--workers") == "2" and _flag(flags[name], "--router") == "kv"
        assert _flag(flags[name], "--kv-blocks") == str(sizes.device_blocks)
    # the control: no tiers, a device pool per worker that holds every conversation
    assert flags["device"] == [*flags["none"][:5], str(sizes.workload_blocks), *flags["none"][6:]]
    assert "--kv-host-bytes" not in flags["none"] and "--kv-disk-bytes" not in flags["none"]
    host = int(_flag(flags["host"], "--kv-host-bytes") or 0)
    assert host >= sizes.workload_blocks * page and "--kv-disk-bytes" not in flags["host"]
    for name in ("host_disk", "all"):
        small = int(_flag(flags[name], "--kv-host-bytes") or 0)
        assert 0 < small <= sizes.device_blocks * page  # the rest must go to disk
        assert int(_flag(flags[name], "--kv-disk-bytes") or 0) >= sizes.workload_blocks * file
        assert _flag(flags[name], "--kv-disk-dir") == "/tmp/d"
    assert flags["host_disk"][:-4] == flags["all"]  # the same fleet, only the router's tier credits differ
    for name in ("none", "host", "host_disk"):
        assert _flag(flags[name], "--router-host-hit-weight") == "0"
        assert _flag(flags[name], "--router-disk-hit-weight") == "0"
    assert "--router-host-hit-weight" not in flags["all"]  # dynserve's defaults


# ---- the figures ------------------------------------------------------------------------------------------


def _turns(ttfts_s: dict[tuple[int, int], float], cached: int = 0, answer: str = "a") -> list[TurnResult]:
    return [TurnResult(c, t, ttft_s, 100 * (t + 1), cached if t > 0 else 0, f"{answer}{c}{t}")
            for (c, t), ttft_s in sorted(ttfts_s.items())]


def test_summary_counts_returning_turns_apart_from_first_turns() -> None:
    turns = _turns({(0, 0): 1.0, (1, 0): 3.0, (0, 1): 0.1, (1, 1): 0.3, (0, 2): 0.2}, cached=50)
    summary = summarize_policy(turns)
    assert summary["num_turns"] == 5 and summary["num_returning_turns"] == 3
    assert summary["ttft_returning_mean_ms"] == pytest.approx(200.0)
    assert summary["ttft_returning_p50_ms"] == pytest.approx(200.0)
    assert summary["ttft_first_mean_ms"] == pytest.approx(2000.0)
    assert summary["prompt_tokens"] == 100 + 100 + 200 + 200 + 300
    assert summary["prefill_tokens"] == summary["prompt_tokens"] - 3 * 50
    assert summary["prefill_tokens_returning"] == 200 + 200 + 300 - 3 * 50
    assert summary["cached_share_returning"] == pytest.approx(150 / 700)


def test_headline_ratios_are_the_baselines_mean_over_each_policys() -> None:
    keys = {(c, t): 0.0 for c in range(2) for t in range(3)}
    none = _turns({k: (2.0 if k[1] else 1.0) for k in keys})
    host = _turns({k: (0.5 if k[1] else 1.0) for k in keys}, cached=90)
    every = _turns({k: (0.25 if k[1] else 1.0) for k in keys}, cached=95)
    played = {"none": none, "host": host, "all": every}
    summaries = {name: summarize_policy(turns) for name, turns in played.items()}
    figures = headline(summaries)
    assert figures["ttft_ratio_none_over_host"] == pytest.approx(4.0)
    assert figures["ttft_ratio_none_over_all"] == pytest.approx(8.0)
    assert figures["ttft_ratio_none_over_host_disk"] is None  # not run
    prefill_none, prefill_all = summaries["none"]["prefill_tokens"], summaries["all"]["prefill_tokens"]
    assert figures["prefill_tokens_saved_ratio"] == pytest.approx(1 - prefill_all / prefill_none)
    assert figures["prefill_tokens_saved_ratio_returning"] == pytest.approx(1 - (1000 - 4 * 95) / 1000)
    assert headline({"host": summaries["host"]})["ttft_ratio_none_over_host"] is None  # no baseline


def test_identical_answers_across_policies() -> None:
    keys = {(c, t): 1.0 for c in range(2) for t in range(2)}
    outputs = compare_outputs({"none": _turns(keys), "host": _turns(keys), "all": _turns(keys)})
    assert outputs["outputs_identical"] is True and outputs["differences"] == []
    assert outputs["compared"] == ["host", "all"]


def test_a_differing_answer_is_named_once_per_conversation_at_its_first_turn() -> None:
    keys = {(c, t): 1.0 for c in range(2) for t in range(3)}
    changed = [TurnResult(r.conversation, r.turn, r.ttft_s, r.prompt_tokens, r.cached_tokens,
                          "other" if (r.conversation, r.turn) >= (1, 1) else r.answer) for r in _turns(keys)]
    outputs = compare_outputs({"none": _turns(keys), "host": _turns(keys), "all": changed})
    assert outputs["outputs_identical"] is False
    assert outputs["differences"] == [{"policy": "all", "conversation": 1, "turn": 1, "answer": "other",
                                       "baseline_answer": "a11"}]


def test_without_a_baseline_or_another_policy_nothing_is_called_identical() -> None:
    keys = {(0, 0): 1.0}
    assert compare_outputs({"host": _turns(keys)})["outputs_identical"] is False
    assert compare_outputs({"none": _turns(keys)})["outputs_identical"] is False


def test_answers_can_be_compared_against_the_device_control_instead() -> None:
    keys = {(c, t): 1.0 for c in range(2) for t in range(2)}
    flipped = [TurnResult(r.conversation, r.turn, r.ttft_s, r.prompt_tokens, r.cached_tokens,
                          "flip" if (r.conversation, r.turn) == (0, 1) else r.answer) for r in _turns(keys)]
    played = {"none": _turns(keys), "device": flipped, "all": flipped}
    assert compare_outputs(played)["outputs_identical"] is False  # prefix reuse flipped a near tie
    to_device = compare_outputs({k: v for k, v in played.items() if k != "none"}, "device")
    assert to_device["outputs_identical"] is True and to_device["compared"] == ["all"]
