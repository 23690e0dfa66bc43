// Segment attention forward (causal inside segments, GQA, LSE and sink) for fp16/bf16 on
// tensor cores through WMMA, fp32 softmax. Same semantics as the Triton kernel in
// smelt_kernels/attention_triton.py:
//
// * q (B, Tq, Hq, D), k/v (B, Tk, Hkv, D) with unit stride over D; o contiguous
//   (B, Tq, Hq, D); lse, psink contiguous (B, Hq, Tq) fp32.
// * A block owns one (batch, KV head) and BM = 64 rows; row r is (query r / G, head r % G)
//   of that KV head's group, so each K/V tile in shared memory serves all G heads.
// * Query position p sees keys [start[p], p] (start: int32 (B, Tk), or null for one
//   segment). The block visits keys start(p_first) .. p_last in BN = 64 tiles and applies
//   the interval mask only to tiles that are not inside every row's interval.
// * An empty interval (the host's encoding of a row with decreasing segment ids) gives NaN.
// * Masked pairs add nothing: their scores are -inf (a NaN or inf key a row does not see
//   never reaches it), and in tiles with masked pairs the V tile's non-finite entries are
//   zeroed as they are loaded (0 * NaN would be NaN) and flagged per key, so that a row
//   which does see one gets NaN in its whole output row.
//
// The head dim is padded to DP in {32, 64, 96, 128} in shared memory only. Four warps,
// sixteen rows each: S = Q K^T and O += P V on WMMA 16x16x16 fragments; the softmax runs
// on S in shared memory, two lanes per row; the O accumulator lives in shared memory (fp32).
// No torch headers: the binding (attention.cpp) calls smelt_segment_attention_fwd.
#include <mma.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../cuda_common.cuh"

namespace {

using namespace nvcuda;
using smelt::from_float;
using smelt::to_float;

constexpr int BM = 64;       // rows per block
constexpr int BN = 64;       // keys per tile
constexpr int NTHREADS = 128;
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

struct Params {
  const void* q;
  const void* k;
  const void* v;
  const int* start;
  void* o;
  float* lse;
  float* psink;
  int64_t sqb, sqt, sqh, skb, skt, skh, svb, svt, svh;
  int B, Tq, Tk, Hq, Hkv, D;
  float scale;
  bool want_sink;
};

template <int DP>
struct Layout {
  static constexpr int LD = DP + 8;    // Q, K, V rows (elements of T)
  static constexpr int LDS = BN + 4;   // S rows (float)
  static constexpr int LDP = BN + 8;   // P rows (T)
  static constexpr int LDO = DP + 4;   // O rows (float)
  static constexpr size_t kQ = 0;
  static constexpr size_t kK = kQ + size_t(BM) * LD * 2;
  static constexpr size_t kV = kK + size_t(BN) * LD * 2;
  static constexpr size_t kS = kV + size_t(BN) * LD * 2;
  static constexpr size_t kP = kS + size_t(BM) * LDS * 4;
  static constexpr size_t kO = kP + size_t(BM) * LDP * 2;
  static constexpr size_t kBad = kO + size_t(BM) * LDO * 4;  // int[2][BN]: V keys with a NaN or inf
  static constexpr size_t bytes = kBad + size_t(2) * BN * 4;
};

// Zeroes the NaN and inf lanes of eight 16-bit values; returns whether there was one.
template <typename T>
__device__ __forceinline__ bool zero_non_finite(uint4& v) {
  constexpr uint32_t exp = std::is_same_v<T, __half> ? 0x7C00u : 0x7F80u;  // all-ones exponent
  uint32_t* w = reinterpret_cast<uint32_t*>(&v);
  bool any = false;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const bool lo = (w[i] & exp) == exp, hi = ((w[i] >> 16) & exp) == exp;
    w[i] &= (lo ? 0xFFFF0000u : 0xFFFFFFFFu) & (hi ? 0x0000FFFFu : 0xFFFFFFFFu);
    any |= lo | hi;
  }
  return any;
}

