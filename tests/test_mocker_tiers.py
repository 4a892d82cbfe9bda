"""The mocker's KV tiers: the engine's tier bookkeeping without pages. Fed the same admissions, a block manager
over the mocker's tiers (`TierBook` over `NoPages`) emits the very KV events, holds the very blocks per tier
and counts the very tier counters as one over the engine's `KVTiers` (torch pages, block files); a mocker
worker with `kv_host_bytes` / `kv_disk_bytes` builds its tiers from its profile's bytes per block without
importing torch, and a step that onboards blocks takes the profile's onboarding time more. Also the tiers
benchmark's mocker part: its flags and sizes. No fleet, no model.
"""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks._tiers_workload import (
    QUICK_PLAN,
    make_conversations,
    mocker_block_bytes,
    mocker_flags,
    policies,
    policy_flags,
    size_fleet,
)
from dynserve.config import Settings
from dynserve.engine.block_manager import BlockManager
from dynserve.engine.kv_tier_book import NoPages, TierBook, TierPolicy, TierStats
from dynserve.engine.sequence import Sequence
from dynserve.model.tokenizer import Tokenizer
from dynserve.protocol import MEDIA, SamplingParams
from dynserve.workers.metrics import tier_families
from dynserve.workers.mocker import MockEngine, mock_tiers
from dynserve.workers.mocker_profiles import CPU, LLAMA_70B_H100_TP4, PROFILES, MockerProfile

from conftest import lazy_import

torch = lazy_import("torch")  # imported on first use: collecting this file imports no torch
kv_tiers = lazy_import("dynserve.engine.kv_tiers")

REPO = Path(__file__).resolve().parent.parent
SALT, BLOCK_SIZE = 7, 2
PAGE_SHAPE = (1, 2, BLOCK_SIZE, 1, 2)  # layers, K/V, block size, kv heads, head dim


def no_pages_manager(num_blocks: int, host_blocks: int, disk_blocks: int, page_bytes: int) -> BlockManager:
    stats = TierStats()
    tiers = TierBook(stats, NoPages(stats, page_bytes=page_bytes, num_host_slots=host_blocks,
                                    num_disk_blocks=disk_blocks))
    return BlockManager(num_blocks, BLOCK_SIZE, SALT, tiers=tiers)  # type: ignore[arg-type]


def serve(manager: BlockManager, token_ids: list[int], request_id: str) -> int:
    """Admit a prompt, compute it whole, cache its full blocks and free it; the tokens found cached."""
    seq = Sequence(request_id, list(token_ids), SamplingParams(max_tokens=1))
    assert manager.allocate(seq)
    cached = seq.num_computed_tokens
    seq.num_computed_tokens = seq.num_tokens
    manager.register_computed_blocks(seq)
    manager.free(seq)
    return cached


# ---- the same bookkeeping as the engine's tiers -------------------------------------------------------------


@pytest.mark.parametrize(("host_blocks", "disk_blocks"), [(3, 0), (0, 5), (2, 6), (3, 4)])
def test_tiers_without_pages_make_the_engines_events_blocks_and_counts(tmp_path: Path, host_blocks: int,
                                                                       disk_blocks: int) -> None:
    num_blocks = 8  # 16 tokens: room for the longest prompt (15)
    layout = kv_tiers.PageLayout(torch.float32, PAGE_SHAPE, BLOCK_SIZE, SALT)
    policy = kv_tiers.TierPolicy(host_blocks * layout.page_bytes, disk_blocks * layout.file_bytes(),
                                 str(tmp_path), "sync")
    kv = torch.zeros((num_blocks, *PAGE_SHAPE))
    engine = BlockManager(num_blocks, BLOCK_SIZE, SALT, tiers=kv_tiers.KVTiers(policy, layout, kv))
    mocker = no_pages_manager(num_blocks, host_blocks, disk_blocks, layout.page_bytes)
    rng = random.Random(host_blocks * 10 + disk_blocks)
    prompts = [[100 * p + i for i in range(rng.randint(3, 9))] for p in range(6)]
    for step in range(60):  # conversations coming back, some grown by a turn, in a seeded order
        p = rng.randrange(len(prompts))
        if rng.random() < 0.3 and len(prompts[p]) < 15:
            prompts[p] = prompts[p] + [100 * p + 50 + len(prompts[p])]
        cached = [serve(manager, prompts[p], f"r{step}") for manager in (engine, mocker)]
        assert cached[0] == cached[1]
        assert engine.drain_events() == mocker.drain_events()
        engine.check_integrity()
        mocker.check_integrity()
    assert engine.cached_block_hashes_by_medium() == mocker.cached_block_hashes_by_medium()
    engine_stats, mocker_stats = engine.tiers.stats, mocker.tiers.stats  # type: ignore[union-attr]
    for name in ("num_onboarded", "num_offloaded", "num_dropped", "onboard_bytes", "num_corrupt_files"):
        assert getattr(engine_stats, name) == getattr(mocker_stats, name), name
    assert sum(mocker_stats.num_onboarded.values()) > 0 and mocker_stats.onboard_s == 0.0  # no time modelled
    if disk_blocks:
        assert mocker_stats.disk_write_bytes > 0 and mocker_stats.disk_read_bytes > 0
    engine.tiers.close()  # type: ignore[union-attr]


