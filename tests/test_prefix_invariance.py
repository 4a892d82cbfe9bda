"""bf16 prefill is prefix-invariant: the KV a prompt leaves in the cache and the logits after it are
bit-identical however the prompt was split, whether its first tokens came from the prefix cache (written by an
earlier prefill or by decode steps), an earlier prefill chunk, or the same chunk as the rest.

So a greedy answer never changes with what the prefix cache held (issue 35: the KV tiers' outputs followed
whether a prefix was reused). It holds where every bf16 row goes to the one C++ attention kernel
(`cpu_native.paged_attention`, AVX512-BF16); the linears, norms and rope are row-wise already.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import lazy_import

from dynserve.protocol import SamplingParams

torch = lazy_import("torch")
kernels = lazy_import("dynserve.engine.kernels")
cpu_native = lazy_import("dynserve.engine.kernels.cpu_native")
torch_attention = lazy_import("dynserve.engine.kernels.torch_attention")

BLOCK = 16


@pytest.fixture(scope="module")
def kernel() -> Any:
    module = cpu_native.load()
    assert module is not None, "the C++ kernel must build on the CI machine (g++ and ninja are installed)"
    if not module.has_avx512_bf16():
        pytest.skip("the bf16 attention kernel needs AVX512-BF16")
    return module


def _model(windows: tuple[int, ...] = (), num_layers: int = 2) -> Any:
    from dynserve.engine.loader import ModelConfig
    from dynserve.engine.models.decoder import CausalLM

    config = ModelConfig(model_id="tiny-invariance", vocab_size=512, hidden_size=128, intermediate_size=256,
                         num_layers=num_layers, num_heads=6, num_kv_heads=2, head_dim=64, rope_theta=10000.0,
                         rms_norm_eps=1e-5, max_position_embeddings=1024, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, layer_windows=windows)
    model = CausalLM(config, torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return model.eval()


def _ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _step(model: Any, cache: Any, seqs: list[tuple[list[int], int, list[int]]]) -> Any:
    """One step: for each (token ids, tokens already cached, block table), its remaining tokens; the last
    logits of each."""
    ids, positions, q_lens, seq_lens, last = [], [], [], [], []
    for tokens, start, _ in seqs:
        ids += tokens[start:]
        positions += range(start, len(tokens))
        q_lens.append(len(tokens) - start)
        seq_lens.append(len(tokens))
        last.append(len(ids) - 1)
    meta = kernels.AttentionMetadata.build(q_lens, seq_lens, [table for *_, table in seqs], BLOCK)
    with torch.inference_mode():
        return model(torch.tensor(ids), torch.tensor(positions), cache, meta, torch_attention,
                     torch.tensor(last))


def _cache(model: Any, num_blocks: int) -> Any:
    cfg = model.config
    shape = (num_blocks, cfg.num_layers, 2, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    return torch.zeros(shape, dtype=torch.bfloat16)


def _run(model: Any, tokens: list[int], cuts: list[int], decode_from: int | None = None) -> tuple[Any, Any]:
    """The cache and last logits after `tokens` went through the model in chunks ending at `cuts` (then
    one token a step from `decode_from`), each chunk its own step."""
    num_blocks = -(-len(tokens) // BLOCK)
    table = list(range(1, num_blocks + 1))  # block 0 unused, so a stray write would show
    cache = _cache(model, num_blocks + 1)
    ends = [*cuts, len(tokens)] if decode_from is None else [*cuts, *range(decode_from, len(tokens) + 1)]
    start, logits = 0, None
    for end in ends:
        if end > start:
            logits = _step(model, cache, [(tokens[:end], start, table[: -(-end // BLOCK)])])
            start = end
    return cache, logits


@pytest.mark.parametrize("windows", [(), (0, 24)], ids=["full", "sliding"])
@pytest.mark.parametrize(("length", "cuts"), [
    (40, [16]), (100, [48]), (100, [32, 64]), (150, [7, 61, 99]), (300, [128]), (300, [100, 101, 250]),
])
def test_a_prompt_split_into_chunks_leaves_the_same_kv_and_logits(
    kernel: Any, windows: tuple[int, ...], length: int, cuts: list[int]
) -> None:
    model = _model(windows)
    tokens = _ids(length)
    whole_cache, whole_logits = _run(model, tokens, [])
    split_cache, split_logits = _run(model, tokens, cuts)
    assert torch.equal(split_cache, whole_cache)
    assert torch.equal(split_logits, whole_logits)


@pytest.mark.parametrize("windows", [(), (0, 24)], ids=["full", "sliding"])
@pytest.mark.parametrize(("length", "decode_from"), [(40, 33), (90, 60)])
def test_tokens_decoded_leave_the_kv_a_prefill_of_them_leaves(
    kernel: Any, windows: tuple[int, ...], length: int, decode_from: int
) -> None:
    """A conversation's next turn reuses the blocks its answer filled while decoding: they must hold what a
    fresh prefill of the same tokens holds, or the next answer depends on whether they were still cached."""
    model = _model(windows)
    tokens = _ids(length)
    whole_cache, whole_logits = _run(model, tokens, [])
    decoded_cache, decoded_logits = _run(model, tokens, [decode_from], decode_from=decode_from)
    assert torch.equal(decoded_cache, whole_cache)
    assert torch.equal(decoded_logits, whole_logits)


def test_a_row_does_not_depend_on_the_rest_of_its_step(kernel: Any) -> None:
    model = _model()
    prompt, other = _ids(70), _ids(45, seed=2)
    cache = _cache(model, 12)
    alone = _step(model, cache, [(prompt, 0, [1, 2, 3, 4, 5])])
    expected = cache[1:6].clone()
    cache.zero_()
    _step(model, cache, [(other[:44], 0, [6, 7, 8])])
    mixed = _step(model, cache, [(other, 44, [6, 7, 8]), (prompt, 0, [1, 2, 3, 4, 5])])
    assert torch.equal(mixed[1], alone[0])
    assert torch.equal(cache[1:6], expected)


# ---- the kernel: prefill rows as decode rows, and against torch ------------------------------------------


def _random_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, seed: int) -> Any:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, 2, 2, block_size, kv_heads, head_dim, generator=g).bfloat16()


@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"),
                         [(9, 3, 64, 16), (8, 2, 64, 8), (8, 2, 128, 16), (4, 1, 256, 32), (2, 2, 64, 16)])
def test_every_prefill_row_equals_the_decode_row_at_its_position(
    kernel: Any, window: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    g = torch.Generator().manual_seed(3)
    seq_lens, q_lens = [150, 37, 9], [61, 37, 1]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 1
    cache = _random_cache(num_blocks, block_size, num_kv_heads, head_dim, 4)
    order = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables, used = [], 0
    for n in seq_lens:
        tables.append(order[used : used + -(-n // block_size)])
        used += len(tables[-1])
    meta = kernels.AttentionMetadata.build(q_lens, seq_lens, tables, block_size)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).bfloat16()
    scale = head_dim**-0.5
    out = kernel.paged_attention(query, cache, 1, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                 scale, window)
    assert out.dtype == torch.bfloat16
    # each row alone, as a decode row at its position
    rows, row_lens, row_tables = [], [], []
    for i, (n, q_len) in enumerate(zip(seq_lens, q_lens, strict=True)):
        for t in range(q_len):
            rows.append(meta.query_start_loc_cpu[i] + t)
            row_lens.append(n - q_len + t + 1)
            row_tables.append(meta.block_tables[i])
    one_by_one = kernel.paged_decode(query[rows], cache, 1, torch.stack(row_tables),
                                     torch.tensor(row_lens, dtype=torch.int32), scale, window)
    assert torch.equal(out[rows], one_by_one)
    # and the reference: fp32 attention over the same bf16 keys and values
    for i, (n, q_len) in enumerate(zip(seq_lens, q_lens, strict=True)):
        k = cache[tables[i], 1, 0].reshape(-1, num_kv_heads, head_dim)[:n].float().transpose(0, 1)
        v = cache[tables[i], 1, 1].reshape(-1, num_kv_heads, head_dim)[:n].float().transpose(0, 1)
        q = query[meta.query_start_loc_cpu[i] : meta.query_start_loc_cpu[i + 1]].float().transpose(0, 1)
        pos = torch.arange(n - q_len, n)[:, None]
        keys = torch.arange(n)[None, :]
        mask = (keys <= pos) & ((keys > pos - window) if window else True)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True
        )[0].transpose(0, 1)
        got = out[meta.query_start_loc_cpu[i] : meta.query_start_loc_cpu[i + 1]].float()
        torch.testing.assert_close(got, ref, atol=1e-2, rtol=1e-2)


def test_the_kernel_refuses_metadata_outside_the_cache(kernel: Any) -> None:
    cache = torch.zeros(4, 1, 2, 16, 1, 64, dtype=torch.bfloat16)
    q = torch.zeros(2, 1, 64, dtype=torch.bfloat16)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    starts = torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="does not fit its block table"):
        kernel.paged_attention(q, cache, 0, tables, torch.tensor([17], dtype=torch.int32), starts, 1.0, 0)
    with pytest.raises(RuntimeError, match="block 4 out of range"):
        kernel.paged_attention(q, cache, 0, torch.tensor([[4]], dtype=torch.int32), lens, starts, 1.0, 0)
    with pytest.raises(RuntimeError, match="query starts do not cover"):
        kernel.paged_attention(q, cache, 0, tables, lens, torch.tensor([0, 1], dtype=torch.int32), 1.0, 0)
    with pytest.raises(RuntimeError, match="3 query tokens in a context of 2"):
        kernel.paged_attention(torch.zeros(3, 1, 64, dtype=torch.bfloat16), cache, 0, tables, lens,
                               torch.tensor([0, 3], dtype=torch.int32), 1.0, 0)


# ---- the engine: a greedy answer does not follow what the prefix cache held ------------------------------


def test_a_next_turn_answers_the_same_with_or_without_its_prefix_cached(kernel: Any, tokenizer: Any) -> None:
    from dynserve.config import Settings
    from dynserve.engine.llm_engine import LLMEngine, LoadedModel

    model = _model(num_layers=4)  # (with 2 layers the answers before the fix happened to agree)
    loaded = LoadedModel(model.config, model, tokenizer, torch.device("cpu"))
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    turn0 = _ids(53)
    cached = LLMEngine(Settings(dtype="bfloat16", device="cpu", kv_blocks=32), loaded=loaded)
    answer = cached.generate([turn0], greedy)[0].token_ids
    turn1 = turn0 + answer + _ids(20, seed=5)
    reused_logits = cached.compute_logits([turn1])
    reused = cached.generate([turn1], greedy)[0]
    # the blocks reused hold the prompt and the first answer's tokens, written by decode steps
    assert cached.scheduler.num_cached_prompt_tokens >= 80
    no_cache = Settings(dtype="bfloat16", device="cpu", kv_blocks=32, enable_prefix_caching=False)
    fresh_engine = LLMEngine(no_cache, loaded=loaded)
    assert torch.equal(reused_logits, fresh_engine.compute_logits([turn1]))
    assert reused.token_ids == fresh_engine.generate([turn1], greedy)[0].token_ids
