"""Timing profiles for the mocker: how long one engine step takes on some hardware, as data.

A profile is an affine model of one step's wall time in milliseconds:

    step_ms = fixed_ms
            + prefill_ms_per_token * P + prefill_ms_per_token_context * A
            + decode_ms_per_seq * B + decode_ms_per_context_token * C

where, over the sequences in the step, P is the number of prompt tokens computed (uncached tokens, prefill
chunks, recomputes), A the number of (new token, token it attends to) pairs of those prefills, B the number
of decoding sequences and C their total context. `fixed_ms` is `prefill_fixed_ms` for a prefill-only step,
`decode_fixed_ms` for a decode-only step and the larger of the two for a mixed one. Each profile also
carries its KV-cache capacity and scheduler limits, which the mocker uses unless settings override them.

Onboarding from the KV tiers (`kv_host_bytes`, `kv_disk_bytes`) adds to a step the time its onboarded blocks
take to come back: host-tier bytes over the host link (`kv_host_link_gbps`), disk-tier bytes over the disk's
read bandwidth (`kv_disk_read_gbps`), one after the other (`onboard_time_ms`).

Every number says where it comes from next to it: `cpu` was fitted to our engine measured on this machine
(`benchmarks/mocker_profile.py`); the H100 profiles are derived from the H100 SXM datasheet and each
model's shape, with stated efficiency factors, and cross-checked against published measurements. The tiers'
bandwidths are estimates from datasheets (PCIe, NVMe), stated as such beside each profile.

Invariants: every coefficient is >= 0, so more work never takes less time; profiles are immutable.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynserve.errors import InvalidRequestError

__all__ = ["PROFILES", "MockerProfile", "StepWork", "get_profile"]


@dataclass(frozen=True, slots=True)
class StepWork:
    """What one step computes, in the units the profiles price."""

    num_prefill_tokens: int = 0
    num_prefill_attention_pairs: int = 0
    num_decode_seqs: int = 0
    num_decode_context_tokens: int = 0


@dataclass(frozen=True, slots=True)
class MockerProfile:
    name: str
    description: str
    prefill_fixed_ms: float
    prefill_ms_per_token: float
    prefill_ms_per_token_context: float
    decode_fixed_ms: float
    decode_ms_per_seq: float
    decode_ms_per_context_token: float
    kv_bytes_per_token: int  # KV cache bytes one token takes (all layers, all tensor-parallel ranks)
    kv_cache_gib: float  # KV cache the modelled deployment holds
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_transfer_gbps: float  # KV bytes a decode worker reads from a prefill worker per second (1e9 B/s)
    kv_transfer_fixed_ms: float  # per read: posting it, completion, the release message
    kv_host_link_gbps: float  # KV bytes per second (1e9 B/s) onboarded from the host tier into the KV cache
    kv_disk_read_gbps: float  # KV bytes per second (1e9 B/s) onboarded from the disk tier into the KV cache

    def transfer_time_ms(self, size_bytes: int) -> float:
        """Modelled wall time of reading `size_bytes` of KV pages from a prefill worker."""
        return self.kv_transfer_fixed_ms + size_bytes / (self.kv_transfer_gbps * 1e9) * 1e3

    def onboard_time_ms(self, num_host_bytes: int, num_disk_bytes: int) -> float:
        """Modelled wall time of onboarding `num_host_bytes` from the host tier and `num_disk_bytes` from the
        disk tier (the two one after the other; no fixed cost, so 0 for no bytes)."""
        host_s = num_host_bytes / (self.kv_host_link_gbps * 1e9)
        return (host_s + num_disk_bytes / (self.kv_disk_read_gbps * 1e9)) * 1e3

    def step_time_ms(self, work: StepWork) -> float:
        """Modelled wall time of one step; 0 for a step that computes nothing."""
        has_prefill, has_decode = work.num_prefill_tokens > 0, work.num_decode_seqs > 0
        if not (has_prefill or has_decode):
            return 0.0
        fixed_ms = max(self.prefill_fixed_ms if has_prefill else 0.0, self.decode_fixed_ms if has_decode else 0.0)
        return (fixed_ms
                + self.prefill_ms_per_token * work.num_prefill_tokens
                + self.prefill_ms_per_token_context * work.num_prefill_attention_pairs
                + self.decode_ms_per_seq * work.num_decode_seqs
                + self.decode_ms_per_context_token * work.num_decode_context_tokens)

    def num_kv_blocks(self, block_size: int) -> int:
        return max(1, int(self.kv_cache_gib * 2**30) // (self.kv_bytes_per_token * block_size))


# ---- cpu: our engine on this machine ------------------------------------------------------------------
#
# SmolLM2-135M-Instruct, fp32, ONE torch thread, on this 2-core x86-64 CPU, fitted to the step times of
#   PYTHONPATH=$PWD .venv/bin/python -m benchmarks.mocker_profile
# (the run's date, commit, load and measured points: docs/benchmarks.md, mocker_profile). Times are each
# step's process CPU time: what the step takes on a core of its own; a worker with 2 threads on a quiet
# machine is up to about 1.6x faster than this profile. Fit, least squares on relative error: prefill within
# 5% of every point; decode rms 18%, worst 40% (the measured curve has steps where torch switches kernels,
# an affine model cannot); a mixed step (decodes plus a prefill chunk) within 1% of its measured time.
CPU = MockerProfile(
    name="cpu",
    description="dynserve's engine, SmolLM2-135M-Instruct fp32, 1 thread of this 2-core CPU (measured, fitted)",
    prefill_fixed_ms=156.6,
    prefill_ms_per_token=3.048,
    prefill_ms_per_token_context=0.00155,
    decode_fixed_ms=106.6,
    decode_ms_per_seq=5.754,
    decode_ms_per_context_token=0.00376,
    kv_bytes_per_token=30 * 2 * 3 * 64 * 4,  # layers x (K, V) x KV heads x head_dim x fp32 = 46,080
    kv_cache_gib=1.0,  # Settings.kv_cache_gib's default: the same 1,456 blocks of 16 as a real worker
    max_model_len=8192,
    max_num_seqs=64,  # Settings defaults
    max_num_batched_tokens=1024,
    # NIXL over UCX (cma) between two workers on this host, CPU memory: benchmarks.kv_transfer read 16 MiB
    # batches at 3-5 GB/s (0.7-0.8x of a memcpy); about 0.5 ms per read for posting and completion.
    kv_transfer_gbps=4.0,
    kv_transfer_fixed_ms=0.5,
    # KV tiers on this CPU (the host tier is another pool in the same memory): benchmarks.tiers measured
    # 0.03-0.04 ms to copy a 368,640-byte bf16 block of SmolLM2 back from the host tier (about 10 GB/s, a
    # memcpy; docs/benchmarks.md, tiers). The disk tier's read (a file in the page cache, a checksum, the
    # copy) was not timed whole there: 2 GB/s is an estimate.
    kv_host_link_gbps=10.0,
    kv_disk_read_gbps=2.0,
)

# ---- H100 profiles: derived from specs, cross-checked with published figures ----------------------------
#
# H100 SXM5 80GB (NVIDIA datasheet): 989 TFLOP/s dense BF16, 3.35 TB/s HBM3. Assumed efficiencies,
# typical of vLLM-class engines: decode reads weights and KV at 75% of peak bandwidth; prefill and the
# per-sequence decode math run at 50% of peak tensor throughput.
#   fixed_ms                    = weight bytes per GPU / (0.75 * 3.35e12 B/s)   (+ all-reduce latency for TP)
#   *_ms_per_token, _per_seq    = 2 * params FLOP / (num_gpus * 0.5 * 989e12 FLOP/s)
#   prefill_ms_per_token_context= 4 * layers * (heads * head_dim) FLOP / (num_gpus * 0.5 * 989e12)
#   decode_ms_per_context_token = KV bytes per token per GPU / (0.75 * 3.35e12)
# The sum of a memory term and compute terms is an upper bound near the roofline knee (a real GPU overlaps
# them), by at most fixed_ms. KV capacity: vLLM's default gpu_memory_utilization 0.9 of 79.6 GiB, less the
# weights and about 4 GiB of activations and CUDA graphs, per GPU. Scheduler limits: vLLM's serving defaults
# on GPUs with >= 70 GiB other than the A100 (vllm/engine/arg_utils.py, get_batch_defaults): 8192 batched
# tokens, 1024 sequences.
# KV transfer: prefill and decode workers on different nodes, pages read GPU to GPU by RDMA (NIXL over UCX)
# through one 400 Gb/s ConnectX-7 NIC per GPU (the DGX H100 design): 50 GB/s per GPU at line rate, taken at
# 80% = 40 GB/s per GPU, the TP ranks reading their own KV shards in parallel; plus about 1 ms per read for
# posting, completion and the release message.
# KV tiers (estimates, from datasheets; nothing here was measured on a GPU): the host tier is pinned host
# memory, onboarded by a copy over each GPU's own PCIe Gen5 x16 link: 64 GB/s per direction on paper
# (32 GT/s x 16 lanes, 128b/130b), about 50 GB/s effective for large pinned host-to-device copies, per GPU,
# the TP ranks copying their own KV shards in parallel (the host's DDR5, several hundred GB/s a socket, is
# not the limit at 4 GPUs). The disk tier is the node's NVMe data drives, one per GPU as in the DGX H100
# design (8 PCIe Gen4 U.2 NVMe drives, striped, for 8 GPUs; such drives' datasheets give 6.5-7 GB/s
# sequential read), each read at 6 GB/s: blocks are MBs each, read whole, and the hop on to the GPU is
# faster and overlaps the read. A worker of N GPUs reads from N drives' worth: 6 GB/s x N.

# Llama-3.1-8B-Instruct, BF16, TP1: 8.03e9 params (16.06 GB), 32 layers, 32 heads x 128, 8 KV heads.
#   fixed:   16.06e9 / 2.51e12                  = 6.39 ms
#   token:   2 * 8.03e9 / 4.945e14              = 0.0325 ms  (about 30,800 prefill tokens/s)
#   pairs:   4 * 32 * 4096 / 4.945e14           = 1.06e-6 ms
#   context: 131,072 B / 2.51e12                = 5.2e-5 ms
#   KV:      0.9 * 79.6 - 14.96 - 4             = 52 GiB, 131,072 B per token (about 426k tokens)
# Cross-checks: vLLM's CI latency test (Llama-3.1-8B TP1 on H200, batch 8, 32 in / 128 out: 833 ms, i.e.
# 6.5 ms per step; https://buildkite.com/vllm/performance-benchmark/builds/9515) on a GPU with faster memory
# than the H100's; NVIDIA NIM's published Llama-3.1-8B ITL of 4.4-4.6 ms at concurrency 1, 5.9-7.2 ms at 50
# (https://docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance, TensorRT-LLM, so below a vLLM BF16 engine).
LLAMA_8B_H100 = MockerProfile(
    name="llama-3.1-8b-h100",
    description="Llama-3.1-8B-Instruct BF16 on one H100 SXM (derived from specs)",
    prefill_fixed_ms=6.39,
    prefill_ms_per_token=0.0325,
    prefill_ms_per_token_context=1.06e-6,
    decode_fixed_ms=6.39,
    decode_ms_per_seq=0.0325,
    decode_ms_per_context_token=5.2e-5,
    kv_bytes_per_token=32 * 2 * 8 * 128 * 2,
    kv_cache_gib=52.0,
    max_model_len=131072,
    max_num_seqs=1024,
    max_num_batched_tokens=8192,
    kv_transfer_gbps=40.0,  # see "KV transfer" above
    kv_transfer_fixed_ms=1.0,
    kv_host_link_gbps=50.0,  # see "KV tiers" above: one PCIe Gen5 x16 link (estimate)
    kv_disk_read_gbps=6.0,  # see "KV tiers" above: one NVMe Gen4 drive's worth (estimate)
)

# Llama-3.1-70B-Instruct, BF16, TP4: 70.6e9 params (141.1 GB, 35.3 GB per GPU), 80 layers, 64 heads x 128,
# 8 KV heads (2 per GPU).
#   fixed:   35.3e9 / 2.51e12 = 14.05 ms, plus 160 all-reduces (2 per layer) x about 9 us = 15.5 ms
#   token:   2 * 70.6e9 / (4 * 4.945e14) = 0.0714 ms, plus the all-reduced activations of each token
#            (2 * 80 * 8192 * 2 B = 2.6 MB at about 300 GB/s of NVLink = 0.0087 ms) = 0.080 ms
#   pairs:   4 * 80 * 8192 / (4 * 4.945e14) = 1.33e-6 ms
#   context: 327,680 B / 4 GPUs / 2.51e12 = 3.26e-5 ms
#   KV:      4 * (0.9 * 79.6 - 32.9 - 4) = 138 GiB, 327,680 B per token (about 452k tokens)
# Cross-checks: vLLM's CI latency test (Llama-3 70B TP4 on H200, batch 8, 32 in / 128 out: 2,078 ms, i.e.
# 16.2 ms per step; same build as above); NIM 1.3's Llama-3.1-70B ITL of 13.2 ms at concurrency 1 and
# 17.4 ms at 50 (same NIM page, TensorRT-LLM on H100s): a slope of about 0.086 ms per extra sequence, the
# size of decode_ms_per_seq plus its context term here.
LLAMA_70B_H100_TP4 = MockerProfile(
    name="llama-3.1-70b-h100-tp4",
    description="Llama-3.1-70B-Instruct BF16 on four H100 SXM, tensor parallel (derived from specs)",
    prefill_fixed_ms=15.5,
    prefill_ms_per_token=0.080,
    prefill_ms_per_token_context=1.33e-6,
    decode_fixed_ms=15.5,
    decode_ms_per_seq=0.0714,
    decode_ms_per_context_token=3.26e-5,
    kv_bytes_per_token=80 * 2 * 8 * 128 * 2,
    kv_cache_gib=138.0,
    max_model_len=131072,
    max_num_seqs=1024,
    max_num_batched_tokens=8192,
    kv_transfer_gbps=160.0,  # see "KV transfer" above: 4 GPUs, each over its own NIC
    kv_transfer_fixed_ms=1.0,
    kv_host_link_gbps=200.0,  # see "KV tiers" above: 4 GPUs, each over its own PCIe Gen5 x16 link (estimate)
    kv_disk_read_gbps=24.0,  # see "KV tiers" above: four NVMe Gen4 drives' worth (estimate)
)

PROFILES: dict[str, MockerProfile] = {p.name: p for p in (CPU, LLAMA_8B_H100, LLAMA_70B_H100_TP4)}


def get_profile(name: str) -> MockerProfile:
    """The profile called `name`; InvalidRequestError names the known ones."""
    profile = PROFILES.get(name)
    if profile is None:
        raise InvalidRequestError(f"unknown mocker profile {name!r}; known: {', '.join(PROFILES)}",
                                  param="mocker")
    return profile
