// One decoder layer of the native runtime in one call, for the common decode case: one-token
// steps and verify blocks of requests on a contiguous range of slots with equal lengths.
//
// decode_layer(x [T, d], ln1 [d], qkv, o, ln2 [d], gu, down, cs [T, 2, D], k_dst, v_dst
//              [B, N, Hk, D] (where the new keys/values go), k_src, v_src [B, Hk, span, D]
//              (what attention reads), mask [B|1, 1, G*N, span] | None, eps, H, Hk, D,
//              qkv_in [T, in] | None, q_norm [D] | None, k_norm [D] | None) -> [T, d]
// where each projection is (kind, packed, n, bias | None): kind 0 `bf16w_linear`, 1
// `bf16amx_linear`, 2 `bf16dp_linear`, 3 `int8w_linear`, 4 `bf16dp1_linear` on the packed weight of
// n outputs.
// `qkv_in` replaces rms_norm(x, ln1) as the QKV product's input (EAGLE-3's layer reads
// [norm(embedding) ; norm(features)] and keeps the features as its residual stream x); ln1 is
// then not read.
// `q_norm` / `k_norm` (both or neither): per-head RMSNorm weights applied to every head of q and
// of k before RoPE (the drafters' Qwen3-style layer, as their `FusedRMSNorm` modules do it).
//
// decode_layers(x [T, d], w, n, qkv_b, cs, dst [2, L, B, N, Hk, D], src [2, L, B, Hk, span, D],
//               mask, eps, H, Hk, D, capture) -> [x after layer L - 1, then x after each layer
// of `capture` in its order]: decode_layer for layers 0..L-1 in turn, layer i's products and norms
// w[6i..6i+6) = (ln1, qkv packed, o packed, ln2, gu packed, down packed), n[8i..8i+8) = (qkv kind, n,
// o kind, n, gu kind, n, down kind, n), qkv_b[i] its QKV bias, its cache views dst[0][i], dst[1][i]
// (new keys, values) and src[0][i], src[1][i] (what attention reads), and with qk_norms (empty, or
// 2L tensors) layer i's per-head q/k norms qk_norms[2i], qk_norms[2i + 1]. The same calls in the same
// order as one decode_layer call a layer (the Python loop over layers), so the same result bit for
// bit; what goes is that loop's interpreter and dispatcher time and its per-layer views.
// context_rows(feats [N, F], fc, ctx_norm_w, ctx_eps, kv, k_norms, eps, cs [N, 2, D], dst
//              [2, L, B, N, Hk, D], L, Hk, D): a DFlash/DSpark catch-up: ctx = rms(fc(feats),
// ctx_norm_w), kv = the product of every layer's keys then values [N, 2 L Hk D], each layer's keys
// normed per head by k_norms[i] (when given), RoPE on the keys, written to dst[0][i] / dst[1][i]
// (DFlashDrafter's fuse and _context_kv: the same functions in the same order, the same values).
// head_rows(states [n, K, d], head, off, uniforms [n, K] | None, temperature) -> (ids [n, K], q): the
// head product, then each row's first argmax over the ids not `off` (q [0]), or with uniforms its
// draw at the temperature (sample_row, q [n, K, Vd] the rows' distributions): a DFlash round's drafts.
// markov_draft(states [n, K, d], head, table [R, Vd], prev [n], off, conf_w [d], conf_row [R],
//              temp, bias, uniforms [n, K] | None, temperature) -> (ids [n, K], conf [n, K], q): a
// DSpark round after its backbone: U = head(states), markov_argmax's chain over U from prev (q
// [0]), or with uniforms markov_sample's at the temperature (q [n, K, Vd]), and the confidence of slot k,
// sigmoid((states[:, k] . conf_w + conf_row[x_{k-1}]) / temp[k] + bias[k]) (its own rounding of
// the dot product: the drafts are the Python loop's, the confidences equal to rounding).
// eagle_chain(state [1, d], K, head, ...) -> [K] draft ids: EAGLE-3's greedy chain of one request
// (head product, argmax over the ids not `off`, embed, decode_layer), and
// eagle_chain_sampled(..., uniforms [K], temperature) -> ([K] ids, q [K, Vd]): draft j drawn from
// q_j = softmax((logits - max) / T) by inverse CDF with uniforms[j] (sampling.sample's rule).
//
// mtp_module(h_prev [N, d], emb [N, d], hnorm_w, enorm_w, proj, ln1, ... decode_layer's products,
//            cs, k, v [1, Hk, R, D], base, ...) -> [N, d]: an MTP module's block over N new rows at
// cache rows base.. (causal among them): x = proj([rms(h_prev, hnorm_w) ; rms(emb, enorm_w)]), then
// decode_layer(x, ln1, ...) (MTPModule.inp, then the block: the Python modules' functions in order).
// head_draft(state [1, d], norm_w, eps, head, off, u, temperature) -> (id [1], q [1, Vd] | [0, Vd]):
// one draft from one state: the first argmax over the ids not `off` of head(rms(state, norm_w))
// (temperature 0), else drawn at the temperature with uniform u by sample_row, q its distribution
// (eagle_chain's draft step, for drafters whose rounds are not one chain).
//
// It is `NativeDecoder._layer_fused` (norm, QKV product, RoPE, cache write, attention with the G
// query heads of a KV head folded into the rows, output product, add + norm, gate/up product,
// SiLU-mul, down product, residual add) calling the same functions in the same order, so its
// result is bit for bit the Python path's; what goes is ~15 Python-level operators a layer
// (their interpreter and dispatcher time: a one-token SmolLM2 forward took 9.7 ms op by op and
// 8.2 ms in one call a layer on a 2-core Zen 5 EPYC, benchmarks/results/runtime-*-epyc-avx512).

