"""The Triton attention kernels agree with the torch reference backend.

Runs the kernels in the Triton interpreter (TRITON_INTERPRET=1, set by conftest) on CPU tensors. Every case
uses a two-layer cache with shuffled, non-contiguous block ids, and attends on layer 1, so the block-major
stride math is exercised; both backends start from identical caches (random values in unused slots) and must
end with identical caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from conftest import lazy_import

torch = lazy_import("torch")
kernels = lazy_import("dynserve.engine.kernels")
torch_attention = lazy_import("dynserve.engine.kernels.torch_attention")
triton_attention = lazy_import("dynserve.engine.kernels.triton_attention")


@pytest.fixture(autouse=True)
def _pure_torch_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference is the pure torch path, not the C++ decode kernel it can hand decode rows to."""
    monkeypatch.setattr("dynserve.engine.kernels.torch_attention.USE_NATIVE_DECODE", False)


@pytest.fixture(autouse=True, scope="module")
def _triton_runs_here() -> None:
    pytest.importorskip("triton")
    if not triton_attention.is_available():
        pytest.skip("needs Triton on a GPU or under TRITON_INTERPRET=1")


TOLERANCE = {  # (atol, rtol) on outputs of magnitude ~1, by dtype name
    "float32": (1e-5, 1e-5),
    "float16": (2e-3, 2e-3),
    "bfloat16": (2e-2, 2e-2),
}
NUM_LAYERS = 2
LAYER = 1


@dataclass(frozen=True, slots=True)
class Shape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16


GQA_4_2 = Shape(num_heads=4, num_kv_heads=2, head_dim=32)
SMOLLM2 = Shape(num_heads=9, num_kv_heads=3, head_dim=64)  # SmolLM2-135M's attention geometry


def make_block_tables(
    seq_lens: list[int], block_size: int, generator: torch.Generator
) -> tuple[list[list[int]], int]:
    """Disjoint block lists from a shuffled pool (ids out of order and gapped), and the pool's size."""
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = 2 * sum(needed) + 3
    pool = torch.randperm(num_blocks, generator=generator).tolist()
    tables, used = [], 0
    for n in needed:
        tables.append(pool[used : used + n])
        used += n
    return tables, num_blocks


def as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A dtype from its name (test parameters name dtypes, so collecting them imports no torch)."""
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def make_step(num_tokens: int, shape: Shape, dtype: str | torch.dtype, generator: torch.Generator):
    """Random query, key and value rows for one step."""

    def rows(heads: int) -> torch.Tensor:
        return torch.randn(num_tokens, heads, shape.head_dim, generator=generator).to(as_dtype(dtype))

    return rows(shape.num_heads), rows(shape.num_kv_heads), rows(shape.num_kv_heads)


def make_cache(num_blocks: int, shape: Shape, dtype: str | torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """A cache full of noise: a kernel that reads a slot it should not will not match the reference."""
    dims = (num_blocks, NUM_LAYERS, 2, shape.block_size, shape.num_kv_heads, shape.head_dim)
    return torch.randn(dims, generator=generator).to(as_dtype(dtype))


def run_both(
    query, key, value, cache_ref, cache_triton, meta, shape: Shape
) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs of the reference and the Triton backend on the same step, each updating its own cache."""
    scale = shape.head_dim**-0.5
    expected = torch_attention.forward(query, key, value, cache_ref, LAYER, meta, scale)
    actual = triton_attention.forward(query, key, value, cache_triton, LAYER, meta, scale)
    return expected, actual


def assert_agree(expected: torch.Tensor, actual: torch.Tensor) -> None:
    atol, rtol = TOLERANCE[str(expected.dtype).removeprefix("torch.")]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def check_step(
    query_lens: list[int], seq_lens: list[int], shape: Shape, dtype: torch.dtype, seed: int
) -> None:
    """One step over a cache whose prefixes hold whatever was there (noise standing in for earlier steps)."""
    generator = torch.Generator().manual_seed(seed)
    tables, num_blocks = make_block_tables(seq_lens, shape.block_size, generator)
    meta = kernels.AttentionMetadata.build(query_lens, seq_lens, tables, shape.block_size)
    cache_ref = make_cache(num_blocks, shape, dtype, generator)
    cache_triton = cache_ref.clone()
    query, key, value = make_step(sum(query_lens), shape, dtype, generator)
    expected, actual = run_both(query, key, value, cache_ref, cache_triton, meta, shape)
    assert_agree(expected, actual)
    assert torch.equal(cache_triton, cache_ref)


