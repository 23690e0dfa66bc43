// Small-GEMM building blocks and the vector conversions the CPU kernels share (the MoE GEMMs
// in csrc/moe_gemm/, RMSNorm and rotary).
//
// Every GEMM here is C (M x N, fp32) (+)= A (M x K, row-major) @ B (K x N), run on one
// thread through ATen's batch-reduce GEMM micro-kernel (at::native::cpublas::brgemm: a
// oneDNN JIT ukernel on AVX-512 / AMX machines, ATen's BLAS gemm elsewhere). The B operand
// is first laid out in a Panel, the form that micro-kernel wants:
//
// * fp32 compute: B is a plain K x N row-major matrix.
// * bf16 / fp16 compute (only where the CPU has AMX for that type, cpublas::could_pack):
//   B is "pair-interleaved" (VNNI): column blocks of at most 64 (padded to a multiple of
//   16), each stored as (K/2) x width x 2, so B[k][n] sits at
//   block(n) + (k/2)*width*2 + (n%64)*2 + k%2. K is padded to even with zeros.
//
// Without AMX for a 16-bit type, the kernels compute in fp32 (operands converted while they
// are gathered or packed), so the compute type CT is float or the input type itself.
#pragma once

#include <ATen/ATen.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <unordered_set>
#include <vector>

#include <sys/mman.h>

#include "cpu_alloc.h"
#include "cpu_transpose.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace smelt_moe {

template <typename CT>
inline constexpr bool kVnni = !std::is_same_v<CT, float>;

inline int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }
inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

constexpr int64_t kPanelBlock = 64;  // widest column block of a pair-interleaved panel

template <typename D, typename S>
inline D cvt(S v) {
  if constexpr (std::is_same_v<D, S>) {
    return v;
  } else {
    return static_cast<D>(static_cast<float>(v));
  }
}

// Element-wise row kernels (csrc/moe_gemm/cpu_vec.cpp), fp32 in registers.
// h = silu(gate) * up
void swiglu_forward(const float* gate, const float* up, float* h, int64_t n);
// From G = dL/dh_unweighted (the down-projection's input gradient before the routing weight
// w): dgate, dup (with w applied) and hw = w * h; returns sum(G * h), dL/dw.
float swiglu_backward(const float* gate, const float* up, const float* G, float w, int64_t n,
                      float* dgate, float* dup, float* hw);
