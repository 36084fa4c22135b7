// Fused fp32 CPU ops for the native decoder's layer: what stock PyTorch runs as 5-15 small
// operators each (dispatch, allocation, a pass over memory per operator) becomes one pass.
//
// Each op computes every row the same way whatever the number of rows, so a one-token step and
// a verify block round alike (greedy speculation stays token for token equal to greedy `ar`).
//   rms_norm(x [M, d], w [d], eps)                    -> [M, d]
//   add_rms_norm(x [M, d], delta [M, d], w, eps)      -> (x + delta, rms_norm(x + delta))
//   rope_(qkv [M, C], cs [M, 2, D], num_heads)        in place on the first num_heads * D columns:
//       x * cos + roll(x, D/2) * sin_signed (the table holds cos and the signed sin)
//   silu_mul(gu [M, 2I])                              -> silu(gu[:, :I]) * gu[:, I:]
//   attention(q [B, Hk, R, D], k [B|S.., Hk, L, D], v, mask [B|1, 1, R, L] bool | None,
//             slots [B] int64 | None)
//       (k and v fp32, or both bf16: widened exactly to fp32 as they are read)
//       -> [B, Hk, R, D]: softmax(q k^T / sqrt(D), masked) v; keys no row of a (b, head) may
//       see are never read, so padding of ragged batches costs nothing. With `slots`, batch
//       row b reads k[slots[b]] and v[slots[b]] (a whole cache read in place, any slots in any
//       order); without, k[b].
//   attention_tokens(q [B, N, H, D], k, v, mask) -> [B, N, H, D]: attention with q and the
//       output token-major (as the QKV product and the output product hold them), row
//       g * N + n of KV head h being q[b, n, h * G + g]: no permuted copies either way
//   attention_avx512(on) -> whether attention's value pass (and its scores over the keys every
//       row of a task sees) now run on AVX-512 (on, where the CPU has AVX-512F) or on 8 lanes;
//       the result is the same bit for bit either way.
//   markov_argmax(u [n, K, V] fp32, table [R, V] fp32|bf16, prev [n] int64, off [V] bool | None)
//       -> [n, K] int64, a greedy chain: x_0 = prev, x_k = argmax_v u[:, k-1, v] + table[x_{k-1}, v]
//       over the v not `off` (sums in fp32; the first of equal maxima, as torch.argmax)
//   markov_sample(u, table, prev, off, uniforms [n, K] fp32, temperature) -> ([n, K] int64, q [n, K, V])
//       the same chain sampled: x_k drawn from q_k = softmax((s_k - max) / T) over the v not `off`
//       (s_k = u[:, k] + table[x_{k-1}]) by inverse CDF with uniforms[:, k] (sampling.sample's rule)
//   markov_topk(u [V] fp32, table [R, V] fp32|bf16, prev int, off [V] bool | None, k)
//       -> (log-probs [k] fp32, ids [k] int64): the k best v of s = u + table[prev] (v not `off`)
//       by s, ties to the lower v, with s - logsumexp(s): a DSpark tree node's children (block_tree)

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32");
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

// 8 key/value elements as fp32 lanes: fp32 as is, bf16 (stored as uint16) widened exactly.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float to_f(float x) { return x; }
inline float to_f(uint16_t x) {
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// silu(z) * u = z / (1 + exp(-z)) * u in 8 lanes (exp_shifted's polynomial; exp(-z) clamped to
// [exp(-87), exp(88)], which only moves results below fp32's resolution)
inline __m256 silu_mul8(__m256 z, __m256 u) {
  const __m256 nz = _mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), z), _mm256_set1_ps(88.f));
  const __m256 e = exp_shifted(nz, _mm256_setzero_ps());
  return _mm256_mul_ps(_mm256_div_ps(z, _mm256_add_ps(_mm256_set1_ps(1.f), e)), u);
}

