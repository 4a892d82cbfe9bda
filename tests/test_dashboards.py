"""The Grafana dashboards: `deploy/grafana/*.json` is what the generator builds now; each dashboard passes the
checks Grafana makes on import (written here as a JSON Schema: the builder's own loader accepts almost
anything); and every query is well formed, names only metrics dynserve exports or recording rules it defines,
and honours the dashboard's `pool` and `worker` variables. That every query of the four dashboards a fleet
without a planner fills has data against a live fleet is checked by the fleet test, with `panel_queries` and
`expand_variables`; only the planner dashboard may read the planner's series.
"""

from __future__ import annotations

import re
from itertools import combinations
from typing import Any

import jsonschema
import pytest

from dynserve.observability.dashboards import (
    DASHBOARDS,
    GRAFANA_DIR,
    build_all,
    expand_variables,
    iter_panels,
    panel_queries,
    render,
)
from dynserve.observability.rules import RULES

BUILT = build_all()
PLANNER_UID = "dynserve-planner"
UIDS = {"dynserve-overview", "dynserve-router", "dynserve-workers", "dynserve-disaggregation", PLANNER_UID}

# ---- the metric catalog (what the gateway, its planner and the workers export) ----------------------------------------------

GATEWAY_COUNTERS = {
    "dynserve_requests_total", "dynserve_generated_tokens_total", "dynserve_cached_prompt_tokens_total",
    "dynserve_rejected_requests_total", "dynserve_gateway_retries_total", "dynserve_disagg_requests_total",
    "dynserve_disagg_fallbacks_total", "dynserve_kv_pulls_total", "dynserve_router_routed_requests_total", "dynserve_router_hot_spot_picks_total",
    "dynserve_router_prompt_blocks_total", "dynserve_router_prompt_hit_blocks_total",
}
GATEWAY_GAUGES = {
    "dynserve_inflight_requests", "dynserve_requests_admitted_total", "dynserve_gateway_worker_up", "dynserve_router_info",
    "dynserve_router_index_blocks", "dynserve_router_index_workers", "dynserve_gateway_waiting_for_worker_requests",
    "dynserve_router_index_tier_blocks",
}
GATEWAY_HISTOGRAMS = {
    "dynserve_time_to_first_token_seconds", "dynserve_inter_token_latency_seconds",
    "dynserve_request_duration_seconds", "dynserve_request_prompt_tokens", "dynserve_request_generation_tokens",
    "dynserve_router_event_lag_seconds", "dynserve_router_decision_seconds", "dynserve_router_overlap_ratio",
}
# on the gateway's /metrics while `dynctl serve --planner` runs; those labelled `pool` follow the variable
PLANNER_POOL_SERIES = {
    "dynserve_planner_workers_target", "dynserve_planner_workers_serving", "dynserve_planner_override_workers",
    "dynserve_planner_workers_needed", "dynserve_planner_correction_ratio",
    "dynserve_planner_observed_latency_seconds", "dynserve_planner_decisions_total",
}
PLANNER_SERIES = PLANNER_POOL_SERIES | {"dynserve_planner_target_latency_seconds", "dynserve_planner_predicted"}
WORKER_COUNTERS = {
    "dynserve_worker_prefix_cache_queried_tokens_total", "dynserve_worker_prefix_cache_hit_tokens_total",
    "dynserve_worker_kv_evictions_total", "dynserve_worker_preemptions_total", "dynserve_worker_generated_tokens_total",
    "dynserve_worker_kv_transfer_bytes_total", "dynserve_worker_kv_transfer_seconds_total",
    "dynserve_worker_kv_transfer_reads_total", "dynserve_worker_kv_transfer_failures_total",
    "dynserve_worker_engine_op_fallbacks_total",
    "dynserve_worker_kv_tier_onboarded_blocks_total", "dynserve_worker_kv_tier_offloaded_blocks_total",
    "dynserve_worker_kv_tier_dropped_blocks_total", "dynserve_worker_kv_onboard_bytes_total",
    "dynserve_worker_kv_onboard_seconds_total", "dynserve_worker_kv_disk_write_bytes_total",
    "dynserve_worker_kv_disk_read_bytes_total", "dynserve_worker_kv_disk_corrupt_files_total",
    "dynserve_worker_kv_pull_bytes_total", "dynserve_worker_kv_pull_seconds_total",
    "dynserve_worker_kv_pull_reads_total", "dynserve_worker_kv_pull_failures_total",
}
WORKER_GAUGES = {
    "dynserve_worker_waiting_requests", "dynserve_worker_running_requests", "dynserve_worker_kv_blocks_used",
    "dynserve_worker_kv_blocks_capacity", "dynserve_worker_kv_tier_blocks", "dynserve_worker_kv_tier_blocks_capacity",
}
WORKER_HISTOGRAMS = {
    "dynserve_worker_step_duration_seconds", "dynserve_worker_step_batch_size", "dynserve_worker_step_prefill_tokens",
    "dynserve_worker_step_decode_tokens", "dynserve_worker_time_to_first_token_seconds",
    "dynserve_worker_inter_token_latency_seconds", "dynserve_worker_grammar_mask_seconds",
}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _series(counters: set[str], gauges: set[str], histograms: set[str]) -> set[str]:
    return counters | gauges | {h + suffix for h in histograms for suffix in HISTOGRAM_SUFFIXES}


