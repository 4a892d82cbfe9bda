// The bf16 model step's CPU ops: a linear over prepacked weights (streaming the weight at close to the
// memory bandwidth for a decode step's few rows, a register-tiled GEMM for prefill), and fused RMSNorm (with the residual add), rotary embedding and SiLU-and-multiply. Activations are bf16,
// every sum and product is fp32 and each result is rounded to bf16 once.
//
// `linear` needs AVX512-BF16 (`has_avx512_bf16()` says whether this CPU has it) and a weight packed for it;
// the other ops run on any x86-64 or ARM CPU.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

// at::BFloat16 converts to float by shifting its bits (exact) and from float by rounding to nearest even
inline float to_f32(at::BFloat16 v) { return static_cast<float>(v); }
inline at::BFloat16 to_bf16(float f) { return at::BFloat16(f); }

void check_bf16_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(t.scalar_type() == torch::kBFloat16, name, ": bf16 only");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": needs a [rows, cols] tensor with contiguous rows");
}

// ---- linear ----------------------------------------------------------------------------------------------
//
// The weight is packed once (`pack_linear`, in Python) as [N / 16 panels][K / 2 pairs][16 columns][2]: one
// 64-byte line holds two consecutive k of 16 output columns, which is what `vdpbf16ps` multiplies with a
// broadcast pair of x. A tile of MT input rows by NB panels keeps MT x NB accumulators in registers for the
// whole of K, so nothing is reduced across lanes and each weight line is loaded once per tile. Panels are
// shared out among threads; with few input rows each thread streams its panels once (prefetching ahead),
// with many it runs every tile of input rows over one group of panels while that group sits in L2, and the
// row tiles share out the fetching of the thread's next group into L2, so that its stream from memory
// overlaps this group's arithmetic instead of stalling the next group's first tile.

#if defined(__x86_64__)
constexpr int kPanelsPerTile = 4;
constexpr int kMaxTileRows = 6;  // 6 x 4 accumulators + 4 weight registers + a broadcast fit the 32 registers

// `next`, when given: a group of panels to fetch into L2 meanwhile, its panels in `next_panels` (a bit each).
template <int MT, int NB, typename Out>
__attribute__((target("avx512f,avx512bw,avx512bf16,avx512vl"))) inline void tile(
    const at::BFloat16* __restrict__ x, int64_t K, const at::BFloat16* __restrict__ wp, int64_t K2,
    Out* __restrict__ y, int64_t N, int64_t num_cols, bool prefetch, const at::BFloat16* next,
    unsigned next_panels) {
  __m512 acc[MT][NB];
  for (int m = 0; m < MT; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
  const auto* pairs = reinterpret_cast<const int32_t*>(x);  // x[m, 2kk:2kk+2] as one 32-bit word
  const int64_t row_pairs = K / 2;
  for (int64_t kk = 0; kk < K2; ++kk) {
    __m512bh w[NB];
    for (int b = 0; b < NB; ++b) {
      const at::BFloat16* line = wp + (b * K2 + kk) * 32;
      w[b] = (__m512bh)_mm512_loadu_si512(line);
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(line + 32 * 16), _MM_HINT_T0);
    }
    if (next != nullptr)
      for (int b = 0; b < kPanelsPerTile; ++b)
        if (next_panels >> b & 1u) _mm_prefetch(reinterpret_cast<const char*>(next + (b * K2 + kk) * 32), _MM_HINT_T1);
    for (int m = 0; m < MT; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pairs[m * row_pairs + kk]);
      for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], w[b], xb);
    }
  }
  for (int m = 0; m < MT; ++m) {
    for (int b = 0; b < NB && b * 16 < num_cols; ++b) {
      const int64_t count = std::min<int64_t>(16, num_cols - b * 16);
      const auto mask = static_cast<__mmask16>((1u << count) - 1u);
      if constexpr (std::is_same_v<Out, float>) {
        _mm512_mask_storeu_ps(y + m * N + b * 16, mask, acc[m][b]);
      } else {
        _mm256_mask_storeu_epi16(y + m * N + b * 16, mask, (__m256i)_mm512_cvtneps_pbh(acc[m][b]));
      }
    }
  }
}

