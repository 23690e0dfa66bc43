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
#include "../env.h"
#include "../settings.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "../cpu_alloc.h"
#include "../cpu_blas.h"

namespace smelt_moe {
namespace {

constexpr int64_t kRouteChunk = 256;  // tokens per counting-sort chunk (fixed, not per thread)

// The k best (value, expert) of one row, best first; ties: lower expert first. The plain
// scan: the portable path, and the one rows with NaN or too few finite logits take.
inline void top_k_scan(const float* l, int64_t E, int64_t k, float* best, int32_t* idx) {
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

// The vector forms give the scan's result exactly, about 5x faster (E 104, k 8: the scan's
// insertions, ~28 a row with a data-dependent branch each, were most of the routing kernel's
// time). First a threshold: the smallest of the maxima of G strided groups of logits (G = 8
// or 16 lanes, G >= k) has at least G >= k logits at or above it, so the top k all are too.
// Then only those candidates (~12 a row for random logits) are inserted, in index order, into
// a sorted list held in one vector register: compare, shift the lanes below the insertion
// point by one, blend; no branch on the values. Equal values stay behind those already
// listed, so ties go to the lower expert index as in the scan. A row with NaN, or whose
// threshold is -inf, returns false and takes the scan.
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx512f"))) bool top_k_avx512(const float* l, int64_t E, int64_t k, float* best,
                                                    int32_t* idx) {
  const int64_t E16 = E / 16 * 16;  // caller: E >= 16, k <= 16
  __m512 mx = _mm512_loadu_ps(l);
  __mmask16 nan = _mm512_cmp_ps_mask(mx, mx, _CMP_UNORD_Q);
  for (int64_t e = 16; e < E16; e += 16) {
    const __m512 v = _mm512_loadu_ps(l + e);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    mx = _mm512_mask_max_ps(mx, 0xffff, mx, v);  // (the unmasked form warns under GCC 12)
  }
  const __mmask16 tail = static_cast<__mmask16>((1u << (E - E16)) - 1u);
  const __m512 vt = _mm512_maskz_loadu_ps(tail, l + E16);
  nan |= _mm512_mask_cmp_ps_mask(tail, vt, vt, _CMP_UNORD_Q);
  if (nan) return false;
  // k <= 8: 8 groups (lanes j and j + 8 merged), so fewer candidates pass
  alignas(64) float m[16];
  _mm512_store_ps(m, mx);
  float thr = std::numeric_limits<float>::infinity();
  for (int j = 0; j < 8; ++j) thr = std::min(thr, k <= 8 ? std::max(m[j], m[j + 8]) : std::min(m[j], m[j + 8]));
  if (!(thr > -std::numeric_limits<float>::infinity())) return false;
  const __m512 th = _mm512_set1_ps(thr);
  const __m512i down = _mm512_set_epi32(14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 0);
  __m512 list = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i ids = _mm512_set1_epi32(-1);
  for (int64_t e = 0; e < E; e += 16) {
    const __mmask16 in = E - e >= 16 ? __mmask16(0xffff) : tail;
    for (uint32_t c = _mm512_mask_cmp_ps_mask(in, _mm512_maskz_loadu_ps(in, l + e), th, _CMP_GE_OQ); c != 0;
         c &= c - 1) {
      const int64_t j = e + __builtin_ctz(c);
      const __m512 v = _mm512_set1_ps(l[j]);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, list, _CMP_GT_OQ);  // the lanes v goes before
      const __mmask16 shifted = static_cast<__mmask16>(gt << 1);     // ... that take their left neighbour
      list = _mm512_mask_permutexvar_ps(_mm512_mask_blend_ps(gt, list, v), shifted, down, list);
      ids = _mm512_mask_permutexvar_epi32(_mm512_mask_blend_epi32(gt, ids, _mm512_set1_epi32(static_cast<int32_t>(j))),
                                          shifted, down, ids);
    }
  }
  const __mmask16 out = static_cast<__mmask16>((1u << k) - 1u);
  _mm512_mask_storeu_ps(best, out, list);
  _mm512_mask_storeu_epi32(idx, out, ids);
  return true;
}

// One insertion into the sorted 8-lane list (values and, as float bits, expert ids).
__attribute__((target("avx2"), always_inline)) inline void insert_avx2(float value, int32_t e, __m256& list,
                                                                      __m256& ids) {
  const __m256i down = _mm256_setr_epi32(0, 0, 1, 2, 3, 4, 5, 6);
  const __m256 not_first = _mm256_castsi256_ps(_mm256_setr_epi32(0, -1, -1, -1, -1, -1, -1, -1));
  const __m256 v = _mm256_set1_ps(value);
  const __m256 gt = _mm256_cmp_ps(v, list, _CMP_GT_OQ);
  const __m256 shifted = _mm256_and_ps(_mm256_permutevar8x32_ps(gt, down), not_first);
  list = _mm256_blendv_ps(_mm256_blendv_ps(list, v, gt), _mm256_permutevar8x32_ps(list, down), shifted);
  const __m256 ve = _mm256_castsi256_ps(_mm256_set1_epi32(e));
  ids = _mm256_blendv_ps(_mm256_blendv_ps(ids, ve, gt), _mm256_permutevar8x32_ps(ids, down), shifted);
}

__attribute__((target("avx2"))) bool top_k_avx2(const float* l, int64_t E, int64_t k, float* best, int32_t* idx) {
  const int64_t E8 = E / 8 * 8;  // caller: E >= 8, k <= 8
  __m256 mx = _mm256_loadu_ps(l);
  __m256 nan = _mm256_cmp_ps(mx, mx, _CMP_UNORD_Q);
  for (int64_t e = 8; e < E8; e += 8) {
    const __m256 v = _mm256_loadu_ps(l + e);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    mx = _mm256_max_ps(mx, v);
  }
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t e = E8; e < E; ++e) has_nan |= std::isnan(l[e]);
  if (has_nan) return false;
  __m128 m4 = _mm_min_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_min_ps(m4, _mm_movehl_ps(m4, m4));
  const float thr = _mm_cvtss_f32(_mm_min_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
  if (!(thr > -std::numeric_limits<float>::infinity())) return false;
  const __m256 th = _mm256_set1_ps(thr);
  __m256 list = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 ids = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  for (int64_t e = 0; e < E8; e += 8)
    for (uint32_t c = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(l + e), th, _CMP_GE_OQ)); c != 0; c &= c - 1)
      insert_avx2(l[e + __builtin_ctz(c)], static_cast<int32_t>(e + __builtin_ctz(c)), list, ids);
  for (int64_t e = E8; e < E; ++e)
    if (l[e] >= thr) insert_avx2(l[e], static_cast<int32_t>(e), list, ids);
  alignas(32) float b[8];
  alignas(32) int32_t i[8];
  _mm256_store_ps(b, list);
  _mm256_store_ps(reinterpret_cast<float*>(i), ids);
  for (int64_t j = 0; j < k; ++j) best[j] = b[j], idx[j] = i[j];
  return true;
}
#endif