GATEWAY_SERIES = _series(GATEWAY_COUNTERS, GATEWAY_GAUGES, GATEWAY_HISTOGRAMS)
# series labelled with a worker: they must follow the `pool` and `worker` variables (and `model`, but for the
# gateway's channel to a worker, which has no model label)
WORKER_SERIES = _series(WORKER_COUNTERS, WORKER_GAUGES, WORKER_HISTOGRAMS) | {"dynserve_gateway_worker_up"}
# gateway series labelled with the model they count: they must follow the `model` variable
GATEWAY_MODEL_SERIES = _series({"dynserve_generated_tokens_total", "dynserve_cached_prompt_tokens_total",
                                "dynserve_requests_admitted_total"}, set(), {
    "dynserve_time_to_first_token_seconds", "dynserve_inter_token_latency_seconds",
    "dynserve_request_duration_seconds", "dynserve_request_prompt_tokens", "dynserve_request_generation_tokens"})
ROUTER_SERIES = {name for name in GATEWAY_SERIES if name.startswith("dynserve_router_")}
RULE_EXPRS = {rule.record: rule.expr for rule in RULES}
KNOWN_NAMES = GATEWAY_SERIES | WORKER_SERIES | PLANNER_SERIES | set(RULE_EXPRS)

# ---- the schema: what Grafana 11 requires of a dashboard it imports ----------------------------------------------

PANEL_TYPES = ["row", "timeseries", "stat", "gauge", "bargauge", "table", "text", "heatmap", "histogram",
               "piechart", "barchart", "state-timeline", "status-history", "logs", "dashlist", "news", "xychart",
               "nodeGraph", "trend", "candlestick", "canvas", "geomap", "flamegraph", "traces", "annolist"]
DATASOURCE_REF = {"type": "object", "required": ["type", "uid"],
                  "properties": {"type": {"const": "prometheus"}, "uid": {"const": "${datasource}"}}}
GRID_POS = {
    "type": "object", "required": ["h", "w", "x", "y"],
    "properties": {"h": {"type": "integer", "minimum": 1}, "w": {"type": "integer", "minimum": 1, "maximum": 24},
                   "x": {"type": "integer", "minimum": 0, "maximum": 23}, "y": {"type": "integer", "minimum": 0}},
    # x + w <= 24, one column at a time (JSON Schema has no arithmetic)
    "allOf": [{"if": {"properties": {"x": {"const": x}}}, "then": {"properties": {"w": {"maximum": 24 - x}}}}
              for x in range(24)],
}
TARGET = {"type": "object", "required": ["refId", "expr", "datasource"],
          "properties": {"refId": {"type": "string", "minLength": 1}, "expr": {"type": "string", "pattern": r"\S"},
                         "datasource": DATASOURCE_REF}}
VARIABLE_OPTIONS = {"datasource": DATASOURCE_REF, "multi": {"const": True}, "includeAll": {"const": True},
                    "allValue": {"const": ".*"}}
