// bf16 matrix product on Intel AMX tiles, for few to many rows (one-token steps, verify blocks,
// batched decoding).
//
// y[M, N] = bf16(x)[M, K] @ w[N, K]^T (+ b[N]); x, y, b fp32; w bf16, repacked once. Activations
// are rounded to bf16 (nearest even) on the way in, products accumulate in fp32 in the tiles.
// A tile multiply (TDPBF16PS) does 16 x 16 x 32 multiply-adds at once, so up to 16 rows cost
// what one row costs: the product is bound by reading w (bf16: half the bytes of fp32) until M
// is in the dozens. Each output row depends only on its own input row, whatever M is.
//
// Layout: w is repacked into blocks of 16 outputs x 32 inputs in the tiles' pair-interleaved
// ("VNNI") order, 1 KiB a block, one tile load each; 2 blocks of outputs make a group, and a
// group's blocks are interleaved by input block: P[group][kb][2][16 input pairs][16 outputs][2]
// (outputs padded with zeros to groups of 32). Each thread owns a range of groups and reads its
// weights as one sequential stream (2 accumulator tiles, the activation tile shared by both),
// rows of x in chunks of 16; two full chunks at a time share each weight tile (4 accumulators).
//
// AMX needs the kernel's permission per process (arch_prctl ARCH_REQ_XCOMP_PERM); where it is
// refused (no AMX, an old kernel) `bf16amx_pack` raises and the format is simply absent. The
// AMX code is compiled for its own target, so the rest of the extension runs on AVX2-only CPUs.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <torch/extension.h>
#include <unistd.h>

#include "bf16_pairs.h"

#include <cstdint>
#include <cstring>

namespace {

using specdecode_kernels::pack_pairs;
using specdecode_kernels::pairs_call;

constexpr int64_t TN = 16;  // outputs per block (tile columns of C, 16 fp32)
constexpr int64_t TK = 32;  // inputs per block (tile row of A: 32 bf16 = 64 bytes)
constexpr int64_t TM = 16;  // rows of x per tile
constexpr int NB = 2;       // output blocks per pass (accumulator tiles)
constexpr int64_t PF = 8;   // prefetch distance, in input blocks

bool amx_permitted() {
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0-1 accumulators C[rows][16 fp32], 2-3 activations A[rows][32 bf16], 4-7 weights B.
__attribute__((target("amx-tile,amx-bf16"))) void configure(int rows, int rows2 = 16) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  for (int t : {0, 1, 2, 3}) cfg.rows[t] = static_cast<uint8_t>(rows);
  // tile_pass2's second chunk: its activation tile 3 and accumulators 6, 7
  if (rows2 < 16) cfg.rows[3] = cfg.rows[6] = cfg.rows[7] = static_cast<uint8_t>(rows2);
  // gcc's _tile_loadconfig tells the compiler it reads 8 bytes only: without this barrier the
  // stores to the rest of cfg can be dropped (and ldtilecfg faults on garbage)
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// Rows [m0, m0 + rows) against the NB = 2 output blocks of group g: C into out[2][rows][16].
// A group's blocks lie interleaved by kb, so the pass reads one sequential stream of weights,
// prefetched PF input blocks ahead into L1 (T0: SmolLM2's T(1)-T(8) 2-5 % faster than into L2,
// T(16) 1-2 % slower: benchmarks/results/runtime-smollm2-135m-amx-l1-prefetch); two input
// blocks per iteration use separate tiles (A: 2, 3; B: 4-7), so no load waits for the
// multiply before it to release its tile.
__attribute__((target("amx-tile,amx-bf16"))) void tile_pass(const uint16_t* xa, int64_t Kp,
                                                             const uint16_t* P, int64_t kb_n,
                                                             int64_t g, float* out) {
  constexpr int64_t BLK = TK * TN;  // bf16 per packed block (1 KiB)
  constexpr int64_t STEP = NB * BLK;
  const uint16_t* p = P + g * kb_n * STEP;
  _tile_zero(0);
  _tile_zero(1);
  int64_t kb = 0;
  for (; kb + 2 <= kb_n; kb += 2, p += 2 * STEP) {
    for (int l = 0; l < 2 * STEP * 2; l += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p + PF * STEP) + l, _MM_HINT_T0);
    _tile_loadd(2, xa + kb * TK, Kp * 2);
    _tile_loadd(4, p, 64);
    _tile_loadd(5, p + BLK, 64);
    _tile_loadd(3, xa + (kb + 1) * TK, Kp * 2);
    _tile_loadd(6, p + STEP, 64);
    _tile_loadd(7, p + STEP + BLK, 64);
    _tile_dpbf16ps(0, 2, 4);
    _tile_dpbf16ps(1, 2, 5);
    _tile_dpbf16ps(0, 3, 6);
    _tile_dpbf16ps(1, 3, 7);
  }
  if (kb < kb_n) {
    _tile_loadd(2, xa + kb * TK, Kp * 2);
    _tile_loadd(4, p, 64);
    _tile_loadd(5, p + BLK, 64);
    _tile_dpbf16ps(0, 2, 4);
    _tile_dpbf16ps(1, 2, 5);
  }
  _tile_stored(0, out, 64);
  _tile_stored(1, out + TM * TN, 64);
}

// Rows [m0, m0 + 16 + r2) (a full chunk of 16, then one of r2 <= 16 rows: 17 verified rows cost
// little more than 16) against the NB = 2 output blocks of group g, four accumulators at once
// (configure(16, r2)): each input block loads 2 activation tiles (2, 3) and 2 weight tiles (4, 5)
// for 4 multiplies, half the loads per multiply of tile_pass, and the
// weights are read once for both chunks. Every accumulator adds the input blocks in the same
// order as tile_pass, so each output element is bit for bit what tile_pass gives.
// C into out[2 chunks][2 blocks][16][16].
__attribute__((target("amx-tile,amx-bf16"))) void tile_pass2(const uint16_t* xa, int64_t Kp,
                                                              const uint16_t* P, int64_t kb_n,
                                                              int64_t g, float* out) {
  constexpr int64_t BLK = TK * TN;
  constexpr int64_t STEP = NB * BLK;
  const uint16_t* p = P + g * kb_n * STEP;
  const uint16_t* xb = xa + TM * Kp;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t kb = 0; kb < kb_n; ++kb, p += STEP) {
    for (int l = 0; l < STEP * 2; l += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p + PF * STEP) + l, _MM_HINT_T0);
    _tile_loadd(2, xa + kb * TK, Kp * 2);
    _tile_loadd(4, p, 64);
    _tile_loadd(5, p + BLK, 64);
    _tile_loadd(3, xb + kb * TK, Kp * 2);
    _tile_dpbf16ps(0, 2, 4);
    _tile_dpbf16ps(1, 2, 5);
    _tile_dpbf16ps(6, 3, 4);
    _tile_dpbf16ps(7, 3, 5);
  }
  _tile_stored(0, out, 64);
  _tile_stored(1, out + TM * TN, 64);
  _tile_stored(6, out + 2 * TM * TN, 64);
  _tile_stored(7, out + 3 * TM * TN, 64);
}

