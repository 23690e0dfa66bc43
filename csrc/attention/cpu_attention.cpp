// Fused segment attention on the CPU, forward and backward (the "cpu" attention backend,
// smelt_kernels/attention/cpu.py).
//
// Layouts: q, o (B, Tq, Hq, D); k, v (B, Tk, Hkv, D); the Tq queries are the last Tq
// positions; start (B, Tk) int32, the first position of each position's segment. Query p
// sees keys start(p)..p, and with a window only those after p - window, and with key_ok
// (B, Tk) bool only the keys it keeps. lse and psink are (B, Hq, Tq) fp32. A query that sees
// no key (key_ok clears all of its interval) gets o = 0, lse = -inf, psink = 0.
//
// Scheme (flash attention, with the segment structure and GQA folded into the tiling):
// * Work items are (batch row, KV head, block of query positions). The G query heads of the
//   KV head are rows (t - t0) * G + g of one block, so every K/V tile is read once for all
//   of them. A block visits only the key tiles between its first query's segment start and
//   its last query, from the top down, and within a tile only the rows whose interval
//   [start(p), p] meets it; masked scores are set to -inf only in the tiles that need it.
// * Scores are kept in log2 units (q is scaled by scale * log2 e), with an online softmax
//   per row and a vectorised 2^x. LSE is returned in natural log; psink is the probability
//   on the segment's first key, from that key's score and the row's final LSE.
// * Optional features, each free when unused: a window raises each query's first key (the
//   forward's key tiles start at the block's first query's, the backward's query blocks end at
//   a unit's last key's last query); key_ok's holes are masked with the rest (a tile without
//   holes takes the plain path, a tile of cleared keys is skipped); softcap turns each score
//   tile into cap * tanh(s / cap) before the softmax (cap in the log2 units of the scores, the
//   same cap), and the backward multiplies dS by 1 - tanh^2 of the uncapped score.
// * Backward: delta = rowsum(dO * O); one pass that computes each block of probabilities once
//   (from the LSE) and from it dV, dK and dQ. A work unit is a chunk of one segment's keys and
//   every query that sees them; it owns the chunk's dK and dV, and gives each query one dQ
//   share, added in chunk order (see run_backward). No atomics: every output element is summed
//   by one thread in a fixed order, so results are bitwise the same for any thread count.
// * Inputs are widened to fp32 once per call (in the forward K also laid out transposed by
//   key panels, (D, 32) per 32 keys; the backward transposes each work unit's K, V panels),
//   an O(T D) pass; the O(T^2 D) work runs on fp32 in registers with FMA. 16-bit inputs
//   therefore compute in fp32 (no AMX path here); outputs are rounded once at the end.
// * The loops (cpu_attention_body.h) are compiled three times, for AVX-512, AVX2 + FMA and
//   the baseline, and picked at load time (SMELT_ATTENTION_ISA=avx2|generic forces a lower
//   one, for tests and comparisons; =avx2-wide runs the AVX-512 variant's code on AVX2).
#include <ATen/ATen.h>
#include "../env.h"
#include "../settings.h"
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include <memory>
#include <vector>

#include "../cpu_alloc.h"
#include "../cpu_transpose.h"

