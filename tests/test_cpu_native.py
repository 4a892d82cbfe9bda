"""The C++ decode kernel (`kernels/cpu_native`) computes what the pure torch path computes."""

from __future__ import annotations

import pytest
import torch

from dynserve.engine.kernels import AttentionMetadata, cpu_native, torch_attention


@pytest.fixture(scope="module")
def kernel():  # type: ignore[no-untyped-def]
    module = cpu_native.load()
    assert module is not None, "the C++ kernel must build on the CI machine (g++ and ninja are installed)"
    return module


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), [(9, 3, 64, 16), (8, 2, 64, 16), (8, 2, 128, 16), (6, 3, 128, 8), (4, 4, 32, 8), (8, 1, 16, 4)])
def test_decode_kernel_matches_torch_path(kernel, monkeypatch, num_heads, num_kv_heads, head_dim, block_size) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(0)
    num_blocks, num_layers = 160, 3
    cache = torch.randn(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim, generator=g)
    seq_lens = [1, 2, block_size, block_size + 1, 3 * block_size, 301]
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for n in seq_lens:
        count = -(-n // block_size)
        tables.append(order[used : used + count])
        used += count
    meta = AttentionMetadata.build([1] * len(seq_lens), seq_lens, tables, block_size)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=g)
    key = torch.randn(len(seq_lens), num_kv_heads, head_dim, generator=g)
    value = torch.randn(len(seq_lens), num_kv_heads, head_dim, generator=g)

    monkeypatch.setattr(torch_attention, "USE_NATIVE_DECODE", False)
    ref_cache = cache.clone()
    expected = torch_attention.forward(query, key, value, ref_cache, 1, meta, head_dim**-0.5)
    monkeypatch.setattr(torch_attention, "USE_NATIVE_DECODE", True)
    meta.backend_plan = None
    actual = torch_attention.forward(query, key, value, cache, 1, meta, head_dim**-0.5)
    assert torch.equal(cache, ref_cache)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
