"""`benchmarks.kv_transfer --hosts`: KV transfer and disaggregated TTFT across hosts, on the multi-host
harness (`benchmarks/_hosts.py`: network namespaces on 198.18.0.0/24, UCX held to tcp over each host's eth1).

Two ratios, each against a baseline measured in the same run:
- KV read bandwidth from host b to host c: NIXL (UCX over tcp) against the TCP backend, 16 and 64 MiB of
  contiguous blocks (the driver runs on host a: `kv_transfer --hosts-driver`, the same code as the one-host
  run with the two actors placed by their hosts' resources);
- a remotely prefilled request (real model, NIXL): prefill worker on host b and decode worker on host c,
  against both workers on host b. TTFT (the first token comes from the prefill worker, before any page moves)
  and the time to the second token (after the decode worker has read the prompt's pages), per request, the
  same prompts in both layouts.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks._common import log
from benchmarks._hosts import Host, Hosts, RayCluster, dynctl_serve

__all__ = ["across_hosts"]

_REPO = Path(__file__).resolve().parent.parent
MODEL = "SmolLM2-135M-Instruct"


def _bandwidth(quick: bool) -> dict[str, Any]:
    with Hosts(3) as hosts, RayCluster(hosts, nodes={1: 1, 2: 1}) as cluster:
        cluster.wait_for_nodes(3)
        argv = [sys.executable, "-m", "benchmarks.kv_transfer", "--hosts-driver", cluster.address,
                *(["--quick"] if quick else [])]
        env = {**cluster.env, "PYTHONPATH": str(_REPO), "RAY_ADDRESS": cluster.address}
        done = hosts[0].run(argv, env=env, timeout_s=600)
    figures: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    for size in ("16mib", "64mib"):
        figures[f"nixl_vs_tcp_{size}"] = round(figures[f"nixl_gbps_{size}"] / figures[f"fallback_gbps_{size}"], 3)
    return figures


def _prompts(count: int, num_words: int) -> list[str]:
    return [" ".join(f"request{r} item{i}" for i in range(num_words)) for r in range(count)]


def _time_requests(url: str, prompts: list[str]) -> list[tuple[float, float]]:
    """(TTFT, time to the second token) in seconds, per prompt, one at a time, streamed. Runs on host a."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    client.completions.create(model=MODEL, prompt="warm up", max_tokens=2)
    timings = []
    for prompt in prompts:
        start = time.perf_counter()
        stamps = []
        for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                               stream=True):
            if chunk.choices and chunk.choices[0].text:
                stamps.append(time.perf_counter() - start)
        if len(stamps) < 2:
            raise RuntimeError(f"a request streamed {len(stamps)} token pieces, not 2 or more")
        timings.append((stamps[0], stamps[1]))
    return timings


def _disaggregated(nodes: dict[int, float], prompts: list[str]) -> list[tuple[float, float]]:
    flags = ["--prefill-workers", "1", "--decode-workers", "1", "--kv-blocks", "512", "--transfer-backend", "nixl",
             "--disagg-local-prefill-tokens", "0", "--dtype", "float32", "--worker-num-cpus", "1"]
    with Hosts(3) as hosts, RayCluster(hosts, nodes=nodes) as cluster:
        cluster.wait_for_nodes(1 + len(nodes))
        a: Host = hosts[0]
        with dynctl_serve(cluster, a, *flags) as url:
            timings = a.call(lambda: _time_requests(url, prompts))
            metrics = a.call(lambda: httpx.get(f"{url}/metrics", timeout=10).text)
    if 'dynserve_disagg_fallbacks_total{reason="transfer_error"} 0.0' not in metrics:
        raise RuntimeError("a KV transfer fell back to a local prefill")
    return timings


def across_hosts(quick: bool) -> dict[str, Any]:
    """Every figure of the hosts mode, ratios included."""
    result: dict[str, Any] = {"hosts": True, "ucx_tls": "tcp,self", "ucx_net_devices": "eth1"}
    log("KV read bandwidth, host b -> host c")
    result["bandwidth"] = _bandwidth(quick)
    result["nixl_vs_tcp_16mib"] = result["bandwidth"]["nixl_vs_tcp_16mib"]
    result["nixl_vs_tcp_64mib"] = result["bandwidth"]["nixl_vs_tcp_64mib"]
    log(f"bandwidth: {result['bandwidth']}")
    prompts = _prompts(3 if quick else 8, 250 if quick else 400)
    log(f"disaggregated, {len(prompts)} prompts: prefill on b, decode on c")
    across = _disaggregated({1: 1, 2: 1}, prompts)
    log("disaggregated, the same prompts: prefill and decode both on b")
    one_host = _disaggregated({1: 2}, prompts)
    for name, index in (("ttft", 0), ("second_token", 1)):
        across_s = statistics.median(t[index] for t in across)
        one_s = statistics.median(t[index] for t in one_host)
        result[f"{name}_ms_p50_across_hosts"] = round(across_s * 1e3, 1)
        result[f"{name}_ms_p50_one_host"] = round(one_s * 1e3, 1)
        result[f"{name}_across_vs_one_host"] = round(across_s / one_s, 3)
    result["num_prompts"] = len(prompts)
    result["load_avg_1m_end"] = os.getloadavg()[0]
    return result