#include <torch/extension.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

// The kernels of the other translation units (bf16w.cpp: bf16w and int8w, amx.cpp, bf16dp.cpp, fused.cpp).
torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& P, int64_t N,
                            const c10::optional<torch::Tensor>& bias);
torch::Tensor amx_linear(const torch::Tensor& x, const torch::Tensor& P, int64_t N,
                         const c10::optional<torch::Tensor>& bias);
torch::Tensor dp_linear(const torch::Tensor& x, const torch::Tensor& P, int64_t N,
                        const c10::optional<torch::Tensor>& bias);
torch::Tensor int8w_linear(const torch::Tensor& x, const torch::Tensor& P, int64_t N,
                           const c10::optional<torch::Tensor>& bias);
torch::Tensor dp1_linear(const torch::Tensor& x, const torch::Tensor& P, int64_t N,
                         const c10::optional<torch::Tensor>& bias);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);
std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& delta,
                                        const torch::Tensor& w, double eps);
void rope_(torch::Tensor& qkv, const torch::Tensor& cs, int64_t num_heads);
torch::Tensor silu_mul(const torch::Tensor& gu);
torch::Tensor attention_tokens(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const c10::optional<torch::Tensor>& mask);
int64_t first_argmax(const float* x, int64_t V, const bool* off);
torch::Tensor markov_argmax(const torch::Tensor& u, const torch::Tensor& table, const torch::Tensor& prev,
                            const c10::optional<torch::Tensor>& off);
std::tuple<torch::Tensor, torch::Tensor> markov_sample(const torch::Tensor& u, const torch::Tensor& table,
                                                       const torch::Tensor& prev,
                                                       const c10::optional<torch::Tensor>& off,
                                                       const torch::Tensor& uniforms, double temperature);
int64_t sample_row(const float* x, int64_t V, const bool* off, float T, float u, float* q);
const bool* off_mask(const c10::optional<torch::Tensor>& off, int64_t V, torch::Tensor& keep);

namespace {

torch::Tensor product(int64_t kind, const torch::Tensor& x, const torch::Tensor& P, int64_t n,
                      const c10::optional<torch::Tensor>& bias) {
  switch (kind) {
    case 0: return packed_linear(x, P, n, bias);
    case 1: return amx_linear(x, P, n, bias);
    case 2: return dp_linear(x, P, n, bias);
    case 3: return int8w_linear(x, P, n, bias);
    case 4: return dp1_linear(x, P, n, bias);
    default: TORCH_CHECK(false, "unknown product kind ", kind);
  }
}

// dst [B, N, Hk, D] (any strides; fp32, or bf16 rounded to nearest even as copy_ rounds) <- the
// Hk * D columns of qkv [T, C] (T = B * N rows, fp32, unit column stride) from column c0 on: the
// cache write of new keys or values, without a TensorIterator's set-up per call.
void write_rows(const torch::Tensor& qkv, int64_t c0, torch::Tensor& dst) {
  TORCH_CHECK(qkv.scalar_type() == torch::kFloat32 && qkv.stride(1) == 1, "qkv must be fp32 with unit column stride");
  const int64_t B = dst.size(0), N = dst.size(1), Hk = dst.size(2), D = dst.size(3), ld = qkv.stride(0);
  const float* src = qkv.data_ptr<float>() + c0;
  const bool bf16 = dst.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16 || dst.scalar_type() == torch::kFloat32, "the cache must be fp32 or bf16");
  const auto st = dst.strides();
  char* base = static_cast<char*>(dst.data_ptr());
  const int64_t es = dst.element_size();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < Hk; ++h) {
        const float* x = src + (b * N + n) * ld + h * D;
        char* row = base + (b * st[0] + n * st[1] + h * st[2]) * es;
        if (bf16) {
          auto* o = reinterpret_cast<c10::BFloat16*>(row);
          for (int64_t e = 0; e < D; ++e) o[e * st[3]] = c10::BFloat16(x[e]);
        } else if (st[3] == 1) {
          std::memcpy(row, x, D * sizeof(float));
        } else {
          auto* o = reinterpret_cast<float*>(row);
          for (int64_t e = 0; e < D; ++e) o[e * st[3]] = x[e];
        }
      }
}

// y += x, both [T, d] fp32 contiguous (the layer's residual add, in place on the down product's
// fresh output).
void add_into(torch::Tensor& y, const torch::Tensor& x) {
  TORCH_CHECK(y.is_contiguous() && x.is_contiguous() && y.sizes() == x.sizes(), "y and x must be contiguous, same shape");
  float* yp = y.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const int64_t n = y.numel();
  for (int64_t i = 0; i < n; ++i) yp[i] += xp[i];
}

}  // namespace