// acc += A B over `steps` 16-deep slices: A row-major (16 rows from a, leading dimension
// lda, slice s at a + 16 s), B in layout BL (leading dimension ldb, slice s at b + s * b_step).
template <typename T, int steps, typename BL>
__device__ __forceinline__ void mma_steps(wmma::fragment<wmma::accumulator, 16, 16, 16, float>& acc,
                                          const T* a, int lda, const T* b, int ldb, int b_step) {
#pragma unroll
  for (int s = 0; s < steps; ++s) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, BL> fb;
    wmma::load_matrix_sync(fa, a + s * 16, lda);
    wmma::load_matrix_sync(fb, b + s * b_step, ldb);
    wmma::mma_sync(acc, fa, fb, acc);
  }
}

// Copy `rows` rows of D elements (16-byte chunks) from global into shared memory, zero
// filling columns >= D and rows with index >= n_valid. With `bad` (zeroed beforehand), NaN
// and inf values are zeroed too and bad[r] set for their rows.
template <typename T, int DP>
__device__ __forceinline__ void load_kv_tile(T* dst, const T* base, int64_t row_stride, int n0,
                                             int n_valid, int D, int* bad) {
  constexpr int CH = DP / 8;
  constexpr int LD = Layout<DP>::LD;
  for (int i = threadIdx.x; i < BN * CH; i += NTHREADS) {
    const int r = i / CH;
    const int c = (i % CH) * 8;
    uint4 val = make_uint4(0u, 0u, 0u, 0u);
    if (n0 + r < n_valid && c < D) {
      val = *reinterpret_cast<const uint4*>(base + int64_t(n0 + r) * row_stride + c);
      if (bad != nullptr && zero_non_finite<T>(val)) bad[r] = 1;
    }
    *reinterpret_cast<uint4*>(dst + r * LD + c) = val;
  }
}

template <typename T, int DP>
__global__ void __launch_bounds__(NTHREADS) segment_attention_fwd_kernel(const Params p) {
  using L = Layout<DP>;
  constexpr int LD = L::LD, LDS = L::LDS, LDP = L::LDP, LDO = L::LDO;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem + L::kQ);
  T* sK = reinterpret_cast<T*>(smem + L::kK);
  T* sV = reinterpret_cast<T*>(smem + L::kV);
  float* sS = reinterpret_cast<float*>(smem + L::kS);
  T* sP = reinterpret_cast<T*>(smem + L::kP);
  float* sO = reinterpret_cast<float*>(smem + L::kO);
  int* sBad = reinterpret_cast<int*>(smem + L::kBad);

  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int G = p.Hq / p.Hkv;
  const int tile = gridDim.x - 1 - blockIdx.x;  // longest tiles first
  const int64_t b = blockIdx.y / p.Hkv;
  const int hkv = blockIdx.y % p.Hkv;
  const int n_rows = p.Tq * G;
  const int off = p.Tk - p.Tq;
  const int r0 = tile * BM;
  const int pos_first = r0 / G + off;
  const int pos_last = (min(r0 + BM, n_rows) - 1) / G + off;
  const int* seg = p.start != nullptr ? p.start + b * p.Tk : nullptr;
  const int start_first = seg != nullptr ? seg[pos_first] : 0;
  const int start_last = seg != nullptr ? seg[pos_last] : 0;

  // the row whose softmax this lane shares with its neighbour (lane ^ 1)
  const int my_row = warp * 16 + (lane >> 1);
  const int half_idx = lane & 1;
  const bool my_ok = r0 + my_row < n_rows;
  const int my_flat = min(r0 + my_row, n_rows - 1);
  const int my_qi = my_flat / G;
  const int my_h = hkv * G + my_flat % G;
  const int my_pos = my_qi + off;
  const int my_start = seg != nullptr ? seg[my_pos] : 0;

  constexpr int CH = DP / 8;
  for (int i = tid; i < BM * CH; i += NTHREADS) {
    const int r = i / CH;
    const int c = (i % CH) * 8;
    const int flat = min(r0 + r, n_rows - 1);
    const int64_t qi = flat / G;
    const int64_t h = hkv * G + flat % G;
    uint4 val = make_uint4(0u, 0u, 0u, 0u);
    if (c < p.D) val = *reinterpret_cast<const uint4*>(q + b * p.sqb + qi * p.sqt + h * p.sqh + c);
    *reinterpret_cast<uint4*>(sQ + r * LD + c) = val;
  }
  for (int i = tid; i < BM * LDO; i += NTHREADS) sO[i] = 0.f;
  for (int i = tid; i < 2 * BN; i += NTHREADS) sBad[i] = 0;
  __syncthreads();  // sQ and sO are read below even when no key tile is visited

  const float qk_scale = p.scale * LOG2E;
  const int lo = start_first;
  const int mid = lo + ((max(start_last - lo, 0) + BN - 1) / BN) * BN;
  const int diag = mid + (max(pos_first + 1 - mid, 0) / BN) * BN;
  const int hi = pos_last + 1;
  const T* kb = k + b * p.skb + int64_t(hkv) * p.skh;
  const T* vb = v + b * p.svb + int64_t(hkv) * p.svh;
  float m_i = -1.0e30f;
  float l_i = 0.f;
  bool sees_bad = false;  // a visible value of this row is NaN or inf

  for (int n0 = lo, it = 0; n0 < hi; n0 += BN, ++it) {
    const bool masked = n0 < mid || n0 >= diag;
    // flags of masked tiles alternate between two arrays: this tile's was cleared during
    // the previous one, after every warp had read it two tiles ago
    int* bad = sBad + (it & 1) * BN;
    __syncthreads();  // every warp is done with the previous K/V tile
    if (tid < BN) sBad[((it + 1) & 1) * BN + tid] = 0;
    load_kv_tile<T, DP>(sK, kb, p.skt, n0, p.Tk, p.D, nullptr);
    load_kv_tile<T, DP>(sV, vb, p.svt, n0, p.Tk, p.D, masked ? bad : nullptr);
    __syncthreads();

    // S = Q K^T for this warp's sixteen rows
#pragma unroll
    for (int nb = 0; nb < BN / 16; ++nb) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.f);
      mma_steps<T, DP / 16, wmma::col_major>(acc, sQ + warp * 16 * LD, LD, sK + nb * 16 * LD, LD, 16);
      wmma::store_matrix_sync(sS + warp * 16 * LDS + nb * 16, acc, LDS, wmma::mem_row_major);
    }
    __syncwarp();

    // online softmax: this lane takes 32 of its row's 64 scores, its keys c_lo..c_hi of
    // them visible. The scores are read from shared memory twice (max, then exponentials)
    // rather than held in 32 registers across both passes (which spilled).
    const float* srow = sS + my_row * LDS + half_idx * 32;
    const int j0 = n0 + half_idx * 32;
    const int c_lo = masked ? my_start - j0 : 0, c_hi = masked ? my_pos - j0 : 31;
    float mx = -INFINITY;
