"""The engine's accelerator path, checked on the CPU: what it computes must equal the CPU path's.

A GPU step uploads its inputs in one copy and computes the slot mapping on the device (`step_inputs`),
replays decode steps from CUDA graphs over static buffers with padding rows (`cuda_graphs`), and samples on
the device (`sampler.sample_on_device`). All of it is plain torch except the capture, so here it runs on
the CPU (the Triton kernels under the interpreter) against the CPU path: same metadata, same logits and
cache, same tokens. `tests/test_gpu.py` runs the same paths on a GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import lazy_import

torch = lazy_import("torch")
kernels = lazy_import("dynserve.engine.kernels")
step_inputs = lazy_import("dynserve.engine.step_inputs")
cuda_graphs = lazy_import("dynserve.engine.cuda_graphs")
sampler = lazy_import("dynserve.engine.sampler")
triton_attention = lazy_import("dynserve.engine.kernels.triton_attention")


def make_seq(request_id: str, prompt: list[int], computed: int, block_table: list[int], **params: Any) -> Any:
    from dynserve.engine.sequence import Sequence
    from dynserve.protocol import SamplingParams

    seq = Sequence(request_id, prompt, SamplingParams(**params))
    seq.num_computed_tokens = computed
    seq.block_table = block_table
    return seq


def test_decode_graph_batch_sizes() -> None:
    assert step_inputs.decode_graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert step_inputs.decode_graph_batch_sizes(6) == [1, 2, 4, 6]
    assert step_inputs.decode_graph_batch_sizes(200)[-4:] == [128, 160, 192, 200]
    assert step_inputs.decode_graph_batch_sizes(1) == [1]


def test_one_upload_gives_the_cpu_paths_metadata() -> None:
    """A mixed batch (a chunk over a cached prefix, a decode row, a fresh prompt, a chunk that does not
    sample): the uploaded inputs equal `AttentionMetadata.build`'s and the runner's lists."""
    from dynserve.engine.scheduler import ScheduledBatch

    block_size = 4
    seqs = [
        make_seq("chunk", list(range(10, 23)), 6, [7, 3, 9, 12]),  # 13 tokens, 6 computed, all 7 now
        make_seq("decode", list(range(40, 49)), 8, [5, 1, 8]),  # 9 tokens, its last one now
        make_seq("fresh", [1, 2, 3], 0, [11]),
        make_seq("partial", list(range(60, 72)), 0, [2, 4, 6]),  # 12 tokens, 5 now: does not sample
    ]
    num_new = [7, 1, 3, 5]
    batch = ScheduledBatch(seqs, num_new)
    inputs = step_inputs.upload_step(batch, block_size, torch.device("cpu"))

    seq_lens = [13, 9, 3, 5]
    expected = kernels.AttentionMetadata.build(num_new, seq_lens, [s.block_table for s in seqs], block_size)
    assert torch.equal(inputs.meta.slot_mapping, expected.slot_mapping)
    assert torch.equal(inputs.meta.query_start_loc, expected.query_start_loc)
    assert torch.equal(inputs.meta.seq_lens, expected.seq_lens)
    assert inputs.meta.block_tables.shape == (4, 16)  # widths rounded up to 16 (one Triton variant)
    assert torch.equal(inputs.meta.block_tables[:, :4], expected.block_tables)
    assert not inputs.meta.block_tables[:, 4:].any()
    for tensor in (inputs.meta.seq_lens, inputs.meta.query_start_loc, inputs.meta.block_tables):
        # every segment 64 bytes into the one buffer (a device allocation's base is aligned further)
        assert (tensor.data_ptr() - tensor.untyped_storage().data_ptr()) % 64 == 0
    assert inputs.meta.query_start_loc_cpu == expected.query_start_loc_cpu
    assert inputs.meta.max_query_len == 7
    assert inputs.input_ids.tolist() == list(range(16, 23)) + [48, 1, 2, 3] + list(range(60, 65))
    assert inputs.positions.tolist() == list(range(6, 13)) + [8, 0, 1, 2] + list(range(5))
    assert [s.request_id for s in inputs.sampling] == ["chunk", "decode", "fresh"]
    assert inputs.logits_indices.tolist() == [6, 7, 10]


# ---- decode graphs' buffers, run eagerly on the CPU ---------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from benchmarks._random_models import write_tiny_llama

    path = tmp_path_factory.mktemp("tiny-llama")
    write_tiny_llama(path)
    return path


@pytest.fixture(autouse=True, scope="module")
def _triton_runs_here() -> None:
    pytest.importorskip("triton")
    if not triton_attention.is_available():
        pytest.skip("needs Triton on a GPU or under TRITON_INTERPRET=1")


def make_engine(model_dir: Path, **settings: Any) -> Any:
    from dynserve.config import Settings
    from dynserve.engine.llm_engine import LLMEngine

    return LLMEngine(Settings(model=str(model_dir), device="cpu", dtype="float32", kv_blocks=96, block_size=4,
                              attention_backend="triton", max_model_len=128, **settings))


def eager_graphs(engine: Any, batch_sizes: list[int]) -> Any:
    """The engine's decode graphs without the capture (what runs where there is no CUDA)."""
    runner = engine.runner
    return cuda_graphs.DecodeGraphs(runner.model, runner.kv_cache, runner.attention, runner.block_size,
                                    engine.max_model_len, batch_sizes)