// These ops serve inference only (the runtime and the drafters call them under no_grad; training
// runs the Python modules): each sets AutoDispatchBelowADInplaceOrView, so the ATen ops it calls
// inside (views of the cache, copies, adds, allocations) skip autograd's and view tracking's
// dispatch layers, which cost ~2 % of a one-token SmolLM2 forward on a 2-core Zen 3. The same
// kernels run either way: results are bit for bit the same.
torch::Tensor decode_layer(const torch::Tensor& x, const torch::Tensor& ln1, int64_t qkv_kind,
                           const torch::Tensor& qkv_p, int64_t qkv_n, const c10::optional<torch::Tensor>& qkv_b,
                           int64_t o_kind, const torch::Tensor& o_p, int64_t o_n, const torch::Tensor& ln2,
                           int64_t gu_kind, const torch::Tensor& gu_p, int64_t gu_n, int64_t down_kind,
                           const torch::Tensor& down_p, int64_t down_n, const torch::Tensor& cs,
                           torch::Tensor k_dst, torch::Tensor v_dst, const torch::Tensor& k_src,
                           const torch::Tensor& v_src, const c10::optional<torch::Tensor>& mask, double eps,
                           int64_t H, int64_t Hk, int64_t D, const c10::optional<torch::Tensor>& qkv_in,
                           const c10::optional<torch::Tensor>& q_norm, const c10::optional<torch::Tensor>& k_norm) {
  const at::AutoDispatchBelowADInplaceOrView below_autograd;  // see the note above `decode_layer`
  TORCH_CHECK(x.dim() == 2 && k_dst.dim() == 4, "x must be [T, d] and k_dst [B, N, Hk, D]");
  const int64_t T = x.size(0), B = k_dst.size(0), N = k_dst.size(1);
  TORCH_CHECK(B * N == T && k_dst.size(2) == Hk && k_dst.size(3) == D, "k_dst must be [B, N, Hk, D] with B * N = T");
  const c10::optional<torch::Tensor> none;
  // 1. attention input: norm, fused QKV product, RoPE on q and k in place
  const auto h = qkv_in.has_value() && qkv_in->defined() ? *qkv_in : rms_norm(x, ln1, eps);
  auto qkv = product(qkv_kind, h, qkv_p, qkv_n, qkv_b);  // [T, (H + 2Hk) D]
  if (q_norm.has_value() && q_norm->defined()) {  // per-head norms of q and k, then RoPE
    TORCH_CHECK(k_norm.has_value() && k_norm->defined(), "q_norm needs k_norm");
    auto qs = qkv.narrow(1, 0, H * D), ks = qkv.narrow(1, H * D, Hk * D);
    qs.copy_(rms_norm(qs.reshape({T * H, D}), *q_norm, eps).view({T, H * D}));
    ks.copy_(rms_norm(ks.reshape({T * Hk, D}), *k_norm, eps).view({T, Hk * D}));
  }
  rope_(qkv, cs, H + Hk);
  const auto q = qkv.narrow(1, 0, H * D).view({B, N, H, D});
  // 2. cache write, then attention over the span with the G heads of a KV head as rows
  write_rows(qkv, H * D, k_dst);
  write_rows(qkv, (H + Hk) * D, v_dst);
  // the G query heads of a KV head and the N tokens are its rows g * N + n, read where they lie
  const auto o = attention_tokens(q, k_src, v_src, mask).view({B * N, H * D});
  // 3. output product, residual add and the MLP's norm in one pass; SiLU MLP with fused gate/up
  const auto xh = add_rms_norm(x, product(o_kind, o, o_p, o_n, none), ln2, eps);
  auto y = product(down_kind, silu_mul(product(gu_kind, xh[1], gu_p, gu_n, none)), down_p, down_n, none);
  add_into(y, xh[0]);  // the residual: y + x is x + y bit for bit
  return y;
}

std::vector<torch::Tensor> decode_layers(const torch::Tensor& x, at::TensorList w, at::IntArrayRef n,
                                         const c10::List<c10::optional<torch::Tensor>>& qkv_b,
                                         const torch::Tensor& cs, const torch::Tensor& dst, const torch::Tensor& src,
                                         const c10::optional<torch::Tensor>& mask, double eps, int64_t H, int64_t Hk,
                                         int64_t D, at::IntArrayRef capture, at::TensorList qk_norms) {
  const int64_t L = static_cast<int64_t>(qkv_b.size());
  TORCH_CHECK(qk_norms.empty() || static_cast<int64_t>(qk_norms.size()) == 2 * L,
              "qk_norms must be empty or hold (q_norm, k_norm) per layer");
  TORCH_CHECK(static_cast<int64_t>(w.size()) == 6 * L && static_cast<int64_t>(n.size()) == 8 * L,
              "w must hold 6 tensors and n 8 ints per layer (qkv_b one entry per layer)");
  TORCH_CHECK(dst.dim() == 6 && src.dim() == 6 && dst.size(0) == 2 && src.size(0) == 2 && dst.size(1) == L &&
                  src.size(1) == L,
              "dst must be [2, L, B, N, Hk, D] and src [2, L, B, Hk, span, D] for the L layers");
  for (const int64_t c : capture) TORCH_CHECK(0 <= c && c < L, "capture holds layers 0..", L - 1, ", got ", c);
  const at::AutoDispatchBelowADInplaceOrView below_autograd;  // see the note above `decode_layer`
  const c10::optional<torch::Tensor> none;
  std::vector<torch::Tensor> out(1 + capture.size());
  torch::Tensor h = x;
  for (int64_t i = 0; i < L; ++i) {
    const torch::Tensor* wi = w.data() + 6 * i;
    const int64_t* ni = n.data() + 8 * i;
    const c10::optional<torch::Tensor> qn = qk_norms.empty() ? none : c10::optional<torch::Tensor>(qk_norms[2 * i]);
    const c10::optional<torch::Tensor> kn = qk_norms.empty() ? none : c10::optional<torch::Tensor>(qk_norms[2 * i + 1]);
    h = decode_layer(h, wi[0], ni[0], wi[1], ni[1], qkv_b.get(i), ni[2], wi[2], ni[3], wi[3], ni[4], wi[4], ni[5],
                     ni[6], wi[5], ni[7], cs, dst[0][i], dst[1][i], src[0][i], src[1][i], mask, eps, H, Hk, D, none,
                     qn, kn);
    for (size_t c = 0; c < capture.size(); ++c)
      if (capture[c] == i) out[1 + c] = h;
  }
  out[0] = h;
  return out;
}