#pragma unroll
    for (int c = 0; c < 32; ++c) mx = fmaxf(mx, c >= c_lo && c <= c_hi ? srow[c] * qk_scale : -INFINITY);
    if (masked) {
      const int* brow = bad + half_idx * 32;
      for (int c = max(c_lo, 0); c <= min(c_hi, 31); ++c) sees_bad |= brow[c] != 0;
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    const float m_new = fmaxf(m_i, mx);
    const float alpha = exp2f(m_i - m_new);
    T* prow = sP + my_row * LDP + half_idx * 32;
    float sum = 0.f;
#pragma unroll
    for (int c = 0; c < 32; ++c) {
      const float pv = exp2f((c >= c_lo && c <= c_hi ? srow[c] * qk_scale : -INFINITY) - m_new);
      sum += pv;
      prow[c] = from_float<T>(pv);
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    l_i = l_i * alpha + sum;
    m_i = m_new;
    float* orow = sO + my_row * LDO + half_idx * (DP / 2);
#pragma unroll
    for (int c = 0; c < DP / 2; ++c) orow[c] *= alpha;
    __syncwarp();

    // O += P V
#pragma unroll
    for (int db = 0; db < DP / 16; ++db) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::load_matrix_sync(acc, sO + warp * 16 * LDO + db * 16, LDO, wmma::mem_row_major);
      mma_steps<T, BN / 16, wmma::row_major>(acc, sP + warp * 16 * LDP, LDP, sV + db * 16, LD, 16 * LD);
      wmma::store_matrix_sync(sO + warp * 16 * LDO + db * 16, acc, LDO, wmma::mem_row_major);
    }
    __syncwarp();
  }

  // epilogue: normalise (an empty interval leaves l = 0: 0 * inf = NaN, on purpose)
  const float lse2 = l_i > 0.f ? m_i + log2f(l_i) : NAN;
  sees_bad |= __shfl_xor_sync(0xffffffffu, int(sees_bad), 1) != 0;
  const float inv = sees_bad ? NAN : 1.f / l_i;
  {
    float* orow = sO + my_row * LDO + half_idx * (DP / 2);
#pragma unroll
    for (int c = 0; c < DP / 2; ++c) orow[c] *= inv;
  }
  float p0 = 0.f;
  if (p.want_sink) {
    const int sidx = min(my_start, p.Tk - 1);
    const T* k0 = kb + int64_t(sidx) * p.skt;
    float dot = 0.f;
    for (int c = half_idx * (DP / 2); c < (half_idx + 1) * (DP / 2) && c < p.D; ++c)
      dot += to_float(sQ[my_row * LD + c]) * to_float(k0[c]);
    dot += __shfl_xor_sync(0xffffffffu, dot, 1);
    p0 = my_start != my_pos ? exp2f(dot * qk_scale - lse2) : 0.f;
  }
  if (my_ok && half_idx == 0) {
    const int64_t stat = (b * p.Hq + my_h) * int64_t(p.Tq) + my_qi;
    p.lse[stat] = lse2 * LN2;
    if (p.want_sink) p.psink[stat] = p0;
  }
  __syncthreads();
  T* o = static_cast<T*>(p.o);
  for (int i = tid; i < BM * CH; i += NTHREADS) {
    const int r = i / CH;
    const int c = (i % CH) * 8;
    if (r0 + r >= n_rows || c >= p.D) continue;
    const int flat = r0 + r;
    const int64_t qi = flat / G;
    const int64_t h = hkv * G + flat % G;
    alignas(16) T out[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) out[e] = from_float<T>(sO[r * LDO + c + e]);
    *reinterpret_cast<uint4*>(o + ((b * p.Tq + qi) * p.Hq + h) * p.D + c) =
        *reinterpret_cast<const uint4*>(out);
  }
}

