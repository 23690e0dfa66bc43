// The forward and backward passes of the CPU segment attention, on the micro-kernels and row
// helpers of cpu_attention_body.h, which includes this file once per instruction set (inside
// its namespace and target region: nothing here is included on its own).

// ---------------------------------------------------------------------- forward
// Queries t0..t1-1 of (b, h): o (fp32, (B, Tq, Hq, D)), lse (natural log) and psink.
inline void forward_block(const Problem& P, int64_t b, int64_t h, int64_t t0, int64_t t1,
                          float* o, float* lse, float* psink) {
  const int64_t G = P.G, D = P.D, BK = P.BK, off = P.Tk - P.Tq;
  const int64_t M = (t1 - t0) * G;
  Buffers& buf = buffers();
  float* Q = grow(buf.q, M * D);
  float* O = grow(buf.o, M * D);
  float* S = grow(buf.s, M * BK);
  float* mx = grow(buf.stat1, M + W);  // + W: the rescale factors are computed W rows at a time
  float* l = grow(buf.stat2, M);
  float* mnew = grow(buf.acc1, M + W);
  float* alpha = grow(buf.acc2, M + W);
  float* rmax = grow(buf.dp, M * W);
  float* first = grow(buf.sink, M);  // each row's score on its segment's first key
  float* bad = grow(buf.ok, BK);      // key_ok's holes in a tile (see key_holes)
  gather_rows(P, P.q, b, h, t0, t1, P.qscale, Q);
  std::fill(first, first + M, -INFINITY);  // a first key outside the window: never visited
  std::fill(O, O + M * D, 0.0f);
  std::fill(mx, mx + M, -INFINITY);
  std::fill(l, l + M, 0.0f);
  const int32_t* st = P.start + b * P.Tk;
  const float* KP = P.kp + (b * P.Hkv + h) * P.NP * D * CB;
  const float* V = P.v + (b * P.Hkv + h) * P.Tk * D;
  vf<W> lanes;
  for (int i = 0; i < W; ++i) lanes[i] = static_cast<float>(i);
  const bool cap = P.cap > 0.0f;
  for_key_tiles(P, st, t0, t1, [&](int64_t j0, int64_t n, int64_t ta, int64_t tb) {
    const int64_t r0 = (ta - t0) * G, r1 = (tb - t0) * G, ncb = (n + CB - 1) / CB;
    const int64_t nok = keys_ok(P, b, j0, n);
    if (nok == 0) return;  // key_ok clears every key of the tile: no row sees one
    // with holes, a row may see no key of the tile (its max is -inf): it takes 0 as its
    // reference here (so 2^(S - m) is 0, not NaN) and keeps -inf as its running max
    const bool holes = nok < n;
    if (holes) key_holes(P, b, j0, n, ncb * CB, bad);
    scores(Q + r0 * D, D, KP + j0 * D, CB, D, S + r0 * BK, BK, r1 - r0, ncb, rmax + r0 * W, D * CB);
    // each row's new running max: from the tile's scores (the micro-kernel's maxima, or
    // after capping or masking a pass over the row), then the rescale factors 2^(old - new),
    // W rows at a time (lanes past r1 get 2^0 and are never read)
    bool masked = false;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t p = off + t0 + r / G, s = st[p], lo = first_key(P, st, p);
      float* Sr = S + r * BK;
      if (cap) cap_row(Sr, ncb, P.cap, P.icap);
      float tmax;
      if (holes || needs_mask(ncb, j0, lo, p, n)) {
        masked = true;
        mask_row(Sr, ncb, j0, lo, p, n, holes ? bad : nullptr);
        tmax = row_max(Sr, ncb);
      } else {
        tmax = cap ? row_max(Sr, ncb) : hmax<W>(load<W>(rmax + r * W));
      }
      if (s >= j0 && s < j0 + n) first[r] = Sr[s - j0];
      mnew[r] = std::max(mx[r], tmax);
      if (holes && mnew[r] == -INFINITY) mnew[r] = 0.0f;
    }
    for (int64_t r = r0; r < r1; r += W) {
      const vf<W> x = load<W>(mx + r) - load<W>(mnew + r);
      store<W>(alpha + r, exp2v<W>(lanes + static_cast<float>(r - r1) < 0.0f ? x : vf<W>{}));
    }
    for (int64_t r = r0; r < r1; ++r) {
      l[r] = l[r] * alpha[r] + exp_row(S + r * BK, ncb, mnew[r]);
      if (alpha[r] != 1.0f) scale_row(O + r * D, D, alpha[r]);
      mx[r] = holes && l[r] == 0.0f ? -INFINITY : mnew[r];  // (l >= 1 once a key is seen)
    }
    if (masked && !v_tile_finite(P, V, (b * P.Hkv + h) * P.NP, j0, n)) {
      // each row sums over the keys it sees only (see rows_finite)
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t p = off + t0 + r / G, lo = std::max(first_key(P, st, p), j0), hi = std::min(p, j0 + n - 1);
        ok_runs(P, b, holes, lo, hi, [&](int64_t j, int64_t len) {
          accumulate(S + r * BK + (j - j0), BK, 1, V + j * D, D, len, O + r * D, D, 1, D);
        });
      }
    } else {
      accumulate(S + r0 * BK, BK, 1, V + j0 * D, D, n, O + r0 * D, D, r1 - r0, D);
    }
  });
  for (int64_t r = 0; r < M; ++r) {
    const int64_t t = t0 + r / G, g = r % G, p = off + t, s = st[p];
    const float lse2 = mx[r] + std::log2(l[r]);  // -inf for a row that sees no key (l = 0)
    const bool none = l[r] == 0.0f;               // (only where key_ok clears all its keys)
    float* out = o + ((b * P.Tq + t) * P.Hq + h * G + g) * D;
    const float inv = none ? 0.0f : 1.0f / l[r];
    for (int64_t d = 0; d < D; ++d) out[d] = O[r * D + d] * inv;
    const int64_t si = (b * P.Hq + h * G + g) * P.Tq + t;
    lse[si] = lse2 * 0.69314718055994531f;
    psink[si] = s == p || none ? 0.0f : std::exp2(first[r] - lse2);
  }
}

