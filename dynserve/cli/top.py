"""`dynctl top`: a live terminal view of a running fleet, read back from its Prometheus.

Three parts, kept apart so each is testable alone:

- the view, plain data: `FleetView` holds the gateway's totals (`FleetStats`), one `PoolView` per role and
  one `WorkerView` per worker;
- the query layer, `fetch_view(client)`: a few instant queries, of the recording rules of
  `dynserve/observability/rules.py` where one exists and of the workers' raw gauges where none does;
- the rendering, `render(view)`: a pure function of a view to a rich renderable (the workers' table gains a
  column of cached KV blocks per medium, device/host/disk, when any worker has KV tiers).

`top(...)` is the shell: one frame (`--once`: a table, or the view as JSON) or a `rich.live.Live` loop that
redraws every `interval_s` until Ctrl-C, showing Prometheus's errors in the frame and retrying.

Invariants of a view: a quantity Prometheus has no finite number for (no series yet, a quantile over no
observations, a down worker's stale series) is NaN, drawn "-" and written null in JSON. Latencies stay in
seconds, as Prometheus has them, and are drawn in milliseconds; ratios are drawn as percentages. Pools are
sorted by role, workers by pool and then id (worker-2 before worker-10). A worker's health is that of its
scrape targets, joined by `instance`: up when any target it was scraped from in the last `HEALTH_WINDOW`
is up, down when all are down, unknown when none is known.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from dynserve.config import Settings
from dynserve.errors import InvalidRequestError, PrometheusError
from dynserve.observability.promql import PrometheusClient, Sample

__all__ = ["DEFAULT_PROMETHEUS_URL", "FleetStats", "FleetView", "PoolView", "WorkerView", "fetch_view",
           "finite_or_none", "render", "render_error", "run_live", "top", "view_to_json"]

DEFAULT_PROMETHEUS_URL = "http://127.0.0.1:9090"
HEALTH_WINDOW = "10m"
NAN = math.nan
Health = Literal["up", "down", "unknown"]


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker. `worker_id` is None for a scrape target that served no worker metrics in `HEALTH_WINDOW`
    (then `role` and `model` are empty and `instance` names it)."""

    worker_id: str | None
    role: str
    model: str
    instance: str | None
    health: Health
    num_waiting: float = NAN
    num_running: float = NAN
    kv_usage_ratio: float = NAN
    generated_tokens_per_s: float = NAN
    step_mean_s: float = NAN
    # cached KV blocks per medium (`dynserve_worker_kv_tier_blocks`), and the blocks its host and disk tiers
    # can hold together (0: no tiers)
    kv_device_blocks: float = NAN
    kv_host_blocks: float = NAN
    kv_disk_blocks: float = NAN
    kv_lower_capacity_blocks: float = NAN

    @property
    def has_lower_tiers(self) -> bool:
        return self.kv_lower_capacity_blocks > 0  # False for NaN


@dataclass(frozen=True, slots=True)
class PoolView:
    """The workers of one role. `num_workers` counts those reporting metrics; `num_workers_down` those whose
    target is down. Latencies are the workers' own (arrival at the worker to first token; between tokens)."""

    role: str
    num_workers: int
    num_workers_down: int
    num_waiting: float = NAN
    kv_usage_ratio: float = NAN
    ttft_p50_s: float = NAN
    ttft_p90_s: float = NAN
    ttft_p99_s: float = NAN
    itl_p50_s: float = NAN
    itl_p90_s: float = NAN
    itl_p99_s: float = NAN


@dataclass(frozen=True, slots=True)
class FleetStats:
    """What clients see, measured at the gateway."""

    request_rate_per_s: float = NAN
    error_rate_per_s: float = NAN
    generated_tokens_per_s: float = NAN
    ttft_p50_s: float = NAN
    ttft_p99_s: float = NAN
    itl_p50_s: float = NAN
    itl_p99_s: float = NAN

    @property
    def error_ratio(self) -> float:
        if not self.request_rate_per_s > 0:
            return NAN
        return self.error_rate_per_s / self.request_rate_per_s


@dataclass(frozen=True, slots=True)
class FleetView:
    """One frame: everything `render` draws."""

    prometheus_url: str
    fetched_at_unix_s: float
    fleet: FleetStats
    pools: tuple[PoolView, ...]
    workers: tuple[WorkerView, ...]


# ---- the query layer ------------------------------------------------------------------------------------

