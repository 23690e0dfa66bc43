// The few-rows (decode) path of the CPU MoE forward: see cpu_decode.h.
//
// C[i][n] = sum_k W[n][k] * X[i][k] for weight rows n (row-major, as stored) and fp32 rows
// X[i]. On an AVX2 + FMA CPU a tile of 4 weight rows by 3 rows of X keeps 12 accumulators of
// 8 lanes over K (16-bit weights widened as they are loaded); lanes are summed in a fixed
// order, the K tail after them; the first tile of a block prefetches the weight rows two
// blocks on. Without AVX2 a plain loop does the same sums. One item runs
// on one thread and each output is summed in one fixed order, so results are bitwise
// reproducible and independent of the thread count.
#include "cpu_decode.h"
#include "../env.h"
#include "../settings.h"

namespace smelt_moe {

bool use_decode_path() {
  return smelt::env("SMELT_CPU_DECODE") != "0";
}

namespace {

template <typename ST>
inline float scalar_of(ST v) {
  return static_cast<float>(v);
}

// Portable: C[i][n] for n < N, i < m.
template <typename ST>
void dots_scalar(const ST* W, int64_t ldw, int64_t N, int64_t K, const float* X, int64_t ldx, int64_t m,
                 float* C, int64_t ldc) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < m; ++i) {
      float lane[8] = {0.0f};
      const ST* w = W + n * ldw;
      const float* xi = X + i * ldx;
      int64_t q = 0;
      for (; q + 8 <= K; q += 8)
        for (int l = 0; l < 8; ++l) lane[l] += scalar_of(w[q + l]) * xi[q + l];
      float s = ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
      for (; q < K; ++q) s += scalar_of(w[q]) * xi[q];
      C[i * ldc + n] = s;
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#define SMELT_DECODE_AVX2 __attribute__((target("avx2,fma,f16c")))

SMELT_DECODE_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
SMELT_DECODE_AVX2 inline __m256 load8(const c10::BFloat16* p) {
  const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}
SMELT_DECODE_AVX2 inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// the same lane order as dots_scalar's: (0+4, 2+6) + (1+5, 3+7)
SMELT_DECODE_AVX2 inline float hsum8(__m256 v) {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // l, l+4
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));                                   // (0+4)+(2+6), (1+5)+(3+7)
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_shuffle_ps(b, b, 1)));
}

// Weight rows ahead of the block in use that its first tile prefetches: the rows are short
// streams that the hardware prefetcher picks up late.
constexpr int kAheadRows = 8;

template <int NB, int MB, bool Ahead, typename ST>
SMELT_DECODE_AVX2 void dots_tile(const ST* W, int64_t ldw, int64_t K, const float* X, int64_t ldx, float* C,
                                 int64_t ldc) {
  __m256 acc[NB][MB];
  for (int a = 0; a < NB; ++a)
    for (int b = 0; b < MB; ++b) acc[a][b] = _mm256_setzero_ps();
  const int64_t K8 = K / 8 * 8;
  constexpr int64_t kLine = 64 / sizeof(ST);  // elements per cache line
  for (int64_t q = 0; q < K8; q += 8) {
    if constexpr (Ahead) {
      if (q % kLine == 0)
        for (int a = 0; a < NB; ++a)
          _mm_prefetch(reinterpret_cast<const char*>(W + (kAheadRows + a) * ldw + q), _MM_HINT_T0);
    }
    __m256 wv[NB], xv[MB];
#pragma GCC unroll 4
    for (int a = 0; a < NB; ++a) wv[a] = load8(W + a * ldw + q);
#pragma GCC unroll 3
    for (int b = 0; b < MB; ++b) xv[b] = _mm256_loadu_ps(X + b * ldx + q);
#pragma GCC unroll 4
    for (int a = 0; a < NB; ++a)
#pragma GCC unroll 3
      for (int b = 0; b < MB; ++b) acc[a][b] = _mm256_fmadd_ps(wv[a], xv[b], acc[a][b]);
  }
  for (int a = 0; a < NB; ++a)
    for (int b = 0; b < MB; ++b) {
      float s = hsum8(acc[a][b]);
      for (int64_t q = K8; q < K; ++q) s += scalar_of(W[a * ldw + q]) * X[b * ldx + q];
      C[b * ldc + a] = s;
    }
}

