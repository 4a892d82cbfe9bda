// Paged decode attention for CPUs: one query token per sequence, read straight from the block-major KV
// cache [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] through the block table, so each
// key and value is read exactly once and nothing is gathered or copied. One work item per (sequence, KV
// head); the query heads sharing that KV head are processed together (GQA). The cache is fp32 or bf16;
// scores, softmax and the output are summed in fp32.
// head_dim and the query heads per KV head are template parameters for common shapes, so the inner loops
// compile to fixed-width SIMD. A bf16 query over a bf16 cache on an AVX512-BF16 CPU goes to the kernel of
// attention_bf16_cpu.cpp instead, whose arithmetic prefill rows share (`paged_attention`, defined here too).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

void register_cpu_ops(pybind11::module& m);  // cpu_ops.cpp
bool has_avx512_bf16();                       // cpu_ops.cpp
// attention_bf16_cpu.cpp
bool bf16_attention_applies(const torch::Tensor& query, const torch::Tensor& kv_cache);
torch::Tensor bf16_attention(torch::Tensor query, const torch::Tensor& kv_cache, int64_t layer,
                             const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                             const std::vector<int64_t>& query_start_loc, double scale, int64_t window);

namespace {


struct Layout {
  int64_t num_heads, num_kv_heads, group, head_dim, block_size, max_blocks;
  int64_t s_block, s_kv, s_tok, s_head;
  int64_t window;  // > 0: a row attends only to its last `window` tokens (sliding window); 0: to all
};

template <int64_t D, typename T>
inline float dot(const float* __restrict__ a, const T* __restrict__ b, int64_t n) {
  float acc = 0.f;
  const int64_t len = D > 0 ? D : n;
#pragma omp simd reduction(+ : acc)
  for (int64_t d = 0; d < len; ++d) acc += a[d] * static_cast<float>(b[d]);
  return acc;
}

template <int64_t D, typename T>
inline void axpy(float* __restrict__ y, const T* __restrict__ x, float a, int64_t n) {
  const int64_t len = D > 0 ? D : n;
#pragma omp simd
  for (int64_t d = 0; d < len; ++d) y[d] += a * static_cast<float>(x[d]);
}

// Asks for one KV head's rows of a block (`count` tokens, `row_bytes` each) ahead of their use: blocks are
// scattered, so the hardware prefetcher cannot guess the next one, and without this each token's row is a
// cache miss waited for.
inline void prefetch_rows(const void* first, int64_t count, int64_t stride_bytes, int64_t row_bytes) {
  const char* p = static_cast<const char*>(first);
  for (int64_t j = 0; j < count; ++j)
    for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(p + j * stride_bytes + off, 0, 3);
}


// Attention of one (sequence, KV head): `group` query rows over the cached tokens `start .. len - 1` (`start`
// is 0, or where a sliding window begins; blocks wholly before it are never read, so they may have been
// freed). With D and G known at compile time (the common shapes), the output rows live in a local array the
// compiler keeps in registers, and each key/value row is loaded once for all G query heads. The next
// block's rows are prefetched while one block is processed.
template <int64_t D, int64_t G, typename T>
void attend_one(const Layout& lay, const T* __restrict__ cache, const int32_t* __restrict__ table,
                int64_t len, int64_t start, int64_t kv_head, const float* __restrict__ q, float* __restrict__ out,
                float scale, std::vector<float>& scores) {
  const int64_t group = G > 0 ? G : lay.group, hd = D > 0 ? D : lay.head_dim, bs = lay.block_size;
  const int64_t n = len - start;  // keys attended; score t of a row is token start + t
  scores.resize(group * n);
  float* __restrict__ s = scores.data();
  const int64_t first_block = start / bs, num_blocks = (len + bs - 1) / bs;
  // the part of block b that is attended: tokens lo .. hi - 1 of it
  auto span = [&](int64_t b, int64_t& lo, int64_t& hi) {
    lo = std::max<int64_t>(0, start - b * bs);
    hi = std::min(bs, len - b * bs);
  };
  const int64_t stride_bytes = lay.s_tok * static_cast<int64_t>(sizeof(T)), row_bytes = hd * static_cast<int64_t>(sizeof(T));
  int64_t lo0, hi0;
  span(first_block, lo0, hi0);
  prefetch_rows(cache + table[first_block] * lay.s_block + kv_head * lay.s_head + lo0 * lay.s_tok, hi0 - lo0,
                stride_bytes, row_bytes);
  for (int64_t b = first_block; b < num_blocks; ++b) {
    int64_t lo, hi;
    span(b, lo, hi);
    const T* base = cache + table[b] * lay.s_block + kv_head * lay.s_head + lo * lay.s_tok;
    const int64_t first = b * bs + lo - start, count = hi - lo;
    if (b + 1 < num_blocks) {
      int64_t lo1, hi1;
      span(b + 1, lo1, hi1);
      prefetch_rows(cache + table[b + 1] * lay.s_block + kv_head * lay.s_head, hi1, stride_bytes, row_bytes);
    } else {  // the values' first block, for the second pass
      prefetch_rows(cache + table[first_block] * lay.s_block + lay.s_kv + kv_head * lay.s_head + lo0 * lay.s_tok,
                    hi0 - lo0, stride_bytes, row_bytes);
    }
    for (int64_t j = 0; j < count; ++j) {
      const T* k = base + j * lay.s_tok;
      for (int64_t g = 0; g < group; ++g) s[g * n + first + j] = dot<D>(q + g * hd, k, hd) * scale;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sg = s + g * n;
    const float m = *std::max_element(sg, sg + n);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < n; ++t) {
      sg[t] = std::exp(sg[t] - m);
      total += sg[t];
    }
    const float inv = 1.f / total;
    for (int64_t t = 0; t < n; ++t) sg[t] *= inv;
  }
  constexpr int64_t kLocal = (D > 0 && G > 0) ? D * G : 1;
  float local[kLocal] = {};
  float* acc = (D > 0 && G > 0) ? local : out;
  for (int64_t b = first_block; b < num_blocks; ++b) {
    int64_t lo, hi;
    span(b, lo, hi);
    const T* base = cache + table[b] * lay.s_block + lay.s_kv + kv_head * lay.s_head + lo * lay.s_tok;
    const int64_t first = b * bs + lo - start, count = hi - lo;
    if (b + 1 < num_blocks) {
      int64_t lo1, hi1;
      span(b + 1, lo1, hi1);
      prefetch_rows(cache + table[b + 1] * lay.s_block + lay.s_kv + kv_head * lay.s_head, hi1, stride_bytes,
                    row_bytes);
    }
    for (int64_t j = 0; j < count; ++j) {
      const T* v = base + j * lay.s_tok;
      for (int64_t g = 0; g < group; ++g) axpy<D>(acc + g * hd, v, s[g * n + first + j], hd);
    }
  }
  if (acc != out) std::copy(local, local + kLocal, out);
}

template <int64_t D, int64_t G, typename T>
void run(const Layout& lay, const T* cache, const int32_t* tables, const int32_t* lens,
         const float* q_all, float* out_all, int64_t num_seqs, float scale) {
  at::parallel_for(0, num_seqs * lay.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / lay.num_kv_heads, kv_head = item % lay.num_kv_heads;
      const int64_t row = (seq * lay.num_heads + kv_head * lay.group) * lay.head_dim;
      const int64_t start = lay.window > 0 ? std::max<int64_t>(0, lens[seq] - lay.window) : 0;
      attend_one<D, G, T>(lay, cache, tables + seq * lay.max_blocks, lens[seq], start, kv_head, q_all + row,
                    out_all + row, scale, scores);
    }
  });
}

