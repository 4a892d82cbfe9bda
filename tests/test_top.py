"""`dynctl top` as an operator uses it: what a frame shows, how it is read from Prometheus, the CLI's exit
codes and output. Prometheus is a stand-in here (an `http.server` answering `/api/v1/query` with canned
JSON, not a Prometheus): the fleet tests run `dynctl top --once` against a real one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import re
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest
from rich.console import Console

from dynserve.cli.main import main
from dynserve.cli.top import FleetStats, FleetView, PoolView, WorkerView, fetch_view, render, run_live
from dynserve.observability.promql import PrometheusClient
from dynserve.observability.rules import RULES

NAN = math.nan


# ---- a hand-built view ----------------------------------------------------------------------------------

def _view() -> FleetView:
    return FleetView(
        prometheus_url="http://prometheus.test:9090", fetched_at_unix_s=1_700_000_000.0,
        fleet=FleetStats(request_rate_per_s=12.5, error_rate_per_s=0.25, generated_tokens_per_s=840.0,
                         ttft_p50_s=0.120, ttft_p99_s=0.95, itl_p50_s=0.021, itl_p99_s=NAN),
        pools=(
            PoolView(role="decode", num_workers=1, num_workers_down=1, num_waiting=3, kv_usage_ratio=0.5,
                     ttft_p50_s=0.0345, ttft_p90_s=0.080, ttft_p99_s=0.250, itl_p50_s=0.0123, itl_p90_s=0.020,
                     itl_p99_s=0.031),
            # a prefill pool decodes nothing: no inter-token latencies
            PoolView(role="prefill", num_workers=1, num_workers_down=0, num_waiting=0, kv_usage_ratio=0.125,
                     ttft_p50_s=0.2104, ttft_p90_s=0.400, ttft_p99_s=0.800),
        ),
        workers=(
            WorkerView(worker_id="decode-2", role="decode", model="SmolLM2-135M", instance="10.0.0.2:9102",
                       health="up", num_waiting=3, num_running=5, kv_usage_ratio=0.5,
                       generated_tokens_per_s=420.0, step_mean_s=0.0152),
            WorkerView(worker_id="decode-10", role="decode", model="SmolLM2-135M", instance="10.0.0.3:9103",
                       health="down"),
            WorkerView(worker_id="prefill-1", role="prefill", model="SmolLM2-135M", instance="10.0.0.1:9101",
                       health="up", num_waiting=0, num_running=2, kv_usage_ratio=0.125,
                       generated_tokens_per_s=2.0, step_mean_s=0.1),
        ),
    )


def _text(renderable: object, width: int = 200) -> str:
    console = Console(record=True, width=width, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def _row(text: str, first_cell: str) -> list[str]:
    """The cells of the table row that starts with `first_cell`."""
    for line in text.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃]", line)[1:-1]]
        if cells and cells[0] == first_cell:
            return cells
    raise AssertionError(f"no row for {first_cell!r} in:\n{text}")


def test_a_frame_shows_every_worker_with_its_pool_health_and_kv() -> None:
    text = _text(render(_view()))
    up = _row(text, "decode-2")
    assert up[:3] == ["decode-2", "decode", "up"]
    assert "50.0%" in up and "15.2" in up  # KV as percent, step time in ms
    down = _row(text, "decode-10")
    assert down[:3] == ["decode-10", "decode", "down"]
    assert down[3:8] == ["-"] * 5  # a down worker's stale series: no numbers
    assert _row(text, "prefill-1")[:3] == ["prefill-1", "prefill", "up"]


def test_a_frame_shows_each_pools_latencies_in_ms_and_dashes_where_there_are_none() -> None:
    text = _text(render(_view()))
    decode = _row(text, "decode")
    assert decode[1:5] == ["1", "1", "3", "50.0%"]  # one reporting, one down, 3 waiting
    assert decode[5:] == ["34.5", "80.0", "250", "12.3", "20.0", "31.0"]
    prefill = _row(text, "prefill")
    assert prefill[5:8] == ["210", "400", "800"] and prefill[8:] == ["-", "-", "-"]
    gateway = _row(text, "12.5")  # the gateway's row starts with its request rate
    assert gateway == ["12.5", "0.25", "2.0%", "840", "120", "950", "21.0", "-"]


def test_workers_are_ordered_by_pool_then_id_as_numbers() -> None:
    text = _text(render(_view()))
    assert text.index("decode-2 ") < text.index("decode-10 ") < text.index("prefill-1 ")


def test_an_empty_fleet_says_so() -> None:
    empty = FleetView(prometheus_url="http://p:9090", fetched_at_unix_s=0.0, fleet=FleetStats(), pools=(),
                      workers=())
    text = _text(render(empty))
    assert "no workers reporting" in text and "no pools reporting" in text


# ---- a stand-in Prometheus --------------------------------------------------------------------------------

Series = list[tuple[dict[str, str], float]]


@dataclass
class StandInPrometheus:
    """Answers `/api/v1/query` from `answers` (expression -> series as (labels, value)); any other query gets
    an empty vector. `queries` records what was asked."""

    answers: dict[str, Series]
    queries: list[str] = field(default_factory=list)
    url: str = ""


@contextlib.contextmanager
def _stand_in_prometheus(answers: dict[str, Series]) -> Iterator[StandInPrometheus]:
    stand_in = StandInPrometheus(answers)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urlparse(self.path)
            if url.path != "/api/v1/query":
                self.send_error(404)
                return
            expr = parse_qs(url.query)["query"][0]
            stand_in.queries.append(expr)
            result = [{"metric": labels, "value": [1_700_000_000.0, repr(value) if math.isfinite(value)
                                                   else {math.inf: "+Inf"}.get(value, "NaN")]}
                      for labels, value in stand_in.answers.get(expr, [])]
            body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *_args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    stand_in.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield stand_in
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _worker(worker_id: str, role: str, **extra: str) -> dict[str, str]:
    return {"worker_id": worker_id, "role": role, "model": "SmolLM2-135M", **extra}


def _per_role(**value_by_role: float) -> Series:
    return [({"role": role}, value) for role, value in value_by_role.items()]


def _fleet_answers() -> dict[str, Series]:
    """Three workers: prefill-1 and decode-2 up, decode-10 whose target just went down (its series are stale,
    only the range query still names it), and a down target that never served worker metrics."""
    p1, d2, d10 = (_worker("prefill-1", "prefill"), _worker("decode-2", "decode"),
                   _worker("decode-10", "decode"))
    scraped = {"job": "dynserve-workers", "component": "worker"}
    p1_raw = {**p1, **scraped, "instance": "127.0.0.1:9101"}
    d2_raw = {**d2, **scraped, "instance": "127.0.0.1:9102"}
    return {
        "dynserve_worker_waiting_requests": [(p1_raw, 1), (d2_raw, 4)],
        "dynserve_worker_running_requests": [(p1_raw, 2), (d2_raw, 6)],
        "worker:dynserve_worker_kv_usage:ratio": [(p1, 0.25), (d2, 0.75)],
        "worker:dynserve_worker_generated_tokens:rate1m": [(p1, 1.5), (d2, 300.0)],
        "worker:dynserve_worker_step_duration_seconds:mean1m": [(p1, 0.2), (d2, NAN)],
        'up{component="worker"}': [({"instance": f"127.0.0.1:{port}", "component": "worker"}, value)
                                   for port, value in ((9101, 1), (9102, 1), (9103, 0), (9104, 0))],
        "last_over_time(dynserve_worker_kv_blocks_capacity[10m])": [
            ({**p1, "instance": "127.0.0.1:9101"}, 512), ({**d2, "instance": "127.0.0.1:9102"}, 512),
            ({**d10, "instance": "127.0.0.1:9103"}, 512),
            # a worker scaled away whose target is gone: no longer part of the view
            ({**_worker("decode-7", "decode"), "instance": "127.0.0.1:9107"}, 512),
        ],
        "role:dynserve_workers:count": _per_role(prefill=1, decode=1),  # the down worker reports nothing
        "role:dynserve_worker_kv_usage:ratio": _per_role(prefill=0.25, decode=0.75),
        "role:dynserve_worker_waiting_requests:sum": _per_role(prefill=1, decode=4),
        "role:dynserve_worker_time_to_first_token_seconds:p50": _per_role(prefill=0.2, decode=0.03),
        "role:dynserve_worker_time_to_first_token_seconds:p99": _per_role(prefill=0.9, decode=0.1),
        "role:dynserve_worker_inter_token_latency_seconds:p50": _per_role(prefill=NAN, decode=0.015),
        "dynserve:requests:rate1m": [({}, 10.0)],
        "dynserve:request_errors:rate1m": [({}, 0.5)],
        "dynserve:time_to_first_token_seconds:p50": [({}, 0.25)],
        "dynserve:inter_token_latency_seconds:p99": [({}, math.inf)],
        "dynserve:generated_tokens:rate1m": [({}, 300.0)],
        # decode-2 has KV tiers
        **{f'dynserve_worker_kv_tier_blocks{{medium="{medium}"}}': [({**d2_raw, "medium": medium}, value)]
           for medium, value in (("device", 64), ("host", 16), ("disk", 256))},
        'sum by (worker_id, role, model) (dynserve_worker_kv_tier_blocks_capacity{medium!="device"})': [
            (d2, 4096)],
    }


def test_fetch_view_builds_workers_with_their_health_from_the_targets() -> None:
    with _stand_in_prometheus(_fleet_answers()) as prometheus, PrometheusClient(prometheus.url) as client:
        view = fetch_view(client)
    assert [(w.worker_id, w.role, w.health) for w in view.workers] == [
        ("decode-2", "decode", "up"), ("decode-10", "decode", "down"), ("prefill-1", "prefill", "up"),
        (None, "", "down"),  # a target that never served worker metrics, named by its address
    ]
    decode_2, decode_10, prefill_1, unknown_target = view.workers
    assert (decode_2.num_waiting, decode_2.num_running, decode_2.kv_usage_ratio) == (4, 6, 0.75)
    assert decode_2.generated_tokens_per_s == 300.0 and math.isnan(decode_2.step_mean_s)
    assert (decode_2.kv_device_blocks, decode_2.kv_host_blocks, decode_2.kv_disk_blocks) == (64, 16, 256)
    assert decode_2.has_lower_tiers and not prefill_1.has_lower_tiers
    assert decode_2.instance == "127.0.0.1:9102" and decode_2.model == "SmolLM2-135M"
    assert decode_10.instance == "127.0.0.1:9103" and math.isnan(decode_10.kv_usage_ratio)
    assert prefill_1.step_mean_s == 0.2
    assert unknown_target.instance == "127.0.0.1:9104"


def test_fetch_view_builds_pools_and_the_gateways_totals() -> None:
    with _stand_in_prometheus(_fleet_answers()) as prometheus, PrometheusClient(prometheus.url) as client:
        view = fetch_view(client)
    decode, prefill = view.pools
    assert (decode.role, decode.num_workers, decode.num_workers_down) == ("decode", 1, 1)
    assert decode.num_waiting == 4
    assert (decode.ttft_p50_s, decode.itl_p50_s, decode.kv_usage_ratio) == (0.03, 0.015, 0.75)
    assert math.isnan(decode.ttft_p90_s)  # no series for it: NaN, not an error
    assert (prefill.num_workers, prefill.num_workers_down, prefill.ttft_p99_s) == (1, 0, 0.9)
    assert math.isnan(prefill.itl_p50_s)
    fleet = view.fleet
    assert (fleet.request_rate_per_s, fleet.error_rate_per_s, fleet.error_ratio) == (10, 0.5, 0.05)
    assert fleet.itl_p99_s == math.inf and math.isnan(fleet.itl_p50_s)


def test_every_recorded_series_top_reads_is_one_the_rules_record() -> None:
    with _stand_in_prometheus(_fleet_answers()) as prometheus, PrometheusClient(prometheus.url) as client:
        fetch_view(client)
    read = {name for expr in prometheus.queries for name in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr)
            if ":" in name}
    assert len(read) >= 15  # the rules, not only raw series
    assert read - {rule.record for rule in RULES} == set()


# ---- the command ----------------------------------------------------------------------------------------

def test_top_once_json_prints_the_view(capsys: pytest.CaptureFixture[str]) -> None:
    with _stand_in_prometheus(_fleet_answers()) as prometheus:
        code = main(["top", "--prometheus-url", prometheus.url, "--once", "--output", "json"])
    out = capsys.readouterr().out
    assert code == 0
    view = json.loads(out)
    assert view["prometheus_url"] == prometheus.url
    assert {w["worker_id"]: w["health"] for w in view["workers"]} == {
        "decode-2": "up", "decode-10": "down", "prefill-1": "up", None: "down"}
    assert view["workers"][1]["kv_usage_ratio"] is None  # NaN is null in JSON
    assert view["fleet"]["itl_p99_s"] is None and view["fleet"]["error_ratio"] == 0.05
    assert [p["role"] for p in view["pools"]] == ["decode", "prefill"]


def test_top_once_text_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    with _stand_in_prometheus(_fleet_answers()) as prometheus:
        code = main(["top", "--prometheus-url", prometheus.url, "--once"])
    out = capsys.readouterr().out
    assert code == 0
    for worker_id in ("decode-2", "decode-10", "prefill-1"):
        assert worker_id in out


def test_top_reads_the_url_from_dyn_prometheus_url(capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    with _stand_in_prometheus(_fleet_answers()) as prometheus:
        monkeypatch.setenv("DYN_PROMETHEUS_URL", prometheus.url)
        code = main(["top", "--once", "--output", "json"])
    assert code == 0 and json.loads(capsys.readouterr().out)["prometheus_url"] == prometheus.url


def _unreachable_url() -> str:
    with socket.socket() as sock:  # a port nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_top_once_without_prometheus_exits_1_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    url = _unreachable_url()
    code = main(["top", "--prometheus-url", url, "--once"])
    captured = capsys.readouterr()
    assert code == 1 and captured.out == ""
    assert captured.err.count("\n") == 1 and f"cannot reach Prometheus at {url}" in captured.err


def test_a_non_positive_interval_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["top", "--interval", "0", "--once"]) == 2
    assert "--interval" in capsys.readouterr().err


class _StopAfter:
    """`sleep` for the live loop: counts the frames and presses Ctrl-C after `num_frames` of them."""

    def __init__(self, num_frames: int) -> None:
        self.num_frames, self.num_sleeps = num_frames, 0

    def __call__(self, _seconds: float) -> None:
        self.num_sleeps += 1
        if self.num_sleeps >= self.num_frames:
            raise KeyboardInterrupt


def test_live_mode_draws_frames_until_ctrl_c_and_exits_0() -> None:
    console = Console(record=True, width=200, file=io.StringIO())
    stop = _StopAfter(2)
    with _stand_in_prometheus(_fleet_answers()) as prometheus, PrometheusClient(prometheus.url) as client:
        code = run_live(client, interval_s=0.01, output="text", console=console, sleep=stop)
    assert code == 0 and stop.num_sleeps == 2
    assert prometheus.queries.count("dynserve:requests:rate1m") == 2  # one fetch per frame
    assert "decode-10" in console.export_text()


def test_live_mode_shows_prometheus_failing_and_keeps_asking() -> None:
    console = Console(record=True, width=200, file=io.StringIO())
    stop = _StopAfter(3)
    url = _unreachable_url()
    with PrometheusClient(url) as client:
        code = run_live(client, interval_s=0.01, output="text", console=console, sleep=stop)
    assert code == 0 and stop.num_sleeps == 3
    assert f"cannot reach Prometheus at {url}" in " ".join(console.export_text().split())


def test_live_json_prints_one_view_per_frame() -> None:
    out = io.StringIO()
    with _stand_in_prometheus(_fleet_answers()) as prometheus, PrometheusClient(prometheus.url) as client:
        code = run_live(client, interval_s=0.01, output="json", console=Console(file=out),
                        sleep=_StopAfter(2))
    lines = out.getvalue().splitlines()
    assert code == 0 and len(lines) == 2
    assert all(json.loads(line)["fleet"]["request_rate_per_s"] == 10.0 for line in lines)


# ---- KV tiers --------------------------------------------------------------------------------------------


def test_a_column_shows_each_workers_kv_blocks_per_tier_when_any_worker_has_tiers() -> None:
    view = _view()
    tiered = dataclasses.replace(view.workers[0], kv_device_blocks=120, kv_host_blocks=40, kv_disk_blocks=300,
                                 kv_lower_capacity_blocks=2048)
    untiered = dataclasses.replace(view.workers[2], kv_device_blocks=7, kv_host_blocks=0, kv_disk_blocks=0,
                                   kv_lower_capacity_blocks=0)
    text = _text(render(dataclasses.replace(view, workers=(tiered, view.workers[1], untiered))))
    assert "dev/host/disk" in text
    assert _row(text, "decode-2")[3:7] == ["3", "5", "50.0%", "120/40/300"]
    assert _row(text, "decode-10")[6] == "-/-/-"  # a down worker: no numbers
    assert _row(text, "prefill-1")[6] == "7/0/0"
    assert "dev/host/disk" not in _text(render(view))  # no worker with tiers: no column

