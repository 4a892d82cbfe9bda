"""The Grafana dashboards of a dynserve fleet, built with grafana-foundation-sdk's typed builders: overview
(what clients see at the gateway), router (how requests are placed), workers (each engine's queue, KV cache,
KV tiers and steps), disaggregation (where prompts are prefilled and how their KV travels) and planner (how
many workers each pool gets, and why).

`deploy/grafana/<uid>.json` is this module's output (`python -m dynserve.observability.dashboards` writes it;
a test fails when the two differ). Nothing here is hand-written JSON.

Invariants every dashboard keeps (tests check them): a stable uid, the tag `dynserve` (the dashboards link to
each other through it), the template variables `datasource`, `model` (the models the workers serve), `pool` and
`worker` (each offering those of the models chosen); every panel and target reads `${datasource}`; every
selector of a worker's series filters `role=~"$pool", worker_id=~"$worker", model=~"$model"` (the gateway's
channel to a worker, which has no model label, the first two), every selector of a gateway series labelled
`model` (latencies, token counts, admitted requests, and their `model:` rules) `model=~"$model"`, and every
selector of a router's or the planner's pool-labelled series `pool=~"$pool"`; raw rates use
`$__rate_interval`; recording rules are referred to only by names `rules.RULES` defines (building fails
otherwise). Only the planner dashboard reads the planner's series (`dynctl serve --planner` exports them), so
the other four have data in a fleet without a planner. `expand_variables` turns a panel's expression into one
Prometheus can run directly, for the fleet test that checks every panel of those four has data.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import common as common_builder
from grafana_foundation_sdk.builders import dashboard as dashboard_builder
from grafana_foundation_sdk.builders import gauge, prometheus, stat, text, timeseries
from grafana_foundation_sdk.builders.dashboard import Row
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dashboard_model
from grafana_foundation_sdk.models.text import TextMode

from dynserve.observability.rules import QUANTILES, RULES

__all__ = ["DASHBOARDS", "GRAFANA_DIR", "TAG", "build_all", "expand_variables", "iter_panels", "panel_queries",
           "render", "write_all"]

GRAFANA_DIR = Path(__file__).resolve().parents[2] / "deploy" / "grafana"
TAG = "dynserve"
REFRESH = "10s"
TIME_FROM = "now-30m"

_DATASOURCE = dashboard_model.DataSourceRef(type_val="prometheus", uid="${datasource}")
_RATE = "$__rate_interval"
_MODEL = 'model=~"$model"'
_CHANNEL = 'role=~"$pool", worker_id=~"$worker"'  # the gateway's channel to a worker (no model label)
_WORKER = f'{_CHANNEL}, {_MODEL}'
_POOL = 'pool=~"$pool"'
_ROLE = 'role=~"$pool"'
_DECODE_WORKER = f'role!="prefill", {_WORKER}'  # KV reads happen on decode workers only
_RULE_NAMES = frozenset(rule.record for rule in RULES)
_PLANNER_UID = "dynserve-planner"
# the overview's link to it keeps the time range, data source and pools (Grafana expands these in panel links)
_PLANNER_URL = (f"/d/{_PLANNER_UID}?${{__url_time_range}}&${{datasource:queryparam}}&${{model:queryparam}}"
                f"&${{pool:queryparam}}")

Query = tuple[str, str]  # (PromQL expression, legend format)
PanelBuilder = Any  # a panel builder of grafana_foundation_sdk (they share no base class but `Builder`)


# ---- PromQL ----------------------------------------------------------------------------------------------


def _selector(metric: str, matchers: str = "") -> str:
    return f"{metric}{{{matchers}}}" if matchers else metric


def _rule(record: str, matchers: str = "") -> str:
    """A recording rule's series; `record` must be one `rules.RULES` defines."""
    if record not in _RULE_NAMES:
        raise KeyError(f"no recording rule named {record!r} in dynserve.observability.rules")
    return _selector(record, matchers)


def _sum_rate(metric: str, matchers: str = "", by: str = "") -> str:
    inner = f"rate({_selector(metric, matchers)}[{_RATE}])"
    return f"sum by ({by}) ({inner})" if by else f"sum({inner})"


def _quantile(quantile: float, histogram: str, matchers: str = "", by: str = "") -> str:
    keep = f"le, {by}" if by else "le"
    return f"histogram_quantile({quantile}, {_sum_rate(histogram + '_bucket', matchers, keep)})"


def _mean(histogram: str, matchers: str = "", by: str = "") -> str:
    return f"{_sum_rate(histogram + '_sum', matchers, by)} / {_sum_rate(histogram + '_count', matchers, by)}"


