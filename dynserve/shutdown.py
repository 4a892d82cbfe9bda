"""Bounded shutdown steps. A process that stops (Ctrl-C, SIGTERM) runs its steps one after another: stop
following the registry, stop the KV consumers, close the event plane's connections, end the pools. One step
that does not end (a connection whose close waits on a peer forever) must not hold up the steps after it (the
pools' workers still end), so each runs under `step`: given `timeout_s`, then cancelled and left behind with a
warning naming it. What it guarantees is that the later steps run; the loop's own close cancels what is left
once more and waits for it, so a step that swallows every cancellation can still keep the process up (the
warning says which).

Only the shared language: every part may use it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any

__all__ = ["step"]

logger = logging.getLogger("dynserve.shutdown")

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
    itself cancels the step's task too."""
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
        logger.warning("shutdown: %s still running after %g s; going on without it", name, timeout_s)
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
