"""vLLM's KV events as dynserve's: its ZMQ publisher's wire format decoded, its blocks re-hashed with dynserve's
block hashing (so a router hit on a vLLM worker is a hit in that worker's prefix cache), and a relay that
follows one vLLM server and publishes on the event plane under its worker id.

The wire. vLLM's publisher (`--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'`)
sends multipart messages `(topic, seq, payload)` on a PUB socket: `seq` an 8-byte big-endian counter from 0,
`payload` a MessagePack `[ts, [event, ...], data_parallel_rank?]`. An event is either a positional array
led by its type name (older releases: `["BlockStored", block_hashes, parent_block_hash, token_ids,
block_size, lora_id, medium, ...]`) or a map with a `type` key (newer: `{"type": "BlockStored",
"block_hashes": ..., ...}`); `decode_batch` reads both. Block hashes are integers or bytes (vLLM's
reproducible hashing); they are only keys here. A replay socket (ROUTER), when configured, answers a
request `seq` with every buffered message from it and an end marker (seq -1).

Re-hashing. vLLM's hashes are its own (seeded per process unless `PYTHONHASHSEED` is fixed), so the relay
re-hashes each stored block from the token ids the event carries, chained from the parent's dynserve hash
(looked up by the parent's vLLM hash), salted by the model (and the LoRA's name). A block whose parent the
relay never saw (it joined late or lost events) cannot be re-hashed: its run is skipped, the router sees no
hit for it, which is an undercount, never a wrong hit.

Media. vLLM names the medium of each stored or removed block (its offloading specs' `medium()`): "GPU"
(or none: the device), "CPU" (its offloading connector's host tier), "DISK"; they become dynserve's
`MEDIA` ("device", "host", "disk") and feed the router's tiered index. The offloading connector's stores
carry no token ids (and block size 0): such a block is translated by its vLLM hash, which is the hash of a
block the worker stored on the device before; one the relay never saw is counted an orphan. A vLLM hash
keeps its translation while any medium holds the block, so a removal on any medium is translated. Blocks
on a medium we do not know are counted (`VllmTranslator.num_unknown_medium`) and not indexed. A vLLM
`AllBlocksCleared` clears the worker on every medium (an undercount if vLLM kept its offloaded blocks).

Joining late. A relay that starts beside a server that has already served (a gateway restarted in front of
warm vLLM servers, a server attached after it took traffic) would never index the prefixes cached before it
joined, nor any block stored after them (their parents unseen). So before it reads the live stream it asks the
replay socket for everything it still buffers, from sequence number 0, and applies that in order: from its
oldest buffered message where the buffer no longer reaches back to 0 (blocks stored before that stay unknown:
an undercount).

Gaps. A sequence number that skips ahead is a lost message: the relay asks the replay socket for the missed
ones; when there is none, or the replay does not reach back that far, the worker's index is cleared
(`AllBlocksCleared`) and rebuilt from the events that follow.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from dynserve.hashing import hash_blocks, model_salt
from dynserve.protocol import MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["END_SEQ", "VllmBatch", "VllmCleared", "VllmEventRelay", "VllmRemoved", "VllmStored", "VllmTranslator",
           "decode_batch"]

logger = logging.getLogger(__name__)

END_SEQ = -1  # the replay socket's end marker
# vLLM's names of media (upper-cased) -> ours; None (not given, older releases) is the device
_MEDIA = {None: "device", "GPU": "device", "CUDA": "device", "CPU": "host", "DISK": "disk"}
_MEDIUM_BITS = {medium: 1 << i for i, medium in enumerate(MEDIA)}

# the positional fields of each event type, in vLLM's order (later releases append fields; extras are ignored)
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
_REMOVED_FIELDS = ("block_hashes", "medium")

VllmHash = int | bytes


@dataclass(frozen=True, slots=True)
class VllmStored:
    block_hashes: list[VllmHash]
    parent_block_hash: VllmHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class VllmRemoved:
    block_hashes: list[VllmHash]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class VllmCleared:
    pass


VllmEvent = VllmStored | VllmRemoved | VllmCleared


@dataclass(frozen=True, slots=True)
class VllmBatch:
    ts: float
    events: list[VllmEvent]
    data_parallel_rank: int | None = None


class VllmDecodeError(ValueError):
    """A payload that is not a vLLM KV event batch."""


def _fields(raw: Any, names: Sequence[str], kind: str) -> dict[str, Any]:
    if isinstance(raw, dict):
        return {name: raw.get(name) for name in names}
    if isinstance(raw, list):
        values = raw[1:]
        if len(values) < 1:
            raise VllmDecodeError(f"{kind} without fields: {raw!r}")
        return {name: values[i] if i < len(values) else None for i, name in enumerate(names)}
    raise VllmDecodeError(f"an event is an array or a map, not {type(raw).__name__}")


def _event(raw: Any) -> VllmEvent:
    kind = raw.get("type") if isinstance(raw, dict) else raw[0] if isinstance(raw, list) and raw else None
    if kind == "BlockStored":
        f = _fields(raw, _STORED_FIELDS, kind)
        if not isinstance(f["block_hashes"], list) or not isinstance(f["token_ids"], list) \
                or not isinstance(f["block_size"], int) or f["block_size"] < 0:
            raise VllmDecodeError(f"malformed BlockStored: {raw!r}")
        return VllmStored(**f)
    if kind == "BlockRemoved":
        f = _fields(raw, _REMOVED_FIELDS, kind)
        if not isinstance(f["block_hashes"], list):
            raise VllmDecodeError(f"malformed BlockRemoved: {raw!r}")
        return VllmRemoved(**f)
    if kind == "AllBlocksCleared":
        return VllmCleared()
    raise VllmDecodeError(f"unknown KV event type {kind!r}")


def decode_batch(payload: bytes) -> VllmBatch:
    """One payload of vLLM's publisher, in either wire shape; `VllmDecodeError` if it is not one."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise VllmDecodeError(f"not MessagePack: {exc}") from exc
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise VllmDecodeError(f"a batch is [ts, events, rank?], not {raw!r:.200}")
    rank = raw[2] if len(raw) > 2 else None
    return VllmBatch(ts=float(raw[0]), events=[_event(e) for e in raw[1]], data_parallel_rank=rank)


