// Work planning shared by the CPU MoE kernels: row items, cost-balanced thread ranges, the
// fixed-order combine, reusable workspaces and the dtype dispatch.
#pragma once

#include <ATen/Parallel.h>

#include <atomic>

#include "../cpu_alloc.h"
#include "cpu_rows.h"

namespace smelt_moe {

constexpr int64_t kRows = 128;  // sorted rows per item; also the K chunk of weight gradients

struct Item {
  int64_t e, r0, r1;  // expert, sorted rows [r0, r1)
};

// Items of at most max_rows rows, expert-major. An expert with more rows is cut into the
// fewest items that allows, of near-equal size, so that no item is a small remainder that
// pays for packing its expert's weights again.
inline std::vector<Item> row_items(const int32_t* off, int64_t E, int64_t max_rows = kRows) {
  std::vector<Item> items;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = off[e + 1] - off[e], parts = cdiv(n, max_rows);
    for (int64_t q = 0; q < parts; ++q)
      items.push_back({e, off[e] + n * q / parts, off[e] + n * (q + 1) / parts});
  }
  return items;
}

// Runs fn(item index, state) over items in cost-balanced contiguous ranges, one range per
// thread, each thread with its own State (scratch buffers, packed weights) for this call.
// What an item computes does not depend on which thread runs it.
template <typename State, typename CT, typename Fn>
void run_balanced(const std::vector<int64_t>& cost, Fn fn) {
  const int64_t n = static_cast<int64_t>(cost.size());
  if (n == 0) return;
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  const std::vector<int64_t> bounds = balance(cost, nt);
  at::parallel_for(0, nt, 1, [&](int64_t p0, int64_t p1) {
    State st;
    for (int64_t p = p0; p < p1; ++p) {
      for (int64_t i = bounds[p]; i < bounds[p + 1]; ++i) fn(i, st);
    }
    gemm_done<CT>();
  });
}

// Runs fn(item, next item or -1, state) for items 0..n-1, each thread taking the next
// unclaimed item, with its own State. A thread claims its next item before running the
// current one, so that fn can start fetching what the next item reads. For item loops that
// keep nothing between items: the last item ends close to the same time on every thread
// whatever the costs, and what an item computes still does not depend on which thread runs
// it.
template <typename State, typename CT, typename Fn>
void run_dynamic_ahead(int64_t n, Fn fn) {
  if (n == 0) return;
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, nt, 1, [&](int64_t p0, int64_t p1) {
    State st;
    for (int64_t p = p0; p < p1; ++p) {
      int64_t i = next.fetch_add(1, std::memory_order_relaxed);
      while (i < n) {
        const int64_t j = next.fetch_add(1, std::memory_order_relaxed);
        fn(i, j < n ? j : -1, st);
        i = j;
      }
    }
    gemm_done<CT>();
  });
}

// Per-thread working set of the row items.
template <typename CT>
struct RowState {
  Panel<CT> B1, B2;
  int64_t expert = -1;  // whose weights B1, B2 hold
  Scratch<CT> A1, A2;
  Scratch<float> C1, C2, row, blk;
  Scratch<int64_t> tok;
  Scratch<const float*> arow;  // row pointers of the rows kernel (cpu_rows.h)
  Scratch<float*> crow, orow;
  LinePrefetch pf;
};

// y[t] = sum_j w[t, j] * rows[rev[t*k + j]] (w == nullptr: weight 1), summed in slot order.
template <typename ST>
void combine(const ST* rows, const int32_t* rev, const float* w, int64_t T, int64_t k, int64_t H, ST* y) {
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    std::vector<const float*> src(k);
    std::vector<float> wide(std::is_same_v<ST, float> ? 0 : k * H), acc(H);
    for (int64_t t = t0; t < t1; ++t) {
#if defined(__x86_64__) && defined(__GNUC__)
      // start the row streams of the token two ahead (random rows of a large buffer)
      if (t + 2 < t1)
        for (int64_t j = 0; j < k; ++j) {
          const char* r = reinterpret_cast<const char*>(rows + static_cast<int64_t>(rev[(t + 2) * k + j]) * H);
          for (int l = 0; l < 4; ++l) _mm_prefetch(r + 64 * l, _MM_HINT_T0);
        }
#endif
      for (int64_t j = 0; j < k; ++j) {
        const ST* r = rows + static_cast<int64_t>(rev[t * k + j]) * H;
        if constexpr (std::is_same_v<ST, float>) {
          src[j] = r;
        } else {
          widen(r, wide.data() + j * H, H);
          src[j] = wide.data() + j * H;
        }
      }
      if constexpr (std::is_same_v<ST, float>) {
        weighted_sum(src.data(), w ? w + t * k : nullptr, k, y + t * H, H);
      } else {
        weighted_sum(src.data(), w ? w + t * k : nullptr, k, acc.data(), H);
        narrow(acc.data(), y + t * H, H);
      }
    }
  });
}

// A (rows x cols) internal buffer of the calling thread, reused across calls: the (T*k) x H
// intermediates are large, and first-touch page faults on freshly mapped memory would
// otherwise cost as much as the GEMMs. Buffers above kWorkspaceCap are not kept. Poisoned
// on every call under SMELT_POISON, so that nothing can read what an earlier call left.
constexpr int64_t kWorkspaceCap = int64_t(1) << 30;
inline at::Tensor workspace(int slot, int64_t rows, int64_t cols, at::ScalarType dtype) {
  thread_local at::Tensor kept[4];
  const int64_t bytes = rows * cols * static_cast<int64_t>(c10::elementSize(dtype));
  if (bytes > kWorkspaceCap) return smelt::output({rows, cols}, at::TensorOptions().dtype(dtype));
  at::Tensor& w = kept[slot];
  if (!w.defined() || w.numel() < bytes) {
    w = at::Tensor();  // the old buffer goes first, so that a tight memory holds the new one
    w = smelt::empty({bytes}, at::TensorOptions().dtype(at::kByte), "a workspace");
  }
  at::Tensor t = w.narrow(0, 0, bytes).view(dtype).view({rows, cols});
  if (smelt::poisoning()) smelt::poison(t);
  return t;
}

// Calls fn(ST{}, CT{}) with the storage type and the compute type for dtype t.
template <typename Fn>
void dispatch(at::ScalarType t, Fn fn) {
  if (t == at::kFloat) {
    fn(float{}, float{});
  } else if (t == at::kBFloat16) {
    if (native_16bit(t)) fn(c10::BFloat16{}, c10::BFloat16{});
    else fn(c10::BFloat16{}, float{});
  } else if (t == at::kHalf) {
    if (native_16bit(t)) fn(c10::Half{}, c10::Half{});
    else fn(c10::Half{}, float{});
  } else {
    TORCH_CHECK_TYPE(false, "smelt moe CPU kernels take float32, bfloat16 or float16, got ", t);
  }
}

// The backward pass (cpu_backward.cpp). order/rev/off: the forward's routing sort.
void moe_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                  const at::Tensor& tw, const at::Tensor& pre, const at::Tensor& order,
                  const at::Tensor& rev, const at::Tensor& off, int64_t k, at::Tensor& dx,
                  at::Tensor& dw1, at::Tensor& dw2, at::Tensor& dtw);

}  // namespace smelt_moe
