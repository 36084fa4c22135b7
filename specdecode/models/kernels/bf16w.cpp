// bf16-weight, fp32-activation matrix product for few rows (one-token steps, verify blocks).
//
// y[M, N] = x[M, K] @ w[N, K]^T (+ b[N]); x, y, b fp32; w bf16 (raw uint16 bits), repacked once.
// At small M a product is bound by reading w: bf16 halves the bytes of fp32, and widening a
// bf16 to fp32 is a 16-bit shift (an unpack against zero), so the product reads half the bytes
// and still multiplies and accumulates in fp32. AVX2 + FMA: the Python side compiles this only
// for CPUs that have them, and uses it only where the format measurement finds it fastest.
//
// Layout: w is repacked into blocks of 16 output rows, transposed: P[blk][k][16]. A step of k
// reads 16 consecutive bf16 (one per output), widens them into two fp32 vectors and multiplies
// them by x[m, k] broadcast, for up to 6 rows of x at once: 2 FMAs per row per 16 weights and no
// horizontal sums, so more rows cost FMAs, not passes over memory. Each thread owns a range of
// blocks and sweeps it a few blocks at a time, each sweep against every row (6 at a time, the
// blocks still in cache for the next 6): every byte is read from memory once per call.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "products.h"

namespace {

constexpr int64_t PB = 16;  // output rows per packed block
constexpr int64_t PF = 96;     // prefetch distance, steps of k (3 KiB; 32 left 4-row passes waiting)
constexpr int64_t SWEEP = 6;  // blocks per sweep over the rows (a multiple of prange's NB 1-2):
                              // 6 x 16 x K bf16, 288 KiB at K = 1536, stay in a core's L2

// A run of sweeps [front, back) shared by its owner, which takes from the front, and the other
// threads, which take from the back once their own runs are done: both ends in one atomic word.
struct alignas(64) SweepRun {  // a cache line each: the owners' updates must not collide
  std::atomic<uint64_t> fb{0};  // front in the low 32 bits, back in the high 32
  void reset(int64_t front, int64_t back) { fb.store(static_cast<uint64_t>(back) << 32 | static_cast<uint64_t>(front)); }
  int64_t take(bool front) {  // the sweep taken, or -1 when the run is empty
    uint64_t cur = fb.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t f = cur & 0xffffffffu, b = cur >> 32;
      if (f >= b) return -1;
      const uint64_t next = front ? (b << 32 | (f + 1)) : ((b - 1) << 32 | f);
      if (fb.compare_exchange_weak(cur, next, std::memory_order_relaxed)) return static_cast<int64_t>(front ? f : b - 1);
    }
  }
  int64_t take_front() { return take(true); }
  int64_t take_back() { return take(false); }
};

template <int MT, int NB>
inline void ptile(const float* x, int64_t K, const uint16_t* p, float* out) {
  // out: [MT][NB * PB], the outputs of NB consecutive blocks in natural order. Every loop over
  // rows and blocks is unrolled: otherwise gcc keeps `acc` in memory and stores all of it on
  // every step of k (8 stores per 8 FMAs at 4 rows), which bounded the kernel, not the FMAs.
  __m256 acc[MT][2 * NB];
  _Pragma("GCC unroll 16") for (int m = 0; m < MT; ++m)
    _Pragma("GCC unroll 16") for (int j = 0; j < 2 * NB; ++j) acc[m][j] = _mm256_setzero_ps();
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t k = 0; k < K; ++k) {
    __m256 wv[2 * NB];
    _Pragma("GCC unroll 16") for (int b = 0; b < NB; ++b) {
      const uint16_t* src = p + b * K * PB + k * PB;
      // PF steps ahead in the order the blocks are read: past this block's end, the same
      // block of the next NB (the stream that will read it), not the next block (read already).
      // Passes of 4+ rows are FMA-bound: they reach 4x farther, into L2 (8 rows ~0.9x the time)
      constexpr int64_t PFM = MT >= 4 ? 4 * PF : PF;
      const int64_t ahead = k + PFM < K ? PFM : (NB - 1) * K + PFM;
      _mm_prefetch(reinterpret_cast<const char*>(src + ahead * PB), MT >= 4 ? _MM_HINT_T1 : _MM_HINT_T0);
      const __m256i wr = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
      wv[2 * b] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, wr));      // outputs 0-3, 8-11
      wv[2 * b + 1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, wr));  // outputs 4-7, 12-15
    }
    _Pragma("GCC unroll 16") for (int m = 0; m < MT; ++m) {
      const __m256 xb = _mm256_broadcast_ss(x + m * K + k);
      _Pragma("GCC unroll 16") for (int j = 0; j < 2 * NB; ++j) acc[m][j] = _mm256_fmadd_ps(xb, wv[j], acc[m][j]);
    }
  }
  _Pragma("GCC unroll 16") for (int m = 0; m < MT; ++m)
    _Pragma("GCC unroll 16") for (int b = 0; b < NB; ++b) {
      const __m256 lo = acc[m][2 * b], hi = acc[m][2 * b + 1];
      float* o = out + m * NB * PB + b * PB;
      _mm256_storeu_ps(o, _mm256_permute2f128_ps(lo, hi, 0x20));      // outputs 0-7
      _mm256_storeu_ps(o + 8, _mm256_permute2f128_ps(lo, hi, 0x31));  // outputs 8-15
    }
}