namespace smelt_att {

// Keys per key panel, the (D, kPanel) blocks of K^T (and in the backward V^T) that the score
// micro-tiles read (their column block, CB in cpu_attention_body.h).
constexpr int64_t kPanel = 32;

struct Problem {
  int64_t B = 0, Tq = 0, Tk = 0, Hq = 0, Hkv = 0, G = 0, D = 0;
  int64_t NP = 0;  // key panels per (b, KV head): cdiv(Tk, kPanel)
  int64_t BK = 64;  // keys per tile (score buffer row stride)
  int64_t BQ = 16;  // query positions per block
  float scale = 1.0f, qscale = 1.0f;
  const float* q = nullptr;     // (B, Tq, Hq, D)
  const float* dout = nullptr;  // (B, Tq, Hq, D)
  const float* k = nullptr;     // (B, Hkv, Tk, D) (backward)
  const float* v = nullptr;     // (B, Hkv, Tk, D)
  const float* kp = nullptr;    // (B, Hkv, NP, D, kPanel): K^T by panels, zero past Tk (forward)
  const float* lse = nullptr;   // (B, Hq, Tq), natural log
  const float* delta = nullptr; // (B, Tq, Hq)
  const int32_t* start = nullptr;  // (B, Tk)
  const int32_t* end = nullptr;    // (B, Tk)
  int64_t window = 0;                // > 0: query p sees keys after p - window only
  const uint8_t* key_ok = nullptr;    // (B, Tk) bool: keys it clears are seen by no query
  const int32_t* ok_count = nullptr;  // (B, Tk + 1): keys key_ok keeps before each position
  float cap = 0.0f, icap = 0.0f;      // softcap in log2 units (softcap * log2 e), 1 / it; 0: none
  // (B, Hkv, NP) forward: whether each key panel of V holds only finite values (1, 0), or
  // -1 until a masked tile first asks (see v_tile_finite)
  std::atomic<int8_t>* v_ok = nullptr;
};

struct Buffers {
  std::vector<float> q, o, s, dp, dov, stat1, stat2, acc1, acc2, kp, vp, sink, ok;
};
Buffers& buffers() {
  thread_local Buffers b;
  return b;
}
float* grow(std::vector<float>& v, int64_t n) { return smelt::grow(v, n, "an attention work buffer"); }

// One key panel: rows x[0..n) (row stride ld, n <= kPanel) as (D, kPanel) at dst, zero past n.
void key_panel(const float* x, int64_t ld, int64_t n, int64_t D, float* dst) {
  if (n > 0)
    smelt::transpose32(reinterpret_cast<const uint32_t*>(x), ld, n, D, reinterpret_cast<uint32_t*>(dst), kPanel);
  if (n < kPanel)
    for (int64_t d = 0; d < D; ++d) std::fill(dst + d * kPanel + n, dst + (d + 1) * kPanel, 0.0f);
}

}  // namespace smelt_att

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SMELT_ATT_X86 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")
namespace smelt_att::avx512 {
constexpr int kW = 16, kRA = 7, kRB = 6;
#include "cpu_attention_body.h"
}  // namespace smelt_att::avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace smelt_att::avx2 {
constexpr int kW = 8, kRA = 3, kRB = 3;
#include "cpu_attention_body.h"
}  // namespace smelt_att::avx2

// The AVX-512 variant's code (16-float vectors, its micro-tile sizes) on AVX2: only chosen
// through SMELT_ATTENTION_ISA=avx2-wide, so its logic is tested where AVX-512 is missing.
namespace smelt_att::avx2_wide {
constexpr int kW = 16, kRA = 7, kRB = 6;
#include "cpu_attention_body.h"
}  // namespace smelt_att::avx2_wide
#pragma GCC pop_options
#endif

namespace smelt_att::generic {
constexpr int kW = 8, kRA = 2, kRB = 2;
#include "cpu_attention_body.h"
}  // namespace smelt_att::generic

