"""The planner's Kubernetes connector: `KubernetesActuator` carries decisions out on a `DynServeDeployment` by
patching its `DynServePool`s' `/scale` subresource (the operator then resizes the pool's worker Deployment,
and the head's Ray pools follow the pods as they join and leave).

The planner owns a pool's replicas until someone else sets them: a count written by hand (`kubectl scale
dynservepool`, an HPA, a change of the deployment's spec) is taken as the planner's manual override of that
pool, held until released (`DELETE /planner/pools/{pool}`). The actuator tells its own writes from others'
by the annotation `dynserve.io/planner-replicas` it sets after each successful scale (and its in-memory
record of the write in flight): replicas that differ from both are someone else's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

from dynserve.errors import KubernetesError
from dynserve.operator.builders import pool_resource_name
from dynserve.operator.reconcile import Client
from dynserve.operator.spec import API_VERSION, POOL_KIND, POOL_ROLES

__all__ = ["ANNOTATION", "KubernetesActuator", "planner_pools"]

logger = logging.getLogger(__name__)

ANNOTATION = "dynserve.io/planner-replicas"


def planner_pools(deployment: str, roles: tuple[str, ...]) -> dict[str, str]:
    """The planner's pools (roles: "both", "prefill", "decode") -> their DynServePools' names."""
    by_role = {role: pool for pool, role in POOL_ROLES.items()}
    return {role: pool_resource_name(deployment, by_role[role]) for role in roles}


class KubernetesActuator:
    """An `Actuator` (see `live.py`) over a deployment's DynServePools. `on_hand_set(role, replicas)` is told of
    a count someone else wrote (the planner holds it as an override); `serving` counts serving workers."""

    def __init__(self, client: Client, namespace: str, pools: Mapping[str, str], *,
                 on_hand_set: Callable[[str, int], None], serving: Callable[[], Mapping[str, int]]) -> None:
        self.client, self.namespace, self.pools = client, namespace, dict(pools)
        self._on_hand_set, self._serving = on_hand_set, serving
        self._current: dict[str, int] = {}
        self._mine: dict[str, int] = {}  # role -> the count this actuator last wrote (or is writing)
        self._writing: dict[str, int] = {}

    def current(self) -> dict[str, int]:
        """Each pool's replicas as last read or written."""
        return dict(self._current)

    def serving(self) -> dict[str, int]:
        return dict(self._serving())

    async def refresh(self) -> None:
        """Read the pools' replicas; report counts someone else set. Raises KubernetesError."""
        for role, name in self.pools.items():
            obj = await asyncio.to_thread(self.client.get, API_VERSION, POOL_KIND, name, self.namespace)
            if obj is None:
                raise KubernetesError(f"DynServePool {self.namespace}/{name} is gone", status=404, reason="NotFound")
            replicas = int(obj["spec"]["replicas"])
            annotated = (obj["metadata"].get("annotations") or {}).get(ANNOTATION)
            mine = self._mine.get(role, int(annotated) if annotated is not None else None)
            if mine is None:  # first sight of a pool this planner never scaled: its start, not an override
                self._mine[role] = replicas
            elif replicas not in (mine, self._writing.get(role)):
                logger.info("planner: pool %s set to %d by hand; holding it there", role, replicas)
                self._mine[role] = replicas
                self._on_hand_set(role, replicas)
            self._current[role] = replicas

    async def scale(self, pool: str, num_workers: int) -> None:
        """Patch the pool's `/scale` to `num_workers`, then record it as the planner's own."""
        name = self.pools[pool]
        self._writing[pool] = num_workers
        try:
            await asyncio.to_thread(self.client.patch, API_VERSION, POOL_KIND, name, self.namespace,
                                    {"spec": {"replicas": num_workers}}, subresource="scale")
            self._mine[pool] = self._current[pool] = num_workers
            await asyncio.to_thread(self.client.patch, API_VERSION, POOL_KIND, name, self.namespace,
                                    {"metadata": {"annotations": {ANNOTATION: str(num_workers)}}})
        finally:
            self._writing.pop(pool, None)
        logger.info("planner: DynServePool %s/%s scaled to %d", self.namespace, name, num_workers)