# WorkerView field -> expression; each series labelled worker_id, role, model. Waiting and running are read
# from the same scrape (raw gauges), not waiting from a rule a rule-evaluation older than running.
WORKER_QUERIES: dict[str, str] = {
    "num_waiting": "dynserve_worker_waiting_requests",
    "num_running": "dynserve_worker_running_requests",
    "kv_usage_ratio": "worker:dynserve_worker_kv_usage:ratio",
    "generated_tokens_per_s": "worker:dynserve_worker_generated_tokens:rate1m",
    "step_mean_s": "worker:dynserve_worker_step_duration_seconds:mean1m",
    **{f"kv_{medium}_blocks": f'dynserve_worker_kv_tier_blocks{{medium="{medium}"}}'
       for medium in ("device", "host", "disk")},
    "kv_lower_capacity_blocks": 'sum by (worker_id, role, model) '
                                '(dynserve_worker_kv_tier_blocks_capacity{medium!="device"})',
}
# PoolView field -> expression; each series labelled role
POOL_QUERIES: dict[str, str] = {
    "num_waiting": "role:dynserve_worker_waiting_requests:sum",
    "kv_usage_ratio": "role:dynserve_worker_kv_usage:ratio",
    **{f"ttft_p{q}_s": f"role:dynserve_worker_time_to_first_token_seconds:p{q}" for q in (50, 90, 99)},
    **{f"itl_p{q}_s": f"role:dynserve_worker_inter_token_latency_seconds:p{q}" for q in (50, 90, 99)},
}
POOL_COUNT_QUERY = "role:dynserve_workers:count"
# FleetStats field -> expression; one unlabelled series each
FLEET_QUERIES: dict[str, str] = {
    "request_rate_per_s": "dynserve:requests:rate1m",
    "error_rate_per_s": "dynserve:request_errors:rate1m",
    "generated_tokens_per_s": "dynserve:generated_tokens:rate1m",
    **{f"ttft_p{q}_s": f"dynserve:time_to_first_token_seconds:p{q}" for q in (50, 99)},
    **{f"itl_p{q}_s": f"dynserve:inter_token_latency_seconds:p{q}" for q in (50, 99)},
}
TARGET_HEALTH_QUERY = 'up{component="worker"}'
# instance -> worker: a range selector skips staleness markers, so a target that just went down still names
# the worker it served
TARGET_WORKER_QUERY = f"last_over_time(dynserve_worker_kv_blocks_capacity[{HEALTH_WINDOW}])"


def fetch_view(client: PrometheusClient) -> FleetView:
    """One frame from Prometheus (about two dozen instant queries, one after another). Raises
    PrometheusError when Prometheus cannot be reached or refuses a query."""
    fetched_at_unix_s = time.time()
    workers = _fetch_workers(client)
    pools = _fetch_pools(client, workers)
    fleet = FleetStats(**{field: _single_value(client.query(expr)) for field, expr in FLEET_QUERIES.items()})
    return FleetView(prometheus_url=client.url, fetched_at_unix_s=fetched_at_unix_s, fleet=fleet,
                     pools=pools, workers=workers)


def _fetch_workers(client: PrometheusClient) -> tuple[WorkerView, ...]:
    identity: dict[str, dict[str, str]] = {}  # worker_id -> labels naming its role and model
    values: dict[str, dict[str, float]] = defaultdict(dict)
    for field, expr in WORKER_QUERIES.items():
        for sample in client.query(expr):
            if worker_id := sample.get("worker_id"):
                identity.setdefault(worker_id, sample.labels)
                values[worker_id][field] = sample.value
    target_health: dict[str, Health] = {s.get("instance"): "up" if s.value == 1 else "down"
                                        for s in client.query(TARGET_HEALTH_QUERY)}
    instances: dict[str, set[str]] = defaultdict(set)  # worker_id -> its targets that are still scraped
    for sample in client.query(TARGET_WORKER_QUERY):
        worker_id, instance = sample.get("worker_id"), sample.get("instance")
        if worker_id and instance in target_health:
            identity.setdefault(worker_id, sample.labels)
            instances[worker_id].add(instance)
    views = [WorkerView(worker_id=worker_id, role=labels.get("role", ""), model=labels.get("model", ""),
                        instance=_main_instance(instances[worker_id], target_health),
                        health=_worker_health(instances[worker_id], target_health), **values[worker_id])
             for worker_id, labels in identity.items()]
    claimed = set().union(*instances.values()) if instances else set()
    views += [WorkerView(worker_id=None, role="", model="", instance=instance, health=health)
              for instance, health in target_health.items() if instance not in claimed]
    return tuple(sorted(views, key=_worker_order))


def _worker_health(instances: set[str], target_health: dict[str, Health]) -> Health:
    healths = {target_health[i] for i in instances}
    return "up" if "up" in healths else "down" if "down" in healths else "unknown"


def _main_instance(instances: set[str], target_health: dict[str, Health]) -> str | None:
    """The target a worker is scraped from now (an up one), else the first of those it was."""
    return min(instances, key=lambda i: (target_health[i] != "up", i), default=None)


