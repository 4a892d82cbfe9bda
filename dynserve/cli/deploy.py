"""`dynctl deploy`, `dynctl status NAME`, `dynctl delete NAME`: a `DynServeDeployment` on Kubernetes.

`deploy` builds the resource from a YAML file and/or flags (flags win), validates it with the operator's own
`parse_deployment` (bad input: exit 2, nothing sent), then either prints it (`--dry-run`; with `--render`
also every child the operator would create) or server-side applies it (field manager "dynctl") and follows
its status until the operator reports it Ready (exit 0), Degraded for a reason waiting cannot fix, or
`--timeout` passes (exit 1). A status is trusted only when its `observedGeneration` is the resource's
`generation` (the operator has seen this spec). `status` shows what the operator reports; `delete` removes
the resource (its children go with it through their owner references).

Several models (`spec.models`): `--model` given twice or more lists them (each named after its file, the first
the default), `--served-model-name NAME[=MODEL_ID]` gives one another name (as `dynctl serve` takes it); the
layout, pool and dtype flags reach every model, over a file's `models` too.

The same small disaggregated fleet of simulated workers, from a file or from flags alone (the README's
Kubernetes section; tests/test_deploy_cli.py runs exactly this)::

    # tiny.yaml
    apiVersion: dynserve.io/v1alpha1
    kind: DynServeDeployment
    metadata:
      name: tiny
    spec:
      engine:
        mocker: cpu
      pools:
        prefill:
          replicas: 2
        decode:
          replicas: 1

    dynctl deploy -f tiny.yaml --dry-run --render      # the resource and every child, as YAML
    dynctl deploy --name tiny --mocker cpu --prefill-workers 2 --decode-workers 1    # the same, applied
    dynctl status tiny
    dynctl delete tiny
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from dynserve.cli.deploy_status import DeploymentView, Progress, outcome, progress_line, render_view, view_of
from dynserve.errors import InvalidRequestError, KubernetesError

__all__ = ["add_kube_commands", "resource_from", "run"]

EXIT_OK, EXIT_FAILURE = 0, 1
FIELD_MANAGER = "dynctl"
DEFAULT_NAME = "dynserve"
POLL_S = 0.5
_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,48}[a-z0-9])?$")  # a DNS-1035 label, leaving room for "-prefill"


# ---- the parsers -------------------------------------------------------------------------------------------

def add_kube_commands(sub: Any) -> None:
    """The `deploy`, `status` and `delete` subparsers of `dynctl`."""
    deploy = sub.add_parser("deploy", help="run a fleet on Kubernetes: apply a DynServeDeployment and wait "
                            "until it is Ready (dynctl deploy --help)")
    deploy.add_argument("-f", "--file", type=Path, metavar="FILE.yaml",
                        help="a DynServeDeployment manifest (or only its spec); flags override it")
    deploy.add_argument("--name", help=f"the resource's name [default: the file's, else {DEFAULT_NAME}]")
    _add_cluster_flags(deploy)
    spec = deploy.add_argument_group("the spec (each overrides the file)")
    spec.add_argument("--model", metavar="PATH|URI", action="append", help="an http(s) URL -> model.uri "
                      "(fetched into the pods' volume), else model.path; given again, several models behind the "
                      "one gateway (spec.models, the first the default; each gets the layout and pool flags)")
    spec.add_argument("--served-model-name", metavar="NAME[=MODEL_ID]", action="append", help="another name "
                      "clients may ask for a model by: NAME for the first --model, NAME=MODEL_ID for any (its "
                      "file's name up to the first dot, or its directory's name); repeated")
    spec.add_argument("--dtype", help="model.dtype: float32, bfloat16, float16")
    spec.add_argument("--image", metavar="REPO[:TAG]", help="the dynserve image")
    spec.add_argument("--workers", type=int, metavar="N", help="aggregated serving: N worker pods")
    spec.add_argument("--prefill-workers", type=int, metavar="N", help="disaggregated: N prefill worker pods")
    spec.add_argument("--decode-workers", type=int, metavar="M", help="disaggregated: M decode worker pods")
    spec.add_argument("--gpus", type=int, metavar="N", help="GPUs per worker pod (nvidia.com/gpu limit)")
    spec.add_argument("--cpus", metavar="Q", help="CPUs each worker pod requests (2, 500m)")
    spec.add_argument("--memory", metavar="Q", help="memory each worker pod requests (8Gi)")
    spec.add_argument("--mocker", metavar="PROFILE", help="simulated workers with this timing profile (no model)")
    spec.add_argument("--engine", choices=["dynserve", "vllm"], help="what the workers pool runs: dynserve's "
                      "engine, or vllm: vLLM's OpenAI server (--vllm-image) beside a dynctl attach sidecar "
                      "(aggregated only; the model: --model, a Hugging Face directory)")
    spec.add_argument("--vllm-image", metavar="REPO:TAG[@sha256:D]", help="engine vllm: vLLM's image "
                      "(e.g. vllm/vllm-openai:v0.10.2), pinned by a digest when given")
    spec.add_argument("--vllm-args", metavar="'ARGS'", help="engine vllm: more flags for vLLM's server, as "
                      "dynctl serve --vllm-args takes them (e.g. '--dtype bfloat16 --max-num-batched-tokens 8192')")
    spec.add_argument("--vllm-block-size", type=int, metavar="N", help="engine vllm: tokens per KV block, a "
                      "multiple of 16 (vLLM's CPU build: of 32)")
    spec.add_argument("--router", metavar="MODE", help="kv, approximate, round_robin, random, least_loaded")
    spec.add_argument("--transfer-backend", metavar="BACKEND", help="KV transfer: auto, nixl, tcp")
    spec.add_argument("--redis", action="store_true", help="a Redis event plane (the operator runs one)")
    spec.add_argument("--redis-url", metavar="URL", help="a Redis event plane at this URL")
    spec.add_argument("--planner", action="store_true", help="let the planner scale the pools")
    spec.add_argument("--ttft-ms", type=float, metavar="MS", help="the planner's TTFT target")
    spec.add_argument("--itl-ms", type=float, metavar="MS", help="the planner's ITL target")
    spec.add_argument("--min-replicas", type=int, metavar="N", help="each pool's lower bound for the planner")
    spec.add_argument("--max-replicas", type=int, metavar="N", help="each pool's upper bound for the planner")
    spec.add_argument("--api-key-secret", metavar="NAME", help="require the API key in this Secret (key api-key)")
    spec.add_argument("--service-type", metavar="TYPE", help="the gateway Service: ClusterIP, NodePort, "
                      "LoadBalancer")
    spec.add_argument("--service-monitor", action="store_true", help="a ServiceMonitor for Prometheus Operator")
    run_group = deploy.add_argument_group("running")
    run_group.add_argument("--dry-run", action="store_true", help="print the resource as YAML; apply nothing")
    run_group.add_argument("--render", action="store_true", help="with --dry-run: also every child the operator "
                           "would create, as one multi-document YAML stream")
    run_group.add_argument("--no-wait", action="store_true", help="return once applied")
    run_group.add_argument("--timeout", type=float, default=600.0, metavar="S",
                           help="seconds to wait for Ready [default: 600]")
    run_group.add_argument("--output", choices=["text", "json"], default="text",
                           help="json: the final resource as JSON [default: text]")

    status = sub.add_parser("status", help="a DynServeDeployment's conditions, pools and gateway URL")
    status.add_argument("name", metavar="NAME")
    _add_cluster_flags(status)
    status.add_argument("--output", choices=["text", "json"], default="text")

    delete = sub.add_parser("delete", help="delete a DynServeDeployment and everything it runs")
    delete.add_argument("name", metavar="NAME")
    _add_cluster_flags(delete)
    delete.add_argument("--wait", action="store_true", help="return once it is gone")
    delete.add_argument("--timeout", type=float, default=600.0, metavar="S",
                        help="with --wait: seconds to wait [default: 600]")


def _add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cluster")
    group.add_argument("--kubeconfig", metavar="FILE",
                       help="[env: KUBECONFIG; default: ~/.kube/config, else the in-cluster service account]")
    group.add_argument("--context", help="the kubeconfig context [default: its current context]")
    group.add_argument("-n", "--namespace", help="[default: the file's, else the context's, else default]")


def run(args: argparse.Namespace) -> int:
    try:
        import kubernetes  # noqa: F401 (only to say what is missing)
    except ImportError:
        print("dynctl: Kubernetes commands need the kubernetes extra: pip install 'dynserve[kubernetes]'",
              file=sys.stderr)
        return EXIT_FAILURE
    if args.command == "deploy":
        return deploy(args)
    if args.command == "status":
        return status(args)
    return delete(args)


# ---- the resource from a file and flags (pure but for reading the file) -----------------------------------

def resource_from(args: argparse.Namespace, default_namespace: str) -> dict[str, Any]:
    """The DynServeDeployment that `args` describe, its spec normalized (defaults left out, each pool's
    replicas written). InvalidRequestError names the bad field or flag."""
    from dynserve.operator.spec import API_VERSION, KIND, parse_deployment

    manifest = _read_manifest(args.file) if args.file else {}
    metadata = dict(manifest.get("metadata") or {})
    file_spec = manifest.get("spec") or {}
    spec = _merge(file_spec, _flag_spec(args, file_spec))
    parsed = parse_deployment(spec)
    if parsed.models is None:
        normalized = parsed.model_dump(mode="json", by_alias=True, exclude_defaults=True)
        normalized["pools"] = _with_replicas(normalized.get("pools", {}), parsed.pools)
    else:  # `model` and `pools` read as the first model's: the resource gives them once, in `models`
        normalized = parsed.model_dump(mode="json", by_alias=True, exclude_defaults=True, exclude={"model", "pools"})
        for entry, parsed_entry in zip(normalized["models"], parsed.models, strict=True):
            entry["pools"] = _with_replicas(entry.get("pools", {}), parsed_entry.pools)
    name = args.name or metadata.get("name") or DEFAULT_NAME
    if not _NAME.match(name):
        raise InvalidRequestError(f"metadata.name: {name!r} must be a DNS label of at most 50 characters: "
                                  "lower-case letters, digits and '-', starting with a letter", param="name")
    metadata.update(name=name, namespace=args.namespace or metadata.get("namespace") or default_namespace)
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": normalized}


def _with_replicas(dumped: dict[str, Any], pools: Any) -> dict[str, Any]:
    """Each pool of a dumped `pools` with its replicas written (a default left out by the dump)."""
    return {pool: {"replicas": pool_spec.replicas, **dumped.get(pool, {})} for pool, pool_spec in pools.items()}


def _read_manifest(path: Path) -> dict[str, Any]:
    import yaml

    from dynserve.operator.spec import API_VERSION, KIND

    try:
        loaded = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise InvalidRequestError(f"--file: cannot read {path}: {exc.strerror}", param="file") from None
    except yaml.YAMLError as exc:
        problem = " ".join(str(exc).split())
        raise InvalidRequestError(f"--file: {path} is not YAML: {problem}", param="file") from None
    if not isinstance(loaded, dict):
        raise InvalidRequestError(f"--file: {path} holds no mapping", param="file")
    if "kind" not in loaded and "apiVersion" not in loaded:
        return {"spec": loaded}  # a bare spec
    if (loaded.get("apiVersion"), loaded.get("kind")) != (API_VERSION, KIND):
        raise InvalidRequestError(f"--file: {path} is a {loaded.get('apiVersion')} {loaded.get('kind')}, not a "
                                  f"{API_VERSION} {KIND}", param="file")
    unknown = set(loaded) - {"apiVersion", "kind", "metadata", "spec"}
    if unknown:
        raise InvalidRequestError(f"--file: unknown top-level field(s) {', '.join(sorted(unknown))}",
                                  param="file")
    return loaded


def _putter(patch: dict[str, Any]) -> Any:
    def put(path: str | tuple[str, ...], value: Any) -> None:  # "a.b.c", or a tuple when a key holds a dot
        *parents, leaf = path.split(".") if isinstance(path, str) else path
        node = patch
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value

    return put


def _source(model: str) -> dict[str, Any]:
    """A `--model` as a model source's merge patch: an http(s) URL is its uri, anything else its path."""
    is_url = re.match(r"^https?://", model) is not None
    return {"uri": model, "path": None} if is_url else {"path": model, "uri": None}


