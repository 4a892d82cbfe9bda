"""Capacity profiles as the planner uses them: the capacity math on a hand-built profile, the shipped
profiles, and `dynctl profile` measuring a mocker into a profile that agrees with the mocker's own step-time
model."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from dynserve.cli.main import main
from dynserve.errors import InvalidRequestError
from dynserve.planner.profile import CapacityProfile, DecodePoint, PrefillPoint, load, shipped, shipped_names
from dynserve.workers.mocker_profiles import CPU, PROFILES, StepWork


def _profile(**overrides: Any) -> CapacityProfile:
    """A small profile with round numbers: TTFT 0.1 / 0.5 / 1.5 s at ISL 100 / 1000 / 2000; ITL 10 / 20 /
    100 ms at batch 1 / 10 / 100 for context 1000, 12 / 30 / 200 ms for context 2000."""
    values: dict[str, Any] = {
        "name": "test", "source": "hand-built", "created": "2026-01-01", "block_size": 16,
        "max_num_seqs": 256, "max_num_batched_tokens": 2048, "max_model_len": 8192, "num_kv_blocks": 100_000,
        "prefill": (PrefillPoint(100, 0.1, 1000.0), PrefillPoint(1000, 0.5, 2000.0),
                    PrefillPoint(2000, 1.5, 1500.0)),
        "decode": (DecodePoint(1000, 1, 0.010), DecodePoint(1000, 10, 0.020), DecodePoint(1000, 100, 0.100),
                   DecodePoint(2000, 1, 0.012), DecodePoint(2000, 10, 0.030), DecodePoint(2000, 100, 0.200)),
    }
    return CapacityProfile(**{**values, **overrides})


# ---- the capacity math ------------------------------------------------------------------------------

def test_curves_interpolate_between_points_and_are_conservative_beyond_them() -> None:
    profile = _profile()
    assert profile.ttft_alone_s(550) == pytest.approx(0.3)
    assert profile.ttft_alone_s(10) == pytest.approx(0.1)  # below: the smallest job's time
    assert profile.ttft_alone_s(3000) == pytest.approx(2.5)  # above: the last segment extended
    assert profile.prefill_tokens_per_s(1500) == pytest.approx(1750.0)
    assert profile.prefill_tokens_per_s(50_000) == pytest.approx(1500.0)  # throughput is never extrapolated
    assert profile.itl_s(1000, 55) == pytest.approx(0.060)
    assert profile.itl_s(1500, 10) == pytest.approx(0.025)  # between contexts
    assert profile.itl_s(500, 1) == pytest.approx(0.010)
    assert profile.itl_s(3000, 1) == pytest.approx(0.014)
    assert profile.itl_s(1000, 190) == pytest.approx(0.180)
    assert profile.expected_itl_s(1500, 10) == profile.itl_s(1500, 10)


def test_prefill_capacity_follows_the_md1_queue() -> None:
    profile = _profile()
    # S = 0.5 s at ISL 1000; a 1 s target is k = 2, so rho = 2/3 of the saturated 2000 tokens/s
    assert profile.prefill_capacity_tokens_per_s(1000, 1.0) == pytest.approx(2000 * 2 / 3)
    assert profile.prefill_capacity_tokens_per_s(1000, 2.0) == pytest.approx(2000 * 6 / 7)  # k = 4
    assert profile.prefill_capacity_tokens_per_s(1000, 0.5) == 0.0  # the target is TTFT alone: no room
    assert profile.prefill_capacity_tokens_per_s(1000, 0.3) == 0.0
    assert profile.expected_ttft_s(1000, 0.0) == pytest.approx(0.5)
    assert profile.expected_ttft_s(1000, 1000.0) == pytest.approx(0.5 * (1 + 0.5 / (2 * 0.5)))
    assert profile.expected_ttft_s(1000, 2000.0) == math.inf
    for target_s in (0.6, 1.0, 3.0):  # at its capacity a worker is expected to meet the target exactly
        capacity = profile.prefill_capacity_tokens_per_s(1000, target_s)
        assert profile.expected_ttft_s(1000, capacity) == pytest.approx(target_s)
    with pytest.raises(ValueError, match="load"):
        profile.expected_ttft_s(1000, -1.0)


def test_decode_capacity_is_the_largest_batch_within_the_itl_target() -> None:
    profile = _profile()
    assert profile.decode_capacity_tokens_per_s(1000, 0.009) == 0.0  # one sequence already misses it
    assert profile.decode_capacity_tokens_per_s(1000, 0.010) == pytest.approx(100.0)
    assert profile.decode_capacity_tokens_per_s(1000, 0.020) == pytest.approx(10 / 0.020)
    assert profile.decode_capacity_tokens_per_s(1000, 0.060) == pytest.approx(55 / 0.060)
    # a loose target: max_num_seqs caps the batch
    assert profile.decode_capacity_tokens_per_s(1000, 10.0) == pytest.approx(256 / profile.itl_s(1000, 256))
    # the KV cache caps it too: 125 blocks of 16 per sequence of 2000 tokens, 12,500 blocks hold 100
    small_cache = _profile(num_kv_blocks=12_500)
    assert small_cache.max_decode_batch(2000) == 100
    assert small_cache.decode_capacity_tokens_per_s(2000, 10.0) == pytest.approx(100 / 0.200)
    assert _profile(num_kv_blocks=100).decode_capacity_tokens_per_s(2000, 10.0) == 0.0  # one does not fit


@pytest.mark.parametrize("isl_or_context", [100, 700, 1000, 1800, 4000])
def test_capacity_never_falls_as_targets_loosen(isl_or_context: int) -> None:
    profile = _profile()
    targets_s = [0.001 * 1.2**i for i in range(60)]
    prefill = [profile.prefill_capacity_tokens_per_s(isl_or_context, t) for t in targets_s]
    decode = [profile.decode_capacity_tokens_per_s(isl_or_context, t) for t in targets_s]
    assert prefill == sorted(prefill) and prefill[-1] > 0
    assert decode == sorted(decode) and decode[-1] > 0


def test_a_profile_round_trips_through_its_file_and_bad_files_are_refused(tmp_path: Path) -> None:
    profile = _profile()
    profile.save(tmp_path / "p.json")
    assert load(tmp_path / "p.json") == profile
    data = json.loads((tmp_path / "p.json").read_text())
    data["prefill"] = list(reversed(data["prefill"]))
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(InvalidRequestError, match="increasing isl"):
        load(tmp_path / "bad.json")
    (tmp_path / "junk.json").write_text("{")
    with pytest.raises(InvalidRequestError, match="not JSON"):
        load(tmp_path / "junk.json")
    with pytest.raises(InvalidRequestError, match="cannot read"):
        load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="at least one"):
        _profile(decode=())


# ---- shipped profiles ---------------------------------------------------------------------------------

def test_every_mocker_hardware_profile_ships_a_sane_capacity_profile() -> None:
    assert set(PROFILES) <= set(shipped_names())
    for name in shipped_names():
        profile = shipped(name)
        assert profile.name == name and "dynctl profile" in profile.source
        ttfts = [p.ttft_s for p in profile.prefill]
        assert ttfts == sorted(ttfts) and len(ttfts) >= 3, name
        for context in {d.context for d in profile.decode}:
            itls = [d.itl_s for d in profile.decode if d.context == context]
            assert itls == sorted(itls), (name, context)
        isl, context = 1024, min(d.context for d in profile.decode)
        assert profile.prefill_capacity_tokens_per_s(isl, 10 * profile.ttft_alone_s(isl)) > 0, name
        assert profile.decode_capacity_tokens_per_s(context, 2 * profile.itl_s(context, 1)) > 0, name


def test_an_unknown_shipped_profile_names_the_shipped_ones() -> None:
    with pytest.raises(InvalidRequestError) as raised:
        shipped("nope")
    assert "'nope'" in str(raised.value)
    assert all(name in str(raised.value) for name in shipped_names())


# ---- dynctl profile -----------------------------------------------------------------------------------

def _ms(work: StepWork) -> float:
    return CPU.step_time_ms(work)


def test_dynctl_profile_measures_what_the_mocker_models(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    output = tmp_path / "cpu.json"
    code = main(["profile", "--mocker", "cpu", "--mocker-speedup", "20", "--quick", "--isl", "128,512",
                 "--context", "256,8192", "--batch", "1,8", "--output", str(output)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert str(output) in captured.out
    assert "context=8192 batch=1: skipped" in captured.err  # 8192 tokens and more exceed the cpu's limit
    profile = load(output)
    assert "speedup 20" in profile.source and "--mocker cpu" in profile.source
    assert profile.max_num_batched_tokens == CPU.max_num_batched_tokens
    assert profile.max_num_seqs == CPU.max_num_seqs
    budget = CPU.max_num_batched_tokens
    for point in profile.prefill:  # ISLs dividing the budget: one step alone, full-budget steps saturated
        isl = point.isl
        assert point.ttft_s == pytest.approx(_ms(StepWork(isl, isl * (isl + 1) // 2)) / 1e3, rel=0.25)
        full_step_ms = _ms(StepWork(budget, budget // isl * isl * (isl + 1) // 2))
        assert point.tokens_per_s == pytest.approx(budget / full_step_ms * 1e3, rel=0.25)
    assert [(d.context, d.batch_size) for d in profile.decode] == [(256, 1), (256, 8)]
    for point in profile.decode:
        batch = point.batch_size
        # each sequence holds its prompt and the few tokens it decoded before and during the timed steps
        num_context_tokens = batch * (point.context + 8)
        expected_ms = _ms(StepWork(num_decode_seqs=batch, num_decode_context_tokens=num_context_tokens))
        assert point.itl_s == pytest.approx(expected_ms / 1e3, rel=0.25)


def test_dynctl_profile_refuses_bad_point_lists(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["profile", "--mocker", "cpu", "--isl", "128,abc", "--output", str(tmp_path / "p.json")])
    assert exited.value.code == 2
    assert "comma-separated integers" in capsys.readouterr().err
