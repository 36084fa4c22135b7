// bf16 matrix product on AVX512-BF16 dot-product instructions, for few rows (one-token steps,
// verify blocks).
//
// y[M, N] = bf16(x)[M, K] @ w[N, K]^T (+ b[N]); x, y, b fp32; w bf16, repacked once. The same
// arithmetic as the AMX kernel: activations rounded to bf16 (nearest even) on the way in, pairs of
// bf16 products accumulated in fp32 (VDPBF16PS: 16 outputs x 2 inputs per instruction, twice
// the multiply-adds of an fp32 FMA of the same width), one accumulator per output, the input
// pairs in order. At few rows the product is bound by reading w (half the bytes of fp32); the
// extra rows of a verify block cost instructions on weights already in registers.
//
// Layout: blocks of 16 outputs, each its own contiguous run of input pairs: P[blk][K2][16][2]
// (K2 = ceil(K / 2), one 64-byte row per input pair). A pass multiplies up to 8 rows of x by NB
// blocks at once, each block a separate stream from memory: 4 blocks for up to 6 rows, 3 for 7-8
// (accumulators rows x NB, at most 24 of the 32 registers). Streams, not one stream per pass,
// and a prefetch into L2 16 KiB ahead of each are what reach the memory's bandwidth while the
// dot products run: on a 2-core Zen 4 the AMX layout read as one stream (32 outputs interleaved
// per block of inputs) ran one row at 19-24 GB/s and 8 rows at 16-21, and without the prefetch
// 8 rows ran at 17-24 (a harness over 8 layers' products); one forward's products now run at
// 26-28 GB/s for 1-4 rows and 25-26 for 7-8, 0.69-0.84x bf16w's time there
// (benchmarks/results/products-smollm2-135m-epyc-zen4). Threads split the blocks as bf16w does
// (`split_sweeps`); more than 8 rows run in passes of 8 over a sweep of blocks still in L2. Every
// row takes the same instructions whatever M is and whichever pass it falls in, so a row's result
// does not depend on the rows beside it.
//
// `bf16dp1_linear` is the same product on the same packing with up to 16 rows in one pass and one
// stream, a block at a time (past 16 rows both run the same passes): the same sums in the same
// order, so the same bits. Which reads faster depends on the CPU, and `models.formats` times both:
// on a 2-core Zen 5 one stream took 0.84-0.90x the time of 3-4 for one forward's products at 1-8
// rows (41-53 GB/s, benchmarks/results/products-smollm2-135m-epyc-zen5), one pass of 12 rows
// 0.73x two passes of 8 (16 rows 0.90x), the prefetch distance mattering little (64-384 pairs
// within 3 %, same-process alternation); on the Zen 4 above one stream of the AMX layout (the
// same way of reading) ran one row at 19-24 GB/s against 26-28 for 3-4 streams.
//
// Compiled for its own target; `bf16dp_pack` raises on a CPU without AVX512-BF16 (a safety
// check only: whether the kernel is used is decided by timing it).

#include <immintrin.h>
#include <torch/extension.h>

#include "bf16_pairs.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t PB = 16;     // outputs per block
constexpr int64_t PF = 256;   // prefetch distance in input pairs: 16 KiB a stream
constexpr int64_t SWEEP = 12;  // blocks per sweep over the rows (a multiple of 3 and 4): 12 x 16 x K
                               // bf16, 216 KiB at K = 576, 576 KiB at K = 1536, stay in L2

bool cpu_has_avx512bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512bf16");
}

