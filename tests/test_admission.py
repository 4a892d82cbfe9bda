"""Admission that keeps the TTFT of admitted requests at a target: the pure limit (`gateway/admission.py`),
and a gateway over a mocker refusing the excess with 429 and Retry-After while serving what it admits."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from dynserve.gateway.admission import Admission

MODEL = "SmolLM2-135M-Instruct"


class _Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_the_limit_bounds_the_requests_waiting_for_a_first_token() -> None:
    admission = Admission(0.5, initial_limit=3, clock=_Clock())
    assert [admission.try_admit() for _ in range(4)] == [True, True, True, False]
    admission.first_token(0.1)
    assert admission.try_admit() and not admission.try_admit()
    admission.abandon()
    assert admission.num_waiting == 2
    admission.check_integrity()


def test_slow_first_tokens_shrink_the_limit_and_fast_ones_under_pressure_grow_it() -> None:
    clock = _Clock()
    admission = Admission(0.5, initial_limit=20, min_limit=2, clock=clock)
    for _ in range(30):  # every window's p90 is over the target: multiplicative decrease to the floor
        clock.now_s += 1.0
        assert admission.try_admit()
        admission.first_token(2.0)
    assert admission.limit == 2
    for _ in range(10):  # fast first tokens while the limit refuses: additive increase
        clock.now_s += 1.0
        while admission.try_admit():
            pass
        for _ in range(admission.num_waiting):
            admission.first_token(0.1)
    assert admission.limit > 10
    admission.check_integrity()
    # windows without pressure leave the limit where it is (the first one closes the last pressured window)
    clock.now_s += 1.0
    admission.try_admit()
    admission.first_token(0.1)
    before = admission.limit
    for _ in range(3):
        clock.now_s += 1.0
        admission.try_admit()
        admission.first_token(0.1)
    assert admission.limit == before


def test_a_bad_configuration_is_refused() -> None:
    with pytest.raises(ValueError):
        Admission(0.5, initial_limit=0.5, min_limit=1, clock=_Clock())


def test_an_overloaded_gateway_refuses_the_excess_with_retry_after_and_serves_the_rest(
        make_mocker: Any, make_gateway: Any) -> None:
    _handle, info = make_mocker("adm-0", mocker_speedup=1, namespace="admission")
    server = make_gateway(infos=[info], namespace="admission", admission_ttft_ms=300)

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            body = {"model": MODEL, "prompt": "word " * 200, "max_tokens": 4}
            return list(await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(60))))

    responses = asyncio.run(burst())
    refused = [r for r in responses if r.status_code == 429]
    served = [r for r in responses if r.status_code == 200]
    assert len(served) + len(refused) == len(responses), {r.status_code for r in responses}
    assert served and refused
    assert all(r.headers.get("retry-after") == "1" for r in refused)
    assert refused[0].json()["error"]["code"] == "rate_limit_exceeded"
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert f'dynserve_rejected_requests_total{{reason="overloaded"}} {float(len(refused))}' in metrics
    # and once the burst is over it serves again
    again = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                       timeout=60)
    assert again.status_code == 200