DTYPES = [pytest.param("float32", id="fp32"), pytest.param("float16", id="fp16")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "shape"),
    [
        # fresh prefills, ragged; a one-token prompt; lengths ending on and crossing block boundaries
        pytest.param([5, 16, 33, 1], [5, 16, 33, 1], GQA_4_2, id="fresh-ragged-gqa4/2"),
        pytest.param([7, 20], [7, 20], SMOLLM2, id="fresh-gqa9/3-d64"),
        # chunks over cached prefixes, with a decode row and a fresh prompt in the same (mixed) batch
        pytest.param([4, 12, 1, 9], [40, 32, 17, 9], GQA_4_2, id="chunks-over-prefix-mixed"),
        # blocks smaller than a key tile (a tile spans many blocks) and larger than one
        pytest.param([10, 3], [37, 24], Shape(4, 2, 16, block_size=4), id="block-size-4"),
        pytest.param([19, 6], [19, 70], Shape(4, 1, 16, block_size=32), id="block-size-32-mqa"),
    ],
)
def test_prefill_matches_torch(query_lens, seq_lens, shape, dtype):
    check_step(query_lens, seq_lens, shape, dtype, seed=sum(seq_lens))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("seq_lens", "shape"),
    [
        pytest.param([1, 15, 16, 17, 64, 100], GQA_4_2, id="gqa4/2"),
        pytest.param([3, 32, 47], SMOLLM2, id="gqa9/3-d64"),
        pytest.param([5, 9, 13], Shape(2, 2, 16, block_size=8), id="mha-block-size-8"),
    ],
)
def test_decode_matches_torch(seq_lens, shape, dtype):
    check_step([1] * len(seq_lens), seq_lens, shape, dtype, seed=sum(seq_lens))


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_prefill_then_decode_over_what_earlier_steps_wrote(dtype):
    """Prompt chunk, second chunk attending over the first (from the cache), then two decode steps.

    The query is a strided view into a fused QKV projection, as a model runner hands it over.
    """
    shape = GQA_4_2
    generator = torch.Generator().manual_seed(7)
    final_lens = [36, 27, 16]
    tables, num_blocks = make_block_tables(final_lens, shape.block_size, generator)
    cache_ref = make_cache(num_blocks, shape, dtype, generator)
    cache_triton = cache_ref.clone()
    steps = [  # (query_lens, seq_lens)
        ([20, 9, 16], [20, 9, 16]),
        ([14, 16, 0], [34, 25, 16]),
        ([1, 1, 0], [35, 26, 16]),
        ([1, 1, 0], [36, 27, 16]),
    ]
    q_width = shape.num_heads * shape.head_dim
    for query_lens, seq_lens in steps:
        meta = kernels.AttentionMetadata.build(query_lens, seq_lens, tables, shape.block_size)
        query, key, value = make_step(sum(query_lens), shape, dtype, generator)
        qkv = torch.cat([query.flatten(1), key.flatten(1), value.flatten(1)], dim=1)
        query_view = qkv[:, :q_width].view(-1, shape.num_heads, shape.head_dim)
        expected, actual = run_both(query_view, key, value, cache_ref, cache_triton, meta, shape)
        assert_agree(expected, actual)
        assert torch.equal(cache_triton, cache_ref)


def test_bf16_decode_and_prefill_match_torch():
    check_step([6, 1], [22, 17], GQA_4_2, torch.bfloat16, seed=3)
    check_step([1, 1], [22, 17], GQA_4_2, torch.bfloat16, seed=4)