// EAGLE-3's greedy chain for one request: K draft ids of the draft vocabulary, x_j the first
// argmax (over the ids not `off`) of head(norm(s_j)); s_0 = state, and for j < K - 1
// s_{j+1} = decode_layer(s_j, qkv_in = [rms(embed[d2t[x_j]], in_w) ; rms(s_j, hid_w)]) at cache row
// base + j with the cs row j (RoPE of position base + j + 1), reading rows 0..base + j of k/v
// [1, Hk, R, D]. The drafter's Python loop (EagleDrafter.propose) calls the same functions in the
// same order, so the ids are the same; what goes is its ~30 operators per draft token.
namespace {

// One draft from one state s [1, d]: the first argmax over the ids not `off` of head(rms(s, norm_w))
// when `u` is null, else drawn at temperature T with uniform *u and its distribution written to q [Vd].
int64_t draft_of(const torch::Tensor& s, const torch::Tensor& norm_w, double eps, int64_t head_kind,
                 const torch::Tensor& head_p, int64_t head_n, const bool* off, const float* u, float T, float* q) {
  const c10::optional<torch::Tensor> none;
  const auto logits = product(head_kind, rms_norm(s, norm_w, eps), head_p, head_n, none).contiguous();  // [1, Vd]
  const float* lp = logits.data_ptr<float>();
  return u ? sample_row(lp, head_n, off, T, *u, q) : first_argmax(lp, head_n, off);
}

// The chain of `eagle_chain` / `eagle_chain_sampled`: greedy when `u` is null, else draft j is
// sampled at temperature T with uniform u[j] and its distribution written to row j of q [K, Vd].
torch::Tensor chain_impl(const torch::Tensor& state, int64_t K, int64_t head_kind, const torch::Tensor& head_p,
                         int64_t head_n, const torch::Tensor& norm_w, const c10::optional<torch::Tensor>& off,
                         const torch::Tensor& d2t, const torch::Tensor& embed, const torch::Tensor& in_w,
                         const torch::Tensor& hid_w, int64_t qkv_kind, const torch::Tensor& qkv_p, int64_t qkv_n,
                         const c10::optional<torch::Tensor>& qkv_b, int64_t o_kind, const torch::Tensor& o_p,
                         int64_t o_n, const torch::Tensor& ln2, int64_t gu_kind, const torch::Tensor& gu_p,
                         int64_t gu_n, int64_t down_kind, const torch::Tensor& down_p, int64_t down_n,
                         const torch::Tensor& cs, torch::Tensor& k, torch::Tensor& v, int64_t base, double eps,
                         int64_t H, int64_t Hk, int64_t D, const c10::optional<torch::Tensor>& q_norm,
                         const c10::optional<torch::Tensor>& k_norm, const float* u, float T, float* q) {
  const at::AutoDispatchBelowADInplaceOrView below_autograd;  // see the note above `decode_layer`
  TORCH_CHECK(state.dim() == 2 && state.size(0) == 1 && state.scalar_type() == torch::kFloat32,
              "state must be [1, d] float32");
  TORCH_CHECK(k.dim() == 4 && k.size(0) == 1 && base >= 0 && base + K <= k.size(2) + 1, "k must be [1, Hk, R, D] with room");
  TORCH_CHECK(cs.dim() == 3 && cs.size(0) >= K - 1, "cs must hold a row per draft but the last");
  TORCH_CHECK(d2t.scalar_type() == torch::kInt64 && d2t.numel() == head_n, "d2t must be [Vd] int64");
  const c10::optional<torch::Tensor> none;
  torch::Tensor offc;
  const bool* offp = off_mask(off, head_n, offc);
  const auto d2tc = d2t.contiguous();
  auto ids = torch::empty({K}, torch::kInt64);
  int64_t* idp = ids.data_ptr<int64_t>();
  auto s = state.contiguous();
  for (int64_t j = 0; j < K; ++j) {
    const int64_t xd = draft_of(s, norm_w, eps, head_kind, head_p, head_n, offp, u ? u + j : nullptr, T,
                                q ? q + j * head_n : nullptr);
    idp[j] = xd;
    if (j + 1 == K) break;
    const auto emb = embed.narrow(0, d2tc.data_ptr<int64_t>()[xd], 1).to(torch::kFloat32);  // [1, d]
    const auto qkv_in = torch::cat({rms_norm(emb, in_w, eps), rms_norm(s, hid_w, eps)}, 1);  // [1, 2d]
    const int64_t r = base + j;
    s = decode_layer(s, ln2, qkv_kind, qkv_p, qkv_n, qkv_b, o_kind, o_p, o_n, ln2, gu_kind, gu_p, gu_n, down_kind,
                     down_p, down_n, cs.narrow(0, j, 1), k.narrow(2, r, 1).transpose(1, 2),
                     v.narrow(2, r, 1).transpose(1, 2), k.narrow(2, 0, r + 1), v.narrow(2, 0, r + 1), none, eps, H,
                     Hk, D, qkv_in, q_norm, k_norm);
  }
  return ids;
}

}  // namespace

