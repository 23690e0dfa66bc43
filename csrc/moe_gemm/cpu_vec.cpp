// Element-wise row kernels of the CPU MoE path: SwiGLU forward and backward, the weighted
// combine's axpy, and 16-bit <-> fp32 conversion. Each is compiled for AVX-512, AVX2 and the
// baseline ISA (SMELT_MULTIVERSION) and written as plain loops that the compiler vectorises.
#include "../cpu_blas.h"

namespace smelt_moe {

SMELT_MULTIVERSION
void swiglu_forward(const float* gate, const float* up, float* h, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float g = gate[i];
    h[i] = g * sigmoid(g) * up[i];
  }
}

SMELT_MULTIVERSION
float swiglu_backward(const float* __restrict gate, const float* __restrict up, const float* __restrict G,
                      float w, int64_t n, float* __restrict dgate, float* __restrict dup, float* __restrict hw) {
  for (int64_t i = 0; i < n; ++i) {
    float g = gate[i], u = up[i], d = G[i];
    float s = sigmoid(g);
    float silu = g * s;
    float dh = w * d;
    dgate[i] = dh * u * s * (1.0f + g * (1.0f - s));
    dup[i] = dh * silu;
    hw[i] = silu * u;  // h for now; scaled by w below
  }
  const float dot = lane_dot(G, hw, n);  // sum(G * h)
  for (int64_t c = 0; c < n; ++c) hw[c] *= w;
  return dot;
}

SMELT_MULTIVERSION
float lane_dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float lane[16] = {0.0f};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) lane[j] += a[i + j] * b[i + j];
  for (; i < n; ++i) lane[i % 16] += a[i] * b[i];
  float s = 0.0f;
  for (int j = 0; j < 16; ++j) s += lane[j];
  return s;
}

SMELT_MULTIVERSION
void axpy(float* acc, const float* x, float a, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += a * x[i];
}

SMELT_MULTIVERSION
void weighted_sum(const float* const* rows, const float* w, int64_t k, float* out, int64_t n) {
  constexpr int64_t B = 64;
  for (int64_t i0 = 0; i0 < n; i0 += B) {
    const int64_t len = std::min(B, n - i0);
    float acc[B] = {0.0f};
    for (int64_t j = 0; j < k; ++j) {
      const float* __restrict r = rows[j] + i0;
      const float a = w ? w[j] : 1.0f;
      for (int64_t i = 0; i < len; ++i) acc[i] += a * r[i];
    }
    for (int64_t i = 0; i < len; ++i) out[i0 + i] = acc[i];
  }
}

void stream_fence() {
#if defined(__x86_64__) && defined(__GNUC__)
  _mm_sfence();
#endif
}

SMELT_MULTIVERSION
void widen(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
}

SMELT_MULTIVERSION
void narrow(const float* src, c10::BFloat16* dst, int64_t n) {
  const uint32_t* s = reinterpret_cast<const uint32_t*>(src);
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t b = s[i];
    bool nan = (b & 0x7fffffffu) > 0x7f800000u;
    uint32_t rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;  // round to nearest even
    d[i] = static_cast<uint16_t>(nan ? ((b >> 16) | 0x40u) : rounded);
  }
}

void widen(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

void narrow(const float* src, c10::Half* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::Half(src[i]);
}

}  // namespace smelt_moe