@pytest.mark.parametrize(
    ("value_dtype", "cache_dtype"),
    [
        pytest.param("float32", "float32", id="fp32"),
        pytest.param("float32", "float16", id="fp32-into-fp16-cache"),
    ],
)
def test_write_kv_stores_the_same_cache_as_torch(value_dtype, cache_dtype):
    shape = Shape(num_heads=3, num_kv_heads=3, head_dim=16, block_size=8)
    generator = torch.Generator().manual_seed(11)
    seq_lens = [9, 16, 3]
    tables, num_blocks = make_block_tables(seq_lens, shape.block_size, generator)
    meta = kernels.AttentionMetadata.build(seq_lens, seq_lens, tables, shape.block_size)
    cache_ref = make_cache(num_blocks, shape, cache_dtype, generator)
    before = cache_ref.clone()
    cache_triton = cache_ref.clone()
    _, key, value = make_step(sum(seq_lens), shape, value_dtype, generator)

    torch_attention.write_kv(cache_ref, LAYER, key, value, meta.slot_mapping)
    triton_attention.write_kv(cache_triton, LAYER, key, value, meta.slot_mapping)

    assert torch.equal(cache_triton, cache_ref)
    assert torch.equal(cache_triton[:, 1 - LAYER], before[:, 1 - LAYER])  # the other layer is untouched
    block_id, offset = divmod(meta.slot_mapping[-1].item(), shape.block_size)
    assert torch.equal(cache_triton[block_id, LAYER, 1, offset], value[-1].to(as_dtype(cache_dtype)))


def test_mismatched_head_counts_are_rejected():
    shape = Shape(num_heads=5, num_kv_heads=2, head_dim=16)
    generator = torch.Generator().manual_seed(0)
    meta = kernels.AttentionMetadata.build([2], [2], [[0]], shape.block_size)
    query, key, value = make_step(2, shape, torch.float32, generator)
    cache = make_cache(1, shape, torch.float32, generator)
    with pytest.raises(ValueError, match="5"):
        triton_attention.forward(query, key, value, cache, LAYER, meta, 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("query_lens", "seq_lens"),
    [
        pytest.param([1, 1, 1], [20, 45, 70], id="decode"),
        pytest.param([30, 12, 1], [30, 60, 50], id="fresh-chunk-and-decode"),
    ],
)
def test_sliding_window_matches_torch_and_never_reads_slid_out_blocks(query_lens, seq_lens, dtype):
    """A 16-token window: both backends attend only to each row's last 16 positions. Blocks wholly before
    every row's window hold NaN (a freed block reused by someone else): neither backend may read them."""
    shape, window = GQA_4_2, 16
    generator = torch.Generator().manual_seed(sum(seq_lens))
    tables, num_blocks = make_block_tables(seq_lens, shape.block_size, generator)
    meta = kernels.AttentionMetadata.build(query_lens, seq_lens, tables, shape.block_size)
    cache = make_cache(num_blocks, shape, dtype, generator)
    for table, q_len, s_len in zip(tables, query_lens, seq_lens, strict=True):
        first_needed = max(0, s_len - q_len - window + 1)
        for block in table[: first_needed // shape.block_size]:
            cache[block] = float("nan")
    query, key, value = make_step(sum(query_lens), shape, dtype, generator)
    scale = shape.head_dim**-0.5
    cache_ref, cache_triton = cache.clone(), cache.clone()
    expected = torch_attention.forward(query, key, value, cache_ref, LAYER, meta, scale, window)
    actual = triton_attention.forward(query, key, value, cache_triton, LAYER, meta, scale, window)
    assert torch.isfinite(expected).all()
    assert_agree(expected, actual)
    # and the window is what the reference applied: a dense softmax over each row's last 16 keys
    start = 0
    for i, (q_len, s_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        blocks = torch.tensor(tables[i])
        keys = cache_ref[blocks, LAYER, 0].reshape(-1, shape.num_kv_heads, shape.head_dim)[:s_len].float()
        values = cache_ref[blocks, LAYER, 1].reshape(-1, shape.num_kv_heads, shape.head_dim)[:s_len].float()
        group = shape.num_heads // shape.num_kv_heads
        for r in range(q_len):
            pos = s_len - q_len + r
            lo = max(0, pos - window + 1)
            q = query[start + r].float().view(shape.num_kv_heads, group, shape.head_dim)
            scores = torch.einsum("hgd,thd->hgt", q, keys[lo : pos + 1]) * scale
            dense = torch.einsum("hgt,thd->hgd", scores.softmax(-1), values[lo : pos + 1]).reshape(-1, shape.head_dim)
            atol, rtol = TOLERANCE[dtype]
            torch.testing.assert_close(expected[start + r].float(), dense, atol=atol, rtol=rtol)
        start += q_len
