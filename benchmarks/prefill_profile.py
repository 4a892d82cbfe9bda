"""Where a bf16 prefill's time goes on this CPU (issue 39), against the CPU's measured bf16 multiply-add peak.

For each prompt length (128, 512 and 2,048 tokens by default: random token ids, prefix caching off, one
output token) the engine prefills two warm-up prompts, then times `--repeats` prefills while every op the
model calls is timed on the engine's thread, in `benchmarks.decode_step`'s groups: `linear` (the layers'
four projections), `logits` (the LM head), `attention` (the cache write and the attention), `norms`,
`rope`, `silu_mul`; `other` is the rest (embedding, step inputs, sampling, scheduling, Python). A prompt of
up to `max_num_batched_tokens` (1,024) prefills in one step, a longer one in chunks.

The peak: `vdpbf16ps` on 512-bit registers with 24 independent accumulators and every operand in
registers (the linear kernel's tile with its loads taken away, so only the instruction's throughput bounds
it), on one thread and on all of torch's threads; built by torch's extension builder on first use (about
30 s) and skipped on a CPU without AVX512-BF16. Reported against it: the linears' FLOP/s (2 x rows x in x
out over every layer's projections) and the attention's (causal QK and PV over every head and layer).

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.prefill_profile [--quick] [--tokens 128 512 2048]

The last stdout line is the JSON result (a copy goes to `benchmarks/results/prefill_profile-<timestamp>.json`):
`peak_gflops` (by thread count), and per length under `prefills`: `ms_p50`, `tok_s`, `parts_ms`,
`linear_gflops`, `linear_of_peak`, `attention_gflops`, `attention_of_peak`. The profile and what was tried
on it: `docs/prefill.md`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import git_commit, log, machine_info, write_result
from benchmarks.decode_step import NUM_SPECIAL_IDS, OP_GROUPS, OpTimer
from dynserve.config import Settings
from dynserve.engine.kernels import cpu_native, torch_attention
from dynserve.engine.llm_engine import LLMEngine
from dynserve.engine.loader import ModelConfig
from dynserve.protocol import SamplingParams

_PEAK_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <atomic>

// Every thread: `iters` x (6 broadcast rows x 4 weight panels) vdpbf16ps into 24 accumulators.
double bf16_peak_loop(int64_t iters) {
  std::atomic<int64_t> sink{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    __m512 a[24];
    for (int i = 0; i < 24; ++i) a[i] = _mm512_set1_ps(float(i));
    __m512bh w[4], x[6];
    for (int i = 0; i < 4; ++i) w[i] = (__m512bh)_mm512_set1_epi32(0x3f803f81 + i);
    for (int i = 0; i < 6; ++i) x[i] = (__m512bh)_mm512_set1_epi32(0x3c003c00 + i);
    for (int64_t it = 0; it < iters; ++it)
      for (int m = 0; m < 6; ++m)
        for (int b = 0; b < 4; ++b) a[m * 4 + b] = _mm512_dpbf16_ps(a[m * 4 + b], w[b], x[m]);
    __m512 s = a[0];
    for (int i = 1; i < 24; ++i) s = _mm512_add_ps(s, a[i]);
    sink += int64_t(_mm512_reduce_add_ps(s));  // keeps the loop
  });
  return double(sink.load());
}
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.prefill_profile", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 timed prefills a length instead of 7")
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--output", type=Path, default=None)
    return parser.parse_args(argv)


def bf16_peak_gflops() -> dict[int, float]:
    """The best of three runs of the peak loop, GFLOP/s, on 1 thread and on all of torch's; {} without
    AVX512-BF16."""
    kernels = cpu_native.load()
    if kernels is None or not kernels.has_avx512_bf16():
        return {}
    from torch.utils.cpp_extension import load_inline

    module = load_inline("dynserve_bf16_peak", cpp_sources=_PEAK_SOURCE, functions=["bf16_peak_loop"],
                         extra_cflags=["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"],
                         extra_ldflags=["-fopenmp"])
    threads = torch.get_num_threads()
    peaks: dict[int, float] = {}
    iters = 2_000_000
    try:
        for num_threads in sorted({1, threads}):
            torch.set_num_threads(num_threads)
            module.bf16_peak_loop(1000)
            best = 0.0
            for _ in range(3):
                start = time.perf_counter()
                module.bf16_peak_loop(iters)
                best = max(best, iters * 24 * 64 * num_threads / (time.perf_counter() - start) / 1e9)
            peaks[num_threads] = best
    finally:
        torch.set_num_threads(threads)
    return peaks


def flops(config: ModelConfig, num_tokens: int) -> tuple[float, float]:
    """(the layers' linears, the causal attention) FLOPs of prefilling `num_tokens` from position 0."""
    hidden, head_dim = config.hidden_size, config.head_dim
    q_dim, kv_dim = config.num_heads * head_dim, config.num_kv_heads * head_dim
    per_layer = hidden * (q_dim + 2 * kv_dim) + q_dim * hidden + 3 * hidden * config.intermediate_size
    linear = 2.0 * num_tokens * per_layer * config.num_layers
    attention = 4.0 * head_dim * config.num_heads * num_tokens * (num_tokens + 1) / 2 * config.num_layers
    return linear, attention


def measure(engine: LLMEngine, num_tokens: int, repeats: int, seed: int = 0) -> dict[str, Any]:
    ops = engine.model.step_ops()
    timer = OpTimer()
    originals = {name: getattr(ops, name) for name in OP_GROUPS}
    for name, group in OP_GROUPS.items():
        setattr(ops, name, timer.wrap(originals[name], group))
    attention_forward = torch_attention.forward
    torch_attention.forward = timer.wrap(attention_forward, "attention")
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size

    def prefill() -> float:
        prompt = [rng.randrange(NUM_SPECIAL_IDS, vocab) for _ in range(num_tokens)]
        start = time.perf_counter()
        engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True, temperature=0))
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - start

    try:
        for _ in range(2):
            prefill()
        timer.on = True
        times_s = [prefill() for _ in range(repeats)]
        timer.on = False
    finally:
        torch_attention.forward = attention_forward
        for name, fn in originals.items():
            setattr(ops, name, fn)
    mean_ms = 1000 * statistics.mean(times_s)
    parts_ms = {group: 1000 * total / repeats for group, total in sorted(timer.totals.items())}
    parts_ms["other"] = mean_ms - sum(parts_ms.values())
    linear_flops, attention_flops = flops(engine.model_config, num_tokens)
    return {"tokens": num_tokens, "ms_p50": 1000 * statistics.median(times_s), "ms_mean": mean_ms,
            "tok_s": num_tokens / statistics.median(times_s),
            "parts_ms": {k: round(v, 2) for k, v in parts_ms.items()},
            "linear_gflops": linear_flops / (parts_ms["linear"] / 1000) / 1e9,
            "attention_gflops": attention_flops / (parts_ms["attention"] / 1000) / 1e9}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 7)
    peaks = bf16_peak_gflops()
    log(f"bf16 multiply-add peak (GFLOP/s by threads): {({k: round(v) for k, v in peaks.items()})}")
    engine = LLMEngine(Settings(dtype="bfloat16", enable_prefix_caching=False))
    threads = torch.get_num_threads()
    prefills = []
    for num_tokens in args.tokens:
        run = measure(engine, num_tokens, repeats)
        if threads in peaks:
            run["linear_of_peak"] = run["linear_gflops"] / peaks[threads]
            run["attention_of_peak"] = run["attention_gflops"] / peaks[threads]
        log(f"{num_tokens:>5} tokens: {run['ms_p50']:.1f} ms ({run['tok_s']:.0f} tok/s), linears "
            f"{run['linear_gflops']:.0f} GFLOP/s, attention {run['attention_gflops']:.0f}: {run['parts_ms']}")
        prefills.append(run)
    result: dict[str, Any] = {
        "benchmark": "prefill_profile", "commit": git_commit(), "quick": args.quick, "repeats": repeats,
        "torch_threads": threads, "step_ops": engine.model.step_ops().name,
        "peak_gflops": {str(k): v for k, v in peaks.items()}, "prefills": prefills, "machine": machine_info(),
    }
    write_result("prefill_profile", result, args.output)
    return result


if __name__ == "__main__":
    main()