def _fetch_pools(client: PrometheusClient, workers: tuple[WorkerView, ...]) -> tuple[PoolView, ...]:
    values: dict[str, dict[str, float]] = defaultdict(dict)
    for field, expr in POOL_QUERIES.items():
        for sample in client.query(expr):
            if role := sample.get("role"):
                values[role][field] = sample.value
    counts = {s.get("role"): s.value for s in client.query(POOL_COUNT_QUERY) if math.isfinite(s.value)}
    roles = set(values) | set(counts) | {w.role for w in workers if w.role}
    return tuple(PoolView(role=role, num_workers=int(counts.get(role, 0)),
                          num_workers_down=sum(w.role == role and w.health == "down" for w in workers),
                          **values[role])
                 for role in sorted(roles))


def _single_value(samples: list[Sample]) -> float:
    return samples[0].value if samples else NAN


def _worker_order(worker: WorkerView) -> tuple[Any, ...]:
    """By pool, then id with its numbers compared as numbers; targets naming no worker last."""
    name = worker.worker_id or worker.instance or ""
    return (worker.worker_id is None, worker.role, [(0, int(p), "") if p.isdigit() else (1, 0, p)
                                                    for p in re.split(r"(\d+)", name) if p])


# ---- rendering (pure) -----------------------------------------------------------------------------------

_HEALTH_STYLE: dict[str, str] = {"up": "green", "down": "bold red", "unknown": "yellow"}


def render(view: FleetView) -> RenderableType:
    """The frame for `view`: a title line, the gateway's totals, one row per pool, one row per worker. Laid
    out for 100 columns; a narrower console shortens the model and target first, then the numbers."""
    when = time.strftime("%H:%M:%S", time.localtime(view.fetched_at_unix_s))
    title = Text.assemble(("dynserve fleet", "bold"), f"  {view.prometheus_url}  {when}")
    return Group(title, _fleet_table(view.fleet), _pools_table(view.pools), _workers_table(view.workers))


def render_error(message: str, last_view: FleetView | None) -> RenderableType:
    """The frame while Prometheus fails: the error, above the last frame that worked (if any)."""
    panel = Panel(Text(message, style="red"), title="Prometheus", title_align="left", border_style="red")
    return panel if last_view is None else Group(panel, render(last_view))


def _table(title: str, *numeric_headers: str, first: tuple[str, ...] = ()) -> Table:
    """A table whose number columns never wrap, so a narrow console shrinks the text columns first (a long
    number header is given as two short lines)."""
    table = Table(title=title, title_justify="left")
    for header in first:
        table.add_column(header, no_wrap=True)
    for header in numeric_headers:
        table.add_column(header, justify="right", no_wrap=True)
    return table


def _fleet_table(fleet: FleetStats) -> Table:
    table = _table("gateway (latencies in ms)", "req/s", "err/s", "errors", "tok/s", "TTFT\np50", "TTFT\np99",
                   "ITL\np50", "ITL\np99")
    table.add_row(_rate(fleet.request_rate_per_s), _rate(fleet.error_rate_per_s), _percent(fleet.error_ratio),
                  _rate(fleet.generated_tokens_per_s), _ms(fleet.ttft_p50_s), _ms(fleet.ttft_p99_s),
                  _ms(fleet.itl_p50_s), _ms(fleet.itl_p99_s))
    return table


def _pools_table(pools: tuple[PoolView, ...]) -> Table:
    table = _table("pools (latencies in ms)", "up", "down", "waiting", "KV", "TTFT\np50", "TTFT\np90",
                   "TTFT\np99", "ITL\np50", "ITL\np90", "ITL\np99", first=("pool",))
    for pool in pools:
        down = Text(str(pool.num_workers_down), style="bold red" if pool.num_workers_down else "")
        table.add_row(pool.role, str(pool.num_workers), down, _count(pool.num_waiting),
                      _percent(pool.kv_usage_ratio), _ms(pool.ttft_p50_s), _ms(pool.ttft_p90_s),
                      _ms(pool.ttft_p99_s), _ms(pool.itl_p50_s), _ms(pool.itl_p90_s), _ms(pool.itl_p99_s))
    if not pools:
        table.add_row(Text("no pools reporting", style="dim"))
    return table


def _workers_table(workers: tuple[WorkerView, ...]) -> Table:
    """One row per worker; with a column of cached KV blocks per medium when any worker has KV tiers."""
    tiers = any(worker.has_lower_tiers for worker in workers)
    table = _table("workers", "waiting", "running", "KV", *(("KV blocks\ndev/host/disk",) if tiers else ()),
                   "tok/s", "step\nms", first=("worker", "pool", "health"))
    table.add_column("model", overflow="ellipsis", max_width=24)
    table.add_column("target", overflow="ellipsis")
    for worker in workers:
        blocks = (worker.kv_device_blocks, worker.kv_host_blocks, worker.kv_disk_blocks)
        table.add_row(worker.worker_id or "-", worker.role or "-",
                      Text(worker.health, style=_HEALTH_STYLE[worker.health]), _count(worker.num_waiting),
                      _count(worker.num_running), _percent(worker.kv_usage_ratio),
                      *(("/".join(map(_count, blocks)),) if tiers else ()),
                      _rate(worker.generated_tokens_per_s), _ms(worker.step_mean_s), worker.model or "-",
                      worker.instance or "-")
    if not workers:
        table.add_row(Text("no workers reporting", style="dim"))
    return table