def test_decode_graph_buffers_give_the_eager_steps_logits_and_cache(tiny_llama_dir: Path) -> None:
    """Three sequences decoded through the graphs' static buffers (bucket 4: one padding row) give the
    eager step's logits and write the same slots: the padding row writes nothing."""
    from dynserve.engine.scheduler import ScheduledBatch

    engine = make_engine(tiny_llama_dir)
    runner = engine.runner
    generator = torch.Generator().manual_seed(3)
    runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape, generator=generator))  # noise in every slot
    blocks = torch.randperm(96, generator=generator).tolist()
    seqs = [
        make_seq("a", list(range(1, 10)), 8, blocks[0:3]),
        make_seq("b", list(range(50, 54)), 3, blocks[3:4]),  # its last token ends a block
        make_seq("c", list(range(100, 117)), 16, blocks[4:9]),  # its last token starts a block
    ]
    batch = ScheduledBatch(seqs, [1, 1, 1])
    graphs = eager_graphs(engine, [1, 2, 4, 8])
    assert graphs.fits(batch) and graphs.bucket(3) == 4

    cache_before = runner.kv_cache.clone()
    expected, sampling = runner._forward(batch)
    cache_eager = runner.kv_cache.clone()
    runner.kv_cache.copy_(cache_before)
    actual = graphs.run(seqs)

    assert sampling == seqs
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    # the same slots written (the padding row wrote none), with the same values up to the rounding of a
    # matmul over four rows instead of three
    assert torch.equal(runner.kv_cache != cache_before, cache_eager != cache_before)
    torch.testing.assert_close(runner.kv_cache, cache_eager, atol=1e-5, rtol=1e-5)


def test_an_uploaded_step_gives_the_cpu_steps_logits(tiny_llama_dir: Path) -> None:
    """The runner's accelerator step (one upload, slots on the device) over a mixed batch: the CPU step's
    logits and cache."""
    from dynserve.engine.scheduler import ScheduledBatch

    engine = make_engine(tiny_llama_dir)
    runner = engine.runner
    generator = torch.Generator().manual_seed(5)
    runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape, generator=generator))
    blocks = torch.randperm(96, generator=generator).tolist()
    seqs = [
        make_seq("chunk", list(range(10, 30)), 9, blocks[0:5]),
        make_seq("decode", list(range(40, 51)), 10, blocks[5:8]),
        make_seq("fresh", [1, 2, 3, 4, 5], 0, blocks[8:10]),
    ]
    batch = ScheduledBatch(seqs, [11, 1, 5])
    before = runner.kv_cache.clone()
    expected, expected_seqs = runner._forward_from_lists(batch)
    written = runner.kv_cache.clone()
    runner.kv_cache.copy_(before)
    actual, actual_seqs = runner._forward_uploaded(batch)
    assert actual_seqs == expected_seqs == seqs
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(runner.kv_cache, written)


def test_fits_only_decode_batches_within_the_largest_bucket(tiny_llama_dir: Path) -> None:
    from dynserve.engine.scheduler import ScheduledBatch

    graphs = eager_graphs(make_engine(tiny_llama_dir), [1, 2])
    decode = [make_seq(f"d{i}", [1, 2, 3], 2, [i]) for i in range(3)]
    assert graphs.fits(ScheduledBatch(decode[:2], [1, 1]))
    assert not graphs.fits(ScheduledBatch(decode, [1, 1, 1]))  # past the largest bucket
    assert not graphs.fits(ScheduledBatch([make_seq("p", [1, 2, 3], 0, [0])], [3]))  # a prefill
    assert not graphs.fits(ScheduledBatch([make_seq("c", [1, 2, 3], 1, [0])], [1]))  # a chunk, no sample
    assert not graphs.fits(ScheduledBatch([], []))


