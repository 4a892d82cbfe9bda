// bf16 attention over the paged cache with one arithmetic for every query row (AVX512-BF16 CPUs).
//
// A query row (one head of one token at context length L) attends to the cached keys and values
// `start .. L - 1` (start is 0, or where its sliding window begins), and its result is computed by the same
// operations in the same order whether the row is a decode step's or one of a prefill chunk's, wherever that
// chunk begins, and whatever else the step holds. So the keys and values a prompt's tokens leave in the cache,
// and the logits after it, are bit-identical whether its prefix was prefilled in another chunk, reused from the
// prefix cache (written by an earlier prefill or by decode steps) or prefilled with the rest. The keys and
// values are always read back from the cache, rounded as stored.
//
// The row's arithmetic, fixed:
// - score of key j: the dot product of the bf16 query and key in `vdpbf16ps` steps of 32 dimensions, chained
//   in order into one 16-lane fp32 accumulator, summed across lanes by one tree (`hsum16`), times `scale`;
// - softmax over the row's keys: the max; e = exp(score - max) by one vectorized exp (`exp16`); the sum of e in
//   16-lane steps from the row's first key, summed across lanes; p = e * (1 / sum);
// - output: sum over j of p_j * v_j, one fused multiply-add a key, in key order, in fp32.
// Tiles of several tokens compute extra scores past a row's keys (and before its window) but give them
// p = 0, and fma(0, v, acc) leaves acc unchanged (acc starts at +0 and is never -0).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

bool has_avx512_bf16();  // cpu_ops.cpp

namespace {

struct Bf16Layout {
  int64_t num_heads, group, head_dim, block_size, max_blocks;
  int64_t s_block, s_kv, s_tok, s_head;
  int64_t window;  // > 0: a row attends only to its last `window` keys
};

// One unit of work: `num_tokens` consecutive query tokens of a sequence (token t has context length
// `len0 + t`) and the query heads of one KV head.
struct Tile {
  int64_t seq, kv_head, first_token, num_tokens, len0;
};

#if defined(__x86_64__)
#define DYN_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16,avx512vl")))

// Lane j of the result is the sum of the 16 lanes of a[j], by one tree for every j:
// P[i] = x[i] + x[i + 8], Q[i] = P[i] + P[i + 4], R[i] = Q[i] + Q[i + 2], sum = R[0] + R[1].
DYN_BF16_TARGET inline __m512 hsum16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int k = 0; k < 8; ++k)
    b[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0xEE));
  for (int k = 0; k < 4; ++k)
    c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], 0xDD));
  for (int k = 0; k < 2; ++k)
    d[k] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * k], c[2 * k + 1], 0x44), _mm512_shuffle_ps(c[2 * k], c[2 * k + 1], 0xEE));
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
  // lane 4m + r of e holds the sum of a[4r + m]
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, e);
}

// e^x for x <= 0: 2^n e^r with n = round(x / ln 2), e^r by Cephes' expf polynomial (about 1 ulp).
DYN_BF16_TARGET inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

inline __mmask16 first_lanes(int64_t count) { return static_cast<__mmask16>((1u << count) - 1u); }

inline void prefetch_rows(const void* first, int64_t count, int64_t stride_bytes, int64_t row_bytes) {
  const char* p = static_cast<const char*>(first);
  for (int64_t j = 0; j < count; ++j)
    for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(p + j * stride_bytes + off, 0, 3);
}