def _p(quantile: float) -> str:
    return f"p{round(quantile * 100)}"


def _quantiles(histogram: str, quantiles: tuple[float, ...], matchers: str = "", by: str = "") -> list[Query]:
    legend = f" {{{{{by}}}}}" if by else ""
    return [(_quantile(q, histogram, matchers, by), _p(q) + legend) for q in quantiles]


def _rule_quantiles(record_prefix: str, matchers: str = "", by: str = "") -> list[Query]:
    legend = f" {{{{{by}}}}}" if by else ""
    return [(_rule(f"{record_prefix}:{_p(q)}", matchers), _p(q) + legend) for q in QUANTILES]


# ---- panels ----------------------------------------------------------------------------------------------


def _with_queries(panel: PanelBuilder, title: str, description: str, unit: str, queries: list[Query],
                  width: int, height: int) -> PanelBuilder:
    panel.title(title).description(description).datasource(_DATASOURCE).unit(unit).span(width).height(height)
    for index, (expr, legend) in enumerate(queries):
        panel.with_target(prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(chr(ord("A") + index))
                          .datasource(_DATASOURCE).range())
    return panel


def _graph(title: str, description: str, unit: str, queries: list[Query], width: int = 8, height: int = 8, *,
           ratio: bool = False, stacked: bool = False) -> PanelBuilder:
    panel = (timeseries.Panel().fill_opacity(10).min(0)
             .legend(common_builder.VizLegendOptions().display_mode(common.LegendDisplayMode.LIST)
                     .placement(common.LegendPlacement.BOTTOM).show_legend(True))
             .tooltip(common_builder.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI)
                      .sort(common.SortOrder.DESCENDING)))
    if ratio:
        panel.max(1)
    if stacked:
        panel.stacking(common_builder.StackingConfig().mode(common.StackingMode.NORMAL))
    return _with_queries(panel, title, description, unit, queries, width, height)


def _stat(title: str, description: str, unit: str, queries: list[Query], width: int = 4, height: int = 4, *,
          names_only: bool = False) -> PanelBuilder:
    panel = (stat.Panel().graph_mode(common.BigValueGraphMode.NONE if names_only else common.BigValueGraphMode.AREA)
             .color_mode(common.BigValueColorMode.NONE if names_only else common.BigValueColorMode.VALUE)
             .text_mode(common.BigValueTextMode.NAME if names_only else common.BigValueTextMode.AUTO)
             .reduce_options(common_builder.ReduceDataOptions().values(False).calcs(["lastNotNull"]))
             .thresholds(dashboard_builder.ThresholdsConfig().mode(dashboard_model.ThresholdsMode.ABSOLUTE)
                         .steps([dashboard_model.Threshold(value=None, color="green")])))
    return _with_queries(panel, title, description, unit, queries, width, height)


def _ratio_gauge(title: str, description: str, queries: list[Query], width: int = 6, height: int = 4) -> PanelBuilder:
    panel = (gauge.Panel().min(0).max(1).show_threshold_markers(True)
             .reduce_options(common_builder.ReduceDataOptions().values(False).calcs(["lastNotNull"]))
             .thresholds(dashboard_builder.ThresholdsConfig().mode(dashboard_model.ThresholdsMode.ABSOLUTE)
                         .steps([dashboard_model.Threshold(value=None, color="green"),
                                 dashboard_model.Threshold(value=0.8, color="orange"),
                                 dashboard_model.Threshold(value=0.95, color="red")])))
    return _with_queries(panel, title, description, "percentunit", queries, width, height)


# ---- the dashboards --------------------------------------------------------------------------------------


