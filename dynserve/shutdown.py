"""Bounded shutdown steps. A process that stops (Ctrl-C, SIGTERM) runs its steps one after another: stop
following the registry, stop the KV consumers, close the event plane's connections, end the pools. One step
that never ends (a connection whose close waits on a peer, a task that lost its cancellation) must not keep
the process alive, so each runs under `step`: given `timeout_s`, then left behind with a warning naming it.

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


async def step(name: str, awaitable: Awaitable[Any], timeout_s: float) -> bool:
    """Run `awaitable` for at most `timeout_s`; True when it ended in time without an error. Past the
    timeout it is cancelled and not waited for (it may ignore the cancellation), and a warning names `name`;
    an error it raises is logged, not raised (the steps after it still run). Cancelling `step` itself cancels
    the step's task too."""
    start_s = time.monotonic()
    task = asyncio.ensure_future(awaitable)
    try:
        done, _pending = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
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
