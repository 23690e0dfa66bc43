// Backward pass of the CPU MoE kernel (smelt_cpu::moe_ffn_bwd).
//
// Per expert e, in chunks of kRows sorted rows (phase A):
//   G   = dy[tok] @ W2[e]                        (gathered rows; the unweighted dL/dh)
//   dtw = rowsum(G * h)   dh = w * G   [dgate, dup] = dSwiGLU(dh)   (h recomputed from P)
//   dXs = [dgate, dup] @ W1[e]                   (per sorted row; summed per token at the end)
// and the chunk's [dgate, dup, w*h] transposed into A^T panels for phase B, the weight
// gradients as GEMMs over the expert's rows (K = rows, reduced in chunk order):
//   dW1[e][:, cols]   = [dgate, dup]^T @ x[tok][:, cols]
//   dW2[e][cols, :]^T = (w h)^T @ dy[tok][:, cols]
// An ordinary expert is one work item (both phases on one thread, its buffers in cache);
// threads claim these items one at a time, costliest first.
// An expert with more rows than a fair share of a thread is done alone with all threads:
// phase A split by chunks, phase B by column blocks. Each output element is reduced by one
// thread in a fixed order, so the gradients are bitwise reproducible.
#include "cpu_work.h"

namespace smelt_moe {
namespace {

constexpr int64_t kColBlock = 256;   // phase B columns per GEMM (keeps C in L2)
constexpr int64_t kBigColBlock = 64; // column split of a big expert's phase B

template <typename ST, typename CT>
struct Backward {
  const ST *dy, *x, *w1, *w2, *pre;
  const float* tw;
  const int32_t *order, *off;
  int64_t H, de, k;
  ST *dxs, *dw1, *dw2;
  float* dtw;

  // Per chunk of kRows rows: the AT panel (rows [0, 2de) = [dgate, dup]^T, rows [2de, 3de) =
  // (w h)^T, row stride kRows) and the gathered dy and x rows (row stride ldg, zero rows
  // past the chunk's end up to the multiple of 8 that phase B reads).
  int64_t ldg() const { return k_pad<CT>(H); }
  int64_t chunk_size() const { return 3 * de * kRows + 2 * kRows * ldg(); }

  static void zero_rows(CT* rows, int64_t from, int64_t to, int64_t ld) {
    std::fill(rows + from * ld, rows + to * ld, CT(0.0f));
  }

  // Phase A for sorted rows [r0, r1) of expert e into chunk buffer `chunk`.
  void rows(int64_t e, int64_t r0, int64_t r1, RowState<CT>& S, CT* chunk) const {
    const int64_t m = r1 - r0, ldg = this->ldg(), ldt = 3 * de, mq = round_up(m, 8);
    CT* AT = chunk;
    CT* A = chunk + 3 * de * kRows;
    CT* X = A + kRows * ldg;
    Panel<CT>& Q1 = S.B1;
    Panel<CT>& Q2 = S.B2;
    if (e != S.expert) {
      pack_plain<CT>(w2 + e * H * de, de, H, de, Q2);
      pack_plain<CT>(w1 + e * 2 * de * H, H, 2 * de, H, Q1);
      S.expert = e;
    }
    int64_t* tok = S.tok.get(m);
    for (int64_t i = 0; i < m; ++i) tok[i] = order[r0 + i] / k;
    gather_rows(dy, H, tok, m, H, A, ldg);
    gather_rows(x, H, tok, m, H, X, ldg);
    zero_rows(A, m, mq, ldg);
    zero_rows(X, m, mq, ldg);
    float* G = S.C1.get(m * Q2.Np);
    gemm(m, A, ldg, Q2, G, Q2.Np, false);
    // [dgate | dup | w h] per row, fp32
    float* T3 = S.C2.get(std::max(m * ldt, 3 * de * kRows) + kRows * ldt);
    float* T3t = T3 + kRows * ldt;
    float* g = S.row.get(2 * de);
    for (int64_t i = 0; i < m; ++i) {
      const int64_t p = order[r0 + i];
      float* t3 = T3 + i * ldt;
      widen(pre + (r0 + i) * 2 * de, g, 2 * de);
      dtw[p] = swiglu_backward(g, g + de, G + i * Q2.Np, tw[p], de, t3, t3 + de, t3 + 2 * de);
    }
    // dXs = [dgate, dup] @ W1[e]
    const CT* dP;
    int64_t ldp;
    if constexpr (std::is_same_v<CT, float>) {
      dP = T3;
      ldp = ldt;
    } else {
      ldp = 2 * de;
      CT* d = S.A2.get(m * ldp);
      for (int64_t i = 0; i < m; ++i) narrow(T3 + i * ldt, d + i * ldp, 2 * de);
      dP = d;
    }
    if constexpr (std::is_same_v<ST, float>) {
      gemm(m, dP, ldp, Q1, dxs + r0 * H, H, false);
    } else {
      float* X = S.C1.get(m * Q1.Np);
      gemm(m, dP, ldp, Q1, X, Q1.Np, false);
      for (int64_t i = 0; i < m; ++i) narrow(X + i * Q1.Np, dxs + (r0 + i) * H, H);
    }
    // the chunk transposed, zero beyond its m rows
    if constexpr (std::is_same_v<CT, float>) {
      transpose32(reinterpret_cast<const uint32_t*>(T3), ldt, m, ldt, reinterpret_cast<uint32_t*>(AT), kRows);
      for (int64_t c = 0; c < ldt; ++c) std::fill(AT + c * kRows + m, AT + c * kRows + mq, 0.0f);
    } else {
      transpose32(reinterpret_cast<const uint32_t*>(T3), ldt, m, ldt, reinterpret_cast<uint32_t*>(T3t), kRows);
      for (int64_t c = 0; c < ldt; ++c) {
        float* src = T3t + c * kRows;
        std::fill(src + m, src + mq, 0.0f);
        narrow(src, AT + c * kRows, mq);
      }
    }
  }

