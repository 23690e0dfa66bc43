// Fused MoE routing on the CPU (smelt_cpu::moe_route_fwd / moe_route_bwd).
//
// One pass over the router logits (T, E): per token the softmax statistics (max, sum of
// exponentials), the top-k experts, their probabilities (renormalised to sum 1 when asked)
// and the per-chunk expert counts of the counting sort; then the stable scatter that gives
// the forward's sort (order, rev, offsets: the layout of smelt_cpu::moe_sort).
//
// Selection: experts in descending logit order (softmax is monotonic, so this is descending
// probability), exact ties broken by the lower expert index. Selecting on the logits rather
// than on the rounded probabilities keeps logits that differ apart even where their fp32
// probabilities round to the same value.
//
// Backward, with p = softmax(logits), s_j = p[ids_j] and dL/dw_j = g_j:
//   renormalised (w = s / S, S = sum s):  ds_j = (g_j - sum_i g_i w_i) / S;  else ds_j = g_j
//   dL/dlogits[e] = p_e * ([e selected] ds_e - c),   c = sum_j ds_j s_j.
// Rows are independent and chunks of rows fixed, so the results do not depend on the
// number of threads.
#include <torch/library.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

#include "../cpu_alloc.h"
#include "cpu_blas.h"

namespace smelt_moe {
namespace {

constexpr int64_t kRouteChunk = 256;  // tokens per counting-sort chunk (fixed, not per thread)

// The k best (value, expert) of one row, best first; ties: lower expert first.
inline void top_k_row(const float* l, int64_t E, int64_t k, float* best, int32_t* idx) {
  int64_t n = 0;
  for (int64_t e = 0; e < E; ++e) {
    const float v = l[e];
    if (n == k && !(v > best[k - 1])) continue;  // also skips NaN against a full list
    int64_t pos = n < k ? n++ : k - 1;
    while (pos > 0 && v > best[pos - 1]) {
      best[pos] = best[pos - 1];
      idx[pos] = idx[pos - 1];
      --pos;
    }
    best[pos] = v;
    idx[pos] = static_cast<int32_t>(e);
  }
}

constexpr int kLanes = 16;  // fixed lanes of the row reductions: vectorised, order fixed

// log-sum-exp of one row: its max, then the sum of exp(l - max), each over kLanes lanes
// (fast_exp, so the loops vectorise; libm's expf per element was most of the kernel's time)
SMELT_MULTIVERSION
float row_lse(const float* l, int64_t E) {
  float mx[kLanes], z[kLanes];
  for (int j = 0; j < kLanes; ++j) {
    mx[j] = -std::numeric_limits<float>::infinity();
    z[j] = 0.0f;
  }
  int64_t e = 0;
  for (; e + kLanes <= E; e += kLanes)
    for (int j = 0; j < kLanes; ++j) mx[j] = mx[j] < l[e + j] ? l[e + j] : mx[j];
  for (; e < E; ++e) mx[e % kLanes] = mx[e % kLanes] < l[e] ? l[e] : mx[e % kLanes];
  float m = mx[0];
  for (int j = 1; j < kLanes; ++j) m = m < mx[j] ? mx[j] : m;
  for (e = 0; e + kLanes <= E; e += kLanes)
    for (int j = 0; j < kLanes; ++j) z[j] += fast_exp(l[e + j] - m);
  for (; e < E; ++e) z[e % kLanes] += fast_exp(l[e] - m);
  float sum = 0.0f;
  for (int j = 0; j < kLanes; ++j) sum += z[j];
  return m + std::log(sum);
}

// d[e] = -exp(l[e] - lse) * c for one row (the softmax part of the router gradient)
SMELT_MULTIVERSION
void scaled_probs(const float* __restrict l, float lse, float c, int64_t E, float* __restrict d) {
  for (int64_t e = 0; e < E; ++e) d[e] = -fast_exp(l[e] - lse) * c;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_route_fwd(
    const at::Tensor& logits_, int64_t top_k, bool renormalize, bool want_sort) {
  TORCH_CHECK_VALUE(logits_.dim() == 2, "route: logits must be (T, E), got shape ", logits_.sizes());
  TORCH_CHECK_TYPE(at::isFloatingType(logits_.scalar_type()), "route: logits must be floating point, got ",
                   logits_.scalar_type());
  const int64_t T = logits_.size(0), E = logits_.size(1), k = top_k;
  TORCH_CHECK_VALUE(k >= 1 && k <= E, "route: top_k must be in [1, E=", E, "], got ", k);
  at::Tensor logits = logits_.to(at::kFloat).contiguous();
  at::Tensor w = smelt::output({T, k}, logits.options());
  at::Tensor ids = smelt::output({T, k}, logits.options().dtype(at::kInt));
  at::Tensor lse = smelt::output({T}, logits.options());
  const float* lp = logits.data_ptr<float>();
  float* wp = w.data_ptr<float>();
  int32_t* ip = ids.data_ptr<int32_t>();
  float* sp = lse.data_ptr<float>();
  const int64_t nchunk = cdiv(T, kRouteChunk);
  std::vector<int32_t> counts(want_sort ? nchunk * E : 0, 0);
  at::parallel_for(0, nchunk, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> best(k);
    for (int64_t c = c0; c < c1; ++c) {
      int32_t* cnt = want_sort ? counts.data() + c * E : nullptr;
      for (int64_t t = c * kRouteChunk; t < std::min(T, (c + 1) * kRouteChunk); ++t) {
        const float* l = lp + t * E;
        const float lse = row_lse(l, E);
        sp[t] = lse;
        top_k_row(l, E, k, best.data(), ip + t * k);
        float* wt = wp + t * k;
        float sum = 0.0f;
        for (int64_t j = 0; j < k; ++j) {
          wt[j] = std::exp(best[j] - lse);
          sum += wt[j];
        }
        if (renormalize)
          for (int64_t j = 0; j < k; ++j) wt[j] /= sum;
        if (cnt)
          for (int64_t j = 0; j < k; ++j) cnt[ip[t * k + j]]++;
      }
    }
  });
  at::Tensor order = smelt::output({want_sort ? T * k : 0}, ids.options());
  at::Tensor rev = smelt::output({want_sort ? T * k : 0}, ids.options());
  at::Tensor offsets = smelt::output({want_sort ? E + 1 : 0}, ids.options());
  if (want_sort) {
    // exclusive prefix over (expert, chunk): chunk c's pairs of expert e start at base[c][e]
    int32_t* off = offsets.data_ptr<int32_t>();
    int32_t run = 0;
    for (int64_t e = 0; e < E; ++e) {
      off[e] = run;
      for (int64_t c = 0; c < nchunk; ++c) {
        const int32_t n = counts[c * E + e];
        counts[c * E + e] = run;
        run += n;
      }
    }
    off[E] = run;
    int32_t* op = order.data_ptr<int32_t>();
    int32_t* rp = rev.data_ptr<int32_t>();
    at::parallel_for(0, nchunk, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        int32_t* base = counts.data() + c * E;
        for (int64_t p = c * kRouteChunk * k; p < std::min(T, (c + 1) * kRouteChunk) * k; ++p) {
          const int32_t r = base[ip[p]]++;
          op[r] = static_cast<int32_t>(p);
          rp[p] = r;
        }
      }
    });
  }
  return {w, ids, lse, order, rev, offsets};
}