def _flag_spec(args: argparse.Namespace, file_spec: dict[str, Any]) -> dict[str, Any]:
    """The flags as a JSON merge patch (RFC 7386: None removes) over the file's spec."""
    patch: dict[str, Any] = {}
    put = _putter(patch)
    models = args.model or []
    if len(models) > 1 or args.served_model_name or file_spec.get("models") is not None:
        patch.update(models=_models(args, file_spec), model=None, pools=None)
    elif models:
        patch["model"] = _source(models[0])
    for path, value in (("engine.mocker", args.mocker), ("router.mode", args.router),
                        ("transfer.backend", args.transfer_backend), ("planner.ttftMs", args.ttft_ms),
                        ("planner.itlMs", args.itl_ms), ("gateway.serviceType", args.service_type)):
        if value is not None:
            put(path, value)
    if args.image is not None:
        repository, tag = _split_image(args.image)
        put("image.repository", repository)
        put("image.tag", tag)
    if args.redis or args.redis_url:
        put("eventPlane.backend", "redis")
    if args.redis_url:
        put("eventPlane.redisUrl", args.redis_url)
    if args.planner:
        put("planner.enabled", True)
    if args.api_key_secret:
        put("gateway.apiKeySecret.name", args.api_key_secret)
    if args.service_monitor:
        put("observability.serviceMonitor", True)
    if "models" not in patch:
        if args.dtype is not None:
            put("model.dtype", args.dtype)
        pools = _pools_patch(args, file_spec.get("pools") or {})
        if pools:
            patch["pools"] = pools
    return patch


