"""The one settings object. Every field can be set by an environment variable `DYN_<FIELD>` (for example
`DYN_DTYPE=bfloat16`) and by the matching `dynctl` flag; nothing else in dynserve reads `os.environ`.
Defaults are what a new user on a laptop needs: the bundled SmolLM2 model, fp32 on CPU, 1 GiB of KV cache.
Secrets (`api_key`, `cluster_token`) are `SecretStr`: a repr, str or JSON dump of the settings (what a log line
would show) masks them; `secret(name)` gives the value to the code that presents or checks it.
"""

from __future__ import annotations

import json
import socket
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["DType", "ModelsFileEntry", "Settings", "ray_system_config", "ray_system_config_flag",
           "read_models_file"]

DType = Literal["auto", "float32", "bfloat16", "float16"]
_GATEWAY: dict[str, Any] = {"group": "gateway"}
_CLUSTER: dict[str, Any] = {"group": "cluster"}
_POOL: dict[str, Any] = {"group": "pool"}
_MOCKER: dict[str, Any] = {"group": "mocker"}
_TRANSFER: dict[str, Any] = {"group": "transfer"}
_METRICS: dict[str, Any] = {"group": "metrics"}
_PLANNER: dict[str, Any] = {"group": "planner"}


def ray_system_config() -> dict[str, Any]:
    """The system config of every Ray dynserve starts (`ray.init(_system_config=...)`; a head node's
    `ray start --system-config`, which the cluster's other nodes take from it): its worker processes start at
    niceness 0, so no actor needs a runtime env to say so (`workers/ray_start.py`). A new dict each call:
    `ray.init` adds its own entries (object spilling) to the one it is given."""
    return {"worker_niceness": 0}


def ray_system_config_flag() -> str:
    """`ray_system_config()` as the flag of `ray start --head`."""
    return "--system-config=" + json.dumps(ray_system_config(), separators=(",", ":"))


