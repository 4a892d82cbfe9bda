"""The C++ CPU kernels (`kernels/cpu_native`) compute what the pure torch paths compute."""

from __future__ import annotations

import pytest
from conftest import lazy_import

torch = lazy_import("torch")
kernels = lazy_import("dynserve.engine.kernels")
cpu_native = lazy_import("dynserve.engine.kernels.cpu_native")
cpu_ops = lazy_import("dynserve.engine.kernels.cpu_ops")
torch_attention = lazy_import("dynserve.engine.kernels.torch_attention")


@pytest.fixture(scope="module")
def kernel():  # type: ignore[no-untyped-def]
    module = cpu_native.load()
    assert module is not None, "the C++ kernel must build on the CI machine (g++ and ninja are installed)"
    return module


@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), [(9, 3, 64, 16), (8, 2, 64, 16), (8, 2, 128, 16), (6, 3, 128, 8), (4, 4, 32, 8), (8, 1, 16, 4), (4, 1, 256, 16)])
def test_decode_kernel_matches_torch_path(kernel, monkeypatch, num_heads, num_kv_heads, head_dim, block_size, window) -> None:  # type: ignore[no-untyped-def]
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
    meta = kernels.AttentionMetadata.build([1] * len(seq_lens), seq_lens, tables, block_size)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=g)
    key = torch.randn(len(seq_lens), num_kv_heads, head_dim, generator=g)
    value = torch.randn(len(seq_lens), num_kv_heads, head_dim, generator=g)

    monkeypatch.setattr("dynserve.engine.kernels.torch_attention.USE_NATIVE_DECODE", False)
    ref_cache = cache.clone()
    expected = torch_attention.forward(query, key, value, ref_cache, 1, meta, head_dim**-0.5, window)
    monkeypatch.setattr("dynserve.engine.kernels.torch_attention.USE_NATIVE_DECODE", True)
    meta.backend_plan = None
    actual = torch_attention.forward(query, key, value, cache, 1, meta, head_dim**-0.5, window)
    assert torch.equal(cache, ref_cache)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_rows", [1, 3, 5])
def test_bf16_decode_kernel_writes_and_attends_as_the_torch_path(kernel, monkeypatch, num_rows) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(1)
    block_size, num_blocks = 16, 64
    cache = torch.randn(num_blocks, 2, 2, block_size, 3, 64, generator=g).bfloat16()
    seq_lens = [17, 2, 40, 33, 64][:num_rows]
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = [order[4 * i : 4 * i + 4] for i in range(num_rows)]
    meta = kernels.AttentionMetadata.build([1] * num_rows, seq_lens, tables, block_size)
    # strided views of one fused projection, as the model hands them over
    qkv = torch.randn(num_rows, (9 + 6) * 64, generator=g).bfloat16()
    query, key, value = qkv[:, :576].view(-1, 9, 64), qkv[:, 576:768].view(-1, 3, 64), qkv[:, 768:].view(-1, 3, 64)

    monkeypatch.setattr("dynserve.engine.kernels.torch_attention.USE_NATIVE_DECODE", False)
    ref_cache = cache.clone()
    expected = torch_attention.forward(query, key, value, ref_cache, 1, meta, 0.125)
    monkeypatch.setattr("dynserve.engine.kernels.torch_attention.USE_NATIVE_DECODE", True)
    meta.backend_plan = None
    actual = torch_attention.forward(query, key, value, cache, 1, meta, 0.125)
    assert meta.backend_plan.native_decode is not None
    assert torch.equal(cache, ref_cache)  # the same slots written, and nothing else
    assert actual.dtype == torch.bfloat16
    # both sum in fp32; the torch path rounds its scores to bf16 on the way, the kernel does not
    torch.testing.assert_close(actual.float(), expected.float(), atol=3e-2, rtol=3e-2)