template <typename T>
void dispatch(const Layout& lay, const T* cache, const int32_t* tables, const int32_t* lens, const float* q,
              float* o, int64_t num_seqs, float s) {
  if (lay.head_dim == 64 && lay.group == 3) {
    run<64, 3>(lay, cache, tables, lens, q, o, num_seqs, s);  // SmolLM2 (9 heads, 3 KV heads)
  } else if (lay.head_dim == 64 && lay.group == 4) {
    run<64, 4>(lay, cache, tables, lens, q, o, num_seqs, s);
  } else if (lay.head_dim == 128 && lay.group == 4) {
    run<128, 4>(lay, cache, tables, lens, q, o, num_seqs, s);  // Llama 3 8B
  } else if (lay.head_dim == 256 && lay.group == 4) {
    run<256, 4>(lay, cache, tables, lens, q, o, num_seqs, s);  // Gemma 3 270M and 1B (4 heads, 1 KV head)
  } else if (lay.head_dim == 64) {
    run<64, 0>(lay, cache, tables, lens, q, o, num_seqs, s);
  } else if (lay.head_dim == 128) {
    run<128, 0>(lay, cache, tables, lens, q, o, num_seqs, s);
  } else if (lay.head_dim == 256) {
    run<256, 0>(lay, cache, tables, lens, q, o, num_seqs, s);
  } else {
    run<0, 0>(lay, cache, tables, lens, q, o, num_seqs, s);
  }
}

}  // namespace