// Dot product in 8 fp32 lanes (compilers keep float reductions scalar unless told to reorder).
inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hadd(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// The 8-key reduction of score8: lane t of the result holds the sum of acc[t]'s lanes.
inline __m256 reduce8(const __m256* a) {
  const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
  // h0123 = [s0lo s1lo s2lo s3lo | s0hi s1hi s2hi s3hi] (lo/hi: 128-bit halves), same for 4-7
  return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

// q . k for 8 keys at once: 8 independent accumulators over d (no hadd per key), then one
// transposing reduction; key t's lanes are summed in the same order whatever the other keys.
template <typename T>
inline __m256 score8(const float* q, const T* const* k, int64_t d) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    a0 = _mm256_fmadd_ps(qv, load8(k[0] + i), a0);
    a1 = _mm256_fmadd_ps(qv, load8(k[1] + i), a1);
    a2 = _mm256_fmadd_ps(qv, load8(k[2] + i), a2);
    a3 = _mm256_fmadd_ps(qv, load8(k[3] + i), a3);
    a4 = _mm256_fmadd_ps(qv, load8(k[4] + i), a4);
    a5 = _mm256_fmadd_ps(qv, load8(k[5] + i), a5);
    a6 = _mm256_fmadd_ps(qv, load8(k[6] + i), a6);
    a7 = _mm256_fmadd_ps(qv, load8(k[7] + i), a7);
  }
  const __m256 acc[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
  __m256 out = reduce8(acc);
  if (i < d) {  // a tail shorter than 8 (head sizes are multiples of 8 in practice)
    alignas(32) float tail[8];
    _mm256_store_ps(tail, out);
    for (int t = 0; t < 8; ++t)
      for (int64_t e = i; e < d; ++e) tail[t] += q[e] * to_f(k[t][e]);
    out = _mm256_load_ps(tail);
  }
  return out;
}

// score8 for RG query rows (q + g * ld) at once, d a multiple of 8: each key vector is loaded
// (and widened) once for all rows, 4 keys at a time. Every score is the same chain of fmas and
// the same reduction as score8's, so out[g] is bit for bit score8(q + g * ld, k, d).
template <int RG, typename T>
inline void score8_rows(const float* q, int64_t ld, const T* const* k, int64_t d, __m256* out) {
  __m256 acc[RG][8];
  for (int half = 0; half < 2; ++half) {
    __m256 a[RG][4];
    for (int g = 0; g < RG; ++g)
      for (int t = 0; t < 4; ++t) a[g][t] = _mm256_setzero_ps();
    const T* const* ks = k + 4 * half;  // this half's 4 keys
    for (int64_t i = 0; i < d; i += 8) {
      // the RG query vectors held, one key widened at a time: 3 rows' 12 accumulators + 3 + 1
      // fill AVX2's 16 registers (all 4 keys held made 17, and gcc spilled accumulators to the
      // stack on every step)
      __m256 qv[RG];
      for (int g = 0; g < RG; ++g) qv[g] = _mm256_loadu_ps(q + g * ld + i);
      for (int t = 0; t < 4; ++t) {
        const __m256 kv = load8(ks[t] + i);
        for (int g = 0; g < RG; ++g) a[g][t] = _mm256_fmadd_ps(qv[g], kv, a[g][t]);
      }
    }
    for (int g = 0; g < RG; ++g)
      for (int t = 0; t < 4; ++t) acc[g][4 * half + t] = a[g][t];
  }
  for (int g = 0; g < RG; ++g) out[g] = reduce8(acc[g]);
}

// o[0, d) += inv * sum_j p[j] v[j] over j0 <= j < n with p[j] != 0, in key order, in 8-lane
// registers (64 at a time); o holds the sum over the keys before j0 (zeros to start).
template <typename T>
inline void weighted_sum(const float* p, int64_t j0, int64_t n, float inv, const T* v, int64_t vl, int64_t d,
                         float* o) {
  int64_t e0 = 0;
  for (; e0 + 64 <= d; e0 += 64) {
    __m256 acc[8];
    for (int u = 0; u < 8; ++u) acc[u] = _mm256_loadu_ps(o + e0 + 8 * u);
    for (int64_t j = j0; j < n; ++j) {
      if (p[j] == 0.f) continue;
      const __m256 pj = _mm256_set1_ps(p[j] * inv);
      const T* vj = v + j * vl + e0;
      for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(pj, load8(vj + 8 * u), acc[u]);
    }
    for (int u = 0; u < 8; ++u) _mm256_storeu_ps(o + e0 + 8 * u, acc[u]);
  }
  for (int64_t e = e0; e < d; ++e) {
    float acc = o[e];
    for (int64_t j = j0; j < n; ++j)
      if (p[j] != 0.f) acc = std::fma(p[j] * inv, to_f(v[j * vl + e]), acc);
    o[e] = acc;
  }
}

// p == 0 (either sign), tested on the float's bits in a general register: a float compare
// keeps a zero in a vector register, and in weighted_sum_rows that 17th register made gcc spill
// an accumulator to the stack (a store-to-load round trip on every key's chain; perf on Zen 3)
inline bool zero_bits(const float* p) {
  uint32_t b;
  std::memcpy(&b, p, sizeof b);
  return (b << 1) == 0;
}

// weighted_sum over keys [0, n) for RG rows at once that share their zero weights there (rows
// of one chunk with the same mask row, or the keys every row of the chunk sees): each value row
// is loaded once for all RG rows; every output element is the same sequence of fmas as
// weighted_sum's, so the result is bit for bit what it gives row by row (o: zeros to start).
// The weights come scaled already (p[j] * inv, the product weighted_sum forms; the softmax pass
// stores it), so a key costs the loop RG broadcasts from memory and no multiplies.
template <int RG, typename T>
inline void weighted_sum_rows(const float* p, int64_t ld, int64_t n, const T* v, int64_t vl, int64_t d, float* o,
                              int64_t od) {
  for (int64_t e0 = 0; e0 + 32 <= d; e0 += 32) {
    __m256 acc[RG][4];
    for (int g = 0; g < RG; ++g)
      for (int u = 0; u < 4; ++u) acc[g][u] = _mm256_loadu_ps(o + g * od + e0 + 8 * u);
    for (int64_t j = 0; j < n; ++j) {
      if (zero_bits(p + j)) continue;  // masked for every row of the group
      const T* vj = v + j * vl + e0;
      // the RG weights held, one value vector widened at a time (12 + 3 + 1 registers; all 4
      // value vectors held made 17 and spilled accumulators to the stack on every key)
      __m256 pj[RG];
      for (int g = 0; g < RG; ++g) pj[g] = _mm256_broadcast_ss(p + g * ld + j);
      for (int u = 0; u < 4; ++u) {
        const __m256 vv = load8(vj + 8 * u);
        for (int g = 0; g < RG; ++g) acc[g][u] = _mm256_fmadd_ps(pj[g], vv, acc[g][u]);
      }
    }
    for (int g = 0; g < RG; ++g)
      for (int u = 0; u < 4; ++u) _mm256_storeu_ps(o + g * od + e0 + 8 * u, acc[g][u]);
  }
}

// The AVX-512 twin of weighted_sum_rows for up to 6 rows (d a multiple of 64 here): 64 output
// elements of every row in registers at once, so the values are read once for all the rows (the
// 8-lane version passes over them once per 3 rows and 32 elements). Each output element is the
// same sequence of fmas in key order, each weight the same product p * inv: bit for bit
// weighted_sum_rows' result. Compiled for its own target; called only when `attention_avx512`
// turned it on (the CPU has AVX-512F).
inline __attribute__((target("avx512f"))) __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __attribute__((target("avx512f"))) __m512 load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <int RG, typename T>
__attribute__((target("avx512f"))) void weighted_sum_rows512(const float* p, int64_t ld, int64_t n,
                                                             const float* inv, const T* v, int64_t vl,
                                                             int64_t d, float* o, int64_t od) {
  for (int64_t e0 = 0; e0 + 64 <= d; e0 += 64) {
    __m512 acc[RG][4];
    for (int g = 0; g < RG; ++g)
      for (int u = 0; u < 4; ++u) acc[g][u] = _mm512_loadu_ps(o + g * od + e0 + 16 * u);
    for (int64_t j = 0; j < n; ++j) {
      if (p[j] == 0.f) continue;  // masked for every row of the group
      const T* vj = v + j * vl + e0;
      const __m512 v0 = load16(vj), v1 = load16(vj + 16), v2 = load16(vj + 32), v3 = load16(vj + 48);
      for (int g = 0; g < RG; ++g) {
        const __m512 pj = _mm512_set1_ps(p[g * ld + j] * inv[g]);
        acc[g][0] = _mm512_fmadd_ps(pj, v0, acc[g][0]);
        acc[g][1] = _mm512_fmadd_ps(pj, v1, acc[g][1]);
        acc[g][2] = _mm512_fmadd_ps(pj, v2, acc[g][2]);
        acc[g][3] = _mm512_fmadd_ps(pj, v3, acc[g][3]);
      }
    }
    for (int g = 0; g < RG; ++g)
      for (int u = 0; u < 4; ++u) _mm512_storeu_ps(o + g * od + e0 + 16 * u, acc[g][u]);
  }
}

// exp_shifted in 16 lanes: every lane the same operations, so the same values bit for bit.
__attribute__((target("avx512f"))) inline __m512 exp_shifted16(__m512 x, __m512 m) {
  const __mmask16 masked = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_EQ_OQ);
  __m512 t = _mm512_max_ps(_mm512_sub_ps(x, m), _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  t = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), t);
  t = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), t);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, t, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, t, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, t, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, t, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, t, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(t, t), t), _mm512_set1_ps(1.f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~masked), y, _mm512_castsi512_ps(e));
}

// score8_rows on AVX-512 for up to 6 rows (d a multiple of 8): keys t and t + 4 share a
// register (lanes 0-7 and 8-15), each row's q broadcast to both halves, so a key's lanes run the
// same fma chain as score8_rows' and the same reduce8 follows: out[g] is bit for bit its result,
// for half the fmas. Called only when `attention_avx512` turned it on.
template <typename T>
__attribute__((target("avx512f"))) inline __m512 pair16(const T* a, const T* b) {
  return _mm512_castpd_ps(
      _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(load8(a))), _mm256_castps_pd(load8(b)), 1));
}

