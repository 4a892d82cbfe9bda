"""The built-in engine on a CUDA device: its Triton kernels compiled, its CUDA graphs, sampling and parity.

Every test takes the `cuda` fixture (marker `gpu`): it skips without a CUDA device, and `make test-gpu` /
`scripts/gpu-run.sh` run them with the kernels compiled (TRITON_INTERPRET=0).

- The fused norm, rope and activation kernels (`triton_ops`) against the eager torch ops.
- Each kernel against the torch reference backend on the same device, in fp16 and bf16: ragged contexts,
  GQA groups (Llama-3-8B's 32/8 x 128 among them), block boundaries, chunked prefill over a cached prefix,
  padding rows (slot -1) that write nothing.
- The engine on a random-weight Llama directory: fp32 greedy generation equal to `transformers` on the same
  device (decode steps replayed from CUDA graphs), bf16 logits within a stated distance of transformers'
  fp32, graphs on and off giving the same tokens, seeded sampling on the device independent of its batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import lazy_import
from test_accelerator_path import check_fused_ops
from test_triton_kernels import GQA_4_2, LAYER, NUM_LAYERS, SMOLLM2, TOLERANCE, Shape, make_block_tables

torch = lazy_import("torch")
kernels = lazy_import("dynserve.engine.kernels")
torch_attention = lazy_import("dynserve.engine.kernels.torch_attention")
triton_attention = lazy_import("dynserve.engine.kernels.triton_attention")

LLAMA_8B = Shape(num_heads=32, num_kv_heads=8, head_dim=128)


@pytest.fixture(autouse=True)
def _pure_torch_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("dynserve.engine.kernels.torch_attention.USE_NATIVE_DECODE", False)


def check_step_on(device: Any, query_lens: list[int], seq_lens: list[int], shape: Shape, dtype: str,
                  seed: int) -> None:
    """One step, Triton on `device` against the torch reference on `device`, both from the same noisy
    cache: the same output within the dtype's tolerance and the same cache, bit for bit."""
    torch_dtype = getattr(torch, dtype)
    generator = torch.Generator().manual_seed(seed)
    tables, num_blocks = make_block_tables(seq_lens, shape.block_size, generator)
    meta = kernels.AttentionMetadata.build(query_lens, seq_lens, tables, shape.block_size, device)
    dims = (num_blocks, NUM_LAYERS, 2, shape.block_size, shape.num_kv_heads, shape.head_dim)
    cache_ref = torch.randn(dims, generator=generator).to(device=device, dtype=torch_dtype)
    cache_triton = cache_ref.clone()
    num_tokens = sum(query_lens)

    def rows(heads: int) -> Any:
        return torch.randn(num_tokens, heads, shape.head_dim, generator=generator).to(device=device, dtype=torch_dtype)

    query, key, value = rows(shape.num_heads), rows(shape.num_kv_heads), rows(shape.num_kv_heads)
    scale = shape.head_dim**-0.5
    expected = torch_attention.forward(query, key, value, cache_ref, LAYER, meta, scale)
    out = torch.full_like(query, float("nan"))  # poisoned: every row must be written
    out.copy_(triton_attention.forward(query, key, value, cache_triton, LAYER, meta, scale))
    torch.cuda.synchronize()
    atol, rtol = TOLERANCE[dtype]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)
    assert torch.equal(cache_triton, cache_ref)


GPU_DTYPES = [pytest.param("float16", id="fp16"), pytest.param("bfloat16", id="bf16")]


@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "shape"),
    [
        pytest.param([5, 16, 33, 1], [5, 16, 33, 1], GQA_4_2, id="fresh-ragged-gqa4/2"),
        pytest.param([4, 12, 1, 9], [40, 32, 17, 9], GQA_4_2, id="chunks-over-prefix-mixed"),
        pytest.param([7, 20], [7, 20], SMOLLM2, id="fresh-gqa9/3-d64"),
        pytest.param([10, 3], [37, 24], Shape(4, 2, 16, block_size=4), id="block-size-4"),
        pytest.param([300, 1, 129], [300, 1000, 700], LLAMA_8B, id="llama8b-chunks-and-decode"),
    ],
)
def test_prefill_kernel_matches_torch_on_gpu(cuda, query_lens, seq_lens, shape, dtype):
    check_step_on(cuda, query_lens, seq_lens, shape, dtype, seed=sum(seq_lens))


@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize(
    ("seq_lens", "shape"),
    [
        pytest.param([1, 15, 16, 17, 64, 100], GQA_4_2, id="gqa4/2-block-edges"),
        pytest.param([3, 32, 47], SMOLLM2, id="gqa9/3-d64"),
        pytest.param([1, 511, 2049, 4096, 33], LLAMA_8B, id="llama8b-ragged"),
    ],
)
def test_decode_kernel_matches_torch_on_gpu(cuda, seq_lens, shape, dtype):
    check_step_on(cuda, [1] * len(seq_lens), seq_lens, shape, dtype, seed=sum(seq_lens))