namespace {

// Copies each row's key and value ([rows, kv_heads, head_dim]) into the cache at its slot (block * block_size
// + offset) of `layer`, converting to the cache's dtype.
template <typename T, typename S>
void write_rows(const S* key, const S* value, T* cache, const int64_t* slots, int64_t rows,
                const torch::Tensor& kv_cache, int64_t layer) {
  const int64_t block_size = kv_cache.size(3), width = kv_cache.size(4) * kv_cache.size(5);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t block = slots[r] / block_size, offset = slots[r] % block_size;
    T* k = cache + block * kv_cache.stride(0) + layer * kv_cache.stride(1) + offset * kv_cache.stride(3);
    T* v = k + kv_cache.stride(2);
    for (int64_t i = 0; i < width; ++i) {
      k[i] = static_cast<T>(key[r * width + i]);
      v[i] = static_cast<T>(value[r * width + i]);
    }
  }
}

// Every row's context fits its block table, every block it uses is in the cache, and the layer exists: the
// kernel reads (and write_and_decode writes) through them without further checks. Sequence i's query tokens
// are its last q_lens[i] (1 where q_lens is null), so its reads begin at its first token's window.
void check_metadata(const torch::Tensor& kv_cache, int64_t layer, const torch::Tensor& block_tables,
                    const torch::Tensor& seq_lens, int64_t window, const int64_t* q_lens = nullptr) {
  TORCH_CHECK(kv_cache.device().is_cpu(), "paged_decode: a CPU cache");
  TORCH_CHECK(layer >= 0 && layer < kv_cache.size(1), "paged_decode: layer ", layer, " out of range");
  TORCH_CHECK(window >= 0, "paged_decode: negative window");
  TORCH_CHECK(block_tables.size(0) == seq_lens.size(0), "paged_decode: bad rows");
  const int64_t num_blocks = kv_cache.size(0), block_size = kv_cache.size(3), max_blocks = block_tables.size(1);
  const auto* tables = block_tables.data_ptr<int32_t>();
  const auto* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t i = 0; i < seq_lens.size(0); ++i) {
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= max_blocks * block_size, "paged_decode: context length ", lens[i],
                " does not fit its block table");
    const int64_t first_len = lens[i] - (q_lens != nullptr ? std::max<int64_t>(q_lens[i], 1) : 1) + 1;
    const int64_t start = window > 0 ? std::max<int64_t>(0, first_len - window) : 0;
    for (int64_t b = start / block_size; b < (lens[i] + block_size - 1) / block_size; ++b) {
      const int32_t block = tables[i * max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_decode: block ", block, " out of range");
    }
  }
}