def test_the_decode_kernels_refuse_metadata_outside_the_cache(kernel) -> None:  # type: ignore[no-untyped-def]
    cache = torch.zeros(4, 1, 2, 16, 1, 64, dtype=torch.bfloat16)
    q, kv = torch.zeros(1, 1, 64, dtype=torch.bfloat16), torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    before = cache.clone()
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernel.write_and_decode(q, kv, kv, cache, 0, torch.tensor([64]), tables, lens, 1.0, 0)
    with pytest.raises(RuntimeError, match="layer 1 out of range"):
        kernel.write_and_decode(q, kv, kv, cache, 1, torch.tensor([3]), tables, lens, 1.0, 0)
    with pytest.raises(RuntimeError, match="does not fit its block table"):
        kernel.paged_decode(q, cache, 0, tables, torch.tensor([17], dtype=torch.int32), 1.0, 0)
    with pytest.raises(RuntimeError, match="context length 0"):
        kernel.paged_decode(q, cache, 0, tables, torch.tensor([0], dtype=torch.int32), 1.0, 0)
    with pytest.raises(RuntimeError, match="block 4 out of range"):
        kernel.paged_decode(q, cache, 0, torch.tensor([[4]], dtype=torch.int32), lens, 1.0, 0)
    assert torch.equal(cache, before)  # a refused call wrote nothing


# ---- the bf16 step's ops against eager torch ---------------------------------------------------------------


@pytest.fixture(scope="module")
def native_ops(kernel):  # type: ignore[no-untyped-def]
    return cpu_ops.NativeBf16Ops(kernel)


