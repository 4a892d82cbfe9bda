"""Bounded shutdown steps. A process that stops (Ctrl-C, SIGTERM) runs its steps one after another: stop
following the registry, stop the KV consumers, close the event plane's connections, end the pools. One step
that does not end (a connection whose close waits on a peer forever) must not hold up the steps after it (the
pools' workers still end), so each runs under `step`: given `timeout_s`, then cancelled and left behind with a
warning naming it. What it guarantees is that the later steps run; the loop's own close cancels what is left
once more and waits for it, so a step that swallows every cancellation can still keep the process up (the
warning says which).

A process's steps share one `budget` as well, so their sum is bounded, not only each step: a step's timeout
is what is left of the budget when that is less, though not under `MIN_STEP_S` (the steps after a spent
budget, the pools' close among them, still get a moment): at most the budget plus `MIN_STEP_S` for each step
after it is spent. The budget's clock starts at its first step, so the drain before (the gateway's grace for
requests in flight) is not counted in it; hence `step` is for shutting down only (one run inside a budget
while the process serves would start the clock then). A pod's grace period covers the drain and the steps
(`operator/builders.py`).

Only the shared language: every part may use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Awaitable, Iterator
from typing import Any

__all__ = ["MIN_STEP_S", "STEPS_BUDGET_S", "budget", "step"]

logger = logging.getLogger("dynserve.shutdown")

# What a process's shutdown steps may take in all (each still bounded by its own timeout), and the least a
# step gets once that is spent
STEPS_BUDGET_S = 30.0
MIN_STEP_S = 2.0


class _Budget:
    def __init__(self, total_s: float) -> None:
        self.total_s = total_s
        self.end_s: float | None = None  # set by the first step

    def timeout_s(self, timeout_s: float) -> float:
        if self.end_s is None:
            self.end_s = time.monotonic() + self.total_s
        return min(timeout_s, max(MIN_STEP_S, self.end_s - time.monotonic()))


_budget: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("dynserve_shutdown_budget",
                                                                        default=None)


@contextlib.contextmanager
def budget(total_s: float = STEPS_BUDGET_S) -> Iterator[None]:
    """The steps run within this block (and in the tasks it starts) share `total_s`, counted from the first of
    them. Within a budget already running, the outer one goes on (a gateway's steps inside `dynctl serve`'s
    count against the fleet's)."""
    if _budget.get() is not None:
        yield
        return
    token = _budget.set(_Budget(total_s))
    try:
        yield
    finally:
        _budget.reset(token)


# Steps left behind, held until they end (the loop holds tasks only weakly) so their end is logged
_left_behind: set[asyncio.Future[Any]] = set()


def _reap(task: asyncio.Future[Any]) -> None:
    _left_behind.discard(task)
    if not task.cancelled() and task.exception() is not None:
        logger.warning("shutdown: a step left behind failed at last (%r)", task.exception())


async def step(name: str, awaitable: Awaitable[Any], timeout_s: float) -> bool:
    """Run `awaitable` for at most `timeout_s`; True when it ended in time without an error. Past the
    timeout it is cancelled and not waited for (held until it ends, its error then logged), and a warning
    names `name`; an error it raises is logged, not raised (the steps after it still run). Cancelling `step`
    itself cancels the step's task too. Within a `budget`, `timeout_s` is at most what is left of it, or
    `MIN_STEP_S` once that is less."""
    shared = _budget.get()
    if shared is not None:
        timeout_s = shared.timeout_s(timeout_s)
    start_s = time.monotonic()
    task = asyncio.ensure_future(awaitable)
    try:
        done, _pending = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        _left_behind.add(task)
        task.add_done_callback(_reap)
        logger.warning("shutdown: %s still running after %.1f s; going on without it", name, timeout_s)
        return False
    if task.cancelled():
        logger.warning("shutdown: %s was cancelled", name)
        return False
    exc = task.exception()
    if exc is not None:
        logger.warning("shutdown: %s failed (%r)", name, exc)
        return False
    logger.debug("shutdown: %s took %.2f s", name, time.monotonic() - start_s)
    return True
