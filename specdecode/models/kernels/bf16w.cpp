// Narrow-weight, fp32-activation matrix products for few rows (one-token steps, verify blocks).
//
// y[M, N] = x[M, K] @ w[N, K]^T (+ b[N]); x, y, b fp32; w held narrow and repacked once:
// - bf16w: w in bf16 (raw uint16 bits). At small M a product is bound by reading w: bf16 halves
//   the bytes of fp32, and widening a bf16 to fp32 is a 16-bit shift (an unpack against zero),
//   so the product reads half the bytes and still multiplies and accumulates in fp32.
// - int8w: w = q * s, q int8 [N, K] and one fp32 scale per output row (weight-only int8, the
//   layout of an int8-stored checkpoint): a quarter of fp32's bytes; q is widened to fp32
//   (sign-extend, convert: exact), the row's sum of x * q is accumulated in fp32 and multiplied
//   by s at the end. Widening costs more instructions than bf16's unpack, on the FMAs' ports:
//   its lead over bf16w is largest at a row or two, where memory bounds the product, and
//   shrinks as rows make the FMAs the bound (a Zen 3: 0.57x bf16w's time at 1 row, ~0.95x at 8).
// AVX2 + FMA: the Python side compiles this only for CPUs that have them, and uses a format
// only where measurement finds it fastest (models.formats).
//
// Layout: w is repacked into blocks of 16 output rows, transposed: P[blk][k][16] (int8w: each
// block followed by its 16 scales, 64 bytes). A step of k reads 16 consecutive weights (one per
// output), widens them into two fp32 vectors and multiplies them by x[m, k] broadcast, for up to
// 6 rows of x at once: 2 FMAs per row per 16 weights and no horizontal sums, so more rows cost
// FMAs, not passes over memory. Each thread owns a range of blocks and sweeps it a few blocks at
// a time, each sweep against every row (6 at a time, the blocks still in cache for the next 6):
// every byte is read from memory once per call.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "products.h"

namespace {

constexpr int64_t PB = 16;  // output rows per packed block
constexpr int64_t SWEEP = 6;  // blocks per sweep over the rows (a multiple of prange's NB 1-3):
                              // 6 x 16 x K bf16, 288 KiB at K = 1536, stay in a core's L2

// Blocks a one-row bf16w product reads side by side (streams; accumulator chains: twice that): 2
// or 3, set by `bf16w_streams`, which models.kernels calls with the faster of both (timed once per
// machine and cached). Which wins depends on the machine (a Zen 3: 3 streams 0.92-0.93x 2's time for
// one forward's products; earlier AVX2 machines read 2 ahead of 1 and 3); a row's outputs are the
// same either way (one chain per output, in the order of k).
std::atomic<int> g_one_row_streams{2};

// A weight format: its element type T, the steps of k a packed block spans (`steps`), the
// prefetch distance PF in steps of k (bf16: 3 KiB; 32 left 4-row passes waiting; int8: the same
// bytes), and `widen`, 16 weights of one step -> two fp32 vectors.
struct Bf16 {
  using T = uint16_t;
  static constexpr int64_t PF = 96;
  static constexpr bool scaled = false;
  static int64_t steps(int64_t K) { return K; }
  static inline void widen(const T* src, __m256& lo, __m256& hi) {
    const __m256i wr = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    const __m256i zero = _mm256_setzero_si256();
    lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, wr));  // outputs 0-3, 8-11
    hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, wr));  // outputs 4-7, 12-15
  }
  static inline void store(float* o, __m256 lo, __m256 hi) {
    _mm256_storeu_ps(o, _mm256_permute2f128_ps(lo, hi, 0x20));      // outputs 0-7
    _mm256_storeu_ps(o + 8, _mm256_permute2f128_ps(lo, hi, 0x31));  // outputs 8-15
  }
};