def test_no_pages_sizes_the_tiers_in_blocks_of_its_bytes() -> None:
    stats = TierStats()
    pages = NoPages.sized(stats, TierPolicy(host_bytes=10_000, disk_bytes=25_999), page_bytes=1000)
    assert (pages.num_host_slots, pages.num_disk_blocks_max, pages.disk_dir) == (10, 25, None)
    with pytest.raises(ValueError):
        NoPages(stats, page_bytes=0, num_host_slots=1, num_disk_blocks=1)


def test_a_mocker_tier_block_is_the_profiles_kv_bytes_per_token_times_the_block_size() -> None:
    block_bytes = LLAMA_70B_H100_TP4.kv_bytes_per_token * 16
    settings = Settings(mocker=LLAMA_70B_H100_TP4.name, kv_host_bytes=100 * block_bytes + 1,
                        kv_disk_bytes=300 * block_bytes)
    tiers = mock_tiers(settings, LLAMA_70B_H100_TP4)
    assert tiers is not None and (tiers.num_host_slots, tiers.num_disk_blocks_max) == (100, 300)
    assert mock_tiers(Settings(mocker="cpu"), CPU) is None  # off by default
    assert mock_tiers(Settings(mocker="cpu", kv_host_bytes=10**9, enable_prefix_caching=False), CPU) is None


