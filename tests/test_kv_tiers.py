"""KV tiers below the device pool: blocks evicted to the host tier and on to the disk tier come back byte for
byte, a corrupt or short disk file is recomputed, the medium-tagged KV events replay to exactly the blocks
each tier holds (and the router's tiered index fed the same events holds the same per tier), and greedy
output over an onboarded prefix equals a fresh prefill's.

The block-manager tests run on a small real KV tensor whose every computed block is written with pages that
are a function of the block's hash (`pages_of`), so "the block a sequence reads holds its own prefix's KV"
is a byte comparison. The engine tests run a tiny random-weight model (no weights are loaded).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dynserve.engine.block_manager import BlockManager
from dynserve.engine.sequence import Sequence
from dynserve.hashing import hash_blocks
from dynserve.protocol import MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, SamplingParams
from dynserve.router.tiers import TieredIndex

from conftest import lazy_import

torch = lazy_import("torch")  # imported on first use: collecting this file imports no torch
kv_tiers = lazy_import("dynserve.engine.kv_tiers")

SALT = 7
PAGE = (2, 2, 0, 2, 4)  # layers, K/V, (block size), kv heads, head dim


def page_shape(block_size: int) -> tuple[int, ...]:
    return PAGE[:2] + (block_size,) + PAGE[3:]


def pages_of(block_hash: int, block_size: int) -> torch.Tensor:
    """The pages a block computed for `block_hash` holds (a function of the hash alone)."""
    gen = torch.Generator().manual_seed(block_hash & (2**63 - 1))
    return torch.randn(page_shape(block_size), generator=gen)


def make_manager(disk_dir: str, *, num_blocks: int, block_size: int, host_blocks: int, disk_blocks: int,
                 disk_write: str = "sync", dtype: torch.dtype | None = None,
                 ) -> tuple[BlockManager, torch.Tensor]:
    dtype = torch.float32 if dtype is None else dtype
    kv = torch.zeros((num_blocks, *page_shape(block_size)), dtype=dtype)
    layout = kv_tiers.PageLayout(dtype, page_shape(block_size), block_size, SALT)
    policy = kv_tiers.TierPolicy(host_blocks * layout.page_bytes, disk_blocks * layout.file_bytes(), disk_dir,
                                 disk_write)  # type: ignore[arg-type]
    return BlockManager(num_blocks, block_size, SALT, tiers=kv_tiers.KVTiers(policy, layout, kv)), kv


def make_seq(token_ids: list[int], request_id: str = "r") -> Sequence:
    return Sequence(request_id, list(token_ids), SamplingParams(max_tokens=16))


def assert_reads_own_prefix(bm: BlockManager, kv: torch.Tensor, seq: Sequence) -> None:
    hashes = hash_blocks(seq.token_ids, bm.block_size, SALT)
    for i in range(seq.num_computed_tokens // bm.block_size):
        expected = pages_of(hashes[i], bm.block_size).to(kv.dtype)
        assert torch.equal(kv[seq.block_table[i]], expected), f"block {i} holds another prefix's KV"


def compute(bm: BlockManager, kv: torch.Tensor, seq: Sequence) -> None:
    """What the engine does for `seq`: read its cached prefix, compute the rest, offer its full blocks."""
    assert_reads_own_prefix(bm, kv, seq)
    hashes = hash_blocks(seq.token_ids, bm.block_size, SALT)
    for i in range(seq.num_computed_tokens // bm.block_size, len(hashes)):
        kv[seq.block_table[i]] = pages_of(hashes[i], bm.block_size)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_computed_blocks(seq)


def run_and_free(bm: BlockManager, kv: torch.Tensor, token_ids: list[int], request_id: str = "r") -> Sequence:
    seq = make_seq(token_ids, request_id)
    assert bm.allocate(seq)
    compute(bm, kv, seq)
    bm.free(seq)
    scribble_free(bm, kv)
    return seq


def scribble_free(bm: BlockManager, kv: torch.Tensor) -> None:
    """A free block's pages mean nothing: scribble them, so no stale page can pass for an onboarded one."""
    for block in bm.blocks:
        if block.ref_count == 0 and block.block_hash is None:
            kv[block.block_id].fill_(float("nan"))


