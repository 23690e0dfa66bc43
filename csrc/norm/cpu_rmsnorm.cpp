// Fused RMSNorm on the CPU (smelt_cpu::rms_norm_fwd / rms_norm_bwd), the native path of
// smelt_kernels.norm.rms_norm.
//
// The eager norm runs five element-wise ops forward and about ten backward, each a pass over
// the activations; a looped model runs two norms per executed layer. Here each is one pass
// per row. Forward, per row of x (N, H):
//   r = 1 / sqrt(mean(x^2) + eps)      y = round(x r) w      (r kept for the backward)
// where round is to the input type, as in the eager norm. Backward, with n = x r, g = dy w:
//   dx = r (g - n mean(g n))            dw = sum over rows of dy round(n)
// Math is fp32 for every input type (fp32, bf16, fp16). Rows are independent, and the weight
// gradient is summed in fixed blocks of kBlock rows, then over the blocks in order, so every
// result is bitwise the same at any thread count.
#include <torch/library.h>

#include <ATen/Parallel.h>

#include "../cpu_alloc.h"
#include "../cpu_blas.h"

namespace smelt_norm {
namespace {

using smelt_moe::lane_dot;
using smelt_moe::narrow;
using smelt_moe::widen;

constexpr int64_t kBlock = 64;  // rows per partial sum of the weight gradient

SMELT_MULTIVERSION
void scale(const float* __restrict x, float r, float* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r;
}

SMELT_MULTIVERSION
void mul(const float* __restrict a, const float* __restrict b, float* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] * b[i];
}

// out = (x r) w, the fp32 forward in one loop
SMELT_MULTIVERSION
void scale_mul(const float* __restrict x, float r, const float* __restrict w, float* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = (x[i] * r) * w[i];
}

// dx = r (g - n c), c = mean(g n)
SMELT_MULTIVERSION
void input_grad(const float* __restrict g, const float* __restrict nrm, float r, float c, float* __restrict dx,
                int64_t n) {
  for (int64_t i = 0; i < n; ++i) dx[i] = r * (g[i] - nrm[i] * c);
}

SMELT_MULTIVERSION
void accumulate(float* __restrict acc, const float* __restrict a, const float* __restrict b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += a[i] * b[i];
}

// 16-bit values are rounded through the input type; fp32 needs nothing
template <typename ST>
void round_through(float* v, ST* tmp, int64_t n) {
  if constexpr (!std::is_same_v<ST, float>) {
    narrow(v, tmp, n);
    widen(tmp, v, n);
  }
}

template <typename ST>
void forward(const ST* x, const ST* w, float eps, int64_t N, int64_t H, ST* y, float* rstd) {
  constexpr bool kF32 = std::is_same_v<ST, float>;
  std::vector<float> wf(H);
  widen(w, wf.data(), H);
  at::parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> xb(kF32 ? 0 : H), t(H);
    std::vector<ST> t16(kF32 ? 0 : H);
    for (int64_t row = r0; row < r1; ++row) {
      const float* xf;
      if constexpr (kF32) {
        xf = x + row * H;
      } else {
        widen(x + row * H, xb.data(), H);
        xf = xb.data();
      }
      const float r = 1.0f / std::sqrt(lane_dot(xf, xf, H) / static_cast<float>(H) + eps);
      rstd[row] = r;
      if constexpr (kF32) {
        scale_mul(xf, r, wf.data(), y + row * H, H);
      } else {
        scale(xf, r, t.data(), H);
        round_through(t.data(), t16.data(), H);
        mul(t.data(), wf.data(), t.data(), H);
        narrow(t.data(), y + row * H, H);
      }
    }
  });
}

template <typename ST>
void backward(const ST* dy, const ST* x, const ST* w, const float* rstd, int64_t N, int64_t H, ST* dx, ST* dw) {
  constexpr bool kF32 = std::is_same_v<ST, float>;
  std::vector<float> wf(H);
  widen(w, wf.data(), H);
  const int64_t nblk = (N + kBlock - 1) / kBlock;
  std::vector<float> part = smelt::sized<float>(nblk * H, "the weight gradient's partial sums");
  at::parallel_for(0, nblk, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> xb(kF32 ? 0 : H), db(kF32 ? 0 : H), nrm(H), g(H), d(kF32 ? 0 : H), nt(kF32 ? 0 : H);
    std::vector<ST> t16(kF32 ? 0 : H);
    for (int64_t b = b0; b < b1; ++b) {
      float* acc = part.data() + b * H;
      std::fill(acc, acc + H, 0.0f);
      for (int64_t row = b * kBlock; row < std::min(N, (b + 1) * kBlock); ++row) {
        const float *xf, *dyf;
        if constexpr (kF32) {
          xf = x + row * H;
          dyf = dy + row * H;
        } else {
          widen(x + row * H, xb.data(), H);
          widen(dy + row * H, db.data(), H);
          xf = xb.data();
          dyf = db.data();
        }
        const float r = rstd[row];
        scale(xf, r, nrm.data(), H);
        mul(dyf, wf.data(), g.data(), H);
        const float c = lane_dot(g.data(), nrm.data(), H) / static_cast<float>(H);
        if constexpr (kF32) {
          input_grad(g.data(), nrm.data(), r, c, dx + row * H, H);
          accumulate(acc, dyf, nrm.data(), H);
        } else {
          input_grad(g.data(), nrm.data(), r, c, d.data(), H);
          narrow(d.data(), dx + row * H, H);
          std::copy(nrm.begin(), nrm.end(), nt.begin());
          round_through(nt.data(), t16.data(), H);
          accumulate(acc, dyf, nt.data(), H);
        }
      }
    }
  });
  at::parallel_for(0, H, 64, [&](int64_t c0, int64_t c1) {
    std::vector<float> s(c1 - c0, 0.0f);
    for (int64_t b = 0; b < nblk; ++b)
      for (int64_t c = c0; c < c1; ++c) s[c - c0] += part[b * H + c];
    narrow(s.data(), dw + c0, c1 - c0);
  });
}

