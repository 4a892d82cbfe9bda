"""Peer pulls (issue 35, part 3): a worker the router sends a prompt to reads the prefix blocks another worker
holds instead of prefilling them.

The cost's pull credit (pure); the dispatcher's export, handle, release-once and fallbacks on scripted
channels (a fake of our own `WorkerChannel`); the engines' export and pull life cycle on mocker engines;
real engines (over a tiny random-weight model) pulling real pages over the TCP transfer backend from a holder
process, which is killed in the middle of a second read: the reader prefills instead and its greedy answer is
unchanged; and a mocker fleet
behind a real gateway, where a busy holder's prefix is pulled and counted on both sides' /metrics."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import httpx
import pytest
from conftest import lazy_import
from prometheus_client.parser import text_string_to_metric_families
from test_dispatcher import Recorder, ScriptedChannel, collect, greedy, request, tokens_of

from dynserve.config import Settings
from dynserve.errors import KVTransferError
from dynserve.gateway.directory import WorkerDirectory
from dynserve.gateway.disagg import DisaggregatedBackend
from dynserve.gateway.dispatcher import Dispatcher, pull_outcome
from dynserve.hashing import hash_blocks
from dynserve.protocol import BlockStored, GenerateRequest, KVHandle, SamplingParams, TokenDelta
from dynserve.router.cost import RoutingPolicy, choose, costs, pull_credits, select
from dynserve.router.router import Router

torch = lazy_import("torch")

GREEDY = SamplingParams(max_tokens=8, temperature=0)


# ---- the cost ----------------------------------------------------------------------------------------------

PULLS = RoutingPolicy(pull_hit_weight=0.8, pull_min_blocks=4)


def test_a_busy_holder_sends_the_prompt_to_an_idle_peer_that_pulls_its_prefix() -> None:
    # 20-block prompt, a holds 16. Without pulls b costs 20 and a 4 + 20 = 24: b, prefilling all 20.
    # With pulls b costs 20 - 0.8 * 16 = 7.2 and pulls from a.
    decision = choose(20, {"a": 16}, ["a", "b"], {"a": 20}, PULLS)
    assert (decision.worker_id, decision.overlap_blocks, decision.pull_from, decision.pull_blocks) == ("b", 0, "a", 16)
    no_pulls = choose(20, {"a": 16}, ["a", "b"], {"a": 20}, RoutingPolicy())
    assert (no_pulls.worker_id, no_pulls.pull_from) == ("b", None)
    # lightly loaded, the holder keeps it: 4 + 3 = 7 against b's 7.2
    assert choose(20, {"a": 16}, ["a", "b"], {"a": 3}, PULLS).worker_id == "a"
    assert choose(20, {"a": 16}, ["a", "b"], {"a": 3}, PULLS).pull_from is None


def test_pull_credit_counts_only_what_the_holder_has_beyond_a_workers_own_and_at_least_the_minimum() -> None:
    credits, holder, held = pull_credits({"a": 10, "b": 8, "c": 2}, {"a": 10, "b": 8, "c": 2}, ["c", "b", "a"],
                                         PULLS)
    assert (holder, held) == ("a", 10)
    assert credits == {"a": 10, "b": 8, "c": 2 + 0.8 * 8}  # b lacks 2 < 4 blocks: no pull credit
    assert pull_credits({"a": 3}, {"a": 3}, ["a", "b"], PULLS)[1:] == (None, 0)  # under the minimum
    assert pull_credits({"a": 9}, {"a": 9}, ["a"], RoutingPolicy())[1:] == (None, 0)  # pulls off
    # a holder that is not a candidate (excluded after a failure) is not pulled from
    assert pull_credits({"a": 9}, {"a": 9}, ["b"], PULLS)[1:] == (None, 0)


def test_a_pulled_block_is_worth_the_pull_weight_of_what_it_is_worth_to_the_holder() -> None:
    # a holds the 16 blocks on its disk tier (credit 0.5 each: 8): pulling them is worth 0.8 * 0.5 each
    credits, holder, held = pull_credits({"a": 16}, {"a": 8.0}, ["a", "b"], PULLS)
    assert (holder, held) == ("a", 16) and credits == {"a": 8.0, "b": 0.8 * 0.5 * 16}
    # idle: the holder, onboarding from its own disk, beats a peer that would read the blocks from it
    idle = choose(20, {"a": 16}, ["b", "a"], {}, PULLS, lower={"a": (0, 0, 16)})
    assert (idle.worker_id, idle.pull_from, idle.blocks_by_medium) == ("a", None, (0, 0, 16))
    busy = choose(20, {"a": 16}, ["b", "a"], {"a": 30}, PULLS, lower={"a": (0, 0, 16)})
    assert (busy.worker_id, busy.pull_from, busy.pull_blocks) == ("b", "a", 16)


@pytest.mark.parametrize("seed", range(20))
def test_choose_with_pulls_equals_the_plain_definition(seed: int) -> None:
    import random

    rng = random.Random(seed)
    workers = [f"w{i}" for i in range(rng.randint(2, 6))]
    overlaps = {w: rng.randint(0, 30) for w in workers if rng.random() < 0.6}
    loads = {w: rng.randint(0, 60) for w in workers}
    decision = choose(30, overlaps, workers, loads, PULLS)
    credits = pull_credits(overlaps, overlaps, workers, PULLS)[0]
    expected = select(costs(30, credits, loads, PULLS.overlap_weight))
    assert decision.worker_id == expected
    if decision.pull_from is not None:
        assert decision.pull_blocks - overlaps.get(decision.worker_id, 0) >= PULLS.pull_min_blocks
        assert decision.pull_from != decision.worker_id


def test_a_policy_with_a_pull_weight_outside_zero_to_one_is_refused() -> None:
    with pytest.raises(ValueError, match="pull_hit_weight"):
        RoutingPolicy(pull_hit_weight=1.5)
    with pytest.raises(ValueError, match="pull_min_blocks"):
        RoutingPolicy(pull_min_blocks=0)


# ---- the dispatcher, on scripted channels ------------------------------------------------------------------

class PullChannel(ScriptedChannel):
    """A `ScriptedChannel` that exports prefixes (`holds`: blocks it holds; `export_fails`: its channel drops
    on an export) and reports a pull on its first delta (`read_fails`: as a failed read)."""

    def __init__(self, worker_id: str, role: str = "both") -> None:
        super().__init__(worker_id, role)
        self.holds, self.export_fails = 0, False

    async def generate(self, request: GenerateRequest) -> Any:
        if request.export_prefix:
            self.requests.append(request)
            if self.export_fails:
                raise self._drop()
            num_blocks = min(self.holds, len(request.token_ids) // self.info.block_size)
            handle = (KVHandle(worker_id=self.worker_id, agent_name=None, block_ids=list(range(num_blocks)),
                               num_tokens=num_blocks * self.info.block_size) if num_blocks else None)
            yield TokenDelta(request_id=request.request_id, token_ids=[], finished=True, finish_reason="exported",
                             kv_handle=handle)
            return
        first = True
        async for delta in super().generate(request):
            if first and request.peer_prefix is not None:
                outcome = {"kv_fallback": "transfer_error"} if self.read_fails else {
                    "kv_pulled_blocks": len(request.peer_prefix.block_ids)}
                delta = TokenDelta(**{**{f: getattr(delta, f) for f in delta.__struct_fields__}, **outcome})
            first = False
            yield delta


class PullRecorder(Recorder):
    def on_pull(self, outcome: str) -> None:
        self.events.append(("pull", outcome))


PROMPT = list(range(1, 41))  # 10 blocks of 4


def _pull_fleet(role: str = "both") -> tuple[Dispatcher, PullRecorder, PullChannel, PullChannel]:
    a, b = PullChannel("a", role), PullChannel("b", role)
    a.holds = 8
    router = Router("kv", block_size=4, salt=0, overlap_weight=1.0, pull_hit_weight=0.8, pull_min_blocks=2)
    assert router.index.apply("a", [BlockStored(0, None, hash_blocks(PROMPT, 4, 0)[:8])])
    router.routed("busy", "a", 50)  # a is busy: the prompt goes to b, which pulls a's 8 blocks
    by_id = {"a": a, "b": b}
    directory = WorkerDirectory([a.info, b.info], channel_factory=lambda info: by_id[info.worker_id])
    backend = Dispatcher(directory, router=router, pool="prefill" if role == "prefill" else "both")
    recorder = PullRecorder()
    backend.add_observer(recorder)
    return backend, recorder, a, b


def _serve(backend: Dispatcher, req: GenerateRequest) -> list[TokenDelta]:
    async def go() -> list[TokenDelta]:
        await backend.start()
        try:
            return await collect(backend.generate(req))
        finally:
            await backend.stop()

    return asyncio.run(go())


def test_the_chosen_worker_gets_the_holders_handle_and_the_holder_is_released_once() -> None:
    backend, recorder, a, b = _pull_fleet()
    deltas = _serve(backend, request(PROMPT))
    assert tokens_of(deltas) == greedy(PROMPT, 10)
    [export] = a.requests
    assert export.export_prefix and export.token_ids == PROMPT[:32] and export.request_id == "r1/export"
    [sent] = b.requests
    assert sent.peer_prefix is not None and sent.peer_prefix.worker_id == "a" and sent.token_ids == PROMPT
    assert a.released == ["r1/export"] and recorder.events == [("pull", "pulled")]
    assert deltas[0].kv_pulled_blocks == 8


@pytest.mark.parametrize(("setup", "outcome", "pulled"), [
    ("export_fails", "export_failed", False),  # the holder's channel drops: b prefills, nothing to release
    ("holds_nothing", "nothing_held", False),  # evicted meanwhile: no handle
    ("read_fails", "transfer_error", True),    # b's read fails: b prefills, the holder is still released
])
def test_a_pull_that_cannot_happen_costs_a_prefill_not_the_request(setup: str, outcome: str, pulled: bool) -> None:
    backend, recorder, a, b = _pull_fleet()
    if setup == "export_fails":
        a.export_fails = True
    elif setup == "holds_nothing":
        a.holds = 0
    else:
        b.read_fails = True
    deltas = _serve(backend, request(PROMPT))
    assert tokens_of(deltas) == greedy(PROMPT, 10) and deltas[-1].finish_reason == "length"
    assert ("pull", outcome) in recorder.events
    [sent] = b.requests
    assert (sent.peer_prefix is not None) == pulled
    assert a.released == (["r1/export"] if pulled else [])


def test_a_chosen_worker_that_fails_before_its_first_token_releases_the_export_and_retries_without_it() -> None:
    backend, _recorder, a, b = _pull_fleet()
    b.fail_before_first = True
    deltas = _serve(backend, request(PROMPT))
    assert tokens_of(deltas) == greedy(PROMPT, 10)
    assert a.released == ["r1/export"]
    assert [r.peer_prefix is not None for r in a.requests] == [False, False]  # the export, then the retry


def test_a_disaggregated_prefill_worker_pulls_a_busier_prefill_workers_prefix() -> None:
    prefill, recorder, a, b = _pull_fleet("prefill")
    decode_channel = ScriptedChannel("d", "decode")
    decode_directory = WorkerDirectory([decode_channel.info], channel_factory=lambda info: decode_channel)
    backend = DisaggregatedBackend(prefill, Dispatcher(decode_directory, pool="decode"))
    deltas = _serve(backend, request(PROMPT))  # type: ignore[arg-type]
    assert tokens_of(deltas) == greedy(PROMPT, 10)
    [export] = a.requests
    assert export.export_prefix and export.token_ids == PROMPT[:32]
    [prefilled] = b.requests
    assert prefilled.prefill_only and prefilled.peer_prefix is not None and prefilled.peer_prefix.worker_id == "a"
    assert decode_channel.requests[0].remote_prefill is not None
    assert a.released == ["r1/export"] and b.released == ["r1"]  # the export, then b's prefill, once each
    assert ("pull", "pulled") in recorder.events


def test_pull_outcome_reads_the_first_delta() -> None:
    delta = TokenDelta(request_id="r", token_ids=[1])
    assert pull_outcome(delta) == "not_needed"
    assert pull_outcome(TokenDelta(request_id="r", token_ids=[1], kv_pulled_blocks=3)) == "pulled"
    assert pull_outcome(TokenDelta(request_id="r", token_ids=[1], kv_fallback="no_blocks")) == "no_blocks"


# ---- the engines: export and pull on mocker engines -------------------------------------------------------

def _run(engine: Any) -> tuple[list[int], TokenDelta]:
    tokens, first = [], None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            first = first or delta
            tokens += delta.token_ids
    assert first is not None
    return tokens, first


def test_mocker_engines_export_pull_and_fall_back() -> None:
    from dynserve.workers.mocker import MockEngine

    settings = Settings(mocker="cpu", mocker_speedup=1e6, kv_blocks=64)
    holder, reader, failing, whole = (MockEngine(settings) for _ in range(4))
    holder.kv_source_id, reader.kv_source_id, failing.kv_source_id = "h", "r", "f"
    block = holder.block_manager.block_size
    history = list(range(100, 300))
    holder.generate([history], GREEDY)
    prompt = history[:180] + [5, 6, 7]  # a returning turn: 11 of its blocks are the holder's
    reference = whole.generate([prompt], GREEDY)[0].token_ids

    exported = holder.export_prefix("x/export", prompt)
    handle = exported.kv_handle
    assert exported.finish_reason == "exported" and handle is not None and handle.worker_id == "h"
    assert handle.num_tokens == 11 * block and len(handle.block_ids) == 11 and holder.num_leases == 1
    assert holder.export_prefix("none/export", [7] * 40).kv_handle is None  # holds none: no lease
    assert holder.num_leases == 1

    reader.add_request(prompt, GREEDY, "x", peer=handle)
    [plan] = reader.drain_receives()
    assert plan.pull and plan.remote_block_ids == handle.block_ids and len(plan.local_block_ids) == 11
    reader.simulate_read(plan)
    assert reader.complete_receive("x", None) is None  # no token yet: the rest is prefilled by a step
    tokens, first = _run(reader)
    assert tokens == reference
    assert (first.kv_pulled_blocks, first.num_cached_tokens, first.kv_fallback) == (11, 11 * block, None)
    assert reader.stats.num_computed_prompt_tokens == len(prompt) - 11 * block

    failing.add_request(prompt, GREEDY, "y", peer=handle)
    [plan] = failing.drain_receives()
    failing.complete_receive("y", "transfer_error")  # nothing that landed is trusted
    tokens, first = _run(failing)
    assert tokens == reference
    assert (first.kv_pulled_blocks, first.num_cached_tokens, first.kv_fallback) == (0, 0, "transfer_error")
    assert failing.stats.num_computed_prompt_tokens == len(prompt)

    # a reader that caches the prefix itself reads nothing; the holder's lease ends on release
    reader.add_request(prompt, GREEDY, "z", peer=handle)
    assert reader.drain_receives() == []
    assert _run(reader)[0] == reference
    assert holder.release("x/export") and not holder.release("x/export")
    for engine in (holder, reader, failing):
        engine.block_manager.check_integrity([])
        assert engine.block_manager.num_used_blocks == 0


def test_a_prefill_only_request_pulls_then_parks_the_whole_prompt_for_its_decode_worker() -> None:
    from dynserve.workers.mocker import MockEngine

    settings = Settings(mocker="cpu", mocker_speedup=1e6, kv_blocks=64)
    holder, prefill = MockEngine(settings), MockEngine(settings)
    holder.kv_source_id, prefill.kv_source_id = "h", "p"
    history = list(range(100, 300))
    holder.generate([history], GREEDY)
    prompt = history[:180] + [5, 6, 7]
    handle = holder.export_prefix("x/export", prompt).kv_handle
    assert handle is not None
    prefill.add_request(prompt, GREEDY, "x", prefill_only=True, peer=handle)
    [plan] = prefill.drain_receives()
    prefill.simulate_read(plan)
    prefill.complete_receive("x", None)
    _tokens, parked = _run(prefill)
    assert parked.finish_reason == "prefilled" and parked.kv_pulled_blocks == 11
    assert parked.kv_handle is not None and parked.kv_handle.num_tokens == len(prompt)
    assert prefill.stats.num_computed_prompt_tokens == len(prompt) - 11 * prefill.block_manager.block_size
    assert prefill.release("x") and holder.release("x/export")
    for engine in (holder, prefill):
        engine.block_manager.check_integrity([])
        assert engine.block_manager.num_used_blocks == 0


def test_an_export_holds_a_prefix_from_the_lower_tiers_byte_for_byte(tmp_path: Any) -> None:
    from test_kv_tiers import SALT, Replay, make_manager, make_seq, pages_of, run_and_free

    bm, kv = make_manager(str(tmp_path), num_blocks=4, block_size=2, host_blocks=2, disk_blocks=8)
    replay = Replay()
    first = list(range(7))  # 3 full blocks
    run_and_free(bm, kv, first, "first")
    for n in range(3):  # other prompts push the first's blocks to host, then to disk
        run_and_free(bm, kv, [100 + 10 * n + i for i in range(7)], f"other{n}")
    assert set(hash_blocks(first, 2, SALT)) <= set(bm.tiers.hashes("host")) | set(bm.tiers.hashes("disk"))
    seq = make_seq(first[:6], "export")  # exactly its 3 blocks: all held, the last one too
    assert bm.hold_prefix(seq) == 3 and seq.num_computed_tokens == 6
    for i, block_hash in enumerate(hash_blocks(first, 2, SALT)):
        assert torch.equal(kv[seq.block_table[i]], pages_of(block_hash, 2))
    replay.apply(bm.drain_events())
    replay.assert_matches(bm)  # onboarded: removed from its tier, stored on the device
    bm.check_integrity([seq])
    bm.free(seq)
    bm.check_integrity()
    assert bm.hold_prefix(make_seq([999] * 6, "none")) == 0
    bm.tiers.close()


def test_an_abort_during_a_pull_frees_the_blocks_when_the_read_ends() -> None:
    from dynserve.workers.mocker import MockEngine

    settings = Settings(mocker="cpu", mocker_speedup=1e6, kv_blocks=64)
    holder, reader = MockEngine(settings), MockEngine(settings)
    holder.kv_source_id = "h"
    prompt = list(range(100, 300))
    holder.generate([prompt], GREEDY)
    handle = holder.export_prefix("x/export", prompt).kv_handle
    assert handle is not None
    reader.add_request(prompt, GREEDY, "x", peer=handle)
    [plan] = reader.drain_receives()
    assert reader.abort("x") and reader.block_manager.num_used_blocks > 0  # the read may still be landing
    assert reader.complete_receive("x", None) is None and not reader.has_unfinished_requests()
    assert reader.block_manager.num_used_blocks == 0


# ---- real engines, real pages, a holder killed mid-read ---------------------------------------------------

def _serve_pages(pipe: Connection, path: str) -> None:
    """The holder's transfer side in a process of its own: its KV cache as saved, served over TCP."""
    from dynserve.kv_transfer.tcp_backend import TcpConnector

    cache = torch.load(path)
    connector = TcpConnector("holder", Settings(transfer_timeout_s=10))
    connector.register_kv_cache(cache)
    pipe.send(connector.metadata())
    pipe.recv()  # until told to go (or killed)
    connector.close()