def test_engine_generates_the_same_tokens_through_the_decode_graphs(tiny_llama_dir: Path) -> None:
    """Greedy generation with every decode step through the graphs' buffers (batches shrinking as
    requests finish, so several buckets and padding) equals the CPU path's; so do seeded samples."""
    from dynserve.protocol import SamplingParams

    # 3 to 11 tokens over blocks of 4; 3 to 11 new: decode batches of 5, 4, 3, 2, 1 (buckets 8, 4, 4, 2, 1),
    # each sequence crossing block boundaries as it grows
    prompts = [[(7 * i + j) % 300 for j in range(3 + 2 * i)] for i in range(5)]
    params = [SamplingParams(max_tokens=3 + 2 * i, temperature=0, ignore_eos=True) for i in range(5)]
    plain = make_engine(tiny_llama_dir)
    with_graphs = make_engine(tiny_llama_dir)
    with_graphs.runner.graphs = eager_graphs(with_graphs, [1, 2, 4, 8])
    replayed = 0
    run = with_graphs.runner.graphs.run

    def counting_run(seqs: list[Any]) -> Any:
        nonlocal replayed
        replayed += 1
        return run(seqs)

    with_graphs.runner.graphs.run = counting_run
    expected = [r.token_ids for r in plain.generate(prompts, params)]
    actual = [r.token_ids for r in with_graphs.generate(prompts, params)]
    assert actual == expected
    assert replayed >= 10


# ---- sampling on the device's side --------------------------------------------------------------------------

def sampling_seqs(params: list[dict[str, Any]], outputs: list[list[int]] | None = None) -> list[Any]:
    seqs = []
    for i, p in enumerate(params):
        seq = make_seq(f"s{i}", [1, 2, 3], 3, [0], **p)
        for token in (outputs or [[]] * len(params))[i]:
            seq.append_token(token)
        seqs.append(seq)
    return seqs


def test_device_sampling_equals_the_cpu_sampler_where_it_is_deterministic() -> None:
    """Greedy rows, penalties and logprobs (top-k included) are the CPU sampler's."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=generator) * 3
    params = [
        {"temperature": 0, "logprobs": 3},
        {"temperature": 0, "frequency_penalty": 0.7, "presence_penalty": 0.3},
        {"temperature": 0},
        {"temperature": 0, "presence_penalty": 1.5, "logprobs": 0},
    ]
    outputs = [[], [4, 4, 9], [], [int(logits[3].argmax()), 2]]
    expected = sampler.sample(logits.clone(), sampling_seqs(params, outputs))
    actual = sampler.sample_on_device(logits.clone(), sampling_seqs(params, outputs))
    assert actual.token_ids == expected.token_ids
    assert actual.logprobs[1] is None and actual.logprobs[2] is None
    for got, want in zip(actual.logprobs, expected.logprobs, strict=True):
        if want is None:
            continue
        assert got.token_id == want.token_id and got.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
        assert [v for _, v in got.top] == pytest.approx([v for _, v in want.top], abs=1e-5)


def test_device_sampling_draws_only_inside_top_k_and_top_p() -> None:
    """Every draw of a filtered row lies in the set the CPU sampler's filter keeps, and an unfiltered
    row's draws follow its softmax."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 40, generator=generator) * 2
    params = [{"top_k": 5}, {"top_p": 0.6, "temperature": 0.8}, {"top_k": 8, "top_p": 0.9, "temperature": 1.3}]
    from dynserve.engine.sampler import _filter_top_k_top_p

    allowed = []
    for row, p in enumerate(params):
        kept = _filter_top_k_top_p(logits[row] / p.get("temperature", 1.0), p.get("top_k"),
                                           p.get("top_p", 1.0))
        allowed.append(set(torch.isfinite(kept).nonzero().flatten().tolist()))
    counts = torch.zeros(40)
    for _ in range(300):
        result = sampler.sample_on_device(logits.clone(), sampling_seqs(params))
        for row, token in enumerate(result.token_ids):
            assert token in allowed[row]
        free = sampler.sample_on_device(logits[:1].clone(), sampling_seqs([{"temperature": 1.0}]))
        counts[free.token_ids[0]] += 1
    expected = logits[0].softmax(-1) * 300
    likely = expected > 15
    assert ((counts[likely] - expected[likely]).abs() < 5 * expected[likely].sqrt() + 3).all()


