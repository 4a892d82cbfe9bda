"""The router sees every KV tier: medium-tagged events land in the tiered index per worker per medium, a
prefix that runs from the device into the host and disk tiers counts whole, the cost credits a lower-tier
hit by its weight (so a host-tier hit still draws a request, within the load balance), clears and gaps
cover every medium, and vLLM's offloaded (CPU) blocks reach the host medium. A Hypothesis state machine
checks the index's per-worker per-medium blocks and matches against plain sets."""

from __future__ import annotations

import random

import hypothesis.strategies as st
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dynserve.events.vllm import VllmRemoved, VllmStored, VllmTranslator, decode_batch
from dynserve.hashing import hash_blocks, model_salt
from dynserve.protocol import MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from dynserve.router.cost import RoutingPolicy, choose, costs, select, tier_credits
from dynserve.router.indexer import KVIndex
from dynserve.router.router import Router
from dynserve.router.tiers import TieredIndex

BLOCK_SIZE, SALT = 4, 7
DEVICE, HOST, DISK = MEDIA


def prompt_of(num_blocks: int, start: int = 0) -> list[int]:
    return list(range(start, start + num_blocks * BLOCK_SIZE))


def hashes_of(tokens: list[int]) -> list[int]:
    return hash_blocks(tokens, BLOCK_SIZE, SALT)


def test_a_prefix_runs_from_the_device_into_the_host_and_disk_tiers() -> None:
    index = TieredIndex()
    h = list(range(100, 110))
    assert index.apply("a", [BlockStored(0, None, h[:4]), BlockStored(1, h[3], h[4:6], medium=HOST),
                             BlockStored(2, h[5], h[6:7], medium=DISK),
                             BlockStored(3, None, h[8:], medium=HOST)])
    assert index.apply("b", [BlockStored(0, None, h[:2], medium=DISK), BlockStored(1, h[1], h[2:5])])
    overlaps, lower = index.match(h)
    assert overlaps == {"a": 7, "b": 5}  # a misses block 7 on every medium, so its blocks 8, 9 do not count
    assert lower == {"a": (4, 2, 1), "b": (3, 0, 2)}
    assert index.num_blocks_by_medium() == {DEVICE: 5, HOST: 4, DISK: 3}  # distinct hashes per medium
    assert [index.num_worker_blocks("a", m) for m in MEDIA] == [4, 4, 1]
    assert index.num_worker_blocks("a") == 9
    index.check_integrity()


def test_a_block_moving_down_and_back_up_is_counted_where_it_is() -> None:
    index = TieredIndex()
    h = [1, 2, 3]
    index.apply("a", [BlockStored(0, None, h)])
    assert index.match(h) == ({"a": 3}, {})
    index.apply("a", [BlockRemoved(1, h[1:]), BlockStored(2, h[0], h[1:], medium=HOST)])  # evicted to host
    assert index.match(h) == ({"a": 3}, {"a": (1, 2, 0)})
    index.apply("a", [BlockRemoved(3, h[2:], medium=HOST), BlockStored(4, h[1], h[2:], medium=DISK)])
    assert index.match(h) == ({"a": 3}, {"a": (1, 1, 1)})
    index.apply("a", [BlockRemoved(5, h[1:2], medium=HOST), BlockStored(6, h[0], h[1:2])])  # onboarded
    assert index.match(h) == ({"a": 3}, {"a": (2, 0, 1)})
    index.apply("a", [BlockRemoved(7, h[2:], medium=DISK)])
    assert index.match(h) == ({"a": 2}, {})
    assert index.worker_blocks("a", HOST) == index.worker_blocks("a", DISK) == set()
    index.check_integrity()