def _overview_panels() -> list[PanelBuilder]:
    requests, failed = "dynserve_requests_total", 'status!~"2.."'
    # non-2xx over all; a fleet without errors has no non-2xx series to sum, so they count 0 while it serves
    # (and a fleet that only fails still has a share: 1)
    error_share = f"({_sum_rate(requests, failed)} or 0 * {_sum_rate(requests)}) / {_sum_rate(requests)}"
    return [
        _stat("Requests/s", "Requests answered by the gateway, all endpoints and statuses.", "reqps",
              [(_rule("dynserve:requests:rate1m"), "requests/s")]),
        _stat("Error share (non-2xx)", "Share of answered requests whose HTTP status is not 2xx.", "percentunit",
              [(error_share, "non-2xx")]),
        _stat("In-flight requests", "Requests admitted by the gateway and not yet answered.", "short",
              [("sum(dynserve_inflight_requests)", "in flight")]),
        _stat("Generated tokens/s", "Tokens streamed to clients.", "suffix: tok/s",
              [(f'sum({_rule("model:dynserve_generated_tokens:rate1m", _MODEL)})', "tokens/s")]),
        _stat("Mean ISL", "Mean prompt length of finished requests (input sequence length).", "suffix: tok",
              [(_mean("dynserve_request_prompt_tokens", _MODEL), "ISL")]),
        _stat("Mean OSL", "Mean generated length of finished requests (output sequence length).", "suffix: tok",
              [(_mean("dynserve_request_generation_tokens", _MODEL), "OSL")]),
        Row("Latency (as clients see it)"),
        _graph("Time to first token", "From the request's arrival at the gateway to its first token, per model.",
               "s", _rule_quantiles("model:dynserve_time_to_first_token_seconds", _MODEL, "model")),
        _graph("Inter-token latency", "Time between consecutive tokens of a stream, per model.", "s",
               _rule_quantiles("model:dynserve_inter_token_latency_seconds", _MODEL, "model")),
        _graph("End-to-end latency", "From the request's arrival to its last token.", "s",
               _quantiles("dynserve_request_duration_seconds", (0.5, 0.99), _MODEL)),
        Row("Traffic"),
        _graph("Requests/s by status", "Answered requests by HTTP status.", "reqps",
               [(_sum_rate(requests, by="status"), "{{status}}")]),
        _graph("Tokens/s", "Tokens generated, and prompt tokens served from a worker's prefix cache.",
               "suffix: tok/s", [(_sum_rate("dynserve_generated_tokens_total", _MODEL), "generated"),
                                 (_sum_rate("dynserve_cached_prompt_tokens_total", _MODEL), "cached prompt")]),
        _graph("Mean ISL and OSL", "Mean prompt and generated lengths of the requests finished lately.",
               "suffix: tok", [(_mean("dynserve_request_prompt_tokens", _MODEL), "ISL"),
                               (_mean("dynserve_request_generation_tokens", _MODEL), "OSL")]),
        _graph("Rejected requests/s by reason", "Requests refused before running (e.g. queue full, not ready), "
               "and requests re-sent to another worker after a failure.", "reqps",
               [(_sum_rate("dynserve_rejected_requests_total", by="reason"), "rejected: {{reason}}"),
                (_sum_rate("dynserve_gateway_retries_total"), "retried")], width=12),
        _graph("Workers up (gateway's channel)", "1 while the gateway's channel to the worker is open.", "short",
               [(f"sum by (worker_id, role) ({_selector('dynserve_gateway_worker_up', _CHANNEL)})",
                 "{{worker_id}} ({{role}})")], width=12),
        Row("Planner").with_panel(
            text.Panel().title("Planner").mode(TextMode.MARKDOWN).span(24).height(3)
            .content("The planner's panels (workers wanted and serving per pool, its decisions, the load it "
                     "predicts and the latency it steers by) are on the **dynserve / Planner** dashboard: "
                     "follow this panel's link. They have data while `dynctl serve --planner` runs.")
            .links([dashboard_builder.DashboardLink("dynserve / Planner")
                    .type(dashboard_model.DashboardLinkType.LINK).url(_PLANNER_URL)])),
    ]


def _router_panels() -> list[PanelBuilder]:
    lag, decision, overlap = ("dynserve_router_event_lag_seconds", "dynserve_router_decision_seconds",
                              "dynserve_router_overlap_ratio")
    return [
        _stat("Router mode by pool", "Each of the gateway's routers: the pool it serves and its mode.", "none",
              [(_selector("dynserve_router_info", _POOL), "{{pool}}: {{mode}}")], width=24, height=3,
              names_only=True),
        Row("Decisions"),
        _graph("Decisions/s by pool", "Workers picked by each pool's router.", "ops",
               [(_sum_rate(decision + "_count", _POOL, "pool"), "{{pool}}")]),
        _graph("Decision time", "Time to pick a worker: prefix match and selection.", "s",
               _quantiles(decision, (0.5, 0.99), _POOL, "pool")),
        _graph("Hot-spot guard picks/s", "Picks made by the hot-spot guard instead of the cost.", "ops",
               [(_sum_rate("dynserve_router_hot_spot_picks_total", _POOL, "pool"), "{{pool}}")]),
        Row("Cache affinity"),
        _graph("Chosen worker's overlap ratio", "Prompt blocks the chosen worker caches, over prompt blocks.",
               "percentunit", [*_quantiles(overlap, (0.5,), _POOL, "pool"),
                               (_mean(overlap, _POOL, "pool"), "mean {{pool}}")], ratio=True),
        _graph("Prefix-cache hit rate per worker", "Prompt tokens found in each worker's prefix cache, over "
               "prompt tokens looked up (the workers' own counters).", "percentunit",
               [(_rule("worker:dynserve_worker_prefix_cache_hit:ratio1m", _WORKER), "{{worker_id}}")], ratio=True),
        _graph("Requests routed per worker", "Requests each router sent to each worker.", "reqps",
               [(_sum_rate("dynserve_router_routed_requests_total", f"{_POOL}, worker_id=~\"$worker\"",
                           "pool, worker_id"), "{{worker_id}} ({{pool}})")]),
        Row("KV event index"),
        _graph("KV event lag", "From a worker publishing a batch of KV events to the router applying it.", "s",
               _quantiles(lag, (0.5, 0.99), _POOL, "pool")),
        _graph("Index size (blocks)", "Distinct KV blocks in each router's index, and per KV medium (device, "
               "host and disk tiers).", "short",
               [(_selector("dynserve_router_index_blocks", _POOL), "{{pool}}"),
                (_selector("dynserve_router_index_tier_blocks", _POOL), "{{pool}} {{medium}}")]),
        _graph("Index size (workers)", "Workers holding at least one block in each router's index.", "short",
               [(_selector("dynserve_router_index_workers", _POOL), "{{pool}}")]),
    ]