class Replay:
    """The per-tier sets of cached hashes, rebuilt from the KV events alone, and the router's tiered index fed
    the same events."""

    def __init__(self) -> None:
        self.held: dict[str, set[int]] = {medium: set() for medium in MEDIA}
        self.next_event_id = 0
        self.index = TieredIndex()

    def apply(self, events: list[KVEvent]) -> None:
        assert self.index.apply("w", events), "the index saw a gap in the engine's events"
        for event in events:
            assert event.event_id == self.next_event_id, "event ids must be consecutive"
            self.next_event_id += 1
            match event:
                case BlockStored(block_hashes=hashes, medium=medium):
                    assert not self.held[medium] & set(hashes), f"stored twice on {medium}"
                    self.held[medium] |= set(hashes)
                case BlockRemoved(block_hashes=hashes, medium=medium):
                    assert set(hashes) <= self.held[medium], f"removed what {medium} did not hold"
                    self.held[medium] -= set(hashes)
                case AllBlocksCleared():
                    for held in self.held.values():
                        held.clear()

    def assert_matches(self, bm: BlockManager) -> None:
        snapshot = bm.cached_block_hashes_by_medium()
        assert {m: set(snapshot.get(m, [])) for m in MEDIA} == self.held
        if self.next_event_id:  # the index knows the worker once it has sent an event
            assert {m: self.index.worker_blocks("w", m) for m in MEDIA} == self.held
            assert {m: self.index.num_worker_blocks("w", m) for m in MEDIA} == {m: len(h) for m, h in
                                                                                 self.held.items()}
            self.index.check_integrity()


# ---- the block manager over tiers -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "float16"])
def test_block_evicted_to_host_then_disk_comes_back_byte_identical(tmp_path: Path, dtype_name: str) -> None:
    dtype = getattr(torch, dtype_name)
    bm, kv = make_manager(str(tmp_path), num_blocks=4, block_size=2, host_blocks=2, disk_blocks=8, dtype=dtype)
    replay = Replay()
    first = list(range(7))  # 3 full blocks
    run_and_free(bm, kv, first, "first")
    original = {h: pages_of(h, 2).to(dtype) for h in hash_blocks(first, 2, SALT)}
    for n in range(3):  # other prompts push the first's blocks to host, then to disk
        run_and_free(bm, kv, [100 + 10 * n + i for i in range(7)], f"other{n}")
        bm.check_integrity()
    replay.apply(bm.drain_events())
    replay.assert_matches(bm)
    assert set(original) <= set(bm.tiers.hashes("disk"))  # type: ignore[union-attr]
    bm.tiers.flush()  # type: ignore[union-attr]
    for h in original:  # the files are written and hold the block under its header
        assert (Path(bm.tiers.disk_dir) / f"{h:016x}.kvb").exists()  # type: ignore[union-attr, arg-type]

    seq = make_seq(first + [9], "again")
    assert bm.allocate(seq)
    assert seq.num_computed_tokens == 6  # all three blocks onboarded from disk, none prefilled
    for i, h in enumerate(hash_blocks(first, 2, SALT)):
        assert torch.equal(kv[seq.block_table[i]], original[h])
    stats = bm.tiers.stats  # type: ignore[union-attr]
    assert stats.num_onboarded["disk"] == 3 and stats.disk_read_bytes > 0 and stats.disk_write_bytes > 0
    assert stats.onboard_bytes == 3 * bm.tiers.layout.page_bytes  # type: ignore[union-attr]
    replay.apply(bm.drain_events())
    replay.assert_matches(bm)
    bm.check_integrity([seq])
    bm.tiers.close()  # type: ignore[union-attr]
    assert not any(tmp_path.iterdir()), "close removes the disk tier's directory"