namespace smelt_att {
namespace {

struct Isa {
  const char* name;
  void (*forward)(const Problem&, int64_t, int64_t, int64_t, int64_t, float*, float*, float*);
  void (*unit)(const Problem&, int64_t, int64_t, int64_t, int64_t, int64_t, float*, float*, float*,
               int64_t, float);
};

const Isa& isa() {
  static const Isa chosen = [] {
    const std::string want = smelt::env("SMELT_ATTENTION_ISA");
    const Isa generic_isa{"generic", &generic::forward_block, &generic::backward_unit};
#ifdef SMELT_ATT_X86
    const Isa avx512_isa{"avx512", &avx512::forward_block, &avx512::backward_unit};
    const Isa avx2_isa{"avx2", &avx2::forward_block, &avx2::backward_unit};
    const bool has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
    const bool has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const Isa wide_isa{"avx2-wide", &avx2_wide::forward_block, &avx2_wide::backward_unit};
    if (want == "avx2-wide" && has2) return wide_isa;
    if (want != "generic") {
      if (has512 && want != "avx2") return avx512_isa;
      if (has2) return avx2_isa;
    }
#endif
    return generic_isa;
  }();
  return chosen;
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const c10::optional<at::Tensor>& start) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "segment_attention_cpu: q, k, v must be 4-d (B, T, H, D)");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "segment_attention_cpu: CPU tensors only");
  TORCH_CHECK(k.sizes() == v.sizes(), "segment_attention_cpu: k and v shapes differ");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(3),
              "segment_attention_cpu: q and k disagree on batch or head dim");
  TORCH_CHECK(q.size(1) <= k.size(1), "segment_attention_cpu: more queries than keys");
  TORCH_CHECK(k.size(2) > 0 && q.size(2) % k.size(2) == 0,
              "segment_attention_cpu: query heads must be a multiple of KV heads");
  TORCH_CHECK(q.size(3) % 8 == 0 && q.size(3) > 0, "segment_attention_cpu: head dim must be a multiple of 8");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "segment_attention_cpu: q, k, v dtypes differ");
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "segment_attention_cpu: float32, bfloat16 or float16 only");
  if (start.has_value()) {
    TORCH_CHECK(start->scalar_type() == at::kInt && start->dim() == 2 && start->size(0) == k.size(0) &&
                    start->size(1) == k.size(1),
                "segment_attention_cpu: start must be int32 (B, Tk)");
  }
}

// The optional features: window >= 0 (0: none), key_ok bool (B, Tk) on the CPU or None,
// softcap finite and >= 0 (0: none); set on P (key_ok as its bytes and their prefix counts,
// kept in ok_count; a window that reaches past the first key is none).
void features(Problem& P, int64_t window, const c10::optional<at::Tensor>& key_ok, double softcap,
              at::Tensor& ok_bytes, std::vector<int32_t>& ok_count) {
  TORCH_CHECK_VALUE(window >= 0, "segment_attention_cpu: window must be >= 0 (0: none), got ", window);
  TORCH_CHECK_VALUE(std::isfinite(softcap) && softcap >= 0.0,
                    "segment_attention_cpu: softcap must be finite and >= 0 (0: none), got ", softcap);
  P.window = window >= P.Tk ? 0 : window;
  P.cap = static_cast<float>(softcap * 1.4426950408889634);
  P.icap = softcap > 0.0 ? 1.0f / P.cap : 0.0f;
  if (!key_ok.has_value()) return;
  const at::Tensor& m = *key_ok;
  TORCH_CHECK_VALUE(m.scalar_type() == at::kBool && m.dim() == 2 && m.size(0) == P.B && m.size(1) == P.Tk &&
                        m.device().is_cpu(),
                    "segment_attention_cpu: key_ok must be a bool (B, Tk) = (", P.B, ", ", P.Tk,
                    ") CPU tensor, got ", m.scalar_type(), " ", m.sizes(), " on ", m.device());
  ok_bytes = m.contiguous();
  const uint8_t* ok = reinterpret_cast<const uint8_t*>(ok_bytes.data_ptr<bool>());
  ok_count = smelt::sized<int32_t>(P.B * (P.Tk + 1), "the key_ok counts");
  for (int64_t b = 0; b < P.B; ++b) {
    int32_t* c = ok_count.data() + b * (P.Tk + 1);
    c[0] = 0;
    for (int64_t j = 0; j < P.Tk; ++j) c[j + 1] = c[j] + (ok[b * P.Tk + j] ? 1 : 0);
  }
  if (ok_count.empty() || P.B == 0) return;
  P.key_ok = ok;
  P.ok_count = ok_count.data();
}

