"""Where a bf16 decode step's time goes on CPU, with the native kernels (`kernels.cpu_ops.NativeBf16Ops` and
the C++ paged decode attention) and with eager torch (`TorchOps` and torch's gather + SDPA attention, the
path before the kernels: the baseline) in the same run.

For each implementation and batch size (1 and 16 sequences of 256-token random prompts, greedy), the
engine prefills the batch, decodes a few warm-up steps, and then times decode steps while every op the
model calls is timed on the engine's thread:
- `linear` (the 30 layers' four projections), `logits` (the LM head), `attention` (cache write and paged
  decode attention), `norms` (RMSNorm with the residual add), `rope`, `silu_mul`;
- `other`: the rest of the step (embedding, step inputs and block tables, sampling, scheduling, Python).

Step times are medians over the timed steps (each op's share is its total over the timed steps / steps).
The weight-streaming bound of a batch-1 step (weight bytes / memory read bandwidth, measured here) is
reported with them. `speedup_b1` and `speedup_b16` are torch's step time over the native one.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.decode_step [--quick]

The last stdout line is the JSON result (a copy goes to `benchmarks/results/decode_step-<timestamp>.json`).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import git_commit, log, machine_info, write_result
from dynserve.config import Settings
from dynserve.engine.kernels import cpu_ops, torch_attention
from dynserve.engine.llm_engine import LLMEngine, load_model
from dynserve.protocol import SamplingParams

PROMPT_TOKENS = 256
NUM_SPECIAL_IDS = 17  # prompts avoid SmolLM2's special tokens
OP_GROUPS = {"linear": "linear", "logits": "logits", "rms_norm": "norms", "add_rms_norm": "norms",
              "rope_qkv": "rope", "rope_tables": "rope", "silu_mul": "silu_mul"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode_step", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer timed steps (about a minute)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--output", type=Path, default=None)
    return parser.parse_args(argv)


class OpTimer:
    """Seconds spent in wrapped callables, by group, while `on`; a wrapped call inside another (an op built
    from other ops) counts only in the outer one."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.on = False
        self._depth = 0

    def wrap(self, fn: Callable[..., Any], group: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on or self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[group] += time.perf_counter() - start
                self._depth -= 1

        return timed


def measure(native: bool, batch_size: int, num_steps: int, seed: int = 0) -> dict[str, Any]:
    """Median decode-step time and each op group's mean share, for one implementation and batch size."""
    cpu_ops.USE_NATIVE_OPS = native
    torch_attention.USE_NATIVE_DECODE = native
    settings = Settings(dtype="bfloat16", enable_prefix_caching=False)
    engine = LLMEngine(settings, loaded=load_model(settings))
    ops = engine.model.step_ops()
    timer = OpTimer()
    for name, group in OP_GROUPS.items():
        setattr(ops, name, timer.wrap(getattr(ops, name), group))
    attention_forward = torch_attention.forward
    torch_attention.forward = timer.wrap(attention_forward, "attention")
    try:
        rng = random.Random(seed)
        vocab = engine.model_config.vocab_size
        for _ in range(batch_size):
            prompt = [rng.randrange(NUM_SPECIAL_IDS, vocab) for _ in range(PROMPT_TOKENS)]
            engine.add_request(prompt, SamplingParams(max_tokens=num_steps + 64, ignore_eos=True, temperature=0))
        scheduler = engine.scheduler
        while scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in scheduler.running):
            engine.step()  # prefill (chunked)
        for _ in range(8):
            engine.step()
        step_s: list[float] = []
        timer.on = True
        for _ in range(num_steps):
            start = time.perf_counter()
            engine.step()
            step_s.append(time.perf_counter() - start)
        timer.on = False
    finally:
        torch_attention.forward = attention_forward
        cpu_ops.USE_NATIVE_OPS = torch_attention.USE_NATIVE_DECODE = True
    parts_ms = {group: 1000 * total / num_steps for group, total in sorted(timer.totals.items())}
    mean_step_ms = 1000 * sum(step_s) / num_steps
    parts_ms["other"] = mean_step_ms - sum(parts_ms.values())
    return {"ops": ops.name, "batch_size": batch_size, "step_ms_p50": 1000 * statistics.median(step_s),
            "step_ms_mean": mean_step_ms, "parts_ms": {k: round(v, 3) for k, v in parts_ms.items()}}


def weight_bytes_and_bandwidth() -> tuple[int, float]:
    from benchmarks.vs_vllm import measure_bandwidth

    settings = Settings(dtype="bfloat16")
    model = load_model(settings).model
    num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return num_bytes, measure_bandwidth()["read_gbs"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    num_steps = 16 if args.quick else 64
    num_bytes, read_gbs = weight_bytes_and_bandwidth()
    bound_ms = 1000 * num_bytes / (read_gbs * 1e9)
    log(f"{num_bytes / 1e6:.0f} MB of weights at {read_gbs:.1f} GB/s: a batch-1 step streams them in {bound_ms:.1f} ms")
    runs = []
    for batch_size in args.batch_sizes:
        for native in (False, True):
            run = measure(native, batch_size, num_steps)
            log(f"{run['ops']:>11} batch {batch_size:>2}: step p50 {run['step_ms_p50']:.1f} ms  {run['parts_ms']}")
            runs.append(run)
    result: dict[str, Any] = {
        "benchmark": "decode_step", "commit": git_commit(), "quick": args.quick, "steps": num_steps,
        "prompt_tokens": PROMPT_TOKENS, "weight_bytes": num_bytes, "bandwidth_gbs": read_gbs,
        "step_bound_ms": bound_ms, "runs": runs, "torch_threads": torch.get_num_threads(),
    }
    for batch_size in args.batch_sizes:
        by_ops = {r["ops"]: r["step_ms_p50"] for r in runs if r["batch_size"] == batch_size}
        if "torch" in by_ops and "native-bf16" in by_ops:
            result[f"speedup_b{batch_size}"] = by_ops["torch"] / by_ops["native-bf16"]
            result[f"step_ms_b{batch_size}"] = by_ops["native-bf16"]
    result["step_over_bound_b1"] = result.get("step_ms_b1", float("nan")) / bound_ms
    result["machine"] = machine_info()
    write_result("decode_step", result, args.output)
    return result


if __name__ == "__main__":
    main()