def _pools_patch(args: argparse.Namespace, file_pools: dict[str, Any]) -> dict[str, Any]:
    """The layout, engine and per-pool flags as a merge patch over one model's `pools`."""
    patch: dict[str, Any] = {}
    put = _putter(patch)
    layout = _layout_patch(args)
    pools = _merge(file_pools, layout)
    if layout:
        patch["pools"] = layout
    _put_vllm(put, args, pools)
    for pool in [p for p in ("workers", "prefill", "decode") if pools.get(p) is not None] or ["workers"]:
        per_pool = {("resources", "limits", "nvidia.com/gpu"): args.gpus,
                    ("resources", "requests", "cpu"): args.cpus, ("resources", "requests", "memory"): args.memory,
                    ("minReplicas",): args.min_replicas, ("maxReplicas",): args.max_replicas}
        for path, value in per_pool.items():
            if value is not None:
                put(("pools", pool, *path), value)
    return dict(patch.get("pools") or {})


def _models(args: argparse.Namespace, file_spec: dict[str, Any]) -> list[dict[str, Any]]:
    """`spec.models` from the flags over the file's: `--model` given twice or more replaces the file's models
    (each on the file's pools, its first model's when it lists several); each model gets the layout and pool
    flags and `--dtype`; `--served-model-name` adds an alias to the model it names."""
    from dynserve.operator.spec import ModelSource, served_id

    file_models = [dict(entry) for entry in file_spec.get("models") or []]
    base_pools = file_spec.get("pools") or (file_models[0].get("pools") if file_models else None) or {}
    if len(args.model or []) > 1 or not file_models:  # the first model keeps the file's volume and dtype
        first = file_spec.get("model") or {}
        sources = [_merge(first if i == 0 else {}, _source(m)) for i, m in enumerate(args.model or [])] or [first]
        names: list[str] = []
        for i, source in enumerate(sources):  # two files of one name: spec.models says why that cannot be
            name = _model_name(source, i)
            names.append(f"{name[:17]}-{i}" if name in names else name)
        file_models = [{"name": name, "model": source, "pools": base_pools}
                       for name, source in zip(names, sources, strict=True)]
    elif args.model:
        raise InvalidRequestError("--model: the file serves several models (spec.models): give --model once for "
                                  "each model, or edit the file", param="model")
    ids = [served_id(ModelSource.model_validate({k: v for k, v in e.get("model", {}).items() if k in ("path", "uri")}))
           for e in file_models]
    for entry in file_models:
        given = entry.pop("pools", None) or {}
        pools = _merge(given, _pools_patch(args, given))
        if pools:  # none: the default pool of workers
            entry["pools"] = pools
        if args.dtype is not None:
            entry["model"] = {**(entry.get("model") or {}), "dtype": args.dtype}
    for alias in args.served_model_name or []:
        name, _, model_id = alias.partition("=")
        if model_id and model_id not in ids:
            raise InvalidRequestError(f"--served-model-name {alias}: no model {model_id!r} is given (the models: "
                                      f"{', '.join(str(i) for i in ids)})", param="served_model_name")
        entry = file_models[ids.index(model_id) if model_id else 0]
        entry["servedModelNames"] = [*entry.get("servedModelNames", []), name]
    return file_models