def test_padding_rows_write_no_kv_on_gpu(cuda):
    shape = GQA_4_2
    cache = torch.randn(4, NUM_LAYERS, 2, shape.block_size, shape.num_kv_heads, shape.head_dim, device=cuda)
    before = cache.clone()
    key = torch.randn(3, shape.num_kv_heads, shape.head_dim, device=cuda)
    slots = torch.tensor([5, -1, 40], device=cuda)
    triton_attention.write_kv(cache, LAYER, key, key, slots)
    torch.cuda.synchronize()
    changed = (cache != before).nonzero()[:, 0].unique().tolist()
    assert changed == [0, 2]
    assert torch.equal(cache[0, LAYER, 0, 5], key[0]) and torch.equal(cache[2, LAYER, 1, 8], key[2])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_ops_match_the_torch_ops_on_gpu(cuda, dtype):
    check_fused_ops(cuda, dtype)


# ---- the engine -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    from benchmarks._random_models import write_tiny_llama

    path = tmp_path_factory.mktemp("tiny-llama-gpu")
    return path, write_tiny_llama(path, vocab_size=512, hidden_size=256, intermediate_size=512,
                                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2)


def gpu_engine(model_dir: Path, **settings: Any) -> Any:
    from dynserve.config import Settings
    from dynserve.engine.llm_engine import LLMEngine

    fields = {"model": str(model_dir), "device": "cuda", "kv_blocks": 256, "max_num_seqs": 16,
              "max_model_len": 512} | settings
    return LLMEngine(Settings(**fields))


PROMPTS = [[(31 * i + 7 * j) % 500 for j in range(n)] for i, n in enumerate((3, 17, 64, 130, 41))]


def greedy(max_tokens: int) -> Any:
    from dynserve.protocol import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def test_fp32_greedy_generation_equals_transformers_on_gpu(cuda, tiny_llama):
    """Five prompts batched in the engine (prefill, then decode steps replayed from CUDA graphs) give
    exactly the tokens transformers' greedy decoding gives each prompt alone, in fp32 on the GPU."""
    path, hf = tiny_llama
    engine = gpu_engine(path, dtype="float32")
    assert engine.runner.graphs is not None and engine.runner.graphs.captured
    hf = hf.to(cuda)
    results = engine.generate(PROMPTS, greedy(24))
    for prompt, result in zip(PROMPTS, results, strict=True):
        # transformers' own forward, greedy over the whole sequence at every step (`generate` would mask
        # the end-of-text token until a minimum length, where the engine's ignore_eos only keeps going)
        ids = list(prompt)
        with torch.inference_mode():
            for _ in range(24):
                ids.append(int(hf(torch.tensor([ids], device=cuda)).logits[0, -1].argmax()))
        assert result.token_ids == ids[len(prompt):]


BF16_LOGITS_TOLERANCE = 5e-2  # ||ours - transformers fp32|| / ||transformers fp32|| of last-token logits


def test_bf16_logits_stay_near_transformers_fp32_on_gpu(cuda, tiny_llama):
    path, hf = tiny_llama
    engine = gpu_engine(path)  # dtype auto: bf16 on a GPU that has it
    assert engine.dtype == torch.bfloat16
    ours = engine.compute_logits(PROMPTS)
    hf = hf.to(cuda).float()
    distances = []
    for prompt, logits in zip(PROMPTS, ours, strict=True):
        with torch.inference_mode():
            ref = hf(torch.tensor([prompt], device=cuda)).logits[0, -1].float().cpu()
        distances.append(float((logits - ref).norm() / ref.norm()))
    print(f"bf16 logits against transformers fp32, relative distances: {[round(d, 4) for d in distances]}")
    assert max(distances) < BF16_LOGITS_TOLERANCE


def test_graphs_on_and_off_give_the_same_tokens_on_gpu(cuda, tiny_llama):
    """Requests of different lengths finishing at different steps: batches shrink through several buckets
    (padding rows included), with and without graphs, greedy and seeded (fp32: a bucket's matmul over more
    rows rounds differently, which in bf16 could flip a near tie)."""
    from dynserve.protocol import SamplingParams

    path, _ = tiny_llama
    params = [greedy(8 + 5 * i) for i in range(3)] + [
        SamplingParams(max_tokens=20, temperature=0.9, top_p=0.8, seed=11),
        SamplingParams(max_tokens=12, temperature=1.2, top_k=20, seed=5, logprobs=2),
    ]
    with_graphs = [r.token_ids for r in gpu_engine(path, dtype="float32").generate(PROMPTS, params)]
    without = [r.token_ids for r in gpu_engine(path, dtype="float32", cuda_graphs=False).generate(PROMPTS, params)]
    assert with_graphs == without


def test_seeded_sampling_on_gpu_ignores_the_batch(cuda, tiny_llama):
    from dynserve.protocol import SamplingParams

    path, _ = tiny_llama
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    engine = gpu_engine(path, dtype="float32")
    alone = engine.generate([PROMPTS[1]], [seeded])[0].token_ids
    others = [SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)] * 3
    crowded = engine.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3]], [others[0], seeded, *others[1:]])
    assert crowded[1].token_ids == alone
    assert len(set(alone)) > 1