// Rows [m0, m0 + MT) of y over panels [p0, p1); `next` and `next_panels` as `tile`'s (one group of panels).
template <int MT, typename Out>
__attribute__((target("avx512f,avx512bw,avx512bf16,avx512vl"))) void tile_rows(
    const at::BFloat16* x, int64_t K, const at::BFloat16* wp, int64_t K2, Out* y, int64_t N, int64_t p0,
    int64_t p1, int64_t m0, bool prefetch, const at::BFloat16* next = nullptr, unsigned next_panels = 0) {
  for (int64_t p = p0; p < p1; p += kPanelsPerTile) {
    const int64_t nb = std::min<int64_t>(kPanelsPerTile, p1 - p);
    const int64_t num_cols = std::min<int64_t>(nb * 16, N - p * 16);
    const at::BFloat16* w = wp + p * K2 * 32;
    const at::BFloat16* xm = x + m0 * K;
    Out* ym = y + m0 * N + p * 16;
    switch (nb) {
      case 4: tile<MT, 4, Out>(xm, K, w, K2, ym, N, num_cols, prefetch, next, next_panels); break;
      case 3: tile<MT, 3, Out>(xm, K, w, K2, ym, N, num_cols, prefetch, next, next_panels); break;
      case 2: tile<MT, 2, Out>(xm, K, w, K2, ym, N, num_cols, prefetch, next, next_panels); break;
      default: tile<MT, 1, Out>(xm, K, w, K2, ym, N, num_cols, prefetch, next, next_panels); break;
    }
  }
}

template <typename Out>
void linear_panels(const at::BFloat16* x, int64_t M, int64_t K, const at::BFloat16* wp, int64_t num_panels,
                   int64_t K2, Out* y, int64_t N) {
  const int64_t groups = (num_panels + kPanelsPerTile - 1) / kPanelsPerTile;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    // few rows: one pass over this thread's panels; many: one group at a time, every row tile over it
    const int64_t step = M <= kMaxTileRows ? g1 - g0 : 1;
    for (int64_t g = g0; g < g1; g += step) {
      const int64_t p0 = g * kPanelsPerTile, p1 = std::min(num_panels, std::min(g1, g + step) * kPanelsPerTile);
      // with many rows, the thread's next group is fetched into L2 by this group's row tiles, tile t taking
      // panels t, t + T, ... of it (T row tiles)
      const int64_t next_p0 = p1, next_count = step == 1 && g + 1 < g1
                                                   ? std::min<int64_t>(kPanelsPerTile, num_panels - next_p0) : 0;
      const int64_t num_tiles = (M + kMaxTileRows - 1) / kMaxTileRows;
      const at::BFloat16* next = next_count > 0 ? wp + next_p0 * K2 * 32 : nullptr;
      for (int64_t m0 = 0, t = 0; m0 < M; ++t) {
        const int64_t mt = std::min<int64_t>(kMaxTileRows, M - m0);
        const bool prefetch = m0 == 0;  // later row tiles find the weights in cache
        unsigned panels = 0;
        for (int64_t b = t; b < next_count; b += num_tiles) panels |= 1u << b;
        switch (mt) {
          case 6: tile_rows<6, Out>(x, K, wp, K2, y, N, p0, p1, m0, prefetch, next, panels); break;
          case 5: tile_rows<5, Out>(x, K, wp, K2, y, N, p0, p1, m0, prefetch, next, panels); break;
          case 4: tile_rows<4, Out>(x, K, wp, K2, y, N, p0, p1, m0, prefetch, next, panels); break;
          case 3: tile_rows<3, Out>(x, K, wp, K2, y, N, p0, p1, m0, prefetch, next, panels); break;
          case 2: tile_rows<2, Out>(x, K, wp, K2, y, N, p0, p1, m0, prefetch, next, panels); break;
          default: tile_rows<1, Out>(x, K, wp, K2, y, N, p0, p1, m0, prefetch, next, panels); break;
        }
        m0 += mt;
      }
    }
  });
}

bool cpu_has_avx512_bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}
#else
bool cpu_has_avx512_bf16() { return false; }
#endif

}  // namespace

bool has_avx512_bf16() {
  static const bool has = cpu_has_avx512_bf16();
  return has;
}

// y = x @ w.T for bf16 x [M, K] and a weight [N, K] packed as [ceil(N / 16), K / 2, 16, 2]; y is fp32 when
// `fp32_out`, bf16 otherwise.
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t out_features, bool fp32_out) {
  check_bf16_rows(x, "linear");
  TORCH_CHECK(has_avx512_bf16(), "linear: needs a CPU with AVX512-BF16");
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous() &&
                  packed.dim() == 4 &&
                  packed.size(2) == 16 && packed.size(3) == 2,
              "linear: the weight must be packed by pack_linear");
  const int64_t M = x.size(0), K = x.size(1), num_panels = packed.size(0), K2 = packed.size(1);
  TORCH_CHECK(K % 2 == 0 && K2 * 2 == K, "linear: shapes ", x.sizes(), " and packed ", packed.sizes());
  TORCH_CHECK(out_features > (num_panels - 1) * 16 && out_features <= num_panels * 16,
              "linear: ", out_features, " output features do not match ", num_panels, " panels");
  x = x.contiguous();
  auto y = torch::empty({M, out_features}, x.options().dtype(fp32_out ? torch::kFloat32 : torch::kBFloat16));