def _model_name(source: dict[str, Any], index: int) -> str:
    """A model's name in spec.models from its weights' id (lower case, '-' for anything else, 20 characters at
    most), `model-I` when that leaves none (the bundled model)."""
    from dynserve.operator.spec import ModelSource, served_id

    model_id = served_id(ModelSource.model_validate({k: v for k, v in source.items() if k in ("path", "uri")})) or ""
    name = re.sub(r"[^a-z0-9]+", "-", model_id.lower()).strip("-")
    name = re.sub(r"^[^a-z]+", "", name)[:20].rstrip("-")
    return name or f"model-{index}"


def _put_vllm(put: Any, args: argparse.Namespace, pools: dict[str, Any]) -> None:
    """The engine flags onto the workers pool (`--engine` onto each pool: a disaggregated one refuses vLLM,
    naming why); `--engine dynserve` drops the file's `vllm` block."""
    if args.engine is not None:
        for pool in [p for p in ("workers", "prefill", "decode") if pools.get(p) is not None] or ["workers"]:
            put(("pools", pool, "engine"), args.engine)
        if args.engine == "dynserve":
            put("pools.workers.vllm", None)
    given = {flag: value for flag, value in (("--vllm-image", args.vllm_image), ("--vllm-args", args.vllm_args),
                                             ("--vllm-block-size", args.vllm_block_size)) if value is not None}
    if not given:
        return
    if pools.get("workers") is None and (pools.get("prefill") is not None or pools.get("decode") is not None):
        raise InvalidRequestError(f"{', '.join(given)}: vLLM runs only in the aggregated workers pool (--workers N); "
                                  "a disaggregated pool moves KV pages between dynserve's own workers",
                                  param="vllm_image")
    if args.vllm_image is not None:
        image, _, digest = args.vllm_image.partition("@")
        put("pools.workers.vllm.image", image)
        put("pools.workers.vllm.digest", digest or None)
    if args.vllm_args is not None:
        try:
            put("pools.workers.vllm.args", shlex.split(args.vllm_args))
        except ValueError as exc:
            raise InvalidRequestError(f"--vllm-args: {exc}", param="vllm_args") from None
    if args.vllm_block_size is not None:
        put("pools.workers.vllm.blockSize", args.vllm_block_size)