template <int RG, typename T>
__attribute__((target("avx512f"))) void score8_rows512(const float* q, int64_t ld, const T* const* k, int64_t d,
                                                       __m256* out) {
  __m512 a[RG][4];
  for (int g = 0; g < RG; ++g)
    for (int t = 0; t < 4; ++t) a[g][t] = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) {
    const __m512 v0 = pair16(k[0] + i, k[4] + i), v1 = pair16(k[1] + i, k[5] + i);
    const __m512 v2 = pair16(k[2] + i, k[6] + i), v3 = pair16(k[3] + i, k[7] + i);
    for (int g = 0; g < RG; ++g) {
      const __m256d q8 = _mm256_castps_pd(_mm256_loadu_ps(q + g * ld + i));
      const __m512 qv = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(q8), q8, 1));
      a[g][0] = _mm512_fmadd_ps(qv, v0, a[g][0]);
      a[g][1] = _mm512_fmadd_ps(qv, v1, a[g][1]);
      a[g][2] = _mm512_fmadd_ps(qv, v2, a[g][2]);
      a[g][3] = _mm512_fmadd_ps(qv, v3, a[g][3]);
    }
  }
  for (int g = 0; g < RG; ++g) {
    __m256 acc[8];
    for (int t = 0; t < 4; ++t) {
      acc[t] = _mm512_castps512_ps256(a[g][t]);
      acc[t + 4] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[g][t]), 1));
    }
    out[g] = reduce8(acc);
  }
}

// A score row's softmax numerators in place, exp(s - mx) over [0, n) (n a multiple of 8), and
// their sum: 16 lanes at a time, the sum taken 8 lanes at a time in key order as the 8-lane
// loop does, so both the values and the sum are bit for bit that loop's.
__attribute__((target("avx512f"))) float exp_sum512(float* sr, int64_t n, float mx) {
  const __m512 vm = _mm512_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 e = exp_shifted16(_mm512_loadu_ps(sr + j), vm);
    _mm512_storeu_ps(sr + j, e);
    vsum = _mm256_add_ps(vsum, _mm512_castps512_ps256(e));
    vsum = _mm256_add_ps(vsum, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
  }
  if (j < n) {
    const __m256 e = exp_shifted(_mm256_loadu_ps(sr + j), _mm256_set1_ps(mx));
    _mm256_storeu_ps(sr + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  return hadd(vsum);
}

// The value pass of `attention_kernel` for rows [0, rn) over keys [0, n): 6 rows at a time on
// AVX-512 (d a multiple of 64), else 3 at a time on 8 lanes; the same result either way.
bool g_avx512 = false;  // set by `attention_avx512` (models.kernels decides by timing both)

// Whether the value pass over head size D runs on AVX-512 (weighted_sum_rows512, which takes the
// softmax weights unscaled with their 1/sum, `inv`) rather than on 8 lanes (weighted_sum_rows,
// which takes them scaled): the softmax asks this too, so both always agree.
inline bool wide_values(int64_t D) { return g_avx512 && D % 64 == 0; }

// Scores of gn query rows (q rows D apart) against 8 keys, D a multiple of 8: score8_rows (gn <= 3)
// or, `wide`, its AVX-512 twin (gn <= 6); the same scores bit for bit either way.
template <typename T>
void score_rows(int gn, bool wide, const float* q, const T* const* keys, int64_t D, __m256* sc) {
  if (wide) {
    switch (gn) {
      case 6: return score8_rows512<6, T>(q, D, keys, D, sc);
      case 5: return score8_rows512<5, T>(q, D, keys, D, sc);
      case 4: return score8_rows512<4, T>(q, D, keys, D, sc);
      case 3: return score8_rows512<3, T>(q, D, keys, D, sc);
      case 2: return score8_rows512<2, T>(q, D, keys, D, sc);
      default: return score8_rows512<1, T>(q, D, keys, D, sc);
    }
  }
  switch (gn) {
    case 3: return score8_rows<3, T>(q, D, keys, D, sc);
    case 2: return score8_rows<2, T>(q, D, keys, D, sc);
    default: return score8_rows<1, T>(q, D, keys, D, sc);
  }
}

template <typename T>
void weighted_sum_all(const float* s, int64_t Lp, int64_t rn, int64_t n, const float* inv, const T* vv,
                      int64_t vl, int64_t D, float* o) {
  if (wide_values(D)) {
    for (int64_t r = 0; r < rn; r += 6) {
      const float* sr = s + r * Lp;
      switch (std::min<int64_t>(6, rn - r)) {
        case 6: weighted_sum_rows512<6, T>(sr, Lp, n, inv + r, vv, vl, D, o + r * D, D); break;
        case 5: weighted_sum_rows512<5, T>(sr, Lp, n, inv + r, vv, vl, D, o + r * D, D); break;
        case 4: weighted_sum_rows512<4, T>(sr, Lp, n, inv + r, vv, vl, D, o + r * D, D); break;
        case 3: weighted_sum_rows512<3, T>(sr, Lp, n, inv + r, vv, vl, D, o + r * D, D); break;
        case 2: weighted_sum_rows512<2, T>(sr, Lp, n, inv + r, vv, vl, D, o + r * D, D); break;
        default: weighted_sum_rows512<1, T>(sr, Lp, n, inv + r, vv, vl, D, o + r * D, D);
      }
    }
    return;
  }
  for (int64_t r = 0; r < rn; r += 3) {
    const float* sr = s + r * Lp;
    switch (std::min<int64_t>(3, rn - r)) {
      case 3: weighted_sum_rows<3, T>(sr, Lp, n, vv, vl, D, o + r * D, D); break;
      case 2: weighted_sum_rows<2, T>(sr, Lp, n, vv, vl, D, o + r * D, D); break;
      default: weighted_sum_rows<1, T>(sr, Lp, n, vv, vl, D, o + r * D, D);
    }
  }
}

// The 8 mask bytes of keys [j0, j0 + jn) as one word (bool is one byte 0/1): 0 = none visible.
inline uint64_t mask_word(const bool* m, int64_t jn) {
  uint64_t w = 0;
  std::memcpy(&w, m, static_cast<size_t>(jn));
  return w;
}

inline void norm_row(const float* x, const float* w, float eps, int64_t d, float* y) {
  const float ss = dot(x, x, d);
  const float r = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
  for (int64_t i = 0; i < d; ++i) y[i] = x[i] * r * w[i];
}

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_f32(x, "x");
  check_f32(w, "w");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && x.size(1) == w.size(0), "x [M, d] and w [d]");
  const auto xc = x.contiguous();
  const auto wc = w.contiguous();
  const int64_t M = xc.size(0), d = xc.size(1);
  auto y = torch::empty_like(xc);
  const float *xp = xc.data_ptr<float>(), *wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t a, int64_t b) {
    for (int64_t m = a; m < b; ++m) norm_row(xp + m * d, wp, static_cast<float>(eps), d, yp + m * d);
  });
  return y;
}