DASHBOARD_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["title", "uid", "schemaVersion", "panels", "templating", "tags", "time", "refresh", "links"],
    "properties": {
        "title": {"type": "string", "minLength": 1},
        "uid": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,40}$"},
        "schemaVersion": {"type": "integer", "minimum": 36},
        "tags": {"type": "array", "contains": {"const": "dynserve"}},
        "time": {"type": "object", "properties": {"from": {"const": "now-30m"}, "to": {"const": "now"}}},
        "refresh": {"type": "string", "pattern": "^[0-9]+[smh]$"},
        "links": {"type": "array", "contains": {
            "required": ["type", "tags"],
            "properties": {"type": {"const": "dashboards"}, "tags": {"contains": {"const": "dynserve"}}}}},
        "panels": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/panel"}},
        "templating": {"type": "object", "required": ["list"], "properties": {"list": {"type": "array", "allOf": [
            {"contains": {"required": ["name", "type", "query"], "properties": {
                "name": {"const": "datasource"}, "type": {"const": "datasource"}, "query": {"const": "prometheus"}}}},
            {"contains": {"required": ["name", "type", "query", "datasource", "multi", "includeAll"], "properties": {
                "name": {"const": "model"}, "type": {"const": "query"},
                "query": {"const": "label_values(dynserve_worker_kv_blocks_capacity, model)"}, **VARIABLE_OPTIONS}}},
            {"contains": {"required": ["name", "type", "query", "datasource", "multi", "includeAll"], "properties": {
                "name": {"const": "pool"}, "type": {"const": "query"},
                "query": {"const": 'label_values(dynserve_worker_kv_blocks_capacity{model=~"$model"}, role)'},
                **VARIABLE_OPTIONS}}},
            {"contains": {"required": ["name", "type", "query", "datasource", "multi", "includeAll"], "properties": {
                "name": {"const": "worker"}, "type": {"const": "query"},
                "query": {"const": 'label_values(dynserve_worker_kv_blocks_capacity{model=~"$model", role=~"$pool"}, '
                                   'worker_id)'},
                **VARIABLE_OPTIONS}}},
        ]}}},
    },
    "$defs": {
        "panel": {"type": "object", "required": ["type", "id", "gridPos", "title"], "properties": {
            "type": {"enum": PANEL_TYPES}, "id": {"type": "integer", "minimum": 1}, "gridPos": GRID_POS,
            "title": {"type": "string"}},
            "if": {"properties": {"type": {"const": "row"}}},
            "then": {"$ref": "#/$defs/row"},
            "else": {"if": {"properties": {"type": {"const": "text"}}}, "then": {"$ref": "#/$defs/text"},
                     "else": {"$ref": "#/$defs/queries"}}},
        "row": {"required": ["collapsed", "panels"], "properties": {
            "gridPos": {"properties": {"h": {"const": 1}, "w": {"const": 24}, "x": {"const": 0}}},
            "panels": {"type": "array", "items": {"allOf": [
                {"$ref": "#/$defs/panel"}, {"not": {"properties": {"type": {"const": "row"}}}}]}}},
            # Grafana drops the panels of an expanded row: they follow it at the top level instead
            "if": {"properties": {"collapsed": {"const": False}}},
            "then": {"properties": {"panels": {"maxItems": 0}}}},
        "text": {"required": ["options"], "properties": {"options": {"required": ["mode", "content"]}}},
        "queries": {"required": ["datasource", "targets"], "properties": {
            "title": {"minLength": 1}, "datasource": DATASOURCE_REF,
            "targets": {"type": "array", "minItems": 1, "items": TARGET}}},
    },
}

# ---- reading PromQL ----------------------------------------------------------------------------------------------

FUNCTIONS = {"sum", "avg", "min", "max", "count", "topk", "bottomk", "quantile", "rate", "irate", "increase",
             "histogram_quantile", "clamp_min", "clamp_max", "abs", "label_replace", "absent", "time", "vector"}
