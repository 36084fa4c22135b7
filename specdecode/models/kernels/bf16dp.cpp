// bf16 matrix product on AVX512-BF16 dot-product instructions, for few rows (one-token steps,
// verify blocks).
//
// y[M, N] = bf16(x)[M, K] @ w[N, K]^T (+ b[N]); x, y, b fp32; w bf16, repacked once. The same
// arithmetic as the AMX kernel: activations rounded to bf16 (nearest even) on the way in, pairs of
// bf16 products accumulated in fp32 (VDPBF16PS: 16 outputs x 2 inputs per instruction, twice
// the multiply-adds of an fp32 FMA of the same width). At few rows the product is bound by
// reading w (half the bytes of fp32); the extra rows of a verify block cost instructions on
// weights already in registers, not passes over memory.
//
// Layout: the AMX kernel's (amx.cpp), which is already what VDPBF16PS wants: w is repacked into
// groups of 32 outputs, each group interleaved by blocks of 32 inputs, and inside a block 16
// input pairs x 16 outputs x 2: P[group][kb][2][16 pairs][16 outputs][2], one 64-byte row per
// (pair, 16 outputs). A thread owns a range of groups and reads each group's weights once per
// chunk of up to 8 rows of x (a group is 32 x K bf16: 36 KiB at K = 576, it stays in L1/L2 for
// the next chunk). Every row of x takes the same sequence of instructions whatever M is, so a
// row's result does not depend on the rows beside it.
//
// Compiled for its own target; `bf16dp_pack` raises on a CPU without AVX512-BF16 (a safety
// check only: whether the kernel is used is decided by timing it).

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "bf16_pairs.h"

#include <cstdint>
#include <cstring>

namespace {

using specdecode_kernels::pack_pairs;
using specdecode_kernels::pairs_call;

constexpr int64_t TN = 16;  // outputs per block
constexpr int64_t TK = 32;  // inputs per block
constexpr int NB = 2;       // blocks per group
constexpr int MT = 8;       // rows of x per pass
constexpr int64_t PF = 4;   // prefetch distance, in input blocks (2 KiB each)

bool cpu_has_avx512bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512bf16");
}


// Rows [0, R) of xa ([R][Kp] bf16, R <= MT) against one group's weights pg: out[R][32] fp32.
// The accumulators are one flat array and the loops over them unrolled, so that they live in
// registers (a 2-D array of vectors made gcc spill them to the stack every step).
template <int R>
__attribute__((target("avx512f,avx512bf16,avx512bw"))) void group_pass(const uint16_t* xa, int64_t Kp,
                                                                       const uint16_t* pg, int64_t kb_n,
                                                                       float* out) {
  __m512 acc[NB * R];
#pragma GCC unroll 16
  for (int i = 0; i < NB * R; ++i) acc[i] = _mm512_setzero_ps();
  constexpr int64_t BLK = TK * TN;  // bf16 per block (1 KiB)
  const int32_t* x2 = reinterpret_cast<const int32_t*>(xa);  // x as bf16 pairs: [R][Kp / 2]
  const uint16_t* p = pg;
  for (int64_t kb = 0; kb < kb_n; ++kb, p += NB * BLK) {
    for (int64_t q = 0; q < TK / 2; ++q) {
      // every line PF input blocks ahead (past the group's end: the next group, read next)
      _mm_prefetch(reinterpret_cast<const char*>(p + PF * NB * BLK + q * TN * 2), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p + PF * NB * BLK + BLK + q * TN * 2), _MM_HINT_T0);
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(p + q * TN * 2);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(p + BLK + q * TN * 2);
      const int64_t pair = kb * (TK / 2) + q;
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(x2[r * (Kp / 2) + pair]);
        acc[NB * r] = _mm512_dpbf16_ps(acc[NB * r], xv, w0);
        acc[NB * r + 1] = _mm512_dpbf16_ps(acc[NB * r + 1], xv, w1);
      }
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < NB * R; ++i) _mm512_storeu_ps(out + i * TN, acc[i]);
}

using Pass = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, float*);
const Pass PASSES[MT + 1] = {nullptr,        group_pass<1>, group_pass<2>, group_pass<3>, group_pass<4>,
                             group_pass<5>, group_pass<6>, group_pass<7>, group_pass<8>};

}  // namespace

torch::Tensor dp_pack(const torch::Tensor& w) {
  TORCH_CHECK(cpu_has_avx512bf16(), "this CPU has no AVX512-BF16 instructions");
  return pack_pairs(w);
}

torch::Tensor dp_linear(const torch::Tensor& x, const torch::Tensor& P, int64_t N,
                        const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(cpu_has_avx512bf16(), "this CPU has no AVX512-BF16 instructions");
  const auto call = pairs_call(x, P, N, bias, "bf16dp_pack");  // checks x and P, rounds x to bf16
  const int64_t M = call.M, groups = call.groups, kb_n = call.kb_n, Kp = call.Kp;
  const uint16_t *xab = call.xa, *pp = call.P;
  const float* bp = call.bias;
  float* yp = call.out;
  const int64_t gsize = kb_n * NB * TK * TN;  // bf16 per group
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    alignas(64) float out[MT * NB * TN];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * NB * TN, cols = std::min<int64_t>(NB * TN, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += MT) {
        const int rows = static_cast<int>(std::min<int64_t>(MT, M - m0));
        PASSES[rows](xab + m0 * Kp, Kp, pp + g * gsize, kb_n, out);
        for (int r = 0; r < rows; ++r) {
          float* dst = yp + (m0 + r) * N + n0;
          const float* src = out + r * NB * TN;
          if (bp)
            for (int64_t c = 0; c < cols; ++c) dst[c] = src[c] + bp[n0 + c];
          else
            std::memcpy(dst, src, cols * sizeof(float));
        }
      }
    }
  });
  return call.y;
}

TORCH_LIBRARY_FRAGMENT(specdecode, m) {
  m.def("bf16dp_pack(Tensor w) -> Tensor");
  m.def("bf16dp_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdecode, CPU, m) {
  m.impl("bf16dp_pack", &dp_pack);
  m.impl("bf16dp_linear", &dp_linear);
}
