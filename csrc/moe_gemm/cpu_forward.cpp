// Native CPU path of smelt_kernels.moe_gemm.moe_ffn: the routing sort, the forward pass and
// the op registrations (the backward pass is in cpu_backward.cpp).
//
// The T*k (token, slot) pairs are sorted by expert with a stable counting sort. Work is cut
// into items of at most kItemRows sorted rows of one expert, which threads claim one at a
// time. Each item runs its GEMMs on one thread, with SwiGLU applied between the two GEMMs:
//   P[r] = x[tok(r)] @ W1[e]^T                 (pre-activation, kept for backward)
//   O[r] = (silu(P_gate) * P_up)[r] @ W2[e]^T
// and then y[t] = sum_j w[t,j] * O[rev(t,j)], a gather-and-sum in slot order (no atomics).
// An expert with at most few_rows_limit rows (decode, small batches; 6 to 48 by the size of
// its weights and the CPU) runs the few-rows path of cpu_decode.h: dot products against its weights in
// place, nothing packed. Otherwise, in fp32 on an AVX-512 CPU the GEMMs run in the rows
// kernel of cpu_rows.h on the token rows in place; otherwise through the micro-kernel of
// cpu_blas.h on token rows gathered into a cache-resident buffer (the 16-bit types on the
// matrix unit). Every element is computed by
// exactly one item in a fixed order, so the results are bitwise reproducible and do not
// depend on the number of threads.
#include <torch/library.h>

#include <unistd.h>

#include <string>

#include "../cpu_alloc.h"
#include "../settings.h"
#include "cpu_decode.h"
#include "cpu_work.h"