// s[r * width + j - kstart] = scale * q_r . k_j for every row r and key j in [kstart, kend).
template <int64_t D>
DYN_BF16_TARGET void score_rows(const Bf16Layout& lay, const at::BFloat16* __restrict__ keys,
                                const int32_t* __restrict__ table, int64_t kstart, int64_t kend,
                                const at::BFloat16* __restrict__ q, int64_t q_stride, int64_t rows, float* s,
                                int64_t width, float scale) {
  constexpr int64_t C = D / 32;
  const int64_t bs = lay.block_size, group = lay.group;
  const int64_t stride_bytes = lay.s_tok * 2, row_bytes = D * 2;
  const __m512 vscale = _mm512_set1_ps(scale);
  prefetch_rows(keys + table[kstart / bs] * lay.s_block + (kstart % bs) * lay.s_tok,
                std::min(bs - kstart % bs, kend - kstart), stride_bytes, row_bytes);
  for (int64_t b = kstart / bs; b * bs < kend; ++b) {
    const int64_t lo = std::max<int64_t>(0, kstart - b * bs), hi = std::min(bs, kend - b * bs);
    const at::BFloat16* base = keys + table[b] * lay.s_block;
    if ((b + 1) * bs < kend)
      prefetch_rows(keys + table[b + 1] * lay.s_block, std::min(bs, kend - (b + 1) * bs), stride_bytes, row_bytes);
    for (int64_t j0 = lo; j0 < hi; j0 += 16) {
      const int64_t count = std::min<int64_t>(16, hi - j0);
      float* dst = s + (b * bs + j0 - kstart);
      for (int64_t r = 0; r < rows; ++r) {
        const at::BFloat16* qr = q + (r / group) * q_stride + (r % group) * D;
        __m512bh qv[C];
        for (int64_t c = 0; c < C; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qr + c * 32);
        __m512 acc[16];
        for (int64_t j = 0; j < 16; ++j) {
          if (j < count) {
            const at::BFloat16* k = base + (j0 + j) * lay.s_tok;
            __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(k), qv[0]);
            for (int64_t c = 1; c < C; ++c) a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(k + c * 32), qv[c]);
            acc[j] = a;
          } else {
            acc[j] = _mm512_setzero_ps();
          }
        }
        _mm512_mask_storeu_ps(dst + r * width, first_lanes(count), _mm512_mul_ps(hsum16(acc), vscale));
      }
    }
  }
}

// The row's scores in [lo, hi) become its probabilities; the rest of [0, n) becomes 0.
DYN_BF16_TARGET void softmax_row(float* s, int64_t lo, int64_t hi, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = lo; i < hi; ++i) m = std::max(m, s[i]);
  const __m512 vm = _mm512_set1_ps(m);
  __m512 total = _mm512_setzero_ps();
  for (int64_t i = lo; i < hi; i += 16) {
    const __mmask16 mask = first_lanes(std::min<int64_t>(16, hi - i));
    const __m512 e = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + i), vm)));
    total = _mm512_add_ps(total, e);
    _mm512_mask_storeu_ps(s + i, mask, e);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total));
  for (int64_t i = lo; i < hi; i += 16) {
    const __mmask16 mask = first_lanes(std::min<int64_t>(16, hi - i));
    _mm512_mask_storeu_ps(s + i, mask, _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, s + i), inv));
  }
  std::fill(s, s + lo, 0.f);
  std::fill(s + hi, s + n, 0.f);
}

// acc[rr * D ...] += p[rr * width + j] * value row j for `count` value rows (`stride` elements apart) and R rows;
// the R x D accumulators stay in registers for the block.
template <int64_t D, int R>
DYN_BF16_TARGET __attribute__((noinline)) void accumulate_block(const at::BFloat16* __restrict__ values, int64_t stride,
                                                                int64_t count, const float* __restrict__ p,
                                                                int64_t width, float* __restrict__ acc) {
  constexpr int64_t C = D / 16;
  __m512 a[R][C];
  for (int rr = 0; rr < R; ++rr)
    for (int64_t c = 0; c < C; ++c) a[rr][c] = _mm512_loadu_ps(acc + rr * D + c * 16);
  for (int64_t j = 0; j < count; ++j) {
    const at::BFloat16* v = values + j * stride;
    __m512 w[R];
    for (int rr = 0; rr < R; ++rr) w[rr] = _mm512_set1_ps(p[rr * width + j]);
    for (int64_t c = 0; c < C; ++c) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + c * 16));
      const __m512 vc = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
      for (int rr = 0; rr < R; ++rr) a[rr][c] = _mm512_fmadd_ps(w[rr], vc, a[rr][c]);
    }
  }
  for (int rr = 0; rr < R; ++rr)
    for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(acc + rr * D + c * 16, a[rr][c]);
}