def test_seeded_device_sampling_ignores_what_shares_the_batch() -> None:
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 64, generator=generator).repeat(3, 1)  # every row the same distribution

    def seeded_draws(batch: list[dict[str, Any]], row: int) -> list[int]:
        seqs = sampling_seqs(batch)
        return [sampler.sample_on_device(logits[: len(batch)].clone(), seqs).token_ids[row] for _ in range(8)]

    alone = seeded_draws([{"seed": 42, "temperature": 1.0}], 0)
    shared = seeded_draws([{"temperature": 1.0}, {"seed": 42, "temperature": 1.0}, {"top_k": 3}], 1)
    assert alone != [alone[0]] * 8  # it does draw
    assert shared == alone
    assert seeded_draws([{"seed": 7, "temperature": 1.0}], 0) != alone


def test_gpu_run_script_passes_its_checks_without_a_gpu() -> None:
    """`scripts/gpu-run.sh --check`: the device run's script parses and the benchmark answers --help."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    done = subprocess.run(["bash", "scripts/gpu-run.sh", "--check"], cwd=repo, capture_output=True, text=True,
                          timeout=60, env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert "gpu-run: checks passed" in done.stdout


# ---- the GPU's fused ops, interpreted ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_triton_ops_match_the_torch_ops(dtype: str) -> None:
    check_fused_ops(torch.device("cpu"), dtype)


def check_fused_ops(device: Any, dtype: str) -> None:
    """RMSNorm (with the residual added and updated in place), SiLU-and-multiply and rope over a fused
    QKV projection: the Triton kernels against `TorchOps` on `device` (bf16: within a rounding or two)."""
    from dynserve.engine.kernels.cpu_ops import TorchOps
    from dynserve.engine.kernels.triton_ops import TritonOps

    torch_dtype = getattr(torch, dtype)
    atol = 1e-5 if dtype == "float32" else 3e-2
    fused, eager = TritonOps(torch_dtype), TorchOps(torch_dtype)
    generator = torch.Generator().manual_seed(9)

    def rand(*shape: int) -> Any:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=torch_dtype)

    x, residual, weight = rand(5, 96), rand(5, 96), rand(96)
    torch.testing.assert_close(fused.rms_norm(x, weight, 1e-5), eager.rms_norm(x, weight, 1e-5), atol=atol, rtol=atol)
    residual_fused = residual.clone()
    normed, updated = fused.add_rms_norm(x, residual_fused, weight, 1e-5)
    want_normed, want_residual = eager.add_rms_norm(x, residual.clone(), weight, 1e-5)
    assert updated.data_ptr() == residual_fused.data_ptr()  # in place
    # one rounding of the same sum: exact in fp32 and on a GPU; under the interpreter, bf16 within one unit
    # of the last place (its conversion to bf16 does not round to nearest as a GPU's does)
    ulp = 0 if dtype == "float32" or device.type == "cuda" else 2**-7
    torch.testing.assert_close(updated, want_residual, atol=0, rtol=ulp)
    torch.testing.assert_close(normed, want_normed, atol=atol, rtol=atol)

    gate_up = rand(3, 2 * 1100)  # more columns than one program's block
    torch.testing.assert_close(fused.silu_mul(gate_up), eager.silu_mul(gate_up), atol=atol, rtol=atol)

    heads, kv_heads, head_dim = 4, 2, 32
    qkv = rand(6, (heads + 2 * kv_heads) * head_dim)
    positions = torch.tensor([0, 1, 5, 17, 200, 3000], device=device)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    expected = eager.rope_qkv(qkv.clone(), eager.rope_tables(positions, inv_freq), heads, kv_heads, head_dim)
    actual = fused.rope_qkv(qkv.clone(), fused.rope_tables(positions, inv_freq), heads, kv_heads, head_dim)
    for got, want in zip(actual, expected, strict=True):
        torch.testing.assert_close(got, want, atol=atol, rtol=atol)


def test_the_model_on_fused_ops_gives_the_torch_ops_logits(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dynserve.engine.kernels import triton_ops

    engine = make_engine(tiny_llama_dir)
    prompts = [[3, 4, 5, 6, 7], list(range(40, 73))]
    expected = engine.compute_logits(prompts)
    model = engine.runner.model
    monkeypatch.setattr(model, "_ops", triton_ops.TritonOps(torch.float32))
    torch.testing.assert_close(engine.compute_logits(prompts), expected, atol=1e-4, rtol=1e-4)
