"""What the workers were doing during a benchmark, seen from the workers themselves: find them in the
registry, then poll each one's load (running and waiting requests) over the worker channel, as a gateway
does, whatever router is sending them requests.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from dynserve.protocol import WorkerInfo, WorkerLoad
from dynserve.workers.channel import WorkerConnection

__all__ = ["LoadSampler", "registered_workers"]


async def registered_workers(redis_url: str, namespace: str, num_workers: int,
                             timeout_s: float = 60) -> list[WorkerInfo]:
    """The workers registered in `namespace` once there are `num_workers` of them."""
    from dynserve.events.redis_plane import RedisEventPlane

    plane = RedisEventPlane(redis_url, prefix=namespace)
    deadline_s = time.monotonic() + timeout_s
    try:
        while len(infos := await plane.workers()) < num_workers:
            if time.monotonic() > deadline_s:
                raise RuntimeError(f"only {len(infos)} of {num_workers} workers registered in {namespace}")
            await asyncio.sleep(0.1)
        return infos
    finally:
        await plane.close()


class LoadSampler:
    """Polls every worker's load each `interval_s` until cancelled; `summary()` gives time averages."""

    def __init__(self, infos: list[WorkerInfo], interval_s: float = 0.2) -> None:
        self.infos, self.interval_s = infos, interval_s
        self._running = {info.worker_id: 0 for info in infos}
        self._waiting = {info.worker_id: 0 for info in infos}
        self._num_samples = 0
        self.num_missed = 0  # polls a worker did not answer in time

    async def run(self) -> None:
        connections = [WorkerConnection(info) for info in self.infos]
        await asyncio.gather(*(c.connect() for c in connections))
        try:
            while True:
                loads = await asyncio.gather(*(c.load() for c in connections), return_exceptions=True)
                for load in loads:
                    if isinstance(load, WorkerLoad):  # a late answer counts as none this round
                        self._running[load.worker_id] += load.num_running
                        self._waiting[load.worker_id] += load.num_waiting
                    else:
                        self.num_missed += 1
                self._num_samples += 1
                await asyncio.sleep(self.interval_s)
        finally:
            await asyncio.gather(*(c.close() for c in connections))

    def summary(self) -> dict[str, Any]:
        """Per worker (in id order) the mean running and waiting requests; `imbalance` is the busiest worker's
        mean requests (running + waiting) over the average worker's (1 is perfectly even)."""
        n = max(self._num_samples, 1)
        ids = sorted(self._running)
        running = [self._running[w] / n for w in ids]
        waiting = [self._waiting[w] / n for w in ids]
        busy = [r + q for r, q in zip(running, waiting, strict=True)]
        mean = sum(busy) / len(busy) if busy else 0.0
        return {"mean_running": [round(r, 2) for r in running],
                "mean_waiting": [round(q, 2) for q in waiting],
                "imbalance": round(max(busy) / mean, 2) if mean else None, "num_samples": self._num_samples,
                "num_missed": self.num_missed}