// fn(value of the element type) for the three input types check() admits
template <typename Fn>
void dispatch(at::ScalarType s, Fn fn) {
  if (s == at::kFloat) fn(float{});
  else if (s == at::kBFloat16) fn(c10::BFloat16{});
  else fn(c10::Half{});
}

void check(const at::Tensor& x, const at::Tensor& w, const char* name) {
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) > 0, "rms_norm: ", name,
                    " must have at least one dimension and a non-empty last one, got ", x.sizes());
  TORCH_CHECK_TYPE(x.device().is_cpu() && w.device().is_cpu(), "rms_norm: ", name, " and weight must be CPU tensors");
  const at::ScalarType s = x.scalar_type();
  TORCH_CHECK_TYPE(s == at::kFloat || s == at::kBFloat16 || s == at::kHalf,
                   "rms_norm: ", name, " must be float32, bfloat16 or float16, got ", s);
  TORCH_CHECK_TYPE(w.scalar_type() == s, "rms_norm: weight must have ", name, "'s dtype ", s, ", got ",
                   w.scalar_type());
  TORCH_CHECK_VALUE(w.dim() == 1 && w.size(0) == x.size(-1), "rms_norm: weight must be (", x.size(-1),
                    ",), got ", w.sizes());
}

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor& x_, const at::Tensor& w_, double eps) {
  check(x_, w_, "x");
  TORCH_CHECK_VALUE(eps >= 0, "rms_norm: eps must be >= 0, got ", eps);
  return smelt::named_op("rms_norm (cpu forward)", [&]() -> std::tuple<at::Tensor, at::Tensor> {
    const at::Tensor x = x_.contiguous(), w = w_.contiguous();
    const int64_t H = x.size(-1), N = x.numel() / H;
    at::Tensor y = smelt::output(x.sizes(), x.options());
    std::vector<int64_t> rows(x.sizes().begin(), x.sizes().end() - 1);
    at::Tensor rstd = smelt::output(rows, x.options().dtype(at::kFloat));
    if (N == 0) return {y, rstd};
    dispatch(x.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      forward<T>(x.data_ptr<T>(), w.data_ptr<T>(), static_cast<float>(eps), N, H, y.data_ptr<T>(),
                 rstd.data_ptr<float>());
    });
    return {y, rstd};
  });
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor& dy_, const at::Tensor& x_, const at::Tensor& w_,
                                                const at::Tensor& rstd_) {
  check(x_, w_, "x");
  TORCH_CHECK_VALUE(dy_.sizes() == x_.sizes(), "rms_norm: dy must have x's shape ", x_.sizes(), ", got ",
                    dy_.sizes());
  TORCH_CHECK_TYPE(dy_.scalar_type() == x_.scalar_type(), "rms_norm: dy must have x's dtype");
  TORCH_CHECK_TYPE(rstd_.scalar_type() == at::kFloat, "rms_norm: rstd must be float32");
  TORCH_CHECK_VALUE(rstd_.numel() * x_.size(-1) == x_.numel(), "rms_norm: rstd must have one value per row");
  return smelt::named_op("rms_norm (cpu backward)", [&]() -> std::tuple<at::Tensor, at::Tensor> {
    const at::Tensor dy = dy_.contiguous(), x = x_.contiguous(), w = w_.contiguous(), rstd = rstd_.contiguous();
    const int64_t H = x.size(-1), N = x.numel() / H;
    at::Tensor dx = smelt::output(x.sizes(), x.options());
    at::Tensor dw = smelt::output(w.sizes(), w.options());
    if (N == 0) return {dx, dw.zero_()};
    dispatch(x.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      backward<T>(dy.data_ptr<T>(), x.data_ptr<T>(), w.data_ptr<T>(), rstd.data_ptr<float>(), N, H,
                  dx.data_ptr<T>(), dw.data_ptr<T>());
    });
    return {dx, dw};
  });
}

}  // namespace
}  // namespace smelt_norm

TORCH_LIBRARY_FRAGMENT(smelt_cpu, m) {
  m.def("rms_norm_fwd(Tensor x, Tensor weight, float eps) -> (Tensor y, Tensor rstd)");
  m.def("rms_norm_bwd(Tensor dy, Tensor x, Tensor weight, Tensor rstd) -> (Tensor dx, Tensor dweight)");
}

TORCH_LIBRARY_IMPL(smelt_cpu, CPU, m) {
  m.impl("rms_norm_fwd", &smelt_norm::rms_norm_fwd);
  m.impl("rms_norm_bwd", &smelt_norm::rms_norm_bwd);
}