#if defined(__x86_64__)
  const auto* xp = x.data_ptr<at::BFloat16>();
  const auto* wp = packed.data_ptr<at::BFloat16>();
  if (fp32_out) {
    linear_panels<float>(xp, M, K, wp, num_panels, K2, y.data_ptr<float>(), out_features);
  } else {
    linear_panels<at::BFloat16>(xp, M, K, wp, num_panels, K2, y.data_ptr<at::BFloat16>(), out_features);
  }
#endif
  return y;
}

// ---- norms, rope, activation -----------------------------------------------------------------------------

namespace {

// 1 / RMS(x) of a bf16 row, summed in fp32.
inline float inv_rms(const at::BFloat16* x, int64_t H, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < H; ++i) {
    const float v = to_f32(x[i]);
    sum += v * v;
  }
  return 1.f / std::sqrt(sum / static_cast<float>(H) + eps);
}

inline void rms_norm_row(const at::BFloat16* __restrict__ in, const at::BFloat16* __restrict__ weight,
                         at::BFloat16* __restrict__ out, int64_t H, float eps) {
  const float inv = inv_rms(in, H, eps);
#pragma omp simd
  for (int64_t i = 0; i < H; ++i) out[i] = to_bf16(to_f32(in[i]) * inv * to_f32(weight[i]));
}

// rms_norm_row with `out` = `in` (a q or k head of the fused projection, normalised where it lies).
inline void rms_norm_in_place(at::BFloat16* x, const at::BFloat16* __restrict__ weight, int64_t H, float eps) {
  const float inv = inv_rms(x, H, eps);
  for (int64_t i = 0; i < H; ++i) x[i] = to_bf16(to_f32(x[i]) * inv * to_f32(weight[i]));
}

void check_norm_weight(const torch::Tensor& weight, int64_t H, const char* name) {
  TORCH_CHECK(weight.scalar_type() == torch::kBFloat16 && weight.is_contiguous(), name, ": bf16 weight");
  TORCH_CHECK(weight.numel() == H, name, ": ", weight.numel(), " weights for rows of ", H);
}

}  // namespace

// RMSNorm of each row of bf16 x [M, H] with weight [H].
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_bf16_rows(x, "rms_norm");
  x = x.contiguous();
  const int64_t M = x.size(0), H = x.size(1);
  check_norm_weight(weight, H, "rms_norm");
  auto out = torch::empty_like(x);
  const auto* xp = x.data_ptr<at::BFloat16>();
  const auto* wp = weight.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, M, 64, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) rms_norm_row(xp + m * H, wp, op + m * H, H, static_cast<float>(eps));
  });
  return out;
}

// residual += x (rounded to bf16, as `residual + x` in torch), then the RMSNorm of the new residual.
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_bf16_rows(x, "add_rms_norm");
  check_bf16_rows(residual, "add_rms_norm");
  TORCH_CHECK(residual.is_contiguous() && x.sizes() == residual.sizes(), "add_rms_norm: shapes");
  x = x.contiguous();
  const int64_t M = x.size(0), H = x.size(1);
  check_norm_weight(weight, H, "add_rms_norm");
  auto out = torch::empty_like(x);
  const auto* xp = x.data_ptr<at::BFloat16>();
  auto* rp = residual.data_ptr<at::BFloat16>();
  const auto* wp = weight.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, M, 64, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      at::BFloat16* r = rp + m * H;
      const at::BFloat16* xi = xp + m * H;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) r[i] = to_bf16(to_f32(r[i]) + to_f32(xi[i]));
      rms_norm_row(r, wp, op + m * H, H, static_cast<float>(eps));
    }
  });
  return out;
}

namespace {

// act(gate) * up for bf16 gate_up [M, 2I] (gate first): [M, I]. As torch, the activation is rounded to bf16
// before the product.
template <typename Act>
torch::Tensor gated_mul(torch::Tensor gate_up, const char* name, Act act) {
  check_bf16_rows(gate_up, name);
  gate_up = gate_up.contiguous();
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * I, name, ": odd width");
  auto out = torch::empty({M, I}, gate_up.options());
  const auto* gp = gate_up.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      const at::BFloat16* g = gp + m * 2 * I;
      const at::BFloat16* u = g + I;
      at::BFloat16* o = op + m * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) o[i] = to_bf16(to_f32(to_bf16(act(to_f32(g[i])))) * to_f32(u[i]));
    }
  });
  return out;
}

}  // namespace

// silu(gate) * up for bf16 gate_up [M, 2I] (gate first): [M, I].
torch::Tensor silu_mul(torch::Tensor gate_up) {
  return gated_mul(std::move(gate_up), "silu_mul", [](float x) { return x / (1.f + std::exp(-x)); });
}

