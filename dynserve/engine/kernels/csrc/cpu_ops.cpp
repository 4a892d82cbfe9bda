// The bf16 decode step's CPU ops: a linear that streams its weight once at the machine's memory bandwidth,
// and fused RMSNorm (with the residual add), rotary embedding and SiLU-and-multiply. Activations are bf16,
// every sum and product is fp32 and each result is rounded to bf16 once.
//
// `linear` is for the few rows of a decode step (on CPUs with AVX512-BF16; `has_avx512_bf16()` says so):
// each weight row is read once for every input row of the call, with `vdpbf16ps` doing the multiply-adds
// and software prefetch keeping several rows in flight. The other ops run on any x86-64 or ARM CPU.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

inline float to_f32(at::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline at::BFloat16 to_bf16(float f) { return at::BFloat16(f); }  // round to nearest even

void check_bf16_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kBFloat16, name, ": bf16 only");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": needs a [rows, cols] tensor with contiguous rows");
}

// ---- linear ----------------------------------------------------------------------------------------------

#if defined(__x86_64__)
constexpr int64_t kRowsAhead = 16;  // prefetch distance in weight rows (PF=4 blocks of 4: measured best)

// y[m, n] (m < MT, n in [n, n + R)) for one block of R weight rows and MT input rows. Each 32-wide chunk of
// the weight rows is loaded once and used for every input row.
template <int MT, int R>
__attribute__((target("avx512f,avx512bw,avx512bf16,avx512vl"))) inline void dot_block(
    const at::BFloat16* __restrict__ x, int64_t ldx, const at::BFloat16* __restrict__ w, int64_t K,
    float* __restrict__ acc_out, bool prefetch) {
  const int64_t kfull = K / 32 * 32;
  const __mmask32 tail = static_cast<__mmask32>(K == kfull ? 0u : (1u << (K - kfull)) - 1u);
  __m512 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kfull; k += 32) {
    __m512bh xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * ldx + k);
    for (int r = 0; r < R; ++r) {
      const at::BFloat16* row = w + r * K + k;
      __m512bh wv = (__m512bh)_mm512_loadu_si512(row);
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(row + kRowsAhead * K), _MM_HINT_T0);
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);
    }
  }
  if (tail) {
    __m512bh xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + m * ldx + kfull);
    for (int r = 0; r < R; ++r) {
      __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tail, w + r * K + kfull);
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) acc_out[m * R + r] = _mm512_reduce_add_ps(acc[r][m]);
}

template <typename Out, int R>
__attribute__((target("avx512f,avx512bw,avx512bf16,avx512vl"))) void linear_rows(
    const at::BFloat16* __restrict__ x, int64_t M, const at::BFloat16* __restrict__ w, int64_t n0,
    int64_t n1, int64_t K, Out* __restrict__ y, int64_t N) {
  float acc[8 * R], half_acc[8 * R];
  for (int64_t n = n0; n < n1; n += R) {
    const int64_t rows = std::min<int64_t>(R, n1 - n);
    const at::BFloat16* wn = w + n * K;
    for (int64_t m0 = 0; m0 < M;) {
      const int64_t left = M - m0;
      const bool prefetch = m0 == 0;  // the later input rows find this block's weights in L1
      int mt;
      if (rows == R) {
        mt = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
        const at::BFloat16* xm = x + m0 * K;
        switch (mt) {
          case 8:  // 8 x 4 accumulators would not fit in the 32 vector registers: two halves of the block
            static_assert(R % 2 == 0, "R is even");
            dot_block<8, R / 2>(xm, K, wn, K, half_acc, prefetch);
            dot_block<8, R / 2>(xm, K, wn + (R / 2) * K, K, half_acc + 8 * (R / 2), prefetch);
            for (int m = 0; m < 8; ++m)
              for (int r = 0; r < R; ++r)
                acc[m * R + r] = r < R / 2 ? half_acc[m * (R / 2) + r] : half_acc[8 * (R / 2) + m * (R / 2) + r - R / 2];
            break;
          case 4: dot_block<4, R>(xm, K, wn, K, acc, prefetch); break;
          case 2: dot_block<2, R>(xm, K, wn, K, acc, prefetch); break;
          default: dot_block<1, R>(xm, K, wn, K, acc, prefetch); break;
        }
        for (int m = 0; m < mt; ++m)
          for (int r = 0; r < R; ++r) y[(m0 + m) * N + n + r] = static_cast<Out>(acc[m * R + r]);
      } else {  // the last rows of the weight, one at a time
        mt = 1;
        for (int64_t r = 0; r < rows; ++r) {
          dot_block<1, 1>(x + m0 * K, K, wn + r * K, K, acc, false);
          y[m0 * N + n + r] = static_cast<Out>(acc[0]);
        }
      }
      m0 += mt;
    }
  }
}

bool cpu_has_avx512_bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512bf16");
}
#else
bool cpu_has_avx512_bf16() { return false; }
#endif

}  // namespace

bool has_avx512_bf16() {
  static const bool has = cpu_has_avx512_bf16();
  return has;
}