def test_a_match_continues_from_host_into_disk_with_every_host_slot_claimed(tmp_path: Path) -> None:
    bm, kv = make_manager(str(tmp_path), num_blocks=4, block_size=2, host_blocks=1, disk_blocks=4)
    replay = Replay()
    prompt = list(range(7))  # 3 full blocks and a tail: the whole device pool
    a0, a1, a2 = hash_blocks(prompt, 2, SALT)
    run_and_free(bm, kv, prompt, "a")
    run_and_free(bm, kv, [50, 51, 52, 53, 54, 55, 56], "b")  # evicts a's blocks, tail first
    tiers = bm.tiers
    assert tiers is not None
    assert tiers.hashes("host") == [a0] and tiers.hashes("disk") == [a2, a1]
    seq = make_seq(prompt, "a2")
    assert bm.allocate(seq)  # b's evicted blocks find the one host slot claimed: they go to disk
    assert seq.num_computed_tokens == 6
    assert tiers.stats.num_onboarded == {"host": 1, "disk": 2}
    assert_reads_own_prefix(bm, kv, seq)
    assert tiers.num_blocks("host") == 0 and tiers.num_blocks("disk") == 3
    replay.apply(bm.drain_events())
    replay.assert_matches(bm)
    bm.check_integrity([seq])
    tiers.close()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_or_short_disk_file_is_detected_and_recomputed(tmp_path: Path, damage: str) -> None:
    bm, kv = make_manager(str(tmp_path), num_blocks=3, block_size=2, host_blocks=0, disk_blocks=8)
    replay = Replay()
    prompt = [1, 2, 3, 4, 5]
    run_and_free(bm, kv, prompt, "a")
    run_and_free(bm, kv, [7, 7, 7, 7, 7], "b")  # a's two blocks go straight to disk
    first_hash = hash_blocks(prompt, 2, SALT)[0]
    path = Path(bm.tiers.disk_dir) / f"{first_hash:016x}.kvb"  # type: ignore[union-attr, arg-type]
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-5] ^= 0x40
    else:
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))

    seq = make_seq(prompt, "a2")
    assert bm.allocate(seq)
    assert seq.num_computed_tokens == 0, "a corrupt first block: the whole prefix is recomputed"
    assert bm.tiers.stats.num_corrupt_files == 1  # type: ignore[union-attr]
    compute(bm, kv, seq)  # recomputed: the device caches it again, and the tiers keep no other copy
    replay.apply(bm.drain_events())
    replay.assert_matches(bm)
    bm.check_integrity([seq])
    assert not path.exists()
    bm.tiers.close()  # type: ignore[union-attr]


def test_another_blocks_valid_file_in_a_blocks_place_is_refused(tmp_path: Path) -> None:
    """The header names the block, model and layout: a well-formed file of another block is no hit."""
    bm, kv = make_manager(str(tmp_path), num_blocks=3, block_size=2, host_blocks=0, disk_blocks=8)
    prompt = [1, 2, 3, 4, 5]
    run_and_free(bm, kv, prompt, "a")
    run_and_free(bm, kv, [7, 7, 7, 7, 7], "b")
    tiers = bm.tiers
    assert tiers is not None and tiers.disk_dir is not None
    first, second = (Path(tiers.disk_dir) / f"{h:016x}.kvb" for h in hash_blocks(prompt, 2, SALT))
    first.write_bytes(second.read_bytes())
    seq = make_seq(prompt, "a2")
    assert bm.allocate(seq)
    assert seq.num_computed_tokens == 0 and tiers.stats.num_corrupt_files == 1
    tiers.close()


def test_the_default_disk_directory_is_the_engines_own_and_goes_with_it() -> None:
    kv = torch.zeros((2, *page_shape(2)))
    layout = kv_tiers.PageLayout(torch.float32, page_shape(2), 2, SALT)
    tiers = kv_tiers.KVTiers(kv_tiers.TierPolicy(disk_bytes=4 * layout.file_bytes()), layout, kv)
    assert tiers.num_disk_blocks_max == 4 and tiers.num_host_slots == 0
    disk_dir = tiers.disk_dir
    assert disk_dir is not None and Path(disk_dir).parent == Path(tempfile.gettempdir())
    tiers.close()
    assert not Path(disk_dir).exists()


def test_onboarding_with_no_free_block_never_evicts_the_matched_prefix(tmp_path: Path) -> None:
    bm, kv = make_manager(str(tmp_path), num_blocks=3, block_size=2, host_blocks=1, disk_blocks=0)
    prompt = [1, 2, 3]
    run_and_free(bm, kv, prompt, "a")  # its block [1, 2] is cached on device
    run_and_free(bm, kv, [4, 5, 6, 7, 8], "b")  # takes every block: a's goes to the host tier
    tiers = bm.tiers
    assert tiers is not None and tiers.num_blocks("host") == 1
    seq = make_seq(prompt, "a2")
    assert bm.allocate(seq)  # taking its blocks evicts b's into the only host slot, a's is claimed already
    assert seq.num_computed_tokens == 2
    assert_reads_own_prefix(bm, kv, seq)
    bm.check_integrity([seq])
    tiers.close()


def test_tier_sizes_of_zero_build_no_tiers_and_events_stay_device_events(tmp_path: Path) -> None:
    """The default: no tiers, the device-only manager; an event written before tiers (no medium) reads as
    a device event."""
    import msgspec

    from dynserve.config import Settings

    settings = Settings()
    assert settings.kv_host_bytes == 0 and settings.kv_disk_bytes == 0
    assert not kv_tiers.TierPolicy(settings.kv_host_bytes, settings.kv_disk_bytes).enabled
    old_wire = msgspec.msgpack.encode(["stored", 0, None, [1, 2]])
    decoded = msgspec.msgpack.decode(old_wire, type=KVEvent)
    assert decoded == BlockStored(0, None, [1, 2]) and decoded.medium == "device"
    bm = BlockManager(4, 2, SALT)
    assert bm.tiers is None
    run_and_free(bm, torch.zeros((4, *page_shape(2))), [1, 2, 3], "a")
    assert all(e.medium == "device" for e in bm.drain_events() if isinstance(e, BlockStored | BlockRemoved))