KEYWORDS = {"and", "or", "unless", "bool", "offset"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENTIFIER = re.compile(r"(?<![\w.])[A-Za-z_:][\w:]*")
_SELECTOR = re.compile(r"(?<![\w:$])((?:dynserve_|[a-z]+:)[\w:]*)(\{[^{}]*\})?")


def identifiers(expr: str) -> set[str]:
    """The names a PromQL expression calls or selects: strings, label matchers, ranges and groupings removed."""
    stripped = _STRING.sub('""', expr)
    for pattern in (_MATCHERS, _RANGE, _GROUPING):
        stripped = pattern.sub(" ", stripped)
    return set(_IDENTIFIER.findall(stripped))


def metric_names(expr: str) -> set[str]:
    return identifiers(expr) - FUNCTIONS - KEYWORDS


def balanced(expr: str) -> bool:
    closing = {")": "(", "]": "[", "}": "{"}
    stack: list[str] = []
    for char in _STRING.sub('""', expr):
        if char in "([{":
            stack.append(char)
        elif char in closing and (not stack or stack.pop() != closing[char]):
            return False
    return not stack and expr.count('"') % 2 == 0


def all_queries() -> list[tuple[str, str, str]]:
    return [(stem, title, expr) for stem, dashboard in BUILT.items() for title, expr in panel_queries(dashboard)]


QUERY_IDS = [f"{stem}:{title}:{index}" for index, (stem, title, _) in enumerate(all_queries())]

# ---- the tests ---------------------------------------------------------------------------------------------------


def test_the_committed_json_is_the_generators_output() -> None:
    assert set(DASHBOARDS) == UIDS
    assert {path.stem for path in GRAFANA_DIR.glob("*.json")} == UIDS
    for stem, dashboard in BUILT.items():
        assert dashboard["uid"] == stem
        assert (GRAFANA_DIR / f"{stem}.json").read_text() == render(dashboard), (
            f"deploy/grafana/{stem}.json is stale: run `python -m dynserve.observability.dashboards`")


@pytest.mark.parametrize("stem", sorted(UIDS))
def test_each_dashboard_passes_grafanas_schema(stem: str) -> None:
    validator = jsonschema.Draft202012Validator(DASHBOARD_SCHEMA)
    errors = [f"{'/'.join(map(str, error.absolute_path))}: {error.message}"
              for error in validator.iter_errors(BUILT[stem])]
    assert not errors, "\n".join(errors)


def test_the_schema_catches_what_grafana_rejects() -> None:
    validator = jsonschema.Draft202012Validator(DASHBOARD_SCHEMA)
    dashboard = BUILT["dynserve-workers"]
    broken_panel = {**dashboard["panels"][0], "gridPos": {"h": 4, "w": 8, "x": 20, "y": 0}}
    assert not validator.is_valid({**dashboard, "panels": [broken_panel]})
    assert not validator.is_valid({**dashboard, "uid": "x" * 41})
    unbound = {**dashboard["panels"][0], "datasource": {"type": "prometheus", "uid": "prom-1"}}
    assert not validator.is_valid({**dashboard, "panels": [unbound]})


@pytest.mark.parametrize("stem", sorted(UIDS))
def test_panel_ids_are_unique_and_ref_ids_unique_per_panel(stem: str) -> None:
    panels = list(iter_panels(BUILT[stem]))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        ref_ids = [target["refId"] for target in panel.get("targets", [])]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]


def _overlaps(a: dict[str, int], b: dict[str, int]) -> bool:
    apart_x = a["x"] + a["w"] <= b["x"] or b["x"] + b["w"] <= a["x"]
    apart_y = a["y"] + a["h"] <= b["y"] or b["y"] + b["h"] <= a["y"]
    return not (apart_x or apart_y)


@pytest.mark.parametrize("stem", sorted(UIDS))
def test_panels_do_not_overlap(stem: str) -> None:
    top_level = BUILT[stem]["panels"]
    groups = [top_level] + [row["panels"] for row in top_level if row["type"] == "row" and row["panels"]]
    for group in groups:
        for a, b in combinations(group, 2):
            assert not _overlaps(a["gridPos"], b["gridPos"]), (stem, a["title"], b["title"])
    for row in top_level:
        for child in row.get("panels", []):  # a collapsed row's panels open below it
            assert child["gridPos"]["y"] > row["gridPos"]["y"], (stem, row["title"], child["title"])


def test_the_overview_ends_with_a_collapsed_planner_row() -> None:
    last = BUILT["dynserve-overview"]["panels"][-1]
    assert (last["type"], last["title"], last["collapsed"]) == ("row", "Planner", True)


