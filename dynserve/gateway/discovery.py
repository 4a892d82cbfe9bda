"""Models found in the worker registry: a worker that announces a model the gateway does not serve adds it.

`ModelDiscovery` reads the registry every `interval_s`. A model id no served model has, announced by a worker
with a `model_path` (dynserve's workers give theirs), becomes a `ServedModel`: its tokenizer read from that
path (on a thread), a backend over the workers announcing it (`make_backend`, which gives it its own router
and KV index), started, its KV events consumed, listed in `/v1/models` from then on. A model it added whose
workers have all been gone for `grace_s` is removed again (its backend stopped); the models the gateway was
started with are never removed (at zero workers they wait for the planner, as before).

A model whose tokenizer cannot be read (another host's path, a format we refuse) is logged once and not
served; its workers stay out of every other model's pools (each directory takes only its own model's).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from dynserve.events.base import EventPlane
from dynserve.gateway.state import GatewayState, ServedModel
from dynserve.protocol import WorkerInfo

__all__ = ["ModelDiscovery"]

logger = logging.getLogger(__name__)

# the models found: a ServedModel (not started) for the workers announcing a new model
MakeServed = Callable[[list[WorkerInfo]], Awaitable[ServedModel]]
# what serving a model needs beside its backend's own start: its KV events consumed (returns the stopper)
Attach = Callable[[ServedModel], Awaitable[Callable[[], Awaitable[None]]]]


class ModelDiscovery:
    def __init__(self, state: GatewayState, registry: EventPlane, make_served: MakeServed, attach: Attach, *,
                 interval_s: float = 0.25, grace_s: float = 3.0) -> None:
        self.state, self.registry = state, registry
        self._make_served, self._attach = make_served, attach
        self.interval_s, self.grace_s = interval_s, grace_s
        self.added: dict[str, Callable[[], Awaitable[None]]] = {}  # model id -> its detach
        self._gone_since: dict[str, float] = {}
        self._refused: set[str] = set()  # model ids whose tokenizer could not be read (logged once)

    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.interval_s)

    async def refresh(self) -> None:
        """One pass: add the new models the registry lists, remove added ones gone for `grace_s`."""
        try:
            listed = await self.registry.workers()
        except Exception as exc:  # a registry blip changes nothing
            logger.warning("model discovery: cannot read the worker registry: %s", exc)
            return
        by_model: dict[str, list[WorkerInfo]] = {}
        for info in listed:
            by_model.setdefault(info.model_id, []).append(info)
        for model_id, infos in by_model.items():
            self._gone_since.pop(model_id, None)
            if model_id in self.state.models or model_id in self._refused:
                continue
            announced = [info for info in infos if info.model_path is not None]
            if announced:
                await self._add(model_id, announced)
        now_s = time.monotonic()
        for model_id in [m for m in self.added if m not in by_model]:
            since_s = self._gone_since.setdefault(model_id, now_s)
            if now_s - since_s >= self.grace_s:
                await self._remove(model_id)

    async def _add(self, model_id: str, infos: list[WorkerInfo]) -> None:
        try:
            served = await self._make_served(infos)
        except Exception as exc:  # its tokenizer unreadable here, or refused: not served, said once
            self._refused.add(model_id)
            logger.warning("model discovery: cannot serve %s (announced by %s at %s): %s", model_id,
                           infos[0].worker_id, infos[0].model_path, exc)
            return
        await served.backend.start()
        self.added[model_id] = await self._attach(served)
        self.state.add_model(served)
        logger.info("model discovery: now serving %s (%d worker(s))", model_id, len(infos))

    async def _remove(self, model_id: str) -> None:
        self._gone_since.pop(model_id, None)
        detach = self.added.pop(model_id)
        served = self.state.remove_model(model_id)
        await detach()
        await served.backend.stop()
        logger.info("model discovery: %s has no workers left; no longer served", model_id)

    async def close(self) -> None:
        for model_id in list(self.added):
            await self._remove(model_id)