// ---------------------------------------------------------------------- backward
// Loads, for queries t0..t1-1 of (b, h): Q (scaled by qscale), dO, lse in log2 units and
// delta = rowsum(dO * O).
inline void backward_rows(const Problem& P, int64_t b, int64_t h, int64_t t0, int64_t t1,
                          float* Q, float* dO, float* lse2, float* delta) {
  const int64_t G = P.G;
  gather_rows(P, P.q, b, h, t0, t1, P.qscale, Q);
  gather_rows(P, P.dout, b, h, t0, t1, 1.0f, dO);
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = (t - t0) * G + g, hq = h * G + g;
      const float x = P.lse[(b * P.Hq + hq) * P.Tq + t];
      // a row that saw no key (lse -inf) has no probabilities: 2^(S - inf) = 0
      lse2[r] = x == -INFINITY ? INFINITY : x * 1.4426950408889634f;
      delta[r] = P.delta[(b * P.Tq + t) * P.Hq + hq];
    }
}

// Probabilities (in S) and dS (in dP) of the M rows of queries tq0.. against keys j0..j0+n-1,
// n <= CB, whose K^T and V^T are the key panels KP and VP ((D, CB) each); both exactly 0 at
// masked pairs (bad: key_ok's holes in the tile, see key_holes, or null). With softcap, the
// scores are capped before the softmax and dS is multiplied by 1 - tanh^2 of the uncapped
// score (dt: CB floats of scratch). Returns whether any pair was masked.
inline bool probs_and_ds(const Problem& P, const int32_t* st, int64_t tq0, int64_t j0, int64_t n,
                         int64_t M, const float* Q, const float* dO, const float* lse2,
                         const float* delta, const float* KP, const float* VP, float* S, float* dP,
                         const float* bad, float* dt) {
  const int64_t G = P.G, D = P.D, BK = P.BK, off = P.Tk - P.Tq, ncb = 1;
  const bool cap = P.cap > 0.0f;
  scores(Q, D, KP, CB, D, S, BK, M, ncb);
  scores(dO, D, VP, CB, D, dP, BK, M, ncb);
  bool masked = false;
  for (int64_t r = 0; r < M; ++r) {
    const int64_t p = off + tq0 + r / G, lo = first_key(P, st, p);
    float* Sr = S + r * BK;
    const bool m = bad || needs_mask(ncb, j0, lo, p, n);
    if (cap) cap_row(Sr, ncb, P.cap, P.icap, dt);
    if (m) mask_row(Sr, ncb, j0, lo, p, n, bad);
    exp_row(Sr, ncb, lse2[r]);
    ds_row(Sr, dP + r * BK, ncb, delta[r]);
    if (cap) {
      for (int64_t c = 0; c < ncb * CB; c += W) store<W>(dP + r * BK + c, load<W>(dP + r * BK + c) * load<W>(dt + c));
    }
    if (m) {
      zero_masked(Sr, ncb, j0, lo, p, n, bad);
      zero_masked(dP + r * BK, ncb, j0, lo, p, n, bad);
      masked = true;
    }
  }
  return masked;
}