@pytest.mark.parametrize(("stem", "title", "expr"), all_queries(), ids=QUERY_IDS)
def test_each_query_is_well_formed_and_names_known_metrics(stem: str, title: str, expr: str) -> None:
    assert balanced(expr), expr
    unknown = metric_names(expr) - KNOWN_NAMES
    assert not unknown, f"{stem} / {title}: not in the metric catalog nor a recording rule: {sorted(unknown)}"
    assert metric_names(expr), f"{stem} / {title}: selects no metric"
    assert all(window == "[$__rate_interval]" for window in _RANGE.findall(expr)), expr


@pytest.mark.parametrize(("stem", "title", "expr"), all_queries(), ids=QUERY_IDS)
def test_each_query_follows_the_model_pool_and_worker_variables(stem: str, title: str, expr: str) -> None:
    for name, matchers in _SELECTOR.findall(expr):
        if name in WORKER_SERIES or name.startswith("worker:"):
            assert 'role=~"$pool"' in matchers and 'worker_id=~"$worker"' in matchers, (title, name)
            assert ('model=~"$model"' in matchers) == (name != "dynserve_gateway_worker_up"), (title, name)
        if name in GATEWAY_MODEL_SERIES or name in PLANNER_SERIES or name.startswith("model:"):
            assert 'model=~"$model"' in matchers, (title, name)
        elif name.startswith("role:"):
            assert 'role=~"$pool"' in matchers, (title, name)
        elif name in ROUTER_SERIES or name in PLANNER_POOL_SERIES:
            assert 'pool=~"$pool"' in matchers, (title, name)


def test_only_the_planner_dashboard_reads_the_planners_series() -> None:
    # the fleet test requires data from every query of the other four in a fleet without a planner
    for stem, title, expr in all_queries():
        if stem != PLANNER_UID:
            assert not metric_names(expr) & PLANNER_SERIES, (stem, title)


def test_the_overviews_planner_row_links_to_the_planner_dashboard() -> None:
    (panel,) = BUILT["dynserve-overview"]["panels"][-1]["panels"]
    assert panel["type"] == "text"
    assert [link["url"].split("?")[0] for link in panel["links"]] == [f"/d/{PLANNER_UID}"]


def test_every_exported_metric_has_a_panel() -> None:
    used = set()
    for _stem, _title, expr in all_queries():
        for name in metric_names(expr):
            used |= {name} | metric_names(RULE_EXPRS.get(name, ""))
    used |= {"dynserve_worker_kv_blocks_capacity"}  # the variables' source
    bases = {name.removesuffix(suffix) for name in used for suffix in HISTOGRAM_SUFFIXES if name.endswith(suffix)}
    catalog = GATEWAY_COUNTERS | GATEWAY_GAUGES | GATEWAY_HISTOGRAMS | WORKER_COUNTERS | WORKER_GAUGES
    catalog |= WORKER_HISTOGRAMS | PLANNER_SERIES
    assert catalog - used - bases == set()


def test_panel_queries_reaches_panels_inside_collapsed_rows() -> None:
    dashboard = {"panels": [
        {"type": "stat", "title": "top", "targets": [{"expr": "up"}]},
        {"type": "row", "title": "r", "collapsed": True, "panels": [
            {"type": "timeseries", "title": "inner", "targets": [{"expr": "a"}, {"expr": "b"}]}]},
    ]}
    assert panel_queries(dashboard) == [("top", "up"), ("inner", "a"), ("inner", "b")]


def test_expand_variables_makes_queries_prometheus_can_run() -> None:
    expr = 'sum by (worker_id) (rate(x{role=~"$pool", worker_id=~"${worker}", model=~"$model"}[$__rate_interval]))'
    assert expand_variables(expr) == 'sum by (worker_id) (rate(x{role=~".*", worker_id=~".*", model=~".*"}[1m]))'
    assert expand_variables(expr, {"pool": "decode", "worker": "$__all", "model": "qwen3|smol"}) == (
        'sum by (worker_id) (rate(x{role=~"decode", worker_id=~".*", model=~"qwen3|smol"}[1m]))')
    assert expand_variables("increase(x[$__range])") == "increase(x[30m])"
    with pytest.raises(ValueError, match="nope"):
        expand_variables("x{a=~\"$nope\"}")
    for _stem, _title, query in all_queries():
        assert "$" not in expand_variables(query), query
