// A speculative step's verification over the target's logits in one call, for the loop's common
// case: chains (no trees), each request greedy or sampling at a plain temperature (no top-k /
// top-p), fp32 logits on the CPU. verify.py's tensor path builds the [B, K+1, V] distributions
// p (and the residual and its cumulative sum) with ~25 operators over the whole vocabulary; this
// reads each logits row once or twice and builds one row of weights per draw (one per request by
// rejection, rows 0..n of a sample-then-match request).
//
//   row_argmax(x [R, V'] fp32, vocab_size) -> [R] int64: the first largest of x[r, :vocab_size]
//       (torch.argmax's choice, NaN largest)
//   verify_chain(logits [B, N, V'] fp32, draft_ids [B, K] int64, num_draft [B] int64,
//                q [B, K, Vq] fp32 | None, uniforms [B, K+1] fp32, temperature [B] fp32,
//                vocab_size, q_ids [Vq] int64 | None, block bool) -> (num_accepted [B] int64,
//                final_ids [B] int64)
//       Request b drafted x_k = draft_ids[b, k] for k < n = num_draft[b] (N >= K + 1 rows of
//       logits, ids < vocab_size count). q spans the target's ids (Vq >= vocab_size), or with
//       q_ids a draft vocabulary: column j is target id q_ids[j], every other id has q = 0 (what
//       the drafters' reduced vocabularies give, without scattering q to V). With T = temperature[b]:
//       - T == 0: drafts are kept while x_k is the argmax of row k; the final token is the
//         argmax of the row after them (the exact limit of rejection sampling, as
//         verify.verify_greedy).
//       - T > 0 with q (rejection, verify.verify_chain): p_k = softmax(logits[b, k] / T);
//         draft k is kept while uniforms[b, k] * q[b, k, x_k] < p_k(x_k); after a rejection at
//         a the final token is drawn from norm(max(0, p_a - q_a)) (p_a where that has no mass),
//         after n acceptances from p_n, by inverse CDF with uniforms[b, K].
//       - T > 0 with q and block (block verification, verify_rules.verify_chain_block): with
//         w_0 = 1, w_i = min(1, w_{i-1} p_{i-1}(x_i) / q_{i-1}(x_i)) and the residual mass S_i of
//         max(0, w_i p_i - q_i), A = the last i in 1..n with uniforms[b, i - 1] < h_i =
//         S_i / (S_i + 1 - w_i) (h_n = w_n), else 0; the final token is drawn from
//         norm(max(0, w_A p_A - q_A)) (p_A where that has no mass), or from p_n when A = n.
//       - T > 0 without q (sample-then-match, verify.verify_chain_match): y_k is drawn from p_k
//         with uniforms[b, k]; drafts are kept while y_k == x_k; the final token is y at the
//         first mismatch (or y_n).
//   verify_tree(logits [B, N+1, V'] fp32, tree_ids [B, N] int64 (-1: no node), parents [B, N]
//               int64 (-1: the root), uniforms [B, N+1] fp32, temperature [B] fp32 (> 0),
//               vocab_size) -> (path [B, N] int64 (accepted nodes, root to leaf, then -1),
//               final_ids [B] int64)
//       A tree of point-mass candidates at T > 0 (verify_rules.verify_tree_batch, iid False):
//       from the root (block row 0), the children of the current node are tried in index order;
//       child i (token x) is accepted when uniforms[b, i + 1] < p'(x), p' = softmax(logits of
//       the current node's row / T) with the children rejected there set to zero and the rest
//       renormalised; accepting moves to row i + 1. The final token is drawn from p' at the last
//       node with uniforms[b, 0]. Only the rows the walk visits are read.
//
// Every sum runs over fixed chunks of CHUNK ids in a fixed order (a chunk's maximum, its
// exponentials relative to it, then the chunks combined), whichever thread computes a chunk, so a
// request's verdict never depends on its batch or on the number of threads. Probabilities are
// those of softmax up to rounding (the exponential is vec_math.h's polynomial); the draws are
// inverse CDF as sampling.sample: the first id whose running mass exceeds u * total, the target
// kept strictly below the total, so an id of zero mass is never drawn.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "vec_math.h"

