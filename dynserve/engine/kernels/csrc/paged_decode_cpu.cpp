// Paged decode attention for CPUs: one query token per sequence, read straight from the block-major KV
// cache [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] through the block table, so each
// key and value is read exactly once and nothing is gathered or copied. One work item per (sequence, KV
// head); the query heads sharing that KV head are processed together (GQA), fp32 throughout.
// head_dim and the query heads per KV head are template parameters for common shapes, so the inner loops
// compile to fixed-width SIMD.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

struct Layout {
  int64_t num_heads, num_kv_heads, group, head_dim, block_size, max_blocks;
  int64_t s_block, s_kv, s_tok, s_head;
};

template <int64_t D>
inline float dot(const float* __restrict__ a, const float* __restrict__ b, int64_t n) {
  float acc = 0.f;
  const int64_t len = D > 0 ? D : n;
#pragma omp simd reduction(+ : acc)
  for (int64_t d = 0; d < len; ++d) acc += a[d] * b[d];
  return acc;
}

template <int64_t D>
inline void axpy(float* __restrict__ y, const float* __restrict__ x, float a, int64_t n) {
  const int64_t len = D > 0 ? D : n;
#pragma omp simd
  for (int64_t d = 0; d < len; ++d) y[d] += a * x[d];
}

// Attention of one (sequence, KV head): `group` query rows over `len` cached tokens. With D and G known at
// compile time (the common shapes), the output rows live in a local array the compiler keeps in registers,
// and each key/value row is loaded once for all G query heads.
template <int64_t D, int64_t G>
void attend_one(const Layout& lay, const float* __restrict__ cache, const int32_t* __restrict__ table,
                int64_t len, int64_t kv_head, const float* __restrict__ q, float* __restrict__ out,
                float scale, std::vector<float>& scores) {
  const int64_t group = G > 0 ? G : lay.group, hd = D > 0 ? D : lay.head_dim, bs = lay.block_size;
  scores.resize(group * len);
  float* __restrict__ s = scores.data();
  const int64_t num_blocks = (len + bs - 1) / bs;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const float* base = cache + table[b] * lay.s_block + kv_head * lay.s_head;
    const int64_t first = b * bs, count = std::min(bs, len - first);
    for (int64_t j = 0; j < count; ++j) {
      const float* k = base + j * lay.s_tok;
      for (int64_t g = 0; g < group; ++g) s[g * len + first + j] = dot<D>(q + g * hd, k, hd) * scale;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sg = s + g * len;
    const float m = *std::max_element(sg, sg + len);
    float total = 0.f;
    for (int64_t t = 0; t < len; ++t) {
      sg[t] = std::exp(sg[t] - m);
      total += sg[t];
    }
    const float inv = 1.f / total;
    for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
  }
  constexpr int64_t kLocal = (D > 0 && G > 0) ? D * G : 1;
  float local[kLocal] = {};
  float* acc = (D > 0 && G > 0) ? local : out;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const float* base = cache + table[b] * lay.s_block + lay.s_kv + kv_head * lay.s_head;
    const int64_t first = b * bs, count = std::min(bs, len - first);
    for (int64_t j = 0; j < count; ++j) {
      const float* v = base + j * lay.s_tok;
      for (int64_t g = 0; g < group; ++g) axpy<D>(acc + g * hd, v, s[g * len + first + j], hd);
    }
  }
  if (acc != out) std::copy(local, local + kLocal, out);
}

template <int64_t D, int64_t G>
void run(const Layout& lay, const float* cache, const int32_t* tables, const int32_t* lens,
         const float* q_all, float* out_all, int64_t num_seqs, float scale) {
  at::parallel_for(0, num_seqs * lay.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / lay.num_kv_heads, kv_head = item % lay.num_kv_heads;
      const int64_t row = (seq * lay.num_heads + kv_head * lay.group) * lay.head_dim;
      attend_one<D, G>(lay, cache, tables + seq * lay.max_blocks, lens[seq], kv_head, q_all + row,
                    out_all + row, scale, scores);
    }
  });
}

}  // namespace

torch::Tensor paged_decode(torch::Tensor query, torch::Tensor kv_cache, int64_t layer,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && kv_cache.scalar_type() == torch::kFloat32,
              "paged_decode: fp32 only");
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 6, "paged_decode: bad ranks");
  TORCH_CHECK(kv_cache.stride(5) == 1, "paged_decode: head_dim must be contiguous");
  query = query.contiguous();
  block_tables = block_tables.to(torch::kInt32).contiguous();
  seq_lens = seq_lens.to(torch::kInt32).contiguous();
  const int64_t num_seqs = query.size(0);
  Layout lay{query.size(1), kv_cache.size(4), 0, query.size(2), kv_cache.size(3), block_tables.size(1),
             kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3), kv_cache.stride(4)};
  TORCH_CHECK(kv_cache.size(5) == lay.head_dim && lay.num_heads % lay.num_kv_heads == 0,
              "paged_decode: bad shapes");
  TORCH_CHECK(seq_lens.size(0) == num_seqs && block_tables.size(0) == num_seqs, "paged_decode: bad rows");
  lay.group = lay.num_heads / lay.num_kv_heads;
  const float* cache = kv_cache.data_ptr<float>() + layer * kv_cache.stride(1);
  auto out = torch::zeros_like(query);
  const float s = static_cast<float>(scale);
  const auto* tables = block_tables.data_ptr<int32_t>();
  const auto* lens = seq_lens.data_ptr<int32_t>();
  const float* q = query.data_ptr<float>();
  float* o = out.data_ptr<float>();
  if (lay.head_dim == 64 && lay.group == 3) {
    run<64, 3>(lay, cache, tables, lens, q, o, num_seqs, s);  // SmolLM2 (9 heads, 3 KV heads)
  } else if (lay.head_dim == 64 && lay.group == 4) {
    run<64, 4>(lay, cache, tables, lens, q, o, num_seqs, s);
  } else if (lay.head_dim == 128 && lay.group == 4) {
    run<128, 4>(lay, cache, tables, lens, q, o, num_seqs, s);  // Llama 3 8B
  } else if (lay.head_dim == 64) {
    run<64, 0>(lay, cache, tables, lens, q, o, num_seqs, s);
  } else if (lay.head_dim == 128) {
    run<128, 0>(lay, cache, tables, lens, q, o, num_seqs, s);
  } else {
    run<0, 0>(lay, cache, tables, lens, q, o, num_seqs, s);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernel touches no Python object: it lets go of the GIL, so the worker's I/O thread can move tokens
  // and take requests while the engine thread is in here (torch's own ops do the same).
  m.def("paged_decode", &paged_decode, "paged decode attention (fp32, CPU)",
        py::call_guard<py::gil_scoped_release>());
}