def _medium(vllm_medium: str | None) -> str | None:
    """Our medium for vLLM's name of one (None: a medium we do not know)."""
    return _MEDIA.get(vllm_medium.upper() if isinstance(vllm_medium, str) else vllm_medium)


@dataclass
class VllmTranslator:
    """vLLM events of one worker as dynserve events (numbered from 0), re-hashed for `model_id`, each on its
    medium."""

    model_id: str
    block_size: int
    num_unknown_medium: int = 0  # blocks stored or removed on a medium we do not know (not indexed)
    num_orphans: int = 0  # stored blocks skipped: their parent (or, with no token ids, the block) never seen
    _ours: dict[VllmHash, int] = field(default_factory=dict)  # vLLM's hash -> dynserve's, while held
    _media: dict[VllmHash, int] = field(default_factory=dict)  # vLLM's hash -> the media holding it (bits)
    _next_id: int = 0
    _salts: dict[str | None, int] = field(default_factory=dict)

    def _salt(self, lora_name: str | None) -> int:
        if lora_name not in self._salts:
            self._salts[lora_name] = model_salt(self.model_id, lora_name)
        return self._salts[lora_name]

    def _id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def translate(self, events: Sequence[VllmEvent]) -> list[KVEvent]:
        out: list[KVEvent] = []
        for event in events:
            if isinstance(event, VllmCleared):
                out.append(self.reset())
                continue
            medium = _medium(event.medium)
            if medium is None:
                self.num_unknown_medium += len(event.block_hashes)
            elif isinstance(event, VllmStored):
                stored = self._stored(event, medium)
                if stored is not None:
                    out.append(stored)
            else:
                removed = self._removed(event, medium)
                if removed is not None:
                    out.append(removed)
        return out

    def _stored(self, event: VllmStored, medium: str) -> BlockStored | None:
        if not event.token_ids and medium != MEDIA[0]:  # a block copied down a tier: known by its hash
            known = [h for h in event.block_hashes if h in self._ours]
            self.num_orphans += len(event.block_hashes) - len(known)
            return self._hold(known, [self._ours[h] for h in known], None, medium)
        if event.block_size != self.block_size:
            raise VllmDecodeError(f"the worker stores blocks of {event.block_size} tokens; it was announced "
                                  f"with {self.block_size}")
        parent: int | None = None
        if event.parent_block_hash is not None:
            parent = self._ours.get(event.parent_block_hash)
            if parent is None:
                self.num_orphans += len(event.block_hashes)
                return None
        ours = hash_blocks(event.token_ids, self.block_size, self._salt(event.lora_name), parent)
        if len(ours) != len(event.block_hashes):
            raise VllmDecodeError(f"BlockStored with {len(event.block_hashes)} hashes and "
                                  f"{len(event.token_ids)} token ids of blocks of {self.block_size}")
        return self._hold(event.block_hashes, list(ours), parent, medium)

    def _hold(self, theirs: list[VllmHash], ours: list[int], parent: int | None,
              medium: str) -> BlockStored | None:
        """Record that `medium` holds the blocks `theirs` (ours: `ours`); the event saying so, if any."""
        if not ours:
            return None
        bit, media = _MEDIUM_BITS[medium], self._media
        self._ours.update(zip(theirs, ours, strict=True))
        for h in theirs:
            media[h] = media.get(h, 0) | bit
        return BlockStored(self._id(), parent, ours, medium=medium)

    def _removed(self, event: VllmRemoved, medium: str) -> BlockRemoved | None:
        bit, media = _MEDIUM_BITS[medium], self._media
        ours = []
        for h in event.block_hashes:
            held = media.get(h, 0)
            if not held & bit:
                continue
            ours.append(self._ours[h])
            if held == bit:  # no medium holds it now: forget its translation
                del media[h], self._ours[h]
            else:
                media[h] = held & ~bit
        return BlockRemoved(self._id(), ours, medium=medium) if ours else None

    def reset(self) -> AllBlocksCleared:
        """Forget everything (events were lost, or the worker cleared its cache): the event that clears the
        worker's index on every medium."""
        self._ours.clear()
        self._media.clear()
        return AllBlocksCleared(self._id())


