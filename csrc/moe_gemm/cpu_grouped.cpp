// Native CPU grouped GEMM behind smelt_kernels.moe_gemm.grouped_gemm.
//
//   grouped_gemm:       c[r] = a[g(r)] @ op(b[e]) for the rows r of group e, where op(b[e]) is
//                     b[e]^T (b: (E, N, K), trans_b) or b[e] (b: (E, K, N)); rows past the
//                     last group are zero.
//   grouped_gemm_wgrad: db[e] = dc[rows of e]^T @ a[g(rows of e)], (E, N, K).
// Rows are expert-sorted; offsets (E+1,) int32 holds each group's first row and the end.
// Same building blocks and scheduling as the MoE kernels (moe_plan.h): row items of one
// group on one thread, weight-gradient items of (group, 64 output rows) reducing over the
// group's rows in a fixed order.
#include <torch/library.h>

#include "../cpu_alloc.h"
#include "cpu_work.h"

namespace smelt_moe {
namespace {

constexpr int64_t kOutRows = 64;  // rows of db[e] per weight-gradient item

template <typename ST, typename CT>
void grouped_impl(const at::Tensor& a, const at::Tensor& b, const int32_t* off, const int32_t* gather,
                  bool trans_b, at::Tensor& c) {
  const int64_t E = b.size(0), K = a.size(1), M = c.size(0), N = c.size(1);
  const ST* ap = a.data_ptr<ST>();
  const ST* bp = b.data_ptr<ST>();
  ST* cp = c.data_ptr<ST>();
  const int64_t lda = k_pad<CT>(K);
  const std::vector<Item> items = row_items(off, E);
  std::vector<int64_t> cost(items.size());
  for (size_t i = 0; i < items.size(); ++i) cost[i] = items[i].r1 - items[i].r0 + 16;
  run_balanced<RowState<CT>, CT>(cost, [&](int64_t it, RowState<CT>& S) {
    const Item& I = items[it];
    const int64_t m = I.r1 - I.r0;
    if (I.e != S.expert) {
      if (trans_b) pack_transposed<CT>(bp + I.e * N * K, K, N, K, S.B1);
      else pack_plain<CT>(bp + I.e * K * N, N, K, N, S.B1);
      S.expert = I.e;
    }
    int64_t* rows = S.tok.get(m);
    for (int64_t i = 0; i < m; ++i) rows[i] = gather ? gather[I.r0 + i] : I.r0 + i;
    CT* A = S.A1.get(m * lda);
    gather_rows(ap, K, rows, m, K, A, lda);
    if constexpr (std::is_same_v<ST, float>) {
      gemm(m, A, lda, S.B1, cp + I.r0 * N, N, false);
    } else {
      float* C = S.C1.get(m * S.B1.Np);
      gemm(m, A, lda, S.B1, C, S.B1.Np, false);
      for (int64_t i = 0; i < m; ++i) narrow(C + i * S.B1.Np, cp + (I.r0 + i) * N, N);
    }
  });
  if (off[E] < M) std::fill(cp + off[E] * N, cp + M * N, ST(0.0f));
}

template <typename ST, typename CT>
void wgrad_impl(const at::Tensor& dc, const at::Tensor& a, const int32_t* off, const int32_t* gather,
                at::Tensor& db) {
  const int64_t E = db.size(0), N = dc.size(1), K = a.size(1);
  const ST* dcp = dc.data_ptr<ST>();
  const ST* ap = a.data_ptr<ST>();
  ST* dbp = db.data_ptr<ST>();
  const int64_t nblk = cdiv(N, kOutRows), ldc = k_pad<CT>(K) + 16;
  std::vector<int64_t> cost(E * nblk);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t i = 0; i < nblk; ++i) cost[e * nblk + i] = off[e + 1] - off[e] + 8;
  run_balanced<RowState<CT>, CT>(cost, [&](int64_t it, RowState<CT>& S) {
    const int64_t e = it / nblk, n0 = (it % nblk) * kOutRows, nw = std::min(kOutRows, N - n0);
    float* C = S.C1.get(nw * ldc);
    std::fill(C, C + nw * ldc, 0.0f);
    float* wide = S.C2.get(2 * kRows * kOutRows);
    float* tr = wide + kRows * kOutRows;
    CT* AT = S.A1.get(kOutRows * kRows);
    for (int64_t r0 = off[e]; r0 < off[e + 1]; r0 += kRows) {
      const int64_t m = std::min<int64_t>(kRows, off[e + 1] - r0), mq = round_up(m, 8);
      // AT (nw x mq) = dc[r0:r0+m, n0:n0+nw]^T, zero beyond m
      for (int64_t i = 0; i < m; ++i) widen(dcp + (r0 + i) * N + n0, wide + i * kOutRows, nw);
      transpose32(reinterpret_cast<const uint32_t*>(wide), kOutRows, m, nw, reinterpret_cast<uint32_t*>(tr), kRows);
      for (int64_t j = 0; j < nw; ++j) {
        std::fill(tr + j * kRows + m, tr + j * kRows + mq, 0.0f);
        narrow(tr + j * kRows, AT + j * kRows, mq);
      }
      int64_t* rows = S.tok.get(m);
      for (int64_t i = 0; i < m; ++i) rows[i] = gather ? gather[r0 + i] : r0 + i;
      pack_gathered<CT>(ap, K, rows, m, mq, 0, K, S.B1);
      gemm(nw, AT, kRows, S.B1, C, ldc, true);
    }
    for (int64_t j = 0; j < nw; ++j) narrow(C + j * ldc, dbp + (e * N + n0 + j) * K, K);
  });
}

void check_grouped(const at::Tensor& a, const at::Tensor& offsets, const c10::optional<at::Tensor>& gather) {
  TORCH_CHECK_VALUE(a.dim() == 2, "grouped_gemm: a must be 2-D");
  TORCH_CHECK_TYPE(offsets.scalar_type() == at::kInt && offsets.dim() == 1, "grouped_gemm: offsets must be int32 (E+1,)");
  if (gather.has_value()) {
    TORCH_CHECK_TYPE(gather->scalar_type() == at::kInt && gather->dim() == 1, "grouped_gemm: gather must be int32 (M,)");
  }
}

at::Tensor grouped_gemm(const at::Tensor& a_, const at::Tensor& b_, const at::Tensor& offsets_,
                      const c10::optional<at::Tensor>& gather_, bool trans_b) {
  check_grouped(a_, offsets_, gather_);
  at::Tensor a = a_.contiguous(), b = b_.contiguous(), offsets = offsets_.contiguous();
  at::Tensor gather = gather_.has_value() ? gather_->contiguous() : at::Tensor();
  const int64_t E = b.size(0), M = gather.defined() ? gather.size(0) : a.size(0);
  const int64_t N = trans_b ? b.size(1) : b.size(2);
  TORCH_CHECK_VALUE(offsets.numel() == E + 1, "grouped_gemm: offsets must have E+1 entries");
  TORCH_CHECK_VALUE((trans_b ? b.size(2) : b.size(1)) == a.size(1), "grouped_gemm: inner dims differ");
  return smelt::named_op("grouped_gemm (cpu)", [&]() -> at::Tensor {
    at::Tensor c = smelt::output({M, N}, a.options());
    if (M == 0 || N == 0) return c;
    if (a.size(1) == 0) return c.zero_();  // K = 0: empty sums
    const int32_t* g = gather.defined() ? gather.data_ptr<int32_t>() : nullptr;
    dispatch(a.scalar_type(), [&](auto st, auto ct) {
      grouped_impl<decltype(st), decltype(ct)>(a, b, offsets.data_ptr<int32_t>(), g, trans_b, c);
    });
    return c;
  });
}

at::Tensor grouped_gemm_wgrad(const at::Tensor& dc_, const at::Tensor& a_, const at::Tensor& offsets_,
                            const c10::optional<at::Tensor>& gather_) {
  check_grouped(a_, offsets_, gather_);
  at::Tensor dc = dc_.to(a_.scalar_type()).contiguous(), a = a_.contiguous(), offsets = offsets_.contiguous();
  at::Tensor gather = gather_.has_value() ? gather_->contiguous() : at::Tensor();
  const int64_t E = offsets.numel() - 1;
  TORCH_CHECK_VALUE(E >= 0 && dc.dim() == 2, "grouped_gemm_wgrad: offsets must have E+1 entries and dc be 2-D");
  return smelt::named_op("grouped_gemm_wgrad (cpu)", [&]() -> at::Tensor {
    at::Tensor db = smelt::output({E, dc.size(1), a.size(1)}, a.options());
    if (db.numel() == 0) return db;
    const int32_t* g = gather.defined() ? gather.data_ptr<int32_t>() : nullptr;
    dispatch(a.scalar_type(), [&](auto st, auto ct) {
      wgrad_impl<decltype(st), decltype(ct)>(dc, a, offsets.data_ptr<int32_t>(), g, db);
    });
    return db;
  });
}

}  // namespace
}  // namespace smelt_moe

TORCH_LIBRARY_FRAGMENT(smelt_cpu, m) {
  m.def("grouped_gemm(Tensor a, Tensor b, Tensor offsets, Tensor? gather, bool trans_b) -> Tensor");
  m.def("grouped_gemm_wgrad(Tensor dc, Tensor a, Tensor offsets, Tensor? gather) -> Tensor");
}

TORCH_LIBRARY_IMPL(smelt_cpu, CPU, m) {
  m.impl("grouped_gemm", &smelt_moe::grouped_gemm);
  m.impl("grouped_gemm_wgrad", &smelt_moe::grouped_gemm_wgrad);
}
