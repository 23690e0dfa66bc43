// The fp32 AVX-512 micro-kernel of the CPU MoE forward, on row pointers.
//
//   c[i][n0 : n0 + nb] (=, +=) sum_{k < kb} a[i][k0 + k] * B[k][0 : nb],   i < M
//
// A and C are given as one pointer per row, so that token rows are read where they lie in x
// (no gathered copy) and output rows are written straight to their place, with
// non-temporal stores when they are only read back after the whole pass. B is a block of at
// most 64 columns (one L1-resident block of a transposed weight matrix). Tiles of 6 rows by
// as many 16-column vectors as the block needs (up to 24 accumulators) stay in registers over
// the whole K block, and every 4 steps of K
// the kernel prefetches one cache line of what the next item will read, so that the next
// expert's weights stream in while this one computes instead of stalling the transposes.
#pragma once

#include "../cpu_blas.h"
#include "../env.h"

namespace smelt_moe {

constexpr int64_t kNtN = 64, kNtK = 128;  // columns and K rows of a transposed weight block

// Cursor over up to two byte ranges that a kernel prefetches into L2 one line at a time.
class LinePrefetch {
 public:
  void reset(const void* a, int64_t a_bytes, const void* b, int64_t b_bytes) {
    p_[0] = static_cast<const char*>(a);
    end_[0] = a ? p_[0] + a_bytes : p_[0];
    p_[1] = static_cast<const char*>(b);
    end_[1] = b ? p_[1] + b_bytes : p_[1];
  }
  void clear() { reset(nullptr, 0, nullptr, 0); }
  // Prefetch the next line, if any is left.
  void one() {
#if defined(__x86_64__) && defined(__GNUC__)
    if (p_[0] < end_[0]) {
      _mm_prefetch(p_[0], _MM_HINT_T1);
      p_[0] += 64;
    } else if (p_[1] < end_[1]) {
      _mm_prefetch(p_[1], _MM_HINT_T1);
      p_[1] += 64;
    }
#endif
  }
  // Prefetch the next n lines.
  void step(int64_t n) {
    for (; n > 0 && (p_[0] < end_[0] || p_[1] < end_[1]); --n) one();
  }
  // Lines left to prefetch.
  int64_t lines() const { return ((end_[0] - p_[0]) + (end_[1] - p_[1]) + 63) / 64; }
  // Prefetch everything that is left.
  void finish() { step(INT64_MAX); }

 private:
  const char* p_[2] = {nullptr, nullptr};
  const char* end_[2] = {nullptr, nullptr};
};

#if defined(__x86_64__) && defined(__GNUC__)
#define SMELT_HAVE_ROWS_KERNEL 1

// acc[r][:] += a[r][k] * B[k][:] for the R rows of a tile of V vectors of 16 columns; lanes
// of the last vector outside `tail` are read as zero.
template <int R, int V>
__attribute__((target("avx512f"), always_inline)) inline void rows_step(__m512 (&acc)[R][V], const float* const* a,
                                                                        const float* B, int64_t ldb, int64_t k,
                                                                        __mmask16 tail) {
  const float* b = B + k * ldb;
  __m512 bv[V];
#pragma GCC unroll 4
  for (int v = 0; v < V; ++v) bv[v] = v + 1 < V ? _mm512_loadu_ps(b + 16 * v) : _mm512_maskz_loadu_ps(tail, b + 16 * v);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m512 av = _mm512_set1_ps(a[r][k]);
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(av, bv[v], acc[r][v]);
  }
}

// One tile of R <= 6 rows by V vectors. Lanes of B past the block's columns are read as zero
// (masked loads) and never stored, so B's padding may hold anything.
template <int R, int V, bool Add, bool Stream>
__attribute__((target("avx512f"), always_inline)) inline void rows_tile(const float* const* a, const float* B,
                                                                        int64_t ldb, int64_t kb, float* const* c,
                                                                        __mmask16 tail, LinePrefetch* pf) {
  __m512 acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      if constexpr (!Add) acc[r][v] = _mm512_setzero_ps();
      else acc[r][v] = v + 1 < V ? _mm512_loadu_ps(c[r] + 16 * v) : _mm512_maskz_loadu_ps(tail, c[r] + 16 * v);
    }
  }
  const float* ap[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) ap[r] = a[r];
  int64_t k = 0;
  for (; k + 4 <= kb; k += 4) {  // one prefetched line per four steps of K
    if (pf) pf->one();
    rows_step<R, V>(acc, ap, B, ldb, k, tail);
    rows_step<R, V>(acc, ap, B, ldb, k + 1, tail);
    rows_step<R, V>(acc, ap, B, ldb, k + 2, tail);
    rows_step<R, V>(acc, ap, B, ldb, k + 3, tail);
  }
  for (; k < kb; ++k) rows_step<R, V>(acc, ap, B, ldb, k, tail);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      float* dst = c[r] + 16 * v;
      const bool whole = v + 1 < V || tail == 0xffff;
      if (Stream && whole && (reinterpret_cast<uintptr_t>(dst) & 63) == 0)
        _mm512_stream_ps(dst, acc[r][v]);
      else if (whole)
        _mm512_storeu_ps(dst, acc[r][v]);
      else
        _mm512_mask_storeu_ps(dst, tail, acc[r][v]);
    }
  }
}