// Rows [0, MT) of x2 (bf16 pairs, row stride K2) against NB consecutive blocks at p (block
// stride bs bf16): out[MT][NB * 16] fp32. Every loop is unrolled so the accumulators stay in
// registers.
template <int MT, int NB>
__attribute__((target("avx512f,avx512bf16,avx512bw"))) inline void tile(const int32_t* x2, int64_t K2,
                                                                      const uint16_t* p, int64_t bs,
                                                                      float* out) {
  __m512 acc[MT * NB];
#pragma GCC unroll 32
  for (int i = 0; i < MT * NB; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K2; ++k) {
    __m512bh w[NB];
#pragma GCC unroll 8
    for (int b = 0; b < NB; ++b) {
      const uint16_t* src = p + b * bs + k * PB * 2;
      // PF pairs ahead into L2, past the block's end into the block this stream reads next
      _mm_prefetch(reinterpret_cast<const char*>(src + (k + PF < K2 ? PF : (NB - 1) * K2 + PF) * PB * 2),
                   _MM_HINT_T1);
      w[b] = (__m512bh)_mm512_loadu_si512(src);
    }
#pragma GCC unroll 16
    for (int m = 0; m < MT; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(x2[m * K2 + k]);
#pragma GCC unroll 8
      for (int b = 0; b < NB; ++b) acc[m * NB + b] = _mm512_dpbf16_ps(acc[m * NB + b], xv, w[b]);
    }
  }
#pragma GCC unroll 32
  for (int i = 0; i < MT * NB; ++i) _mm512_storeu_ps(out + i * PB, acc[i]);
}

// Rows [0, MT) against blocks [b0, b1), NB at a time (the last few one at a time), into y.
template <int MT, int NB>
void prange(const int32_t* x2, int64_t K2, const uint16_t* P, const float* bias, float* y, int64_t N,
            int64_t b0, int64_t b1) {
  alignas(64) float out[MT * NB * PB];
  const int64_t bs = K2 * PB * 2;
  for (int64_t b = b0; b < b1;) {
    const int nbk = b + NB <= b1 ? NB : 1;
    if (nbk == NB)
      tile<MT, NB>(x2, K2, P + b * bs, bs, out);
    else
      tile<MT, 1>(x2, K2, P + b * bs, bs, out);
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < nbk; ++j) {
        const int64_t n0 = (b + j) * PB, cols = std::min<int64_t>(PB, N - n0);
        const float* src = out + (m * nbk + j) * PB;
        float* dst = y + m * N + n0;
        if (bias)
          for (int64_t c = 0; c < cols; ++c) dst[c] = src[c] + bias[n0 + c];
        else
          std::memcpy(dst, src, cols * sizeof(float));
      }
    b += nbk;
  }
}

// Rows [0, R) (R <= 8) against blocks [b0, b1): one pass, 4 streams up to 6 rows, 3 beyond.
void rows_pass(int R, const int32_t* x2, int64_t K2, const uint16_t* P, const float* bias, float* y,
               int64_t N, int64_t b0, int64_t b1) {
  switch (R) {
    case 1: prange<1, 4>(x2, K2, P, bias, y, N, b0, b1); break;
    case 2: prange<2, 4>(x2, K2, P, bias, y, N, b0, b1); break;
    case 3: prange<3, 4>(x2, K2, P, bias, y, N, b0, b1); break;
    case 4: prange<4, 4>(x2, K2, P, bias, y, N, b0, b1); break;
    case 5: prange<5, 4>(x2, K2, P, bias, y, N, b0, b1); break;
    case 6: prange<6, 4>(x2, K2, P, bias, y, N, b0, b1); break;
    case 7: prange<7, 3>(x2, K2, P, bias, y, N, b0, b1); break;
    default: prange<8, 3>(x2, K2, P, bias, y, N, b0, b1); break;
  }
}

// Rows [0, R) (R <= 16) against blocks [b0, b1) in one stream, a block at a time (bf16dp1).
template <int R = 1>
void rows_pass1(int rows, const int32_t* x2, int64_t K2, const uint16_t* P, const float* bias, float* y,
                int64_t N, int64_t b0, int64_t b1) {
  if constexpr (R < 16) {
    if (rows != R) return rows_pass1<R + 1>(rows, x2, K2, P, bias, y, N, b0, b1);
  }
  prange<R, 1>(x2, K2, P, bias, y, N, b0, b1);
}

}  // namespace