__attribute__((target("amx-tile"))) void release() { _tile_release(); }


}  // namespace

torch::Tensor amx_pack(const torch::Tensor& w) {
  TORCH_CHECK(amx_permitted(), "AMX tiles are not available to this process (no AMX, or the OS refused)");
  return pack_pairs(w);
}

torch::Tensor amx_linear(const torch::Tensor& x, const torch::Tensor& P, int64_t N,
                         const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(amx_permitted(), "AMX tiles are not available to this process");
  const auto call = pairs_call(x, P, N, bias, "bf16amx_pack");  // checks x and P, rounds x to bf16
  const int64_t M = call.M, groups = call.groups, kb_n = call.kb_n, Kp = call.Kp;
  const uint16_t *xab = call.xa, *pp = call.P;
  const float* bp = call.bias;
  float* yp = call.out;
  // groups of NB blocks are the unit of work; a thread takes a contiguous range of them
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    alignas(64) float out[2 * NB * TM * TN];
    int configured = -1;
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b = g * NB;
      // every chunk of rows against this group while its weights are still in L2: chunks two
      // at a time (tile_pass2; the second may be partial), a last lone chunk alone
      for (int64_t m0 = 0; m0 < M;) {
        const bool pair = m0 + TM < M;
        const int rows = static_cast<int>(std::min<int64_t>(TM, M - m0));
        const int rows2 = pair ? static_cast<int>(std::min<int64_t>(TM, M - m0 - TM)) : 16;
        const int key = rows * 32 + rows2;
        if (key != configured) {
          configure(rows, rows2);
          configured = key;
        }
        if (pair)
          tile_pass2(xab + m0 * Kp, Kp, pp, kb_n, g, out);
        else
          tile_pass(xab + m0 * Kp, Kp, pp, kb_n, g, out);
        const int64_t chunks = pair ? 2 : 1;
        for (int64_t c = 0; c < chunks; ++c, m0 += TM) {
          const int cr = c == 0 ? rows : rows2;
          for (int64_t j = 0; j < NB && (b + j) * TN < N; ++j)
            for (int r = 0; r < cr; ++r) {
              const float* src = out + (c * NB + j) * TM * TN + r * TN;
              float* dst = yp + (m0 + r) * N + (b + j) * TN;
              const int64_t cols = std::min<int64_t>(TN, N - (b + j) * TN);
              if (bp)
                for (int64_t k = 0; k < cols; ++k) dst[k] = src[k] + bp[(b + j) * TN + k];
              else
                std::memcpy(dst, src, cols * sizeof(float));
            }
        }
      }
    }
    if (configured >= 0) release();
  });
  return call.y;
}

TORCH_LIBRARY_FRAGMENT(specdecode, m) {
  m.def("bf16amx_pack(Tensor w) -> Tensor");
  m.def("bf16amx_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdecode, CPU, m) {
  m.impl("bf16amx_pack", &amx_pack);
  m.impl("bf16amx_linear", &amx_linear);
}
