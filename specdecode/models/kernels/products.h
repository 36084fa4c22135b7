// Shared by our product kernels (bf16w.cpp, bf16dp.cpp, and through bf16_pairs.h amx.cpp): the
// bias as fp32, and the split of a product's output blocks between threads (`split_sweeps`).
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace specdecode_kernels {

// A product's optional bias [N] as fp32 values, or nullptr; `keep` holds the converted tensor
// for as long as the pointer is read.
inline const float* bias_f32(const c10::optional<torch::Tensor>& bias, int64_t N, torch::Tensor& keep) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  keep = bias->to(torch::kFloat32).contiguous();
  TORCH_CHECK(keep.numel() == N, "bias must have N entries");
  return keep.data_ptr<float>();
}

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
};

// Calls sweep(c0, c1) over blocks [0, nb) in sweeps of `per` blocks, on the threads of torch's
// pool. One row (`fixed`) is bound by memory, which the cores share: each thread takes an equal
// run of blocks. With more rows each thread owns an equal run of sweeps and takes them from its
// front, streaming its own contiguous memory as a fixed split does, and a thread done with its
// own takes the last sweeps left in another's run: the two cores of a shared machine often run
// at different speeds for seconds at a time (on a 2-core Zen 3 one thread's share of an 8-row
// product took 1.35x the other's), and with a fixed split the faster one would wait (for one row
// the shared runs cost ~1 % of a forward: the fixed split stays). Each block's outputs must not
// depend on the thread that computes them (the caller's sweep sees to it).
template <class F>
void split_sweeps(int64_t nb, int64_t per, bool fixed, const F& sweep) {
  if (fixed) {
    at::parallel_for(0, nb, 4, [&](int64_t b0, int64_t b1) {
      for (int64_t c0 = b0; c0 < b1; c0 += per) sweep(c0, std::min(b1, c0 + per));
    });
    return;
  }
  const int64_t chunks = (nb + per - 1) / per;
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), chunks));
  std::vector<SweepRun> runs(nt);
  for (int64_t t = 0; t < nt; ++t) runs[t].reset(chunks * t / nt, chunks * (t + 1) / nt);
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int64_t c;
      while ((c = runs[t].take(true)) >= 0) sweep(c * per, std::min(nb, (c + 1) * per));
      for (int64_t o = 1; o < nt; ++o)
        while ((c = runs[(t + o) % nt].take(false)) >= 0) sweep(c * per, std::min(nb, (c + 1) * per));
    }
  });
}

}  // namespace specdecode_kernels
