// Shared by our product kernels (bf16w.cpp, and through bf16_pairs.h amx.cpp and bf16dp.cpp).
#pragma once

#include <torch/extension.h>

namespace specdecode_kernels {

// A product's optional bias [N] as fp32 values, or nullptr; `keep` holds the converted tensor
// for as long as the pointer is read.
inline const float* bias_f32(const c10::optional<torch::Tensor>& bias, int64_t N, torch::Tensor& keep) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  keep = bias->to(torch::kFloat32).contiguous();
  TORCH_CHECK(keep.numel() == N, "bias must have N entries");
  return keep.data_ptr<float>();
}

}  // namespace specdecode_kernels