std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& delta,
                                        const torch::Tensor& w, double eps) {
  check_f32(x, "x");
  check_f32(delta, "delta");
  check_f32(w, "w");
  TORCH_CHECK(x.sizes() == delta.sizes() && x.dim() == 2 && x.size(1) == w.size(0),
              "x and delta [M, d], w [d]");
  const auto xc = x.contiguous(), dc = delta.contiguous(), wc = w.contiguous();
  const int64_t M = xc.size(0), d = xc.size(1);
  auto s = torch::empty_like(xc);
  auto y = torch::empty_like(xc);
  const float *xp = xc.data_ptr<float>(), *dp = dc.data_ptr<float>(), *wp = wc.data_ptr<float>();
  float *sp = s.data_ptr<float>(), *yp = y.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t a, int64_t b) {
    for (int64_t m = a; m < b; ++m) {
      for (int64_t i = 0; i < d; ++i) sp[m * d + i] = xp[m * d + i] + dp[m * d + i];
      norm_row(sp + m * d, wp, static_cast<float>(eps), d, yp + m * d);
    }
  });
  return {s, y};
}

void rope_(torch::Tensor& qkv, const torch::Tensor& cs, int64_t num_heads) {
  check_f32(qkv, "qkv");
  check_f32(cs, "cs");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be [M, C] with unit column stride");
  TORCH_CHECK(cs.dim() == 3 && cs.size(0) == qkv.size(0) && cs.size(1) == 2, "cs must be [M, 2, D]");
  const auto cc = cs.contiguous();
  const int64_t M = qkv.size(0), D = cc.size(2), half = D / 2, ld = qkv.stride(0);
  TORCH_CHECK(D % 2 == 0 && num_heads * D <= qkv.size(1), "num_heads * D must fit in qkv's columns");
  float* p = qkv.data_ptr<float>();
  const float* c = cc.data_ptr<float>();
  at::parallel_for(0, M, 4, [&](int64_t a, int64_t b) {
    for (int64_t m = a; m < b; ++m) {
      const float* cosv = c + m * 2 * D;
      const float* sinv = cosv + D;
      for (int64_t h = 0; h < num_heads; ++h) {
        float* x = p + m * ld + h * D;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = x[i], x2 = x[i + half];
          x[i] = x1 * cosv[i] + x2 * sinv[i];
          x[i + half] = x2 * cosv[i + half] + x1 * sinv[i + half];
        }
      }
    }
  });
}

torch::Tensor silu_mul(const torch::Tensor& gu) {
  check_f32(gu, "gu");
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0, "gu must be [M, 2I]");
  const auto gc = gu.contiguous();
  const int64_t M = gc.size(0), I = gc.size(1) / 2;
  auto y = torch::empty({M, I}, gc.options());
  const float* g = gc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // rows split over threads; within a row 8 lanes at a time, the tail through a padded copy, so
  // every element goes through the same vector code wherever it lies
  at::parallel_for(0, M, 4, [&](int64_t a, int64_t b) {
    for (int64_t m = a; m < b; ++m) {
      const float *gr = g + m * 2 * I, *ur = gr + I;
      float* yr = yp + m * I;
      int64_t i = 0;
      for (; i + 8 <= I; i += 8) _mm256_storeu_ps(yr + i, silu_mul8(_mm256_loadu_ps(gr + i), _mm256_loadu_ps(ur + i)));
      if (i < I) {
        alignas(32) float zt[8] = {}, ut[8] = {}, yt[8];
        for (int64_t t = 0; t < I - i; ++t) zt[t] = gr[i + t], ut[t] = ur[i + t];
        _mm256_store_ps(yt, silu_mul8(_mm256_load_ps(zt), _mm256_load_ps(ut)));
        for (int64_t t = 0; t < I - i; ++t) yr[i + t] = yt[t];
      }
    }
  });
  return y;
}

