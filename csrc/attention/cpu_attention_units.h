// The work scheduling of the CPU segment attention (cpu_attention.cpp includes this file
// once, inside its anonymous namespace, after Problem and the ISA table): run_items, the
// intra-op work queue, and run_backward, which cuts each segment's keys into work units.

// Runs f(item) for items 0..n-1 on the intra-op threads: the costliest first, each thread
// taking the next one when it is done (a static split of these uneven items left threads
// idle). Which thread runs an item never changes what it computes.
template <typename F>
void run_items(const std::vector<int64_t>& cost, F&& f) {
  const int64_t n = static_cast<int64_t>(cost.size());
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n)), 1,
                   [&](int64_t, int64_t) {
                     for (int64_t i; (i = next.fetch_add(1)) < n;) f(order[i]);
                   });
}

// Query-block items (b, h, t0) with their cost (keys seen).
void query_items(const Problem& P, const std::vector<int32_t>& st, std::vector<int64_t>& t0s,
                 std::vector<int64_t>& cost) {
  const int64_t off = P.Tk - P.Tq;
  for (int64_t b = 0; b < P.B; ++b)
    for (int64_t h = 0; h < P.Hkv; ++h)
      for (int64_t t0 = 0; t0 < P.Tq; t0 += P.BQ) {
        const int64_t t1 = std::min(P.Tq, t0 + P.BQ);
        t0s.push_back((b * P.Hkv + h) * P.Tq + t0);
        const int64_t lo = P.window > 0 ? std::max<int64_t>(st[b * P.Tk + off + t0], off + t0 - P.window + 1)
                                        : st[b * P.Tk + off + t0];
        cost.push_back((off + t1 - lo) * (t1 - t0));
      }
}

// Backward work units: each segment of each (b, KV head) is cut into key chunks, at most
// kMaxChunks, about kChunkKeys keys each and split at equal cost (a key costs the queries that
// see it); a chunk and every query that sees it is one unit, which owns its keys' dK, dV. dQ
// rows get one share per chunk at or before them: the first chunk's goes straight into dq,
// the others' into scratch, added in chunk order afterwards. The cut depends on the segment
// layout only, never on the thread count, so the sums (and the results) are bitwise the same
// for any number of threads.
constexpr int64_t kChunkKeys = 512, kMaxChunks = 8, kChunkAlign = 32;

struct Unit {
  int64_t b, h, kb, ke, e, cost;
  float* dst;       // where its dQ shares go: dq itself, or scratch at offset `at`
  int64_t stride;
  float mul;
  int64_t at = -1;
};
struct Seg {  // a segment cut into more than one chunk: its scratch shares to add
  int64_t b, h, s, e, first, n;
};

void run_backward(const Problem& P, const std::vector<int32_t>& en, float* dqp, float* dkp, float* dvp) {
  const int64_t off = P.Tk - P.Tq, G = P.G, D = P.D;
  std::vector<Unit> units;
  std::vector<Seg> segs;
  int64_t scratch = 0;
  for (int64_t b = 0; b < P.B; ++b)
    for (int64_t s = 0; s < P.Tk;) {
      const int64_t e = en[b * P.Tk + s], L = e - s + 1;
      const int64_t n = std::min(kMaxChunks, std::max<int64_t>(1, (L + kChunkKeys - 1) / kChunkKeys));
      // key cost: queries max(j, off)..e (with a window, up to j + window - 1 at most); a chunk
      // ends where the running cost passes c/n of it
      auto cost_of = [&](int64_t j0, int64_t j1) {
        int64_t c = 0;
        for (int64_t j = j0; j < j1; ++j) {
          const int64_t last = P.window > 0 ? std::min(e, j + P.window - 1) : e;
          c += std::max<int64_t>(0, last - std::max(j, off) + 1);
        }
        return c;
      };
      const int64_t total = cost_of(s, e + 1);
      std::vector<int64_t> cuts{s};
      int64_t run = 0;
      for (int64_t j = s; j <= e && static_cast<int64_t>(cuts.size()) < n; j += kChunkAlign) {
        const int64_t j1 = std::min(e + 1, j + kChunkAlign);
        run += cost_of(j, j1);
        if (j1 <= e && run * n >= total * static_cast<int64_t>(cuts.size())) cuts.push_back(j1);
      }
      cuts.push_back(e + 1);
      const int64_t nc = static_cast<int64_t>(cuts.size()) - 1;
      std::vector<int64_t> chunk_cost(nc);  // the same for every KV head
      for (int64_t c = 0; c < nc; ++c) chunk_cost[c] = cost_of(cuts[c], cuts[c + 1]) + (cuts[c + 1] - cuts[c]);
      for (int64_t h = 0; h < P.Hkv; ++h) {
        if (nc > 1) segs.push_back({b, h, s, e, static_cast<int64_t>(units.size()), nc});
        for (int64_t c = 0; c < nc; ++c) {
          const int64_t kb = cuts[c], ke = cuts[c + 1], plo = std::max(kb, off);
          Unit u{b, h, kb, ke, e, chunk_cost[c], nullptr, 0, 1.0f};
          if (plo <= e && c == 0) {
            u.dst = dqp + ((b * P.Tq + plo - off) * P.Hq + h * G) * D;
            u.stride = P.Hq * D;
            u.mul = nc == 1 ? P.scale : 1.0f;
          } else if (plo <= e) {
            u.stride = G * D;
            u.at = scratch;
            scratch += (e - plo + 1) * G * D;
          }
          units.push_back(u);
        }
      }
      s = e + 1;
    }
  std::vector<float> extra = smelt::sized<float>(scratch, "the backward's dQ shares");
  for (Unit& u : units)
    if (u.at >= 0) u.dst = extra.data() + u.at;
  std::vector<int64_t> cost(units.size());
  for (size_t i = 0; i < units.size(); ++i) cost[i] = units[i].cost;
  const Isa& I = isa();
  run_items(cost, [&](int64_t i) {
    const Unit& u = units[i];
    I.unit(P, u.b, u.h, u.kb, u.ke, u.e, dkp, dvp, u.dst, u.stride, u.mul);
  });
  // dq of the segments cut in several chunks: (first share + second + ...) * scale, in order
  at::parallel_for(0, static_cast<int64_t>(segs.size()), 1, [&](int64_t s0, int64_t s1) {
    for (int64_t si = s0; si < s1; ++si) {
      const Seg& sg = segs[si];
      for (int64_t p = std::max(sg.s, off); p <= sg.e; ++p) {
        float* row = dqp + ((sg.b * P.Tq + p - off) * P.Hq + sg.h * G) * D;
        for (int64_t c = 1; c < sg.n; ++c) {
          const Unit& u = units[sg.first + c];
          const int64_t plo = std::max(u.kb, off);
          if (p < plo) continue;
          const float* share = u.dst + (p - plo) * u.stride;
          for (int64_t i = 0; i < G * D; ++i) row[i] += share[i];
        }
        for (int64_t i = 0; i < G * D; ++i) row[i] *= P.scale;
      }
    }
  });
}