# ---- a state machine of stores, evictions, onboards, corruptions and resets ------------------------------


class TieredBlockManagerMachine(RuleBasedStateMachine):
    """Drives a BlockManager with tiers; `replay` is the plain model of each tier's hashes (events only)."""

    @initialize(num_blocks=st.integers(3, 8), host_blocks=st.integers(0, 4), disk_blocks=st.integers(0, 6),
                disk_write=st.sampled_from(["sync", "background"]))
    def setup(self, num_blocks: int, host_blocks: int, disk_blocks: int, disk_write: str) -> None:
        self.dir = tempfile.TemporaryDirectory()
        self.bm, self.kv = make_manager(self.dir.name, num_blocks=num_blocks, block_size=2,
                                        host_blocks=host_blocks, disk_blocks=disk_blocks,
                                        disk_write=disk_write)
        self.replay = Replay()
        self.running: list[Sequence] = []
        self.history: list[list[int]] = [[]]
        self.num_seqs = 0

    def teardown(self) -> None:
        if hasattr(self, "bm"):
            self.bm.tiers.close()  # type: ignore[union-attr]
            self.dir.cleanup()

    def _expected_hits(self, token_ids: list[int]) -> int:
        held = set().union(*self.replay.held.values())
        num = 0
        for h in hash_blocks(token_ids, 2, SALT):
            if h not in held:
                break
            num += 1
        return num - 1 if num * 2 >= len(token_ids) else num

    @rule(base=st.integers(0, 20), cut=st.integers(0, 12), extra=st.lists(st.integers(0, 2), max_size=6),
          keep=st.booleans())
    def run(self, base: int, cut: int, extra: list[int], keep: bool) -> None:
        token_ids = self.history[base % len(self.history)][:cut] + extra
        if not token_ids or self.bm.blocks_needed(len(token_ids)) > self.bm.num_free_blocks:
            return
        self.num_seqs += 1
        seq = make_seq(token_ids, f"r{self.num_seqs}")
        self.replay.apply(self.bm.drain_events())
        expected = self._expected_hits(token_ids)
        num_corrupt = self.bm.tiers.stats.num_corrupt_files  # type: ignore[union-attr]
        assert self.bm.allocate(seq)
        if self.bm.tiers.stats.num_corrupt_files == num_corrupt:  # type: ignore[union-attr]
            assert seq.num_computed_tokens == 2 * expected, "a cached block in some tier was not reused"
        compute(self.bm, self.kv, seq)
        self.history.append(token_ids)
        if keep:
            self.running.append(seq)
        else:
            self.bm.free(seq)

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 10))
    def free(self, index: int) -> None:
        self.bm.free(self.running.pop(index % len(self.running)))

    @precondition(lambda self: self.bm.tiers.num_blocks("disk"))  # type: ignore[union-attr]
    @rule(index=st.integers(0, 10), truncate=st.booleans())
    def damage_a_disk_file(self, index: int, truncate: bool) -> None:
        tiers = self.bm.tiers
        assert tiers is not None and tiers.disk_dir is not None
        tiers.flush()
        hashes = tiers.hashes("disk")
        path = os.path.join(tiers.disk_dir, f"{hashes[index % len(hashes)]:016x}.kvb")
        data = bytearray(Path(path).read_bytes())
        data = data[: len(data) - 3] if truncate else data[:-1] + bytes([data[-1] ^ 1])
        Path(path).write_bytes(bytes(data))

    @rule()
    def reset(self) -> None:
        self.bm.reset_prefix_cache()

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "bm"):
            return
        self.bm.check_integrity(self.running)
        self.replay.apply(self.bm.drain_events())
        self.replay.assert_matches(self.bm)
        for seq in self.running:
            assert_reads_own_prefix(self.bm, self.kv, seq)
        scribble_free(self.bm, self.kv)


TieredBlockManagerMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_tiered_block_manager_state_machine = TieredBlockManagerMachine.TestCase


# ---- the engine: greedy output over onboarded prefixes --------------------------------------------------