def _workers_panels() -> list[PanelBuilder]:
    step = "dynserve_worker_step_duration_seconds"

    def per_worker(metric: str, matchers: str = _WORKER) -> str:
        return _sum_rate(metric, matchers, "worker_id")

    return [
        _stat("Workers by pool", "Workers exporting metrics, per pool.", "short",
              [(f"count by (role) ({_selector('dynserve_worker_kv_blocks_capacity', _WORKER)})", "{{role}}")],
              width=6),
        _ratio_gauge("KV usage by pool", "KV blocks held by requests over KV blocks, per pool.",
                     [(f"sum by (role) ({_selector('dynserve_worker_kv_blocks_used', _WORKER)}) / sum by (role) "
                       f"({_selector('dynserve_worker_kv_blocks_capacity', _WORKER)})", "{{role}}")]),
        _stat("Gateway channel up", "1 while the gateway's channel to the worker is open.", "short",
              [(f"sum by (worker_id) ({_selector('dynserve_gateway_worker_up', _CHANNEL)})", "{{worker_id}}")],
              width=12),
        Row("Queues and KV cache"),
        _graph("Waiting and running requests", "Requests queued on each worker (including those whose KV is "
               "being read) and in its running batch.", "short",
               [(f"sum by (worker_id) ({_selector('dynserve_worker_waiting_requests', _WORKER)})",
                 "{{worker_id}} waiting"),
                (f"sum by (worker_id) ({_selector('dynserve_worker_running_requests', _WORKER)})",
                 "{{worker_id}} running")]),
        _graph("KV usage ratio", "KV blocks held by requests over the worker's KV blocks.", "percentunit",
               [(_rule("worker:dynserve_worker_kv_usage:ratio", _WORKER), "{{worker_id}}")], ratio=True),
        _graph("Generated tokens/s", "Tokens each worker generated.", "suffix: tok/s",
               [(_rule("worker:dynserve_worker_generated_tokens:rate1m", _WORKER), "{{worker_id}}")]),
        Row("Engine steps"),
        _graph("Step duration", "Time of one engine step (a forward pass).", "s",
               _quantiles(step, (0.5, 0.99), _WORKER, "worker_id")),
        _graph("Batch size (mean)", "Requests in one engine step.", "short",
               [(_mean("dynserve_worker_step_batch_size", _WORKER, "worker_id"), "{{worker_id}}")]),
        _graph("Prefill and decode tokens/s", "Prompt tokens computed and tokens decoded by each worker's "
               "steps.", "suffix: tok/s",
               [(per_worker("dynserve_worker_step_prefill_tokens_sum"), "{{worker_id}} prefill"),
                (per_worker("dynserve_worker_step_decode_tokens_sum"), "{{worker_id}} decode")]),
        Row("Memory pressure"),
        _graph("Preemptions/s", "Running requests preempted (recomputed later) for lack of KV blocks.", "ops",
               [(per_worker("dynserve_worker_preemptions_total"), "{{worker_id}}")], width=12),
        _graph("KV evictions/s", "Cached KV blocks evicted to make room.", "ops",
               [(per_worker("dynserve_worker_kv_evictions_total"), "{{worker_id}}")], width=12),
        _graph("Engine ops in eager torch/s", "Calls of an op the worker's kernels do not cover yet (e.g. the "
               "Triton ops' q/k norm), run in eager torch: correct, slower; the worker's log names the ops. Zero "
               "when every op has its kernel.",
               "ops", [(per_worker("dynserve_worker_engine_op_fallbacks_total"), "{{worker_id}}")], width=12),
        _graph("Grammar mask time per token", "Time to compute the allowed-token mask of one token of a request "
               "with a grammar (structured output, tools), on a thread beside the forward: tens of microseconds "
               "is the usual; no data without such requests (a mocker computes none ahead).", "s",
               _quantiles("dynserve_worker_grammar_mask_seconds", (0.5, 0.99), _WORKER, "worker_id"), width=12),
        Row("KV tiers"),
        *_kv_tier_panels(),
        Row("Latency per pool (measured on the workers)"),
        _graph("Time to first token by pool", "From a request's arrival at a worker to its first token.", "s",
               _quantiles("dynserve_worker_time_to_first_token_seconds", QUANTILES, _WORKER, "role"), width=12),
        _graph("Inter-token latency by pool", "Between the steps that decode a request, on its worker.", "s",
               _quantiles("dynserve_worker_inter_token_latency_seconds", QUANTILES, _WORKER, "role"), width=12),
    ]


