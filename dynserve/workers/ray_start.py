"""The runtime env of a worker actor (`worker_runtime_env`): none on a Ray whose system config starts its
workers at niceness 0 (`config.ray_system_config`, as every Ray dynserve starts), else one that says so.

Ray renices every worker process it starts to 15, fit for batch tasks, unless its system config
(`worker_niceness`) or the process's environment (`RAY_worker_niceness`) says otherwise. A worker's start
(Ray's import, ours, the engine's build) is what a scaling decision waits for, and its I/O what a request
waits for: neither may wait behind every other process on the host (at a load average of 30 on 2 cores a
niced mocker took 13-90 s from the pool's call to serving, one started at 0 took 6-16 s).

Saying it in an actor's runtime env costs every start: Ray then starts the process through its
`setup_worker`, which imports ray once more before it execs the worker (a bare actor's start 1.8-1.9 s of
CPU against 1.0 s here), and never hands the actor a process it started ahead. So every Ray dynserve starts
says it once, in its system config, which the cluster's other nodes take from its head: `dynctl serve`'s
local Ray, the operator's head pods, the tests' and the benchmarks' Rays. An actor carries the runtime env
only on a cluster whose config does not say it (one the user started).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

__all__ = ["worker_runtime_env"]

logger = logging.getLogger(__name__)


def worker_runtime_env() -> dict[str, Any] | None:
    """The runtime env of a worker actor on the Ray this process is connected to: none where the cluster's
    system config starts workers at niceness 0 (the actor then inherits its job's, if any), else one that
    says so (a new dict each call, as Ray may add to what it is given)."""
    import ray

    if _starts_workers_unniced(ray.get_runtime_context().gcs_address):
        return None
    return {"env_vars": {"RAY_worker_niceness": "0"}}


@functools.cache
def _starts_workers_unniced(gcs_address: str) -> bool:
    """Whether the cluster at `gcs_address` starts worker processes at niceness 0 by its system config (asked
    once a cluster)."""
    from ray._private import state

    try:
        config = state.state.get_system_config()
    except Exception as exc:  # a Ray without the call: the runtime env says it, as it always can
        logger.debug("the system config of the Ray at %s is not readable: %s", gcs_address, exc)
        return False
    return config.get("worker_niceness") == 0