def _tiny_loaded(tokenizer: Any) -> Any:
    from dynserve.engine.llm_engine import LoadedModel
    from dynserve.engine.loader import ModelConfig
    from dynserve.engine.models.decoder import CausalLM

    config = ModelConfig(model_id="tiny-tiers", vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                         rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2)
    model = CausalLM(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return LoadedModel(config, model.eval(), tokenizer, torch.device("cpu"))


@pytest.fixture(scope="module")
def tiny_loaded(tokenizer: Any) -> Any:
    return _tiny_loaded(tokenizer)


def _engine(loaded: Any, tmp_path: Path, **overrides: Any) -> Any:
    from dynserve.config import Settings
    from dynserve.engine.llm_engine import LLMEngine

    settings = Settings(**{"dtype": "float32", "device": "cpu", "kv_blocks": 12, "block_size": 16,
                           "kv_disk_dir": str(tmp_path), "kv_disk_write": "sync", **overrides})
    return LLMEngine(settings, loaded=loaded)


PAGE_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # the tiny model's block: layers, K/V, tokens, kv heads, head dim, fp32
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [(i * 37 + 11) % 500 + 3 for i in range(70)]  # 4 full blocks and a tail
OTHERS = [[(i * 53 + 7 * k) % 500 + 3 for i in range(150)] for k in range(1, 3)]  # evict the prompt's blocks


@pytest.mark.parametrize(("tier", "host_blocks", "disk_blocks", "disk_write"),
                         [("host", 16, 0, "sync"), ("disk", 0, 16, "sync"), ("disk", 0, 16, "background")])
def test_greedy_output_over_an_onboarded_prefix_equals_a_fresh_prefill(
    tiny_loaded: Any, tmp_path: Path, tier: str, host_blocks: int, disk_blocks: int, disk_write: str
) -> None:
    fresh_engine = _engine(tiny_loaded, tmp_path, enable_prefix_caching=False)
    fresh = fresh_engine.generate([PROMPT], GREEDY)[0]
    engine = _engine(tiny_loaded, tmp_path, kv_host_bytes=host_blocks * PAGE_BYTES,
                     kv_disk_bytes=disk_blocks * (PAGE_BYTES + 4096), kv_disk_write=disk_write)
    tiers = engine.block_manager.tiers
    replay = Replay()
    engine.generate([PROMPT], GREEDY)
    for other in OTHERS:
        engine.generate([other], GREEDY)
    replay.apply(engine.drain_kv_events())
    again = engine.generate([PROMPT], GREEDY)[0]
    assert again.num_cached_tokens == 64, "the prompt's four blocks come back from the lower tier"
    assert tiers.stats.num_onboarded[tier] == 4
    assert again.token_ids == fresh.token_ids
    for other in OTHERS:  # evicted again: the logits over the onboarded prefix are a fresh prefill's
        engine.generate([other], GREEDY)
    before = tiers.stats.num_onboarded[tier]
    logits = engine.compute_logits([PROMPT])
    assert tiers.stats.num_onboarded[tier] == before + 4
    torch.testing.assert_close(logits, fresh_engine.compute_logits([PROMPT]), atol=1e-5, rtol=0)
    replay.apply(engine.drain_kv_events())
    replay.assert_matches(engine.block_manager)
    tiers.flush()  # then the disk directory is checked against the disk tier too
    engine.block_manager.check_integrity(engine.scheduler.running)
    engine.close()


def test_corrupt_disk_blocks_are_recomputed_with_the_same_output(tiny_loaded: Any, tmp_path: Path) -> None:
    fresh = _engine(tiny_loaded, tmp_path, enable_prefix_caching=False).generate([PROMPT], GREEDY)[0]
    engine = _engine(tiny_loaded, tmp_path, kv_disk_bytes=16 * (PAGE_BYTES + 4096))
    engine.generate([PROMPT], GREEDY)
    for other in OTHERS:
        engine.generate([other], GREEDY)
    tiers = engine.block_manager.tiers
    hashes = hash_blocks(PROMPT, 16, engine.block_manager.hash_salt)
    third = Path(tiers.disk_dir) / f"{hashes[2]:016x}.kvb"
    data = bytearray(third.read_bytes())
    data[len(data) // 2] ^= 0xFF
    third.write_bytes(bytes(data))
    again = engine.generate([PROMPT], GREEDY)[0]
    assert tiers.stats.num_corrupt_files == 1
    assert again.num_cached_tokens == 32, "blocks before the corrupt one are onboarded, the rest recomputed"
    assert again.token_ids == fresh.token_ids
    engine.block_manager.check_integrity(engine.scheduler.running)
    engine.close()
