"""Offline throughput of the dynserve engine against Hugging Face `generate`, measured in one run.

What it measures (same model file, dtype, thread count and greedy decoding for every system):

1. **dynserve**: every request of the workload added at once, then `step()` until all finish (continuous
   batching). Reports generated tok/s (generated tokens / wall time), total time, TTFT p50 from the start,
   and the run's prefill rate (prompt tokens / time until the last request's first token).
2. **HF sequential**: `model.generate` one request at a time, the naive server.
3. **HF static batches**: `generate` on batches of 8 in arrival order, left padded. Each batch decodes to its
   longest output; only the tokens each request asked for count as useful output.
4. **Prefill**: one 512-token prompt, dynserve `compute_logits` vs one HF forward, best of a few each.

Requests use random token ids (no special ids) and `ignore_eos`, so every request yields exactly its output
length and no prefix is shared. Read `ratio_vs_hf_*` (dynserve tok/s / baseline tok/s) and
`prefill_ratio_vs_hf` (HF prefill time / dynserve prefill time): above 1 means dynserve is faster.
`workloads` says which requests each number came from; `greedy_match_requests` says how many of the HF
sequential requests produced the very tokens dynserve produced (a check that both did the same work).
`machine.load_avg_1m` (at the end) tells whether other work on the machine may have skewed the timings.

The full workload is 32 requests, prompts of 64..512 tokens, outputs of 32..128. `--quick` fits about 90 s
on a quiet 2-core CPU: the same length distributions but 8 requests (one static batch) for dynserve and HF
static, and the first 2 of them for HF sequential (its tok/s is a rate; a subset estimates it). With only
8 requests in flight dynserve batches less, so quick ratios understate the full run's.
The last stdout line is the JSON result; a copy goes to `benchmarks/results/engine-<timestamp>.json`.
Record a run in `docs/benchmarks.md` (engine), which keeps the history.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import best_time_s, git_commit, log, machine_info, percentile, write_result
from dynserve.config import Settings
from dynserve.engine.llm_engine import LLMEngine, torch_dtype
from dynserve.model.resolve import default_model_path
from dynserve.protocol import SamplingParams

NUM_SPECIAL_IDS = 17  # SmolLM2's special tokens are ids 0..16; prompts avoid them
STATIC_BATCH_SIZE = 8
PREFILL_LEN = 512


@dataclass(frozen=True, slots=True)
class Plan:
    """Workload sizes for one mode. Lengths are inclusive (low, high) ranges, drawn uniformly."""

    num_requests: int
    prompt_len_range: tuple[int, int]
    output_len_range: tuple[int, int]
    num_sequential_requests: int | None  # HF sequential runs this many of the requests; None: all
    sequential_max_output_len: int | None  # and caps their outputs at this; None: no cap
    num_prefill_repeats: int


FULL_PLAN = Plan(32, (64, 512), (32, 128), None, None, num_prefill_repeats=5)
QUICK_PLAN = Plan(8, (64, 512), (32, 128), 2, None, num_prefill_repeats=2)


@dataclass(frozen=True, slots=True)
class Workload:
    prompt_token_ids: list[list[int]]
    output_lens: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.output_lens)

    def head(self, num_requests: int | None, max_output_len: int | None) -> Workload:
        """The first `num_requests` requests, outputs capped at `max_output_len` (None: no limit)."""
        cap = max_output_len or max(self.output_lens)
        n = num_requests or self.num_requests
        return Workload(self.prompt_token_ids[:n], [min(o, cap) for o in self.output_lens[:n]])

    def describe(self) -> dict[str, Any]:
        prompt_lens = [len(p) for p in self.prompt_token_ids]
        return {
            "num_requests": self.num_requests,
            "prompt_len_min_max": [min(prompt_lens), max(prompt_lens)],
            "output_len_min_max": [min(self.output_lens), max(self.output_lens)],
            "num_prompt_tokens": sum(prompt_lens),
            "num_output_tokens": sum(self.output_lens),
        }


def make_workload(plan: Plan, vocab_size: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(plan.num_requests):
        prompt_len = rng.randint(*plan.prompt_len_range)
        prompts.append([rng.randrange(NUM_SPECIAL_IDS, vocab_size) for _ in range(prompt_len)])
        outputs.append(rng.randint(*plan.output_len_range))
    return Workload(prompts, outputs)


def _check_lengths(system: str, output_ids: list[list[int]], workload: Workload) -> None:
    """Rates compare only if every request produced exactly its output length."""
    got = [len(o) for o in output_ids]
    if got != workload.output_lens:
        raise RuntimeError(f"{system} produced {got} tokens, expected {workload.output_lens}")


def random_prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(NUM_SPECIAL_IDS, vocab_size) for _ in range(length)]


# ---- dynserve -----------------------------------------------------------------------------------------


def run_dynserve(engine: LLMEngine, workload: Workload) -> dict[str, Any]:
    """Add every request at once, step until all finish; rates, TTFTs and each request's output ids."""
    engine.reset_prefix_cache()
    cached_before = engine.stats.num_cached_prompt_tokens
    start = time.perf_counter()
    index_of = {}
    for i, (prompt, out_len) in enumerate(zip(workload.prompt_token_ids, workload.output_lens, strict=True)):
        params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
        index_of[engine.add_request(prompt, params)] = i
    output_ids: list[list[int]] = [[] for _ in range(workload.num_requests)]
    ttft_s: list[float | None] = [None] * workload.num_requests
    while engine.has_unfinished_requests():
        deltas = engine.step()
        now = time.perf_counter() - start
        for delta in deltas:
            i = index_of[delta.request_id]
            output_ids[i].extend(delta.token_ids)
            ttft_s[i] = now if ttft_s[i] is None else ttft_s[i]
    total_s = time.perf_counter() - start
    _check_lengths("dynserve", output_ids, workload)
    num_generated = sum(workload.output_lens)
    prompt_tokens = workload.describe()["num_prompt_tokens"]
    return {
        "tok_s": num_generated / total_s,
        "total_s": total_s,
        "num_generated_tokens": num_generated,
        "ttft_p50_ms": 1000 * percentile([t for t in ttft_s if t is not None], 50),
        "run_prefill_tok_s": prompt_tokens / max(t for t in ttft_s if t is not None),
        "num_cached_prompt_tokens": engine.stats.num_cached_prompt_tokens - cached_before,
        "output_ids": output_ids,
    }