torch::Tensor eagle_chain(const torch::Tensor& state, int64_t K, int64_t head_kind, const torch::Tensor& head_p,
                          int64_t head_n, const torch::Tensor& norm_w, const c10::optional<torch::Tensor>& off,
                          const torch::Tensor& d2t, const torch::Tensor& embed, const torch::Tensor& in_w,
                          const torch::Tensor& hid_w, int64_t qkv_kind, const torch::Tensor& qkv_p, int64_t qkv_n,
                          const c10::optional<torch::Tensor>& qkv_b, int64_t o_kind, const torch::Tensor& o_p,
                          int64_t o_n, const torch::Tensor& ln2, int64_t gu_kind, const torch::Tensor& gu_p,
                          int64_t gu_n, int64_t down_kind, const torch::Tensor& down_p, int64_t down_n,
                          const torch::Tensor& cs, torch::Tensor k, torch::Tensor v, int64_t base, double eps,
                          int64_t H, int64_t Hk, int64_t D, const c10::optional<torch::Tensor>& q_norm,
                          const c10::optional<torch::Tensor>& k_norm) {
  return chain_impl(state, K, head_kind, head_p, head_n, norm_w, off, d2t, embed, in_w, hid_w, qkv_kind, qkv_p,
                    qkv_n, qkv_b, o_kind, o_p, o_n, ln2, gu_kind, gu_p, gu_n, down_kind, down_p, down_n, cs, k, v,
                    base, eps, H, Hk, D, q_norm, k_norm, nullptr, 1.f, nullptr);
}

std::tuple<torch::Tensor, torch::Tensor> eagle_chain_sampled(
    const torch::Tensor& state, int64_t K, int64_t head_kind, const torch::Tensor& head_p, int64_t head_n,
    const torch::Tensor& norm_w, const c10::optional<torch::Tensor>& off, const torch::Tensor& d2t,
    const torch::Tensor& embed, const torch::Tensor& in_w, const torch::Tensor& hid_w, int64_t qkv_kind,
    const torch::Tensor& qkv_p, int64_t qkv_n, const c10::optional<torch::Tensor>& qkv_b, int64_t o_kind,
    const torch::Tensor& o_p, int64_t o_n, const torch::Tensor& ln2, int64_t gu_kind, const torch::Tensor& gu_p,
    int64_t gu_n, int64_t down_kind, const torch::Tensor& down_p, int64_t down_n, const torch::Tensor& cs,
    torch::Tensor k, torch::Tensor v, int64_t base, double eps, int64_t H, int64_t Hk, int64_t D,
    const torch::Tensor& uniforms, double temperature, const c10::optional<torch::Tensor>& q_norm,
    const c10::optional<torch::Tensor>& k_norm) {
  TORCH_CHECK(uniforms.scalar_type() == torch::kFloat32 && uniforms.numel() == K, "uniforms must be [K] float32");
  TORCH_CHECK(temperature > 0, "temperature must be > 0 (greedy chains: eagle_chain)");
  const auto uc = uniforms.contiguous();
  auto q = torch::empty({K, head_n}, torch::kFloat32);  // every row written by sample_row
  auto ids = chain_impl(state, K, head_kind, head_p, head_n, norm_w, off, d2t, embed, in_w, hid_w, qkv_kind, qkv_p,
                        qkv_n, qkv_b, o_kind, o_p, o_n, ln2, gu_kind, gu_p, gu_n, down_kind, down_p, down_n, cs, k,
                        v, base, eps, H, Hk, D, q_norm, k_norm, uc.data_ptr<float>(),
                        static_cast<float>(temperature), q.data_ptr<float>());
  return {ids, q};
}