namespace smelt_moe {
namespace {

struct Routing {
  int64_t T = 0, k = 0, E = 0, TK = 0;
  at::Tensor order, rev, offsets;  // int32: (TK,), (TK,), (E + 1,)
};

// Stable counting sort of the (token, slot) pairs by expert. Checks the ids (range, and no
// expert twice in one token's slots) and raises ValueError naming topk_ids.
Routing sort_pairs(const at::Tensor& ids, int64_t E) {
  TORCH_CHECK_VALUE(ids.dim() == 2 && ids.scalar_type() == at::kInt,
                    "topk_ids must be a 2-D int32 tensor, got ", ids.sizes(), " ", ids.scalar_type());
  at::Tensor idc = ids.contiguous();
  Routing R;
  R.T = idc.size(0);
  R.k = idc.size(1);
  R.E = E;
  R.TK = R.T * R.k;
  const int32_t* id = idc.data_ptr<int32_t>();
  std::vector<int64_t> seen = smelt::sized<int64_t>(E, "the routing sort");
  std::vector<int64_t> count = smelt::sized<int64_t>(E + 1, "the routing sort");
  std::fill(seen.begin(), seen.end(), -1);
  for (int64_t t = 0; t < R.T; ++t) {
    for (int64_t j = 0; j < R.k; ++j) {
      int64_t e = id[t * R.k + j];
      TORCH_CHECK_VALUE(e >= 0 && e < E, "moe_ffn: topk_ids must lie in [0, ", E, "): token ", t, " slot ", j,
                        " has ", e);
      TORCH_CHECK_VALUE(seen[e] != t, "moe_ffn: topk_ids has expert ", e, " twice in token ", t,
                        "'s slots; each token must pick distinct experts");
      seen[e] = t;
      count[e + 1]++;
    }
  }
  const auto i32 = at::TensorOptions().dtype(at::kInt);
  R.offsets = smelt::output({E + 1}, i32);
  R.order = smelt::output({R.TK}, i32);
  R.rev = smelt::output({R.TK}, i32);
  int32_t* off = R.offsets.data_ptr<int32_t>();
  int32_t* order = R.order.data_ptr<int32_t>();
  int32_t* rev = R.rev.data_ptr<int32_t>();
  for (int64_t e = 0; e < E; ++e) count[e + 1] += count[e];
  for (int64_t e = 0; e <= E; ++e) off[e] = static_cast<int32_t>(count[e]);
  for (int64_t p = 0; p < R.TK; ++p) {
    int64_t r = count[id[p]]++;
    order[r] = static_cast<int32_t>(p);
    rev[p] = static_cast<int32_t>(r);
  }
  return R;
}

// ---------------------------------------------------------------------------- forward
constexpr int64_t kPanelBytes = 256 * 1024;  // weight panel packed at a time (fits in L2)
// Rows per item: an expert's rows are split only above this, so that most experts are one
// item and read their weights once. Every item transposes its expert's weights into panels,
// so a split expert pays for that twice: at 4096 tokens, top-8 of 64 to 104 experts (~300 to
// ~500 rows each), 1024 instead of 256 took 8-12% off the training forward at the tiny and
// 100M shapes. Items stay many enough to balance the threads (one per expert).
constexpr int64_t kItemRows = 1024;
// fp32 experts with at most this many bytes of weights run in the rows kernel (cpu_rows.h);
// larger ones ran faster on the brgemm panels of the portable path.
constexpr int64_t kRowsKernelBytes = 1024 * 1024;
// A forward whose items read at most this many bytes of weights in all (a decode step of
// small experts) runs on the calling thread.
constexpr int64_t kInlineBytes = 2 * 1024 * 1024;

// The next item's weights are prefetched into L2 while the current item computes when they
// take at most half of it: at many small experts, streaming each expert's weights from memory
// would otherwise stall the transposes that lay them out. A few-rows (decode) item, which
// streams its expert's weights once, prefetches only the first prefetch_limit() / 2 bytes of
// the next expert's W1 and prefetch_limit() / 4 of its W2: each expert's row streams start
// cold, and in decode, where every expert is such a start, that latency adds up (tiny pair
// at batch 8, both models in one process: 1-4% off the baseline's step, 4-7% off SMELT's,
// whose experts are smaller).
inline int64_t prefetch_limit() {
  static const int64_t limit = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return static_cast<int64_t>(l2 > 0 ? l2 / 2 : 512 * 1024);
  }();
  return limit;
}

// Which forward kernel an (H, d_e, dtype) layer runs: "rows" (the rows kernel, fp32 on an
// AVX-512 CPU with experts of at most kRowsKernelBytes), "panels" (brgemm on packed panels,
// fp32 compute) or "panels-16bit" (brgemm on the matrix unit).
std::string forward_kernel(int64_t H, int64_t de, at::ScalarType dtype) {
  const int64_t bytes = 3 * H * de * static_cast<int64_t>(c10::elementSize(dtype));
  if (dtype == at::kFloat) return use_rows_kernel() && bytes <= kRowsKernelBytes ? "rows" : "panels";
  return native_16bit(dtype) ? "panels-16bit" : "panels";
}

// Per item, fp32 on an AVX-512 CPU: the rows kernel (cpu_rows.h) reads token rows in place
// and writes the down-projection rows straight to out (non-temporal), and prefetches the
// next expert's weights from inside its K loop.
void forward_rows_item(const float* xp, const float* w1e, const float* w2e, const int32_t* order, int64_t k,
                       int64_t H, int64_t de, const Item& I, float* prep, float* outp, RowState<float>& S) {
  const int64_t m = I.r1 - I.r0;
  const int64_t kHid = std::min<int64_t>(de, 128);  // hidden units per up-projection step
  const float** xr = S.arow.get(m);
  float** cr = S.crow.get(m);
  float** orow = S.orow.get(m);
  float* C1 = S.C1.get(m * 2 * kHid);
  float* A2 = S.A2.get(m * de);
  float* blk = S.blk.get(kNtN * kNtK);
  // Each token row is read once per 64 output columns of the up-projection. With d_e <= 128
  // (one up-projection step, whose gate and up rows lie together in w1e and run as one pass
  // of 2 d_e columns) that is at most four times: read the rows in place, from x. Otherwise
  // gather them into a buffer that stays in L2 for the repeated passes. Against gathering,
  // in place took 4% off the tiny baseline's forward (d_e 128) and 8% off SMELT's (d_e 96),
  // and the single pass another 3.5% off SMELT's (its 2 x 96 columns are three full 64-column
  // blocks instead of 64 + 32 twice); the sums are the same, in the same order.
  const bool in_place = de <= 2 * kNtN;
  float* A1 = in_place ? nullptr : S.A1.get(m * H);
  for (int64_t i = 0; i < m; ++i) {
    const float* row = xp + static_cast<int64_t>(order[I.r0 + i] / k) * H;
    if (in_place) {
      xr[i] = row;
    } else {
      std::memcpy(A1 + i * H, row, H * sizeof(float));
      xr[i] = A1 + i * H;
    }
  }
  for (int64_t j0 = 0; j0 < de; j0 += kHid) {
    const int64_t jb = std::min(kHid, de - j0);
    for (int64_t i = 0; i < m; ++i) cr[i] = C1 + i * 2 * jb;
    if (jb == de) {  // gate and up rows together: one pass
      gemm_rows_nt(m, xr, w1e, H, 2 * de, H, cr, 0, false, blk, &S.pf);
    } else {
      gemm_rows_nt(m, xr, w1e + j0 * H, H, jb, H, cr, 0, false, blk, &S.pf);
      gemm_rows_nt(m, xr, w1e + (de + j0) * H, H, jb, H, cr, jb, false, blk, &S.pf);
    }
    for (int64_t i = 0; i < m; ++i) {
      const float* c = cr[i];
      if (prep) {
        std::memcpy(prep + (I.r0 + i) * 2 * de + j0, c, jb * sizeof(float));
        std::memcpy(prep + (I.r0 + i) * 2 * de + de + j0, c + jb, jb * sizeof(float));
      }
      swiglu_forward(c, c + jb, A2 + i * de + j0, jb);
    }
  }
  for (int64_t i = 0; i < m; ++i) {
    xr[i] = A2 + i * de;
    orow[i] = outp + (I.r0 + i) * H;
  }
  gemm_rows_nt(m, xr, w2e, de, H, de, orow, 0, true, blk, &S.pf);
}

template <typename ST, typename CT>
void forward_impl(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2, const float* tw,
                  const Routing& R, at::Tensor& y, ST* prep, at::Tensor& out) {
  const int64_t H = x.size(1), de = w1.size(1) / 2, E = R.E, k = R.k;
  const ST* xp = x.data_ptr<ST>();
  const ST* w1p = w1.data_ptr<ST>();
  const ST* w2p = w2.data_ptr<ST>();
  ST* outp = out.data_ptr<ST>();
  const int32_t* order = R.order.data_ptr<int32_t>();
  const int32_t* off = R.offsets.data_ptr<int32_t>();
  const std::vector<Item> items = row_items(off, E, kItemRows);
  const int64_t lda1 = k_pad<CT>(H), lda2 = k_pad<CT>(de);
  constexpr bool kF32 = std::is_same_v<ST, float>;
  const int64_t w1_bytes = 2 * de * H * static_cast<int64_t>(sizeof(ST));
  const int64_t w2_bytes = H * de * static_cast<int64_t>(sizeof(ST));
  const bool rows_kernel = forward_kernel(H, de, x.scalar_type()) == "rows";
  const bool prefetch = w1_bytes + w2_bytes <= prefetch_limit();
  const int64_t few_limit = few_rows_limit(w1_bytes + w2_bytes);
  const int64_t decode_ahead = prefetch_limit() / 2;
  const bool decode = use_decode_path();
  // hidden units per up-projection panel (gate and up columns) and output columns per
  // down-projection panel, so that each packed panel stays in L2 however large H and d_e are
  const int64_t kHid = std::min<int64_t>(de, std::max<int64_t>(16, kPanelBytes / (2 * lda1 * sizeof(CT)) / 16 * 16));
  const int64_t kOut = std::min<int64_t>(H, std::max<int64_t>(64, kPanelBytes / (lda2 * sizeof(CT)) / 64 * 64));

  auto item = [&](int64_t it, int64_t nx, RowState<CT>& S) {
        const Item& I = items[it];
        const int64_t m = I.r1 - I.r0;
        const ST* w1e = w1p + I.e * 2 * de * H;
        const ST* w2e = w2p + I.e * H * de;
        const bool few_rows = decode && m <= few_limit;
        const bool next_expert = nx >= 0 && items[nx].e != I.e;
        const ST* w1n = next_expert ? w1p + items[nx].e * 2 * de * H : nullptr;
        const ST* w2n = next_expert ? w2p + items[nx].e * H * de : nullptr;
        if (next_expert && prefetch)
          S.pf.reset(w1n, w1_bytes, w2n, w2_bytes);
        else if (next_expert && few_rows)  // the heads of its streams (see prefetch_limit)
          S.pf.reset(w1n, std::min(w1_bytes, decode_ahead), w2n, std::min(w2_bytes, decode_ahead / 2));
        else
          S.pf.clear();
        if (few_rows) {  // few rows: dot products on the weights in place
          decode_item<ST>(xp, w1e, w2e, order, k, H, de, I.r0, m, prep, outp, &S.pf);
          S.pf.finish();
          return;
        }
        if constexpr (kF32) {
          if (rows_kernel) {
            forward_rows_item(xp, w1e, w2e, order, k, H, de, I, prep, outp, S);
            S.pf.finish();
            stream_fence();
            return;
          }
        }
        // Portable path: a few prefetched lines per row of the epilogue and of the output
        const int64_t per_row = cdiv(S.pf.lines(), m * (cdiv(de, kHid) + cdiv(H, kOut)));
        int64_t* tok = S.tok.get(m);
        for (int64_t i = 0; i < m; ++i) tok[i] = order[I.r0 + i] / k;
        CT* A1 = S.A1.get(m * lda1);
        gather_rows(xp, H, tok, m, H, A1, lda1);
        CT* A2 = S.A2.get(m * lda2);
        // Up-projection, kHid hidden units at a time: the panel [W_gate^T | W_up^T] of those
        // units is packed right before use.
        float* C1 = S.C1.get(m * round_up(2 * kHid, 16));
        float* h = S.row.get(kHid);
        for (int64_t j0 = 0; j0 < de; j0 += kHid) {
          const int64_t jb = std::min(kHid, de - j0);
          pack_transposed<CT>(w1e + j0 * H, jb, w1e + (de + j0) * H, jb, H, H, S.B1);
          const int64_t ldc1 = S.B1.Np;
          gemm(m, A1, lda1, S.B1, C1, ldc1, false);
          for (int64_t i = 0; i < m; ++i) {
            S.pf.step(per_row);
            const float* c = C1 + i * ldc1;
            if (prep) {
              narrow(c, prep + (I.r0 + i) * 2 * de + j0, jb);
              narrow(c + jb, prep + (I.r0 + i) * 2 * de + de + j0, jb);
            }
            CT* a = A2 + i * lda2 + j0;
            if constexpr (std::is_same_v<CT, float>) {
              swiglu_forward(c, c + jb, a, jb);
            } else {
              swiglu_forward(c, c + jb, h, jb);
              narrow(h, a, jb);
            }
          }
        }
        for (int64_t i = 0; i < m; ++i)
          for (int64_t c = de; c < lda2; ++c) A2[i * lda2 + c] = CT(0.0f);
        // Down-projection, kOut output columns at a time (packed the same way)
        float* C2 = S.C2.get(m * round_up(kOut, 16));
        for (int64_t n0 = 0; n0 < H; n0 += kOut) {
          const int64_t nb = std::min(kOut, H - n0);
          pack_transposed<CT>(w2e + n0 * de, de, nb, de, S.B2);
          if constexpr (kF32) {
            // fp32 rows go straight to their place in out (no padding columns in fp32 panels)
            gemm(m, A2, lda2, S.B2, outp + I.r0 * H + n0, H, false);
            S.pf.step(per_row * m);
          } else {
            gemm(m, A2, lda2, S.B2, C2, S.B2.Np, false);
            for (int64_t i = 0; i < m; ++i) {
              narrow(C2 + i * S.B2.Np, outp + (I.r0 + i) * H + n0, nb);
              S.pf.step(per_row);
            }
          }
        }
        S.pf.finish();
      };
  const int64_t n_items = static_cast<int64_t>(items.size());
  if (n_items * (w1_bytes + w2_bytes) <= kInlineBytes) {
    // a call this small runs on the calling thread: waking the pool costs more than it saves
    RowState<CT> S;
    for (int64_t it = 0; it < n_items; ++it) item(it, it + 1 < n_items ? it + 1 : -1, S);
    gemm_done<CT>();
  } else {
    run_dynamic_ahead<RowState<CT>, CT>(n_items, item);
  }
  combine<ST>(outp, R.rev.data_ptr<int32_t>(), tw, R.T, k, H, y.data_ptr<ST>());
}

// ---------------------------------------------------------------------------- ops
void check_args(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2, const at::Tensor& tw,
                const at::Tensor& ids) {
  TORCH_CHECK_VALUE(x.dim() == 2 && w1.dim() == 3 && w2.dim() == 3, "moe_ffn: x (T, H), w1 (E, 2d, H), w2 (E, H, d)");
  const int64_t T = x.size(0), H = x.size(1), E = w1.size(0), de = w1.size(1) / 2;
  TORCH_CHECK_VALUE(w1.size(1) == 2 * de && w1.size(2) == H, "moe_ffn: w1 must be (E, 2*d_e, H), got ", w1.sizes());
  TORCH_CHECK_VALUE(w2.size(0) == E && w2.size(1) == H && w2.size(2) == de, "moe_ffn: w2 must be (E, H, d_e), got ", w2.sizes());
  TORCH_CHECK_VALUE(tw.dim() == 2 && tw.size(0) == T && ids.sizes() == tw.sizes(), "moe_ffn: topk_weights and topk_ids must be (T, k)");
  TORCH_CHECK_TYPE(w1.scalar_type() == x.scalar_type() && w2.scalar_type() == x.scalar_type(), "moe_ffn: x, w1, w2 must share a dtype");
  TORCH_CHECK_TYPE(tw.scalar_type() == at::kFloat, "moe_ffn: topk_weights must be float32 here");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_ffn_fwd(
    const at::Tensor& x_, const at::Tensor& w1_, const at::Tensor& w2_, const at::Tensor& tw_,
    const at::Tensor& ids, bool save_preact) {
  check_args(x_, w1_, w2_, tw_, ids);
  return smelt::named_op("moe_ffn (cpu forward)", [&]() -> std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> {
    at::Tensor x = x_.contiguous(), w1 = w1_.contiguous(), w2 = w2_.contiguous(), tw = tw_.contiguous();
    Routing R = sort_pairs(ids, w1.size(0));
    const int64_t H = x.size(1), de = w1.size(1) / 2;
    at::Tensor y = smelt::pooled_output({R.T, H}, x.scalar_type());
    // the pre-activation is stored only when a backward will need it
    at::Tensor pre = smelt::pooled_output({save_preact ? R.TK : 0, 2 * de}, x.scalar_type());
    if (H == 0 || de == 0) {
      // an empty sum: the up-projection over H = 0 is zero, and so is a down-projection
      // from d_e = 0 hidden units
      y.zero_();
      pre.zero_();
      return {y, pre, R.order, R.rev, R.offsets};
    }
    at::Tensor out = workspace(0, R.TK, H, x.scalar_type());
    dispatch(x.scalar_type(), [&](auto st, auto ct) {
      using ST = decltype(st);
      using CT = decltype(ct);
      forward_impl<ST, CT>(x, w1, w2, tw.data_ptr<float>(), R, y, save_preact ? pre.data_ptr<ST>() : nullptr, out);
    });
    return {y, pre, R.order, R.rev, R.offsets};
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_ffn_bwd(
    const at::Tensor& dy_, const at::Tensor& x_, const at::Tensor& w1_, const at::Tensor& w2_,
    const at::Tensor& tw_, const at::Tensor& ids, const at::Tensor& pre_, const at::Tensor& order_,
    const at::Tensor& rev_, const at::Tensor& offsets_) {
  check_args(x_, w1_, w2_, tw_, ids);
  at::Tensor x = x_.contiguous(), w1 = w1_.contiguous(), w2 = w2_.contiguous(), tw = tw_.contiguous();
  at::Tensor dy = dy_.to(x.scalar_type()).contiguous(), pre = pre_.contiguous();
  at::Tensor order = order_.contiguous(), rev = rev_.contiguous(), offsets = offsets_.contiguous();
  const int64_t T = x.size(0), E = w1.size(0), de = w1.size(1) / 2, k = ids.size(1);
  TORCH_CHECK_VALUE(dy.sizes() == x.sizes(), "moe_ffn backward: grad_output must be (T, H)");
  TORCH_CHECK_VALUE(pre.size(0) == T * k && pre.size(1) == 2 * de && order.numel() == T * k &&
                        rev.numel() == T * k && offsets.numel() == E + 1,
                    "moe_ffn backward: saved routing tensors do not match the inputs");
  return smelt::named_op("moe_ffn (cpu backward)", [&]() -> std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> {
    at::Tensor dx = smelt::pooled_output_like(x), dw1 = smelt::pooled_output_like(w1);
    at::Tensor dw2 = smelt::pooled_output_like(w2), dtw = smelt::output({T, k}, tw.options());
    if (x.size(1) == 0 || de == 0) {
      // empty sums (see the forward): every gradient is zero or empty
      return {dx.zero_(), dw1.zero_(), dw2.zero_(), dtw.zero_()};
    }
    moe_backward(dy, x, w1, w2, tw, pre, order, rev, offsets, k, dx, dw1, dw2, dtw);
    return {dx, dw1, dw2, dtw};
  });
}

std::string moe_forward_kernel(int64_t hidden, int64_t expert_size, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(hidden > 0 && expert_size > 0, "moe_forward_kernel: hidden and expert_size must be positive");
  return forward_kernel(hidden, expert_size, dtype);
}

int64_t moe_few_rows_limit(int64_t hidden, int64_t expert_size, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(hidden > 0 && expert_size > 0, "moe_few_rows_limit: hidden and expert_size must be positive");
  return few_rows_limit(3 * hidden * expert_size * static_cast<int64_t>(c10::elementSize(dtype)));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_sort(const at::Tensor& ids, int64_t num_experts) {
  TORCH_CHECK_VALUE(num_experts >= 0, "moe_sort: num_experts must be >= 0, got ", num_experts);
  return smelt::named_op("moe_sort (cpu)", [&]() -> std::tuple<at::Tensor, at::Tensor, at::Tensor> {
    Routing R = sort_pairs(ids, num_experts);
    return {R.order, R.rev, R.offsets};
  });
}

}  // namespace

bool rows_kernel_allowed() { return use_rows_kernel(); }

}  // namespace smelt_moe

TORCH_LIBRARY_FRAGMENT(smelt_cpu, m) {
  m.def("moe_sort(Tensor topk_ids, int num_experts) -> (Tensor order, Tensor rev, Tensor offsets)");
  m.def("moe_forward_kernel(int hidden, int expert_size, ScalarType dtype) -> str", &smelt_moe::moe_forward_kernel);
  m.def("moe_few_rows_limit(int hidden, int expert_size, ScalarType dtype) -> int", &smelt_moe::moe_few_rows_limit);
  m.def(
      "moe_ffn_fwd(Tensor x, Tensor w1, Tensor w2, Tensor topk_weights, Tensor topk_ids, bool save_preact=True)"
      " -> (Tensor y, Tensor preact, Tensor order, Tensor rev, Tensor offsets)");
  m.def(
      "moe_ffn_bwd(Tensor grad_y, Tensor x, Tensor w1, Tensor w2, Tensor topk_weights,"
      " Tensor topk_ids, Tensor preact, Tensor order, Tensor rev, Tensor offsets)"
      " -> (Tensor grad_x, Tensor grad_w1, Tensor grad_w2, Tensor grad_topk_weights)");
}

TORCH_LIBRARY_IMPL(smelt_cpu, CPU, m) {
  m.impl("moe_sort", &smelt_moe::moe_sort);
  m.impl("moe_ffn_fwd", &smelt_moe::moe_ffn_fwd);
  m.impl("moe_ffn_bwd", &smelt_moe::moe_ffn_bwd);
}