  // Phase B for one chunk of m rows and columns [c0, c0 + cw): C1 (2de x cw) and C2 (de x cw),
  // row stride ldc, accumulate this chunk's products (add) or start them.
  void wgrad(int64_t m, const CT* chunk, int64_t c0, int64_t cw, bool add, RowState<CT>& S, float* C1,
             float* C2, int64_t ldc) const {
    const int64_t mq = round_up(m, 8), ldg = this->ldg();
    const CT* AT = chunk;
    const CT* A = chunk + 3 * de * kRows;
    const CT* X = A + kRows * ldg;
    pack_plain<CT>(X + c0, ldg, mq, cw, S.B1);
    gemm(2 * de, AT, kRows, S.B1, C1, ldc, add);
    pack_plain<CT>(A + c0, ldg, mq, cw, S.B2);
    gemm(de, AT + 2 * de * kRows, kRows, S.B2, C2, ldc, add);
    S.expert = -1;  // B1, B2 no longer hold weights
  }

  // dW1[e][:, c0:c0+cw] = C1, dW2[e][c0:c0+cw, :] = C2^T (zeros when the expert has no rows).
  void store(int64_t e, int64_t c0, int64_t cw, const float* C1, const float* C2, int64_t ldc,
             bool empty, RowState<CT>& S) const {
    float* zero = S.row.get(std::max(cw, de));
    if (empty) std::fill(zero, zero + std::max(cw, de), 0.0f);
    for (int64_t r = 0; r < 2 * de; ++r) narrow(empty ? zero : C1 + r * ldc, dw1 + (e * 2 * de + r) * H + c0, cw);
    if (empty) {
      for (int64_t n = 0; n < cw; ++n) narrow(zero, dw2 + (e * H + c0 + n) * de, de);
      return;
    }
    float* t = S.C2.get(cw * de);
    transpose32(reinterpret_cast<const uint32_t*>(C2), ldc, de, cw, reinterpret_cast<uint32_t*>(t), de);
    for (int64_t n = 0; n < cw; ++n) narrow(t + n * de, dw2 + (e * H + c0 + n) * de, de);
  }

  // Both phases of expert e on this thread.
  void expert(int64_t e, RowState<CT>& S, Scratch<CT>& ATs, Scratch<float>& Cs) const {
    const int64_t m_e = off[e + 1] - off[e], nq = cdiv(m_e, kRows);
    CT* buf = ATs.get(std::max<int64_t>(nq, 1) * chunk_size());
    for (int64_t q = 0; q < nq; ++q)
      rows(e, off[e] + q * kRows, std::min<int64_t>(off[e + 1], off[e] + (q + 1) * kRows), S, buf + q * chunk_size());
    for (int64_t c0 = 0; c0 < H; c0 += kColBlock) {
      const int64_t cw = std::min(kColBlock, H - c0), ldc = round_up(cw, 16);
      float* C1 = Cs.get(3 * de * ldc);
      float* C2 = C1 + 2 * de * ldc;
      for (int64_t q = 0; q < nq; ++q)
        wgrad(std::min(kRows, m_e - q * kRows), buf + q * chunk_size(), c0, cw, q > 0, S, C1, C2, ldc);
      store(e, c0, cw, C1, C2, ldc, nq == 0, S);
    }
  }