torch::Tensor mtp_module(const torch::Tensor& h_prev, const torch::Tensor& emb, const torch::Tensor& hnorm_w,
                         const torch::Tensor& enorm_w, int64_t proj_kind, const torch::Tensor& proj_p, int64_t proj_n,
                         const torch::Tensor& ln1, int64_t qkv_kind, const torch::Tensor& qkv_p, int64_t qkv_n,
                         const c10::optional<torch::Tensor>& qkv_b, int64_t o_kind, const torch::Tensor& o_p,
                         int64_t o_n, const torch::Tensor& ln2, int64_t gu_kind, const torch::Tensor& gu_p,
                         int64_t gu_n, int64_t down_kind, const torch::Tensor& down_p, int64_t down_n,
                         const torch::Tensor& cs, torch::Tensor k, torch::Tensor v, int64_t base, double eps,
                         int64_t H, int64_t Hk, int64_t D, const c10::optional<torch::Tensor>& q_norm,
                         const c10::optional<torch::Tensor>& k_norm) {
  const at::AutoDispatchBelowADInplaceOrView below_autograd;  // see the note above `decode_layer`
  TORCH_CHECK(h_prev.dim() == 2 && emb.sizes() == h_prev.sizes(), "h_prev and emb must be [N, d]");
  TORCH_CHECK(k.dim() == 4 && k.size(0) == 1 && base >= 0, "k must be [1, Hk, R, D]");
  const int64_t N = h_prev.size(0);
  TORCH_CHECK(base + N <= k.size(2), "the cache has no room for ", N, " rows at row ", base);
  const c10::optional<torch::Tensor> none;
  const auto in = torch::cat({rms_norm(h_prev, hnorm_w, eps), rms_norm(emb, enorm_w, eps)}, 1);  // [N, 2d]
  const auto x = product(proj_kind, in, proj_p, proj_n, none);                                     // [N, d]
  c10::optional<torch::Tensor> mask;  // one row sees every row up to its own; N rows: causal
  if (N > 1) {
    const auto vis = torch::arange(base + N).unsqueeze(0) <= (torch::arange(N) + base).unsqueeze(1);  // [N, base+N]
    mask = vis.repeat({H / Hk, 1}).unsqueeze(0).unsqueeze(0);  // [1, 1, G*N, base+N]
  }
  return decode_layer(x, ln1, qkv_kind, qkv_p, qkv_n, qkv_b, o_kind, o_p, o_n, ln2, gu_kind, gu_p, gu_n, down_kind,
                      down_p, down_n, cs, k.narrow(2, base, N).transpose(1, 2), v.narrow(2, base, N).transpose(1, 2),
                      k.narrow(2, 0, base + N), v.narrow(2, 0, base + N), mask, eps, H, Hk, D, none, q_norm, k_norm);
}

std::tuple<torch::Tensor, torch::Tensor> head_draft(const torch::Tensor& state, const torch::Tensor& norm_w,
                                                    double eps, int64_t head_kind, const torch::Tensor& head_p,
                                                    int64_t head_n, const c10::optional<torch::Tensor>& off,
                                                    double uniform, double temperature) {
  TORCH_CHECK(state.dim() == 2 && state.size(0) == 1 && state.scalar_type() == torch::kFloat32,
              "state must be [1, d] float32");
  torch::Tensor offc;
  const bool* offp = off_mask(off, head_n, offc);
  auto ids = torch::empty({1}, torch::kInt64);
  auto q = torch::empty({temperature > 0 ? 1 : 0, head_n}, torch::kFloat32);  // written by sample_row
  const float u = static_cast<float>(uniform);
  ids.data_ptr<int64_t>()[0] = draft_of(state.contiguous(), norm_w, eps, head_kind, head_p, head_n, offp,
                                        temperature > 0 ? &u : nullptr, static_cast<float>(temperature),
                                        temperature > 0 ? q.data_ptr<float>() : nullptr);
  return {ids, q};
}

