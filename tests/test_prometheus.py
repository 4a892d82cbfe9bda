"""The Prometheus side's files, checked by Prometheus's own tool: the recording rules in
`deploy/prometheus/` (what `rules.py` generates, `promtool check rules` clean), and the configuration `dynctl serve --prometheus` writes
(`promtool check config`). A real Prometheus runs on a real fleet in tests/test_observability.py."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from dynserve.observability.prometheus import RULES_NAME, scrape_config
from dynserve.observability.rules import RULES, RULES_FILE, render_rules


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", "check", *args], capture_output=True, text=True, timeout=60, check=False)


def test_the_rules_file_is_what_the_rules_module_generates() -> None:
    assert RULES_FILE.read_text() == render_rules(), "run: python -m dynserve.observability.rules"


def test_promtool_finds_the_rules_file_clean() -> None:
    checked = _promtool("rules", str(RULES_FILE))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(RULES)} rules found" in checked.stdout


def test_rules_cover_what_a_planner_and_an_operator_read() -> None:
    records = {rule.record for rule in RULES}
    for quantile in ("p50", "p90", "p99"):
        assert f"role:dynserve_worker_time_to_first_token_seconds:{quantile}" in records
        assert f"role:dynserve_worker_inter_token_latency_seconds:{quantile}" in records
        assert f"dynserve:time_to_first_token_seconds:{quantile}" in records
    assert {"dynserve:requests:rate1m", "dynserve:prompt_tokens:mean1m", "dynserve:generation_tokens:mean1m",
            "worker:dynserve_worker_kv_usage:ratio", "role:dynserve_worker_kv_usage:ratio",
            "worker:dynserve_worker_queue_depth:sum", "role:dynserve_worker_waiting_requests:sum"} <= records
    assert len(records) == len(RULES)


@pytest.mark.parametrize("interval_s", [1.0, 5.0, 15.0, 0.5])
def test_promtool_accepts_the_configuration_dynctl_serve_writes(tmp_path: Path, interval_s: float) -> None:
    (tmp_path / RULES_NAME).write_text(render_rules())
    config = tmp_path / "prometheus.yml"
    config.write_text(scrape_config("http://127.0.0.1:8000/metrics/targets", scrape_interval_s=interval_s))
    checked = _promtool("config", str(config))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    text = config.read_text()
    assert "http_sd_configs" in text and "http://127.0.0.1:8000/metrics/targets" in text
    assert re.search(r"refresh_interval: (\d+)s", text)  # never under Prometheus's 1 s minimum