@pytest.fixture(scope="module")
def make_tiny_engine() -> Any:
    """Engines over one tiny random-weight Llama with the real model's vocabulary (`tests/_tiny_models.py`):
    a pull's pages and a fallback's prefill are checked against a fresh prefill's greedy tokens, which hold
    for any weights, and a step costs milliseconds. Its embeddings are untied: a random tied model's greedy
    tokens repeat the last one, an untied one's vary, so a wrong page shows in them.
    `make_tiny_engine(kv_blocks=64)` takes `make_engine`'s settings."""
    from _tiny_models import tiny_model

    from dynserve.engine.llm_engine import LLMEngine, load_model

    path = str(tiny_model("llama", tie_word_embeddings=False))
    loaded = load_model(Settings(model=path, dtype="float32", device="cpu"))

    def factory(**overrides: Any) -> Any:
        settings = Settings(**{"model": path, "dtype": "float32", "device": "cpu", "kv_blocks": 512, **overrides})
        return LLMEngine(settings, loaded=loaded)

    return factory


def test_real_pages_pulled_from_a_holder_and_a_holder_killed_mid_read_costs_a_prefill(
        make_tiny_engine: Any, tmp_path: Any) -> None:
    from dynserve.kv_transfer.tcp_backend import TcpConnector

    holder, reader, whole = (make_tiny_engine(kv_blocks=n) for n in (24, 64, 64))
    holder.kv_source_id, reader.kv_source_id = "h", "r"
    text = "The history of the river valley, told by the people who lived along it. " * 8
    history = holder.tokenizer.encode(text)
    holder.generate([history], GREEDY)
    prompt = history + holder.tokenizer.encode(" What did they grow?")
    reference = whole.generate([prompt], GREEDY)[0].token_ids
    handle = holder.export_prefix("x/export", prompt).kv_handle
    assert handle is not None and len(handle.block_ids) >= 8
    path = tmp_path / "holder-cache.pt"
    torch.save(holder.runner.kv_cache, path)

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "dynserve.kv_transfer.tcp_backend"])
    ours, theirs = context.Pipe()
    process = context.Process(target=_serve_pages, args=(theirs, str(path)), daemon=True)
    process.start()
    try:
        assert ours.poll(60), "the holder's page server did not start"
        with TcpConnector("reader", Settings(transfer_timeout_s=10)) as connector:
            connector.register_kv_cache(reader.runner.kv_cache)
            peer = connector.add_peer(ours.recv())
            handle = KVHandle(worker_id="h", agent_name=peer, block_ids=handle.block_ids,
                              num_tokens=handle.num_tokens, lease_ends_unix_s=handle.lease_ends_unix_s)

            # a pull that lands: the pages are the holder's, byte for byte, and the answer is a fresh prefill's
            reader.add_request(prompt, GREEDY, "pulled", peer=handle)
            [plan] = reader.drain_receives()
            connector.read_blocks(plan.agent_name, plan.remote_block_ids, plan.local_block_ids)
            assert torch.equal(reader.runner.kv_cache[plan.local_block_ids],
                               holder.runner.kv_cache[plan.remote_block_ids])
            reader.complete_receive("pulled", None)
            tokens, first = _run(reader)
            assert tokens == reference and first.kv_pulled_blocks == len(handle.block_ids)
            reader.reset_prefix_cache()

            # the holder stops answering, the read is under way, the holder dies: the read fails well
            # before its deadline, the reader prefills, and its answer is unchanged
            reader.add_request(prompt, GREEDY, "killed", peer=handle)
            [plan] = reader.drain_receives()
            reader.runner.kv_cache[plan.local_block_ids] = 0.0  # whatever landed must not be used
            os.kill(process.pid, signal.SIGSTOP)
            failure: list[BaseException] = []

            def read() -> None:
                try:
                    connector.read_blocks(plan.agent_name, plan.remote_block_ids, plan.local_block_ids)
                except BaseException as exc:  # noqa: BLE001 - what the driver would see
                    failure.append(exc)

            started = time.monotonic()
            thread = threading.Thread(target=read)
            thread.start()
            time.sleep(0.3)
            assert thread.is_alive(), "the read finished while the holder was stopped"
            os.kill(process.pid, signal.SIGKILL)
            thread.join(10)
            assert failure and isinstance(failure[0], KVTransferError), failure
            assert time.monotonic() - started < 5.0
            reader.complete_receive("killed", "transfer_error")
            tokens, first = _run(reader)
            assert tokens == reference and first.kv_fallback == "transfer_error" and first.kv_pulled_blocks == 0
    finally:
        if process.is_alive():
            os.kill(process.pid, signal.SIGKILL)
        process.join(10)
    assert holder.release("x/export")
    for engine in (holder, reader):
        engine.block_manager.check_integrity([])
        assert engine.block_manager.num_used_blocks == 0


