// Transposes of 32-bit elements for the native CPU kernels (the MoE panels, attention's K^T):
// 8 x 8 (AVX2) and 16 x 16 (AVX-512) blocks in registers, picked at run time, scalar edges.
#pragma once

#include <algorithm>
#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace smelt {

// dst[c * ldd + r] = src[r * lds + c] for 32-bit elements (fp32 values, or bf16/fp16 pairs).
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2"))) static inline void transpose8x8_avx2(const uint32_t* src, int64_t lds,
                                                                      uint32_t* dst, int64_t ldd) {
  __m256 r0 = _mm256_loadu_ps(reinterpret_cast<const float*>(src + 0 * lds));
  __m256 r1 = _mm256_loadu_ps(reinterpret_cast<const float*>(src + 1 * lds));
  __m256 r2 = _mm256_loadu_ps(reinterpret_cast<const float*>(src + 2 * lds));
  __m256 r3 = _mm256_loadu_ps(reinterpret_cast<const float*>(src + 3 * lds));
  __m256 r4 = _mm256_loadu_ps(reinterpret_cast<const float*>(src + 4 * lds));
  __m256 r5 = _mm256_loadu_ps(reinterpret_cast<const float*>(src + 5 * lds));
  __m256 r6 = _mm256_loadu_ps(reinterpret_cast<const float*>(src + 6 * lds));
  __m256 r7 = _mm256_loadu_ps(reinterpret_cast<const float*>(src + 7 * lds));
  __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
  __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
  __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
  __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  float* d = reinterpret_cast<float*>(dst);
  _mm256_storeu_ps(d + 0 * ldd, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_storeu_ps(d + 1 * ldd, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_storeu_ps(d + 2 * ldd, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_storeu_ps(d + 3 * ldd, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_storeu_ps(d + 4 * ldd, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_storeu_ps(d + 5 * ldd, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_storeu_ps(d + 6 * ldd, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_storeu_ps(d + 7 * ldd, _mm256_permute2f128_ps(u3, u7, 0x31));
}
// (GCC 12 warns inside its own AVX-512 intrinsics headers about their undefined-vector idiom)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
__attribute__((target("avx512f"))) static inline void transpose16x16_avx512(const uint32_t* src, int64_t lds,
                                                                            uint32_t* dst, int64_t ldd) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(reinterpret_cast<const float*>(src + i * lds));
  for (int i = 0; i < 16; i += 2) {  // 32-bit interleave inside 128-bit lanes
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // 64-bit interleave: r[4g+j] lane L = column 4L+j of rows 4g..4g+3
    const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
    const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  float* o = reinterpret_cast<float*>(dst);
  for (int j = 0; j < 4; ++j) {  // gather lane L of the four row groups into output row 4L+j
    const __m512 s0 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88), s1 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);
    const __m512 q0 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88), q1 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
    _mm512_storeu_ps(o + (0 + j) * ldd, _mm512_shuffle_f32x4(s0, q0, 0x88));
    _mm512_storeu_ps(o + (4 + j) * ldd, _mm512_shuffle_f32x4(s1, q1, 0x88));
    _mm512_storeu_ps(o + (8 + j) * ldd, _mm512_shuffle_f32x4(s0, q0, 0xdd));
    _mm512_storeu_ps(o + (12 + j) * ldd, _mm512_shuffle_f32x4(s1, q1, 0xdd));
  }
}
#pragma GCC diagnostic pop
inline bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}
inline bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}
#else
inline bool cpu_has_avx2() { return false; }
inline bool cpu_has_avx512() { return false; }
#endif

inline void transpose32(const uint32_t* src, int64_t lds, int64_t rows, int64_t cols, uint32_t* dst,
                        int64_t ldd) {
  int64_t r8 = 0, c8 = 0;
#if defined(__x86_64__) && defined(__GNUC__)
  if (cpu_has_avx512() && rows >= 16 && cols >= 16) {
    const int64_t r16 = rows / 16 * 16, c16 = cols / 16 * 16;
    for (int64_t r = 0; r < r16; r += 16)
      for (int64_t c = 0; c < c16; c += 16)
        transpose16x16_avx512(src + r * lds + c, lds, dst + c * ldd + r, ldd);
    // the 8-wide strips left of the 16x16 blocks go to the AVX2 kernel below
    if (r16 == rows && c16 == cols) return;
    for (int64_t r = 0; r < r16; r += 8)
      for (int64_t c = c16; c + 8 <= cols; c += 8) transpose8x8_avx2(src + r * lds + c, lds, dst + c * ldd + r, ldd);
    for (int64_t r = r16; r + 8 <= rows; r += 8)
      for (int64_t c = 0; c + 8 <= cols; c += 8) transpose8x8_avx2(src + r * lds + c, lds, dst + c * ldd + r, ldd);
    r8 = rows / 8 * 8;
    c8 = cols / 8 * 8;
  } else if (cpu_has_avx2()) {
    r8 = rows / 8 * 8;
    c8 = cols / 8 * 8;
    for (int64_t r = 0; r < r8; r += 8)
      for (int64_t c = 0; c < c8; c += 8) transpose8x8_avx2(src + r * lds + c, lds, dst + c * ldd + r, ldd);
  }
#endif
  // the edges (everything, without AVX2): the rows below r8, then the columns right of c8
  auto scalar = [&](int64_t ra, int64_t rb, int64_t ca, int64_t cb) {
    constexpr int64_t b = 16;
    for (int64_t r0 = ra; r0 < rb; r0 += b)
      for (int64_t c0 = ca; c0 < cb; c0 += b)
        for (int64_t r = r0; r < std::min(rb, r0 + b); ++r)
          for (int64_t c = c0; c < std::min(cb, c0 + b); ++c) dst[c * ldd + r] = src[r * lds + c];
  };
  scalar(r8, rows, 0, cols);
  scalar(0, r8, c8, cols);
}

}  // namespace smelt