template <int V, bool Add, bool Stream>
__attribute__((target("avx512f"))) inline void rows_block(int64_t M, const float* const* a, int64_t k0,
                                                          const float* B, int64_t ldb, int64_t kb,
                                                          float* const* c, int64_t n0, int64_t nb,
                                                          LinePrefetch* pf) {
  const __mmask16 tail = static_cast<__mmask16>((1u << (nb - 16 * (V - 1))) - 1u);
  const float* ar[6];
  float* cr[6];
  int64_t i = 0;
  for (; i + 6 <= M; i += 6) {
    for (int r = 0; r < 6; ++r) ar[r] = a[i + r] + k0, cr[r] = c[i + r] + n0;
    rows_tile<6, V, Add, Stream>(ar, B, ldb, kb, cr, tail, pf);
  }
  const int64_t rest = M - i;
  for (int64_t r = 0; r < rest; ++r) ar[r] = a[i + r] + k0, cr[r] = c[i + r] + n0;
  switch (rest) {
    case 5: rows_tile<5, V, Add, Stream>(ar, B, ldb, kb, cr, tail, pf); break;
    case 4: rows_tile<4, V, Add, Stream>(ar, B, ldb, kb, cr, tail, pf); break;
    case 3: rows_tile<3, V, Add, Stream>(ar, B, ldb, kb, cr, tail, pf); break;
    case 2: rows_tile<2, V, Add, Stream>(ar, B, ldb, kb, cr, tail, pf); break;
    case 1: rows_tile<1, V, Add, Stream>(ar, B, ldb, kb, cr, tail, pf); break;
    default: break;
  }
}

// rows_block for a block of nb <= 64 columns: as many vectors as it needs.
template <bool Add, bool Stream>
inline void rows_block_any(int64_t M, const float* const* a, int64_t k0, const float* B, int64_t ldb, int64_t kb,
                           float* const* c, int64_t n0, int64_t nb, LinePrefetch* pf) {
  switch (cdiv(nb, 16)) {
    case 1: rows_block<1, Add, Stream>(M, a, k0, B, ldb, kb, c, n0, nb, pf); break;
    case 2: rows_block<2, Add, Stream>(M, a, k0, B, ldb, kb, c, n0, nb, pf); break;
    case 3: rows_block<3, Add, Stream>(M, a, k0, B, ldb, kb, c, n0, nb, pf); break;
    default: rows_block<4, Add, Stream>(M, a, k0, B, ldb, kb, c, n0, nb, pf); break;
  }
}

// c[i][n0 : n0 + N] = a[i][:K] @ W^T for W (N x K, row stride ldw), i < M; W is transposed one
// 64 x 128 block at a time into buf (kNtN * kNtK floats) right before the kernel uses it.
// stream: the finished rows are written with non-temporal stores (the caller fences).
inline void gemm_rows_nt(int64_t M, const float* const* a, const float* W, int64_t ldw, int64_t N, int64_t K,
                         float* const* c, int64_t n0, bool stream, float* buf, LinePrefetch* pf) {
  if (M == 0 || N == 0) return;
  for (int64_t j0 = 0; j0 < N; j0 += kNtN) {
    const int64_t nb = std::min(kNtN, N - j0);
    for (int64_t k0 = 0; k0 < K; k0 += kNtK) {
      const int64_t kb = std::min(kNtK, K - k0);
      transpose32(reinterpret_cast<const uint32_t*>(W + j0 * ldw + k0), ldw, nb, kb,
                  reinterpret_cast<uint32_t*>(buf), kNtN);
      const bool add = k0 > 0, stream_now = stream && k0 + kb >= K;
      if (add) {
        if (stream_now) rows_block_any<true, true>(M, a, k0, buf, kNtN, kb, c, n0 + j0, nb, pf);
        else rows_block_any<true, false>(M, a, k0, buf, kNtN, kb, c, n0 + j0, nb, pf);
      } else {
        if (stream_now) rows_block_any<false, true>(M, a, k0, buf, kNtN, kb, c, n0 + j0, nb, pf);
        else rows_block_any<false, false>(M, a, k0, buf, kNtN, kb, c, n0 + j0, nb, pf);
      }
    }
  }
}
#endif

// Whether the forward may use the rows kernel: an AVX-512 CPU, unless SMELT_CPU_GENERIC is
// set (which selects the portable path, e.g. to test it on such a CPU).
inline bool use_rows_kernel() {
#ifdef SMELT_HAVE_ROWS_KERNEL
  return cpu_has_avx512() && !smelt::env_flag("SMELT_CPU_GENERIC");
#else
  return false;
#endif
}

}  // namespace smelt_moe