// fused.cpp's argmax of one row (torch.argmax's rule; no id mask here).
int64_t first_argmax(const float* x, int64_t V, const bool* off);

namespace {

constexpr int64_t CHUNK = 4096;  // ids per chunk (a row's sums are combined over these)

// Adds 8 fp32 lanes into two 4-lane double accumulators (sums of thousands of terms keep fp32's
// precision per term), and the horizontal sum of those.
inline void add_wide(__m256d& lo, __m256d& hi, __m256 v) {
  lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
  hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
}
inline double hadd_wide(__m256d lo, __m256d hi) {
  alignas(32) double t[4];
  _mm256_store_pd(t, _mm256_add_pd(lo, hi));
  return (t[0] + t[1]) + (t[2] + t[3]);
}

struct ChunkStat {
  float mx;      // the chunk's largest logit (greedy: its first index in `arg`)
  double sum;    // T > 0: sum over the chunk of exp((x - mx) / T)
  int64_t arg;   // T == 0: the chunk's first largest (absolute id)
};

// One chunk [v0, v1) of a row: greedy -> its first largest; T > 0 -> its maximum and the sum of
// exp((x - mx) / T) (the difference taken before the scaling, as sampling.process_logits does, so
// a low temperature keeps the precision of near ties; summed in double lanes).
ChunkStat chunk_stat(const float* x, int64_t v0, int64_t v1, float inv_t) {
  ChunkStat st{-std::numeric_limits<float>::infinity(), 0.0, v0};
  if (inv_t == 0.f) {
    st.arg = v0 + first_argmax(x + v0, v1 - v0, nullptr);
    st.mx = x[st.arg];
    return st;
  }
  __m256 vmax = _mm256_set1_ps(st.mx);
  int64_t v = v0;
  for (; v + 8 <= v1; v += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(x + v));
  float mx = hmax(vmax);
  for (int64_t t = v; t < v1; ++t) mx = std::max(mx, x[t]);
  st.mx = mx;
  if (mx == -std::numeric_limits<float>::infinity()) return st;  // nothing of mass here
  const __m256 it = _mm256_set1_ps(inv_t), m = _mm256_set1_ps(mx), zero = _mm256_setzero_ps();
  __m256d lo = _mm256_setzero_pd(), hi = lo;
  for (v = v0; v + 8 <= v1; v += 8)
    add_wide(lo, hi, exp_shifted(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + v), m), it), zero));
  double s = hadd_wide(lo, hi);
  for (int64_t t = v; t < v1; ++t) s += std::exp(static_cast<double>((x[t] - mx) * inv_t));
  st.sum = s;
  return st;
}

struct RowStat {
  float mx;      // the row's largest logit
  double z;      // sum of exp((x - mx) / T) over the row
  int64_t arg;   // T == 0: the row's first largest
};

// The chunks of a row combined in order.
RowStat combine(const ChunkStat* c, int64_t n, float inv_t) {
  RowStat r{c[0].mx, 0.0, c[0].arg};
  for (int64_t i = 1; i < n; ++i)
    if (c[i].mx > r.mx || (std::isnan(c[i].mx) && !std::isnan(r.mx))) r.mx = c[i].mx, r.arg = c[i].arg;
  if (inv_t == 0.f) return r;
  for (int64_t i = 0; i < n; ++i)
    if (c[i].sum > 0.0) r.z += c[i].sum * std::exp(static_cast<double>((c[i].mx - r.mx) * inv_t));
  return r;
}

// p(x) of one id under a row's statistics.
inline double prob(const float* x, int64_t id, const RowStat& r, float inv_t) {
  return std::exp(static_cast<double>((x[id] - r.mx) * inv_t)) / r.z;
}