// out row r (fp32, D wide) = sum over keys j in [kstart, kend) of p[r][j] * v_j, for R rows from `r0`.
template <int64_t D, int R>
void accumulate_rows(const Bf16Layout& lay, const at::BFloat16* __restrict__ values, const int32_t* __restrict__ table,
                     int64_t kstart, int64_t kend, const float* p, int64_t width, int64_t r0, float* out,
                     int64_t out_stride) {
  const int64_t bs = lay.block_size, group = lay.group;
  const int64_t stride_bytes = lay.s_tok * 2, row_bytes = D * 2;
  float acc[R * D] = {};
  for (int64_t b = kstart / bs; b * bs < kend; ++b) {
    const int64_t lo = std::max<int64_t>(0, kstart - b * bs), hi = std::min(bs, kend - b * bs);
    if ((b + 1) * bs < kend)
      prefetch_rows(values + table[b + 1] * lay.s_block, std::min(bs, kend - (b + 1) * bs), stride_bytes, row_bytes);
    accumulate_block<D, R>(values + table[b] * lay.s_block + lo * lay.s_tok, lay.s_tok, hi - lo,
                           p + r0 * width + (b * bs + lo - kstart), width, acc);
  }
  for (int rr = 0; rr < R; ++rr) {
    const int64_t r = r0 + rr;
    std::copy(acc + rr * D, acc + (rr + 1) * D, out + (r / group) * out_stride + (r % group) * D);
  }
}

template <int64_t D>
void accumulate_all(const Bf16Layout& lay, const at::BFloat16* values, const int32_t* table,
                                    int64_t kstart, int64_t kend, const float* p, int64_t width, int64_t rows,
                                    float* out, int64_t out_stride) {
  constexpr int kRows = D <= 64 ? 6 : (D <= 128 ? 3 : 1);  // R x D / 16 accumulators fit the registers
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    switch (std::min<int64_t>(kRows, rows - r0)) {
      case 6: accumulate_rows<D, (kRows >= 6 ? 6 : 1)>(lay, values, table, kstart, kend, p, width, r0, out, out_stride); break;
      case 5: accumulate_rows<D, (kRows >= 5 ? 5 : 1)>(lay, values, table, kstart, kend, p, width, r0, out, out_stride); break;
      case 4: accumulate_rows<D, (kRows >= 4 ? 4 : 1)>(lay, values, table, kstart, kend, p, width, r0, out, out_stride); break;
      case 3: accumulate_rows<D, (kRows >= 3 ? 3 : 1)>(lay, values, table, kstart, kend, p, width, r0, out, out_stride); break;
      case 2: accumulate_rows<D, (kRows >= 2 ? 2 : 1)>(lay, values, table, kstart, kend, p, width, r0, out, out_stride); break;
      default: accumulate_rows<D, 1>(lay, values, table, kstart, kend, p, width, r0, out, out_stride); break;
    }
  }
}

// One tile: scores of all its rows, each row's softmax over its own keys, then the weighted values.
template <int64_t D>
void attend_tile(const Bf16Layout& lay, const at::BFloat16* cache, const int32_t* table, const Tile& tile,
                 const at::BFloat16* q, int64_t q_stride, float* out, int64_t out_stride, float scale,
                 std::vector<float>& buf) {
  const int64_t rows = tile.num_tokens * lay.group;
  auto row_start = [&](int64_t t) {
    return lay.window > 0 ? std::max<int64_t>(0, tile.len0 + t - lay.window) : int64_t{0};
  };
  const int64_t kstart = row_start(0), kend = tile.len0 + tile.num_tokens - 1, n = kend - kstart;
  const int64_t width = (n + 15) & ~int64_t{15};
  buf.resize(rows * width);
  float* s = buf.data();
  const at::BFloat16* keys = cache + tile.kv_head * lay.s_head;
  score_rows<D>(lay, keys, table, kstart, kend, q, q_stride, rows, s, width, scale);
  const int64_t bs = lay.block_size, first = kstart / bs;
  prefetch_rows(keys + lay.s_kv + table[first] * lay.s_block + (kstart - first * bs) * lay.s_tok,
                std::min(bs * (first + 1), kend) - kstart, lay.s_tok * 2, lay.head_dim * 2);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r / lay.group;
    softmax_row(s + r * width, row_start(t) - kstart, tile.len0 + t - kstart, n);
  }
  accumulate_all<D>(lay, keys + lay.s_kv, table, kstart, kend, s, width, rows, out, out_stride);
}
#endif