# ---- a mocker fleet behind a real gateway ----------------------------------------------------------------

def _samples(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = httpx.get(url, timeout=10).text
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_a_busy_holders_prefix_is_pulled_through_the_gateway(make_mocker: Any, make_gateway: Any) -> None:
    workers = [make_mocker(f"pull-{i}", kv_blocks=256, mocker_speedup=10, kv_peer_pulls=True) for i in range(2)]
    infos = [info for _handle, info in workers]
    gateway = make_gateway(infos=infos, router="kv", kv_peer_pulls=True, overlap_weight=1.0,
                           kv_pull_min_blocks=2)
    words = " ".join(f"word{i}" for i in range(300))

    def complete(max_tokens: int, suffix: str) -> dict[str, Any]:
        body = {"model": infos[0].model_id, "prompt": words + suffix, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()

    complete(1, " first")  # caches the prefix on one worker
    router = gateway.app.state.backend.router
    deadline = time.monotonic() + 5
    while router.index.num_blocks < 10:
        assert time.monotonic() < deadline, "the router's index did not receive the workers' KV events"
        time.sleep(0.02)
    [holder] = [w for w in router.index.worker_ids if router.index.num_worker_blocks(w)]
    busy = threading.Thread(target=complete, args=(300, " busy"))  # keeps the holder busy for a while
    busy.start()
    try:
        while not router._active.get(holder):  # routed to the holder (its prefix), still running
            assert busy.is_alive() and time.monotonic() < deadline + 10
            time.sleep(0.005)
        answer = complete(2, " pulled")
    finally:
        busy.join(60)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 10 * infos[0].block_size
    gateway_samples = _samples(f"{gateway.url}/metrics")
    assert gateway_samples[("dynserve_kv_pulls_total", frozenset({("outcome", "pulled")}))] == 1
    [reader] = [info for info in infos if info.worker_id != holder]
    worker_samples = _samples(f"http://{reader.host}:{reader.metrics_port}/metrics")
    assert sum(v for (name, _labels), v in worker_samples.items() if name == "dynserve_worker_kv_pull_reads_total") == 1
    assert sum(v for (name, _labels), v in worker_samples.items() if name == "dynserve_worker_kv_pull_bytes_total") > 0