def test_all_blocks_cleared_clears_every_medium_of_that_worker_only() -> None:
    index = TieredIndex()
    index.apply("a", [BlockStored(0, None, [1]), BlockStored(1, 1, [2], medium=HOST),
                      BlockStored(2, 2, [3], medium=DISK)])
    index.apply("b", [BlockStored(0, None, [1, 2], medium=HOST)])
    assert index.apply("a", [AllBlocksCleared(3)])
    assert [index.num_worker_blocks("a", m) for m in MEDIA] == [0, 0, 0]
    assert index.match([1, 2, 3]) == ({"b": 2}, {"b": (0, 2, 0)})
    assert index.apply("a", [BlockStored(4, None, [1, 2, 3], medium=DISK)])  # numbering goes on
    assert index.match([1, 2, 3])[0] == {"a": 3, "b": 2}
    index.check_integrity()


def test_a_gap_stops_apply_and_a_snapshot_restores_every_medium() -> None:
    index = TieredIndex()
    assert index.apply("a", [BlockStored(0, None, [1, 2])])
    assert not index.apply("a", [BlockStored(2, 2, [3], medium=HOST)])  # event 1 was lost
    assert index.worker_blocks("a", HOST) == set()
    index.resync("a", [1], 2, lower={HOST: [2, 3], DISK: [4]})
    assert index.match([1, 2, 3, 4]) == ({"a": 4}, {"a": (1, 2, 1)})
    assert index.apply("a", [BlockStored(2, None, [99], medium=HOST), BlockRemoved(3, [4], medium=DISK)])
    assert 99 not in index.worker_blocks("a")  # event 2 is in the snapshot: a replay, skipped
    assert index.last_event_id("a") == 3
    index.resync("a", [1, 2], 3)  # a snapshot of the device only: the lower media are dropped
    assert index.match([1, 2, 3]) == ({"a": 2}, {})
    with pytest.raises(ValueError, match="not lower media"):
        index.resync("a", [], 3, lower={DEVICE: [1]})
    index.remove_worker("a")
    assert index.worker_ids == [] and index.num_blocks == 0
    index.check_integrity()


def test_a_device_index_alone_numbers_lower_medium_events_but_holds_only_device_blocks() -> None:
    index = KVIndex()
    assert index.apply("a", [BlockStored(0, None, [1, 2]), BlockStored(1, 2, [3], medium=HOST),
                             BlockRemoved(2, [2], medium=DISK), BlockStored(3, 2, [4])])
    assert index.worker_blocks("a") == {1, 2, 4} and index.last_event_id("a") == 3


def test_events_on_a_medium_not_in_media_are_counted_not_indexed() -> None:
    index = TieredIndex()
    assert index.apply("a", [BlockStored(0, None, [1, 2], medium="tape"), BlockStored(1, None, [1])])
    assert index.num_unknown_medium == 2
    assert index.match([1, 2]) == ({"a": 1}, {})


# ---- the cost ---------------------------------------------------------------------------------------


def _router_with(events: dict[str, list[KVEvent]], **policy: float) -> Router:
    router = Router("kv", block_size=BLOCK_SIZE, salt=SALT, **policy)  # type: ignore[arg-type]
    for worker_id, worker_events in events.items():
        assert router.index.apply(worker_id, worker_events)
    return router


def test_a_host_tier_hit_draws_the_request_over_an_idle_worker_within_the_load_balance() -> None:
    prompt = prompt_of(10)
    hashes = hashes_of(prompt)
    router = _router_with({"a": [BlockStored(0, None, hashes[:8], medium=HOST)]})  # host_hit_weight 0.9
    assert router.pick(prompt, ["b", "a"], {}) == ("a", 8)
    router.routed("r1", "a", 7)  # a's cost: 10 - 0.9 * 8 + 7 = 9.8 < b's 10
    assert router.pick(prompt, ["b", "a"], {}) == ("a", 8)
    router.routed("r2", "a", 1)  # 10.8 > 10: the idle worker now
    assert router.pick(prompt, ["b", "a"], {}) == ("b", 0)


