// Small 8-lane fp32 helpers shared by the kernels of fused.cpp and verify.cpp (AVX2 + FMA):
// horizontal sum and maximum of a vector, and exp(x - m) for x <= m in 8 lanes.
#pragma once

#include <immintrin.h>

#include <limits>

inline float hadd(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

inline float hmax(__m256 v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// exp(x - m) for x <= m, in 8 lanes (Cephes' polynomial, ~2 ulp); x == -inf gives exactly 0.
// Every lane runs the same instructions, so a score's weight never depends on its neighbours.
inline __m256 exp_shifted(__m256 x, __m256 m) {
  const __m256 masked = _mm256_cmp_ps(x, _mm256_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_EQ_OQ);
  __m256 t = _mm256_max_ps(_mm256_sub_ps(x, m), _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(t, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  t = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), t);
  t = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), t);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, t, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, t, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, t, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, t, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, t, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(t, t), t), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(masked, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}
