"""What the KV tiers show outside the engine: a worker's snapshot carries its host and disk blocks and a
router resyncing from it after a gap keeps them; a worker's `/metrics` series per tier; the gateway's
per-medium router series (index blocks, prompt blocks hit). A small real block manager over real `KVTiers` (tiny CPU pages, a temporary disk
directory), a real `Router` and the in-process event plane; no model, no fleet.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import msgspec
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric

from dynserve.engine.block_manager import BlockManager
from dynserve.engine.sequence import Sequence
from dynserve.events.memory import MemoryEventPlane
from dynserve.gateway.metrics import GatewayMetrics
from dynserve.hashing import hash_blocks
from dynserve.protocol import MEDIA, BlockStored, KVSnapshot, SamplingParams, WorkerFrame
from dynserve.router.router import Router
from dynserve.workers.metrics import tier_families
from dynserve.workers.worker import kv_snapshot_of

from conftest import lazy_import

torch = lazy_import("torch")  # imported on first use: collecting this file imports no torch
kv_tiers = lazy_import("dynserve.engine.kv_tiers")

SALT, BLOCK_SIZE = 7, 2
PAGE_SHAPE = (1, 2, BLOCK_SIZE, 1, 2)  # layers, K/V, block size, kv heads, head dim


def tiered_manager(disk_dir: Path, *, num_blocks: int = 4, host_blocks: int = 2,
                   disk_blocks: int = 8) -> BlockManager:
    kv = torch.zeros((num_blocks, *PAGE_SHAPE))
    layout = kv_tiers.PageLayout(torch.float32, PAGE_SHAPE, BLOCK_SIZE, SALT)
    policy = kv_tiers.TierPolicy(host_blocks * layout.page_bytes, disk_blocks * layout.file_bytes(),
                                 str(disk_dir), "sync")
    return BlockManager(num_blocks, BLOCK_SIZE, SALT, tiers=kv_tiers.KVTiers(policy, layout, kv))


def serve(manager: BlockManager, token_ids: list[int], request_id: str) -> None:
    """Admit a prompt, compute it whole, cache its full blocks and free it (the engine's steps, no model)."""
    seq = Sequence(request_id, list(token_ids), SamplingParams(max_tokens=1))
    assert manager.allocate(seq)
    seq.num_computed_tokens = seq.num_tokens
    manager.register_computed_blocks(seq)
    manager.free(seq)


def prompt(n: int) -> list[int]:
    return [1000 * (n + 1) + i for i in range(7)]  # 3 full blocks of its own


def held_by_medium(manager: BlockManager) -> dict[str, set[int]]:
    snapshot = manager.cached_block_hashes_by_medium()
    return {medium: set(snapshot.get(medium, [])) for medium in MEDIA}


# ---- snapshots carry the lower tiers ---------------------------------------------------------------------


def test_a_snapshot_carries_each_tiers_blocks_over_the_wire(tmp_path: Path) -> None:
    manager = tiered_manager(tmp_path)
    for n in range(4):  # later prompts push earlier ones down to host, then to disk
        serve(manager, prompt(n), f"r{n}")
    held = held_by_medium(manager)
    assert all(held.values()), held  # something on every medium
    frame = msgspec.msgpack.decode(msgspec.msgpack.encode(kv_snapshot_of("w0", manager)), type=WorkerFrame)
    assert isinstance(frame, KVSnapshot)
    assert frame.last_event_id == manager.last_event_id
    assert set(frame.block_hashes) == held["device"]
    assert {medium: set(hashes) for medium, hashes in frame.lower_block_hashes.items()} == {
        "host": held["host"], "disk": held["disk"]}


def test_a_snapshot_from_a_worker_without_the_field_decodes_with_no_lower_blocks() -> None:
    class OlderSnapshot(msgspec.Struct, tag="kv_snapshot", kw_only=True):
        worker_id: str
        block_hashes: list[int]
        last_event_id: int | None

    frame = msgspec.msgpack.decode(msgspec.msgpack.encode(OlderSnapshot(worker_id="w0", block_hashes=[1, 2],
                                                                        last_event_id=5)), type=WorkerFrame)
    assert frame == KVSnapshot(worker_id="w0", block_hashes=[1, 2], last_event_id=5)
    assert frame.lower_block_hashes == {}


def test_a_router_resyncing_after_a_gap_keeps_the_workers_host_and_disk_blocks(tmp_path: Path) -> None:
    manager = tiered_manager(tmp_path)
    snapshots: list[KVSnapshot] = []

    async def snapshot(worker_id: str) -> KVSnapshot:
        wire = msgspec.msgpack.encode(kv_snapshot_of(worker_id, manager))  # as the channel carries it
        snapshots.append(msgspec.msgpack.decode(wire, type=WorkerFrame))  # type: ignore[arg-type]
        return snapshots[-1]

    async def scenario() -> Router:
        plane, router = MemoryEventPlane(), Router("kv", block_size=BLOCK_SIZE, salt=SALT)
        serve(manager, prompt(0), "r0")
        await plane.publish("w0", manager.drain_events())
        for n in range(1, 4):
            serve(manager, prompt(n), f"r{n}")
        manager.drain_events()  # lost on the way: the router sees a gap at the next batch
        serve(manager, prompt(4), "r4")
        await plane.publish("w0", manager.drain_events())
        consuming = asyncio.create_task(router.consume(plane, snapshot))
        deadline_s = time.monotonic() + 10
        while router.index.last_event_id("w0") != manager.last_event_id:
            assert time.monotonic() < deadline_s, "the router did not catch up"
            await asyncio.sleep(0.01)
        consuming.cancel()
        return router

    router = asyncio.run(scenario())
    assert len(snapshots) == 1  # one gap, one resync
    held = held_by_medium(manager)
    assert held["host"] and held["disk"]
    index = router.index
    assert {medium: index.worker_blocks("w0", medium) for medium in MEDIA} == held  # type: ignore[call-arg]
    assert router.index_blocks_by_medium() == {medium: len(hashes) for medium, hashes in held.items()}
    index.check_integrity()


# ---- a worker's tier series ----------------------------------------------------------------------------

LABELS = ["w0", "decode", "m"]


def exposition(families: list[Metric]) -> str:
    class One:
        def collect(self) -> list[Metric]:
            return families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(One())
    return generate_latest(registry).decode()


def samples_of(families: list[Metric]) -> dict[tuple[str, str | None], float]:
    """(sample name, its medium label or None) -> value, for worker w0's samples."""
    return {(s.name, s.labels.get("medium")): s.value for family in families for s in family.samples
            if s.labels["worker_id"] == "w0"}


def test_a_workers_tier_series_are_its_tiers_counts(tmp_path: Path) -> None:
    manager = tiered_manager(tmp_path)
    for n in range(4):
        serve(manager, prompt(n), f"r{n}")
    serve(manager, prompt(0), "again")  # its blocks come back from the disk tier
    tiers = manager.tiers
    assert tiers is not None
    stats = tiers.stats
    families = list(tier_families(LABELS, manager))
    values = samples_of(families)
    assert values[("dynserve_worker_kv_tier_blocks", "device")] == manager.num_cached_blocks
    assert values[("dynserve_worker_kv_tier_blocks", "host")] == tiers.num_blocks("host") == 2
    assert values[("dynserve_worker_kv_tier_blocks", "disk")] == tiers.num_blocks("disk") > 0
    assert values[("dynserve_worker_kv_tier_blocks_capacity", "host")] == 2
    assert values[("dynserve_worker_kv_tier_blocks_capacity", "disk")] == 8
    onboarded, offloaded = stats.num_onboarded, stats.num_offloaded
    assert values[("dynserve_worker_kv_tier_onboarded_blocks_total", "disk")] == onboarded["disk"] == 3
    assert values[("dynserve_worker_kv_tier_offloaded_blocks_total", "host")] == offloaded["host"] > 0
    assert values[("dynserve_worker_kv_onboard_bytes_total", None)] == stats.onboard_bytes > 0
    assert values[("dynserve_worker_kv_onboard_seconds_total", None)] == stats.onboard_s > 0
    assert values[("dynserve_worker_kv_disk_write_bytes_total", None)] == stats.disk_write_bytes > 0
    assert values[("dynserve_worker_kv_disk_read_bytes_total", None)] == stats.disk_read_bytes > 0
    assert values[("dynserve_worker_kv_disk_corrupt_files_total", None)] == 0
    checked = subprocess.run(["promtool", "check", "metrics"], input=exposition(families),
                             capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0 and not (checked.stdout + checked.stderr).strip(), checked


def test_a_worker_without_tiers_exports_the_same_series_at_zero_below_the_device() -> None:
    manager = BlockManager(8, BLOCK_SIZE, SALT)
    serve(manager, prompt(0), "r0")
    values = samples_of(list(tier_families(LABELS, manager)))
    assert values[("dynserve_worker_kv_tier_blocks", "device")] == 3
    assert values[("dynserve_worker_kv_tier_blocks_capacity", "device")] == 8
    below = {key: value for key, value in values.items() if key[1] != "device"}
    assert len(below) == 14 and set(below.values()) == {0}


# ---- the router's series per medium -------------------------------------------------------------------------


def test_the_gateway_exports_the_routers_index_and_hits_per_medium() -> None:
    router = Router("kv", block_size=BLOCK_SIZE, salt=SALT)
    metrics = GatewayMetrics()
    metrics.watch_router(router, "decode")

    def value(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"pool": "decode", **labels})

    assert [value("dynserve_router_prompt_hit_blocks_total", medium=m) for m in MEDIA] == [0, 0, 0]
    tokens = list(range(2 * 8))  # 8 blocks
    h = hash_blocks(tokens, BLOCK_SIZE, SALT)
    router.index.apply("a", [BlockStored(0, None, h[:2]), BlockStored(1, h[1], h[2:5], medium="host"),
                             BlockStored(2, h[4], h[5:6], medium="disk")])
    router.index.apply("b", [BlockStored(0, None, h[:3])])
    assert [value("dynserve_router_index_tier_blocks", medium=m) for m in MEDIA] == [3, 3, 1]
    assert router.pick(tokens, ["a"], {}) == ("a", 6)  # 2 on the device, 3 on host, 1 on disk
    assert router.pick(tokens, ["b"], {}) == ("b", 3)  # all 3 on the device
    assert value("dynserve_router_prompt_blocks_total") == 16
    assert [value("dynserve_router_prompt_hit_blocks_total", medium=m) for m in MEDIA] == [5, 3, 1]