void context_rows(const torch::Tensor& feats, int64_t fc_kind, const torch::Tensor& fc_p, int64_t fc_n,
                  const torch::Tensor& ctx_norm_w, double ctx_eps, int64_t kv_kind, const torch::Tensor& kv_p,
                  int64_t kv_n, at::TensorList k_norms, double eps, const torch::Tensor& cs, torch::Tensor dst,
                  int64_t L, int64_t Hk, int64_t D) {
  TORCH_CHECK(feats.dim() == 2 && feats.scalar_type() == torch::kFloat32, "feats must be [N, F] float32");
  const int64_t N = feats.size(0), w = Hk * D;
  TORCH_CHECK(kv_n == 2 * L * w, "the key/value product must give 2 L Hk D outputs");
  TORCH_CHECK(k_norms.empty() || static_cast<int64_t>(k_norms.size()) == L, "k_norms must be empty or one per layer");
  TORCH_CHECK(dst.dim() == 6 && dst.size(0) == 2 && dst.size(1) == L && dst.size(2) * dst.size(3) == N,
              "dst must be [2, L, B, N, Hk, D] with B * N = feats' rows");
  const at::AutoDispatchBelowADInplaceOrView below_autograd;  // see the note above `decode_layer`
  const c10::optional<torch::Tensor> none;
  const auto ctx = rms_norm(product(fc_kind, feats, fc_p, fc_n, none), ctx_norm_w, ctx_eps);  // [N, d]
  auto kv = product(kv_kind, ctx, kv_p, kv_n, none);  // [N, 2 L Hk D]: every layer's keys, then values
  for (int64_t i = 0; i < static_cast<int64_t>(k_norms.size()); ++i) {
    auto k = kv.narrow(1, i * w, w);
    k.copy_(rms_norm(k.reshape({N * Hk, D}), k_norms[i], eps).view({N, w}));
  }
  rope_(kv, cs, L * Hk);  // the keys' heads only
  for (int64_t i = 0; i < L; ++i) {
    auto kd = dst[0][i], vd = dst[1][i];
    write_rows(kv, i * w, kd);
    write_rows(kv, (L + i) * w, vd);
  }
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> markov_draft(
    const torch::Tensor& states, int64_t head_kind, const torch::Tensor& head_p, int64_t head_n,
    const torch::Tensor& table, const torch::Tensor& prev, const c10::optional<torch::Tensor>& off,
    const torch::Tensor& conf_w, const torch::Tensor& conf_row, const torch::Tensor& temp, const torch::Tensor& bias,
    const c10::optional<torch::Tensor>& uniforms, double temperature) {
  TORCH_CHECK(states.dim() == 3 && states.scalar_type() == torch::kFloat32, "states must be [n, K, d] float32");
  const int64_t n = states.size(0), K = states.size(1), d = states.size(2);
  TORCH_CHECK(conf_w.scalar_type() == torch::kFloat32 && conf_w.numel() == d, "conf_w must be [d] float32");
  TORCH_CHECK(conf_row.scalar_type() == torch::kFloat32 && conf_row.dim() == 1 && conf_row.size(0) == table.size(0),
              "conf_row must be float32 with one entry per table row");
  TORCH_CHECK(temp.scalar_type() == torch::kFloat32 && bias.scalar_type() == torch::kFloat32 && temp.numel() >= K &&
                  bias.numel() >= K,
              "temp and bias must be float32 with an entry per slot");
  const at::AutoDispatchBelowADInplaceOrView below_autograd;  // see the note above `decode_layer`
  const c10::optional<torch::Tensor> none;
  const auto sc = states.contiguous();
  const auto u = product(head_kind, sc.view({n * K, d}), head_p, head_n, none).view({n, K, head_n});
  torch::Tensor ids, q;  // [n, K]; q [n, K, Vd] when sampled, else [0]
  if (uniforms.has_value() && uniforms->defined()) {
    std::tie(ids, q) = markov_sample(u, table, prev, off, *uniforms, temperature);
  } else {
    ids = markov_argmax(u, table, prev, off);
    q = torch::empty({0}, sc.options());
  }
  auto conf = torch::empty({n, K}, sc.options());
  const float* sp = sc.data_ptr<float>();
  const auto wc = conf_w.contiguous(), rowc = conf_row.contiguous(), tc = temp.contiguous(), bc = bias.contiguous();
  const float* w = wc.data_ptr<float>();
  const float *row = rowc.data_ptr<float>(), *tp = tc.data_ptr<float>(), *bp = bc.data_ptr<float>();
  const int64_t* idp = ids.data_ptr<int64_t>();
  const auto pc = prev.contiguous();
  float* cp = conf.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < K; ++k) {
      const float* s = sp + (i * K + k) * d;
      float z = 0.f;
      for (int64_t e = 0; e < d; ++e) z += s[e] * w[e];
      const int64_t p = k ? idp[i * K + k - 1] : pc.data_ptr<int64_t>()[i];
      const float a = (z + row[p]) / tp[k] + bp[k];
      cp[i * K + k] = 1.f / (1.f + std::exp(-a));
    }
  return {ids, conf, q};
}

std::tuple<torch::Tensor, torch::Tensor> head_rows(const torch::Tensor& states, int64_t head_kind,
                                                   const torch::Tensor& head_p, int64_t head_n,
                                                   const c10::optional<torch::Tensor>& off,
                                                   const c10::optional<torch::Tensor>& uniforms, double temperature) {
  TORCH_CHECK(states.dim() == 3 && states.scalar_type() == torch::kFloat32, "states must be [n, K, d] float32");
  const int64_t n = states.size(0), K = states.size(1), d = states.size(2);
  const bool sampled = uniforms.has_value() && uniforms->defined();
  TORCH_CHECK(!sampled || temperature > 0, "temperature must be > 0 (greedy rows: no uniforms)");
  const at::AutoDispatchBelowADInplaceOrView below_autograd;  // see the note above `decode_layer`
  const c10::optional<torch::Tensor> none;
  const auto sc = states.contiguous();
  const auto u = product(head_kind, sc.view({n * K, d}), head_p, head_n, none).contiguous();  // [n K, Vd]
  torch::Tensor offc, uc;
  const bool* offp = off_mask(off, head_n, offc);
  const float* up = nullptr;
  if (sampled) {
    uc = uniforms->contiguous();
    TORCH_CHECK(uc.scalar_type() == torch::kFloat32 && uc.numel() == n * K, "uniforms must be [n, K] float32");
    up = uc.data_ptr<float>();
  }
  auto ids = torch::empty({n, K}, torch::kInt64);
  // sampled: every row written by sample_row, so not zeroed first
  auto q = sampled ? torch::empty({n, K, head_n}, sc.options()) : torch::empty({0}, sc.options());
  int64_t* idp = ids.data_ptr<int64_t>();
  const float* lp = u.data_ptr<float>();
  const float t = static_cast<float>(temperature);
  for (int64_t r = 0; r < n * K; ++r)
    idp[r] = sampled ? sample_row(lp + r * head_n, head_n, offp, t, up[r], q.data_ptr<float>() + r * head_n)
                     : first_argmax(lp + r * head_n, head_n, offp);
  return {ids, q};
}