class VllmEventRelay:
    """Follows one vLLM server's KV events (`endpoint`, and `replay_endpoint` if it has one) and hands them,
    as dynserve's, in order, to `emit` (the worker's `Registration.queue_kv_events`, which publishes them on
    the event plane as worker `worker_id`'s). `run()` until cancelled."""

    def __init__(self, emit: Callable[[list[KVEvent]], None], worker_id: str, translator: VllmTranslator,
                 endpoint: str, *, replay_endpoint: str | None = None, topic: bytes = b"",
                 on_gap: Callable[[int, bool], None] | None = None) -> None:
        """`on_gap(num_missed, replayed)`: told of each gap and whether the replay filled it."""
        self.emit, self.worker_id, self.translator = emit, worker_id, translator
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic
        self._on_gap = on_gap
        self.next_seq: int | None = None  # the sequence number expected next
        self.num_published = 0

    async def run(self) -> None:
        import zmq
        import zmq.asyncio

        context = zmq.asyncio.Context.instance()
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(self.endpoint)  # before the catch-up: what is published meanwhile waits in the socket
        try:
            await self.catch_up()
            while True:
                _topic, seq_bytes, payload = await sub.recv_multipart()
                await self.receive(int.from_bytes(seq_bytes, "big", signed=True), payload)
        finally:
            sub.close(linger=0)

    async def receive(self, seq: int, payload: bytes) -> None:
        """One message of the publisher, in order: a gap before it is filled from the replay or clears the
        worker's index first."""
        if self.next_seq is not None and seq > self.next_seq:
            missed = seq - self.next_seq
            replayed = await self._replay(self.next_seq, seq)
            if self._on_gap is not None:
                self._on_gap(missed, replayed)
            if not replayed:
                logger.warning("worker %s: %d KV event batches lost (no replay); its index is rebuilt",
                               self.worker_id, missed)
                await self._publish([self.translator.reset()])
        if self.next_seq is not None and seq < self.next_seq:
            return  # already seen (a replay overlapping the live stream)
        self.next_seq = seq + 1
        try:
            batch = decode_batch(payload)
            events = self.translator.translate(batch.events)
        except VllmDecodeError as exc:
            logger.warning("worker %s: KV event batch %d unreadable (%s); its index is rebuilt", self.worker_id,
                           seq, exc)
            events = [self.translator.reset()]
        await self._publish(events)

    async def catch_up(self) -> bool:
        """What the server published before this relay joined, as far back as its replay socket still buffers it,
        published in order (see "Joining late" in the module's docstring). False when there is no replay socket,
        it answered nothing, or the relay has already read the stream."""
        if self.next_seq is not None:
            return False
        return await self._replay(0, None, from_oldest=True)

    async def _replay(self, start: int, stop: int | None, *, from_oldest: bool = False) -> bool:
        """Batches [start, stop) (stop None: all) from the replay socket, published in order; False if it has
        none of them, or (unless `from_oldest`) not from `start`."""
        if self.replay_endpoint is None:
            return False
        import zmq
        import zmq.asyncio

        # a DEALER, not a REQ: the ROUTER answers one request with many messages, (b"", topic, seq, payload)
        # each, then (b"", b"", END_SEQ, b"")
        dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        got: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), 2.0)
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == END_SEQ:
                    break
                if seq >= start and (stop is None or seq < stop):
                    got.append((seq, frames[-1]))
        except (TimeoutError, OSError, zmq.ZMQError) as exc:
            logger.warning("worker %s: KV event replay failed: %s", self.worker_id, exc)
            return False
        finally:
            dealer.close(linger=0)
        if not got or (got[0][0] != start and not from_oldest):
            return False
        for seq, payload in got:
            self.next_seq = seq + 1
            try:
                await self._publish(self.translator.translate(decode_batch(payload).events))
            except VllmDecodeError:
                return False
        return True

    async def _publish(self, events: list[KVEvent]) -> None:
        if events:
            self.emit(events)
            self.num_published += len(events)