// sum of a[i] * b[i] in 16 fixed lanes (vectorised, the same order on every CPU)
float lane_dot(const float* a, const float* b, int64_t n);
// acc += a * x
void axpy(float* acc, const float* x, float a, int64_t n);
// out = sum_j w[j] * rows[j] (w == nullptr: weights 1), summed in j order
void weighted_sum(const float* const* rows, const float* w, int64_t k, float* out, int64_t n);
// Orders this thread's non-temporal stores before what follows (a thread calls it before
// other threads may read what it streamed).
void stream_fence();
void widen(const c10::BFloat16* src, float* dst, int64_t n);
void widen(const c10::Half* src, float* dst, int64_t n);
void narrow(const float* src, c10::BFloat16* dst, int64_t n);
void narrow(const float* src, c10::Half* dst, int64_t n);
inline void widen(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void narrow(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

// 64-byte aligned scratch that only grows; one per thread and purpose.
template <typename T>
class Scratch {
 public:
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() { std::free(ptr_); }
  T* get(int64_t n) {
    if (n > cap_) {
      std::free(ptr_);
      size_t bytes = static_cast<size_t>(round_up(std::max<int64_t>(n, 1) * sizeof(T), 64));
      ptr_ = static_cast<T*>(std::aligned_alloc(64, bytes));
      if (ptr_ == nullptr) {
        cap_ = 0;
        smelt::out_of_memory("a scratch buffer", static_cast<int64_t>(bytes));
      }
      cap_ = n;
    }
    return ptr_;
  }

 private:
  T* ptr_ = nullptr;
  int64_t cap_ = 0;
};

// K rounded up to what the compute type needs (pairs for the 16-bit types).
template <typename CT>
inline int64_t k_pad(int64_t K) {
  return kVnni<CT> ? round_up(K, 2) : K;
}

// The B operand (K x N) in the micro-kernel's layout.
template <typename CT>
struct Panel {
  int64_t K = 0, N = 0;    // logical size
  int64_t Kp = 0, Np = 0;  // padded size (Kp even and Np a multiple of 16 for VNNI)
  int64_t ld = 0;          // fp32: row stride of data
  const CT* data = nullptr;
  Scratch<CT> store;

  CT* reset(int64_t k, int64_t n) {
    K = k;
    N = n;
    Kp = k_pad<CT>(k);
    Np = kVnni<CT> ? round_up(n, 16) : n;
    ld = Np;
    CT* p = store.get(Kp * Np);
    data = p;
    return p;
  }
  // Offset of B[k][n] in a pair-interleaved panel.
  int64_t vnni_at(int64_t k, int64_t n) const {
    int64_t n0 = n / kPanelBlock * kPanelBlock;
    int64_t width = std::min(kPanelBlock, Np - n0);
    return Kp * n0 + (k / 2) * width * 2 + (n - n0) * 2 + (k & 1);
  }
};

// ---------------------------------------------------------------------------- transpose
// (csrc/cpu_transpose.h, shared with the attention kernels)
using smelt::cpu_has_avx2;
using smelt::cpu_has_avx512;
using smelt::transpose32;

// ---------------------------------------------------------------------------- packing
// Columns [col0, col0 + n) of panel P (already reset) = W^T, W: n x K rows with stride ldw.
template <typename CT, typename ST>
void transpose_into(const ST* W, int64_t ldw, int64_t n, int64_t K, Panel<CT>& P, CT* out, int64_t col0) {
  if (n <= 0) return;
  if constexpr (!kVnni<CT>) {
    if constexpr (std::is_same_v<ST, float>) {
      transpose32(reinterpret_cast<const uint32_t*>(W), ldw, n, K, reinterpret_cast<uint32_t*>(out + col0), P.ld);
    } else {
      // fp32 compute of 16-bit weights: convert row by row, then transpose
      thread_local Scratch<float> wide;
      float* w = wide.get(n * K);
      for (int64_t r = 0; r < n; ++r) widen(W + r * ldw, w + r * K, K);
      transpose32(reinterpret_cast<const uint32_t*>(w), K, n, K, reinterpret_cast<uint32_t*>(out + col0), P.ld);
    }
  } else {
    static_assert(std::is_same_v<CT, ST>, "pair-interleaved panels are built from their own type");
    // Within a column block, the pair (W[c][2q], W[c][2q+1]) becomes the 32-bit word at
    // row q, column c of that block: a 32-bit transpose (rows of W are 4-byte aligned
    // when K and ldw are even; otherwise the slow path below).
    const int64_t Kh = P.Kp / 2;
    const bool aligned = K % 2 == 0 && ldw % 2 == 0 && reinterpret_cast<uintptr_t>(W) % 4 == 0;
    for (int64_t c = col0; c < col0 + n;) {
      const int64_t b0 = c / kPanelBlock * kPanelBlock, width = std::min(kPanelBlock, P.Np - b0);
      const int64_t cnt = std::min(col0 + n, b0 + width) - c;
      uint32_t* blk = reinterpret_cast<uint32_t*>(out + P.Kp * b0) + (c - b0);
      const ST* rows = W + (c - col0) * ldw;
      if (aligned) {
        transpose32(reinterpret_cast<const uint32_t*>(rows), ldw / 2, cnt, Kh, blk, width);
      } else {
        for (int64_t r = 0; r < cnt; ++r) {
          const ST* w = rows + r * ldw;
          for (int64_t q = 0; q < Kh; ++q) {
            uint16_t lo, hi = 0;
            std::memcpy(&lo, w + 2 * q, 2);
            if (2 * q + 1 < K) std::memcpy(&hi, w + 2 * q + 1, 2);
            blk[q * width + r] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
          }
        }
      }
      c += cnt;
    }
  }
}

// B = [Wa^T | Wb^T] for Wa (na x K) and Wb (nb x K), row stride ldw: the "x @ W^T" operand
// of Linear-layout weights (Wb may be null with nb = 0).
template <typename CT, typename ST>
void pack_transposed(const ST* Wa, int64_t na, const ST* Wb, int64_t nb, int64_t ldw, int64_t K, Panel<CT>& P) {
  CT* out = P.reset(K, na + nb);
  if constexpr (kVnni<CT>) {
    // padding columns of the last block are zero
    const int64_t b0 = (na + nb) / kPanelBlock * kPanelBlock, width = P.Np - b0;
    uint32_t* blk = reinterpret_cast<uint32_t*>(out + P.Kp * b0);
    if (na + nb < P.Np)
      for (int64_t q = 0; q < P.Kp / 2; ++q)
        for (int64_t c = na + nb - b0; c < width; ++c) blk[q * width + c] = 0;
  }
  transpose_into<CT>(Wa, ldw, na, K, P, out, 0);
  transpose_into<CT>(Wb, ldw, nb, K, P, out, na);
}

template <typename CT, typename ST>
void pack_transposed(const ST* W, int64_t ldw, int64_t N, int64_t K, Panel<CT>& P) {
  pack_transposed<CT, ST>(W, N, static_cast<const ST*>(nullptr), 0, ldw, K, P);
}

// B = W for W (K x N, row stride ldw). An fp32 W is used in place, without a copy.
template <typename CT, typename ST>
void pack_plain(const ST* W, int64_t ldw, int64_t K, int64_t N, Panel<CT>& P) {
  if constexpr (std::is_same_v<CT, float> && std::is_same_v<ST, float>) {
    P.K = P.Kp = K;
    P.N = P.Np = N;
    P.ld = ldw;
    P.data = W;
  } else if constexpr (!kVnni<CT>) {
    CT* out = P.reset(K, N);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t n = 0; n < N; ++n) out[k * P.ld + n] = cvt<CT>(W[k * ldw + n]);
  } else {
    CT* out = P.reset(K, N);
    const CT zero = CT(0.0f);
    for (int64_t k = 0; k < P.Kp; k += 2) {
      const ST* r0 = W + k * ldw;
      const ST* r1 = k + 1 < K ? W + (k + 1) * ldw : nullptr;
      for (int64_t n0 = 0; n0 < P.Np; n0 += kPanelBlock) {
        int64_t width = std::min(kPanelBlock, P.Np - n0);
        CT* dst = out + P.vnni_at(k, n0);
        for (int64_t nl = 0; nl < width; ++nl) {
          int64_t n = n0 + nl;
          dst[2 * nl] = n < N ? r0[n] : zero;
          dst[2 * nl + 1] = (n < N && r1) ? r1[n] : zero;
        }
      }
    }
  }
}

// B[i][:] = src[rows[i]][col0 : col0 + ncols] for i < K, zero rows up to Kp.
template <typename CT, typename ST>
void pack_gathered(const ST* src, int64_t lds, const int64_t* rows, int64_t K, int64_t Kp,
                   int64_t col0, int64_t ncols, Panel<CT>& P) {
  CT* out = P.reset(Kp, ncols);
  const CT zero = CT(0.0f);
  if constexpr (!kVnni<CT>) {
    for (int64_t i = 0; i < Kp; ++i) {
      CT* dst = out + i * P.ld;
      if (i < K) {
        const ST* s = src + rows[i] * lds + col0;
        for (int64_t n = 0; n < ncols; ++n) dst[n] = cvt<CT>(s[n]);
      } else {
        for (int64_t n = 0; n < ncols; ++n) dst[n] = zero;
      }
    }
  } else {
    for (int64_t k = 0; k < P.Kp; k += 2) {
      const ST* r0 = k < K ? src + rows[k] * lds + col0 : nullptr;
      const ST* r1 = k + 1 < K ? src + rows[k + 1] * lds + col0 : nullptr;
      for (int64_t n0 = 0; n0 < P.Np; n0 += kPanelBlock) {
        int64_t width = std::min(kPanelBlock, P.Np - n0);
        CT* dst = out + P.vnni_at(k, n0);
        for (int64_t nl = 0; nl < width; ++nl) {
          int64_t n = n0 + nl;
          dst[2 * nl] = (r0 && n < ncols) ? r0[n] : zero;
          dst[2 * nl + 1] = (r1 && n < ncols) ? r1[n] : zero;
        }
      }
    }
  }
}

// A[i][:] = src[rows[i]][:K] converted to CT, zero columns up to lda.
template <typename CT, typename ST>
void gather_rows(const ST* src, int64_t lds, const int64_t* rows, int64_t M, int64_t K, CT* A,
                 int64_t lda) {
  for (int64_t i = 0; i < M; ++i) {
    const ST* s = src + rows[i] * lds;
    CT* d = A + i * lda;
    if constexpr (std::is_same_v<CT, ST>) {
      std::memcpy(d, s, K * sizeof(CT));
    } else {
      for (int64_t c = 0; c < K; ++c) d[c] = cvt<CT>(s[c]);
    }
    for (int64_t c = K; c < lda; ++c) d[c] = CT(0.0f);
  }
}

// ---------------------------------------------------------------------------- GEMM
// Room for one more micro-kernel. ATen's brgemm compiles a kernel for every new shape (256
// KiB of code each, and its descriptors) the first time a thread asks for it, and a failed
// allocation there ends in a crash inside oneDNN rather than an error. So before a shape
// this thread has not run yet, kKernelRoom bytes of address space must be mappable (checked
// with a mapping that is released at once), else torch.OutOfMemoryError. Costs two system
// calls per new shape and thread, next to a compile that takes far longer.
constexpr size_t kKernelRoom = size_t(4) << 20;

struct KernelKey {
  int64_t M, N, K, lda, ldb, ldc;
  bool add, vnni;
  bool operator==(const KernelKey& o) const {
    return std::tie(M, N, K, lda, ldb, ldc, add, vnni) == std::tie(o.M, o.N, o.K, o.lda, o.ldb, o.ldc, o.add, o.vnni);
  }
};
struct KernelKeyHash {
  size_t operator()(const KernelKey& k) const {
    size_t h = 0;
    for (int64_t v : {k.M, k.N, k.K, k.lda, k.ldb, k.ldc, int64_t(k.add), int64_t(k.vnni)})
      h = h * 1000003u ^ std::hash<int64_t>()(v);
    return h;
  }
};

inline void kernel_room(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add,
                        bool vnni) {
  thread_local std::unordered_set<KernelKey, KernelKeyHash> seen;
  thread_local KernelKey last{-1, -1, -1, -1, -1, -1, false, false};  // consecutive calls repeat
  const KernelKey key{M, N, K, lda, ldb, ldc, add, vnni};
  if (key == last) return;
  if (seen.find(key) == seen.end()) {
    void* room = mmap(nullptr, kKernelRoom, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (room == MAP_FAILED) smelt::out_of_memory("a GEMM micro-kernel", static_cast<int64_t>(kKernelRoom));
    munmap(room, kKernelRoom);
    seen.insert(key);
  }
  last = key;
}

// at::native::cpublas::brgemm after kernel_room.
template <typename CT>
inline void brgemm(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add, const CT* A,
                   const CT* B, float* C, bool vnni) {
  kernel_room(M, N, K, lda, ldb, ldc, add, vnni);
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add, A, B, C, vnni);
}

// C (M x P.Np, row stride ldc, fp32) = A (M x P.Kp, row stride lda) @ B, or += when add.
// For VNNI panels C must have room for the padded width P.Np. K = 0 gives C = 0 (or leaves
// it, with add).
template <typename CT>
void gemm(int64_t M, const CT* A, int64_t lda, const Panel<CT>& P, float* C, int64_t ldc, bool add) {
  if (M == 0) return;
  if (P.Kp == 0) {
    if (!add)
      for (int64_t i = 0; i < M; ++i) std::fill(C + i * ldc, C + i * ldc + P.Np, 0.0f);
    return;
  }
  // Blocked so that the B block in use (about 32 KB) stays in L1 while the M rows of A
  // stream past it; C accumulates over the K blocks.
  if constexpr (!kVnni<CT>) {
    const int64_t nb = std::min<int64_t>(P.N, 64), kb = std::min<int64_t>(P.Kp, 128);
    for (int64_t n0 = 0; n0 < P.N; n0 += nb)
      for (int64_t k0 = 0; k0 < P.Kp; k0 += kb)
        brgemm<CT>(M, std::min(nb, P.N - n0), std::min(kb, P.Kp - k0), lda, P.ld, ldc, add || k0 > 0, A + k0,
                   P.data + k0 * P.ld + n0, C + n0, false);
  } else {
    const int64_t kb = std::min<int64_t>(P.Kp, 256);  // even, so K blocks start on a pair
    for (int64_t n0 = 0; n0 < P.Np; n0 += kPanelBlock) {
      const int64_t width = std::min(kPanelBlock, P.Np - n0);
      const CT* blk = P.data + P.Kp * n0;
      for (int64_t k0 = 0; k0 < P.Kp; k0 += kb)
        brgemm<CT>(M, width, std::min(kb, P.Kp - k0), lda, width, ldc, add || k0 > 0, A + k0, blk + k0 * width,
                   C + n0, true);
    }
  }
}

// Give back the matrix unit's tile state at the end of a thread's work (AMX).
template <typename CT>
void gemm_done() {
  if constexpr (kVnni<CT>) at::native::cpublas::brgemm_release(true);
}

// Whether 16-bit inputs of this type run on the matrix unit here (else fp32 compute).
inline bool native_16bit(at::ScalarType t) {
  return (t == at::kBFloat16 || t == at::kHalf) && at::native::cpublas::could_pack(t);
}

// ---------------------------------------------------------------------------- math
// exp for the SwiGLU epilogues: written as straight-line float arithmetic so that loops over
// it vectorise; relative error ~2 ulp on [-87, 88], saturating outside.
inline float fast_exp(float x) {
  x = std::min(88.0f, std::max(-87.0f, x));
  const float log2e = 1.44269504088896341f;
  // round to nearest by the 1.5 * 2^23 trick (vectorises where nearbyint may not)
  float n = (x * log2e + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693145751953125f;  // ln2, high part
  r = r - n * 1.428606765330187e-06f;     // ln2, low part
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

inline float sigmoid(float g) { return 1.0f / (1.0f + fast_exp(-g)); }

// The element-wise loops (SwiGLU epilogues, combines) are compiled for AVX-512, AVX2 and the
// baseline, picked at load time, since the extension is built without -march flags.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SMELT_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define SMELT_MULTIVERSION
#endif

// Splits items with the given costs into at most nparts contiguous ranges of similar cost;
// returns nparts + 1 boundaries.
inline std::vector<int64_t> balance(const std::vector<int64_t>& cost, int64_t nparts) {
  const int64_t n = static_cast<int64_t>(cost.size());
  std::vector<int64_t> cum(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) cum[i + 1] = cum[i] + cost[i];
  std::vector<int64_t> bounds(nparts + 1, n);
  bounds[0] = 0;
  int64_t i = 0;
  for (int64_t p = 1; p < nparts; ++p) {
    const double target = static_cast<double>(cum[n]) * p / nparts;
    while (i < n && static_cast<double>(cum[i]) < target) ++i;
    bounds[p] = std::max(bounds[p - 1], i);
  }
  return bounds;
}

}  // namespace smelt_moe
