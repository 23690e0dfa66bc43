// Grouped top-k expert GEMMs, forward, for fp16/bf16 on tensor cores through WMMA with fp32
// accumulation. Same semantics as the Triton kernels in smelt_kernels/moe_triton.py:
//
// * Rows are the T*k (token, slot) pairs sorted by expert; a tile table (built on the device
//   by smelt_kernels/routing.py) gives each BM-row tile its expert and row range; tiles
//   with expert -1 are unused (the table is sized from a host-known upper bound).
// * up:      PRE[r] = x[tok[r]] @ W1[e]^T (gate block and up block in two accumulators, the
//            gather in the A-load), HID[r] = silu(gate) * up.
// * down:    OUT[r] = HID[r] @ W2[e]^T.
// * combine: y[t] = sum_j w[t, j] * OUT[rev[t*k + j]] in slot order (rev < 0: skipped).
//
// A block owns BM = 64 rows and BN = 64 output columns (for `up`: 64 gate and the matching
// 64 up columns); four warps each hold a 32 x 32 quarter as 2 x 2 WMMA 16x16x16 fragments.
// Tiles are staged in shared memory with element-wise bounds checks, so any H and d_e work.
// Weights are read in their (out, in) row-major layout, which is exactly WMMA's col_major B.
// No torch headers: the binding (moe_gemm.cpp) calls the smelt_moe_* launchers below.
#include <mma.h>

#include <cstdint>

#include "../cuda_common.cuh"

namespace {

using namespace nvcuda;
using smelt::from_float;
using smelt::to_float;

constexpr int BM = 64;
constexpr int BN = 64;
constexpr int BK = 32;
constexpr int LDS = BK + 8;   // shared row length of A and B tiles (elements)
constexpr int LDC = BN + 4;   // shared row length of the fp32 epilogue tile
constexpr int NTHREADS = 128;

struct RowsParams {
  const void* a;        // A rows (row stride lda), gathered through idx when idx != null
  const int* idx;
  const void* w;        // weights (E, N_total, K) row-major: B[e][k][n] = w[e][n][k]
  const int* tile_e;
  const int* tile_r0;
  const int* tile_r1;
  void* out;            // up: PRE (rows, 2N); down: OUT (rows, N)
  void* hid;            // up: HID (rows, N)
  int64_t lda, w_expert_stride;
  int N, K;             // output columns per accumulator set, inner dim
};

// Stage rows [r0, r0+BM) x [k0, k0+BK) of A and rows [n0, n0+BN) x [k0, k0+BK) of one
// weight block (col_major B) into shared memory, zero outside the valid ranges.
template <typename T>
__device__ void load_tiles(const RowsParams& p, const T* wblk, int n_base, int r0, int r1, int n0,
                           int k0, T* As, T* Bs) {
  const T* a = static_cast<const T*>(p.a);
  const T zero = from_float<T>(0.0f);
  for (int i = threadIdx.x; i < BM * BK; i += NTHREADS) {
    const int r = i / BK, c = i % BK, row = r0 + r, k = k0 + c;
    T v = zero;
    if (row < r1 && k < p.K) {
      const int64_t src = p.idx ? p.idx[row] : row;
      v = a[src * p.lda + k];
    }
    As[r * LDS + c] = v;
  }
  for (int i = threadIdx.x; i < BN * BK; i += NTHREADS) {
    const int n = i / BK, c = i % BK, col = n0 + n, k = k0 + c;
    Bs[n * LDS + c] = (col < p.N && k < p.K) ? wblk[int64_t(n_base + col) * p.K + k] : zero;
  }
}

template <typename T, bool SWIGLU>
__global__ void __launch_bounds__(NTHREADS) rows_kernel(const RowsParams p) {
  const int tile = blockIdx.x;
  const int e = p.tile_e[tile];
  if (e < 0) return;
  const int r0 = p.tile_r0[tile], r1 = p.tile_r1[tile];
  const int n0 = blockIdx.y * BN;
  constexpr int NSETS = SWIGLU ? 2 : 1;
  // operand tiles, reused as the fp32 epilogue tiles
  constexpr int OPERANDS = (BM + NSETS * BN) * LDS * int(sizeof(T));
  constexpr int EPILOGUE = NSETS * BM * LDC * int(sizeof(float));
  __shared__ __align__(128) unsigned char smem[OPERANDS > EPILOGUE ? OPERANDS : EPILOGUE];
  T* As = reinterpret_cast<T*>(smem);
  T* Bs = As + BM * LDS;
  const T* wblk = static_cast<const T*>(p.w) + int64_t(e) * p.w_expert_stride;

  const int warp = threadIdx.x / 32, wm = (warp / 2) * 32, wn = (warp % 2) * 32;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[NSETS][2][2];
#pragma unroll
  for (int s = 0; s < NSETS; ++s)
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[s][i][j], 0.0f);