def test_a_device_hit_beats_the_same_hit_on_host_and_host_beats_disk() -> None:
    prompt = prompt_of(6)
    hashes = hashes_of(prompt)
    router = _router_with({"disk": [BlockStored(0, None, hashes, medium=DISK)],
                           "host": [BlockStored(0, None, hashes, medium=HOST)],
                           "dev": [BlockStored(0, None, hashes[:3]), BlockStored(1, hashes[2], hashes[3:])]})
    assert router.pick(prompt, ["disk", "host", "dev"], {}) == ("dev", 6)
    assert router.pick(prompt, ["disk", "host"], {}) == ("host", 6)
    router.routed("r1", "host", 3)  # host: 6 - 5.4 + 3 = 3.6 > disk: 6 - 3 = 3
    assert router.pick(prompt, ["disk", "host"], {}) == ("disk", 6)


def test_the_tier_weights_are_settings_and_zero_makes_a_tier_worth_nothing() -> None:
    prompt = prompt_of(4)
    events = {"a": [BlockStored(0, None, hashes_of(prompt), medium=DISK)]}
    assert _router_with(events, disk_hit_weight=0.0).pick(prompt, ["b", "a"], {})[0] == "b"
    assert _router_with(events, disk_hit_weight=0.3).pick(prompt, ["b", "a"], {})[0] == "a"
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        RoutingPolicy(host_hit_weight=1.5)


def test_the_decision_reports_where_the_chosen_prefix_lies() -> None:
    policy = RoutingPolicy(hot_spot_ratio=10.0)
    decision = choose(8, {"a": 6, "b": 2}, ["a", "b"], {}, policy, lower={"a": (2, 3, 1)})
    assert (decision.worker_id, decision.overlap_blocks, decision.blocks_by_medium) == ("a", 6, (2, 3, 1))
    device_only = choose(8, {"a": 6, "b": 2}, ["a", "b"], {}, policy)
    assert (device_only.worker_id, device_only.overlap_blocks, device_only.blocks_by_medium) == ("a", 6, None)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), num_workers=st.integers(1, 6), temperature=st.sampled_from([0.0, 0.5]))
def test_choose_with_tiers_is_select_over_the_credited_costs(data: st.DataObject, num_workers: int,
                                                             temperature: float) -> None:
    workers = [f"w{i}" for i in range(num_workers)]
    num_prompt_blocks = data.draw(st.integers(1, 12))
    lower: dict[str, tuple[int, int, int]] = {}
    overlaps: dict[str, int] = {}
    for worker_id in workers:
        counts = data.draw(st.tuples(*[st.integers(0, 4)] * 3))
        if sum(counts) > num_prompt_blocks or not sum(counts):
            continue
        overlaps[worker_id] = sum(counts)
        if counts[0] != sum(counts):
            lower[worker_id] = counts
    active = {w: data.draw(st.integers(0, 6)) for w in workers}
    policy = RoutingPolicy(temperature=temperature, hot_spot_ratio=100.0,
                           host_hit_weight=data.draw(st.sampled_from([0.0, 0.5, 0.9, 1.0])),
                           disk_hit_weight=data.draw(st.sampled_from([0.0, 0.25, 0.5])))
    seed = data.draw(st.integers(0, 2**16))
    decision = choose(num_prompt_blocks, overlaps, workers, active, policy, random.Random(seed), lower=lower)
    expected = select(costs(num_prompt_blocks, tier_credits(overlaps, lower, policy), active),
                      temperature, random.Random(seed))
    assert decision.worker_id == expected
    assert decision.overlap_blocks == overlaps.get(expected, 0)


# ---- vLLM's media -----------------------------------------------------------------------------------