def _kv_tier_panels() -> list[PanelBuilder]:
    """The workers dashboard's KV tiers row: blocks per medium, the router's hits per medium, moves between
    tiers, onboard time and bytes, peer pulls. Every worker exports the tier and pull series (at 0 without
    tiers or pulls)."""
    blocks, capacity = "dynserve_worker_kv_tier_blocks", "dynserve_worker_kv_tier_blocks_capacity"
    onboarded = "dynserve_worker_kv_tier_onboarded_blocks_total"

    def per_worker(metric: str, by: str = "worker_id") -> str:
        return _sum_rate(metric, _WORKER, by)

    def hit_share(medium: str) -> Query:
        hits = _sum_rate("dynserve_router_prompt_hit_blocks_total", f'{_POOL}, medium="{medium}"', "pool")
        prompt = _sum_rate("dynserve_router_prompt_blocks_total", _POOL, "pool")
        return f"{hits} / {prompt}", f"{{{{pool}}}} {medium}"

    onboard_time = f"{per_worker('dynserve_worker_kv_onboard_seconds_total')} / {per_worker(onboarded)}"
    return [
        _graph("KV blocks by tier", "Cached KV blocks the workers hold per medium: the device's KV cache, "
               "the host tier and the disk tier (--kv-host-bytes, --kv-disk-bytes).", "short",
               [(f"sum by (medium) ({_selector(blocks, _WORKER)})", "{{medium}}")]),
        _graph("Tier fill", "Blocks held over blocks each medium can hold, all workers (no line for a tier "
               "no worker has).", "percentunit",
               [(f"sum by (medium) ({_selector(blocks, _WORKER)}) / sum by (medium) "
                 f"({_selector(capacity, _WORKER)})", "{{medium}}")], ratio=True),
        _graph("Prompt blocks hit by tier", "Prompt blocks the chosen worker held when the router placed the "
               "request, per medium, over prompt blocks (the router's view; stacked: the whole is the chosen "
               "worker's overlap).", "percentunit",
               [hit_share(medium) for medium in ("device", "host", "disk")], ratio=True, stacked=True),
        _graph("Blocks moved between tiers/s", "Blocks stored into a tier (evicted from the one above), "
               "onboarded from a tier into the KV cache (tier hits), dropped off the last tier, and disk "
               "files found corrupt (recomputed).", "ops",
               [(per_worker("dynserve_worker_kv_tier_offloaded_blocks_total", "worker_id, medium"),
                 "{{worker_id}} stored {{medium}}"),
                (per_worker(onboarded, "worker_id, medium"), "{{worker_id}} onboarded {{medium}}"),
                (per_worker("dynserve_worker_kv_tier_dropped_blocks_total"), "{{worker_id}} dropped"),
                (per_worker("dynserve_worker_kv_disk_corrupt_files_total"), "{{worker_id}} corrupt files")]),
        _graph("Onboard time per block", "Mean time to bring one block from the host or disk tier into the KV "
               "cache (a disk block's file read and checked, then copied).", "s",
               [(onboard_time, "{{worker_id}}")]),
        _graph("Tier bytes/s", "Bytes onboarded into the KV cache from the tiers, and block files written to "
               "and read from the disk tier.", "Bps",
               [(per_worker("dynserve_worker_kv_onboard_bytes_total"), "{{worker_id}} onboarded"),
                (per_worker("dynserve_worker_kv_disk_write_bytes_total"), "{{worker_id}} disk write"),
                (per_worker("dynserve_worker_kv_disk_read_bytes_total"), "{{worker_id}} disk read")]),
        _graph("Peer pulls/s", "Prompt prefixes the router had a worker read from a busier peer's cache "
               "(--kv-peer-pulls), by outcome at the gateway (pulled, or why the worker prefilled instead), and "
               "the workers' pull reads that failed, by reason.", "ops",
               [(_sum_rate("dynserve_kv_pulls_total", by="outcome"), "{{outcome}}"),
                (per_worker("dynserve_worker_kv_pull_failures_total", "reason"), "read failed: {{reason}}")]),
        _graph("Pull bandwidth", "KV bytes each worker pulled from its peers' caches.", "Bps",
               [(per_worker("dynserve_worker_kv_pull_bytes_total"), "{{worker_id}}")]),
        _graph("Pull time (mean)", "Mean time of one prefix pull's read, per reading worker.", "s",
               [(f"{per_worker('dynserve_worker_kv_pull_seconds_total')} / "
                 f"{per_worker('dynserve_worker_kv_pull_reads_total')}", "{{worker_id}}")]),
    ]