  for (int k0 = 0; k0 < p.K; k0 += BK) {
    __syncthreads();
    load_tiles<T>(p, wblk, 0, r0, r1, n0, k0, As, Bs);
    if (SWIGLU) {
      // the up rows of W1[e] follow its N gate rows; only B needs loading again
      const T zero = from_float<T>(0.0f);
      T* Bu = Bs + BN * LDS;
      for (int i = threadIdx.x; i < BN * BK; i += NTHREADS) {
        const int n = i / BK, c = i % BK, col = n0 + n, k = k0 + c;
        Bu[n * LDS + c] = (col < p.N && k < p.K) ? wblk[int64_t(p.N + col) * p.K + k] : zero;
      }
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> af[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(af[i], As + (wm + 16 * i) * LDS + kk, LDS);
#pragma unroll
      for (int s = 0; s < NSETS; ++s) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> bf;
          wmma::load_matrix_sync(bf, Bs + s * BN * LDS + (wn + 16 * j) * LDS + kk, LDS);
#pragma unroll
          for (int i = 0; i < 2; ++i) wmma::mma_sync(acc[s][i][j], af[i], bf, acc[s][i][j]);
        }
      }
    }
  }
  __syncthreads();
  float* Cs = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int s = 0; s < NSETS; ++s)
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j)
        wmma::store_matrix_sync(Cs + s * BM * LDC + (wm + 16 * i) * LDC + wn + 16 * j, acc[s][i][j], LDC,
                                wmma::mem_row_major);
  __syncthreads();
  T* out = static_cast<T*>(p.out);
  for (int i = threadIdx.x; i < BM * BN; i += NTHREADS) {
    const int r = i / BN, c = i % BN, row = r0 + r, col = n0 + c;
    if (row >= r1 || col >= p.N) continue;
    const float g = Cs[r * LDC + c];
    if (SWIGLU) {
      const float u = Cs[BM * LDC + r * LDC + c];
      out[int64_t(row) * 2 * p.N + col] = from_float<T>(g);
      out[int64_t(row) * 2 * p.N + p.N + col] = from_float<T>(u);
      const float h = g / (1.0f + __expf(-g)) * u;
      static_cast<T*>(p.hid)[int64_t(row) * p.N + col] = from_float<T>(h);
    } else {
      out[int64_t(row) * p.N + col] = from_float<T>(g);
    }
  }
}

template <typename T>
__global__ void combine_kernel(const T* src, const int* rev, const float* w, T* y, int T_, int H, int k) {
  const int t = blockIdx.x;
  const int c = blockIdx.y * blockDim.x + threadIdx.x;
  if (t >= T_ || c >= H) return;
  float acc = 0.0f;
  for (int j = 0; j < k; ++j) {
    const int r = rev[int64_t(t) * k + j];
    if (r >= 0) acc += w[int64_t(t) * k + j] * to_float(src[int64_t(r) * H + c]);
  }
  y[int64_t(t) * H + c] = from_float<T>(acc);
}

template <typename T>
cudaError_t launch_rows(const RowsParams& p, int n_tiles, bool swiglu, cudaStream_t stream) {
  if (n_tiles == 0 || p.N == 0) return cudaSuccess;
  const dim3 grid(n_tiles, (p.N + BN - 1) / BN);
  if (swiglu) rows_kernel<T, true><<<grid, NTHREADS, 0, stream>>>(p);
  else rows_kernel<T, false><<<grid, NTHREADS, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

// Row tiles of BM = 64 (the caller builds the tile table with that size). dtype: 0 = fp16,
// 1 = bf16. Returns a cudaError_t as int (0 = success).
//
// up: x (T, H) rows gathered by tok; w1 (E, 2*de, H); pre (rows, 2*de); hid (rows, de).
int smelt_moe_up(const void* x, const int* tok, const void* w1, const int* tile_e, const int* tile_r0,
                 const int* tile_r1, int n_tiles, void* pre, void* hid, int64_t ldx, int H, int de,
                 int dtype, void* stream) {
  RowsParams p{x, tok, w1, tile_e, tile_r0, tile_r1, pre, hid, ldx, int64_t(2) * de * H, de, H};
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return int(smelt::with_dtype(dtype, [&](auto t) { return launch_rows<decltype(t)>(p, n_tiles, true, s); }));
}

// down: hid (rows, de); w2 (E, H, de); out (rows, H).
int smelt_moe_down(const void* hid, const void* w2, const int* tile_e, const int* tile_r0, const int* tile_r1,
                   int n_tiles, void* out, int H, int de, int dtype, void* stream) {
  RowsParams p{hid, nullptr, w2, tile_e, tile_r0, tile_r1, out, nullptr, de, int64_t(H) * de, H, de};
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return int(smelt::with_dtype(dtype, [&](auto t) { return launch_rows<decltype(t)>(p, n_tiles, false, s); }));
}

// combine: src (rows, H); rev (T*k,); w (T*k,) fp32; y (T, H).
int smelt_moe_combine(const void* src, const int* rev, const float* w, void* y, int T, int H, int k, int dtype,
                      void* stream) {
  if (T == 0 || H == 0) return 0;
  const dim3 grid(T, (H + 255) / 256);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  smelt::with_dtype(dtype, [&](auto tag) {
    using Elem = decltype(tag);
    combine_kernel<Elem><<<grid, 256, 0, s>>>(static_cast<const Elem*>(src), rev, w, static_cast<Elem*>(y), T, H, k);
    return 0;
  });
  return int(cudaGetLastError());
}