torch::Tensor attend(torch::Tensor query, const torch::Tensor& kv_cache, int64_t layer,
                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t window) {
  const auto cache_type = kv_cache.scalar_type();
  TORCH_CHECK(cache_type == torch::kFloat32 || cache_type == torch::kBFloat16, "paged_decode: fp32 or bf16 cache");
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 || query.scalar_type() == cache_type,
              "paged_decode: the query is fp32 or the cache's dtype");
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 6, "paged_decode: bad ranks");
  TORCH_CHECK(kv_cache.stride(5) == 1, "paged_decode: head_dim must be contiguous");
  const auto out_type = query.scalar_type();
  block_tables = block_tables.to(torch::kInt32).contiguous();
  seq_lens = seq_lens.to(torch::kInt32).contiguous();
  const int64_t num_seqs = query.size(0);
  if (bf16_attention_applies(query, kv_cache)) {  // the arithmetic every bf16 row shares, prefill's too
    TORCH_CHECK(seq_lens.size(0) == num_seqs && block_tables.size(0) == num_seqs, "paged_decode: bad rows");
    check_metadata(kv_cache, layer, block_tables, seq_lens, window);
    std::vector<int64_t> starts(num_seqs + 1);
    for (int64_t i = 0; i <= num_seqs; ++i) starts[i] = i;
    return bf16_attention(query, kv_cache, layer, block_tables, seq_lens, starts, scale, window).to(out_type);
  }
  query = query.to(torch::kFloat32).contiguous();
  Layout lay{query.size(1), kv_cache.size(4), 0, query.size(2), kv_cache.size(3), block_tables.size(1),
             kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3), kv_cache.stride(4), window};
  TORCH_CHECK(window >= 0, "paged_decode: negative window");
  TORCH_CHECK(kv_cache.size(5) == lay.head_dim && lay.num_heads % lay.num_kv_heads == 0,
              "paged_decode: bad shapes");
  TORCH_CHECK(seq_lens.size(0) == num_seqs && block_tables.size(0) == num_seqs, "paged_decode: bad rows");
  check_metadata(kv_cache, layer, block_tables, seq_lens, window);
  lay.group = lay.num_heads / lay.num_kv_heads;
  auto out = torch::zeros_like(query);
  const float s = static_cast<float>(scale);
  const auto* tables = block_tables.data_ptr<int32_t>();
  const auto* lens = seq_lens.data_ptr<int32_t>();
  const float* q = query.data_ptr<float>();
  float* o = out.data_ptr<float>();
  if (cache_type == torch::kFloat32) {
    dispatch(lay, kv_cache.data_ptr<float>() + layer * kv_cache.stride(1), tables, lens, q, o, num_seqs, s);
  } else {
    dispatch(lay, kv_cache.data_ptr<at::BFloat16>() + layer * kv_cache.stride(1), tables, lens, q, o, num_seqs, s);
  }
  return out_type == torch::kFloat32 ? out : out.to(out_type);
}

}  // namespace

// Attention of each query row (one token per sequence) over its cached context (its last `window` tokens
// when window > 0); the result has the query's dtype. The cache is fp32 or bf16; the query is fp32 or the
// cache's dtype.
torch::Tensor paged_decode(torch::Tensor query, torch::Tensor kv_cache, int64_t layer,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t window) {
  return attend(std::move(query), kv_cache, layer, std::move(block_tables), std::move(seq_lens), scale, window);
}