def bench_dynserve(args: argparse.Namespace, plan: Plan) -> tuple[dict[str, Any], Workload, list[list[int]]]:
    settings = Settings(dtype=args.dtype, num_threads=args.threads, seed=args.seed)
    start = time.perf_counter()
    engine = LLMEngine(settings)
    log(f"dynserve loaded in {time.perf_counter() - start:.1f}s")
    vocab_size = engine.model_config.vocab_size
    workload = make_workload(replace(plan, num_requests=args.num_requests), vocab_size, args.seed)
    warm = make_workload(Plan(4, (16, 64), (4, 4), None, None, 1), vocab_size, args.seed + 1)
    run_dynserve(engine, warm)
    log(f"dynserve: {workload.num_requests} requests at once ...")
    run = run_dynserve(engine, workload)
    log(f"dynserve: {run['tok_s']:.1f} tok/s, {run['total_s']:.1f}s, TTFT p50 {run['ttft_p50_ms']:.0f} ms")
    prefill_ids = random_prompt(PREFILL_LEN, vocab_size, args.seed + 2)
    engine.compute_logits([prefill_ids])  # warm-up at this length
    prefill_s = best_time_s(lambda: engine.compute_logits([prefill_ids]), plan.num_prefill_repeats)
    log(f"dynserve prefill {PREFILL_LEN} tokens: {1000 * prefill_s:.0f} ms")
    output_ids = run.pop("output_ids")
    return {**run, "prefill_s": prefill_s}, workload, output_ids