void check_out(const at::Tensor& t, at::IntArrayRef shape, at::ScalarType dt, const char* name) {
  TORCH_CHECK(t.sizes() == shape && t.scalar_type() == dt && t.device().is_cpu(),
              "segment_attention_cpu: output ", name, " has the wrong shape or dtype");
}

// Segment starts (validated: 0 <= start(p) <= p, one segment per run) and ends, (B, Tk).
void bounds(const c10::optional<at::Tensor>& start, int64_t B, int64_t Tk, std::vector<int32_t>& st,
            std::vector<int32_t>& en) {
  st = smelt::sized<int32_t>(B * Tk, "the segment bounds");
  en = smelt::sized<int32_t>(B * Tk, "the segment bounds");
  if (start.has_value()) {
    const at::Tensor s = start->contiguous();
    std::memcpy(st.data(), s.data_ptr<int32_t>(), B * Tk * sizeof(int32_t));
  }
  for (int64_t b = 0; b < B; ++b) {
    const int32_t* s = st.data() + b * Tk;
    for (int64_t p = 0; p < Tk; ++p) {
      const bool ok = s[p] >= 0 && s[p] <= p && (p == 0 || s[p] == s[p - 1] || s[p] == p);
      TORCH_CHECK(ok, "segment_attention_cpu: start[", b, ", ", p, "] = ", s[p],
                  " is not a segment start at or before its position");
    }
    int32_t* e = en.data() + b * Tk;
    for (int64_t p = Tk - 1; p >= 0; --p)
      e[p] = (p == Tk - 1 || s[p + 1] != s[p]) ? static_cast<int32_t>(p) : e[p + 1];
  }
}

// int32 (B, T) first position of every position's segment, from integer segment ids (B, T)
// that must not decrease along T (ValueError naming the first drop otherwise). One pass on
// the calling thread: what segment_bounds in ops.py computes with a dozen ATen ops, at the
// cost of none of them, for the per-layer calls of a decode step.
at::Tensor segment_starts(const at::Tensor& ids_) {
  TORCH_CHECK_VALUE(ids_.dim() == 2, "segment_ids must be 2-D (B, T), got shape ", ids_.sizes());
  TORCH_CHECK_TYPE(at::isIntegralType(ids_.scalar_type(), /*includeBool=*/false),
                   "segment_ids must be an integer tensor, got ", ids_.scalar_type());
  const at::Tensor ids = ids_.to(at::kLong).contiguous();
  const int64_t B = ids.size(0), T = ids.size(1);
  TORCH_CHECK_VALUE(T <= std::numeric_limits<int32_t>::max(), "segment_ids: T = ", T, " does not fit int32 positions");
  at::Tensor start = smelt::output({B, T}, ids.options().dtype(at::kInt));
  const int64_t* id = ids.data_ptr<int64_t>();
  int32_t* st = start.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* r = id + b * T;
    int32_t* s = st + b * T;
    int32_t cur = 0;
    for (int64_t p = 0; p < T; ++p) {
      if (p > 0 && r[p] != r[p - 1]) {
        TORCH_CHECK_VALUE(r[p] > r[p - 1], "segment_ids must be non-decreasing along T; row ", b,
                          " goes from ", r[p - 1], " at position ", p - 1, " to ", r[p], " at ", p);
        cur = static_cast<int32_t>(p);
      }
      s[p] = cur;
    }
  }
  return start;
}

// fp32 x with a unit stride inside D (x itself when it has one, else a contiguous fp32 copy).
at::Tensor float_rows(const at::Tensor& x) {
  return x.scalar_type() == at::kFloat && x.stride(3) == 1 ? x : x.to(at::kFloat).contiguous();
}