// The attention kernel over keys and values of type T (float, or bf16 bits as uint16_t).
template <typename T>
void attention_kernel(const float* qp, const T* kp, const T* vp, float* op, const bool* mp, int64_t mb,
                      const int64_t* sp, int64_t B, int64_t Hk, int64_t R, int64_t D, int64_t L, int64_t kb,
                      int64_t kh, int64_t kl, int64_t vb, int64_t vh, int64_t vl, int64_t tokN,
                      const int64_t* qst) {
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  // Where row r of (batch row bi, KV head h) lives: q and o contiguous [B, Hk, R, D], or
  // token-major [B, tokN, Hk * G, D] with r = g * tokN + n (tokN > 0, G = R / tokN; q read
  // through its strides qst[0..2], o contiguous)
  const auto row_at = [&](int64_t bi, int64_t h, int64_t r, const int64_t* st) -> int64_t {
    if (tokN == 0) return ((bi * Hk + h) * R + r) * D;
    const int64_t G = R / tokN, g = r / tokN, n = r % tokN;
    return bi * st[0] + n * st[1] + (h * G + g) * st[2];
  };
  const int64_t ost[3] = {R * Hk * D, R / std::max<int64_t>(tokN, 1) * Hk * D, D};  // [B, tokN, H, D]
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t Lp = (L + 7) / 8 * 8;        // score rows padded to whole vectors (-inf)
  // Query rows per task (at most RMAX): each (batch row, KV head)'s rows are split into the
  // `chunks` tasks that load the busiest thread least, a task costing its rows plus READ_ROWS
  // rows' worth for reading its keys and values (the fewest chunks among equals). A row's
  // result never depends on the split.
  constexpr int64_t RMAX = 16, READ_ROWS = 4;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const auto load = [&](int64_t c) { return (B * Hk * c + threads - 1) / threads * ((R + c - 1) / c + READ_ROWS); };
  const int64_t fewest = (R + RMAX - 1) / RMAX;
  int64_t chunks = fewest;
  for (int64_t c = fewest + 1; c <= std::min<int64_t>(R, 4 * fewest); ++c)
    if (load(c) < load(chunks)) chunks = c;
  const int64_t RC = (R + chunks - 1) / chunks;
  chunks = (R + RC - 1) / RC;  // no task left without rows (e.g. 9 rows as 4 x 3)
  at::parallel_for(0, B * Hk * chunks, 1, [&](int64_t a, int64_t b) {
    std::vector<float> s(RC * Lp);
    std::vector<float> qs(RC * D);
    std::vector<float> ob(tokN ? RC * D : 0);  // a token-major task's rows before they go out
    std::vector<T> zero_key(D, T{});
    for (int64_t task = a; task < b; ++task) {
      const int64_t bh = task / chunks, r0 = (task % chunks) * RC, rn = std::min(RC, R - r0);
      const int64_t bi = bh / Hk, h = bh % Hk;
      const int64_t si = sp ? sp[bi] : bi;  // the cache slot this batch row reads
      const T* kk = kp + si * kb + h * kh;
      const T* vv = vp + si * vb + h * vh;
      const bool* mm = mp ? mp + bi * mb + r0 * L : nullptr;
      for (int64_t r = 0; r < rn; ++r) {
        const float* qq = qp + row_at(bi, h, r0 + r, qst);
        for (int64_t i = 0; i < D; ++i) qs[r * D + i] = qq[i] * scale;
      }
      // Rows of this chunk with one mask row (a decode step's G query heads; no mask) share
      // their zero weights: their values are summed together (weighted_sum_rows).
      bool shared = D % 32 == 0;
      for (int64_t r = 1; shared && mm && r < rn; ++r) shared = std::memcmp(mm, mm + r * L, L) == 0;
      // 1. scores, 8 keys at a time (keys past L read a zero key); a block of keys none of these
      //    rows may see is skipped (never read). Every score comes from score8, whatever its
      //    neighbours, so a row's scores do not depend on the other rows of the chunk.
      int64_t last = -1;  // last key any of these rows sees
      // the next task's keys and values (a batch row's K/V live far apart in the cache): asked
      // for now, block by block beside this task's, so they arrive while this one computes
      const bool ahead = task + 1 < b && (task + 1) / chunks != bh;
      const int64_t nbh = bh + 1, nbi = nbh / Hk, nh = nbh % Hk, nsi = !ahead ? 0 : sp ? sp[nbi] : nbi;
      const char* nk = reinterpret_cast<const char*>(kp + nsi * kb + nh * kh);
      const char* nv = reinterpret_cast<const char*>(vp + nsi * vb + nh * vh);
      const bool* nm = mp ? mp + nbi * mb : nullptr;
      const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
      // keys [0, open) every row of the chunk sees (a verify block's committed prefix, a decode
      // step's whole span): their blocks skip the mask words
      int64_t open = L;
      for (int64_t r = 0; mm && r < rn && open > 0; ++r) {
        const void* hole = std::memchr(mm + r * L, 0, static_cast<size_t>(open));
        if (hole != nullptr) open = static_cast<const bool*>(hole) - (mm + r * L);
      }
      for (int64_t j0 = 0; j0 < L; j0 += 8) {
        const int64_t jn = std::min<int64_t>(8, L - j0);
        if (ahead && (!nm || mask_word(nm + j0, jn) != 0)) {
          for (int64_t t = 0; t < jn; ++t)
            for (int64_t c = 0; c < row_bytes; c += 64) {
              _mm_prefetch(nk + (j0 + t) * kl * static_cast<int64_t>(sizeof(T)) + c, _MM_HINT_T1);
              _mm_prefetch(nv + (j0 + t) * vl * static_cast<int64_t>(sizeof(T)) + c, _MM_HINT_T1);
            }
        }
        const uint64_t full = jn == 8 ? 0x0101010101010101ull : (1ull << (8 * jn)) / 255;
        const T* keys[8];
        for (int64_t t = 0; t < 8; ++t) keys[t] = t < jn ? kk + (j0 + t) * kl : zero_key.data();
        if (j0 + 8 <= open && D % 8 == 0) {  // the general path below gives the same scores
          const int64_t step = g_avx512 ? 6 : 3;
          for (int64_t rg = 0; rg < rn; rg += step) {
            __m256 sc[6];
            const int gn = static_cast<int>(std::min<int64_t>(step, rn - rg));
            score_rows<T>(gn, g_avx512, qs.data() + rg * D, keys, D, sc);
            for (int g = 0; g < gn; ++g) _mm256_storeu_ps(s.data() + (rg + g) * Lp + j0, sc[g]);
          }
          last = j0 + 7;
          continue;
        }
        // rows three at a time (a decode step's G query heads), each key loaded once for them
        for (int64_t rg = 0; rg < rn; rg += 3) {
          const int gn = static_cast<int>(std::min<int64_t>(3, rn - rg));
          uint64_t w[3];
          bool any = false;
          for (int g = 0; g < gn; ++g) {
            w[g] = mm ? mask_word(mm + (rg + g) * L + j0, jn) : full;
            any = any || w[g] != 0;
          }
          __m256 sc[3];
          if (any && D % 8 == 0) {
            score_rows<T>(gn, false, qs.data() + rg * D, keys, D, sc);
          } else if (any) {
            for (int g = 0; g < gn; ++g) sc[g] = score8(qs.data() + (rg + g) * D, keys, D);
          }
          for (int g = 0; g < gn; ++g) {
            const int64_t r = rg + g;
            float* sr = s.data() + r * Lp + j0;
            const bool* mr = mm ? mm + r * L + j0 : nullptr;
            if (w[g] == 0) {
              for (int64_t t = 0; t < 8; ++t) sr[t] = ninf;
              continue;
            }
            _mm256_storeu_ps(sr, sc[g]);
            if (w[g] == full) {
              for (int64_t t = jn; t < 8; ++t) sr[t] = ninf;
              last = std::max(last, j0 + jn - 1);
              continue;
            }
            for (int64_t t = 0; t < 8; ++t)
              if (t >= jn || !mr[t]) {
                sr[t] = ninf;
              } else {
                last = std::max(last, j0 + t);
              }
          }
        }
      }
      const int64_t jend = (last + 8) / 8 * 8;  // whole vectors past the last key: -inf
      for (int64_t r = 0; r < rn; ++r)
        for (int64_t j = last + 1; j < jend; ++j) s[r * Lp + j] = ninf;
      // 2. softmax per row (masked scores give exactly 0), then 3. the weighted sum of values
      float* o = tokN ? ob.data() : op + (bh * R + r0) * D;
      const auto put = [&] {  // token-major: each row to its place
        for (int64_t r = 0; tokN && r < rn; ++r) std::memcpy(op + row_at(bi, h, r0 + r, ost), o + r * D, D * sizeof(float));
      };
      float inv[RMAX];
      bool sees[RMAX];
      for (int64_t r = 0; r < rn; ++r) {
        float* sr = s.data() + r * Lp;
        float* orow = o + r * D;
        for (int64_t e = 0; e < D; ++e) orow[e] = 0.f;
        sees[r] = false;
        if (last < 0) continue;
        __m256 vmax = _mm256_set1_ps(ninf);
        for (int64_t j = 0; j < jend; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(sr + j));
        const float mx = hmax(vmax);
        if (mx == ninf) continue;  // a row that sees nothing: zeros (padding rows only)
        if (wide_values(D)) {  // unscaled, with inv: the AVX-512 value pass
          inv[r] = 1.f / exp_sum512(sr, jend, mx);
          sees[r] = true;
          continue;
        }
        const __m256 vm = _mm256_set1_ps(mx);
        __m256 vsum = _mm256_setzero_ps();
        for (int64_t j = 0; j < jend; j += 8) {
          const __m256 e = exp_shifted(_mm256_loadu_ps(sr + j), vm);
          _mm256_storeu_ps(sr + j, e);
          vsum = _mm256_add_ps(vsum, e);
        }
        // the weights scaled here once (p * inv, the product the value pass would form for every
        // 32 outputs); the value pass then multiplies by inv = 1, which leaves them as they are
        const float iv = 1.f / hadd(vsum);
        const __m256 vi = _mm256_set1_ps(iv);
        for (int64_t j = 0; j < jend; j += 8) _mm256_storeu_ps(sr + j, _mm256_mul_ps(_mm256_loadu_ps(sr + j), vi));
        inv[r] = 1.f;
        sees[r] = true;
      }
      if (last < 0) {
        put();
        continue;
      }
      // Keys [0, common) are seen by every row of the chunk (all of them when the rows share
      // their mask row; a verify block's committed prefix otherwise): their values are summed for
      // the rows together, then each row goes on alone over the keys only some rows see.
      int64_t common = 0;
      if (shared) {
        common = sees[0] ? last + 1 : 0;
      } else if (D % 32 == 0) {
        common = last + 1;
        for (int64_t r = 0; r < rn && common > 0; ++r) {
          if (!sees[r]) {  // a row that sees nothing keeps its zeros
            common = 0;
            break;
          }
          const void* hole = std::memchr(mm + r * L, 0, static_cast<size_t>(common));
          if (hole != nullptr) common = static_cast<const bool*>(hole) - (mm + r * L);
        }
      }
      if (common > 0) weighted_sum_all<T>(s.data(), Lp, rn, common, inv, vv, vl, D, o);
      if (!shared)
        for (int64_t r = 0; r < rn; ++r)
          if (sees[r]) weighted_sum(s.data() + r * Lp, common, last + 1, inv[r], vv, vl, D, o + r * D);
      put();
    }
  });
}