# ---- Hugging Face baselines ---------------------------------------------------------------------------


def load_hf(dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    log(f"HF model loaded in {time.perf_counter() - start:.1f}s")
    return model


@torch.inference_mode()
def hf_generate(model: Any, prompts: list[list[int]], num_new_tokens: int) -> list[list[int]]:
    """Greedy `generate` of exactly `num_new_tokens` per prompt; a batch is left padded with a mask."""
    width = max(len(p) for p in prompts)
    pad_id = 0
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(
        input_ids=input_ids, attention_mask=attention_mask, do_sample=False, pad_token_id=pad_id,
        max_new_tokens=num_new_tokens, min_new_tokens=num_new_tokens,
    )
    return out[:, width:].tolist()


def run_hf_sequential(model: Any, workload: Workload) -> dict[str, Any]:
    start = time.perf_counter()
    output_ids = [hf_generate(model, [p], n)[0]
                  for p, n in zip(workload.prompt_token_ids, workload.output_lens, strict=True)]
    total_s = time.perf_counter() - start
    _check_lengths("HF sequential", output_ids, workload)
    num_generated = sum(workload.output_lens)
    return {"tok_s": num_generated / total_s, "total_s": total_s, "output_ids": output_ids}


def run_hf_static(model: Any, workload: Workload, batch_size: int) -> dict[str, Any]:
    # Each batch decodes to its longest request; tokens past a request's own length are wasted work, so
    # tok/s counts only the requested lengths (sum of output_lens / wall time), like a real static server.
    start = time.perf_counter()
    for first in range(0, workload.num_requests, batch_size):
        prompts = workload.prompt_token_ids[first:first + batch_size]
        hf_generate(model, prompts, max(workload.output_lens[first:first + batch_size]))
    total_s = time.perf_counter() - start
    return {"tok_s": sum(workload.output_lens) / total_s, "total_s": total_s}


@torch.inference_mode()
def hf_prefill(model: Any, prompt: list[int]) -> torch.Tensor:
    # logits_to_keep=1: only the last position's logits, as generate's prefill and compute_logits do.
    return model(input_ids=torch.tensor([prompt]), logits_to_keep=1).logits


def bench_hf(args: argparse.Namespace, plan: Plan, workload: Workload) -> tuple[dict[str, Any], Workload]:
    model = load_hf(torch_dtype(args.dtype))
    hf_generate(model, [random_prompt(32, model.config.vocab_size, args.seed + 1)] * 2, 4)  # warm-up
    sequential = workload.head(plan.num_sequential_requests, plan.sequential_max_output_len)
    log(f"HF sequential: {sequential.num_requests} requests one at a time ...")
    seq = run_hf_sequential(model, sequential)
    log(f"HF sequential: {seq['tok_s']:.1f} tok/s, {seq['total_s']:.1f}s")
    log(f"HF static batches of {STATIC_BATCH_SIZE}: {workload.num_requests} requests ...")
    static = run_hf_static(model, workload, STATIC_BATCH_SIZE)
    log(f"HF static: {static['tok_s']:.1f} useful tok/s, {static['total_s']:.1f}s")
    prefill_ids = random_prompt(PREFILL_LEN, model.config.vocab_size, args.seed + 2)
    hf_prefill(model, prefill_ids)  # warm-up at this length
    prefill_s = best_time_s(lambda: hf_prefill(model, prefill_ids), plan.num_prefill_repeats)
    log(f"HF prefill {PREFILL_LEN} tokens: {1000 * prefill_s:.0f} ms")
    result = {"sequential": seq, "static": static, "prefill_s": prefill_s,
              "attn_implementation": getattr(model.config, "_attn_implementation", None)}
    return result, sequential


# ---- report -------------------------------------------------------------------------------------------


def count_greedy_matches(dyn_output_ids: list[list[int]], hf_output_ids: list[list[int]]) -> int:
    """Requests whose HF tokens equal dynserve's first tokens (HF may have generated fewer)."""
    return sum(hf == dyn[:len(hf)] for dyn, hf in zip(dyn_output_ids, hf_output_ids))


def summarize(args: argparse.Namespace, plan: Plan, dyn: dict[str, Any], hf: dict[str, Any],
              workload: Workload, sequential: Workload, greedy_match: int) -> dict[str, Any]:
    seq, static = hf["sequential"], hf["static"]
    return {
        "benchmark": "engine", "quick": args.quick, "seed": args.seed, "dtype": args.dtype,
        "num_requests": workload.num_requests, "commit": git_commit(), "machine": machine_info(),
        "num_threads": torch.get_num_threads(), "model": default_model_path().name,
        "dynserve_tok_s": dyn["tok_s"], "dynserve_total_s": dyn["total_s"],
        "dynserve_ttft_p50_ms": dyn["ttft_p50_ms"], "dynserve_run_prefill_tok_s": dyn["run_prefill_tok_s"],
        "dynserve_num_cached_prompt_tokens": dyn["num_cached_prompt_tokens"],
        "hf_sequential_tok_s": seq["tok_s"], "hf_sequential_total_s": seq["total_s"],
        "hf_static_tok_s": static["tok_s"], "hf_static_total_s": static["total_s"],
        "hf_static_batch_size": STATIC_BATCH_SIZE, "hf_attn_implementation": hf["attn_implementation"],
        "ratio_vs_hf_sequential": dyn["tok_s"] / seq["tok_s"],
        "ratio_vs_hf_static": dyn["tok_s"] / static["tok_s"],
        "prefill_len": PREFILL_LEN,
        "dynserve_prefill_tok_s": PREFILL_LEN / dyn["prefill_s"],
        "hf_prefill_tok_s": PREFILL_LEN / hf["prefill_s"],
        "prefill_ratio_vs_hf": hf["prefill_s"] / dyn["prefill_s"],
        "greedy_match_requests": greedy_match, "greedy_compared_requests": sequential.num_requests,
        "workloads": {"dynserve": workload.describe(), "hf_static": workload.describe(),
                      "hf_sequential": sequential.describe(),
                      "prefill": {"prompt_len": PREFILL_LEN, "best_of": plan.num_prefill_repeats}},
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engine", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller workload that runs in about 90 s")
    parser.add_argument("--seed", type=int, default=0, help="seed for prompts and lengths (default 0)")
    parser.add_argument("--num-requests", type=int, default=None,
                        help=f"requests in the workload (default {FULL_PLAN.num_requests}, "
                             f"--quick {QUICK_PLAN.num_requests})")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads for every system (default: torch's choice)")
    parser.add_argument("--output", type=Path, default=None, help="result file (default benchmarks/results/)")
    args = parser.parse_args(argv)
    plan = QUICK_PLAN if args.quick else FULL_PLAN
    args.num_requests = args.num_requests or plan.num_requests
    if args.num_requests < 1:
        parser.error("--num-requests must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    plan = QUICK_PLAN if args.quick else FULL_PLAN
    torch.manual_seed(args.seed)
    args.threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(args.threads)  # the same for every system measured
    log(f"{'quick' if args.quick else 'full'} run, seed {args.seed}, {args.dtype}, {args.threads} threads")
    start = time.perf_counter()
    dyn, workload, dyn_output_ids = bench_dynserve(args, plan)
    hf, sequential = bench_hf(args, plan, workload)
    greedy_match = count_greedy_matches(dyn_output_ids, hf["sequential"].pop("output_ids"))
    result = summarize(args, plan, dyn, hf, workload, sequential, greedy_match)
    result["wall_s"] = time.perf_counter() - start
    write_result("engine", result, args.output)
    return result


if __name__ == "__main__":
    main()