  // Expert e with all threads: phase A over chunks, then phase B over column blocks.
  void big_expert(int64_t e) const {
    const int64_t m_e = off[e + 1] - off[e], nq = cdiv(m_e, kRows);
    Scratch<CT> bufs;
    CT* buf = bufs.get(nq * chunk_size());
    at::parallel_for(0, nq, 1, [&](int64_t q0, int64_t q1) {
      RowState<CT> S;
      for (int64_t q = q0; q < q1; ++q)
        rows(e, off[e] + q * kRows, std::min<int64_t>(off[e + 1], off[e] + (q + 1) * kRows), S, buf + q * chunk_size());
      gemm_done<CT>();
    });
    at::parallel_for(0, cdiv(H, kBigColBlock), 1, [&](int64_t b0, int64_t b1) {
      RowState<CT> S;
      Scratch<float> Cs;
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t c0 = b * kBigColBlock, cw = std::min(kBigColBlock, H - c0), ldc = round_up(cw, 16);
        float* C1 = Cs.get(3 * de * ldc);
        float* C2 = C1 + 2 * de * ldc;
        for (int64_t q = 0; q < nq; ++q)
          wgrad(std::min(kRows, m_e - q * kRows), buf + q * chunk_size(), c0, cw, q > 0, S, C1, C2, ldc);
        store(e, c0, cw, C1, C2, ldc, false, S);
      }
      gemm_done<CT>();
    });
  }
};


template <typename ST, typename CT>
void backward_impl(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                   const at::Tensor& tw, const at::Tensor& pre, const at::Tensor& order,
                   const at::Tensor& rev, const at::Tensor& offsets, int64_t k, at::Tensor& dx,
                   at::Tensor& dw1, at::Tensor& dw2, at::Tensor& dtw) {
  const int64_t T = x.size(0), H = x.size(1), E = w1.size(0), de = w1.size(1) / 2;
  at::Tensor dxs = workspace(1, T * k, H, x.scalar_type());
  const int32_t* off = offsets.data_ptr<int32_t>();
  Backward<ST, CT> B{dy.data_ptr<ST>(), x.data_ptr<ST>(), w1.data_ptr<ST>(), w2.data_ptr<ST>(),
                     pre.data_ptr<ST>(), tw.data_ptr<float>(), order.data_ptr<int32_t>(), off,
                     H, de, k, dxs.data_ptr<ST>(), dw1.data_ptr<ST>(), dw2.data_ptr<ST>(),
                     dtw.data_ptr<float>()};
  // an expert is "big" when it has more than half of one thread's fair share of the rows
  const int64_t nt = at::get_num_threads();
  std::vector<int64_t> small, cost;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t m_e = off[e + 1] - off[e];
    if (nt > 1 && m_e > kRows && 2 * nt * m_e > T * k) {
      B.big_expert(e);
    } else {
      small.push_back(e);
      cost.push_back(m_e + 16);
    }
  }
  struct State {
    RowState<CT> S;
    Scratch<CT> AT;
    Scratch<float> C;
  };
  // Threads claim experts one at a time, the costliest first, so that they finish together
  // whatever the routing; an expert's gradients do not depend on which thread computes them.
  std::vector<int64_t> by_cost(small.size());
  for (size_t i = 0; i < small.size(); ++i) by_cost[i] = static_cast<int64_t>(i);
  std::stable_sort(by_cost.begin(), by_cost.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  run_dynamic_ahead<State, CT>(static_cast<int64_t>(by_cost.size()), [&](int64_t i, int64_t, State& st) {
    B.expert(small[by_cost[i]], st.S, st.AT, st.C);
  });
  combine<ST>(B.dxs, rev.data_ptr<int32_t>(), nullptr, T, k, H, dx.data_ptr<ST>());
}

}  // namespace

void moe_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                  const at::Tensor& tw, const at::Tensor& pre, const at::Tensor& order,
                  const at::Tensor& rev, const at::Tensor& off, int64_t k, at::Tensor& dx,
                  at::Tensor& dw1, at::Tensor& dw2, at::Tensor& dtw) {
  dispatch(x.scalar_type(), [&](auto st, auto ct) {
    using ST = decltype(st);
    using CT = decltype(ct);
    backward_impl<ST, CT>(dy, x, w1, w2, tw, pre, order, rev, off, k, dx, dw1, dw2, dtw);
  });
}

}  // namespace smelt_moe