class ModelsFileEntry(BaseModel):
    """One model of a models file (`Settings.models_file`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, description="a GGUF file or Hugging Face directory, as --model takes it")
    served_model_names: list[Annotated[str, Field(min_length=1, pattern=r"^[^\s=]+$")]] = Field(
        [], description="other names clients may ask for it by")


class _ModelsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    models: list[ModelsFileEntry] = Field(min_length=1)


def read_models_file(text: str) -> list[ModelsFileEntry]:
    """The models a models file lists (`models: [{model: PATH, served_model_names: [NAME, ...]}, ...]`, the first
    the default model), from its YAML text; ValueError naming what is wrong (not YAML, not a list of models, an
    unknown key, no models, an entry without its model)."""
    import yaml

    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"not YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(loaded, dict) or "models" not in loaded:
        raise ValueError("give a mapping with a 'models' list: models: [{model: PATH, served_model_names: [NAME]}]")
    try:
        return _ModelsFile.model_validate(loaded).models
    except ValidationError as exc:
        raise ValueError("; ".join(f"{'.'.join(map(str, e['loc']))}: {_MODELS_FILE_PROBLEMS.get(e['type'], e['msg'])}"
                                   for e in exc.errors())) from None


_MODELS_FILE_PROBLEMS = {"extra_forbidden": "unknown key (the file gives models, each model its model and "
                         "served_model_names)",
                         "too_short": "no models listed", "missing": "missing (the model's file or directory)",
                         "list_type": "not a list"}


class Settings(BaseSettings):
    # hide_input_in_errors: a bad secret's value must not reach a traceback or a log through its error
    model_config = SettingsConfigDict(env_prefix="DYN_", extra="ignore", protected_namespaces=(),
                                      hide_input_in_errors=True)

    # ---- engine ----
    model: str | None = Field(None, description="GGUF file or Hugging Face directory; default: bundled SmolLM2. "
                              "Given again, the next models to serve (the same as --extra-model)")
    extra_models: list[str] = Field([], description="dynctl serve: more models to serve beside --model, each with "
                                    "workers of its own (as many as the worker flags say), its own router and KV "
                                    "index; requests name the model they want")
    models_file: str | None = Field(None, description="a YAML file listing the models to serve, instead of --model "
                                    "and --served-model-name: 'models: [{model: PATH, served_model_names: [NAME, "
                                    "...]}, ...]', the first the default model")
    dtype: DType = Field("auto", description="weights and activations dtype; 'auto': bfloat16 on a GPU that has "
                                             "it and on a CPU with AVX512-BF16 (where the engine's bf16 kernels "
                                             "run), float32 elsewhere")
    device: str = Field("auto", description="'auto' (cuda if present, else cpu), 'cpu' or 'cuda[:N]'")
    block_size: int = Field(16, ge=1, le=256, description="tokens per KV block (a vLLM worker's: a multiple of its "
                            "attention backend's, 32 on CPU)")
    engine: Literal["dynserve", "vllm"] = Field("dynserve", description="what each worker runs: dynserve's engine, "
                                                "or vLLM's OpenAI server (vllm_command), started by the pool")
    vllm_command: str | None = Field(None, description="engine vllm: how to start vLLM's OpenAI server on a "
                                     "worker's node, e.g. '/opt/vllm/bin/python -m vllm.entrypoints.openai.api_server'")
    vllm_args: str = Field("", description="engine vllm: more flags for vLLM's server (e.g. '--dtype bfloat16')")
    kv_blocks: int | None = Field(None, ge=1, description="KV blocks to allocate; default: from kv_cache_gib")
    kv_cache_gib: float = Field(1.0, gt=0, description="KV cache size when kv_blocks is not given")
    max_num_seqs: int = Field(64, ge=1, description="sequences batched together at most")
    max_num_batched_tokens: int = Field(1024, ge=16, description="tokens computed per step at most")
    max_model_len: int | None = Field(None, ge=16, description="context limit; default: the model's")
    enable_prefix_caching: bool = Field(True, description="reuse KV blocks of shared prompt prefixes")
    kv_host_bytes: int = Field(0, ge=0, description="host KV tier: cached blocks evicted from the KV cache "
                               "are kept in a host memory pool of this size (pinned on a GPU) and copied back "
                               "on a prefix hit instead of prefilled (0: off; on a CPU the KV cache is host "
                               "memory already, so give the memory to kv_cache_gib instead)")
    kv_disk_bytes: int = Field(0, ge=0, description="disk KV tier: blocks leaving the host tier (or the KV "
                               "cache, without one) are written to files under kv_disk_dir up to this total, "
                               "least recently used dropped first (0: off)")
    kv_disk_dir: str | None = Field(None, description="where the disk KV tier writes: each engine makes a "
                                    "directory of its own inside it and removes it on close; a restarted "
                                    "worker starts with an empty disk tier (default: the system temp dir)")
    kv_disk_write: Literal["background", "sync"] = Field(
        "background", description="disk KV tier writes: 'background' (a writer thread; the engine never "
        "waits for the disk, a block is read from memory until written) or 'sync' (written before the step "
        "goes on)")
    attention_backend: Literal["auto", "torch", "triton"] = Field("auto", description="'auto': triton on GPU")
    cuda_graphs: bool = Field(True, description="on a GPU with the triton backend: replay decode steps from CUDA "
                                                "graphs captured at start (per batch-size bucket)")
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads; default: torch's choice")
    seed: int = Field(0, description="seed for requests that give none")
    engine_nice: int = Field(5, ge=0, le=19, description="on CPU, how much lower a worker's engine threads run "
                             "than its I/O, so streaming is not stuck behind compute")

    # ---- gateway ----
    host: str = Field("127.0.0.1", description="gateway listen address", json_schema_extra=_GATEWAY)
    port: int = Field(8000, ge=0, le=65535, description="gateway listen port (0: any free port)",
                      json_schema_extra=_GATEWAY)
    api_key: SecretStr | None = Field(None, description="require 'Authorization: Bearer <key>' on /v1 routes",
                                      json_schema_extra=_GATEWAY)
    metrics_require_key: bool = Field(False, description="with an api_key, /metrics and /metrics/targets require "
                                      "it too (a Prometheus sends it: 'authorization' in its scrape config; "
                                      "dynctl serve --prometheus does)", json_schema_extra=_GATEWAY)
    max_queue: int = Field(512, ge=1, description="requests the gateway holds at once (running and waiting); "
                           "one more gets 429", json_schema_extra=_GATEWAY)
    max_body_bytes: int = Field(8 * 2**20, ge=1024, description="largest request body; larger ones get 413",
                                json_schema_extra=_GATEWAY)
    # HTTP edge limits, as nginx and uvicorn bound theirs (each breach answered in OpenAI's error shape):
    # 16 KiB of request line and headers is h11's limit under uvicorn and between nginx's 8 KiB per line and
    # 32 KiB in all; an OpenAI client sends under 1 KiB. 100 fields is Tomcat's and Python http.client's.
    max_header_bytes: int = Field(16 * 2**10, ge=1024, description="largest request line plus headers; larger "
                                  "ones get 431", json_schema_extra=_GATEWAY)
    max_headers: int = Field(100, ge=1, description="most header fields in a request; more get 431",
                             json_schema_extra=_GATEWAY)
    header_timeout_s: float = Field(30.0, gt=0, description="a request's line and headers must arrive within "
                                    "this long of its first byte, and its body may pause no longer (else 408); "
                                    "a connection that sends no request for this long is closed",
                                    json_schema_extra=_GATEWAY)
    keep_alive_timeout_s: float = Field(5.0, gt=0, description="an idle keep-alive connection (no request in "
                                        "flight) is closed after this long (uvicorn's default)",
                                        json_schema_extra=_GATEWAY)
    max_generation_s: float = Field(600.0, gt=0, description="the longest a completion request may generate; "
                                    "then it ends with finish_reason 'length' and its workers free its KV "
                                    "blocks (a request may ask for less: its max_generation_s field)",
                                    json_schema_extra=_GATEWAY)
    shutdown_grace_s: float = Field(20.0, ge=0, description="on SIGTERM or Ctrl-C the gateway stops accepting, "
                                    "answers new requests 503, and gives requests in flight this long to finish "
                                    "before cutting them (a second signal cuts them at once)",
                                    json_schema_extra=_GATEWAY)
    admission_ttft_ms: float | None = Field(
        None, gt=0, description="keep the time to first token of admitted requests at this target under any load: "
        "an adaptive number of requests may wait for their first token, the excess gets 429 with Retry-After at "
        "once (default: off; only max_queue bounds what is admitted)", json_schema_extra=_GATEWAY)
    served_model_names: list[str] = Field([], description="other names clients may ask for a model by: NAME "
                                          "(the first --model), or NAME=MODEL_ID (any model served; its id is "
                                          "its file's name up to the first dot, or its directory's name)",
                                          json_schema_extra=_GATEWAY)
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral"] = Field(
        "auto", description="how the model writes tool calls: hermes (<tool_call> JSON: Qwen, Hermes), llama3_json "
        "(Llama 3.1-3.3's JSON call), mistral ([TOOL_CALLS] list); auto: from the model's chat template and "
        "vocabulary", json_schema_extra=_GATEWAY)
    worker_wait_s: float = Field(0.0, ge=0, description="when no worker is ready, hold a request this long for "
                                 "one to start (a planner scaling up from zero) before answering 503; "
                                 "dynctl serve --planner: 120 unless set", json_schema_extra=_GATEWAY)

    # ---- cluster ----
    ray_address: str | None = Field(None, description="join this Ray cluster; default: start a local one",
                                    json_schema_extra=_CLUSTER)
    worker_num_cpus: float = Field(1.0, gt=0, description="Ray CPUs reserved by each worker",
                                   json_schema_extra=_CLUSTER)
    workers: int = Field(1, ge=1, description="engine workers to start (dynctl serve)", json_schema_extra=_CLUSTER)
    worker_urls: list[str] = Field([], description="attach OpenAI-compatible servers others run as workers "
                                   "(dynctl gateway; repeat the flag): 'vllm=http://HOST:PORT[;events=tcp://HOST:PORT]"
                                   "[;replay=tcp://HOST:PORT][;id=NAME]' (vLLM, its KV events relayed to the router) "
                                   "or 'openai=http://HOST:PORT' (any other)", json_schema_extra=_CLUSTER)
    attach_wait_s: float = Field(600.0, ge=0, description="dynctl attach / gateway --worker-url: how long to wait "
                                 "for a server to answer at start (one still loading its model), then fail",
                                 json_schema_extra=_CLUSTER)
    # Addresses are the node's: a worker inside Ray reads them from its own process's environment
    # (DYN_ADVERTISE_HOST, DYN_BIND_HOST: a pod sets its pod IP), not from the settings its driver sent.
    advertise_host: str | None = Field(
        None, description="the address a process announces for the ports it serves other processes (worker "
        "channel, KV transfer, event plane): default its Ray node's IP, or 127.0.0.1 outside Ray (dynctl "
        "serve's own local Ray: 127.0.0.1); in a pod, its pod IP", json_schema_extra=_CLUSTER)
    bind_host: str | None = Field(
        None, description="the address those ports listen on; default the advertised one (0.0.0.0 only when "
        "set here)", json_schema_extra=_CLUSTER)
    pools_follow_nodes: bool = Field(
        False, description="dynctl serve on a cluster whose nodes are made per pool (Kubernetes: a pod each): a "
        "pool places its workers only on Ray nodes offering the resource dynserve_pool_<role> and keeps one "
        "worker per unit of it, growing and shrinking as such nodes join and leave; the worker counts given "
        "set only the layout", json_schema_extra=_CLUSTER)
    prefill_workers: int = Field(0, ge=0, description="disaggregated serving (dynctl serve): prefill workers "
                                 "to start; with decode_workers, replaces --workers", json_schema_extra=_CLUSTER)
    decode_workers: int = Field(0, ge=0, description="disaggregated serving (dynctl serve): decode workers to "
                                "start", json_schema_extra=_CLUSTER)
    disagg_local_prefill_tokens: int = Field(
        512, ge=0, description="disaggregated serving: a prompt with fewer uncached tokens than this (by the "
        "prefill router's view of the prefill workers' caches) is prefilled on its decode worker",
        json_schema_extra=_CLUSTER)
    disagg_max_prefill_queue: int = Field(
        2, ge=0, description="disaggregated serving: while the prefill workers have this many requests each "
        "queued or running, further prompts are prefilled on their decode worker", json_schema_extra=_CLUSTER)
    router: Literal["kv", "approximate", "round_robin", "random", "least_loaded"] = Field(
        "kv", description="how the gateway picks a worker: prefix-cache overlap (from KV events, or "
        "approximate: from where it sent earlier prompts) and load, or a baseline",
        json_schema_extra=_CLUSTER)
    # A block to prefill costs the new request far more time than a block another request holds while it
    # decodes: at 1 the load term wins and follow-up turns leave the worker holding their history (in
    # benchmarks.routing they went back to it 41% of the time at 1, every time at 8; docs/benchmarks.md).
    overlap_weight: float = Field(8.0, ge=0, description="kv router: weight of blocks to prefill against load "
                                  "(blocks in flight)", json_schema_extra=_CLUSTER)
    router_temperature: float = Field(0.0, ge=0, description="kv router: 0 picks the cheapest worker, more "
                                      "samples among near-equal ones", json_schema_extra=_CLUSTER)
    # The guard is for a popular prefix piling up on one worker, not for the imbalance a few requests make:
    # set lower, it fires on a few requests in flight and moves follow-up turns off the worker holding their
    # history (benchmarks.routing; docs/benchmarks.md).
    router_hot_spot_ratio: float = Field(
        2.0, gt=1, description="kv/approximate router: when the busiest candidate has more than this times "
        "the mean active blocks (and at least router_hot_spot_min_blocks), pick the least loaded whatever it "
        "caches",
        json_schema_extra=_CLUSTER)
    router_hot_spot_min_blocks: int = Field(
        1024, ge=0, description="kv/approximate router: no hot spot while the busiest candidate has fewer "
        "active blocks than this", json_schema_extra=_CLUSTER)
    # Estimates until benchmarks.tiers measures them: on a GPU a block copied back from host memory costs about
    # a tenth of prefilling it, one read from NVMe about two thirds.
    router_host_hit_weight: float = Field(
        0.9, ge=0, le=1, description="kv router: a prompt block a worker holds in its host KV tier counts as "
        "this fraction of a device-tier hit", json_schema_extra=_CLUSTER)
    router_disk_hit_weight: float = Field(
        0.5, ge=0, le=1, description="kv router: a prompt block a worker holds in its disk KV tier counts as "
        "this fraction of a device-tier hit", json_schema_extra=_CLUSTER)
    kv_peer_pulls: bool = Field(
        False, description="peer pulls: when the kv router sends a prompt to a worker other than the one "
        "holding most of its prefix (that one is busier), the chosen worker reads the blocks it lacks from the "
        "holder's cache (any tier) over the KV transfer backend and prefills only the rest; a failed pull "
        "prefills them. Aggregated pools and prefill pools of dynserve's engine", json_schema_extra=_CLUSTER)
    router_pull_hit_weight: float = Field(
        0.8, ge=0, le=1, description="kv router with kv_peer_pulls: a prompt block another worker holds, "
        "which the chosen worker would pull, counts as this fraction of what it is worth to that worker (a "
        "device hit, or its host or disk tier's weight)", json_schema_extra=_CLUSTER)
    kv_pull_min_blocks: int = Field(
        4, ge=1, description="kv router with kv_peer_pulls: pull only when the holder has at least this many "
        "more of the prompt's blocks than the chosen worker (fewer are prefilled)", json_schema_extra=_CLUSTER)
    router_approx_ttl_s: float = Field(
        120.0, gt=0, description="approximate router: forget a prompt's blocks this long after it last "
        "routed them", json_schema_extra=_CLUSTER)
    router_approx_max_blocks: int = Field(
        65536, ge=1, description="approximate router: blocks remembered per worker at most (oldest forgotten "
        "first)", json_schema_extra=_CLUSTER)
    migration_limit: int = Field(3, ge=0, description="a request whose worker fails mid-stream is resubmitted "
                                 "to another worker at most this many times (0: off)", json_schema_extra=_CLUSTER)
    redis_url: str | None = Field(None, description="event plane and registry on this Redis; default: embedded "
                                  "in Ray", json_schema_extra=_CLUSTER)
    worker_lease_s: float = Field(3.0, gt=0, description="a worker's registry lease; heartbeats every third",
                                  json_schema_extra=_CLUSTER)
    namespace: str = Field("dynserve", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$",
                           description="event plane and registry namespace: a gateway routes only to the "
                           "workers registered in its own", json_schema_extra=_CLUSTER)
    cluster_token: SecretStr | None = Field(
        None, min_length=16, max_length=512, description="when set, every internal socket (worker channel, "
        "embedded event plane, TCP KV transfer) serves only peers presenting it; every process of a fleet must "
        "share it (in Kubernetes it comes from a Secret; prefer the env variable to the flag, which ps shows). "
        "Default: none, except that dynctl serve starting its own local Ray makes a random one for its fleet",
        json_schema_extra=_CLUSTER)

    # ---- worker pools (dynserve.workers.pool) ----
    pool_health_interval_s: float = Field(1.0, gt=0, description="how often a pool checks that its workers' "
                                          "engines run and answer (an actor's death it learns at once), and "
                                          "starts the replacements due", json_schema_extra=_POOL)
    pool_unresponsive_s: float = Field(15.0, gt=0, description="a worker that answers no health check for "
                                       "this long is killed and replaced", json_schema_extra=_POOL)
    pool_drain_timeout_s: float = Field(60.0, gt=0, description="how long a worker being removed may finish "
                                        "its in-flight requests before they are cut", json_schema_extra=_POOL)
    pool_max_restarts: int = Field(5, ge=0, description="dead workers a pool replaces per restart window at "
                                   "most", json_schema_extra=_POOL)
    pool_restart_window_s: float = Field(300.0, gt=0, description="the window pool_max_restarts counts over",
                                         json_schema_extra=_POOL)
    pool_restart_backoff_s: float = Field(1.0, ge=0, description="delay before replacing a dead worker; "
                                          "doubles with each restart in the window", json_schema_extra=_POOL)
    pool_restart_backoff_max_s: float = Field(30.0, ge=0, description="the longest replacement delay",
                                              json_schema_extra=_POOL)
    registry_interval_s: float = Field(0.25, gt=0, description="how often a gateway that follows the "
                                       "registry re-reads it", json_schema_extra=_POOL)

    # ---- mocker ----
    mocker: str | None = Field(None, description="serve simulated workers (real scheduler, block manager and KV "
                               "events; no model) that take the step times of this profile: cpu, "
                               "llama-3.1-8b-h100, llama-3.1-70b-h100-tp4; KV blocks, context and batch limits "
                               "not set explicitly are the profile's", json_schema_extra=_MOCKER)
    mocker_speedup: float = Field(1.0, gt=0, description="mocker: run this many times faster than the profile",
                                  json_schema_extra=_MOCKER)

    # ---- KV-page transfer (dynserve.kv_transfer) ----
    transfer_backend: Literal["auto", "nixl", "tcp"] = Field(
        "auto", description="how workers move KV pages: NIXL (UCX; RDMA/NVLink/cuda_ipc where present, "
        "cma on one host), a plain TCP stream, or 'auto' (NIXL when it imports)", json_schema_extra=_TRANSFER)
    transfer_timeout_s: float = Field(10.0, gt=0, description="a KV read that takes longer fails (the decode "
                                      "worker then prefills locally)", json_schema_extra=_TRANSFER)
    transfer_ucx_tls: str | None = Field(None, description="nixl: UCX transports, set as UCX_TLS unless that is "
                                         "already set (one CPU host: 'cma,tcp,self'); default: UCX's choice",
                                         json_schema_extra=_TRANSFER)
    transfer_ucx_net_devices: str | None = Field(None, description="nixl: UCX network devices, set as "
                                                 "UCX_NET_DEVICES unless already set (one host: 'lo'); "
                                                 "default: UCX's choice", json_schema_extra=_TRANSFER)
    transfer_progress_thread: bool = Field(False, description="nixl: run NIXL's own UCX progress thread (it "
                                           "polls without pause, taking the CPU that reads need on a machine of "
                                           "few cores); off, the connector progresses UCX every "
                                           "transfer_progress_interval_s",
                                           json_schema_extra=_TRANSFER)
    transfer_progress_interval_s: float = Field(0.005, gt=0, description="nixl: how often the connector "
                                                "progresses UCX for peers' connections and notifications when "
                                                "NIXL's progress thread is off", json_schema_extra=_TRANSFER)
    kv_lease_s: float = Field(30.0, gt=0, description="a prefill worker holds a prompt's KV blocks for its "
                              "decode worker this long at most, then frees them", json_schema_extra=_TRANSFER)
    transfer_fault: Literal["none", "error", "timeout"] = Field(
        "none", description="fault injection for resilience tests and drills: every KV read of this worker "
        "fails at once ('error') or only after transfer_timeout_s ('timeout'); the decode worker then prefills "
        "locally", json_schema_extra=_TRANSFER)
    transfer_port: int = Field(0, ge=0, le=65535, description="tcp: the port a worker serves its KV pages on "
                               "(0: any free port), at its bind_host", json_schema_extra=_TRANSFER)

    # ---- metrics (dynserve.observability; each worker's own port: dynserve.workers.metrics) ----
    worker_metrics: bool = Field(True, description="each worker serves Prometheus metrics on its own port, "
                                 "announced in the worker registry", json_schema_extra=_METRICS)
    worker_metrics_port: int = Field(0, ge=0, le=65535, description="the port a worker serves its metrics on, "
                                     "at its bind_host (0: any free port; set one where each worker has its own "
                                     "address, e.g. a pod)", json_schema_extra=_METRICS)
    prometheus: bool = Field(False, description="dynctl serve: run a Prometheus (the `prometheus` binary) on a "
                             "free local port that scrapes the gateway and follows the workers as they come and "
                             "go, with dynserve's recording rules; prints its URL", json_schema_extra=_METRICS)
    prometheus_url: str | None = Field(None, description="an existing Prometheus that scrapes the fleet (point "
                                       "its http_sd_configs at the gateway's /metrics/targets); dynctl top "
                                       "reads it", json_schema_extra=_METRICS)
    scrape_interval_s: float = Field(5.0, gt=0, description="dynctl serve --prometheus: how often it scrapes "
                                     "and evaluates the rules", json_schema_extra=_METRICS)

    # ---- planner (dynserve.planner) ----
    planner: bool = Field(False, description="dynctl serve: scale the pools against the TTFT and ITL targets "
                          "below, from the fleet's Prometheus (its own unless --prometheus-url)",
                          json_schema_extra=_PLANNER)
    planner_mode: Literal["sla", "load"] = Field(
        "sla", description="sla: predict the load and size each pool from a capacity profile, corrected by "
        "observed latency; load: grow a pool whose latency or queue is over target, shrink one comfortably under",
        json_schema_extra=_PLANNER)
    planner_ttft_ms: float = Field(1000.0, gt=0, description="the time-to-first-token target",
                                   json_schema_extra=_PLANNER)
    planner_itl_ms: float = Field(50.0, gt=0, description="the inter-token latency target",
                                  json_schema_extra=_PLANNER)
    planner_interval_s: float = Field(10.0, gt=0, description="how often the planner decides",
                                      json_schema_extra=_PLANNER)
    planner_window_s: float = Field(60.0, gt=0, description="the window of the rates and latencies it reads (60: "
                                    "the recording rules)", json_schema_extra=_PLANNER)
    planner_min_workers: int = Field(1, ge=0, description="aggregated serving: the fewest workers",
                                     json_schema_extra=_PLANNER)
    planner_max_workers: int = Field(8, ge=1, description="aggregated serving: the most workers",
                                     json_schema_extra=_PLANNER)
    planner_min_prefill_workers: int = Field(1, ge=0, description="disaggregated: the fewest prefill workers",
                                             json_schema_extra=_PLANNER)
    planner_max_prefill_workers: int = Field(4, ge=1, description="disaggregated: the most prefill workers",
                                             json_schema_extra=_PLANNER)
    planner_min_decode_workers: int = Field(1, ge=0, description="disaggregated: the fewest decode workers",
                                            json_schema_extra=_PLANNER)
    planner_max_decode_workers: int = Field(4, ge=1, description="disaggregated: the most decode workers",
                                            json_schema_extra=_PLANNER)
    planner_max_total_workers: int | None = Field(None, ge=1, description="a budget all pools share; default: "
                                                  "none", json_schema_extra=_PLANNER)
    planner_idle_s: float | None = Field(None, gt=0, description="scale every pool to zero after this long "
                                         "without a request (the next request waits for a worker); default: "
                                         "never", json_schema_extra=_PLANNER)
    planner_predictor: Literal["constant", "ewma", "holt"] = Field(
        "holt", description="how the sla mode predicts the rate, ISL and OSL at its horizon (when a worker "
        "decided now would serve)", json_schema_extra=_PLANNER)
    planner_start_s: float | None = Field(None, ge=0, description="a new worker's time from decision to serving, "
                                          "which the sla mode sizes ahead by; default: measured from its own "
                                          "scale-ups", json_schema_extra=_PLANNER)
    planner_down_delay_s: float | None = Field(None, ge=0, description="how long a lower need must hold before a "
                                               "pool shrinks; default: three intervals",
                                               json_schema_extra=_PLANNER)
    planner_rise_spare_workers: int = Field(1, ge=0, description="the sla mode: workers a prefilling pool keeps "
                                            "over its need while its rate rises (a worker decided now serves "
                                            "only after its start); 0: none", json_schema_extra=_PLANNER)
    planner_kubernetes: str | None = Field(
        None, description="NAMESPACE/NAME of the DynServeDeployment this fleet is (the operator sets it): the "
        "planner scales its DynServePools through their scale subresource instead of the Ray pools, and takes "
        "a replica count set there by hand (kubectl scale, an HPA) as an override", json_schema_extra=_PLANNER)
    planner_profile: str | None = Field(None, description="the capacity profile (a file from dynctl profile, or "
                                        "a shipped name); default: the --mocker profile's, else 'cpu'",
                                        json_schema_extra=_PLANNER)

    def secret(self, name: Literal["api_key", "cluster_token"]) -> str | None:
        """The value of secret setting `name`, None when unset: for the code that presents or checks it, never
        for a log line."""
        value = getattr(self, name)
        return None if value is None else value.get_secret_value()  # type: ignore[no-any-return]

    def serving_addresses(self, node_ip: str | None) -> tuple[str, str]:
        """(bind, advertise): where a process's served ports listen and the address it announces for them.

        The advertised address is `advertise_host`, else `node_ip` (Ray's address for the node the process
        runs on, which other nodes reach it by), else loopback (a process outside Ray, on one host by
        construction). The bind address is `bind_host`, else the advertised one: never every interface
        unless asked.
        """
        advertise = self.advertise_host or node_ip or "127.0.0.1"
        return self.bind_host or advertise, advertise

    @classmethod
    def field_names(cls, group: str) -> list[str]:
        """Names of the fields in `group` ("engine", "gateway", "cluster", "pool", "mocker", "transfer",
        "metrics" or "planner")."""
        return [name for name, f in cls.model_fields.items()
                if (f.json_schema_extra or {}).get("group", "engine") == group]  # type: ignore[union-attr]


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now (the OS's pick; another process could take it before it is bound): for a
    process that must name its port before it serves (Prometheus, vLLM's server and its event sockets)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
