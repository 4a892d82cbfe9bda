"""What `dynctl deploy` and `dynctl status` show of a `DynServeDeployment`'s status, as the operator writes it
(`dynserve/operator/reconcile.py`): a `DeploymentView` of it (pure), whether waiting is over (`outcome`), a
plain progress line, rich tables, and `Progress` (a live view on a terminal, else a line per change).
A status counts only when its `observedGeneration` is the resource's `generation`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Literal, Self

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

__all__ = ["PERMANENT_REASONS", "Condition", "DeploymentView", "PoolStatus", "Progress", "outcome", "progress_line",
           "render_view", "view_of"]

# Degraded reasons that waiting cannot fix: the operator's verdict on a spec (reconcile.invalid_status), an API
# refusal only the user can lift, an image that cannot be pulled
PERMANENT_REASONS = frozenset({"InvalidSpec", "Invalid", "Forbidden", "ErrImagePull", "ImagePullBackOff"})


@dataclass(frozen=True, slots=True)
class Condition:
    type: str
    status: str
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class PoolStatus:
    pool: str
    desired_replicas: int | None
    ready_replicas: int | None


@dataclass(frozen=True, slots=True)
class DeploymentView:
    """A DynServeDeployment's status as dynctl shows it. `current`: the status is about this generation."""

    name: str
    namespace: str
    generation: int | None
    observed_generation: int | None
    phase: str | None
    conditions: tuple[Condition, ...]
    pools: tuple[PoolStatus, ...]
    gateway_url: str | None

    @property
    def current(self) -> bool:
        return self.generation is not None and self.observed_generation == self.generation

    def condition(self, kind: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == kind), None)


def view_of(obj: dict[str, Any]) -> DeploymentView:
    meta, status = obj.get("metadata") or {}, obj.get("status") or {}
    conditions = tuple(Condition(str(c.get("type", "")), str(c.get("status", "Unknown")),
                                 str(c.get("reason") or ""), str(c.get("message") or ""))
                       for c in status.get("conditions") or [])
    pools = tuple(PoolStatus(pool, p.get("desiredReplicas"), p.get("readyReplicas"))
                  for pool, p in (status.get("pools") or {}).items())
    return DeploymentView(name=meta.get("name", ""), namespace=meta.get("namespace", ""),
                          generation=meta.get("generation"), observed_generation=status.get("observedGeneration"),
                          phase=status.get("phase"), conditions=conditions, pools=pools,
                          gateway_url=status.get("gatewayURL"))


def outcome(view: DeploymentView) -> Literal["ready", "failed"] | None:
    """"ready", "failed" (Degraded for a permanent reason), or None: keep waiting. Only a current status
    counts."""
    if not view.current:
        return None
    ready, degraded = view.condition("Ready"), view.condition("Degraded")
    if ready is not None and ready.status == "True":
        return "ready"
    if degraded is not None and degraded.status == "True" and degraded.reason in PERMANENT_REASONS:
        return "failed"
    return None


def progress_line(view: DeploymentView) -> str:
    """One plain line: the phase, each pool's ready/desired replicas, the Ready condition's message."""
    if not view.current:
        return f"{view.namespace}/{view.name}: waiting for the operator to see generation {view.generation}"
    pools = ", ".join(f"{p.pool} {_count(p.ready_replicas)}/{_count(p.desired_replicas)} ready"
                      for p in view.pools)
    ready = view.condition("Ready")
    message = f" - {ready.message}" if ready is not None and ready.message else ""
    pools_text = f"; {pools}" if pools else ""
    return f"{view.namespace}/{view.name}: {view.phase or 'Pending'}{pools_text}{message}"


def render_view(view: DeploymentView) -> RenderableType:
    """The status as rich tables: conditions, then pools, then the gateway URL."""
    title = f"DynServeDeployment {view.namespace}/{view.name}: {view.phase or 'Pending'}"
    if not view.current:
        title += f" (status of generation {view.observed_generation}; the spec is at {view.generation})"
    conditions = Table("condition", "status", "reason", "message", title=title, title_justify="left")
    for c in view.conditions:
        style = "green" if (c.status == "True") == (c.type != "Degraded") else "yellow"
        conditions.add_row(c.type, Text(c.status, style=style), c.reason, c.message)
    pools = Table("pool", "desired", "ready")
    for p in view.pools:
        pools.add_row(p.pool, _count(p.desired_replicas), _count(p.ready_replicas))
    return Group(conditions, pools, Text(f"gateway: {view.gateway_url or '-'}"))


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)



class Progress:
    """Progress on stderr: a live rich view on a terminal, else a plain line each time it changes."""

    def __init__(self) -> None:
        self._console = Console(stderr=True)
        self._live: Any = None
        self._last_line: str | None = None

    def __enter__(self) -> Self:
        if self._console.is_terminal:
            from rich.live import Live

            self._live = Live(console=self._console, auto_refresh=False, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)

    def show(self, view: DeploymentView) -> None:
        if self._live is not None:
            self._live.update(render_view(view), refresh=True)
            return
        line = progress_line(view)
        if line != self._last_line:
            print(line, file=sys.stderr, flush=True)
            self._last_line = line

    def note(self, message: str) -> None:
        self._console.print(Text(message, style="yellow")) if self._live is not None else print(
            message, file=sys.stderr, flush=True)