template <typename T, int DP>
cudaError_t launch(const Params& p, cudaStream_t stream) {
  constexpr size_t smem = Layout<DP>::bytes;
  auto kernel = segment_attention_fwd_kernel<T, DP>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (err != cudaSuccess) return err;
  const int G = p.Hq / p.Hkv;
  const dim3 grid((p.Tq * G + BM - 1) / BM, p.B * p.Hkv);
  kernel<<<grid, NTHREADS, smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t dispatch_head_dim(const Params& p, cudaStream_t stream) {
  if (p.D <= 32) return launch<T, 32>(p, stream);
  if (p.D <= 64) return launch<T, 64>(p, stream);
  if (p.D <= 96) return launch<T, 96>(p, stream);
  if (p.D <= 128) return launch<T, 128>(p, stream);
  return cudaErrorInvalidValue;
}

}  // namespace

// Launch the forward on `stream`. dtype: 0 = fp16, 1 = bf16. Strides are in elements
// (batch, time, head); the D stride is 1. Returns a cudaError_t as int (0 = success).
// The caller guarantees: D % 8 == 0 and D <= 128, Hq % Hkv == 0, Tq <= Tk,
// 16-byte aligned rows, o contiguous, lse/psink (B, Hq, Tq) contiguous.
int smelt_segment_attention_fwd(const void* q, const void* k, const void* v, const int* start,
                                void* o, float* lse, float* psink, int64_t sqb, int64_t sqt,
                                int64_t sqh, int64_t skb, int64_t skt, int64_t skh, int64_t svb,
                                int64_t svt, int64_t svh, int B, int Tq, int Tk, int Hq, int Hkv,
                                int D, float scale, bool want_sink, int dtype, void* stream) {
  if (B == 0 || Tq == 0 || Hq == 0) return 0;  // no query: nothing to launch
  Params p{q, k, v, start, o, lse, psink, sqb, sqt, sqh, skb, skt, skh, svb, svt, svh,
           B, Tq, Tk, Hq, Hkv, D, scale, want_sink};
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const cudaError_t err =
      smelt::with_dtype(dtype, [&](auto tag) { return dispatch_head_dim<decltype(tag)>(p, s); });
  return int(err);
}
