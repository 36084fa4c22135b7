// Shared by the kernels that multiply bf16 pairs (amx.cpp, bf16dp.cpp): rounding fp32 activations
// to bf16 (nearest even); and the AMX kernel's pair-interleaved weight layout,
// P[group][kb][2][16 input pairs][16 outputs][2]: groups of 32 outputs (zero-padded), blocks of
// 32 inputs (zero-padded), one 64-byte row per (input pair, 16 outputs).
#pragma once

#include <immintrin.h>
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "products.h"

namespace specdecode_kernels {

inline uint16_t to_bf16(float f) {  // round to nearest even (NaN stays NaN)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// x[0, n) -> bf16, 16 at a time with AVX512-BF16 (call only on CPUs that have it)
__attribute__((target("avx512f,avx512bf16,avx512vl"))) inline void to_bf16_row(const float* x, uint16_t* y,
                                                                              int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
  for (; i < n; ++i) y[i] = to_bf16(x[i]);
}

constexpr int64_t PAIR_TN = 16;  // outputs per block
constexpr int64_t PAIR_TK = 32;  // inputs per block
constexpr int64_t PAIR_NB = 2;   // blocks per group

// w [N, K] bf16 -> [ceil(N / 32), ceil(K / 32), 2, 16, 16, 2]
inline torch::Tensor pack_pairs(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16, "w must be [N, K] bfloat16");
  const auto wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), NB = PAIR_NB, TN = PAIR_TN, TK = PAIR_TK;
  const int64_t ng = (N + NB * TN - 1) / (NB * TN), kb_n = (K + TK - 1) / TK;
  auto P = torch::zeros({ng, kb_n, NB, TK / 2, TN, 2}, wc.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(P.data_ptr<at::BFloat16>());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t blk = ((n / (NB * TN)) * kb_n + k / TK) * NB + (n / TN) % NB, kk = k % TK;
      dst[blk * TK * TN + (kk / 2) * TN * 2 + (n % TN) * 2 + kk % 2] = src[n * K + k];
    }
  return P;
}

// Whether P is pack_pairs' layout for inputs of width K and N outputs.
inline bool is_pairs_of(const torch::Tensor& P, int64_t K, int64_t N) {
  return P.dim() == 6 && P.scalar_type() == torch::kBFloat16 && P.is_contiguous() &&
         P.size(2) == PAIR_NB && P.size(3) == PAIR_TK / 2 && P.size(4) == PAIR_TN &&
         P.size(0) * PAIR_NB * PAIR_TN >= N && P.size(1) * PAIR_TK >= K && (P.size(1) - 1) * PAIR_TK < K;
}

// Rows of x [M, K] fp32 -> bf16 [M, Kp], zero-padded to Kp, in a buffer kept per calling thread.
inline const uint16_t* round_rows(const float* x, int64_t M, int64_t K, int64_t Kp) {
  thread_local std::vector<uint16_t> xa;
  if (xa.size() < static_cast<size_t>(M * Kp)) xa.resize(M * Kp);
  for (int64_t m = 0; m < M; ++m) {
    to_bf16_row(x + m * K, xa.data() + m * Kp, K);
    std::fill(xa.data() + m * Kp + K, xa.data() + (m + 1) * Kp, 0);
  }
  return xa.data();
}

// What amx_linear sets up for x [M, K] fp32 against P (pack_pairs' layout
// for N outputs): x rounded to bf16 rows [M, Kp] (call it only once the CPU is known to run
// AVX512-BF16), y [M, N] to fill, the weights and the bias. `pack` names the packing op in the
// error for a P of another shape.
struct PairsCall {
  torch::Tensor y, bias_keep;
  const uint16_t* xa;
  const uint16_t* P;
  const float* bias;
  float* out;
  int64_t M, groups, kb_n, Kp;
};

inline PairsCall pairs_call(const torch::Tensor& x, const torch::Tensor& P, int64_t N,
                            const c10::optional<torch::Tensor>& bias, const char* pack) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be [M, K] float32");
  TORCH_CHECK(is_pairs_of(P, x.size(1), N), "P must come from ", pack, " for this K and N");
  const auto xc = x.contiguous();
  PairsCall c;
  c.M = xc.size(0);
  c.groups = P.size(0);
  c.kb_n = P.size(1);
  c.Kp = c.kb_n * PAIR_TK;
  c.xa = round_rows(xc.data_ptr<float>(), c.M, xc.size(1), c.Kp);  // [M, Kp] bf16
  c.y = torch::empty({c.M, N}, xc.options());
  c.out = c.y.data_ptr<float>();
  c.P = reinterpret_cast<const uint16_t*>(P.data_ptr<at::BFloat16>());
  c.bias = bias_f32(bias, N, c.bias_keep);
  return c;
}

}  // namespace specdecode_kernels