struct Int8 {
  using T = int8_t;
  static constexpr int64_t PF = 192;
  static constexpr bool scaled = true;
  static int64_t steps(int64_t K) { return K + 4; }  // the block's 16 fp32 scales: 4 steps of 16 bytes
  static inline void widen(const T* src, __m256& lo, __m256& hi) {
    // sign-extending loads (vpmovsxbd ymm, m64): no shuffle to reach the upper 8 bytes
    lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src))));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 8))));
  }
  static inline void store(float* o, __m256 lo, __m256 hi) {
    _mm256_storeu_ps(o, lo);
    _mm256_storeu_ps(o + 8, hi);
  }
  static const float* scales(const T* P, int64_t blk, int64_t K) {  // block blk's 16 scales
    return reinterpret_cast<const float*>(P + (blk * steps(K) + K) * PB);
  }
};

template <class W, int MT, int NB>
inline void ptile(const float* x, int64_t K, const typename W::T* p, float* out) {
  // out: [MT][NB * PB], the outputs of NB consecutive blocks in natural order. Every loop over
  // rows and blocks is unrolled: otherwise gcc keeps `acc` in memory and stores all of it on
  // every step of k (8 stores per 8 FMAs at 4 rows), which bounded the kernel, not the FMAs.
  __m256 acc[MT][2 * NB];
  _Pragma("GCC unroll 16") for (int m = 0; m < MT; ++m)
    _Pragma("GCC unroll 16") for (int j = 0; j < 2 * NB; ++j) acc[m][j] = _mm256_setzero_ps();
  const int64_t bs = W::steps(K);
  for (int64_t k = 0; k < K; ++k) {
    __m256 wv[2 * NB];
    _Pragma("GCC unroll 16") for (int b = 0; b < NB; ++b) {
      const typename W::T* src = p + b * bs * PB + k * PB;
      // PF steps ahead in the order the blocks are read: past this block's end, the same
      // block of the next NB (the stream that will read it), not the next block (read already).
      // Passes of 4+ rows are FMA-bound: they reach 4x farther, into L2 (8 rows ~0.9x the time)
      constexpr int64_t PFM = MT >= 4 ? 4 * W::PF : W::PF;
      const int64_t ahead = k + PFM < K ? PFM : (NB - 1) * bs + PFM;
      _mm_prefetch(reinterpret_cast<const char*>(src + ahead * PB), MT >= 4 ? _MM_HINT_T1 : _MM_HINT_T0);
      W::widen(src, wv[2 * b], wv[2 * b + 1]);
    }
    _Pragma("GCC unroll 16") for (int m = 0; m < MT; ++m) {
      const __m256 xb = _mm256_broadcast_ss(x + m * K + k);
      _Pragma("GCC unroll 16") for (int j = 0; j < 2 * NB; ++j) acc[m][j] = _mm256_fmadd_ps(xb, wv[j], acc[m][j]);
    }
  }
  _Pragma("GCC unroll 16") for (int m = 0; m < MT; ++m)
    _Pragma("GCC unroll 16") for (int b = 0; b < NB; ++b) {
      W::store(out + m * NB * PB + b * PB, acc[m][2 * b], acc[m][2 * b + 1]);
    }
}

template <class W, int MT, int NB>
inline void pblocks(const float* x, int64_t K, const typename W::T* P, const float* bias, float* y,
                    int64_t N, int64_t blk) {
  float out[MT * NB * PB];
  ptile<W, MT, NB>(x, K, P + blk * W::steps(K) * PB, out);
  for (int m = 0; m < MT; ++m)
    for (int64_t c = 0; c < NB * PB; ++c) {
      const int64_t n = blk * PB + c;
      if (n >= N) continue;
      const float b = bias ? bias[n] : 0.f;
      if constexpr (W::scaled)  // the row's sum of x * q times its scale, plus b: one rounding
        y[m * N + n] = std::fma(out[m * NB * PB + c], W::scales(P, blk + c / PB, K)[c % PB], b);
      else
        y[m * N + n] = out[m * NB * PB + c] + b;
    }
}