// gelu_tanh(gate) * up, the same shapes (Gemma's MLP).
torch::Tensor gelu_tanh_mul(torch::Tensor gate_up) {
  constexpr float kAlpha = 0.7978845608028654f;  // sqrt(2 / pi)
  return gated_mul(std::move(gate_up), "gelu_tanh_mul", [](float x) {
    return 0.5f * x * (1.f + std::tanh(kAlpha * (x + 0.044715f * x * x * x)));
  });
}

// Rotate-half rotary embedding, in place, on the query and key heads of bf16 qkv [M, (Hq + 2 Hkv) * D]
// (the value heads are left alone); cos and sin are fp32 [M, D / 2]. Before the rotation, optionally: the
// projection's bias ([(Hq + 2 Hkv) * D], Qwen2) is added to every head, q and k included, and each query and
// key head is RMS-normalised with its own weight ([D], Qwen3 and Gemma 3's q/k norm, rounded to bf16 as the
// reference does). Returns q, k and v as views of qkv ([M, heads, D] each): made here, they cost a fraction
// of what three slices and views cost in Python.
std::vector<torch::Tensor> rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t num_heads,
                                 int64_t num_kv_heads, int64_t head_dim, std::optional<torch::Tensor> bias,
                                 std::optional<torch::Tensor> q_norm, std::optional<torch::Tensor> k_norm,
                                 double eps) {
  check_bf16_rows(qkv, "rope_");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "rope_: fp32 contiguous cos and sin");
  const int64_t M = qkv.size(0), half = head_dim / 2, rotated = num_heads + num_kv_heads;
  const int64_t width = (num_heads + 2 * num_kv_heads) * head_dim;
  TORCH_CHECK(qkv.size(1) == width && cos.size(0) == M && cos.size(1) == half && sin.sizes() == cos.sizes(),
              "rope_: shapes");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "rope_: q and k norms come together");
  const at::BFloat16* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kBFloat16 && bias->is_contiguous() && bias->numel() == width,
                "rope_: a bf16 bias of ", width);
    bp = bias->data_ptr<at::BFloat16>();
  }
  const at::BFloat16 *qn = nullptr, *kn = nullptr;
  if (q_norm.has_value()) {
    check_norm_weight(*q_norm, head_dim, "rope_ (q norm)");
    check_norm_weight(*k_norm, head_dim, "rope_ (k norm)");
    qn = q_norm->data_ptr<at::BFloat16>();
    kn = k_norm->data_ptr<at::BFloat16>();
  }
  auto* base = qkv.data_ptr<at::BFloat16>();
  const int64_t ld = qkv.stride(0);
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const float epsf = static_cast<float>(eps);
  at::parallel_for(0, M, 32, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      at::BFloat16* row = base + m * ld;
      if (bp != nullptr) {
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) row[i] = to_bf16(to_f32(row[i]) + to_f32(bp[i]));
      }
      const float* c = cp + m * half;
      const float* s = sp + m * half;
      for (int64_t h = 0; h < rotated; ++h) {
        at::BFloat16* x1 = row + h * head_dim;
        at::BFloat16* x2 = x1 + half;
        if (qn != nullptr) rms_norm_in_place(x1, h < num_heads ? qn : kn, head_dim, epsf);
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = to_f32(x1[i]), b2 = to_f32(x2[i]);
          x1[i] = to_bf16(a * c[i] - b2 * s[i]);
          x2[i] = to_bf16(b2 * c[i] + a * s[i]);
        }
      }
    }
  });
  const int64_t q_dim = num_heads * head_dim, kv_dim = num_kv_heads * head_dim;
  return {qkv.narrow(1, 0, q_dim).view({M, num_heads, head_dim}),
          qkv.narrow(1, q_dim, kv_dim).view({M, num_kv_heads, head_dim}),
          qkv.narrow(1, q_dim + kv_dim, kv_dim).view({M, num_kv_heads, head_dim})};
}

void register_cpu_ops(pybind11::module& m) {
  // None of these touches a Python object: each lets go of the GIL (see paged_decode_cpu.cpp).
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("has_avx512_bf16", &has_avx512_bf16, "whether `linear` can run on this CPU");
  m.def("linear", &linear, "x @ w.T, bf16, over a weight packed by pack_linear", release());
  m.def("rms_norm", &rms_norm, "RMSNorm of bf16 rows", release());
  m.def("add_rms_norm", &add_rms_norm, "residual += x; RMSNorm(residual)", release());
  m.def("silu_mul", &silu_mul, "silu(gate) * up", release());
  m.def("gelu_tanh_mul", &gelu_tanh_mul, "gelu_tanh(gate) * up", release());
  m.def("rope_", &rope_, "bias, q/k norm and rotate-half rope on q and k heads, in place; q, k, v views",
        release());
}