// Attention of a step's query tokens, prefill chunks and decode rows alike, over a bf16 cache that already
// holds the step's keys and values: sequence i's tokens are rows query_start_loc[i] .. query_start_loc[i + 1]
// - 1 of `query` (bf16 [tokens, heads, head_dim]), its last at context length seq_lens[i]. Each row is computed
// exactly as `paged_decode` computes a decode row at the same position (attention_bf16_cpu.cpp). bf16 out.
torch::Tensor paged_attention(torch::Tensor query, torch::Tensor kv_cache, int64_t layer, torch::Tensor block_tables,
                              torch::Tensor seq_lens, torch::Tensor query_start_loc, double scale, int64_t window) {
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 6, "paged_attention: bad ranks");
  TORCH_CHECK(bf16_attention_applies(query, kv_cache),
              "paged_attention: a bf16 query and cache, head_dim 64, 128 or 256, and AVX512-BF16");
  block_tables = block_tables.to(torch::kInt32).contiguous();
  seq_lens = seq_lens.to(torch::kInt32).contiguous();
  query_start_loc = query_start_loc.to(torch::kInt64).contiguous();
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1, "paged_attention: one query start per sequence and the end");
  const auto* qsl = query_start_loc.data_ptr<int64_t>();
  std::vector<int64_t> starts(qsl, qsl + num_seqs + 1), q_lens(num_seqs);
  TORCH_CHECK(starts[0] == 0 && starts[num_seqs] == query.size(0), "paged_attention: query starts do not cover the rows");
  for (int64_t i = 0; i < num_seqs; ++i) {
    q_lens[i] = starts[i + 1] - starts[i];
    TORCH_CHECK(q_lens[i] >= 0, "paged_attention: query starts must not decrease");
  }
  check_metadata(kv_cache, layer, block_tables, seq_lens, window, q_lens.data());
  return bf16_attention(query, kv_cache, layer, block_tables, seq_lens, starts, scale, window).to(torch::kBFloat16);
}

// A step of decode rows only, in one call: each row's key and value ([rows, kv_heads, head_dim], the
// query's dtype) go into the cache at its slot first, then `paged_decode`.
torch::Tensor write_and_decode(torch::Tensor query, torch::Tensor key, torch::Tensor value, torch::Tensor kv_cache,
                               int64_t layer, torch::Tensor slot_mapping, torch::Tensor block_tables,
                               torch::Tensor seq_lens, double scale, int64_t window) {
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(),
              "write_and_decode: query, key and value share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.size(0) == query.size(0),
              "write_and_decode: one int64 slot per row");
  TORCH_CHECK(key.dim() == 3 && key.size(1) == kv_cache.size(4) && key.size(2) == kv_cache.size(5) &&
                  key.sizes() == value.sizes() && key.size(0) == query.size(0),
              "write_and_decode: key/value shapes");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.device().is_cpu(), "write_and_decode: a CPU cache of rank 6");
  TORCH_CHECK(kv_cache.stride(5) == 1 && kv_cache.stride(4) == kv_cache.size(5) &&
                  kv_cache.stride(3) == kv_cache.size(4) * kv_cache.size(5),
              "write_and_decode: a token's keys must be dense");
  TORCH_CHECK(layer >= 0 && layer < kv_cache.size(1), "write_and_decode: layer ", layer, " out of range");
  key = key.contiguous();
  value = value.contiguous();
  slot_mapping = slot_mapping.contiguous();
  const int64_t rows = key.size(0);
  const auto* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = kv_cache.size(0) * kv_cache.size(3);
  for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(slots[r] >= 0 && slots[r] < num_slots, "write_and_decode: slot out of range");
  if (kv_cache.scalar_type() == torch::kBFloat16 && key.scalar_type() == torch::kBFloat16) {
    write_rows(key.data_ptr<at::BFloat16>(), value.data_ptr<at::BFloat16>(), kv_cache.data_ptr<at::BFloat16>(),
               slots, rows, kv_cache, layer);
  } else if (kv_cache.scalar_type() == torch::kFloat32 && key.scalar_type() == torch::kFloat32) {
    write_rows(key.data_ptr<float>(), value.data_ptr<float>(), kv_cache.data_ptr<float>(), slots, rows, kv_cache,
               layer);
  } else {
    TORCH_CHECK(false, "write_and_decode: key and cache must share a dtype (fp32 or bf16)");
  }
  return attend(std::move(query), kv_cache, layer, std::move(block_tables), std::move(seq_lens), scale, window);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernel touches no Python object: it lets go of the GIL, so the worker's I/O thread can move tokens
  // and take requests while the engine thread is in here (torch's own ops do the same).
  m.def("paged_decode", &paged_decode, "paged decode attention (fp32 or bf16 cache, CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_attention", &paged_attention, "a step's bf16 attention, prefill and decode rows alike (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("write_and_decode", &write_and_decode, "write a decode step's keys and values, then paged_decode",
        py::call_guard<py::gil_scoped_release>());
  register_cpu_ops(m);
}