// Rows m0..m0+MT of x against blocks [b0, b1), NB blocks at a time.
template <class W, int MT, int NB>
inline void prange(const float* x, int64_t K, const typename W::T* P, const float* bias, float* y,
                   int64_t N, int64_t b0, int64_t b1) {
  int64_t b = b0;
  for (; b + NB <= b1; b += NB) pblocks<W, MT, NB>(x, K, P, bias, y, N, b);
  for (; b < b1; ++b) pblocks<W, MT, 1>(x, K, P, bias, y, N, b);
}

// y = x @ w.T (+ bias) for a packed w of format W (x [M, K] fp32 contiguous, y [M, N]).
template <class W>
void narrow_linear(const float* xp, int64_t M, int64_t K, const typename W::T* pp, int64_t nb, const float* bp,
                   float* yp, int64_t N) {
  // The rows against blocks [c0, c1): SWEEP blocks at a time against every row, so a block comes
  // from memory once per call and from L1/L2 for the next rows.
  const auto sweep = [&](int64_t c0, int64_t c1) {
    int64_t m = 0;
    // 6 rows: 12 accumulators + 2 weight vectors + a broadcast fill AVX2's 16 registers;
    // more would spill and cost more than a second pass over blocks still in L1/L2
    for (; m + 6 <= M && M - m != 7; m += 6) prange<W, 6, 1>(xp + m * K, K, pp, bp, yp + m * N, N, c0, c1);
    const float* xr = xp + m * K;
    float* yr = yp + m * N;
    switch (M - m) {
      // 7 rows left: 5 and 2, not 6 and a lone row, whose pass over blocks already in cache runs
      // 4 dependent FMA chains (latency-bound; 7 rows took 1.45-1.69x 6 rows' time, 5 + 2 1.21-1.34x,
      // 4 + 3 1.25-1.63x, one 7-row pass of half vectors 1.8-2.3x: Zen 3, same-process alternation)
      case 7:
        prange<W, 5, 1>(xr, K, pp, bp, yr, N, c0, c1);
        prange<W, 2, 2>(xr + 5 * K, K, pp, bp, yr + 5 * N, N, c0, c1);
        break;
      case 5: prange<W, 5, 1>(xr, K, pp, bp, yr, N, c0, c1); break;
      case 4: prange<W, 4, 1>(xr, K, pp, bp, yr, N, c0, c1); break;
      case 3: prange<W, 3, 1>(xr, K, pp, bp, yr, N, c0, c1); break;
      case 2: prange<W, 2, 2>(xr, K, pp, bp, yr, N, c0, c1); break;
      case 1:
        if (std::is_same_v<W, Bf16> && g_one_row_streams.load(std::memory_order_relaxed) == 3)
          prange<W, 1, 3>(xr, K, pp, bp, yr, N, c0, c1);
        else  // int8w: 2 (timed on bf16w only)
          prange<W, 1, 2>(xr, K, pp, bp, yr, N, c0, c1);
        break;
      default: break;
    }
  };
  specdecode_kernels::split_sweeps(nb, SWEEP, M == 1, sweep);  // contract there
}

// The op around narrow_linear: x [M, K] fp32 (any strides, checked by the caller) against a
// packed weight of nb blocks.
template <class W>
torch::Tensor narrow_product(const torch::Tensor& x, const typename W::T* pp, int64_t nb, int64_t N,
                             const c10::optional<torch::Tensor>& bias) {
  const auto xc = x.contiguous();
  auto y = torch::empty({xc.size(0), N}, xc.options());
  torch::Tensor bc;
  const float* bp = specdecode_kernels::bias_f32(bias, N, bc);
  narrow_linear<W>(xc.data_ptr<float>(), xc.size(0), xc.size(1), pp, nb, bp, y.data_ptr<float>(), N);
  return y;
}

}  // namespace