// Weights of one chunk [v0, v1) of the final distribution into w: p (no q), or max(0, p - q)
// with q a full row (`q`) or a draft-vocabulary row (`qc`, its id of target id v at t2q[v], -1
// for none); returns their sum (in double lanes, then in order).
double chunk_weights(const float* x, const float* q, const float* qc, const int32_t* t2q, int64_t v0, int64_t v1,
                     const RowStat& r, float inv_t, float* w, double scale = 1.0) {
  const __m256 it = _mm256_set1_ps(inv_t), m = _mm256_set1_ps(r.mx);
  const __m256 iz = _mm256_set1_ps(static_cast<float>(scale / r.z)), zero = _mm256_setzero_ps();
  int64_t v = v0;
  for (; v + 8 <= v1; v += 8) {
    __m256 p = _mm256_mul_ps(exp_shifted(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + v), m), it), zero), iz);
    if (q) p = _mm256_max_ps(_mm256_sub_ps(p, _mm256_loadu_ps(q + v)), zero);
    _mm256_storeu_ps(w + v, p);
  }
  for (; v < v1; ++v) {
    w[v] = static_cast<float>(scale * prob(x, v, r, inv_t));
    if (q) w[v] = std::max(w[v] - q[v], 0.f);
  }
  if (qc)
    for (v = v0; v < v1; ++v)
      if (t2q[v] >= 0) w[v] = std::max(w[v] - qc[t2q[v]], 0.f);
  __m256d lo = _mm256_setzero_pd(), hi = lo;
  for (v = v0; v + 8 <= v1; v += 8) add_wide(lo, hi, _mm256_loadu_ps(w + v));
  double s = hadd_wide(lo, hi);
  for (; v < v1; ++v) s += w[v];
  return s;
}

// Block verification's residual mass sum_x max(0, s * p(x) - q(x)) over ids < V of one row: q a
// full row (`q`), or a draft-vocabulary row (`qc`, column j at target id q_ids[j], nq columns;
// every other id keeps s * p). `buf` holds nq floats.
double residual_mass(const float* x, const float* q, const float* qc, const int64_t* q_ids, int64_t nq, int64_t V,
                     const RowStat& r, float inv_t, double s, float* buf) {
  const __m256 it = _mm256_set1_ps(inv_t), m = _mm256_set1_ps(r.mx), zero = _mm256_setzero_ps();
  const __m256 sz = _mm256_set1_ps(static_cast<float>(s / r.z)), iz = _mm256_set1_ps(static_cast<float>(1.0 / r.z));
  __m256d lo = _mm256_setzero_pd(), hi = lo, plo = lo, phi = lo;
  const float* xs = x;
  const float* qs = q;
  int64_t n = V;
  if (!q) {  // gather the logits of q's columns (ids past the vocabulary: -inf, p = 0)
    for (int64_t j = 0; j < nq; ++j) buf[j] = q_ids[j] < V ? x[q_ids[j]] : -std::numeric_limits<float>::infinity();
    xs = buf, qs = qc, n = nq;
  }
  int64_t v = 0;
  for (; v + 8 <= n; v += 8) {
    const __m256 e = exp_shifted(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(xs + v), m), it), zero);
    add_wide(lo, hi, _mm256_max_ps(_mm256_sub_ps(_mm256_mul_ps(e, sz), _mm256_loadu_ps(qs + v)), zero));
    if (!q) add_wide(plo, phi, _mm256_mul_ps(e, iz));
  }
  double res = hadd_wide(lo, hi), in_q = hadd_wide(plo, phi);
  for (; v < n; ++v) {
    const double p = std::isinf(xs[v]) ? 0.0 : prob(xs, v, r, inv_t);
    res += std::max(s * p - qs[v], 0.0);
    in_q += p;
  }
  return q ? res : res + std::max(s * (1.0 - in_q), 0.0);
}