def _disaggregation_panels() -> list[PanelBuilder]:
    paths, remote, fallbacks = "dynserve_disagg_requests_total", 'path="remote"', "dynserve_disagg_fallbacks_total"
    transfer_bytes, failures = "dynserve_worker_kv_transfer_bytes_total", "dynserve_worker_kv_transfer_failures_total"
    read_time = (f'{_sum_rate("dynserve_worker_kv_transfer_seconds_total", _DECODE_WORKER, "worker_id")} / '
                 f'{_sum_rate("dynserve_worker_kv_transfer_reads_total", _DECODE_WORKER, "worker_id")}')
    return [
        _stat("Remote prefill share", "Requests whose prompt was prefilled on a prefill worker.", "percentunit",
              [(f"{_sum_rate(paths, remote)} / {_sum_rate(paths)}", "remote")],
              width=6),
        _stat("Fallbacks/s", "Requests prefilled on their decode worker after the remote prefill failed.", "reqps",
              [(_sum_rate(fallbacks), "fallbacks")], width=6),
        _stat("KV transfer bandwidth", "KV bytes read from prefill workers, all decode workers.", "Bps",
              [(_sum_rate(transfer_bytes, _DECODE_WORKER), "bytes/s")], width=6),
        _stat("KV transfer failures/s", "KV reads that failed, all decode workers.", "ops",
              [(_sum_rate(failures, _DECODE_WORKER), "failures")], width=6),
        Row("Where prompts are prefilled"),
        _graph("Requests by prefill path", "remote: on a prefill worker; short_prompt, prefill_queue, "
               "no_prefill_worker: on the decode worker, and why.", "reqps",
               [(_sum_rate(paths, by="path"), "{{path}}")], width=12, stacked=True),
        _graph("Fallbacks by reason", "Requests prefilled on their decode worker after the remote prefill failed "
               "(prefill_failed) or its KV could not be read.", "reqps",
               [(_sum_rate(fallbacks, by="reason"), "{{reason}}")], width=12),
        Row("KV transfer"),
        _graph("KV transfer bandwidth per decode worker", "KV bytes each decode worker read from prefill workers.",
               "Bps", [(_sum_rate(transfer_bytes, _DECODE_WORKER, "worker_id"), "{{worker_id}}")]),
        _graph("KV transfer read time (mean)", "Mean time of one successful KV read.", "s",
               [(read_time, "{{worker_id}}")]),
        _graph("KV transfer failures by reason", "KV reads that failed (the request was prefilled on its decode "
               "worker instead).", "ops", [(_sum_rate(failures, _DECODE_WORKER, "reason"), "{{reason}}")]),
    ]