template <int NB, typename ST>
SMELT_DECODE_AVX2 void dots_rows(const ST* W, int64_t ldw, int64_t K, const float* X, int64_t ldx, int64_t m,
                                 float* C, int64_t ldc) {
  // the first tile prefetches the weight rows kAheadRows on (prefetches never fault, so
  // those past the matrix's end are harmless)
  int64_t i = 0;
  if (m >= 3) {
    dots_tile<NB, 3, true>(W, ldw, K, X, ldx, C, ldc);
    i = 3;
  } else if (m == 2) {
    dots_tile<NB, 2, true>(W, ldw, K, X, ldx, C, ldc);
    i = 2;
  } else if (m == 1) {
    dots_tile<NB, 1, true>(W, ldw, K, X, ldx, C, ldc);
    i = 1;
  }
  for (; i + 3 <= m; i += 3) dots_tile<NB, 3, false>(W, ldw, K, X + i * ldx, ldx, C + i * ldc, ldc);
  if (m - i == 2) dots_tile<NB, 2, false>(W, ldw, K, X + i * ldx, ldx, C + i * ldc, ldc);
  if (m - i == 1) dots_tile<NB, 1, false>(W, ldw, K, X + i * ldx, ldx, C + i * ldc, ldc);
}

template <typename ST>
void dots_avx2(const ST* W, int64_t ldw, int64_t N, int64_t K, const float* X, int64_t ldx, int64_t m, float* C,
               int64_t ldc, LinePrefetch* pf, int64_t pf_per_block) {
  int64_t n = 0;
  for (; n + 4 <= N; n += 4) {
    if (pf) pf->step(pf_per_block);
    dots_rows<4>(W + n * ldw, ldw, K, X, ldx, m, C + n, ldc);
  }
  switch (N - n) {
    case 3: dots_rows<3>(W + n * ldw, ldw, K, X, ldx, m, C + n, ldc); break;
    case 2: dots_rows<2>(W + n * ldw, ldw, K, X, ldx, m, C + n, ldc); break;
    case 1: dots_rows<1>(W + n * ldw, ldw, K, X, ldx, m, C + n, ldc); break;
    default: break;
  }
}

inline bool cpu_has_avx2_fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return has;
}
#endif

// C (m x N, stride ldc) = X (m x K) @ W^T, W (N x K, stride ldw).
template <typename ST>
void dots(const ST* W, int64_t ldw, int64_t N, int64_t K, const float* X, int64_t ldx, int64_t m, float* C,
          int64_t ldc, LinePrefetch* pf, int64_t pf_per_block) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (cpu_has_avx2_fma()) {
    dots_avx2(W, ldw, N, K, X, ldx, m, C, ldc, pf, pf_per_block);
    return;
  }
#endif
  dots_scalar(W, ldw, N, K, X, ldx, m, C, ldc);
}

}  // namespace

template <typename ST>
void decode_item(const ST* x, const ST* w1e, const ST* w2e, const int32_t* order, int64_t k, int64_t H,
                 int64_t de, int64_t r0, int64_t m, ST* prep, ST* out, LinePrefetch* pf) {
  thread_local Scratch<float> buf;
  float* X = buf.get(m * H + m * 2 * de + m * de + m * H);
  float* P = X + m * H;
  float* Hd = P + m * 2 * de;
  float* O = Hd + m * de;
  for (int64_t i = 0; i < m; ++i) widen(x + static_cast<int64_t>(order[r0 + i] / k) * H, X + i * H, H);
  // prefetched lines per block of four weight rows: the next item's weights spread over this one
  const int64_t blocks = cdiv(2 * de, 4) + cdiv(H, 4);
  const int64_t per_block = pf ? cdiv(pf->lines(), blocks) : 0;
  dots(w1e, H, 2 * de, H, X, H, m, P, 2 * de, pf, per_block);
  for (int64_t i = 0; i < m; ++i) {
    const float* p = P + i * 2 * de;
    if (prep) narrow(p, prep + (r0 + i) * 2 * de, 2 * de);
    swiglu_forward(p, p + de, Hd + i * de, de);
  }
  dots(w2e, de, H, de, Hd, de, m, O, H, pf, per_block);
  for (int64_t i = 0; i < m; ++i) narrow(O + i * H, out + (r0 + i) * H, H);
}

template void decode_item<float>(const float*, const float*, const float*, const int32_t*, int64_t, int64_t,
                                 int64_t, int64_t, int64_t, float*, float*, LinePrefetch*);
template void decode_item<c10::BFloat16>(const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*,
                                         const int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                         c10::BFloat16*, c10::BFloat16*, LinePrefetch*);
template void decode_item<c10::Half>(const c10::Half*, const c10::Half*, const c10::Half*, const int32_t*,
                                     int64_t, int64_t, int64_t, int64_t, int64_t, c10::Half*, c10::Half*,
                                     LinePrefetch*);

}  // namespace smelt_moe