// The inverse-CDF draw over weights w [V] with chunk sums `sums` (in order): the first id whose
// running mass exceeds u * total; the last id of positive weight if rounding runs past the end.
int64_t draw(const float* w, const double* sums, int64_t chunks, int64_t V, float u) {
  double total = 0.0;
  for (int64_t c = 0; c < chunks; ++c) total += sums[c];
  const double target = std::min(static_cast<double>(u) * total, std::nextafter(total, 0.0));
  double acc = 0.0;
  int64_t c = 0;
  while (c + 1 < chunks && acc + sums[c] <= target) acc += sums[c++];
  int64_t last = -1;
  for (int64_t v = c * CHUNK; v < V; ++v) {
    if (w[v] <= 0.f) continue;
    last = v;
    acc += w[v];
    if (acc > target) return v;
  }
  if (last >= 0) return last;
  for (int64_t v = V - 1; v >= 0; --v)  // rounding ran past every later id: the last of mass
    if (w[v] > 0.f) return v;
  return 0;
}

// A draw from p itself (a row's softmax at T), for a residual left without mass: p == q, where a
// rejection has probability 0 and only rounding can make one (as verify_rules._normalised_or).
int64_t draw_from_p(const float* x, const RowStat& r, float inv_t, int64_t V, int64_t chunks, float u) {
  std::vector<double> ps(chunks);
  std::vector<float> pw(V);
  for (int64_t c = 0; c < chunks; ++c)
    ps[c] = chunk_weights(x, nullptr, nullptr, nullptr, c * CHUNK, std::min(V, (c + 1) * CHUNK), r, inv_t, pw.data());
  return draw(pw.data(), ps.data(), chunks, V, u);
}

void check(const torch::Tensor& t, const char* name, c10::ScalarType type, int64_t dim) {
  TORCH_CHECK(t.scalar_type() == type && t.device().is_cpu() && t.dim() == dim, name, " must be a ", dim,
              "-D ", c10::toString(type), " tensor on the CPU");
}

}  // namespace

torch::Tensor row_argmax(const torch::Tensor& x, int64_t vocab_size) {
  check(x, "x", torch::kFloat32, 2);
  TORCH_CHECK(vocab_size >= 1 && vocab_size <= x.size(1), "vocab_size must be in [1, V']");
  const auto xc = x.contiguous();
  const int64_t R = xc.size(0), ld = xc.size(1), chunks = (vocab_size + CHUNK - 1) / CHUNK;
  std::vector<ChunkStat> st(R * chunks);
  const float* xp = xc.data_ptr<float>();
  at::parallel_for(0, R * chunks, 1, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) {
      const int64_t r = t / chunks, c = t % chunks;
      st[t] = chunk_stat(xp + r * ld, c * CHUNK, std::min(vocab_size, (c + 1) * CHUNK), 0.f);
    }
  });
  auto out = torch::empty({R}, torch::kInt64);
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) op[r] = combine(st.data() + r * chunks, chunks, 0.f).arg;
  return out;
}