def _planner_panels() -> list[PanelBuilder]:
    def planner(metric: str, matchers: str = _POOL) -> str:  # every planner series is labelled with its model
        return _selector(f"dynserve_planner_{metric}", f"{matchers}, {_MODEL}")

    def against_target(kind: str, record_prefix: str) -> list[Query]:
        return [(planner("observed_latency_seconds", f'{_POOL}, kind="{kind}"'), "planner read {{model}} {{pool}}"),
                (_rule(f"{record_prefix}:p90", _ROLE), "p90 {{role}}"),
                (planner("target_latency_seconds", f'kind="{kind}"'), "target {{model}}")]

    def predicted(quantity: str) -> str:
        return planner("predicted", f'quantity="{quantity}"')

    decisions = _sum_rate("dynserve_planner_decisions_total", f"{_POOL}, {_MODEL}", "model, pool, reason")
    return [
        _stat("Workers wanted by pool", "Workers the planner wants in each pool now.", "short",
              [(planner("workers_target"), "{{model}} {{pool}}")], width=6),
        _stat("Workers serving by pool", "Workers serving in each pool now.", "short",
              [(planner("workers_serving"), "{{model}} {{pool}}")], width=6),
        _stat("Overrides in force", "Pools whose worker count an operator fixed by hand, and that count.",
              "short", [(planner("override_workers"), "{{model}} {{pool}}")], width=6).no_value("none"),
        _stat("Requests waiting for a worker", "Requests the gateway holds while the fleet scales up from "
              "zero.", "short", [("sum(dynserve_gateway_waiting_for_worker_requests)", "waiting")], width=6),
        Row("Scaling"),
        _graph("Workers wanted vs serving", "The planner's target per pool, and the workers serving in it.",
               "short", [(planner("workers_target"), "wanted {{model}} {{pool}}"),
                         (planner("workers_serving"), "serving {{model}} {{pool}}")]),
        _graph("Workers needed (fractional)", "Workers the predicted load needs per pool, corrected by the "
               "observed latency (sla mode).", "short", [(planner("workers_needed"), "{{model}} {{pool}}")]),
        _graph("Scale decisions/s by pool and reason", "Changes of a pool's target: sla_up, sla_down (latency "
               "targets), load_up, load_down (queues), idle, wake (a request for a fleet at zero), override, "
               "budget (the fleet's total cap), bound (a pool's min or max).", "ops",
               [(decisions, "{{model}} {{pool}}: {{reason}}")]),
        Row("Load"),
        _graph("Offered vs predicted request rate", "Requests/s admitted by the gateway (the offered load the "
               "planner reads), answered, and the rate the planner predicts for its next interval.", "reqps",
               [(f'sum({_rule("model:dynserve_requests_admitted:rate1m", _MODEL)})', "offered"),
                (_rule("dynserve:requests:rate1m"), "answered"), (predicted("request_rate"), "predicted")],
               width=12),
        _graph("Mean ISL and OSL vs predicted", "Mean prompt and generated lengths of finished requests, and "
               "the lengths the planner predicts.", "suffix: tok",
               [(_mean("dynserve_request_prompt_tokens", _MODEL), "ISL"), (predicted("isl"), "predicted ISL"),
                (_mean("dynserve_request_generation_tokens", _MODEL), "OSL"), (predicted("osl"), "predicted OSL")],
               width=12),
        Row("Latency against the targets"),
        _graph("Time to first token vs target", "Each pool's TTFT as the planner read it, the p90 its "
               "workers measured, and the planner's target.", "s",
               against_target("ttft", "role:dynserve_worker_time_to_first_token_seconds")),
        _graph("Inter-token latency vs target", "Each pool's ITL as the planner read it, the p90 its "
               "workers measured, and the planner's target.", "s",
               against_target("itl", "role:dynserve_worker_inter_token_latency_seconds")),
        _graph("Correction ratio by pool", "Observed over the profile's expected latency, smoothed (sla "
               "mode): above 1 the pool is slower than profiled, so it needs more workers.", "short",
               [(planner("correction_ratio"), "{{model}} {{pool}}")]),
    ]


# ---- assembly --------------------------------------------------------------------------------------------


def _variables() -> list[dashboard_builder.DatasourceVariable | dashboard_builder.QueryVariable]:
    every = dashboard_model.VariableOption(selected=True, text=["All"], value=["$__all"])

    def multi(name: str, label: str, query: str) -> dashboard_builder.QueryVariable:
        return (dashboard_builder.QueryVariable(name).label(label).query(query).datasource(_DATASOURCE)
                .multi(True).include_all(True).all_value(".*").current(every)
                .refresh(dashboard_model.VariableRefresh.ON_TIME_RANGE_CHANGED)
                .sort(dashboard_model.VariableSort.ALPHABETICAL_ASC))

    return [
        dashboard_builder.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        multi("model", "Model", "label_values(dynserve_worker_kv_blocks_capacity, model)"),
        multi("pool", "Pool", 'label_values(dynserve_worker_kv_blocks_capacity{model=~"$model"}, role)'),
        multi("worker", "Worker", 'label_values(dynserve_worker_kv_blocks_capacity{model=~"$model", role=~"$pool"}, '
                                  'worker_id)'),
    ]