def test_vllm_cpu_offloaded_blocks_land_in_the_host_medium_and_draw_the_request() -> None:
    model = "m"
    translator = VllmTranslator(model, BLOCK_SIZE)
    tokens = prompt_of(3)
    ours = hash_blocks(tokens, BLOCK_SIZE, model_salt(model))
    # vLLM's offloading connector: stores on "CPU" carry no token ids and block size 0
    payload = msgspec.msgpack.encode([0.0, [
        {"type": "BlockStored", "block_hashes": [b"a", b"b", b"c"], "parent_block_hash": None,
         "token_ids": tokens, "block_size": BLOCK_SIZE, "lora_id": None, "medium": "GPU"},
        ["BlockStored", [b"a", b"b", b"c", b"zz"], None, [], 0, None, "CPU", None],
        {"type": "BlockRemoved", "block_hashes": [b"b", b"c"], "medium": "GPU"},
        {"type": "BlockRemoved", "block_hashes": [b"a"], "medium": "cpu"},
    ]])
    events = translator.translate(decode_batch(payload).events)
    assert events == [BlockStored(0, None, ours), BlockStored(1, None, ours, medium=HOST),
                      BlockRemoved(2, ours[1:]), BlockRemoved(3, ours[:1], medium=HOST)]
    assert translator.num_orphans == 1  # zz: never stored on the device, so its tokens are unknown
    router = Router("kv", block_size=BLOCK_SIZE, salt=model_salt(model))
    assert router.index.apply("v0", events)
    assert router.index.match(ours) == ({"v0": 3}, {"v0": (1, 2, 0)})  # a on the device, b and c on host
    assert router.pick(tokens, ["idle", "v0"], {}) == ("v0", 3)
    assert router.index_blocks_by_medium() == {DEVICE: 1, HOST: 2, DISK: 0}
    assert Router("approximate", block_size=BLOCK_SIZE, salt=SALT).index_blocks_by_medium() == {
        DEVICE: 0, HOST: 0, DISK: 0}
    # the device copy of "a" goes too; its host copy was removed above: nothing is held any more
    removals = translator.translate([VllmRemoved([b"a"], "GPU"), VllmRemoved([b"b", b"c"], "CPU")])
    assert removals == [BlockRemoved(4, ours[:1]), BlockRemoved(5, ours[1:], medium=HOST)]
    assert translator._ours == {}  # no medium holds a block: no translation is kept
    assert router.index.apply("v0", removals)
    assert router.index.num_worker_blocks("v0") == 0
    on_disk = translator.translate([VllmStored([b"q"], None, [1, 2, 3, 4], 4, medium="DISK")])
    assert router.index.apply("v0", on_disk)
    assert router.index.worker_blocks("v0", DISK) == set(hash_blocks([1, 2, 3, 4], BLOCK_SIZE, model_salt("m")))


# ---- the state machine ------------------------------------------------------------------------------

WORKERS = ["w0", "w1", "w2"]
HASHES = st.integers(min_value=0, max_value=15)


def model_match(known: dict[str, dict[str, set[int]]],
                prompt: list[int]) -> tuple[dict[str, int], dict[str, tuple[int, ...]]]:
    """Each worker's prefix over its media: from each block, the fastest medium holding it, followed while
    it holds the next ones."""
    overlaps, lower = {}, {}
    for worker, media in known.items():
        counts, depth = [0] * len(MEDIA), 0
        while depth < len(prompt):
            holding = [i for i, m in enumerate(MEDIA) if prompt[depth] in media[m]]
            if not holding:
                break
            i = holding[0]
            while depth < len(prompt) and prompt[depth] in media[MEDIA[i]]:
                counts[i] += 1
                depth += 1
        if depth:
            overlaps[worker] = depth
            if counts[0] != depth:
                lower[worker] = tuple(counts)
    return overlaps, lower


