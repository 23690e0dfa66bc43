// The loops of the CPU segment attention (csrc/attention/cpu_attention.cpp), written once with
// GCC vector types and included once per instruction set: cpu_attention.cpp wraps each
// inclusion in `#pragma GCC target(...)` and a namespace, and picks one at load time (the
// extension is built without -march flags). Everything here works on fp32 buffers the
// caller prepared; see cpu_attention.cpp for the layouts and the scheme.
//
// Needs before inclusion, in the enclosing namespace: int constants kW (widest vector,
// floats), kRA (rows per score micro-tile), kRB (rows per accumulate micro-tile); <cstdint>, <cmath>,
// <algorithm>, and smelt_att::{kPanel, Problem, Buffers, buffers, grow, key_panel} (declared
// outside the target regions, so no library code is compiled for a wider instruction set
// than this).

template <int W>
struct Vec {
  typedef float f __attribute__((vector_size(W * 4)));
  typedef int32_t i __attribute__((vector_size(W * 4)));
};
template <int W>
using vf = typename Vec<W>::f;
template <int W>
using vi = typename Vec<W>::i;

template <int W>
inline vf<W> load(const float* p) {
  vf<W> v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
template <int W>
inline void store(float* p, vf<W> v) {
  __builtin_memcpy(p, &v, sizeof v);
}
template <int W>
inline vf<W> splat(float s) {
  // s - 0 is s for every s (also -0), so this compiles to one broadcast; `vf<W>{} + s`
  // keeps a scalar add (0 + -0 is +0) on the FMA loops' critical path, and an element-wise
  // fill becomes a chain of inserts
  return s - vf<W>{};
}

// 2^x for x <= 0 (every use: scores minus their row max or log-sum-exp), relative error
// about 2e-7: 2^x = 2^r * 2^f with r = round(x) and f in [-0.5, 0.5], 2^f from a degree-5
// polynomial fitted for relative error on that interval (1.9e-7 evaluated in fp32, below the
// 2.4e-7 of the degree-6 Taylor series). Below -127 the result is exactly 0 (so 2^-inf is 0):
// x is raised to -127, whose rounded exponent field is 0, so the scale factor is +0. NaN
// stays NaN (the max keeps it). 2^0 is exactly 1. No upper clamp: nothing calls it with
// x > 0 beyond rounding.
template <int W>
inline vf<W> exp2v(vf<W> x) {
  const vf<W> lo = splat<W>(-127.0f);
  const vf<W> xc = lo > x ? lo : x;                   // vmaxps(lo, x): NaN in x passes
  const vf<W> r = (xc + 12582912.0f) - 12582912.0f;  // round to nearest
  const vf<W> f = xc - r;                            // [-0.5, 0.5]
  vf<W> p = splat<W>(1.3264731969684362e-3f);
  p = p * f + 9.6715139225125313e-3f;
  p = p * f + 5.5507335811853409e-2f;
  p = p * f + 2.4022242426872253e-1f;
  p = p * f + 6.9314700365066528e-1f;
  p = p * f + 1.0f;
  const vi<W> e = (__builtin_convertvector(r, vi<W>) + 127) << 23;
  vf<W> s;
  __builtin_memcpy(&s, &e, sizeof s);
  return p * s;
}

// tanh(x), relative error about 5e-7 (NaN stays NaN, +-inf gives +-1): on |x| < 0.25 its
// odd Taylor series to x^9 (the omitted terms are below 1e-8 of it); above, (1 - t) / (1 + t)
// with t = e^(-2|x|) in (0, 1] from exp2v, which neither overflows nor loses the sign for
// large |x| (the 1 - 2 / (e^(2x) + 1) form cancels near 0, where the series takes over).
template <int W>
inline vf<W> tanhv(vf<W> x) {
  const vf<W> ax = x < 0.0f ? -x : x;
  const vf<W> t = exp2v<W>(ax * -2.8853900817779268f);  // e^(-2|x|) = 2^(-2 log2(e) |x|)
  const vf<W> big = (1.0f - t) / (1.0f + t);
  const vf<W> x2 = ax * ax;
  vf<W> p = splat<W>(2.1869488536155203e-2f);  // 62/2835
  p = p * x2 - 5.3968253968253971e-2f;         // 17/315
  p = p * x2 + 1.3333333333333333e-1f;         // 2/15
  p = p * x2 - 3.3333333333333333e-1f;
  const vf<W> small = ax + ax * x2 * p;
  const vf<W> r = ax < 0.25f ? small : big;
  return x < 0.0f ? -r : r;
}

// Horizontal max and sum by halving: two halves combined element-wise down to 4 lanes, then
// two in-register shuffles (a handful of instructions, not a chain over every lane).
template <int W>
inline vf<W / 2> half(vf<W> v, int which) {
  vf<W / 2> h;
  __builtin_memcpy(&h, reinterpret_cast<const char*>(&v) + which * sizeof h, sizeof h);
  return h;
}
template <int W>
inline float hmax(vf<W> v) {
  if constexpr (W > 4) {
    const vf<W / 2> a = half<W>(v, 0), b = half<W>(v, 1);
    return hmax<W / 2>(b > a ? b : a);
  } else {
    const vf<4> s = __builtin_shufflevector(v, v, 2, 3, 0, 1);
    const vf<4> m = s > v ? s : v;
    const vf<4> t = __builtin_shufflevector(m, m, 1, 0, 3, 2);
    const vf<4> r = t > m ? t : m;
    return r[0];
  }
}
template <int W>
inline float hsum(vf<W> v) {
  if constexpr (W > 4) {
    return hsum<W / 2>(half<W>(v, 0) + half<W>(v, 1));
  } else {
    const vf<4> m = v + __builtin_shufflevector(v, v, 2, 3, 0, 1);
    const vf<4> r = m + __builtin_shufflevector(m, m, 1, 0, 3, 2);
    return r[0];
  }
}

constexpr int W = kW;
constexpr int CB = kPanel;  // score columns per micro-tile (keys): one key panel
constexpr int CV = CB / W;

// ---------------------------------------------------------------------- micro-kernels
// S[r][c] = sum_d A[r][d] * BT[d][c] for R rows and CB columns; A row stride lda, BT row
// stride ldb, S row stride lds, K >= 1. With rmax, also the rows' maxima over these columns,
// one vector of W per row at rmax + r * W, combined with what is there unless `first`.
template <int R>
inline void scores_tile(const float* A, int64_t lda, const float* BT, int64_t ldb, int64_t K,
                        float* S, int64_t lds, float* rmax, bool first) {
  vf<W> acc[R][CV];
  {  // d = 0 sets the accumulators (so they start in registers, not in a zeroed array)
    vf<W> b[CV];
    for (int c = 0; c < CV; ++c) b[c] = load<W>(BT + c * W);
    for (int r = 0; r < R; ++r) {
      const vf<W> a = splat<W>(A[r * lda]);
      for (int c = 0; c < CV; ++c) acc[r][c] = a * b[c];
    }
  }
  for (int64_t d = 1; d < K; ++d) {
    vf<W> b[CV];
    for (int c = 0; c < CV; ++c) b[c] = load<W>(BT + d * ldb + c * W);
    for (int r = 0; r < R; ++r) {
      const vf<W> a = splat<W>(A[r * lda + d]);
      for (int c = 0; c < CV; ++c) acc[r][c] += a * b[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CV; ++c) store<W>(S + r * lds + c * W, acc[r][c]);
  if (rmax) {
    for (int r = 0; r < R; ++r) {
      vf<W> m = acc[r][0];
      for (int c = 1; c < CV; ++c) m = acc[r][c] > m ? acc[r][c] : m;
      if (!first) {
        const vf<W> o = load<W>(rmax + r * W);
        m = o > m ? o : m;
      }
      store<W>(rmax + r * W, m);
    }
  }
}

template <int R>
inline void scores_rows(const float* A, int64_t lda, const float* BT, int64_t ldb, int64_t K,
                        float* S, int64_t lds, int64_t ncb, float* rmax, int64_t cbs) {
  for (int64_t cb = 0; cb < ncb; ++cb)
    scores_tile<R>(A, lda, BT + cb * cbs, ldb, K, S + cb * CB, lds, rmax, cb == 0);
}

// S (M x ncb*CB) = A (M x K) @ BT (K x ncb*CB), column block cb of BT at BT + cb * cbs (CB
// for a plain row-major BT, K * CB for key panels); with rmax, each row's maximum as a
// vector of W at rmax + r * W (hmax of it is the row's max).
inline void scores(const float* A, int64_t lda, const float* BT, int64_t ldb, int64_t K,
                   float* S, int64_t lds, int64_t M, int64_t ncb, float* rmax = nullptr,
                   int64_t cbs = CB) {
  constexpr int R = kRA;
  int64_t r = 0;
  for (; r + R <= M; r += R)
    scores_rows<R>(A + r * lda, lda, BT, ldb, K, S + r * lds, lds, ncb, rmax ? rmax + r * W : nullptr, cbs);
  const int64_t left = M - r;
  A += r * lda;
  S += r * lds;
  if (rmax) rmax += r * W;
  switch (left) {
#define SMELT_ROWS_CASE(n) \
  case n:                  \
    if constexpr (n < R) { scores_rows<n>(A, lda, BT, ldb, K, S, lds, ncb, rmax, cbs); } \
    break;
    SMELT_ROWS_CASE(1) SMELT_ROWS_CASE(2) SMELT_ROWS_CASE(3) SMELT_ROWS_CASE(4)
    SMELT_ROWS_CASE(5) SMELT_ROWS_CASE(6) SMELT_ROWS_CASE(7)
#undef SMELT_ROWS_CASE
    default: break;
  }
}

// C[r][0:NV*V] += sum_k A[r*sar + k*sak] * B[k][0:NV*V] for R rows.
template <int V, int R, int NV>
inline void acc_tile(const float* A, int64_t sar, int64_t sak, const float* B, int64_t ldb,
                     int64_t K, float* C, int64_t ldc) {
  vf<V> acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = load<V>(C + r * ldc + c * V);
  for (int64_t k = 0; k < K; ++k) {
    vf<V> b[NV];
    for (int c = 0; c < NV; ++c) b[c] = load<V>(B + k * ldb + c * V);
    for (int r = 0; r < R; ++r) {
      const vf<V> a = splat<V>(A[r * sar + k * sak]);
      for (int c = 0; c < NV; ++c) acc[r][c] += a * b[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) store<V>(C + r * ldc + c * V, acc[r][c]);
}

template <int V, int R>
inline void acc_rows(const float* A, int64_t sar, int64_t sak, const float* B, int64_t ldb,
                     int64_t K, float* C, int64_t ldc, int64_t D) {
  constexpr int NV = 4;
  int64_t d = 0;
  for (; d + NV * V <= D; d += NV * V) acc_tile<V, R, NV>(A, sar, sak, B + d, ldb, K, C + d, ldc);
  switch ((D - d) / V) {
    case 3: acc_tile<V, R, 3>(A, sar, sak, B + d, ldb, K, C + d, ldc); break;
    case 2: acc_tile<V, R, 2>(A, sar, sak, B + d, ldb, K, C + d, ldc); break;
    case 1: acc_tile<V, R, 1>(A, sar, sak, B + d, ldb, K, C + d, ldc); break;
    default: break;
  }
}

template <int V>
inline void accumulate_v(const float* A, int64_t sar, int64_t sak, const float* B, int64_t ldb,
                         int64_t K, float* C, int64_t ldc, int64_t M, int64_t D) {
  constexpr int R = kRB;
  int64_t r = 0;
  for (; r + R <= M; r += R) acc_rows<V, R>(A + r * sar, sar, sak, B, ldb, K, C + r * ldc, ldc, D);
  A += r * sar;
  C += r * ldc;
  switch (M - r) {
#define SMELT_ROWS_CASE(n) \
  case n:                  \
    if constexpr (n < R) { acc_rows<V, n>(A, sar, sak, B, ldb, K, C, ldc, D); } \
    break;
    SMELT_ROWS_CASE(1) SMELT_ROWS_CASE(2) SMELT_ROWS_CASE(3) SMELT_ROWS_CASE(4)
    SMELT_ROWS_CASE(5) SMELT_ROWS_CASE(6) SMELT_ROWS_CASE(7)
#undef SMELT_ROWS_CASE
    default: break;
  }
}

// C (M x D) += A (M x K, element (r, k) at r*sar + k*sak) @ B (K x D, row stride ldb).
// D a multiple of 8; widest vectors that divide it.
inline void accumulate(const float* A, int64_t sar, int64_t sak, const float* B, int64_t ldb,
                       int64_t K, float* C, int64_t ldc, int64_t M, int64_t D) {
  if (M <= 0 || K <= 0) return;
  if constexpr (W > 8) {
    if (D % W == 0) return accumulate_v<W>(A, sar, sak, B, ldb, K, C, ldc, M, D);
  }
  accumulate_v<8>(A, sar, sak, B, ldb, K, C, ldc, M, D);
}

// ---------------------------------------------------------------------- row helpers
// Sets S[c] = -inf where key j0 + c is outside [s, p] or c >= n, for ncb*CB columns, and
// with `bad` (see key_holes) also where bad[c] < 0: a key that key_ok clears.
inline void mask_row(float* S, int64_t ncb, int64_t j0, int64_t s, int64_t p, int64_t n,
                     const float* bad = nullptr) {
  vf<W> iota;
  for (int i = 0; i < W; ++i) iota[i] = static_cast<float>(i);
  const float lo = static_cast<float>(s - j0), hi = static_cast<float>(std::min(p - j0, n - 1));
  const vf<W> ninf = splat<W>(-INFINITY);
  if (bad) {
    for (int64_t c = 0; c < ncb * CB; c += W) {
      const vf<W> col = iota + static_cast<float>(c);
      const vf<W> x = load<W>(S + c);
      store<W>(S + c, ((col < lo) | (col > hi) | (load<W>(bad + c) < 0.0f)) ? ninf : x);
    }
    return;
  }
  for (int64_t c = 0; c < ncb * CB; c += W) {
    const vf<W> col = iota + static_cast<float>(c);
    const vf<W> x = load<W>(S + c);
    store<W>(S + c, ((col < lo) | (col > hi)) ? ninf : x);
  }
}

// Sets S[c] = 0 where key j0 + c is outside [s, p] or c >= n (or bad[c] < 0, as mask_row):
// the probabilities and dS of masked pairs are exactly nothing, whatever the row's
// statistics (a NaN LSE, a NaN dP from a value the row does not see).
inline void zero_masked(float* S, int64_t ncb, int64_t j0, int64_t s, int64_t p, int64_t n,
                        const float* bad = nullptr) {
  vf<W> iota;
  for (int i = 0; i < W; ++i) iota[i] = static_cast<float>(i);
  const float lo = static_cast<float>(s - j0), hi = static_cast<float>(std::min(p - j0, n - 1));
  if (bad) {
    for (int64_t c = 0; c < ncb * CB; c += W) {
      const vf<W> col = iota + static_cast<float>(c);
      const vf<W> x = load<W>(S + c);
      store<W>(S + c, ((col < lo) | (col > hi) | (load<W>(bad + c) < 0.0f)) ? vf<W>{} : x);
    }
    return;
  }
  for (int64_t c = 0; c < ncb * CB; c += W) {
    const vf<W> col = iota + static_cast<float>(c);
    const vf<W> x = load<W>(S + c);
    store<W>(S + c, ((col < lo) | (col > hi)) ? vf<W>{} : x);
  }
}

// The first key query position p sees: its segment start, raised by the window (if any).
// Never decreases with p, so the queries that see a key are a run of positions.
inline int64_t first_key(const Problem& P, const int32_t* st, int64_t p) {
  return P.window > 0 ? std::max<int64_t>(st[p], p - P.window + 1) : st[p];
}

// How many of keys j0..j0+n-1 of batch row b key_ok keeps (n without key_ok).
inline int64_t keys_ok(const Problem& P, int64_t b, int64_t j0, int64_t n) {
  if (!P.key_ok) return n;
  const int32_t* c = P.ok_count + b * (P.Tk + 1);
  return c[j0 + n] - c[j0];
}

// bad[c] = -inf where key_ok clears key j0 + c, else 0, for c < n; 0 on to ncols.
inline void key_holes(const Problem& P, int64_t b, int64_t j0, int64_t n, int64_t ncols, float* bad) {
  const uint8_t* ok = P.key_ok + b * P.Tk + j0;
  for (int64_t c = 0; c < n; ++c) bad[c] = ok[c] ? 0.0f : -INFINITY;
  std::fill(bad + n, bad + ncols, 0.0f);
}

// f(j, len) for each run j..j+len-1 of keys in lo..hi that key_ok keeps (one run, lo..hi,
// without key_ok or without holes).
template <typename F>
inline void ok_runs(const Problem& P, int64_t b, bool holes, int64_t lo, int64_t hi, F&& f) {
  if (!holes) {
    if (lo <= hi) f(lo, hi - lo + 1);
    return;
  }
  const uint8_t* ok = P.key_ok + b * P.Tk;
  for (int64_t j = lo; j <= hi;) {
    if (!ok[j]) {
      ++j;
      continue;
    }
    int64_t e = j;
    while (e < hi && ok[e + 1]) ++e;
    f(j, e - j + 1);
    j = e + 1;
  }
}

// Soft-capping of a row of scores in log2 units: S[c] = cap * tanh(S[c] / cap) (cap the
// softcap times log2 e, icap its inverse: the same cap as in natural units); with dt, also
// dt[c] = 1 - tanh^2, the derivative the backward multiplies dS by.
inline void cap_row(float* S, int64_t ncb, float cap, float icap, float* dt = nullptr) {
  for (int64_t c = 0; c < ncb * CB; c += W) {
    const vf<W> t = tanhv<W>(load<W>(S + c) * icap);
    store<W>(S + c, t * cap);
    if (dt) store<W>(dt + c, 1.0f - t * t);
  }
}

// Whether rows x[0..n) (row stride ld, D a multiple of 8 columns) hold only finite values.
// A masked pair must add nothing, but in the tiled products it is a zero weight times the
// other operand, and 0 * inf or 0 * NaN is NaN: tiles whose operands are not all finite
// take exact per-row sums over the visible pairs instead.
inline bool rows_finite(const float* x, int64_t ld, int64_t n, int64_t D) {
  vf<8> acc = vf<8>{};
  for (int64_t i = 0; i < n; ++i)
    for (int64_t d = 0; d < D; d += 8) acc += load<8>(x + i * ld + d) * 0.0f;  // NaN unless finite
  for (int i = 0; i < 8; ++i)
    if (!(acc[i] == 0.0f)) return false;
  return true;
}

// Whether keys j0..j0+n-1 of V (that KV head's (Tk, D) rows) hold only finite values, from
// the per-panel flags of P.v_ok (index base + panel), each computed by the first tile that
// asks (a race between threads computes the same value twice).
inline bool v_tile_finite(const Problem& P, const float* V, int64_t base, int64_t j0, int64_t n) {
  for (int64_t pnl = j0 / CB; pnl * CB < j0 + n; ++pnl) {
    std::atomic<int8_t>& flag = P.v_ok[base + pnl];
    int8_t ok = flag.load(std::memory_order_relaxed);
    if (ok < 0) {
      ok = rows_finite(V + pnl * CB * P.D, P.D, std::min<int64_t>(CB, P.Tk - pnl * CB), P.D) ? 1 : 0;
      flag.store(ok, std::memory_order_relaxed);
    }
    if (ok == 0) return false;
  }
  return true;
}

inline bool needs_mask(int64_t ncb, int64_t j0, int64_t s, int64_t p, int64_t n) {
  return s > j0 || p < j0 + ncb * CB - 1 || n < ncb * CB;
}

inline float row_max(const float* S, int64_t ncb) {
  vf<W> m = load<W>(S);
  for (int64_t c = W; c < ncb * CB; c += W) {
    const vf<W> x = load<W>(S + c);
    m = x > m ? x : m;
  }
  return hmax<W>(m);
}

// S[c] = 2^(S[c] - m); returns the sum.
inline float exp_row(float* S, int64_t ncb, float m) {
  vf<W> sum = vf<W>{};
  for (int64_t c = 0; c < ncb * CB; c += W) {
    const vf<W> e = exp2v<W>(load<W>(S + c) - m);
    store<W>(S + c, e);
    sum += e;
  }
  return hsum<W>(sum);
}

// dS[c] = P[c] * (dP[c] - delta), in place in dP.
inline void ds_row(const float* P, float* dP, int64_t ncb, float delta) {
  for (int64_t c = 0; c < ncb * CB; c += W)
    store<W>(dP + c, load<W>(P + c) * (load<W>(dP + c) - delta));
}

inline void scale_row(float* x, int64_t n, float a) {
  for (int64_t i = 0; i < n; i += 8) {
    vf<8> v = load<8>(x + i);
    store<8>(x + i, v * a);
  }
}

// Rows r = (t - t0) * G + g of query positions t0..t1-1 of (b, h), as fp32 times mul.
inline void gather_rows(const Problem& P, const float* src, int64_t b, int64_t h, int64_t t0,
                        int64_t t1, float mul, float* dst) {
  const int64_t G = P.G, D = P.D;
  for (int64_t t = t0; t < t1; ++t) {
    const float* row = src + ((b * P.Tq + t) * P.Hq + h * G) * D;
    float* out = dst + (t - t0) * G * D;
    for (int64_t i = 0; i < G * D; ++i) out[i] = row[i] * mul;
  }
}

// Key tiles of the queries t0..t1-1, from the last position down to the first query's
// first key (its segment start, or the window's start): tiles of at most BK keys that start
// on a key panel (so the top one and the lowest one are partial; keys below that first key
// are masked by every query). Calls f(j0, n, ta, tb) with the tile's keys j0..j0+n-1 and
// the queries ta..tb-1 whose interval [first_key(p), p] meets it.
template <typename F>
inline void for_key_tiles(const Problem& P, const int32_t* st, int64_t t0, int64_t t1, F&& f) {
  const int64_t off = P.Tk - P.Tq, BK = P.BK;
  const int64_t kbeg = first_key(P, st, off + t0), kend = off + t1, lowest = kbeg / CB * CB;
  for (int64_t j1 = kend, j0; j1 > kbeg; j1 = j0) {
    j0 = std::max(lowest, (j1 + CB - 1) / CB * CB - BK);
    int64_t ta = t0, tb = t1;
    while (ta < t1 && off + ta < j0) ++ta;
    while (tb > ta && first_key(P, st, off + tb - 1) > j1 - 1) --tb;
    if (ta < tb) f(j0, j1 - j0, ta, tb);
  }
}

// ---------------------------------------------------------------------- the passes
// The forward and backward work of one (batch row, KV head), on the helpers above.
#include "cpu_attention_passes.h"