torch::Tensor pack(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16, "w must be [N, K] bfloat16");
  const auto wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), nb = (N + PB - 1) / PB;
  auto P = torch::zeros({nb, K, PB}, wc.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(P.data_ptr<at::BFloat16>());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) dst[(n / PB) * K * PB + k * PB + n % PB] = src[n * K + k];
  return P;
}

torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& P, int64_t N,
                            const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be [M, K] float32");
  TORCH_CHECK(P.dim() == 3 && P.scalar_type() == torch::kBFloat16 && P.is_contiguous() &&
                  P.size(2) == PB && P.size(0) * PB >= N && P.size(1) == x.size(-1),
              "P must come from bf16w_pack for this K and N");
  return narrow_product<Bf16>(x, reinterpret_cast<const uint16_t*>(P.data_ptr<at::BFloat16>()), P.size(0), N, bias);
}

// q [N, K] int8 and scale [N] (w = q * scale row by row) -> P [nb, K + 4, 16] int8: each block's
// weights transposed, then its 16 scales as fp32 bytes (zero past N).
torch::Tensor int8w_pack(const torch::Tensor& q, const torch::Tensor& scale) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kInt8, "q must be [N, K] int8");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == q.size(0), "scale must be [N]");
  const auto qc = q.contiguous();
  const auto sc = scale.to(torch::kFloat32).contiguous();
  const int64_t N = qc.size(0), K = qc.size(1), nb = (N + PB - 1) / PB;
  auto P = torch::zeros({nb, Int8::steps(K), PB}, qc.options());
  const int8_t* src = qc.data_ptr<int8_t>();
  int8_t* dst = P.data_ptr<int8_t>();
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t k = 0; k < K; ++k) dst[(n / PB) * Int8::steps(K) * PB + k * PB + n % PB] = src[n * K + k];
    std::memcpy(dst + ((n / PB) * Int8::steps(K) + K) * PB + (n % PB) * 4, sc.data_ptr<float>() + n, 4);
  }
  return P;
}

torch::Tensor int8w_linear(const torch::Tensor& x, const torch::Tensor& P, int64_t N,
                           const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be [M, K] float32");
  TORCH_CHECK(P.dim() == 3 && P.scalar_type() == torch::kInt8 && P.is_contiguous() && P.size(2) == PB &&
                  P.size(0) * PB >= N && P.size(1) == Int8::steps(x.size(-1)),
              "P must come from int8w_pack for this K and N");
  return narrow_product<Int8>(x, P.data_ptr<int8_t>(), P.size(0), N, bias);
}

// bf16w_streams(n): a one-row bf16w product reads n = 2 or 3 blocks side by side from now on (0:
// unchanged); returns the number in use. The outputs are the same bit for bit either way.
int64_t bf16w_streams(int64_t n) {
  TORCH_CHECK(n == 0 || n == 2 || n == 3, "bf16w_streams takes 2 or 3 (0 asks)");
  if (n != 0) g_one_row_streams.store(static_cast<int>(n));
  return g_one_row_streams.load();
}

// Dispatcher ops (torch.ops.specdecode.bf16w_linear, ...), so profilers and torch.compile see a
// named product rather than an opaque Python call.
TORCH_LIBRARY_FRAGMENT(specdecode, m) {
  m.def("bf16w_pack(Tensor w) -> Tensor");
  m.def("bf16w_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("int8w_pack(Tensor q, Tensor scale) -> Tensor");
  m.def("int8w_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("bf16w_streams(int n) -> int", &bf16w_streams);
}

TORCH_LIBRARY_IMPL(specdecode, CPU, m) {
  m.impl("bf16w_pack", &pack);
  m.impl("bf16w_linear", &packed_linear);
  m.impl("int8w_pack", &int8w_pack);
  m.impl("int8w_linear", &int8w_linear);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