std::tuple<torch::Tensor, torch::Tensor> verify_chain(const torch::Tensor& logits, const torch::Tensor& draft_ids,
                                                      const torch::Tensor& num_draft,
                                                      const c10::optional<torch::Tensor>& q,
                                                      const torch::Tensor& uniforms, const torch::Tensor& temperature,
                                                      int64_t vocab_size, const c10::optional<torch::Tensor>& q_ids,
                                                      bool block) {
  check(logits, "logits", torch::kFloat32, 3);
  check(draft_ids, "draft_ids", torch::kInt64, 2);
  check(num_draft, "num_draft", torch::kInt64, 1);
  check(uniforms, "uniforms", torch::kFloat32, 2);
  check(temperature, "temperature", torch::kFloat32, 1);
  const int64_t B = logits.size(0), N = logits.size(1), V = vocab_size, K = draft_ids.size(1);
  TORCH_CHECK(V >= 1 && V <= logits.size(2), "vocab_size must be in [1, V']");
  TORCH_CHECK(draft_ids.size(0) == B && num_draft.size(0) == B && temperature.size(0) == B &&
                  uniforms.size(0) == B && uniforms.size(1) == K + 1 && N >= K + 1,
              "draft_ids [B, K], num_draft [B], uniforms [B, K+1], temperature [B] and logits [B, >= K+1, V']");
  const bool has_q = q.has_value() && q->defined();
  const bool compact = has_q && q_ids.has_value() && q_ids->defined();
  torch::Tensor qc;
  std::vector<int32_t> t2q;  // compact q: target id -> q's column (-1: none)
  torch::Tensor ic;          // compact q: its columns' target ids
  if (has_q) {
    check(*q, "q", torch::kFloat32, 3);
    TORCH_CHECK(q->size(0) == B && q->size(1) == K, "q must be [B, K, ...]");
    TORCH_CHECK(compact || q->size(2) >= V, "q must be [B, K, >= vocab_size] (or give q_ids)");
    qc = q->contiguous();
  }
  if (compact) {
    check(*q_ids, "q_ids", torch::kInt64, 1);
    TORCH_CHECK(q_ids->size(0) == q->size(2), "q_ids must name each of q's ", q->size(2), " columns");
    ic = q_ids->contiguous();
    const int64_t* ip = ic.data_ptr<int64_t>();
    t2q.assign(V, -1);
    for (int64_t j = 0; j < ic.size(0); ++j) {
      TORCH_CHECK(ip[j] >= 0, "q_ids[", j, "] = ", ip[j], " is not a token id");
      if (ip[j] >= V) continue;  // ids past the vocabulary: p is 0 there
      TORCH_CHECK(t2q[ip[j]] < 0, "q_ids names target id ", ip[j], " twice (columns ", t2q[ip[j]], " and ", j, ")");
      t2q[ip[j]] = static_cast<int32_t>(j);
    }
  }
  const auto lc = logits.contiguous(), dc = draft_ids.contiguous(), nc = num_draft.contiguous();
  const auto uc = uniforms.contiguous(), tc = temperature.contiguous();
  const float *lp = lc.data_ptr<float>(), *up = uc.data_ptr<float>(), *tp = tc.data_ptr<float>();
  const float* qp = has_q ? qc.data_ptr<float>() : nullptr;
  const int64_t *xp = dc.data_ptr<int64_t>(), *np = nc.data_ptr<int64_t>();
  const int64_t ld = lc.size(2), qld = has_q ? qc.size(2) : 0, chunks = (V + CHUNK - 1) / CHUNK;
  std::vector<float> inv_t(B);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(np[b] >= 0 && np[b] <= K, "num_draft[", b, "] = ", np[b], " is outside [0, ", K, "]");
    TORCH_CHECK(tp[b] >= 0.f && std::isfinite(tp[b]), "temperature[", b, "] must be finite and >= 0");
    inv_t[b] = tp[b] == 0.f ? 0.f : 1.f / tp[b];
  }
  const auto row = [&](int64_t b, int64_t k) { return lp + (b * N + k) * ld; };
  // 1. Statistics of every row a verdict may read (rows 0..n of each request), chunk by chunk.
  std::vector<int64_t> first(B + 1, 0);  // request b's rows are tasks [first[b], first[b + 1]) / chunks
  for (int64_t b = 0; b < B; ++b) first[b + 1] = first[b] + (np[b] + 1) * chunks;
  std::vector<ChunkStat> st(first[B]);
  at::parallel_for(0, first[B], 1, [&](int64_t a, int64_t e) {
    for (int64_t t = a; t < e; ++t) {
      const int64_t b = std::upper_bound(first.begin(), first.end(), t) - first.begin() - 1;
      const int64_t k = (t - first[b]) / chunks, c = (t - first[b]) % chunks;
      st[t] = chunk_stat(row(b, k), c * CHUNK, std::min(V, (c + 1) * CHUNK), inv_t[b]);
    }
  });
  std::vector<std::vector<RowStat>> rs(B);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t k = 0; k <= np[b]; ++k) rs[b].push_back(combine(st.data() + first[b] + k * chunks, chunks, inv_t[b]));
  // 2. Acceptance, request by request (scalar), and which row the final token is drawn from.
  auto accepted = torch::zeros({B}, torch::kInt64);
  auto final_ids = torch::zeros({B}, torch::kInt64);
  int64_t *ap = accepted.data_ptr<int64_t>(), *fp = final_ids.data_ptr<int64_t>();
  std::vector<int64_t> draw_row(B, -1);  // T > 0 rejection: the row to draw from (-1: none)
  std::vector<double> scale(B, 1.0);      // block verification: w_A, p's weight in the residual
  std::vector<float> buf(compact ? qc.size(2) : 0);
  const auto q_at = [&](int64_t b, int64_t k, int64_t id) {  // q of draft slot k at target id < V
    const float* qr = qp + (b * K + k) * qld;
    return !compact ? qr[id] : t2q[id] >= 0 ? qr[t2q[id]] : 0.f;
  };
  std::vector<int64_t> match_rows(B, 0);  // T > 0 without q: rows 0..n all drawn
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = np[b];
    const int64_t* x = xp + b * K;
    int64_t a = 0;
    if (inv_t[b] == 0.f) {
      while (a < n && x[a] == rs[b][a].arg) ++a;
      ap[b] = a, fp[b] = rs[b][a].arg;
    } else if (has_q && block) {
      // w_i = min(1, w_{i-1} p_{i-1}(x_i) / q_{i-1}(x_i)); A = the last i whose uniform is below
      // h_i = S_i / (S_i + 1 - w_i) (h_n = w_n), S_i the residual mass at row i. S_i <= w_i, so
      // h_i <= w_i: walking down from n, S_i is only computed where the uniform is below w_i.
      std::vector<double> wv(n + 1, 0.0);
      wv[0] = 1.0;
      for (int64_t i = 1; i <= n && x[i - 1] >= 0 && x[i - 1] < V; ++i) {
        const float qx = q_at(b, i - 1, x[i - 1]);
        const double px = prob(row(b, i - 1), x[i - 1], rs[b][i - 1], inv_t[b]);
        wv[i] = std::min(1.0, wv[i - 1] * (qx > 0.f ? px / qx : px > 0.0 ? 1e300 : 0.0));
      }
      for (int64_t i = n; i >= 1 && a == 0; --i) {
        const double eta = up[b * (K + 1) + i - 1];
        if (!(eta < wv[i])) continue;
        double h = wv[i];
        if (i < n) {
          const float* qn = qp + (b * K + i) * qld;
          const double S = residual_mass(row(b, i), compact ? nullptr : qn, compact ? qn : nullptr,
                                         compact ? ic.data_ptr<int64_t>() : nullptr, compact ? ic.size(0) : 0, V,
                                         rs[b][i], inv_t[b], wv[i], buf.data());
          h = S > 0.0 ? S / (S + 1.0 - wv[i]) : 0.0;
        }
        if (eta < h) a = i;  // strictly: a uniform of 0 never keeps a draft of p = 0 (h = 0)
      }
      scale[b] = a < n ? wv[a] : 1.0;
      ap[b] = a, draw_row[b] = a;
    } else if (has_q) {
      while (a < n && x[a] >= 0 && x[a] < V) {
        const float qx = q_at(b, a, x[a]);
        if (!(static_cast<double>(up[b * (K + 1) + a]) * qx < prob(row(b, a), x[a], rs[b][a], inv_t[b]))) break;
        ++a;
      }
      ap[b] = a, draw_row[b] = a;
    } else {
      match_rows[b] = n + 1;
    }
  }
  // 3. The draws: one row per rejection-sampled request, every row of a matched one, each row's
  //    weights computed chunk by chunk (in parallel), then drawn in order.
  std::vector<std::tuple<int64_t, int64_t>> draws;  // (request, row)
  for (int64_t b = 0; b < B; ++b) {
    if (draw_row[b] >= 0) draws.emplace_back(b, draw_row[b]);
    for (int64_t k = 0; k < match_rows[b]; ++k) draws.emplace_back(b, k);
  }
  const int64_t D = static_cast<int64_t>(draws.size());
  if (D == 0) return {accepted, final_ids};
  std::vector<float> w(D * V);
  std::vector<double> sums(D * chunks);
  at::parallel_for(0, D * chunks, 1, [&](int64_t a, int64_t e) {
    for (int64_t t = a; t < e; ++t) {
      const int64_t d = t / chunks, c = t % chunks;
      const auto [b, k] = draws[d];
      // the residual max(0, p - q) after a rejection (k < n); p itself for a bonus or a match draw
      const float* qr = has_q && k < np[b] ? qp + (b * K + k) * qld : nullptr;
      sums[t] = chunk_weights(row(b, k), compact ? nullptr : qr, compact ? qr : nullptr, t2q.data(), c * CHUNK,
                              std::min(V, (c + 1) * CHUNK), rs[b][k], inv_t[b], w.data() + d * V, scale[b]);
    }
  });
  std::vector<int64_t> drawn(D);
  for (int64_t d = 0; d < D; ++d) {
    const auto [b, k] = draws[d];
    const float* wd = w.data() + d * V;
    const double* sd = sums.data() + d * chunks;
    double mass = 0.0;
    for (int64_t c = 0; c < chunks; ++c) mass += sd[c];
    const float u = has_q ? up[b * (K + 1) + K] : up[b * (K + 1) + k];
    drawn[d] = mass > 0.0 ? draw(wd, sd, chunks, V, u) : draw_from_p(row(b, k), rs[b][k], inv_t[b], V, chunks, u);
  }
  std::vector<char> open(B, 1);  // a matched request not yet decided
  for (int64_t d = 0; d < D; ++d) {  // draws run row by row within a request
    const auto [b, k] = draws[d];
    if (draw_row[b] >= 0) {
      fp[b] = drawn[d];
    } else if (open[b] && !(k < np[b] && drawn[d] == xp[b * K + k])) {  // y_k != x_k, or the bonus row
      ap[b] = k, fp[b] = drawn[d], open[b] = 0;
    }
  }
  return {accepted, final_ids};
}

