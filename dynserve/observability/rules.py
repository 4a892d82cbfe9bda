"""The Prometheus recording rules of a dynserve fleet, as data: the quantities a planner, `dynctl top`, the
dashboards and an operator read, computed once by Prometheus instead of by every reader.

`deploy/prometheus/dynserve-rules.yml` is this module's output (`python -m dynserve.observability.rules`
writes it; a test fails when the two differ), and `dynctl serve --prometheus` loads the same rules.

Names follow Prometheus's `level:metric:operations` convention. A pool is the workers of one role
(`role` label: `both`, `prefill`, `decode`), so per-pool rules aggregate `by (role)` and per-worker rules
keep `worker_id`, `role`, `model`. Rates and quantiles are over `WINDOW` (1m): at least two scrapes at the
15 s interval a production Prometheus uses. Request-level latencies are the gateway's (what clients see);
per-pool TTFT and ITL are the workers' own (from a request's arrival at the worker to its first token, and
between the steps that decode it), so a planner can tell which pool is slow.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["GROUP_NAME", "QUANTILES", "RULES", "RULES_FILE", "WINDOW", "Rule", "render_rules"]

WINDOW = "1m"
QUANTILES = (0.5, 0.9, 0.99)
GROUP_NAME = "dynserve"
RULES_FILE = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "dynserve-rules.yml"


@dataclass(frozen=True, slots=True)
class Rule:
    record: str
    expr: str


def _quantile_rules(record_prefix: str, metric: str, by: str) -> list[Rule]:
    keep = f"le, {by}" if by else "le"
    return [Rule(f"{record_prefix}:p{round(q * 100)}",
                 f"histogram_quantile({q}, sum by ({keep}) (rate({metric}_bucket[{WINDOW}])))")
            for q in QUANTILES]


# vLLM workers' own series as dynserve's worker series, so the dashboards, `dynctl top` and the planner read
# them as they read a dynserve worker's. The gateway's scrape targets label a vLLM worker with its `worker_id`,
# `role` and `model` (vLLM's series have none of them), which is what selects them here. vLLM reports KV
# usage as a fraction of its cache, so a vLLM worker counts a capacity of one "block": ratios are exact,
# block counts are not. Their rules come first in the group: the rules after them read what they record.
_VLLM_AS_OURS = (
    ("dynserve_worker_running_requests", "vllm:num_requests_running"),
    ("dynserve_worker_waiting_requests", "vllm:num_requests_waiting"),
    ("dynserve_worker_kv_blocks_used", "vllm:kv_cache_usage_perc"),
    ("dynserve_worker_generated_tokens_total", "vllm:generation_tokens_total"),
    ("dynserve_worker_step_prefill_tokens_sum", "vllm:prompt_tokens_total"),
    ("dynserve_worker_prefix_cache_hit_tokens_total", "vllm:prefix_cache_hits_total"),
    ("dynserve_worker_prefix_cache_queried_tokens_total", "vllm:prefix_cache_queries_total"),
)
_VLLM_HISTOGRAMS_AS_OURS = (
    ("dynserve_worker_time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_bucket"),
    ("dynserve_worker_inter_token_latency_seconds_bucket", "vllm:inter_token_latency_seconds_bucket"),
)


def _vllm_rules(worker: str) -> list[Rule]:
    selected = '{worker_id!=""}'
    rules = [Rule(ours, f"sum by ({worker}) ({theirs}{selected})") for ours, theirs in _VLLM_AS_OURS]
    rules.append(Rule("dynserve_worker_kv_blocks_capacity",
                      f"count by ({worker}) (vllm:kv_cache_usage_perc{selected})"))
    rules += [Rule(ours, f"sum by (le, {worker}) ({theirs}{selected})") for ours, theirs in _VLLM_HISTOGRAMS_AS_OURS]
    return rules


def _rules() -> list[Rule]:
    w = WINDOW
    worker = "worker_id, role, model"
    rules = [
        *_vllm_rules(worker),
        # ---- requests, at the gateway --------------------------------------------------------------------
        Rule("dynserve:requests:rate1m", f"sum(rate(dynserve_requests_total[{w}]))"),
        Rule("dynserve:requests_admitted:rate1m", f"sum(rate(dynserve_requests_admitted_total[{w}]))"),
        # 0 while requests succeed (a sum over no error series would be no value at all), none without requests
        Rule("dynserve:request_errors:rate1m", f'sum(rate(dynserve_requests_total{{status!~"2.."}}[{w}])) '
             f"or 0 * sum(rate(dynserve_requests_total[{w}]))"),
        Rule("dynserve:prompt_tokens:mean1m",
             f"sum(rate(dynserve_request_prompt_tokens_sum[{w}])) / sum(rate(dynserve_request_prompt_tokens_count[{w}]))"),
        Rule("dynserve:generation_tokens:mean1m",
             f"sum(rate(dynserve_request_generation_tokens_sum[{w}])) "
             f"/ sum(rate(dynserve_request_generation_tokens_count[{w}]))"),
        Rule("dynserve:generated_tokens:rate1m", f"sum(rate(dynserve_generated_tokens_total[{w}]))"),
        *_quantile_rules("dynserve:time_to_first_token_seconds", "dynserve_time_to_first_token_seconds", ""),
        *_quantile_rules("dynserve:inter_token_latency_seconds", "dynserve_inter_token_latency_seconds", ""),
        # ---- per model, at the gateway (one that serves several) ---------------------------------------------
        Rule("model:dynserve_requests_admitted:rate1m",
             f"sum by (model) (rate(dynserve_requests_admitted_total[{w}]))"),
        Rule("model:dynserve_generated_tokens:rate1m", f"sum by (model) (rate(dynserve_generated_tokens_total[{w}]))"),
        *_quantile_rules("model:dynserve_time_to_first_token_seconds", "dynserve_time_to_first_token_seconds",
                         "model"),
        *_quantile_rules("model:dynserve_inter_token_latency_seconds", "dynserve_inter_token_latency_seconds",
                         "model"),
        # ---- per pool, from the workers ------------------------------------------------------------------
        Rule("role:dynserve_workers:count", "count by (role) (dynserve_worker_kv_blocks_capacity)"),
        *_quantile_rules("role:dynserve_worker_time_to_first_token_seconds",
                         "dynserve_worker_time_to_first_token_seconds", "role"),
        *_quantile_rules("role:dynserve_worker_inter_token_latency_seconds",
                         "dynserve_worker_inter_token_latency_seconds", "role"),
        Rule("role:dynserve_worker_kv_usage:ratio",
             "sum by (role) (dynserve_worker_kv_blocks_used) / sum by (role) (dynserve_worker_kv_blocks_capacity)"),
        Rule("role:dynserve_worker_waiting_requests:sum", "sum by (role) (dynserve_worker_waiting_requests)"),
        Rule("role:dynserve_worker_running_requests:sum", "sum by (role) (dynserve_worker_running_requests)"),
        Rule("role:dynserve_worker_prefill_tokens:rate1m",
             f"sum by (role) (rate(dynserve_worker_step_prefill_tokens_sum[{w}]))"),
        Rule("role:dynserve_worker_generated_tokens:rate1m",
             f"sum by (role) (rate(dynserve_worker_generated_tokens_total[{w}]))"),
        # ---- per worker ----------------------------------------------------------------------------------
        Rule("worker:dynserve_worker_kv_usage:ratio",
             f"sum by ({worker}) (dynserve_worker_kv_blocks_used) "
             f"/ sum by ({worker}) (dynserve_worker_kv_blocks_capacity)"),
        Rule("worker:dynserve_worker_queue_depth:sum",
             f"sum by ({worker}) (dynserve_worker_waiting_requests)"),
        Rule("worker:dynserve_worker_generated_tokens:rate1m",
             f"sum by ({worker}) (rate(dynserve_worker_generated_tokens_total[{w}]))"),
        Rule("worker:dynserve_worker_step_duration_seconds:mean1m",
             f"sum by ({worker}) (rate(dynserve_worker_step_duration_seconds_sum[{w}])) "
             f"/ sum by ({worker}) (rate(dynserve_worker_step_duration_seconds_count[{w}]))"),
        Rule("worker:dynserve_worker_prefix_cache_hit:ratio1m",
             f"sum by ({worker}) (rate(dynserve_worker_prefix_cache_hit_tokens_total[{w}])) "
             f"/ sum by ({worker}) (rate(dynserve_worker_prefix_cache_queried_tokens_total[{w}]))"),
    ]
    return rules


RULES: tuple[Rule, ...] = tuple(_rules())


def render_rules() -> str:
    """The rules file's text (Prometheus's rule-file YAML; written by hand: it is two levels deep)."""
    lines = [
        "# Generated by `python -m dynserve.observability.rules` from dynserve/observability/rules.py: edit that.",
        "groups:",
        f"  - name: {GROUP_NAME}",
        "    rules:",
    ]
    for rule in RULES:
        lines.append(f"      - record: {rule.record}")
        lines.append(f"        expr: {_yaml_string(rule.expr)}")
    return "\n".join(lines) + "\n"


def _yaml_string(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


if __name__ == "__main__":
    RULES_FILE.parent.mkdir(parents=True, exist_ok=True)
    RULES_FILE.write_text(render_rules())
    print(f"wrote {len(RULES)} rules to {RULES_FILE}", file=sys.stderr)
