// torch.library binding of the segment-attention forward kernel (csrc/attention/cuda.cu).
//
//   torch.ops.smelt_cuda.segment_attention_fwd(q, k, v, start, o, lse, psink, scale, want_sink)
//
// writes o (B, Tq, Hq, D), lse (B, Hq, Tq) fp32 and, with want_sink, psink (B, Hq, Tq) fp32
// (the probability each query puts on its segment's first key; 0 for segment starts).
// start: int32 (B, Tk) first position of every position's segment, or None (one segment).
// smelt_kernels/attention.py validates the public inputs first; the checks here guard the
// kernel's own assumptions.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

int smelt_segment_attention_fwd(const void* q, const void* k, const void* v, const int* start,
                                void* o, float* lse, float* psink, int64_t sqb, int64_t sqt,
                                int64_t sqh, int64_t skb, int64_t skt, int64_t skh, int64_t svb,
                                int64_t svt, int64_t svh, int B, int Tq, int Tk, int Hq, int Hkv,
                                int D, float scale, bool want_sink, int dtype, void* stream);

namespace {

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1, name, " must be 4-D with unit stride over D");
  TORCH_CHECK(x.stride(0) % 8 == 0 && x.stride(1) % 8 == 0 && x.stride(2) % 8 == 0 &&
                  reinterpret_cast<std::uintptr_t>(x.data_ptr()) % 16 == 0,
              name, " rows must be 16-byte aligned (strides multiples of 8 elements)");
}

void segment_attention_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const std::optional<at::Tensor>& start, at::Tensor& o,
                           at::Tensor& lse, at::Tensor& psink, double scale, bool want_sink) {
  check_rows(q, "q");
  check_rows(k, "k");
  check_rows(v, "v");
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kHalf || dt == at::kBFloat16, "q must be float16 or bfloat16");
  TORCH_CHECK(k.scalar_type() == dt && v.scalar_type() == dt, "k and v must have q's dtype");
  const int64_t B = q.size(0), Tq = q.size(1), Hq = q.size(2), D = q.size(3);
  const int64_t Tk = k.size(1), Hkv = k.size(2);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(3) == D, "k/v shape mismatch");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "Hq must be a multiple of Hkv");
  TORCH_CHECK(Tq <= Tk, "Tq must not exceed Tk");
  TORCH_CHECK(D % 8 == 0 && D <= 128, "head dim must be a multiple of 8 and <= 128");
  TORCH_CHECK(o.is_contiguous() && o.sizes() == q.sizes() && o.scalar_type() == dt,
              "o must be contiguous (B, Tq, Hq, D) of q's dtype");
  TORCH_CHECK(lse.is_contiguous() && lse.scalar_type() == at::kFloat && lse.dim() == 3 &&
                  lse.size(0) == B && lse.size(1) == Hq && lse.size(2) == Tq,
              "lse must be contiguous (B, Hq, Tq) float32");
  if (want_sink) {
    TORCH_CHECK(psink.is_contiguous() && psink.scalar_type() == at::kFloat &&
                    psink.sizes() == lse.sizes(),
                "psink must be contiguous (B, Hq, Tq) float32");
  }
  const int* start_ptr = nullptr;
  if (start.has_value()) {
    const at::Tensor& s = *start;
    TORCH_CHECK(s.is_cuda() && s.scalar_type() == at::kInt && s.is_contiguous() &&
                    s.dim() == 2 && s.size(0) == B && s.size(1) == Tk,
                "start must be a contiguous int32 CUDA tensor (B, Tk)");
    start_ptr = s.data_ptr<int>();
  }
  for (const at::Tensor* t : {&k, &v, static_cast<const at::Tensor*>(&o),
                               static_cast<const at::Tensor*>(&lse)}) {
    TORCH_CHECK(t->device() == q.device(), "all tensors must be on q's device");
  }
  // device-generic guard and stream lookup (no c10/cuda headers needed)
  const c10::DeviceGuard guard(q.device());
  void* stream = c10::impl::getDeviceGuardImpl(q.device().type())->getStream(q.device()).native_handle();
  const int err = smelt_segment_attention_fwd(
      q.data_ptr(), k.data_ptr(), v.data_ptr(), start_ptr, o.data_ptr(), lse.data_ptr<float>(),
      want_sink ? psink.data_ptr<float>() : nullptr, q.stride(0), q.stride(1), q.stride(2),
      k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
      static_cast<int>(B), static_cast<int>(Tq), static_cast<int>(Tk), static_cast<int>(Hq),
      static_cast<int>(Hkv), static_cast<int>(D), static_cast<float>(scale), want_sink,
      dt == at::kHalf ? 0 : 1, stream);
  TORCH_CHECK(err == 0, "segment_attention_fwd launch failed: ",
              cudaGetErrorString(static_cast<cudaError_t>(err)));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(smelt_cuda, m) {
  m.def(
      "segment_attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? start, Tensor(a!) o, "
      "Tensor(b!) lse, Tensor(c!) psink, float scale, bool want_sink) -> ()");
}

TORCH_LIBRARY_IMPL(smelt_cuda, CUDA, m) {
  m.impl("segment_attention_fwd", &segment_attention_fwd);
}