def test_a_mocker_with_tiers_imports_no_torch() -> None:
    code = ("import sys\n"
            "from dynserve.config import Settings\n"
            "from dynserve.workers.mocker import MockEngine\n"
            "engine = MockEngine(Settings(mocker='cpu', kv_blocks=4, kv_host_bytes=10**8, kv_disk_bytes=10**9))\n"
            "assert engine.block_manager.tiers.num_host_slots > 0\n"
            "engine.generate([list(range(100, 140))])\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO), "DYN_MOCKER_SPEEDUP": "1000"}, check=False)
    assert done.returncode == 0, done.stderr[-3000:]


# ---- onboarding time --------------------------------------------------------------------------------------


def _instant(**overrides: Any) -> MockerProfile:
    """A profile whose steps cost nothing, so a run's modelled time is its onboarding alone."""
    zero = {"prefill_fixed_ms": 0.0, "prefill_ms_per_token": 0.0, "prefill_ms_per_token_context": 0.0,
            "decode_fixed_ms": 0.0, "decode_ms_per_seq": 0.0, "decode_ms_per_context_token": 0.0,
            "kv_host_link_gbps": 2.0, "kv_disk_read_gbps": 0.5}
    return dataclasses.replace(CPU, **{**zero, "name": "instant", **overrides})


def test_onboard_time_is_each_tiers_bytes_over_its_bandwidth() -> None:
    profile = _instant()
    assert profile.onboard_time_ms(0, 0) == 0.0
    assert profile.onboard_time_ms(2_000_000, 0) == pytest.approx(1.0)
    assert profile.onboard_time_ms(0, 500_000) == pytest.approx(1.0)
    assert profile.onboard_time_ms(2_000_000, 500_000) == pytest.approx(2.0)
    for gpu in PROFILES.values():  # host beats disk; at GPU speeds both beat prefilling the block
        block_bytes = gpu.kv_bytes_per_token * 16
        assert gpu.onboard_time_ms(block_bytes, 0) < gpu.onboard_time_ms(0, block_bytes)
        if gpu.name != "cpu":
            assert gpu.onboard_time_ms(0, block_bytes) < 16 * gpu.prefill_ms_per_token


@pytest.mark.parametrize(("medium", "tier_bytes"), [("host", {"kv_host_bytes"}), ("disk", {"kv_disk_bytes"})])
def test_a_step_that_onboards_takes_the_profiles_onboarding_time_over_the_speedup(
        tokenizer: Tokenizer, medium: str, tier_bytes: set[str]) -> None:
    profile, speedup, block_size = _instant(), 4.0, 16
    block_bytes = profile.kv_bytes_per_token * block_size
    settings = Settings(mocker="cpu", kv_blocks=8, block_size=block_size, mocker_speedup=speedup,
                        **{name: 100 * block_bytes for name in tier_bytes})
    engine = MockEngine(settings, tokenizer, profile, sleep=False)
    greedy = SamplingParams(max_tokens=2, temperature=0)
    first, other = list(range(1000, 1060)), list(range(2000, 2120))  # 3 full blocks; then all 8 blocks
    engine.generate([first], greedy)
    engine.generate([other], greedy)  # evicts the first prompt's cached blocks into the tier
    tiers = engine.block_manager.tiers
    assert tiers is not None and tiers.num_blocks(medium) >= 3
    busy_s = engine.simulated_busy_s
    assert busy_s == 0.0  # no step cost anything so far: nothing was onboarded
    again = engine.generate([first], greedy)[0]
    assert again.num_cached_tokens == 3 * block_size and tiers.stats.num_onboarded[medium] == 3
    gbps = profile.kv_host_link_gbps if medium == "host" else profile.kv_disk_read_gbps
    expected_s = 3 * block_bytes / (gbps * 1e9) / speedup
    assert engine.simulated_busy_s == pytest.approx(expected_s, rel=1e-9)
    assert tiers.stats.onboard_s == pytest.approx(expected_s, rel=1e-9)  # what /metrics reports
    assert tiers.stats.onboard_bytes == 3 * block_bytes
    engine.generate([first], greedy)  # a device hit now: no onboarding, no more time
    assert engine.simulated_busy_s == pytest.approx(expected_s, rel=1e-9)
    engine.block_manager.check_integrity()
    engine.close()


def test_a_mocker_workers_tier_series_are_its_tiers(tokenizer: Tokenizer) -> None:
    profile = _instant()
    block_bytes = profile.kv_bytes_per_token * 16
    settings = Settings(mocker="cpu", kv_blocks=8, kv_host_bytes=2 * block_bytes, kv_disk_bytes=50 * block_bytes)
    engine = MockEngine(settings, tokenizer, profile, sleep=False)
    greedy = SamplingParams(max_tokens=2, temperature=0)
    for base in (1000, 2000, 3000, 1000):
        engine.generate([list(range(base, base + 100))], greedy)
    tiers = engine.block_manager.tiers
    assert tiers is not None
    values = {(s.name, s.labels.get("medium")): s.value for f in tier_families(["w", "both", "m"],
                                                                              engine.block_manager)
              for s in f.samples if not s.name.endswith("_created")}
    assert values[("dynserve_worker_kv_tier_blocks_capacity", "host")] == 2
    assert values[("dynserve_worker_kv_tier_blocks_capacity", "disk")] == 50
    for medium in MEDIA[1:]:
        assert values[("dynserve_worker_kv_tier_blocks", medium)] == tiers.num_blocks(medium)
    assert values[("dynserve_worker_kv_tier_onboarded_blocks_total", "disk")] == tiers.stats.num_onboarded[
        "disk"] > 0
    assert values[("dynserve_worker_kv_onboard_seconds_total", None)] == tiers.stats.onboard_s > 0
    assert values[("dynserve_worker_kv_disk_read_bytes_total", None)] > 0


# ---- the tiers benchmark's mocker part ----------------------------------------------------------------------


def _flag(flags: list[str], name: str) -> str | None:
    return flags[flags.index(name) + 1] if name in flags else None


def test_the_benchmarks_mocker_fleets_have_the_real_fleets_pools_in_the_profiles_blocks() -> None:
    sizes = size_fleet(QUICK_PLAN, make_conversations(QUICK_PLAN, 0))
    block_bytes = mocker_block_bytes(LLAMA_70B_H100_TP4.kv_bytes_per_token, QUICK_PLAN.block_size)
    assert block_bytes == 327_680 * 16
    for name, policy in policies(sizes).items():
        flags = policy_flags(policy, sizes, page_bytes=block_bytes, disk_file_bytes=block_bytes, disk_dir=None)
        flags += mocker_flags(LLAMA_70B_H100_TP4.name, 1.0)
        assert _flag(flags, "--mocker") == LLAMA_70B_H100_TP4.name and _flag(flags, "--mocker-speedup") == "1"
        assert _flag(flags, "--kv-blocks") == str(policy.device_blocks or sizes.device_blocks)
        assert "--kv-disk-dir" not in flags  # the mocker's disk tier writes nothing
        settings = Settings(mocker=LLAMA_70B_H100_TP4.name,
                            kv_host_bytes=int(_flag(flags, "--kv-host-bytes") or 0),
                            kv_disk_bytes=int(_flag(flags, "--kv-disk-bytes") or 0))
        tiers = mock_tiers(settings, LLAMA_70B_H100_TP4)
        blocks = (0, 0) if tiers is None else (tiers.num_host_slots, tiers.num_disk_blocks_max)
        assert blocks == (policy.host_blocks, policy.disk_blocks), name  # the tiers the policy asked for


def test_all_pulls_from_peers_only_when_asked() -> None:
    sizes = size_fleet(QUICK_PLAN, make_conversations(QUICK_PLAN, 0))

    def flags(peer_pulls: bool) -> dict[str, list[str]]:
        return {name: policy_flags(policy, sizes, page_bytes=1, disk_file_bytes=1, disk_dir=None)
                for name, policy in policies(sizes, peer_pulls=peer_pulls).items()}

    assert not any("--kv-peer-pulls" in f for f in flags(False).values())
    pulled = flags(True)
    assert [name for name, f in pulled.items() if "--kv-peer-pulls" in f] == ["all"]
