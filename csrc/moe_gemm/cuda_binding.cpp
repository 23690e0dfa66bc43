// torch.library binding of the grouped MoE forward kernels (csrc/moe_gemm/cuda.cu).
//
//   torch.ops.smelt_cuda.moe_up(x, w1, tok, tile_e, tile_r0, tile_r1, pre, hid)
//   torch.ops.smelt_cuda.moe_down(hid, w2, tile_e, tile_r0, tile_r1, out)
//   torch.ops.smelt_cuda.moe_combine(src, rev, topk_weights, y)
//
// write pre (T*k, 2 d_e) and hid (T*k, d_e), out (T*k, H), y (T, H). The tile table comes
// from smelt_kernels/moe_gemm/routing.py with BM = 64. smelt_kernels/moe_gemm/ops.py validates the
// public inputs first; the checks here guard the kernels' own assumptions.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <cstdint>

int smelt_moe_up(const void* x, const int* tok, const void* w1, const int* tile_e, const int* tile_r0,
                 const int* tile_r1, int n_tiles, void* pre, void* hid, int64_t ldx, int H, int de,
                 int dtype, void* stream);
int smelt_moe_down(const void* hid, const void* w2, const int* tile_e, const int* tile_r0, const int* tile_r1,
                   int n_tiles, void* out, int H, int de, int dtype, void* stream);
int smelt_moe_combine(const void* src, const int* rev, const float* w, void* y, int T, int H, int k, int dtype,
                      void* stream);

namespace {

int dtype_code(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16, name,
              " must be float16 or bfloat16");
  return t.scalar_type() == at::kHalf ? 0 : 1;
}

void check_int(const at::Tensor& t, const char* name, const at::Tensor& like) {
  TORCH_CHECK(t.device() == like.device() && t.scalar_type() == at::kInt && t.is_contiguous() && t.dim() == 1,
              name, " must be a contiguous int32 vector on ", like.device());
}

void check_out(const at::Tensor& t, const char* name, const at::Tensor& like, int64_t rows, int64_t cols) {
  TORCH_CHECK(t.device() == like.device() && t.scalar_type() == like.scalar_type() && t.is_contiguous() &&
                  t.dim() == 2 && t.size(0) == rows && t.size(1) == cols,
              name, " must be contiguous (", rows, ", ", cols, ") of dtype ", like.scalar_type());
}

void* stream_of(const at::Tensor& t) {
  return c10::impl::getDeviceGuardImpl(t.device().type())->getStream(t.device()).native_handle();
}

void check_tiles(const at::Tensor& te, const at::Tensor& t0, const at::Tensor& t1, const at::Tensor& like) {
  check_int(te, "tile_e", like);
  check_int(t0, "tile_r0", like);
  check_int(t1, "tile_r1", like);
  TORCH_CHECK(t0.numel() == te.numel() && t1.numel() == te.numel(), "tile arrays must have one length");
}

void moe_up(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& tok, const at::Tensor& tile_e,
            const at::Tensor& tile_r0, const at::Tensor& tile_r1, at::Tensor& pre, at::Tensor& hid) {
  const int dt = dtype_code(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be (T, H) with unit column stride");
  TORCH_CHECK(w1.is_contiguous() && w1.dim() == 3 && w1.scalar_type() == x.scalar_type() &&
                  w1.size(2) == x.size(1) && w1.size(1) % 2 == 0 && w1.device() == x.device(),
              "w1 must be contiguous (E, 2*d_e, H) of x's dtype and device");
  check_int(tok, "tok", x);
  check_tiles(tile_e, tile_r0, tile_r1, x);
  const int64_t rows = tok.numel(), H = x.size(1), de = w1.size(1) / 2;
  check_out(pre, "pre", x, rows, 2 * de);
  check_out(hid, "hid", x, rows, de);
  const c10::DeviceGuard guard(x.device());
  const int err = smelt_moe_up(x.data_ptr(), tok.data_ptr<int>(), w1.data_ptr(), tile_e.data_ptr<int>(),
                               tile_r0.data_ptr<int>(), tile_r1.data_ptr<int>(), int(tile_e.numel()),
                               pre.data_ptr(), hid.data_ptr(), x.stride(0), int(H), int(de), dt, stream_of(x));
  TORCH_CHECK(err == 0, "moe_up launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

void moe_down(const at::Tensor& hid, const at::Tensor& w2, const at::Tensor& tile_e, const at::Tensor& tile_r0,
              const at::Tensor& tile_r1, at::Tensor& out) {
  const int dt = dtype_code(hid, "hid");
  TORCH_CHECK(hid.is_contiguous() && hid.dim() == 2, "hid must be contiguous (rows, d_e)");
  TORCH_CHECK(w2.is_contiguous() && w2.dim() == 3 && w2.scalar_type() == hid.scalar_type() &&
                  w2.size(2) == hid.size(1) && w2.device() == hid.device(),
              "w2 must be contiguous (E, H, d_e) of hid's dtype and device");
  check_tiles(tile_e, tile_r0, tile_r1, hid);
  const int64_t H = w2.size(1), de = w2.size(2);
  check_out(out, "out", hid, hid.size(0), H);
  const c10::DeviceGuard guard(hid.device());
  const int err = smelt_moe_down(hid.data_ptr(), w2.data_ptr(), tile_e.data_ptr<int>(), tile_r0.data_ptr<int>(),
                                 tile_r1.data_ptr<int>(), int(tile_e.numel()), out.data_ptr(), int(H), int(de),
                                 dt, stream_of(hid));
  TORCH_CHECK(err == 0, "moe_down launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

void moe_combine(const at::Tensor& src, const at::Tensor& rev, const at::Tensor& tw, at::Tensor& y) {
  const int dt = dtype_code(src, "src");
  TORCH_CHECK(src.is_contiguous() && src.dim() == 2, "src must be contiguous (rows, H)");
  check_int(rev, "rev", src);
  TORCH_CHECK(tw.device() == src.device() && tw.scalar_type() == at::kFloat && tw.is_contiguous() &&
                  tw.numel() == rev.numel() && tw.dim() == 2,
              "topk_weights must be contiguous float32 (T, k) on src's device");
  const int64_t T = tw.size(0), k = tw.size(1), H = src.size(1);
  check_out(y, "y", src, T, H);
  const c10::DeviceGuard guard(src.device());
  const int err = smelt_moe_combine(src.data_ptr(), rev.data_ptr<int>(), tw.data_ptr<float>(), y.data_ptr(),
                                    int(T), int(H), int(k), dt, stream_of(src));
  TORCH_CHECK(err == 0, "moe_combine launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(smelt_cuda, m) {
  m.def(
      "moe_up(Tensor x, Tensor w1, Tensor tok, Tensor tile_e, Tensor tile_r0, Tensor tile_r1, "
      "Tensor(a!) pre, Tensor(b!) hid) -> ()");
  m.def("moe_down(Tensor hid, Tensor w2, Tensor tile_e, Tensor tile_r0, Tensor tile_r1, Tensor(a!) out) -> ()");
  m.def("moe_combine(Tensor src, Tensor rev, Tensor topk_weights, Tensor(a!) y) -> ()");
}

TORCH_LIBRARY_IMPL(smelt_cuda, CUDA, m) {
  m.impl("moe_up", &moe_up);
  m.impl("moe_down", &moe_down);
  m.impl("moe_combine", &moe_combine);
}