namespace {

// attention and attention_tokens: q [B, Hk, R, D] (tokN 0) or [B, tokN, H, D] (R = tokN * H / Hk)
torch::Tensor attention_impl(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const c10::optional<torch::Tensor>& mask, const c10::optional<torch::Tensor>& slots,
                             int64_t tokN) {
  check_f32(q, "q");
  TORCH_CHECK((k.scalar_type() == torch::kFloat32 || k.scalar_type() == torch::kBFloat16) &&
                  v.scalar_type() == k.scalar_type() && k.device().is_cpu() && v.device().is_cpu(),
              "k and v must be float32 or bfloat16 (both alike) on the CPU");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be 4-D");
  const int64_t B = q.size(0), Hk = tokN ? k.size(1) : q.size(1), D = q.size(3), L = k.size(2);
  TORCH_CHECK(tokN == 0 || (q.size(1) == tokN && q.size(2) % Hk == 0), "q must be [B, N, H, D], H a multiple of Hk");
  const int64_t R = tokN ? tokN * (q.size(2) / Hk) : q.size(2);
  const bool by_slot = slots.has_value() && slots->defined();
  TORCH_CHECK((by_slot || k.size(0) == B) && k.size(1) == Hk && k.size(3) == D && v.sizes() == k.sizes(),
              "k and v must be [B, Hk, L, D] (or [S, Hk, L, D] read by slots) like q [B, Hk, R, D]");
  torch::Tensor sc;
  const int64_t* sp = nullptr;
  if (by_slot) {
    TORCH_CHECK(slots->scalar_type() == torch::kInt64 && slots->dim() == 1 && slots->size(0) == B &&
                    slots->device().is_cpu(),
                "slots must be int64 [B] on the CPU");
    sc = slots->contiguous();
    sp = sc.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(sp[b] >= 0 && sp[b] < k.size(0), "slots[", b, "] = ", sp[b], " is outside k's ", k.size(0),
                  " slots");
  }
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "k and v need a contiguous last dimension");
  const auto qc = tokN ? q : q.contiguous();  // token-major q is read through its strides
  TORCH_CHECK(qc.stride(3) == 1, "q needs a contiguous last dimension");
  const int64_t qst[3] = {qc.stride(0), qc.stride(1), qc.stride(2)};
  const bool* mp = nullptr;
  int64_t mb = 0;
  torch::Tensor mc;
  if (mask.has_value() && mask->defined()) {
    TORCH_CHECK(mask->scalar_type() == torch::kBool && mask->dim() == 4 && mask->size(1) == 1 &&
                    mask->size(2) == R && mask->size(3) == L &&
                    (mask->size(0) == B || mask->size(0) == 1),
                "mask must be bool [B or 1, 1, R, L]");
    mc = mask->contiguous();
    mp = mc.data_ptr<bool>();
    mb = mc.size(0) == 1 ? 0 : R * L;
  }
  auto out = torch::empty(qc.sizes(), qc.options().memory_format(at::MemoryFormat::Contiguous));
  const float* qp = qc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t kb = k.stride(0), kh = k.stride(1), kl = k.stride(2);
  const int64_t vb = v.stride(0), vh = v.stride(1), vl = v.stride(2);
  if (k.scalar_type() == torch::kFloat32) {
    attention_kernel<float>(qp, k.data_ptr<float>(), v.data_ptr<float>(), op, mp, mb, sp, B, Hk, R, D, L, kb,
                            kh, kl, vb, vh, vl, tokN, qst);
  } else {
    const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
    const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
    attention_kernel<uint16_t>(qp, kp, vp, op, mp, mb, sp, B, Hk, R, D, L, kb, kh, kl, vb, vh, vl, tokN, qst);
  }
  return out;
}

}  // namespace

torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const c10::optional<torch::Tensor>& mask, const c10::optional<torch::Tensor>& slots) {
  return attention_impl(q, k, v, mask, slots, 0);
}

torch::Tensor attention_tokens(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const c10::optional<torch::Tensor>& mask) {
  TORCH_CHECK(q.dim() == 4, "q must be [B, N, H, D]");
  return attention_impl(q, k, v, mask, c10::nullopt, q.size(1));
}

// An optional [V] bool mask of ids to skip as a pointer (nullptr when absent); `keep` holds the
// contiguous copy for as long as the pointer is read. Shared with layer.cpp's eagle_chain.
const bool* off_mask(const c10::optional<torch::Tensor>& off, int64_t V, torch::Tensor& keep) {
  if (!off.has_value() || !off->defined()) return nullptr;
  keep = off->contiguous();
  TORCH_CHECK(keep.scalar_type() == torch::kBool && keep.numel() == V, "off must be [V] bool");
  return keep.data_ptr<bool>();
}