// One work unit of the backward, in a single pass: keys kb..ke-1 of the segment that ends at
// position e, of (b, h), against every query of that segment at or after kb (no other query
// sees them), BQ query positions at a time and the keys in tiles of KT. Per (query block, key
// tile) the probabilities and dS are computed once and give all three products: dV += P^T dO,
// dK += dS^T Q (the unit owns its keys) and dQ_block += dS K. A query block's dQ is complete for
// this unit after its key tiles and is stored, times mul, to dst: row (t - tlo, g) at
// dst + (t - tlo) * dst_stride + g * D, tlo the unit's first query (max(kb, Tk - Tq) - offset).
// dK, dV are written to (B, Tk, Hkv, D) fp32; zeros where no query sees the keys.
inline void backward_unit(const Problem& P, int64_t b, int64_t h, int64_t kb, int64_t ke, int64_t e,
                          float* dk, float* dv, float* dst, int64_t dst_stride, float mul) {
  constexpr int64_t KT = CB;  // keys per tile: one key panel
  const int64_t G = P.G, D = P.D, BK = P.BK, BQ = P.BQ, off = P.Tk - P.Tq;
  const int64_t nk = ke - kb;
  Buffers& buf = buffers();
  float* dK = grow(buf.acc1, nk * D);
  float* dV = grow(buf.acc2, nk * D);
  std::fill(dK, dK + nk * D, 0.0f);
  std::fill(dV, dV + nk * D, 0.0f);
  const int64_t plo = std::max(kb, off);
  if (plo <= e) {
    float* Q = grow(buf.q, BQ * G * D);
    float* dO = grow(buf.dov, BQ * G * D);
    float* dQ = grow(buf.o, BQ * G * D);
    float* S = grow(buf.s, BQ * G * BK);
    float* dP = grow(buf.dp, BQ * G * BK);
    float* lse2 = grow(buf.stat1, BQ * G);
    float* delta = grow(buf.stat2, BQ * G);
    const int32_t* st = P.start + b * P.Tk;
    const int64_t kv = b * P.Hkv + h;
    const float* K = P.k + kv * P.Tk * D;
    const float* V = P.v + kv * P.Tk * D;
    // the unit's keys as panels of KT keys from kb, (D, KT) each, K^T and V^T: a tile's
    // score micro-tiles then read one contiguous run
    const int64_t np = (nk + KT - 1) / KT;
    float* KP = grow(buf.kp, np * D * KT);
    float* VP = grow(buf.vp, np * D * KT);
    float* k_ok = grow(buf.ok, np);  // 1 where the panel's keys are all finite
    float* bad = grow(buf.sink, 2 * CB);  // key_ok's holes in a tile (see key_holes)
    float* dt = bad + CB;                 // softcap: 1 - tanh^2 of a row's scores
    for (int64_t i = 0; i < np; ++i) {
      const int64_t n = std::min(KT, nk - i * KT);
      key_panel(K + (kb + i * KT) * D, D, n, D, KP + i * D * KT);
      key_panel(V + (kb + i * KT) * D, D, n, D, VP + i * D * KT);
      k_ok[i] = rows_finite(K + (kb + i * KT) * D, D, n, D) ? 1.0f : 0.0f;
    }
    const int64_t tlo = plo - off;
    // the last query that sees one of the unit's keys: the segment's end, or with a window
    // the last key's last one; the unit's dQ shares of later queries are zeros
    const int64_t pend = P.window > 0 ? std::min(e, ke - 2 + P.window) : e;
    const uint8_t* key_ok = P.key_ok ? P.key_ok + b * P.Tk : nullptr;
    for (int64_t pa = plo; pa <= pend; pa += BQ) {
      const int64_t t0 = pa - off, t1 = std::min(pend + 1, pa + BQ) - off, M = (t1 - t0) * G;
      backward_rows(P, b, h, t0, t1, Q, dO, lse2, delta);
      const bool q_ok = rows_finite(Q, D, M, D), do_ok = rows_finite(dO, D, M, D);
      std::fill(dQ, dQ + M * D, 0.0f);
      const int64_t kend = std::min(ke, off + t1);  // keys past the block's last query: none seen
      // keys before the block's first query's window: none seen (tiles stay on kb + i * KT)
      const int64_t kfirst = P.window > 0 ? kb + std::max<int64_t>(0, pa - P.window + 1 - kb) / KT * KT : kb;
      for (int64_t j0 = kfirst; j0 < kend; j0 += KT) {
        const int64_t n = std::min(KT, ke - j0);
        const int64_t pi = (j0 - kb) / KT;
        const int64_t nok = keys_ok(P, b, j0, n);
        if (nok == 0) continue;  // key_ok clears every key of the tile
        const bool holes = nok < n;
        if (holes) key_holes(P, b, j0, n, CB, bad);
        const bool masked = probs_and_ds(P, st, t0, j0, n, M, Q, dO, lse2, delta, KP + pi * D * KT,
                                         VP + pi * D * KT, S, dP, holes ? bad : nullptr, dt);
        // Where a masked pair meets a non-finite operand, exact sums over the visible pairs
        // (see rows_finite): per key over the rows that see it (a run of rows: positions
        // from the key on, up to the end of its segment or window), per row over its keys.
        if (masked && !(q_ok && do_ok)) {
          for (int64_t j = j0; j < j0 + n; ++j) {
            if (holes && !key_ok[j]) continue;
            const int64_t ta = std::max(t0, j - off);
            int64_t tb = t1;
            while (tb > ta && first_key(P, st, off + tb - 1) > j) --tb;
            if (ta >= tb) continue;
            const int64_t ra = (ta - t0) * G, rb = (tb - t0) * G;
            if (!do_ok) accumulate(S + ra * BK + (j - j0), 1, BK, dO + ra * D, D, rb - ra, dV + (j - kb) * D, D, 1, D);
            if (!q_ok) accumulate(dP + ra * BK + (j - j0), 1, BK, Q + ra * D, D, rb - ra, dK + (j - kb) * D, D, 1, D);
          }
        }
        if (!masked || do_ok) accumulate(S, 1, BK, dO, D, M, dV + (j0 - kb) * D, D, n, D);  // dV += P^T dO
        if (!masked || q_ok) accumulate(dP, 1, BK, Q, D, M, dK + (j0 - kb) * D, D, n, D);   // dK += dS^T Q
        if (masked && k_ok[pi] == 0.0f) {
          for (int64_t r = 0; r < M; ++r) {
            const int64_t p = off + t0 + r / G, lo = std::max(first_key(P, st, p), j0), hi = std::min(p, j0 + n - 1);
            ok_runs(P, b, holes, lo, hi, [&](int64_t j, int64_t len) {
              accumulate(dP + r * BK + (j - j0), BK, 1, K + j * D, D, len, dQ + r * D, D, 1, D);
            });
          }
        } else {
          accumulate(dP, BK, 1, K + j0 * D, D, n, dQ, D, M, D);  // dQ += dS K
        }
      }
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t g = 0; g < G; ++g) {
          const float* src = dQ + ((t - t0) * G + g) * D;
          float* out = dst + (t - tlo) * dst_stride + g * D;
          for (int64_t d = 0; d < D; ++d) out[d] = src[d] * mul;
        }
    }
    for (int64_t p = std::max(plo, pend + 1); p <= e; ++p)
      for (int64_t g = 0; g < G; ++g) std::fill_n(dst + (p - off - tlo) * dst_stride + g * D, D, 0.0f);
  }
  const float kmul = P.scale / P.qscale;  // dS^T Q used Q times qscale
  for (int64_t j = 0; j < nk; ++j) {
    float* ok = dk + ((b * P.Tk + kb + j) * P.Hkv + h) * D;
    float* ov = dv + ((b * P.Tk + kb + j) * P.Hkv + h) * D;
    for (int64_t d = 0; d < D; ++d) {
      ok[d] = dK[j * D + d] * kmul;
      ov[d] = dV[j * D + d];
    }
  }
}