def _ms(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "+Inf" if seconds == math.inf else "-"
    ms = seconds * 1000
    return f"{ms:.2f}" if ms < 10 else f"{ms:.1f}" if ms < 100 else f"{ms:.0f}"


def _percent(ratio: float) -> str:
    return f"{ratio * 100:.1f}%" if math.isfinite(ratio) else "-"


def _rate(per_s: float) -> str:
    if not math.isfinite(per_s):
        return "-"
    return f"{per_s:.2f}" if per_s < 10 else f"{per_s:.1f}" if per_s < 100 else f"{per_s:.0f}"


def _count(value: float) -> str:
    return f"{value:.0f}" if math.isfinite(value) else "-"


def view_to_json(view: FleetView) -> dict[str, Any]:
    """The view as JSON-able data: latencies in seconds, ratios as fractions, null where there is no finite
    number; the fleet's error ratio is added."""
    data = finite_or_none(dataclasses.asdict(view))
    data["fleet"]["error_ratio"] = finite_or_none(view.fleet.error_ratio)
    return data


def finite_or_none(value: Any) -> Any:
    """`value` with every NaN or infinity (in dicts, lists, tuples) as None: JSON has neither."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_none(v) for v in value]
    return value


# ---- the shell ------------------------------------------------------------------------------------------

def top(*, prometheus_url: str | None, interval_s: float, once: bool, output: Literal["text", "json"],
        console: Console | None = None) -> int:
    """`dynctl top`. The URL defaults to `Settings().prometheus_url` (env DYN_PROMETHEUS_URL), then
    `DEFAULT_PROMETHEUS_URL`. With `once`, raises a one-line PrometheusError when Prometheus fails; live, it
    retries until Ctrl-C and returns 0."""
    if not interval_s > 0:
        raise InvalidRequestError(f"--interval must be more than 0 seconds, not {interval_s:g}",
                                  param="interval")
    url = prometheus_url or Settings().prometheus_url or DEFAULT_PROMETHEUS_URL
    console = console or Console()
    with PrometheusClient(url) as client:
        if once:
            try:
                view = fetch_view(client)
            except PrometheusError as exc:
                raise PrometheusError(_one_line(exc), url=exc.url, query=exc.query) from exc
            if output == "json":
                print(json.dumps(view_to_json(view)), file=console.file, flush=True)
            elif console.is_terminal:
                console.print(render(view))
            else:  # to a file or a pipe, whole rows rather than a guessed 80 columns (`print(width=)` can
                # only narrow a console, so a wider one writes them)
                Console(file=console.file, width=max(console.width, 160)).print(render(view))
            return 0
        return run_live(client, interval_s=interval_s, output=output, console=console)


def run_live(client: PrometheusClient, *, interval_s: float, output: Literal["text", "json"],
             console: Console, sleep: Callable[[float], None] = time.sleep) -> int:
    """A frame every `interval_s` until Ctrl-C, then 0. Text: redrawn in place, a failing Prometheus shown in
    the frame above the last frame that worked. JSON: one view per line, failures on stderr. Either way
    Prometheus is asked again next time."""
    if output == "json":
        return _repeat(lambda: _print_json_line(client, console), interval_s, sleep)
    last_view: FleetView | None = None

    def draw() -> None:
        nonlocal last_view
        try:
            last_view = fetch_view(client)
            frame = render(last_view)
        except PrometheusError as exc:
            frame = render_error(f"{_one_line(exc)} (retrying every {interval_s:g} s)", last_view)
        live.update(frame, refresh=True)

    with Live(console=console, auto_refresh=False) as live:
        return _repeat(draw, interval_s, sleep)


def _print_json_line(client: PrometheusClient, console: Console) -> None:
    try:
        print(json.dumps(view_to_json(fetch_view(client))), file=console.file, flush=True)
    except PrometheusError as exc:
        print(f"dynctl top: {_one_line(exc)} (retrying)", file=sys.stderr, flush=True)


def _repeat(tick: Callable[[], None], interval_s: float, sleep: Callable[[float], None]) -> int:
    """`tick()` every `interval_s` (its own time included) until Ctrl-C; then 0, the exit code."""
    try:
        while True:
            started_s = time.monotonic()
            tick()
            sleep(max(0.0, interval_s - (time.monotonic() - started_s)))
    except KeyboardInterrupt:
        return 0


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())
