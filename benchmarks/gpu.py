"""The built-in engine on a GPU: its attention kernels and its decode against this run's ceilings and peers.

    python -m benchmarks.gpu [--quick] [--out DIR]      # on a CUDA machine (scripts/gpu-run.sh runs it)
    python -m benchmarks.gpu --smoke                     # on the CPU: tiny shapes, checks the script runs

Llama-3.1-8B-shaped random bf16 weights are built on the device (no checkpoint travels). Measured, each
as the median of timed repeats (CUDA events; a warm-up first):

1. ceiling: a device-to-device copy's bandwidth (bytes read + written per second);
2. paged decode attention (batch 64, context 4,096, 32 query / 8 KV heads x 128, block 16): bytes of K and
   V read per second over the copy bandwidth, for the default launch parameters and the best of a small
   sweep; beside torch SDPA over K/V already gathered (and gather + SDPA), and FlexAttention's paged
   attention where this torch has it;
3. prefill attention over 4,096 fresh tokens: time of torch SDPA's flash backend over ours;
4. the engine (CUDA graphs, sampling on the device) generating at batch 1, 16 and 64, against
   `transformers` `generate` with the same static batch (tokens/s, prefill included; each the better of
   two runs), the decode step of both at batch 1 and 64, and the engine's batch-1 step against the
   weight-streaming bound (weight bytes / copy bandwidth).

The last stdout line is the JSON result (also written under --out, with a PNG of tokens/s by batch).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._common import git_commit, log, machine_info, write_result

TARGETS = {"decode_vs_copy": 0.7, "prefill_vs_flash": 0.8, "engine_b64_vs_hf": 3.0, "b1_step_vs_bound_max": 1.5}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer tokens and no launch-parameter sweep")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreted)")
    parser.add_argument("--out", type=Path, default=None, help="directory for gpu.json and gpu-engine.png")
    args = parser.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of triton
    import torch

    if torch.cuda.is_available() and not args.smoke:
        device = torch.device("cuda")
    elif args.smoke:
        device = torch.device("cpu")
    else:
        sys.exit("benchmarks.gpu needs a CUDA device (or --smoke, on the CPU)")
    out = args.out
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    bench = GpuBench(device, quick=args.quick or args.smoke, smoke=args.smoke)
    result = bench.run(out / "gpu-partial.json" if out else None)
    if out is not None:
        bench.plot(result, out / "gpu-engine.png")
    write_result("gpu", result, out / "gpu.json" if out else None)


class GpuBench:
    def __init__(self, device: Any, *, quick: bool, smoke: bool) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.quick = quick
        self.smoke = smoke
        self.cuda = device.type == "cuda"
        if smoke:  # every shape tiny: the script's logic, not its numbers
            self.attn = {"batch": 4, "context": 64, "heads": 4, "kv_heads": 2, "head_dim": 32, "block": 16}
            self.prefill_len = 64
        else:
            self.attn = {"batch": 64, "context": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "block": 16}
            self.prefill_len = 4096

    # ---- timing ----------------------------------------------------------------------------------------

    def time_ms(self, fn: Callable[[], object], repeats: int = 20, warmup: int = 3) -> float:
        """Median milliseconds of `fn` (CUDA events around each call on a GPU)."""
        torch = self.torch
        repeats, warmup = (2, 1) if self.smoke else (repeats, warmup)
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def wall_s(self, fn: Callable[[], object]) -> float:
        if self.cuda:
            self.torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if self.cuda:
            self.torch.cuda.synchronize()
        return time.perf_counter() - t0

    # ---- the run -----------------------------------------------------------------------------------------

    def run(self, partial: Path | None = None) -> dict[str, Any]:
        """Every part in turn; with `partial`, the result so far is written there after each (a run cut
        short by its time limit still leaves its numbers)."""
        torch = self.torch
        import triton

        result: dict[str, Any] = {
            "benchmark": "gpu", "commit": git_commit(), "machine": machine_info(), "quick": self.quick,
            "smoke": self.smoke, "device": torch.cuda.get_device_name(0) if self.cuda else "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "targets": TARGETS,
        }
        copy_gbps = self.copy_bandwidth()
        result["copy_gbps"] = copy_gbps
        log(f"device-to-device copy: {copy_gbps:.0f} GB/s (read + written)")
        for name, step in (("decode_attention", self.decode_attention), ("prefill_attention", self.prefill),
                           ("engine", self.engine), ("flex_paged_decode", self.flex_paged_decode)):
            try:
                result[name] = step(copy_gbps)
            except Exception as exc:  # one failed part still leaves the others' numbers
                log(f"{name} failed: {exc!r}\n{traceback.format_exc()}")
                result[name] = {"error": repr(exc)}
            if partial is not None:
                partial.write_text(json.dumps(result, sort_keys=True, default=str) + "\n")
        result["verdict"] = self.verdict(result)
        return result

    def verdict(self, result: dict[str, Any]) -> dict[str, Any]:
        decode = result.get("decode_attention", {})
        prefill = result.get("prefill_attention", {})
        engine = result.get("engine", {})
        ratios = {
            "decode_vs_copy": decode.get("best_vs_copy"),
            "prefill_vs_flash": prefill.get("best_vs_flash"),
            "engine_b64_vs_hf": (engine.get("speedup_vs_hf") or {}).get("64"),
            "b1_step_vs_bound": engine.get("b1_step_vs_bound"),
        }
        met = {
            "decode_vs_copy": _at_least(ratios["decode_vs_copy"], TARGETS["decode_vs_copy"]),
            "prefill_vs_flash": _at_least(ratios["prefill_vs_flash"], TARGETS["prefill_vs_flash"]),
            "engine_b64_vs_hf": _at_least(ratios["engine_b64_vs_hf"], TARGETS["engine_b64_vs_hf"]),
            "b1_step_vs_bound": None if ratios["b1_step_vs_bound"] is None
            else ratios["b1_step_vs_bound"] <= TARGETS["b1_step_vs_bound_max"],
        }
        return {"ratios": ratios, "met": met}

    def copy_bandwidth(self) -> float:
        torch = self.torch
        num_bytes = (64 if self.smoke else 4096) * 2**20
        src = torch.randn(num_bytes // 4, device=self.device)
        dst = torch.empty_like(src)
        ms = self.time_ms(lambda: dst.copy_(src))
        return 2 * num_bytes / (ms * 1e-3) / 1e9

    # ---- attention ---------------------------------------------------------------------------------------

    def decode_attention(self, copy_gbps: float) -> dict[str, Any]:
        torch = self.torch
        from dynserve.engine.kernels import AttentionMetadata, triton_attention

        a = self.attn
        batch, ctx, heads, kv_heads, dim, block = (a["batch"], a["context"], a["heads"], a["kv_heads"],
                                                   a["head_dim"], a["block"])
        dtype = torch.bfloat16
        blocks_per_seq = ctx // block
        num_blocks = batch * blocks_per_seq
        cache = torch.randn((num_blocks, 1, 2, block, kv_heads, dim), dtype=dtype, device=self.device)
        tables = torch.randperm(num_blocks).view(batch, blocks_per_seq)
        meta = AttentionMetadata.build([1] * batch, [ctx] * batch, tables.tolist(), block, self.device)
        q = torch.randn((batch, heads, dim), dtype=dtype, device=self.device)
        k = torch.randn((batch, kv_heads, dim), dtype=dtype, device=self.device)
        v = torch.randn_like(k)
        scale = dim**-0.5
        kv_bytes = 2 * batch * ctx * kv_heads * dim * cache.element_size()

        def ours() -> object:
            return triton_attention.forward(q, k, v, cache, 0, meta, scale)

        sweep = self.sweep(ours, [
            {"decode_block_n": 64, "decode_num_warps": 4, "decode_num_stages": 3},
            {"decode_block_n": 128, "decode_num_warps": 4, "decode_num_stages": 3},
            {"decode_block_n": 64, "decode_num_warps": 8, "decode_num_stages": 3},
            {"decode_block_n": 32, "decode_num_warps": 4, "decode_num_stages": 4},
            {"decode_block_n": 128, "decode_num_warps": 8, "decode_num_stages": 2},
            {"decode_block_n": 64, "decode_num_warps": 4, "decode_num_stages": 2},
        ])
        default_ms, best = sweep["default_ms"], sweep["best"]
        out: dict[str, Any] = {
            "shape": a, "kv_bytes": kv_bytes, "default_ms": default_ms,
            "default_gbps": kv_bytes / (default_ms * 1e-3) / 1e9,
            "default_vs_copy": kv_bytes / (default_ms * 1e-3) / 1e9 / copy_gbps,
            "best": best, "best_vs_copy": kv_bytes / (best["ms"] * 1e-3) / 1e9 / copy_gbps, "sweep": sweep["runs"],
        }
        log(f"decode attention: {default_ms:.3f} ms default ({out['default_vs_copy']:.2f} of copy), best "
            f"{best['ms']:.3f} ms ({out['best_vs_copy']:.2f}) with {best['tuning']}")
        # torch SDPA over K/V gathered into [batch, kv_heads, ctx, dim]
        index = tables.flatten().to(self.device)

        def gather() -> tuple[Any, Any]:
            kg = cache[index, 0, 0].view(batch, ctx, kv_heads, dim).transpose(1, 2)
            vg = cache[index, 0, 1].view(batch, ctx, kv_heads, dim).transpose(1, 2)
            return kg, vg

        kg, vg = gather()
        q4 = q.unsqueeze(2)

        def sdpa() -> object:
            return torch.nn.functional.scaled_dot_product_attention(q4, kg, vg, scale=scale, enable_gqa=True)

        out["sdpa_gathered_ms"] = self.time_ms(sdpa)
        out["gather_plus_sdpa_ms"] = self.time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
            q4, *gather(), scale=scale, enable_gqa=True))
        log(f"decode: SDPA over gathered K/V {out['sdpa_gathered_ms']:.3f} ms, gather + SDPA "
            f"{out['gather_plus_sdpa_ms']:.3f} ms")
        return out

    def flex_paged_decode(self, copy_gbps: float) -> dict[str, Any]:
        """FlexAttention over its own paged layout (torch's experimental PagedAttention, pages of 128), on
        the decode shape; last in the run, since compiling it takes the longest."""
        torch = self.torch
        if not self.cuda or self.quick:
            return {"skipped": "quick or no CUDA"}
        a = self.attn
        batch, ctx, heads, kv_heads, dim = a["batch"], a["context"], a["heads"], a["kv_heads"], a["head_dim"]
        q4 = torch.randn((batch, heads, 1, dim), dtype=torch.bfloat16, device=self.device)
        scale = dim**-0.5
        try:
            from torch.nn.attention.experimental._paged_attention import PagedAttention
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        except ImportError as exc:
            return {"unavailable": repr(exc)}
        try:
            page = 128
            n_pages = batch * ctx // page
            paged = PagedAttention(n_pages, page, batch, device=str(self.device))
            for b in range(batch):
                paged.reserve(torch.tensor(b, device=self.device), torch.tensor(ctx, device=self.device))
            k_cache = torch.randn((1, kv_heads, n_pages * page, dim), dtype=q4.dtype, device=self.device)
            v_cache = torch.randn_like(k_cache)

            def everything(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                return kv_idx >= 0

            logical = create_block_mask(everything, batch, None, 1, ctx, device=str(self.device),
                                        BLOCK_SIZE=(1, page))
            physical = paged.convert_logical_block_mask(logical)
            compiled = torch.compile(flex_attention)

            def flex() -> object:
                return compiled(q4, k_cache, v_cache, block_mask=physical, scale=scale, enable_gqa=True)

            ms = self.time_ms(flex)
            kv_bytes = 2 * batch * ctx * kv_heads * dim * k_cache.element_size()
            gbps = kv_bytes / (ms * 1e-3) / 1e9
            log(f"FlexAttention paged decode: {ms:.3f} ms ({gbps / copy_gbps:.2f} of copy)")
            return {"ms": ms, "gbps": gbps, "vs_copy": gbps / copy_gbps, "page": page}
        except Exception as exc:  # an experimental API: report what it said
            return {"error": repr(exc)}

    def prefill(self, copy_gbps: float) -> dict[str, Any]:
        torch = self.torch
        import torch.nn.functional as F

        from dynserve.engine.kernels import AttentionMetadata, triton_attention

        a = self.attn
        length, heads, kv_heads, dim, block = self.prefill_len, a["heads"], a["kv_heads"], a["head_dim"], a["block"]
        dtype = torch.bfloat16
        num_blocks = length // block
        cache = torch.randn((num_blocks, 1, 2, block, kv_heads, dim), dtype=dtype, device=self.device)
        table = torch.randperm(num_blocks).tolist()
        meta = AttentionMetadata.build([length], [length], [table], block, self.device)
        q = torch.randn((length, heads, dim), dtype=dtype, device=self.device)
        k = torch.randn((length, kv_heads, dim), dtype=dtype, device=self.device)
        v = torch.randn_like(k)
        scale = dim**-0.5
        flops = 4 * heads * dim * length * (length + 1) / 2  # QK^T and PV over the causal half

        def ours() -> object:
            return triton_attention.forward(q, k, v, cache, 0, meta, scale)

        sweep = self.sweep(ours, [
            {"prefill_max_block_m": 128, "prefill_block_n": 128, "prefill_num_warps": 8, "prefill_num_stages": 2},
            {"prefill_max_block_m": 128, "prefill_block_n": 64, "prefill_num_warps": 8, "prefill_num_stages": 3},
            {"prefill_max_block_m": 64, "prefill_block_n": 64, "prefill_num_warps": 4, "prefill_num_stages": 3},
            {"prefill_max_block_m": 128, "prefill_block_n": 64, "prefill_num_warps": 4, "prefill_num_stages": 3},
            {"prefill_max_block_m": 128, "prefill_block_n": 32, "prefill_num_warps": 4, "prefill_num_stages": 4},
            {"prefill_max_block_m": 64, "prefill_block_n": 128, "prefill_num_warps": 4, "prefill_num_stages": 2},
        ])
        out: dict[str, Any] = {"length": length, "default_ms": sweep["default_ms"], "best": sweep["best"],
                               "sweep": sweep["runs"],
                               "default_tflops": flops / (sweep["default_ms"] * 1e-3) / 1e12}
        q4 = q.transpose(0, 1).unsqueeze(0)
        group = heads // kv_heads
        k4 = k.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0).contiguous()
        v4 = v.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0).contiguous()

        def flash() -> object:
            return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale)

        if self.cuda:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                out["flash_ms"] = self.time_ms(flash)
        else:
            out["flash_ms"] = self.time_ms(flash)
        out["flash_tflops"] = flops / (out["flash_ms"] * 1e-3) / 1e12
        out["default_vs_flash"] = out["flash_ms"] / sweep["default_ms"]
        out["best_vs_flash"] = out["flash_ms"] / sweep["best"]["ms"]
        log(f"prefill attention over {length}: ours {sweep['default_ms']:.3f} ms default, best "
            f"{sweep['best']['ms']:.3f} ms; SDPA flash {out['flash_ms']:.3f} ms "
            f"(best/flash speed {out['best_vs_flash']:.2f})")
        return out

    def sweep(self, fn: Callable[[], object], tunings: list[dict[str, int]]) -> dict[str, Any]:
        """Time `fn` under each launch tuning (the first is the default; --quick times only it)."""
        from dynserve.engine.kernels import triton_attention

        default = triton_attention.TUNING
        runs = []
        for i, fields in enumerate(tunings[:1] if self.quick else tunings):
            triton_attention.TUNING = _replace(default, fields)
            try:
                runs.append({"tuning": fields, "ms": self.time_ms(fn)})
            except Exception as exc:  # a launch that does not fit (shared memory, registers) is reported
                runs.append({"tuning": fields, "error": repr(exc)})
            finally:
                triton_attention.TUNING = default
            if i == 0 and "ms" not in runs[0]:
                raise RuntimeError(f"the default launch failed: {runs[0]['error']}")
        timed = [r for r in runs if "ms" in r]
        return {"default_ms": runs[0]["ms"], "best": min(timed, key=lambda r: r["ms"]), "runs": runs}

    # ---- the engine --------------------------------------------------------------------------------------

    def engine(self, copy_gbps: float) -> dict[str, Any]:
        torch = self.torch
        import transformers

        from benchmarks._random_models import LLAMA_3_1_8B, write_byte_tokenizer
        from dynserve.config import Settings
        from dynserve.engine.llm_engine import LLMEngine, LoadedModel
        from dynserve.engine.loader import ModelConfig
        from dynserve.engine.models.decoder import CausalLM
        from dynserve.model.tokenizer import Tokenizer
        from dynserve.protocol import SamplingParams

        shape = dict(LLAMA_3_1_8B)
        if self.smoke:
            shape |= {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
        prompt_len, new_tokens = (16, 4) if self.smoke else (128, 32) if self.quick else (512, 128)
        batches = [1, 4] if self.smoke else [1, 16, 64]
        dtype = torch.bfloat16 if self.cuda else torch.float32
        log(f"building random Llama-3.1-8B-shaped weights on {self.device} ({'smoke' if self.smoke else dtype})")
        t0 = time.perf_counter()
        hf_config = transformers.LlamaConfig(**shape)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(self.device):
                hf = transformers.LlamaForCausalLM(hf_config).eval()
        finally:
            torch.set_default_dtype(previous)
        log(f"transformers model built in {time.perf_counter() - t0:.1f} s")
        generator = torch.Generator().manual_seed(0)

        def prompts(batch: int) -> Any:  # fresh ones at every call
            return torch.randint(1, shape["vocab_size"] - 1, (batch, prompt_len), generator=generator)

        out: dict[str, Any] = {"prompt_tokens": prompt_len, "new_tokens": new_tokens, "batches": batches,
                               "hf_tokens_per_s": {}, "engine_tokens_per_s": {}}

        def hf_generate(ids: Any, max_new: int) -> object:
            ids = ids.to(self.device)
            with torch.inference_mode():
                return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                   min_new_tokens=max_new, do_sample=False, pad_token_id=0)

        hf_generate(prompts(1), 2)  # warm-up
        for batch in batches:  # the better of two runs: the first at a batch size still warms up
            seconds = min(self.wall_s(lambda b=batch: hf_generate(prompts(b), new_tokens)) for _ in range(2))
            out["hf_tokens_per_s"][str(batch)] = batch * new_tokens / seconds
            log(f"transformers generate, batch {batch}: {out['hf_tokens_per_s'][str(batch)]:.0f} tokens/s")
        for batch in (1, max(batches)):
            first = self.wall_s(lambda b=batch: hf_generate(prompts(b), 1))
            whole = self.wall_s(lambda b=batch: hf_generate(prompts(b), new_tokens + 1))
            out[f"hf_b{batch}_step_ms"] = (whole - first) / new_tokens * 1e3

        config = ModelConfig(
            model_id="random-llama-3.1-8b", vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
            intermediate_size=shape["intermediate_size"], num_layers=shape["num_hidden_layers"],
            num_heads=shape["num_attention_heads"], num_kv_heads=shape["num_key_value_heads"],
            head_dim=shape["head_dim"], rope_theta=shape["rope_theta"], rms_norm_eps=shape["rms_norm_eps"],
            max_position_embeddings=shape["max_position_embeddings"], tie_word_embeddings=False,
            rope_scaling=shape["rope_scaling"], eos_token_id=shape["vocab_size"] - 1,
        )
        with torch.device(self.device):
            model = CausalLM(config, dtype)
        model.load_hf_state_dict(hf.state_dict())
        model.eval()
        hf = None  # its weights freed: the engine's copy is the one measured next
        if self.cuda:
            torch.cuda.empty_cache()
        weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n != "embed_tokens")
        with tempfile.TemporaryDirectory() as tmp:
            write_byte_tokenizer(Path(tmp), shape["vocab_size"])
            tokenizer = Tokenizer.load(tmp)
        max_len = prompt_len + new_tokens + 16
        blocks = max(batches) * math.ceil(max_len / 16) + 64
        settings = Settings(device=str(self.device), dtype="bfloat16" if self.cuda else "float32", block_size=16,
                            kv_blocks=blocks, max_num_seqs=max(batches), max_model_len=max_len,
                            max_num_batched_tokens=max(8192, prompt_len), enable_prefix_caching=False,
                            attention_backend="triton")
        t0 = time.perf_counter()
        engine = LLMEngine(settings, loaded=LoadedModel(config, model, tokenizer, self.device))
        out["engine_start_s"] = time.perf_counter() - t0
        log(f"engine ready in {out['engine_start_s']:.1f} s (graphs: {engine.runner.graphs is not None})")

        def generate(batch: int, max_tokens: int) -> object:
            ids = prompts(batch).tolist()
            return engine.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))

        generate(2, 3)  # warm-up: the prefill kernel compiled
        for batch in batches:  # measured as transformers is: the better of two runs
            seconds = min(self.wall_s(lambda b=batch: generate(b, new_tokens)) for _ in range(2))
            out["engine_tokens_per_s"][str(batch)] = batch * new_tokens / seconds
            log(f"engine generate, batch {batch}: {out['engine_tokens_per_s'][str(batch)]:.0f} tokens/s")
        out["speedup_vs_hf"] = {b: out["engine_tokens_per_s"][b] / out["hf_tokens_per_s"][b]
                                for b in out["engine_tokens_per_s"]}
        for batch in (1, max(batches)):
            first = self.wall_s(lambda b=batch: generate(b, 1))
            whole = self.wall_s(lambda b=batch: generate(b, new_tokens + 1))
            out[f"b{batch}_step_ms"] = (whole - first) / new_tokens * 1e3
            out[f"b{batch}_prefill_and_first_token_s"] = first
        out["weight_bytes"] = weight_bytes
        out["streaming_bound_ms"] = weight_bytes / (copy_gbps * 1e9) * 1e3
        out["b1_step_vs_bound"] = out["b1_step_ms"] / out["streaming_bound_ms"]
        graphs = engine.runner.graphs
        if graphs is not None and 1 in graphs._graphs:  # the replay alone: the device's share of a step
            graph, _ = graphs._graphs[1]
            out["b1_graph_replay_ms"] = self.time_ms(graph.replay)
            out["b1_replay_vs_bound"] = out["b1_graph_replay_ms"] / out["streaming_bound_ms"]
        log(f"batch-1 step {out['b1_step_ms']:.2f} ms (graph replay {out.get('b1_graph_replay_ms', float('nan')):.2f}"
            f" ms) against the streaming bound {out['streaming_bound_ms']:.2f} ms; batch-{max(batches)} step "
            f"{out[f'b{max(batches)}_step_ms']:.2f} ms")
        return out

    def plot(self, result: dict[str, Any], path: Path) -> None:
        engine = result.get("engine") or {}
        if "engine_tokens_per_s" not in engine:
            return
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            log("no matplotlib: no PNG")
            return
        batches = [int(b) for b in engine["engine_tokens_per_s"]]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(batches, list(engine["engine_tokens_per_s"].values()), "o-", label="dynserve engine")
        ax.plot(batches, [engine["hf_tokens_per_s"][str(b)] for b in batches], "s--", label="transformers generate")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (static)")
        ax.set_ylabel("generated tokens/s")
        ax.set_title(f"Llama-3.1-8B shape, bf16, {result['device']}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        log(f"wrote {path}")


def _replace(tuning: Any, fields: dict[str, int]) -> Any:
    import dataclasses

    return dataclasses.replace(tuning, **fields)


def _at_least(value: float | None, target: float) -> bool | None:
    return None if value is None else value >= target


if __name__ == "__main__":
    main()