def _build(uid: str, title: str, description: str, panels: list[PanelBuilder]) -> dict[str, Any]:
    builder = (dashboard_builder.Dashboard(title).uid(uid).description(description).tags([TAG])
               .refresh(REFRESH).time(TIME_FROM, "now").timezone("browser")
               .tooltip(dashboard_model.DashboardCursorSync.CROSSHAIR).variables(_variables())
               .link(dashboard_builder.DashboardLink("dynserve dashboards")
                     .type(dashboard_model.DashboardLinkType.DASHBOARDS).tags([TAG]).as_dropdown(False)
                     .include_vars(True).keep_time(True)))
    for panel in panels:
        if isinstance(panel, Row):
            builder.with_row(panel)
        else:
            builder.with_panel(panel)
    model = builder.build()
    for panel_id, panel in enumerate(_model_panels(model.panels or []), start=1):
        panel.id_val = panel_id
    return json.loads(json.dumps(model, cls=JSONEncoder))


def _model_panels(panels: list[Any]) -> Iterator[Any]:
    for panel in panels:
        yield panel
        yield from getattr(panel, "panels", None) or []


def overview() -> dict[str, Any]:
    return _build("dynserve-overview", "dynserve / Overview", "What clients see at the gateway: traffic, errors, "
                  "latency, tokens.", _overview_panels())


def router() -> dict[str, Any]:
    return _build("dynserve-router", "dynserve / Router", "How the KV-aware routers place requests: decisions, "
                  "cache affinity, the KV event index.", _router_panels())


def workers() -> dict[str, Any]:
    return _build("dynserve-workers", "dynserve / Workers", "Each worker's queue, KV cache and engine steps, "
                  "its KV tiers, and per-pool latency.", _workers_panels())


def disaggregation() -> dict[str, Any]:
    return _build("dynserve-disaggregation", "dynserve / Disaggregation", "Where prompts are prefilled, "
                  "fallbacks, and the KV transfers between prefill and decode workers.", _disaggregation_panels())


def planner() -> dict[str, Any]:
    return _build(_PLANNER_UID, "dynserve / Planner", "How many workers each pool gets and why: targets, "
                  "decisions, the load the planner predicts and the latency it steers by (`dynctl serve "
                  "--planner`).", _planner_panels())


# file stem (= the dashboard's uid) -> its builder
DASHBOARDS: dict[str, Callable[[], dict[str, Any]]] = {
    "dynserve-overview": overview,
    "dynserve-router": router,
    "dynserve-workers": workers,
    "dynserve-disaggregation": disaggregation,
    _PLANNER_UID: planner,
}


def build_all() -> dict[str, dict[str, Any]]:
    """file stem -> dashboard JSON (as a dict)."""
    return {stem: build() for stem, build in DASHBOARDS.items()}


def render(dashboard: dict[str, Any]) -> str:
    """The text of a dashboard's JSON file."""
    return json.dumps(dashboard, indent=2, ensure_ascii=False) + "\n"


def write_all(directory: Path | str = GRAFANA_DIR) -> list[Path]:
    """Write every dashboard to `directory/<stem>.json`; returns the paths written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, dashboard in build_all().items():
        path = directory / f"{stem}.json"
        path.write_text(render(dashboard))
        written.append(path)
    return written


# ---- reading the dashboards back -------------------------------------------------------------------------


def iter_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel of a dashboard's JSON, rows and the panels nested in collapsed rows included."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", []) if panel.get("type") == "row" else []


def panel_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL expression) of every target of every panel."""
    return [(panel.get("title", ""), target["expr"])
            for panel in iter_panels(dashboard) for target in panel.get("targets") or []]


# what Grafana substitutes for its built-in variables, for the dashboards' default range (30 minutes)
_BUILTIN_VALUES = {"__rate_interval": "1m", "__interval": "15s", "__interval_ms": "15000", "__range": "30m",
                   "__range_s": "1800", "__range_ms": "1800000", "datasource": "prometheus"}
_ALL_VALUES = frozenset({"All", "$__all"})
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


def expand_variables(expr: str, values: dict[str, str] | None = None) -> str:
    """`expr` with its variables replaced as Grafana would, so Prometheus can run it. `values` maps a variable's
    name to its value (a regex for `model`, `pool` and `worker`, whose "All" becomes `.*`); unset variables take "All"
    or Grafana's built-in values. Raises ValueError on a variable no dashboard defines."""
    given = {"model": "All", "pool": "All", "worker": "All", **_BUILTIN_VALUES, **(values or {})}

    def substitute(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in given:
            raise ValueError(f"unknown variable ${name} in {expr!r}")
        value = given[name]
        return ".*" if value in _ALL_VALUES else value

    return _VARIABLE.sub(substitute, expr)


if __name__ == "__main__":
    paths = write_all()
    print(f"wrote {len(paths)} dashboards to {GRAFANA_DIR}", file=sys.stderr)