// Which top-k form a call runs: the widest vector form the CPU has, or a lower one that
// SMELT_ROUTE_ISA=avx2|generic forces (read per call, so tests can compare them in one
// process).
enum class TopKIsa { kGeneric, kAvx2, kAvx512 };

TopKIsa top_k_isa() {
  const std::string want = smelt::env("SMELT_ROUTE_ISA");
  TopKIsa isa = cpu_has_avx512() ? TopKIsa::kAvx512 : cpu_has_avx2() ? TopKIsa::kAvx2 : TopKIsa::kGeneric;
  if (want == "generic") return TopKIsa::kGeneric;
  if (want == "avx2" && isa == TopKIsa::kAvx512) return TopKIsa::kAvx2;
  return isa;
}

// The k best of one row in the chosen form; rows it does not take run the scan.
inline void top_k_row(TopKIsa isa, const float* l, int64_t E, int64_t k, float* best, int32_t* idx) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (isa == TopKIsa::kAvx512 && E >= 16 && k <= 16 && top_k_avx512(l, E, k, best, idx)) return;
  if (isa == TopKIsa::kAvx2 && E >= 8 && k <= 8 && top_k_avx2(l, E, k, best, idx)) return;
#endif
  top_k_scan(l, E, k, best, idx);
}

constexpr int kLanes = 16;  // fixed lanes of the row reductions: vectorised, order fixed