// The first index of the largest x[v] over the v not `off` (torch.argmax's choice, NaN largest);
// 0 when every v is off. Shared with layer.cpp's eagle_chain.
int64_t first_argmax(const float* x, int64_t V, const bool* off) {
  if (off == nullptr) {  // 8 lanes at a time: the maximum (any NaN noted), then its first index
    __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    __m256 nan = _mm256_setzero_ps();
    int64_t v = 0;
    for (; v + 8 <= V; v += 8) {
      const __m256 xv = _mm256_loadu_ps(x + v);
      vmax = _mm256_max_ps(vmax, xv);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(xv, xv, _CMP_UNORD_Q));
    }
    float mx = hmax(vmax);
    bool any_nan = _mm256_movemask_ps(nan) != 0;
    for (int64_t t = v; t < V; ++t) {
      any_nan = any_nan || std::isnan(x[t]);
      mx = std::max(mx, x[t]);
    }
    if (any_nan) {  // torch.argmax takes the first NaN
      for (int64_t t = 0; t < V; ++t)
        if (std::isnan(x[t])) return t;
    }
    const __m256 vm = _mm256_set1_ps(mx);
    for (v = 0; v + 8 <= V; v += 8) {
      const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + v), vm, _CMP_EQ_OQ));
      if (hit != 0) return v + __builtin_ctz(static_cast<unsigned>(hit));
    }
    for (; v < V; ++v)
      if (x[v] == mx) return v;
    return 0;
  }
  int64_t arg = -1;
  float best = 0.f;
  for (int64_t v = 0; v < V; ++v) {
    if (off && off[v]) continue;
    if (arg < 0 || x[v] > best || (std::isnan(x[v]) && !std::isnan(best))) best = x[v], arg = v;
  }
  return std::max<int64_t>(arg, 0);
}

// Temperature sampling of one row (shared with layer.cpp's eagle_chain_sampled), as
// sampling.process_logits + sampling.sample do it: q = softmax((x - max) / T) over the ids not
// `off` (written to q, off ids 0), then the first id whose cumulative mass exceeds u * total,
// total being the cumulative sum's end and the target kept strictly below it (an id of positive
// mass). The cumulative sum runs in double in id order and each running total is rounded to
// fp32, as torch.cumsum does on the CPU, and the id is found by binary search over those totals
// (torch.searchsorted, right=True); so the ids match torch's path up to the rounding of q's
// exponentials (exp_shifted's polynomial, 8 lanes at a time: ~2 ulp) and of the normalising sum
// (double, 8 lanes). One sequential pass over V: the max, exponentials, sum and scaling run in
// lanes.
int64_t sample_row(const float* x, int64_t V, const bool* off, float T, float u, float* q) {
  thread_local std::vector<float> totals;  // the running totals (torch.cumsum's output)
  if (static_cast<int64_t>(totals.size()) < V) totals.resize(V);
  float* cdf = totals.data();
  const float ninf = -std::numeric_limits<float>::infinity();
  // lanes of an off mask: 8 bools -> all-ones where off
  const auto off8 = [&](int64_t v) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(off + v)));
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(b, _mm256_setzero_si256()));
  };
  __m256 vmx = _mm256_set1_ps(ninf);
  int64_t v = 0;
  for (; v + 8 <= V; v += 8) {  // max_ps(x, m) keeps m where x is NaN, as `x > mx` skips it
    __m256 xv = _mm256_loadu_ps(x + v);
    if (off) xv = _mm256_blendv_ps(xv, _mm256_set1_ps(ninf), off8(v));
    vmx = _mm256_max_ps(xv, vmx);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmx);
  float mx = ninf;
  for (int i = 0; i < 8; ++i) mx = std::max(mx, lanes[i]);
  for (; v < V; ++v)
    if (!(off && off[v]) && x[v] > mx) mx = x[v];
  const __m256 vm = _mm256_set1_ps(mx), vt = _mm256_set1_ps(T), zero = _mm256_setzero_ps();
  __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
  for (v = 0; v + 8 <= V; v += 8) {
    __m256 e = exp_shifted(_mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(x + v), vm), vt), zero);
    if (off) e = _mm256_andnot_ps(off8(v), e);
    _mm256_storeu_ps(q + v, e);
    s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  alignas(32) double d[4];
  _mm256_store_pd(d, _mm256_add_pd(s0, s1));
  double sum = (d[0] + d[1]) + (d[2] + d[3]);
  for (; v < V; ++v) {
    q[v] = off && off[v] ? 0.f : std::exp((x[v] - mx) / T);
    sum += q[v];
  }
  const float inv = static_cast<float>(1.0 / sum);
  const __m256 vinv = _mm256_set1_ps(inv);
  for (v = 0; v + 8 <= V; v += 8) _mm256_storeu_ps(q + v, _mm256_mul_ps(_mm256_loadu_ps(q + v), vinv));
  for (; v < V; ++v) q[v] *= inv;
  double acc = 0.0;
  for (int64_t i = 0; i < V; ++i) cdf[i] = static_cast<float>(acc += q[i]);
  const float total = cdf[V - 1];
  const float target = std::min(u * total, std::nextafter(total, 0.f));
  // the first total above the target: it rose there, so that id has positive mass
  const int64_t id = std::upper_bound(cdf, cdf + V, target) - cdf;
  return std::min(id, V - 1);
}

// The Markov chain of markov_argmax (uni null: x_k the argmax) and markov_sample (x_k drawn with
// uni[i, k] at temperature temp, its distribution written to q).
template <typename T>
void markov_chain(const char* op, const float* u, const T* table, int64_t R, const int64_t* prev, const bool* off,
                  int64_t n, int64_t K, int64_t V, const float* uni, float temp, int64_t* ids, float* q) {
  std::vector<float> sums(V);
  for (int64_t i = 0; i < n; ++i) {
    int64_t p = prev[i];
    for (int64_t k = 0; k < K; ++k) {
      TORCH_CHECK(p >= 0 && p < R, op, ": previous id ", p, " outside the table's ", R, " rows");
      const int64_t at = i * K + k;
      const float* ur = u + at * V;
      const T* row = table + p * V;
      for (int64_t v = 0; v < V; ++v) sums[v] = ur[v] + to_f(row[v]);
      ids[at] = p = uni ? sample_row(sums.data(), V, off, temp, uni[at], q + at * V)
                        : first_argmax(sums.data(), V, off);
    }
  }
}