at::Tensor moe_route_bwd(const at::Tensor& grad_w_, const at::Tensor& logits_, const at::Tensor& lse_,
                         const at::Tensor& w_, const at::Tensor& ids_, bool renormalize) {
  TORCH_CHECK_VALUE(logits_.dim() == 2 && grad_w_.dim() == 2 && grad_w_.sizes() == ids_.sizes() &&
                        w_.sizes() == ids_.sizes() && grad_w_.size(0) == logits_.size(0) &&
                        lse_.numel() == logits_.size(0),
                    "route backward: grad (T, k), logits (T, E), saved lse (T,), weights and ids (T, k)");
  const int64_t T = logits_.size(0), E = logits_.size(1), k = ids_.size(1);
  at::Tensor logits = logits_.to(at::kFloat).contiguous(), g = grad_w_.to(at::kFloat).contiguous();
  at::Tensor lse = lse_.contiguous(), w = w_.contiguous(), ids = ids_.contiguous();
  at::Tensor dl = smelt::output({T, E}, logits.options());
  const float *lp = logits.data_ptr<float>(), *gp = g.data_ptr<float>(), *sp = lse.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const int32_t* ip = ids.data_ptr<int32_t>();
  float* dp = dl.data_ptr<float>();
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    std::vector<float> s(k), ds(k);
    for (int64_t t = t0; t < t1; ++t) {
      const float* l = lp + t * E;
      const float* gt = gp + t * k;
      const int32_t* it = ip + t * k;
      float S = 0.0f, gw = 0.0f;
      for (int64_t j = 0; j < k; ++j) {
        s[j] = std::exp(l[it[j]] - sp[t]);
        S += s[j];
        gw += gt[j] * wp[t * k + j];
      }
      float c = 0.0f;
      for (int64_t j = 0; j < k; ++j) {
        ds[j] = renormalize ? (gt[j] - gw) / S : gt[j];
        c += ds[j] * s[j];
      }
      float* d = dp + t * E;
      scaled_probs(l, sp[t], c, E, d);
      for (int64_t j = 0; j < k; ++j) d[it[j]] += s[j] * ds[j];
    }
  });
  return dl;
}

}  // namespace
}  // namespace smelt_moe

TORCH_LIBRARY_FRAGMENT(smelt_cpu, m) {
  m.def(
      "moe_route_fwd(Tensor logits, int top_k, bool renormalize, bool want_sort)"
      " -> (Tensor weights, Tensor ids, Tensor lse, Tensor order, Tensor rev, Tensor offsets)");
  m.def("moe_route_bwd(Tensor grad_weights, Tensor logits, Tensor lse, Tensor weights, Tensor ids, bool renormalize)"
        " -> Tensor");
}

TORCH_LIBRARY_IMPL(smelt_cpu, CPU, m) {
  m.impl("moe_route_fwd", &smelt_moe::moe_route_fwd);
  m.impl("moe_route_bwd", &smelt_moe::moe_route_bwd);
}