class TieredIndexMachine(RuleBasedStateMachine):
    """Workers store, move between media, remove and clear blocks, emitting numbered medium-tagged events,
    some lost in transit. The index must hold, per worker per medium, exactly what it was told, notice
    every loss at the next delivered event, and after a snapshot hold the worker's true caches."""

    def __init__(self) -> None:
        super().__init__()
        self.index = TieredIndex(scan_max_workers=1)  # both match paths over three workers
        self.truth: dict[str, dict[str, set[int]]] = {}
        self.known: dict[str, dict[str, set[int]]] = {}
        self.next_id: dict[str, int] = {}
        self.gap: dict[str, bool] = {}

    def _caches(self, worker: str) -> dict[str, set[int]]:
        return self.truth.setdefault(worker, {m: set() for m in MEDIA})

    def _next(self, worker: str) -> int:
        self._caches(worker)
        event_id = self.next_id.get(worker, 0)
        self.next_id[worker] = event_id + 1
        return event_id

    def _emit(self, worker: str, events: list[KVEvent], lost: bool) -> None:
        if lost:
            self.gap[worker] = True
            return
        applied = self.index.apply(worker, events)
        truth = self.truth[worker]
        if self.gap.get(worker):
            assert not applied, "a lost event went unnoticed"
            self.index.resync(worker, truth[DEVICE], events[-1].event_id,
                              lower={m: truth[m] for m in MEDIA[1:]})
            self.gap[worker] = False
        else:
            assert applied
        self.known[worker] = {m: set(blocks) for m, blocks in truth.items()}

    @rule(worker=st.sampled_from(WORKERS), medium=st.sampled_from(MEDIA),
          hashes=st.lists(HASHES, min_size=1, max_size=6), lost=st.booleans())
    def store(self, worker: str, medium: str, hashes: list[int], lost: bool) -> None:
        event_id = self._next(worker)
        self._caches(worker)[medium] |= set(hashes)
        self._emit(worker, [BlockStored(event_id, None, hashes, medium=medium)], lost)

    @rule(worker=st.sampled_from(WORKERS), media=st.permutations(MEDIA), data=st.data(), lost=st.booleans())
    def move(self, worker: str, media: list[str], data: st.DataObject, lost: bool) -> None:
        source, target = media[0], media[1]
        held = sorted(self._caches(worker)[source])
        moved = data.draw(st.lists(st.sampled_from(held), max_size=4, unique=True)) if held else []
        caches = self._caches(worker)
        caches[source] -= set(moved)
        caches[target] |= set(moved)
        removed_id = self._next(worker)
        stored_id = self._next(worker)
        self._emit(worker, [BlockRemoved(removed_id, moved, medium=source),
                            BlockStored(stored_id, None, moved, medium=target)], lost)

    @rule(worker=st.sampled_from(WORKERS), medium=st.sampled_from(MEDIA), data=st.data(), lost=st.booleans())
    def remove(self, worker: str, medium: str, data: st.DataObject, lost: bool) -> None:
        held = sorted(self._caches(worker)[medium])
        gone = data.draw(st.lists(st.sampled_from(held), max_size=4)) if held else []
        self._caches(worker)[medium] -= set(gone)
        self._emit(worker, [BlockRemoved(self._next(worker), gone, medium=medium)], lost)

    @rule(worker=st.sampled_from(WORKERS), lost=st.booleans())
    def clear(self, worker: str, lost: bool) -> None:
        event_id = self._next(worker)
        self.truth[worker] = {m: set() for m in MEDIA}
        self._emit(worker, [AllBlocksCleared(event_id)], lost)

    @precondition(lambda self: bool(self.truth))
    @rule(data=st.data())
    def worker_leaves(self, data: st.DataObject) -> None:
        worker = data.draw(st.sampled_from(sorted(self.truth)))
        self.index.remove_worker(worker)
        for table in (self.truth, self.known, self.next_id, self.gap):
            table.pop(worker, None)

    @rule(prompt=st.lists(HASHES, min_size=1, max_size=8))
    def match_agrees_with_the_model(self, prompt: list[int]) -> None:
        assert self.index.match(prompt) == model_match(self.known, prompt)

    @invariant()
    def index_holds_what_it_was_told_per_medium(self) -> None:
        self.index.check_integrity()
        for worker, media in self.known.items():
            for medium, blocks in media.items():
                assert self.index.worker_blocks(worker, medium) == blocks
                assert self.index.num_worker_blocks(worker, medium) == len(blocks)
        for medium in MEDIA:
            held = set().union(*(media[medium] for media in self.known.values()))
            assert self.index.num_blocks_by_medium()[medium] == len(held)


TestTieredIndexMachine = TieredIndexMachine.TestCase
TestTieredIndexMachine.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)