template <int MT, int NB>
inline void pblocks(const float* x, int64_t K, const uint16_t* P, const float* bias, float* y,
                    int64_t N, int64_t blk) {
  float out[MT * NB * PB];
  ptile<MT, NB>(x, K, P + blk * K * PB, out);
  for (int m = 0; m < MT; ++m)
    for (int64_t c = 0; c < NB * PB; ++c) {
      const int64_t n = blk * PB + c;
      if (n < N) y[m * N + n] = out[m * NB * PB + c] + (bias ? bias[n] : 0.f);
    }
}

// Rows m0..m0+MT of x against blocks [b0, b1), NB blocks at a time.
template <int MT, int NB>
inline void prange(const float* x, int64_t K, const uint16_t* P, const float* bias, float* y,
                   int64_t N, int64_t b0, int64_t b1) {
  int64_t b = b0;
  for (; b + NB <= b1; b += NB) pblocks<MT, NB>(x, K, P, bias, y, N, b);
  for (; b < b1; ++b) pblocks<MT, 1>(x, K, P, bias, y, N, b);
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
                  P.size(2) == PB && P.size(0) * PB >= N && P.size(1) == x.size(1),
              "P must come from bf16w_pack for this K and N");
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), nb = P.size(0);
  auto y = torch::empty({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const uint16_t* pp = reinterpret_cast<const uint16_t*>(P.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  torch::Tensor bc;
  const float* bp = specdecode_kernels::bias_f32(bias, N, bc);
  // The rows against blocks [c0, c1): SWEEP blocks at a time against every row, so a block comes
  // from memory once per call and from L1/L2 for the next rows.
  const auto sweep = [&](int64_t c0, int64_t c1) {
    int64_t m = 0;
    // 6 rows: 12 accumulators + 2 weight vectors + a broadcast fill AVX2's 16 registers;
    // more would spill and cost more than a second pass over blocks still in L1/L2
    for (; m + 6 <= M; m += 6) prange<6, 1>(xp + m * K, K, pp, bp, yp + m * N, N, c0, c1);
    const float* xr = xp + m * K;
    float* yr = yp + m * N;
    switch (M - m) {
      case 5: prange<5, 1>(xr, K, pp, bp, yr, N, c0, c1); break;
      case 4: prange<4, 1>(xr, K, pp, bp, yr, N, c0, c1); break;
      case 3: prange<3, 1>(xr, K, pp, bp, yr, N, c0, c1); break;
      case 2: prange<2, 2>(xr, K, pp, bp, yr, N, c0, c1); break;
      case 1: prange<1, 2>(xr, K, pp, bp, yr, N, c0, c1); break;  // 2 streams beat 1 and 3
      default: break;
    }
  };
  // One row is bound by memory, which both cores share: each thread takes an equal run of blocks
  // (a sweep of its own over them in turn). With 2+ rows each thread owns an equal run of sweeps
  // and takes them from its front, streaming its own contiguous memory as the fixed split does,
  // and a thread done with its own takes the last sweeps left in another's run: the two cores of
  // a shared machine often run at different speeds for seconds at a time (on a 2-core Zen 3 one
  // thread's share of an 8-row product took 1.35x the other's), and with a fixed split the faster
  // one would wait. (For one row the shared runs cost ~1 % of a forward: the fixed split stays.)
  // Every block's outputs are computed the same way whichever thread takes it.
  if (M == 1) {
    at::parallel_for(0, nb, 4, [&](int64_t b0, int64_t b1) {
      for (int64_t c0 = b0; c0 < b1; c0 += SWEEP) sweep(c0, std::min(b1, c0 + SWEEP));
    });
    return y;
  }
  const int64_t chunks = (nb + SWEEP - 1) / SWEEP;
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), chunks));
  std::vector<SweepRun> runs(nt);
  for (int64_t t = 0; t < nt; ++t) runs[t].reset(chunks * t / nt, chunks * (t + 1) / nt);
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int64_t c;
      while ((c = runs[t].take_front()) >= 0) sweep(c * SWEEP, std::min(nb, (c + 1) * SWEEP));
      for (int64_t o = 1; o < nt; ++o)
        while ((c = runs[(t + o) % nt].take_back()) >= 0) sweep(c * SWEEP, std::min(nb, (c + 1) * SWEEP));
    }
  });
  return y;
}

// A dispatcher op (torch.ops.specdecode.bf16w_linear), so profilers and torch.compile see a
// named product rather than an opaque Python call.
TORCH_LIBRARY_FRAGMENT(specdecode, m) {
  m.def("bf16w_pack(Tensor w) -> Tensor");
  m.def("bf16w_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdecode, CPU, m) {
  m.impl("bf16w_pack", &pack);
  m.impl("bf16w_linear", &packed_linear);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