// log-sum-exp of one row: its max, then the sum of exp(l - max), each over kLanes lanes
// (fast_exp, so the loops vectorise; libm's expf per element was most of the kernel's time).
// NaN where the softmax of the row is NaN (a NaN logit anywhere, a +inf one, or all -inf),
// so that every weight and gradient of such a row comes out NaN as from torch.softmax: the
// max ignores NaN and fast_exp saturates, so a NaN logit is caught on its own.
SMELT_MULTIVERSION
float row_lse(const float* l, int64_t E) {
  float mx[kLanes], z[kLanes], nan[kLanes];
  for (int j = 0; j < kLanes; ++j) {
    mx[j] = -std::numeric_limits<float>::infinity();
    z[j] = 0.0f;
    nan[j] = 0.0f;
  }
  int64_t e = 0;
  for (; e + kLanes <= E; e += kLanes)
    for (int j = 0; j < kLanes; ++j) {
      mx[j] = mx[j] < l[e + j] ? l[e + j] : mx[j];
      nan[j] = l[e + j] != l[e + j] ? 1.0f : nan[j];
    }
  for (; e < E; ++e) {
    mx[e % kLanes] = mx[e % kLanes] < l[e] ? l[e] : mx[e % kLanes];
    nan[e % kLanes] = l[e] != l[e] ? 1.0f : nan[e % kLanes];
  }
  float m = mx[0], any_nan = nan[0];
  for (int j = 1; j < kLanes; ++j) {
    m = m < mx[j] ? mx[j] : m;
    any_nan += nan[j];
  }
  if (any_nan != 0.0f || !(std::abs(m) < std::numeric_limits<float>::infinity()))
    return std::numeric_limits<float>::quiet_NaN();
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

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> route_forward(
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
  std::vector<int32_t> counts = smelt::sized<int32_t>(want_sort ? nchunk * E : 0, "the routing sort's counts");
  const TopKIsa isa = top_k_isa();
  at::parallel_for(0, nchunk, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> best(k);
    for (int64_t c = c0; c < c1; ++c) {
      int32_t* cnt = want_sort ? counts.data() + c * E : nullptr;
      for (int64_t t = c * kRouteChunk; t < std::min(T, (c + 1) * kRouteChunk); ++t) {
        const float* l = lp + t * E;
        const float lse = row_lse(l, E);
        sp[t] = lse;
        top_k_row(isa, l, E, k, best.data(), ip + t * k);
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

at::Tensor route_backward(const at::Tensor& grad_w_, const at::Tensor& logits_, const at::Tensor& lse_,
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

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_route_fwd(
    const at::Tensor& logits, int64_t top_k, bool renormalize, bool want_sort) {
  return smelt::named_op("route (cpu forward)", [&] { return route_forward(logits, top_k, renormalize, want_sort); });
}

at::Tensor moe_route_bwd(const at::Tensor& grad_w, const at::Tensor& logits, const at::Tensor& lse,
                         const at::Tensor& w, const at::Tensor& ids, bool renormalize) {
  return smelt::named_op("route (cpu backward)",
                         [&] { return route_backward(grad_w, logits, lse, w, ids, renormalize); });
}

}  // namespace

std::string route_isa() {
  switch (top_k_isa()) {
    case TopKIsa::kAvx512: return "avx512";
    case TopKIsa::kAvx2: return "avx2";
    default: return "generic";
  }
}

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