TORCH_LIBRARY_FRAGMENT(specdecode, m) {
  m.def(
      "head_rows(Tensor states, int head_kind, Tensor head_p, int head_n, Tensor? off, Tensor? uniforms=None, "
      "float temperature=1.0) -> (Tensor, Tensor)");
  m.def(
      "context_rows(Tensor feats, int fc_kind, Tensor fc_p, int fc_n, Tensor ctx_norm_w, float ctx_eps, "
      "int kv_kind, Tensor kv_p, int kv_n, Tensor[] k_norms, float eps, Tensor cs, Tensor(a!) dst, int L, "
      "int Hk, int D) -> ()");
  m.def(
      "markov_draft(Tensor states, int head_kind, Tensor head_p, int head_n, Tensor table, Tensor prev, "
      "Tensor? off, Tensor conf_w, Tensor conf_row, Tensor temp, Tensor bias, Tensor? uniforms=None, "
      "float temperature=1.0) -> (Tensor, Tensor, Tensor)");
  m.def(
      "eagle_chain(Tensor state, int K, int head_kind, Tensor head_p, int head_n, Tensor norm_w, Tensor? off, "
      "Tensor d2t, Tensor embed, Tensor in_w, Tensor hid_w, int qkv_kind, Tensor qkv_p, int qkv_n, Tensor? qkv_b, "
      "int o_kind, Tensor o_p, int o_n, Tensor ln2, int gu_kind, Tensor gu_p, int gu_n, int down_kind, "
      "Tensor down_p, int down_n, Tensor cs, Tensor(a!) k, Tensor(b!) v, int base, float eps, int H, int Hk, "
      "int D, Tensor? q_norm=None, Tensor? k_norm=None) -> Tensor");
  m.def(
      "eagle_chain_sampled(Tensor state, int K, int head_kind, Tensor head_p, int head_n, Tensor norm_w, "
      "Tensor? off, Tensor d2t, Tensor embed, Tensor in_w, Tensor hid_w, int qkv_kind, Tensor qkv_p, int qkv_n, "
      "Tensor? qkv_b, int o_kind, Tensor o_p, int o_n, Tensor ln2, int gu_kind, Tensor gu_p, int gu_n, "
      "int down_kind, Tensor down_p, int down_n, Tensor cs, Tensor(a!) k, Tensor(b!) v, int base, float eps, "
      "int H, int Hk, int D, Tensor uniforms, float temperature, Tensor? q_norm=None, Tensor? k_norm=None) "
      "-> (Tensor, Tensor)");
  m.def(
      "mtp_module(Tensor h_prev, Tensor emb, Tensor hnorm_w, Tensor enorm_w, int proj_kind, Tensor proj_p, "
      "int proj_n, Tensor ln1, int qkv_kind, Tensor qkv_p, int qkv_n, Tensor? qkv_b, int o_kind, Tensor o_p, "
      "int o_n, Tensor ln2, int gu_kind, Tensor gu_p, int gu_n, int down_kind, Tensor down_p, int down_n, "
      "Tensor cs, Tensor(a!) k, Tensor(b!) v, int base, float eps, int H, int Hk, int D, Tensor? q_norm=None, "
      "Tensor? k_norm=None) -> Tensor");
  m.def(
      "head_draft(Tensor state, Tensor norm_w, float eps, int head_kind, Tensor head_p, int head_n, Tensor? off, "
      "float uniform, float temperature) -> (Tensor, Tensor)");
  m.def(
      "decode_layers(Tensor x, Tensor[] w, int[] n, Tensor?[] qkv_b, Tensor cs, Tensor(a!) dst, Tensor src, "
      "Tensor? mask, float eps, int H, int Hk, int D, int[] capture, Tensor[] qk_norms) -> Tensor[]");
  m.def(
      "decode_layer(Tensor x, Tensor ln1, int qkv_kind, Tensor qkv_p, int qkv_n, Tensor? qkv_b, int o_kind, "
      "Tensor o_p, int o_n, Tensor ln2, int gu_kind, Tensor gu_p, int gu_n, int down_kind, Tensor down_p, "
      "int down_n, Tensor cs, Tensor(a!) k_dst, Tensor(b!) v_dst, Tensor k_src, Tensor v_src, Tensor? mask, "
      "float eps, int H, int Hk, int D, Tensor? qkv_in=None, Tensor? q_norm=None, Tensor? k_norm=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdecode, CPU, m) {
  m.impl("decode_layer", &decode_layer);
  m.impl("decode_layers", &decode_layers);
  m.impl("eagle_chain", &eagle_chain);
  m.impl("eagle_chain_sampled", &eagle_chain_sampled);
  m.impl("mtp_module", &mtp_module);
  m.impl("head_draft", &head_draft);
  m.impl("markov_draft", &markov_draft);
  m.impl("context_rows", &context_rows);
  m.impl("head_rows", &head_rows);
}