// y = x @ w.T for bf16 x [M, K] and w [N, K]; y is fp32 when `fp32_out`, bf16 otherwise.
torch::Tensor linear(torch::Tensor x, torch::Tensor w, bool fp32_out) {
  check_bf16_rows(x, "linear");
  check_bf16_rows(w, "linear");
  TORCH_CHECK(w.is_contiguous() && x.size(1) == w.size(1), "linear: shapes ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(has_avx512_bf16(), "linear: needs a CPU with AVX512-BF16");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options().dtype(fp32_out ? torch::kFloat32 : torch::kBFloat16));
#if defined(__x86_64__)
  constexpr int R = 4;
  const auto* xp = x.data_ptr<at::BFloat16>();
  const auto* wp = w.data_ptr<at::BFloat16>();
  const int64_t num_blocks = (N + R - 1) / R;
  // grain: at least 16 blocks (64 rows) per task, so a small matrix does not pay for many hand-offs
  at::parallel_for(0, num_blocks, 16, [&](int64_t b0, int64_t b1) {
    const int64_t n0 = b0 * R, n1 = std::min(N, b1 * R);
    if (fp32_out) {
      linear_rows<float, R>(xp, M, wp, n0, n1, K, y.data_ptr<float>(), N);
    } else {
      linear_rows<at::BFloat16, R>(xp, M, wp, n0, n1, K, y.data_ptr<at::BFloat16>(), N);
    }
  });
#endif
  return y;
}

// ---- norms, rope, activation -----------------------------------------------------------------------------

namespace {

inline void rms_norm_row(const at::BFloat16* __restrict__ in, const at::BFloat16* __restrict__ weight,
                         at::BFloat16* __restrict__ out, int64_t H, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < H; ++i) {
    const float v = to_f32(in[i]);
    sum += v * v;
  }
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(H) + eps);
#pragma omp simd
  for (int64_t i = 0; i < H; ++i) out[i] = to_bf16(to_f32(in[i]) * inv * to_f32(weight[i]));
}

}  // namespace

// RMSNorm of each row of bf16 x [M, H] with weight [H].
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_bf16_rows(x, "rms_norm");
  TORCH_CHECK(weight.scalar_type() == torch::kBFloat16 && weight.is_contiguous(), "rms_norm: bf16 weight");
  x = x.contiguous();
  const int64_t M = x.size(0), H = x.size(1);
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
  TORCH_CHECK(weight.scalar_type() == torch::kBFloat16 && weight.is_contiguous(), "add_rms_norm: bf16 weight");
  x = x.contiguous();
  const int64_t M = x.size(0), H = x.size(1);
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

// silu(gate) * up for bf16 gate_up [M, 2I] (gate first): [M, I].
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_bf16_rows(gate_up, "silu_mul");
  gate_up = gate_up.contiguous();
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * I, "silu_mul: odd width");
  auto out = torch::empty({M, I}, gate_up.options());
  const auto* gp = gate_up.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      const at::BFloat16* g = gp + m * 2 * I;
      const at::BFloat16* u = g + I;
      at::BFloat16* o = op + m * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) {
        // torch rounds silu(gate) to bf16 before the product; so does this
        const float gi = to_f32(g[i]);
        const float s = to_f32(to_bf16(gi / (1.f + std::exp(-gi))));
        o[i] = to_bf16(s * to_f32(u[i]));
      }
    }
  });
  return out;
}

// Rotate-half rotary embedding, in place, on the query and key heads of bf16 qkv [M, (Hq + 2 Hkv) * D]
// (the value heads are left alone); cos and sin are fp32 [M, D / 2].
void rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t num_heads, int64_t num_kv_heads,
           int64_t head_dim) {
  check_bf16_rows(qkv, "rope_");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "rope_: fp32 contiguous cos and sin");
  const int64_t M = qkv.size(0), half = head_dim / 2, rotated = num_heads + num_kv_heads;
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim && cos.size(0) == M &&
                  cos.size(1) == half && sin.sizes() == cos.sizes(),
              "rope_: shapes");
  auto* base = qkv.data_ptr<at::BFloat16>();
  const int64_t ld = qkv.stride(0);
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, M, 32, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      const float* c = cp + m * half;
      const float* s = sp + m * half;
      for (int64_t h = 0; h < rotated; ++h) {
        at::BFloat16* x1 = base + m * ld + h * head_dim;
        at::BFloat16* x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = to_f32(x1[i]), b2 = to_f32(x2[i]);
          x1[i] = to_bf16(a * c[i] - b2 * s[i]);
          x2[i] = to_bf16(b2 * c[i] + a * s[i]);
        }
      }
    }
  });
}

void register_cpu_ops(pybind11::module& m) {
  // None of these touches a Python object: each lets go of the GIL (see paged_decode_cpu.cpp).
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("has_avx512_bf16", &has_avx512_bf16, "whether `linear` can run on this CPU");
  m.def("linear", &linear, "x @ w.T, bf16, for the few rows of a decode step", release());
  m.def("rms_norm", &rms_norm, "RMSNorm of bf16 rows", release());
  m.def("add_rms_norm", &add_rms_norm, "residual += x; RMSNorm(residual)", release());
  m.def("silu_mul", &silu_mul, "silu(gate) * up", release());
  m.def("rope_", &rope_, "rotate-half rope on q and k heads, in place", release());
}
