// bf16-weight, fp32-activation matrix product for few rows (one-token steps, short verify blocks).
//
// y[M, N] = x[M, K] @ w[N, K]^T (+ b[N]); x, y, b fp32; w bf16 (raw uint16 bits).
// At small M a product is bound by reading w: bf16 halves the bytes of fp32, and widening a
// bf16 to fp32 is a 16-bit shift, so the product reads half the bytes and still multiplies and
// accumulates in fp32. Each thread owns a range of output tiles (TN rows of w, kept in L1) and
// sweeps all M rows of x over them, so every weight byte leaves memory once per call.
// AVX2 + FMA: the Python side compiles this only where the compiler targets them, and the
// kernel is used only when the format measurement finds it fastest on the machine at hand.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t TN = 4;  // output rows per tile: kept in L1 while every x row sweeps them

// Widening bf16 to fp32 puts the 16 bits in the high half of a 32-bit lane: unpacking against
// zero does that for 16 values in two instructions, but within 128-bit lanes, so the low
// result holds elements {0-3, 8-11} of a 16-block and the high one {4-7, 12-15}. x is permuted
// to match once per call (PERM), and a dot product does not care about the order of its terms.
constexpr int PERM[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};

inline float bf16_to_float(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// MT rows of (permuted) x against NT rows of w; MT * NT accumulators stay in registers.
// x: original rows (for the tail), xp: permuted rows, both [MT, K] with row stride K.
template <int MT, int NT>
inline void tile(const float* x, const float* xp, int64_t K, const uint16_t* w, const float* b,
                 float* y, int64_t N) {
  __m256 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_setzero_ps();
  const __m256i zero = _mm256_setzero_si256();
  const int64_t K16 = K - K % 16;
  for (int64_t k = 0; k < K16; k += 16) {
    __m256i wr[NT];
    for (int n = 0; n < NT; ++n) {
      // The same place in the next tile (TN rows on): short rows give the hardware prefetcher
      // too little to lock on to.
      _mm_prefetch(reinterpret_cast<const char*>(w + (n + TN) * K + k), _MM_HINT_T0);
      wr[n] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + n * K + k));
    }
    __m256 wv[NT];
    for (int n = 0; n < NT; ++n) wv[n] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, wr[n]));
    for (int m = 0; m < MT; ++m) {
      const __m256 xv = _mm256_loadu_ps(xp + m * K + k);
      for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_fmadd_ps(xv, wv[n], acc[m][n]);
    }
    for (int n = 0; n < NT; ++n) wv[n] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, wr[n]));
    for (int m = 0; m < MT; ++m) {
      const __m256 xv = _mm256_loadu_ps(xp + m * K + k + 8);
      for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) {
      float s = hsum(acc[m][n]);
      for (int64_t k = K16; k < K; ++k) s += x[m * K + k] * bf16_to_float(w[n * K + k]);
      y[m * N + n] = b ? s + b[n] : s;
    }
}

// Every row of x against one tile of TN weight rows (w, b, y offset to the tile).
inline void sweep(const float* x, const float* xp, int64_t M, int64_t K, const uint16_t* w,
                  const float* b, float* y, int64_t N) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4)  // 4 x rows, 2 w rows: fewest conversions per FMA that fit
    for (int64_t n = 0; n < TN; n += 2)
      tile<4, 2>(x + m * K, xp + m * K, K, w + n * K, b ? b + n : nullptr, y + m * N + n, N);
  const int64_t r = M - m;
  if (r == 3) {
    for (int64_t n = 0; n < TN; n += 2)
      tile<3, 2>(x + m * K, xp + m * K, K, w + n * K, b ? b + n : nullptr, y + m * N + n, N);
  } else if (r == 2) {
    tile<2, 4>(x + m * K, xp + m * K, K, w, b, y + m * N, N);
  } else if (r == 1) {
    tile<1, 4>(x + m * K, xp + m * K, K, w, b, y + m * N, N);
  }
}

inline void sweep_rows(const float* x, const float* xp, int64_t M, int64_t K, const uint16_t* w,
                       const float* b, float* y, int64_t N, int64_t nt) {
  // A partial last tile: one weight row at a time.
  for (int64_t j = 0; j < nt; ++j)
    for (int64_t m = 0; m < M; ++m)
      tile<1, 1>(x + m * K, xp + m * K, K, w + j * K, b ? b + j : nullptr, y + m * N + j, N);
}

}  // namespace

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be [M, K] float32");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous(),
              "w must be a contiguous [N, K] bfloat16 tensor");
  TORCH_CHECK(x.size(1) == w.size(1), "x [M, K] and w [N, K] disagree on K");
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, xc.options());
  const float* xo = xc.data_ptr<float>();
  auto xperm = torch::empty_like(xc);
  float* xp = xperm.data_ptr<float>();
  const int64_t K16 = K - K % 16;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K16; k += 16)
      for (int j = 0; j < 16; ++j) xp[m * K + k + j] = xo[m * K + k + PERM[j]];
    for (int64_t k = K16; k < K; ++k) xp[m * K + k] = xo[m * K + k];
  }
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  const float* bp = nullptr;
  torch::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->to(torch::kFloat32).contiguous();
    TORCH_CHECK(bc.numel() == N, "bias must have N entries");
    bp = bc.data_ptr<float>();
  }
  const int64_t tiles = (N + TN - 1) / TN;
  // A tile writes an [M, TN] block of y ([M, N] row-major): it gets y offset to its first column.
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * TN;
      const int64_t nt = std::min(TN, N - n0);
      const uint16_t* wt = wp + n0 * K;
      const float* bt = bp ? bp + n0 : nullptr;
      float* yt = yp + n0;
      if (nt == TN) {
        sweep(xo, xp, M, K, wt, bt, yt, N);
      } else {
        sweep_rows(xo, xp, M, K, wt, bt, yt, N, nt);
      }
    }
  });
  return y;
}

// A dispatcher op (torch.ops.specdecode.bf16w_linear), so profilers and torch.compile see a
// named product rather than an opaque Python call.
TORCH_LIBRARY_FRAGMENT(specdecode, m) {
  m.def("bf16w_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdecode, CPU, m) {
  m.impl("bf16w_linear", &linear);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