std::tuple<torch::Tensor, torch::Tensor> verify_tree(const torch::Tensor& logits, const torch::Tensor& tree_ids,
                                                     const torch::Tensor& parents, const torch::Tensor& uniforms,
                                                     const torch::Tensor& temperature, int64_t vocab_size) {
  check(logits, "logits", torch::kFloat32, 3);
  check(tree_ids, "tree_ids", torch::kInt64, 2);
  check(parents, "parents", torch::kInt64, 2);
  check(uniforms, "uniforms", torch::kFloat32, 2);
  check(temperature, "temperature", torch::kFloat32, 1);
  const int64_t B = logits.size(0), N = tree_ids.size(1), V = vocab_size;
  TORCH_CHECK(V >= 1 && V <= logits.size(2), "vocab_size must be in [1, V']");
  TORCH_CHECK(tree_ids.size(0) == B && parents.sizes() == tree_ids.sizes() && temperature.size(0) == B &&
                  uniforms.size(0) == B && uniforms.size(1) == N + 1 && logits.size(1) >= N + 1,
              "tree_ids and parents [B, N], uniforms [B, N+1], temperature [B] and logits [B, >= N+1, V']");
  const auto lc = logits.contiguous(), ic = tree_ids.contiguous(), pc = parents.contiguous();
  const auto uc = uniforms.contiguous(), tc = temperature.contiguous();
  const float *lp = lc.data_ptr<float>(), *up = uc.data_ptr<float>(), *tp = tc.data_ptr<float>();
  const int64_t *xp = ic.data_ptr<int64_t>(), *pp = pc.data_ptr<int64_t>();
  const int64_t ld = lc.size(2), rows = lc.size(1), chunks = (V + CHUNK - 1) / CHUNK;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(tp[b] > 0.f && std::isfinite(tp[b]), "temperature[", b, "] must be finite and > 0");
    for (int64_t i = 0; i < N; ++i)
      TORCH_CHECK(xp[b * N + i] < 0 || (pp[b * N + i] >= -1 && pp[b * N + i] < i),
                  "parents[", b, ", ", i, "] must name an earlier node or -1");
  }
  auto path = torch::full({B, N}, -1, torch::kInt64);
  auto final_ids = torch::zeros({B}, torch::kInt64);
  int64_t *ap = path.data_ptr<int64_t>(), *fp = final_ids.data_ptr<int64_t>();
  std::vector<ChunkStat> st(chunks);
  std::vector<float> w(V);
  std::vector<double> sums(chunks);
  for (int64_t b = 0; b < B; ++b) {
    const float inv_t = 1.f / tp[b];
    const int64_t* x = xp + b * N;
    const int64_t* par = pp + b * N;
    const auto stats = [&](int64_t r) {  // a visited row's statistics, its chunks in parallel
      const float* xr = lp + (b * rows + r) * ld;
      at::parallel_for(0, chunks, 1, [&](int64_t a, int64_t e) {
        for (int64_t c = a; c < e; ++c) st[c] = chunk_stat(xr, c * CHUNK, std::min(V, (c + 1) * CHUNK), inv_t);
      });
      return combine(st.data(), chunks, inv_t);
    };
    int64_t cur = 0, depth = 0;
    RowStat rs = stats(0);
    std::vector<int64_t> rejected;  // children rejected at the current node (their p goes to 0)
    double gone = 0.0;              // their mass under the current row's p
    for (int64_t i = 0; i < N; ++i) {
      if (x[i] < 0 || par[i] + 1 != cur) continue;  // absent, or not a child of the current node
      const float* xr = lp + (b * rows + cur) * ld;
      const bool dup = std::find(rejected.begin(), rejected.end(), x[i]) != rejected.end();
      const double px = x[i] >= V || dup ? 0.0 : prob(xr, x[i], rs, inv_t);
      const double left = 1.0 - gone;  // mass the rejected children left
      if (static_cast<double>(up[b * (N + 1) + i + 1]) * left < px) {
        ap[b * N + depth++] = i;
        cur = i + 1;
        rs = stats(cur);
        rejected.clear(), gone = 0.0;
      } else {
        rejected.push_back(x[i]);
        gone += px;
      }
    }
    // the final draw: p at the current node without the children rejected there
    const float* xr = lp + (b * rows + cur) * ld;
    at::parallel_for(0, chunks, 1, [&](int64_t a, int64_t e) {
      for (int64_t c = a; c < e; ++c)
        sums[c] = chunk_weights(xr, nullptr, nullptr, nullptr, c * CHUNK, std::min(V, (c + 1) * CHUNK), rs, inv_t,
                                w.data());
    });
    std::vector<double> kept = sums;
    for (const int64_t r : rejected)
      if (r >= 0 && r < V && w[r] > 0.f) kept[r / CHUNK] -= w[r], w[r] = 0.f;
    double mass = 0.0;
    for (int64_t c = 0; c < chunks; ++c) mass += kept[c];
    // nothing left (every id of mass rejected: only rounding can do that): p itself, as the
    // tensor path's fallback
    const float u = up[b * (N + 1)];
    fp[b] = mass > 0.0 ? draw(w.data(), kept.data(), chunks, V, u) : draw_from_p(xr, rs, inv_t, V, chunks, u);
  }
  return {path, final_ids};
}

TORCH_LIBRARY_FRAGMENT(specdecode, m) {
  m.def("verify_tree(Tensor logits, Tensor tree_ids, Tensor parents, Tensor uniforms, Tensor temperature, "
        "int vocab_size) -> (Tensor, Tensor)");
  m.def("row_argmax(Tensor x, int vocab_size) -> Tensor");
  m.def("verify_chain(Tensor logits, Tensor draft_ids, Tensor num_draft, Tensor? q, Tensor uniforms, "
        "Tensor temperature, int vocab_size, Tensor? q_ids=None, bool block=False) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(specdecode, CPU, m) {
  m.impl("row_argmax", &row_argmax);
  m.impl("verify_chain", &verify_chain);
  m.impl("verify_tree", &verify_tree);
}