// w [N, K] bf16 -> P [ceil(N / 16), ceil(K / 2), 16, 2] (zero-padded)
torch::Tensor dp_pack(const torch::Tensor& w) {
  TORCH_CHECK(cpu_has_avx512bf16(), "this CPU has no AVX512-BF16 instructions");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16, "w must be [N, K] bfloat16");
  const auto wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), nb = (N + PB - 1) / PB, K2 = (K + 1) / 2;
  auto P = torch::zeros({nb, K2, PB, 2}, wc.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(P.data_ptr<at::BFloat16>());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) dst[((n / PB) * K2 + k / 2) * PB * 2 + (n % PB) * 2 + k % 2] = src[n * K + k];
  return P;
}

// y = x @ w.T (+ bias); `one` (bf16dp1_linear): up to 16 rows in one pass and one stream.
static torch::Tensor dp_product(const torch::Tensor& x, const torch::Tensor& P, int64_t N,
                                const c10::optional<torch::Tensor>& bias, bool one) {
  TORCH_CHECK(cpu_has_avx512bf16(), "this CPU has no AVX512-BF16 instructions");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be [M, K] float32");
  TORCH_CHECK(P.dim() == 4 && P.scalar_type() == torch::kBFloat16 && P.is_contiguous() && P.size(2) == PB &&
                  P.size(3) == 2 && P.size(0) * PB >= N && P.size(1) == (x.size(1) + 1) / 2,
              "P must come from bf16dp_pack for this K and N");
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0), K2 = P.size(1), nb = P.size(0);
  // [M, 2 * K2] bf16, zero-padded: rows of input pairs
  const auto* x2 = reinterpret_cast<const int32_t*>(
      specdecode_kernels::round_rows(xc.data_ptr<float>(), M, xc.size(1), 2 * K2));
  auto y = torch::empty({M, N}, xc.options());
  torch::Tensor bc;
  const float* bp = specdecode_kernels::bias_f32(bias, N, bc);
  float* yp = y.data_ptr<float>();
  if (M == 0) return y;
  const uint16_t* pp = reinterpret_cast<const uint16_t*>(P.data_ptr<at::BFloat16>());
  // Up to one pass of rows (bf16dp1: up to 16 rows in one stream; else 8), with nothing to keep in
  // L2 for a next pass, the threads share the blocks a tile at a time: a finer last share for the
  // thread that finishes first to take than SWEEP blocks, of which a 576-output product has 3 (one
  // forward's products 0.96-0.98x the time at 2-8 rows, the same at 1 and 16: a 2-core Zen 5,
  // same-process alternation). Past that, passes of 8 rows in 3-4 streams over sweeps in L2.
  if (one && M <= 16) {
    specdecode_kernels::split_sweeps(nb, 4, M == 1, [&](int64_t c0, int64_t c1) {
      rows_pass1(static_cast<int>(M), x2, K2, pp, bp, yp, N, c0, c1);
    });
    return y;
  }
  specdecode_kernels::split_sweeps(nb, M > 8 ? SWEEP : M > 6 ? 3 : 4, M == 1, [&](int64_t c0, int64_t c1) {
    for (int64_t m = 0; m < M; m += 8)
      rows_pass(static_cast<int>(std::min<int64_t>(8, M - m)), x2 + m * K2, K2, pp, bp, yp + m * N, N, c0, c1);
  });
  return y;
}

torch::Tensor dp_linear(const torch::Tensor& x, const torch::Tensor& P, int64_t N,
                        const c10::optional<torch::Tensor>& bias) {
  return dp_product(x, P, N, bias, false);
}

torch::Tensor dp1_linear(const torch::Tensor& x, const torch::Tensor& P, int64_t N,
                         const c10::optional<torch::Tensor>& bias) {
  return dp_product(x, P, N, bias, true);
}

TORCH_LIBRARY_FRAGMENT(specdecode, m) {
  m.def("bf16dp_pack(Tensor w) -> Tensor");
  m.def("bf16dp_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("bf16dp1_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdecode, CPU, m) {
  m.impl("bf16dp_pack", &dp_pack);
  m.impl("bf16dp_linear", &dp_linear);
  m.impl("bf16dp1_linear", &dp1_linear);
}