// f(i, src, ld) for every (b, h) of x (B, Tk, H, D) from float_rows, in parallel: i = b * H + h,
// src = &x[b][0][h][0], ld = x's row stride (a slice of a longer cache is read where it lies).
template <typename F>
void per_head(const at::Tensor& x, F&& f) {
  const float* xp = x.data_ptr<float>();
  const int64_t H = x.size(2), sb = x.stride(0), st = x.stride(1), sh = x.stride(2);
  at::parallel_for(0, x.size(0) * H, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) f(i, xp + (i / H) * sb + (i % H) * sh, st);
  });
}

// (B, H, NP, D, kPanel) fp32 copy of x (B, Tk, H, D): panel j holds keys j*kPanel.. as
// (D, kPanel), zero past Tk. A score micro-tile then reads its keys as one contiguous run
// (D * 128 bytes) instead of D rows a (D, Tk) K^T row apart, one page each: on that layout
// the micro-kernel stalled on those loads and cost as much at D = 64 as at D = 96.
at::Tensor key_panels(const at::Tensor& x_, int64_t NP) {
  const at::Tensor x = float_rows(x_);
  const int64_t Tk = x.size(1), D = x.size(3);
  at::Tensor out = smelt::empty({x.size(0), x.size(2), NP, D, kPanel}, x.options(), "the key panels");
  float* op = out.data_ptr<float>();
  per_head(x, [&](int64_t i, const float* src, int64_t ld) {
    for (int64_t j = 0; j < NP; ++j)
      key_panel(src + j * kPanel * ld, ld, std::min(kPanel, Tk - j * kPanel), D, op + (i * NP + j) * D * kPanel);
  });
  return out;
}

Problem problem(const at::Tensor& q, const at::Tensor& k, double scale) {
  Problem P;
  P.B = q.size(0);
  P.Tq = q.size(1);
  P.Hq = q.size(2);
  P.D = q.size(3);
  P.Tk = k.size(1);
  P.Hkv = k.size(2);
  P.G = P.Hq / P.Hkv;
  P.NP = (P.Tk + kPanel - 1) / kPanel;
  P.BQ = std::max<int64_t>(1, 64 / std::max<int64_t>(1, P.G));
  P.scale = static_cast<float>(scale);
  P.qscale = static_cast<float>(scale * 1.4426950408889634);
  return P;
}

// The intra-op work queue and the backward's work units (chunks of a segment's keys).
#include "cpu_attention_units.h"

at::Tensor as_float(const at::Tensor& x) { return x.to(at::kFloat).contiguous(); }
// (B, H, Tk, D) fp32 of x (B, Tk, H, D): x itself when that is already its layout (one KV
// head, rows packed), else rows of D copied.
at::Tensor kv_major(const at::Tensor& x_) {
  const at::Tensor x = float_rows(x_);
  const at::Tensor xt = x.transpose(1, 2);
  if (xt.is_contiguous()) return xt;
  const int64_t Tk = x.size(1), D = x.size(3);
  at::Tensor out = smelt::empty({x.size(0), x.size(2), Tk, D}, x.options(), "the keys and values in fp32");
  float* op = out.data_ptr<float>();
  per_head(x, [&](int64_t i, const float* src, int64_t ld) {
    float* dst = op + i * Tk * D;
    for (int64_t t = 0; t < Tk; ++t) std::memcpy(dst + t * D, src + t * ld, D * sizeof(float));
  });
  return out;
}

// fp32 contiguous buffer the kernel writes for out (out itself when it already is one).
at::Tensor staging(const at::Tensor& out) {
  if (out.scalar_type() == at::kFloat && out.is_contiguous()) return out;
  return smelt::output(out.sizes(), out.options().dtype(at::kFloat));
}

void forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& start,
             double scale, at::Tensor o, at::Tensor lse, at::Tensor psink, int64_t window,
             const c10::optional<at::Tensor>& key_ok, double softcap) {
  check_inputs(q, k, v, start);
  Problem P = problem(q, k, scale);
  at::Tensor ok_bytes;
  std::vector<int32_t> ok_count;
  features(P, window, key_ok, softcap, ok_bytes, ok_count);
  check_out(o, q.sizes(), q.scalar_type(), "o");
  check_out(lse, {P.B, P.Hq, P.Tq}, at::kFloat, "lse");
  check_out(psink, {P.B, P.Hq, P.Tq}, at::kFloat, "psink");
  TORCH_CHECK(lse.is_contiguous() && psink.is_contiguous(), "segment_attention_cpu: lse/psink not contiguous");
  if (P.Tq == 0 || P.Hq == 0 || P.B == 0) return;
  std::vector<int32_t> st, en;
  bounds(start, P.B, P.Tk, st, en);
  const at::Tensor qf = as_float(q), vf = kv_major(v), kp = key_panels(k, P.NP);
  const int64_t n_panels = P.B * P.Hkv * P.NP;
  std::unique_ptr<std::atomic<int8_t>[]> v_ok(new std::atomic<int8_t>[n_panels]);
  for (int64_t i = 0; i < n_panels; ++i) v_ok[i].store(-1, std::memory_order_relaxed);
  P.v_ok = v_ok.get();
  P.q = qf.data_ptr<float>();
  P.v = vf.data_ptr<float>();
  P.kp = kp.data_ptr<float>();
  P.start = st.data();
  P.end = en.data();
  at::Tensor of = staging(o);
  float* op = of.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  float* sp = psink.data_ptr<float>();
  std::vector<int64_t> items, cost;
  query_items(P, st, items, cost);
  const Isa& I = isa();
  run_items(cost, [&](int64_t i) {
    const int64_t bh = items[i] / P.Tq, t0 = items[i] % P.Tq;
    I.forward(P, bh / P.Hkv, bh % P.Hkv, t0, std::min(P.Tq, t0 + P.BQ), op, lp, sp);
  });
  if (!of.is_same(o)) o.copy_(of);
}

void segment_attention_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const c10::optional<at::Tensor>& start, double scale, at::Tensor o,
                           at::Tensor lse, at::Tensor psink, int64_t window,
                           const c10::optional<at::Tensor>& key_ok, double softcap) {
  smelt::named_op("segment_attention (cpu forward)",
                  [&] { forward(q, k, v, start, scale, o, lse, psink, window, key_ok, softcap); });
}