def _layout_patch(args: argparse.Namespace) -> dict[str, Any]:
    disaggregated = args.prefill_workers is not None or args.decode_workers is not None
    if args.workers is not None and disaggregated:
        raise InvalidRequestError("give --workers (aggregated) or --prefill-workers and --decode-workers "
                                  "(disaggregated), not both", param="workers")
    if args.workers is not None:
        return {"workers": {"replicas": args.workers}, "prefill": None, "decode": None}
    layout: dict[str, Any] = {"workers": None} if disaggregated else {}
    for pool, replicas in (("prefill", args.prefill_workers), ("decode", args.decode_workers)):
        if replicas is not None:
            layout[pool] = {"replicas": replicas}
    return layout


def _split_image(image: str) -> tuple[str, str | None]:
    """"repo[:tag]" (a registry's port, host:5000/repo, is not a tag)."""
    repository, sep, tag = image.rpartition(":")
    if not sep or "/" in tag:
        return image, None
    return repository, tag


def _merge(target: Any, patch: Any) -> Any:
    """RFC 7386 merge: objects merge key by key, None removes a key, anything else replaces."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge(result.get(key), value)
    return result


# ---- the shells ---------------------------------------------------------------------------------------------

def deploy(args: argparse.Namespace) -> int:
    from dynserve.operator.kube import KubeClient, default_namespace

    if args.render and not args.dry_run:
        raise InvalidRequestError("--render needs --dry-run", param="render")
    if not args.timeout > 0:
        raise InvalidRequestError(f"--timeout must be more than 0 seconds, not {args.timeout:g}", param="timeout")
    namespace = default_namespace(kubeconfig=args.kubeconfig, context=args.context)
    resource = resource_from(args, namespace)
    if args.dry_run:
        _print_dry_run(resource, render=args.render, output=args.output)
        return EXIT_OK
    name, namespace = resource["metadata"]["name"], resource["metadata"]["namespace"]
    with KubeClient.connect(kubeconfig=args.kubeconfig, context=args.context) as client:
        applied = client.apply(resource, field_manager=FIELD_MANAGER)
        generation = applied["metadata"].get("generation")
        print(f"{resource['kind']} {namespace}/{name} applied (generation {generation})", file=sys.stderr,
              flush=True)
        if args.no_wait:
            final, result = applied, "applied"
        else:
            final, result = _follow(client, name, namespace, timeout_s=args.timeout)
    if args.output == "json":
        print(json.dumps(final, indent=2))
    view = view_of(final)
    if result == "ready":
        if args.output == "text":
            print(f"{resource['kind']} {namespace}/{name} is Ready: the OpenAI API is at "
                  f"{view.gateway_url or '-'}")
        return EXIT_OK
    if result == "applied":
        return EXIT_OK
    print(f"dynctl: {resource['kind']} {namespace}/{name} {_failure(view, result, args.timeout)}",
          file=sys.stderr)
    return EXIT_FAILURE


def _print_dry_run(resource: dict[str, Any], *, render: bool, output: str) -> None:
    import yaml

    documents = [resource]
    if render:
        from dynserve.operator.builders import build_children
        from dynserve.operator.spec import parse_deployment

        meta = resource["metadata"]
        documents += build_children(meta["name"], meta["namespace"], parse_deployment(resource["spec"]))
    if output == "json":
        print(json.dumps(documents if render else resource, indent=2))
    else:
        print(yaml.safe_dump_all(documents, sort_keys=False, width=120), end="")


def _follow(client: Any, name: str, namespace: str, *, timeout_s: float) -> tuple[dict[str, Any], str]:
    """Poll the resource until `outcome` decides or `timeout_s` passes: (the last object, "ready" | "failed" |
    "timeout"). A retryable API error is shown and retried; any other is raised."""
    from dynserve.operator.spec import API_VERSION, KIND

    deadline_s = time.monotonic() + timeout_s
    last: dict[str, Any] | None = None
    with Progress() as progress:
        while True:
            try:
                obj = client.get(API_VERSION, KIND, name, namespace)
            except KubernetesError as exc:
                if not exc.retryable:
                    raise
                progress.note(f"{exc} (retrying)")
            else:
                if obj is None:
                    raise KubernetesError(f"{KIND} {namespace}/{name} was deleted while dynctl waited for it",
                                          status=404, reason="NotFound")
                last = obj
                view = view_of(obj)
                progress.show(view)
                decided = outcome(view)
                if decided is not None:
                    return obj, decided
            remaining_s = deadline_s - time.monotonic()
            if remaining_s <= 0:
                if last is None:
                    raise KubernetesError(f"no answer from the Kubernetes API for {timeout_s:g} s", status=None)
                return last, "timeout"
            time.sleep(min(POLL_S, remaining_s))


def _failure(view: DeploymentView, result: str, timeout_s: float) -> str:
    degraded, ready = view.condition("Degraded"), view.condition("Ready")
    if result == "failed" and degraded is not None:
        return f"is Degraded ({degraded.reason}): {degraded.message}"
    where = progress_line(view).split(": ", 1)[1]
    detail = f"; Ready {ready.status} ({ready.reason})" if ready is not None and ready.reason else ""
    return f"was not Ready after {timeout_s:g} s ({where}{detail})"


def status(args: argparse.Namespace) -> int:
    from dynserve.operator.kube import KubeClient, default_namespace
    from dynserve.operator.spec import API_VERSION, KIND

    namespace = args.namespace or default_namespace(kubeconfig=args.kubeconfig, context=args.context)
    with KubeClient.connect(kubeconfig=args.kubeconfig, context=args.context) as client:
        obj = client.get(API_VERSION, KIND, args.name, namespace)
    if obj is None:
        print(f"dynctl: {KIND} {namespace}/{args.name} not found", file=sys.stderr)
        return EXIT_FAILURE
    if args.output == "json":
        print(json.dumps(obj, indent=2))
    else:
        console = Console()
        width = None if console.is_terminal else max(console.width, 160)  # to a pipe: whole rows
        console.print(render_view(view_of(obj)), width=width)
    return EXIT_OK


def delete(args: argparse.Namespace) -> int:
    from dynserve.operator.kube import KubeClient, default_namespace
    from dynserve.operator.spec import API_VERSION, KIND

    namespace = args.namespace or default_namespace(kubeconfig=args.kubeconfig, context=args.context)
    with KubeClient.connect(kubeconfig=args.kubeconfig, context=args.context) as client:
        if not client.delete(API_VERSION, KIND, args.name, namespace):
            print(f"dynctl: {KIND} {namespace}/{args.name} not found", file=sys.stderr)
            return EXIT_FAILURE
        deadline_s = time.monotonic() + args.timeout
        while args.wait and client.get(API_VERSION, KIND, args.name, namespace) is not None:
            if time.monotonic() >= deadline_s:
                print(f"dynctl: {KIND} {namespace}/{args.name} still exists after {args.timeout:g} s (its "
                      "children are being removed first)", file=sys.stderr)
                return EXIT_FAILURE
            time.sleep(POLL_S)
    print(f"{KIND} {namespace}/{args.name} deleted" + ("" if args.wait else " (its children follow)"))
    return EXIT_OK