// Checks and dispatch of both ops: ids [n, K], and q [n, K, V] when `uniforms` is given.
std::tuple<torch::Tensor, torch::Tensor> markov_impl(const char* op, const torch::Tensor& u, const torch::Tensor& table,
                                                     const torch::Tensor& prev,
                                                     const c10::optional<torch::Tensor>& off,
                                                     const torch::Tensor* uniforms, double temperature) {
  check_f32(u, "u");
  TORCH_CHECK(u.dim() == 3 && table.dim() == 2 && table.size(1) == u.size(2), "u [n, K, V], table [R, V]");
  TORCH_CHECK(prev.dim() == 1 && prev.size(0) == u.size(0) && prev.scalar_type() == torch::kInt64,
              "prev must be [n] int64");
  const auto uc = u.contiguous(), tc = table.contiguous(), pc = prev.contiguous();
  const int64_t n = uc.size(0), K = uc.size(1), V = uc.size(2), R = tc.size(0);
  torch::Tensor oc, wc, q;
  const bool* offp = off_mask(off, V, oc);
  const float* uni = nullptr;
  float* qp = nullptr;
  if (uniforms) {
    check_f32(*uniforms, "uniforms");
    TORCH_CHECK(uniforms->dim() == 2 && uniforms->size(0) == n && uniforms->size(1) == K,
                "uniforms must be [n, K]");
    TORCH_CHECK(temperature > 0, "temperature must be > 0 (greedy chains: markov_argmax)");
    wc = uniforms->contiguous();
    uni = wc.data_ptr<float>();
    q = torch::empty({n, K, V}, uc.options());  // every row written by sample_row
    qp = q.data_ptr<float>();
  }
  auto ids = torch::empty({n, K}, pc.options());
  const float t = static_cast<float>(temperature);
  if (tc.scalar_type() == torch::kFloat32) {
    markov_chain<float>(op, uc.data_ptr<float>(), tc.data_ptr<float>(), R, pc.data_ptr<int64_t>(), offp, n, K, V,
                        uni, t, ids.data_ptr<int64_t>(), qp);
  } else {
    TORCH_CHECK(tc.scalar_type() == torch::kBFloat16, "table must be float32 or bfloat16");
    markov_chain<uint16_t>(op, uc.data_ptr<float>(), reinterpret_cast<const uint16_t*>(tc.data_ptr<at::BFloat16>()),
                           R, pc.data_ptr<int64_t>(), offp, n, K, V, uni, t, ids.data_ptr<int64_t>(), qp);
  }
  return {ids, q};
}

// One row of markov_topk: s into `s` (off ids -inf), then the top k by insertion (k is small).
template <typename T>
void topk_row(const float* u, const T* row, const bool* off, int64_t V, int64_t k, float* s, float* vals,
              int64_t* ids) {
  constexpr float NEG = -std::numeric_limits<float>::infinity();
  __m256 vmax = _mm256_set1_ps(NEG);
  for (int64_t v = 0; v < V; ++v) s[v] = (off && off[v]) ? NEG : u[v] + to_f(row[v]);
  int64_t v = 0;
  for (; v + 8 <= V; v += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + v));
  float mx = hmax(vmax);
  for (int64_t t = v; t < V; ++t) mx = std::max(mx, s[t]);
  const __m256 vm = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  for (v = 0; v + 8 <= V; v += 8) acc = _mm256_add_ps(acc, exp_shifted(_mm256_loadu_ps(s + v), vm));
  double sum = hadd(acc);
  for (int64_t t = v; t < V; ++t) sum += std::exp(s[t] - mx);
  const float lse = mx + static_cast<float>(std::log(sum));
  int64_t n = 0;  // vals[0..n) descending; a later v enters only above an equal value's place
  for (v = 0; v < V; ++v) {
    const float x = s[v];
    if (x == NEG || (n == k && !(x > vals[n - 1]))) continue;
    int64_t at = n < k ? n++ : k - 1;
    while (at > 0 && x > vals[at - 1]) {
      vals[at] = vals[at - 1];
      ids[at] = ids[at - 1];
      --at;
    }
    vals[at] = x;
    ids[at] = v;
  }
  for (int64_t j = 0; j < n; ++j) vals[j] -= lse;
  for (int64_t j = n; j < k; ++j) vals[j] = NEG, ids[j] = 0;
}

std::tuple<torch::Tensor, torch::Tensor> markov_topk(const torch::Tensor& u, const torch::Tensor& table, int64_t prev,
                                                     const c10::optional<torch::Tensor>& off, int64_t k) {
  check_f32(u, "u");
  TORCH_CHECK(u.dim() == 1 && table.dim() == 2 && table.size(1) == u.size(0), "u [V], table [R, V]");
  const int64_t V = u.size(0), R = table.size(0);
  TORCH_CHECK(prev >= 0 && prev < R, "markov_topk: previous id ", prev, " outside the table's ", R, " rows");
  TORCH_CHECK(k >= 1 && k <= V, "markov_topk: k must be in [1, V]");
  const auto uc = u.contiguous(), tc = table.contiguous();
  torch::Tensor oc;
  const bool* offp = off_mask(off, V, oc);
  auto vals = torch::empty({k}, uc.options());
  auto ids = torch::empty({k}, uc.options().dtype(torch::kInt64));
  thread_local std::vector<float> s;
  s.resize(V);
  if (tc.scalar_type() == torch::kFloat32) {
    topk_row<float>(uc.data_ptr<float>(), tc.data_ptr<float>() + prev * V, offp, V, k, s.data(),
                    vals.data_ptr<float>(), ids.data_ptr<int64_t>());
  } else {
    TORCH_CHECK(tc.scalar_type() == torch::kBFloat16, "table must be float32 or bfloat16");
    topk_row<uint16_t>(uc.data_ptr<float>(), reinterpret_cast<const uint16_t*>(tc.data_ptr<at::BFloat16>()) + prev * V,
                       offp, V, k, s.data(), vals.data_ptr<float>(), ids.data_ptr<int64_t>());
  }
  return {vals, ids};
}

torch::Tensor markov_argmax(const torch::Tensor& u, const torch::Tensor& table, const torch::Tensor& prev,
                            const c10::optional<torch::Tensor>& off) {
  return std::get<0>(markov_impl("markov_argmax", u, table, prev, off, nullptr, 1.0));
}

std::tuple<torch::Tensor, torch::Tensor> markov_sample(const torch::Tensor& u, const torch::Tensor& table,
                                                       const torch::Tensor& prev,
                                                       const c10::optional<torch::Tensor>& off,
                                                       const torch::Tensor& uniforms, double temperature) {
  return markov_impl("markov_sample", u, table, prev, off, &uniforms, temperature);
}

// attention_avx512(on): use the AVX-512 value pass from now on (on = True, where the CPU runs
// AVX-512F) or the 8-lane one; returns whether it is in use. Results are the same either way.
bool attention_avx512(bool on) {
  g_avx512 = on && __builtin_cpu_supports("avx512f");
  return g_avx512;
}

TORCH_LIBRARY_FRAGMENT(specdecode, m) {
  m.def("attention_avx512(bool on) -> bool", &attention_avx512);
  m.def("markov_argmax(Tensor u, Tensor table, Tensor prev, Tensor? off) -> Tensor");
  m.def("markov_sample(Tensor u, Tensor table, Tensor prev, Tensor? off, Tensor uniforms, float temperature) "
        "-> (Tensor, Tensor)");
  m.def("markov_topk(Tensor u, Tensor table, int prev, Tensor? off, int k) -> (Tensor, Tensor)");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor w, float eps) -> Tensor[]");
  m.def("rope_(Tensor(a!) qkv, Tensor cs, int num_heads) -> ()");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? slots=None) -> Tensor");
  m.def("attention_tokens(Tensor q, Tensor k, Tensor v, Tensor? mask) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdecode, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_", &rope_);
  m.impl("silu_mul", &silu_mul);
  m.impl("attention", &attention);
  m.impl("attention_tokens", &attention_tokens);
  m.impl("markov_argmax", &markov_argmax);
  m.impl("markov_sample", &markov_sample);
  m.impl("markov_topk", &markov_topk);
}