// The forward with its outputs allocated here, (o, lse): the inference entry point, which
// calls that need no gradient and no sink statistic take without the Python custom op.
std::tuple<at::Tensor, at::Tensor> segment_attention_infer(const at::Tensor& q, const at::Tensor& k,
                                                           const at::Tensor& v,
                                                           const c10::optional<at::Tensor>& start,
                                                           double scale, int64_t window,
                                                           const c10::optional<at::Tensor>& key_ok,
                                                           double softcap) {
  TORCH_CHECK_VALUE(q.dim() == 4, "segment_attention_cpu: q must be (B, Tq, Hq, D), got ", q.sizes());
  return smelt::named_op("segment_attention (cpu forward)", [&]() -> std::tuple<at::Tensor, at::Tensor> {
    at::Tensor o = smelt::output(q.sizes(), q.options());
    at::Tensor lse = smelt::output({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
    at::Tensor psink = smelt::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
    forward(q, k, v, start, scale, o, lse, psink, window, key_ok, softcap);
    return {o, lse};
  });
}

void backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& o, const at::Tensor& lse, const c10::optional<at::Tensor>& start, double scale,
              at::Tensor dq, at::Tensor dk, at::Tensor dv, int64_t window,
              const c10::optional<at::Tensor>& key_ok, double softcap) {
  check_inputs(q, k, v, start);
  Problem P = problem(q, k, scale);
  at::Tensor ok_bytes;
  std::vector<int32_t> ok_count;
  features(P, window, key_ok, softcap, ok_bytes, ok_count);
  TORCH_CHECK(dout.sizes() == q.sizes() && o.sizes() == q.sizes(), "segment_attention_cpu: do/o shape");
  check_out(lse, {P.B, P.Hq, P.Tq}, at::kFloat, "lse");
  check_out(dq, q.sizes(), q.scalar_type(), "dq");
  check_out(dk, k.sizes(), k.scalar_type(), "dk");
  check_out(dv, v.sizes(), v.scalar_type(), "dv");
  if (P.B == 0 || P.Hq == 0 || P.Tq == 0) {  // no query: no gradient reaches a key
    dk.zero_();
    dv.zero_();
    return;
  }
  std::vector<int32_t> st, en;
  bounds(start, P.B, P.Tk, st, en);
  const at::Tensor qf = as_float(q), dof = as_float(dout), of = as_float(o), lsef = lse.contiguous();
  const at::Tensor kf = kv_major(k), vf = kv_major(v);
  // delta = rowsum(dO * O), one row per (b, t, head), summed in order
  std::vector<float> delta = smelt::sized<float>(P.B * P.Tq * P.Hq, "the backward's row sums");
  const float* dp = dof.data_ptr<float>();
  const float* opf = of.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(delta.size()), 256, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float s = 0.0f;
      for (int64_t d = 0; d < P.D; ++d) s += dp[r * P.D + d] * opf[r * P.D + d];
      delta[r] = s;
    }
  });
  P.q = qf.data_ptr<float>();
  P.dout = dp;
  P.k = kf.data_ptr<float>();
  P.v = vf.data_ptr<float>();
  P.lse = lsef.data_ptr<float>();
  P.delta = delta.data();
  P.start = st.data();
  P.end = en.data();
  at::Tensor dqf = staging(dq), dkf = staging(dk), dvf = staging(dv);
  float* dqp = dqf.data_ptr<float>();
  float* dkp = dkf.data_ptr<float>();
  float* dvp = dvf.data_ptr<float>();
  run_backward(P, en, dqp, dkp, dvp);
  if (!dqf.is_same(dq)) dq.copy_(dqf);
  if (!dkf.is_same(dk)) dk.copy_(dkf);
  if (!dvf.is_same(dv)) dv.copy_(dvf);
}

void segment_attention_bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& v, const at::Tensor& o, const at::Tensor& lse,
                           const c10::optional<at::Tensor>& start, double scale, at::Tensor dq,
                           at::Tensor dk, at::Tensor dv, int64_t window,
                           const c10::optional<at::Tensor>& key_ok, double softcap) {
  smelt::named_op("segment_attention (cpu backward)",
                  [&] { backward(dout, q, k, v, o, lse, start, scale, dq, dk, dv, window, key_ok, softcap); });
}

}  // namespace

std::string attention_isa() { return isa().name; }

}  // namespace smelt_att

TORCH_LIBRARY_FRAGMENT(smelt_cpu, m) {
  m.def("segment_attention_isa() -> str", &smelt_att::attention_isa);
  m.def("segment_starts(Tensor segment_ids) -> Tensor");
  m.def(
      "segment_attention_infer(Tensor q, Tensor k, Tensor v, Tensor? start, float scale, int window=0,"
      " Tensor? key_ok=None, float softcap=0.0) -> (Tensor o, Tensor lse)");
  m.def(
      "segment_attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? start, float scale,"
      " Tensor(a!) o, Tensor(b!) lse, Tensor(c!) psink, int window=0, Tensor? key_ok=None,"
      " float softcap=0.0) -> ()");
  m.def(
      "segment_attention_bwd(Tensor grad_o, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse,"
      " Tensor? start, float scale, Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, int window=0,"
      " Tensor? key_ok=None, float softcap=0.0) -> ()");
}

TORCH_LIBRARY_IMPL(smelt_cpu, CPU, m) {
  m.impl("segment_starts", &smelt_att::segment_starts);
  m.impl("segment_attention_infer", &smelt_att::segment_attention_infer);
  m.impl("segment_attention_fwd", &smelt_att::segment_attention_fwd);
  m.impl("segment_attention_bwd", &smelt_att::segment_attention_bwd);
}