@pytest.mark.parametrize("num_rows", [1, 2, 3, 5, 6, 7, 13, 16, 64, 300])
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (577, 1536), (3, 40), (49, 2)])
def test_linear_matches_an_fp32_product(kernel, num_rows, out_features, in_features) -> None:  # type: ignore[no-untyped-def]
    if not kernel.has_avx512_bf16():
        pytest.skip("no AVX512-BF16 on this CPU: the torch GEMM serves every linear")
    g = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, in_features, generator=g).bfloat16()
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    packed = cpu_ops.pack_linear(w)
    assert packed.packed.shape == (-(-out_features // 16), in_features // 2, 16, 2)
    exact = x.float() @ w.float().T  # bf16 inputs are exact in fp32; only the summation order differs
    out32 = kernel.linear(x, packed.packed, out_features, True)
    assert out32.dtype == torch.float32 and out32.shape == (num_rows, out_features)
    torch.testing.assert_close(out32, exact, atol=1e-3 * in_features**0.5, rtol=1e-4)
    out16 = kernel.linear(x, packed.packed, out_features, False)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16, exact.bfloat16(), atol=1e-3 * in_features**0.5, rtol=1e-2)
    # a strided view of the rows (as the model's slices are) reads the same values
    wide = torch.cat([x, x], dim=1)[:, :in_features]
    torch.testing.assert_close(kernel.linear(wide, packed.packed, out_features, True), out32, atol=0, rtol=0)


def test_ops_refuse_what_they_cannot_compute(kernel) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RuntimeError, match="bf16 only"):
        kernel.rms_norm(torch.zeros(2, 8), torch.ones(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(RuntimeError, match="7 weights for rows of 8"):
        kernel.rms_norm(torch.zeros(2, 8, dtype=torch.bfloat16), torch.ones(7, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="only bf16 weights"):
        cpu_ops.pack_linear(torch.zeros(4, 8))
    with pytest.raises(ValueError, match="odd number of input features"):
        cpu_ops.pack_linear(torch.zeros(4, 9, dtype=torch.bfloat16))
    if kernel.has_avx512_bf16():
        packed = cpu_ops.pack_linear(torch.zeros(20, 8, dtype=torch.bfloat16)).packed
        with pytest.raises(RuntimeError, match="shapes"):
            kernel.linear(torch.zeros(2, 10, dtype=torch.bfloat16), packed, 20, False)
        with pytest.raises(RuntimeError, match="output features"):
            kernel.linear(torch.zeros(2, 8, dtype=torch.bfloat16), packed, 33, False)
        with pytest.raises(RuntimeError, match="packed by pack_linear"):
            kernel.linear(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(20, 8, dtype=torch.bfloat16), 20, False)


@pytest.mark.parametrize("num_rows", [1, 5, 130])
def test_fused_ops_match_eager_torch(native_ops, num_rows) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(7)
    ref = cpu_ops.TorchOps(torch.bfloat16)
    hidden, eps = 576, 1e-5
    x = torch.randn(num_rows, hidden, generator=g).bfloat16()
    residual = torch.randn(num_rows, hidden, generator=g).bfloat16()
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).bfloat16()
    bf16 = {"atol": 2e-2, "rtol": 2e-2}  # one bf16 rounding apart

    torch.testing.assert_close(native_ops.rms_norm(x, weight, eps), ref.rms_norm(x, weight, eps), **bf16)
    expected_out, expected_residual = ref.add_rms_norm(x, residual.clone(), weight, eps)
    out, new_residual = native_ops.add_rms_norm(x, residual.clone(), weight, eps)
    assert torch.equal(new_residual, expected_residual)  # the add rounds exactly as torch's
    torch.testing.assert_close(out, expected_out, **bf16)

    gate_up = torch.randn(num_rows, 2 * 1536, generator=g).bfloat16()
    torch.testing.assert_close(native_ops.silu_mul(gate_up), ref.silu_mul(gate_up), **bf16)

    positions = torch.randint(0, 8192, (num_rows,), generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    qkv = torch.randn(num_rows, (9 + 2 * 3) * 64, generator=g).bfloat16()
    expected = ref.rope_qkv(qkv.clone(), ref.rope_tables(positions, inv_freq), 9, 3, 64)
    actual = native_ops.rope_qkv(qkv.clone(), native_ops.rope_tables(positions, inv_freq), 9, 3, 64)
    for a, e in zip(actual, expected, strict=True):
        # torch rotates with bf16 cos/sin; the kernel with fp32 ones (closer to the exact rotation)
        torch.testing.assert_close(a, e, atol=5e-2, rtol=2e-2)
    assert torch.equal(actual[2], qkv[:, 15 * 64 - 3 * 64 :].view(num_rows, 3, 64))  # values untouched

    torch.testing.assert_close(native_ops.gelu_tanh_mul(gate_up), ref.gelu_tanh_mul(gate_up), **bf16)
    # Qwen2's projection bias, Qwen3's and Gemma 3's q/k norm, a YaRN-style attention factor: one pass
    bias = (0.5 * torch.randn(15 * 64, generator=g)).bfloat16()
    q_norm, k_norm = ((1 + 0.2 * torch.randn(64, generator=g)).bfloat16() for _ in range(2))
    extras = (bias, q_norm, k_norm, 1e-6)
    expected = ref.rope_qkv(qkv.clone(), ref.rope_tables(positions, inv_freq, 1.2), 9, 3, 64, *extras)
    actual = native_ops.rope_qkv(qkv.clone(), native_ops.rope_tables(positions, inv_freq, 1.2), 9, 3, 64, *extras)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, atol=8e-2, rtol=3e-2)


def test_select_ops_takes_the_kernels_for_bf16_on_cpu_only(kernel, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    cpu = torch.device("cpu")
    assert cpu_ops.select_ops(torch.bfloat16, cpu).name == "native-bf16"
    assert cpu_ops.select_ops(torch.float32, cpu).name == "torch"  # fp32 stays exactly eager torch
    monkeypatch.setattr("dynserve.engine.kernels.cpu_ops.USE_NATIVE_OPS", False)
    assert cpu_ops.select_ops(torch.bfloat16, cpu).name == "torch"


def test_dtype_auto_is_bf16_only_where_the_kernels_run_and_bf16_elsewhere_is_warned_of(  # type: ignore[no-untyped-def]
        kernel, caplog) -> None:
    from dynserve.engine.llm_engine import resolve_dtype

    cpu = torch.device("cpu")
    has_bf16 = kernel.has_avx512_bf16()
    assert resolve_dtype("auto", cpu) == (torch.bfloat16 if has_bf16 else torch.float32)
    with caplog.at_level("WARNING", logger="dynserve.engine.llm_engine"):
        assert resolve_dtype("bfloat16", cpu) == torch.bfloat16  # served as asked
        assert resolve_dtype("float32", cpu) == torch.float32
    warned = [r.getMessage() for r in caplog.records if "AVX512-BF16" in r.getMessage()]
    assert len(warned) == (0 if has_bf16 else 1), warned