// Runs every tile, the costliest first, each taken by whichever thread is free.
void run_tiles(const Bf16Layout& lay, const at::BFloat16* cache, const int32_t* tables, std::vector<Tile>& tiles,
               const at::BFloat16* q, float* out, float scale) {
#if defined(__x86_64__)
  auto cost = [](const Tile& t) { return t.num_tokens * (t.len0 + t.num_tokens); };
  std::stable_sort(tiles.begin(), tiles.end(), [&](const Tile& a, const Tile& b) { return cost(a) > cost(b); });
  const int64_t tok_stride = lay.num_heads * lay.head_dim;
  std::atomic<int64_t> next{0};
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_tiles), 1, [&](int64_t, int64_t) {
    std::vector<float> buf;
    for (int64_t i = next++; i < num_tiles; i = next++) {
      const Tile& t = tiles[i];
      const int64_t offset = t.first_token * tok_stride + t.kv_head * lay.group * lay.head_dim;
      const int32_t* table = tables + t.seq * lay.max_blocks;
      switch (lay.head_dim) {
        case 64: attend_tile<64>(lay, cache, table, t, q + offset, tok_stride, out + offset, tok_stride, scale, buf); break;
        case 128: attend_tile<128>(lay, cache, table, t, q + offset, tok_stride, out + offset, tok_stride, scale, buf); break;
        default: attend_tile<256>(lay, cache, table, t, q + offset, tok_stride, out + offset, tok_stride, scale, buf); break;
      }
    }
  });
#endif
}

constexpr int64_t kTileTokens = 8;  // a prefill chunk's tokens per tile (x the GQA group: its rows)

}  // namespace

bool bf16_attention_applies(const torch::Tensor& query, const torch::Tensor& kv_cache) {
  const int64_t d = query.dim() == 3 ? query.size(2) : 0;
  return query.scalar_type() == torch::kBFloat16 && kv_cache.scalar_type() == torch::kBFloat16 &&
         has_avx512_bf16() && (d == 64 || d == 128 || d == 256);
}

// Attention of the query tokens of each sequence: sequence i's tokens are rows query_start_loc[i] ..
// query_start_loc[i + 1] - 1 of `query` ([tokens, heads, head_dim], bf16), the last of them at context length
// seq_lens[i]; every key and value is read from the bf16 cache (the step's own already written there).
// Returns fp32 [tokens, heads, head_dim]. The caller has checked the metadata against the cache.
torch::Tensor bf16_attention(torch::Tensor query, const torch::Tensor& kv_cache, int64_t layer,
                             const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                             const std::vector<int64_t>& query_start_loc, double scale, int64_t window) {
  TORCH_CHECK(bf16_attention_applies(query, kv_cache), "bf16 attention: bf16 query and cache, head_dim 64/128/256");
  TORCH_CHECK(kv_cache.stride(5) == 1, "bf16 attention: head_dim must be contiguous");
  query = query.contiguous();
  const int64_t num_seqs = seq_lens.size(0), num_kv_heads = kv_cache.size(4);
  TORCH_CHECK(query.size(1) % num_kv_heads == 0 && kv_cache.size(5) == query.size(2), "bf16 attention: bad shapes");
  Bf16Layout lay{query.size(1), query.size(1) / num_kv_heads, query.size(2), kv_cache.size(3), block_tables.size(1),
                 kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3), kv_cache.stride(4), window};
  const auto* lens = seq_lens.data_ptr<int32_t>();
  std::vector<Tile> tiles;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t q_len = query_start_loc[i + 1] - query_start_loc[i];
    TORCH_CHECK(q_len >= 0 && q_len <= lens[i], "bf16 attention: ", q_len, " query tokens in a context of ", lens[i]);
    for (int64_t t0 = 0; t0 < q_len; t0 += kTileTokens)
      for (int64_t h = 0; h < num_kv_heads; ++h)
        tiles.push_back(Tile{i, h, query_start_loc[i] + t0, std::min(kTileTokens, q_len - t0), lens[i] - q_len + t0 + 1});
  }
  TORCH_CHECK(query_start_loc[num_seqs] == query.size(0), "bf16 attention: query rows do not match");
  auto out = torch::empty(query.sizes(), query.options().dtype(torch::kFloat32));
  run_tiles(lay, kv_cache.data_ptr<at::BFloat16>() + layer * kv_cache.stride(1), block_tables.data_ptr<int32_t>(),
            tiles, query.data_ptr<at::BFloat16>(), out.data_ptr<float>(), static_cast<float>(scale));
  return out;
}
