// Rotary position embedding on the CPU (smelt_cpu::rotary), the native path of
// smelt_kernels.rotary.apply_rotary.
//
// x (B, T, heads, D) in the rotate-half form, cos/sin (T, D/2) or (B, T, D/2) in fp32:
//   out[..., :D/2] = x1 c - x2 s        out[..., D/2:] = x2 c + x1 s
// computed in fp32 and rounded to x's type, as the eager form does. The eager form makes
// about six passes over q and k forward and more backward (slices, products, a cat, the
// casts); this is one, with each position's cos/sin row read once for all its heads. With
// inverse = true it rotates by -angle (x1 c + x2 s, x2 c - x1 s): the backward.
#include <torch/library.h>

#include <ATen/Parallel.h>

#include "../cpu_alloc.h"
#include "../cpu_blas.h"

namespace smelt_rotary {
namespace {

using smelt_moe::narrow;
using smelt_moe::widen;

SMELT_MULTIVERSION
void rotate(const float* __restrict x, const float* __restrict c, const float* __restrict s, float sign,
            float* __restrict out, int64_t half) {
  const float* x1 = x;
  const float* x2 = x + half;
  for (int64_t i = 0; i < half; ++i) {
    const float si = sign * s[i];
    out[i] = x1[i] * c[i] - x2[i] * si;
    out[half + i] = x2[i] * c[i] + x1[i] * si;
  }
}

template <typename ST>
void run(const ST* x, const float* cos, const float* sin, int64_t B, int64_t T, int64_t heads, int64_t D,
         bool per_batch, bool inverse, ST* out) {
  constexpr bool kF32 = std::is_same_v<ST, float>;
  const int64_t half = D / 2;
  const float sign = inverse ? -1.0f : 1.0f;
  at::parallel_for(0, B * T, 16, [&](int64_t p0, int64_t p1) {
    std::vector<float> xb(kF32 ? 0 : D), ob(kF32 ? 0 : D);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t row = per_batch ? p : p % T;
      const float* c = cos + row * half;
      const float* s = sin + row * half;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t at = (p * heads + h) * D;
        if constexpr (kF32) {
          rotate(x + at, c, s, sign, out + at, half);
        } else {
          widen(x + at, xb.data(), D);
          rotate(xb.data(), c, s, sign, ob.data(), half);
          narrow(ob.data(), out + at, D);
        }
      }
    }
  });
}

at::Tensor rotary(const at::Tensor& x_, const at::Tensor& cos_, const at::Tensor& sin_, bool inverse) {
  TORCH_CHECK_VALUE(x_.dim() == 4, "rotary: x must be (B, T, heads, head_dim), got ", x_.sizes());
  const int64_t B = x_.size(0), T = x_.size(1), heads = x_.size(2), D = x_.size(3);
  TORCH_CHECK_VALUE(D % 2 == 0, "rotary: head_dim must be even, got ", D);
  TORCH_CHECK_TYPE(x_.device().is_cpu() && cos_.device().is_cpu() && sin_.device().is_cpu(),
                   "rotary: x, cos and sin must be CPU tensors");
  const at::ScalarType st = x_.scalar_type();
  TORCH_CHECK_TYPE(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf,
                   "rotary: x must be float32, bfloat16 or float16, got ", st);
  TORCH_CHECK_TYPE(cos_.scalar_type() == at::kFloat && sin_.scalar_type() == at::kFloat,
                   "rotary: cos and sin must be float32");
  TORCH_CHECK_VALUE(cos_.sizes() == sin_.sizes(), "rotary: cos and sin must have one shape");
  const bool per_batch = cos_.dim() == 3;
  const bool fits = per_batch ? cos_.size(0) == B && cos_.size(1) == T && cos_.size(2) == D / 2
                              : cos_.dim() == 2 && cos_.size(0) == T && cos_.size(1) == D / 2;
  TORCH_CHECK_VALUE(fits, "rotary: cos and sin must be (T, head_dim / 2) = (", T, ", ", D / 2,
                    ") or (B, T, head_dim / 2), got ", cos_.sizes());
  const at::Tensor x = x_.contiguous(), cos = cos_.contiguous(), sin = sin_.contiguous();
  at::Tensor out = smelt::output(x.sizes(), x.options());
  if (x.numel() == 0) return out;
  const float *c = cos.data_ptr<float>(), *s = sin.data_ptr<float>();
  if (st == at::kFloat)
    run(x.data_ptr<float>(), c, s, B, T, heads, D, per_batch, inverse, out.data_ptr<float>());
  else if (st == at::kBFloat16)
    run(x.data_ptr<c10::BFloat16>(), c, s, B, T, heads, D, per_batch, inverse, out.data_ptr<c10::BFloat16>());
  else
    run(x.data_ptr<c10::Half>(), c, s, B, T, heads, D, per_batch, inverse, out.data_ptr<c10::Half>());
  return out;
}

}  // namespace
}  // namespace smelt_rotary

TORCH_LIBRARY_FRAGMENT(smelt_cpu, m) {
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, bool inverse) -> Tensor");
}

TORCH_LIBRARY_IMPL(smelt_cpu, CPU, m) { m.impl("rotary", &smelt_rotary::rotary); }
