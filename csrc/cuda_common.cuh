// Helpers shared by the CUDA kernels (csrc/*/cuda.cu): fp16/bf16 <-> fp32 conversion and
// the dispatch on the dtype code the bindings pass (0 = fp16, 1 = bf16).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace smelt {

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Calls launch(T{}) with T = __half for dtype code 0 and __nv_bfloat16 otherwise, and
// returns what it returns: `with_dtype(dtype, [&](auto tag) { return run<decltype(tag)>(); })`.
template <typename F>
auto with_dtype(int dtype, F&& launch) {
  return dtype == 0 ? launch(__half{}) : launch(__nv_bfloat16{});
}

}  // namespace smelt
