// The few-rows path of the CPU MoE forward (decode): an expert with at most
// few_rows_limit(its weight bytes) sorted rows runs both GEMMs as dot products against its
// weights where they lie, row-major as stored, with SwiGLU between them. Nothing is packed
// or transposed, and every weight row is read from memory once per item: four weight rows at
// a time stay in L1 while the item's token rows (three at a time) are dotted against them.
#pragma once

#include "cpu_rows.h"

namespace smelt_moe {

// Experts with at most this many rows in a call take the few-rows path. The packed panels
// cost a transpose of the expert's weights per item, which larger experts (more of it from
// memory) amortise only over more rows; the crossover also depends on how much faster than
// the few-rows kernel (8-lane AVX2 dot products) the other path computes. Crossovers, either
// path timed on the same call (balanced routing, T*k/E rows per expert):
//   AVX2 EPYC (brgemm panels on AVX2): about 22 rows at 196 KiB (H 256, d_e 64), 33 at
//   368 KiB (H 320, d_e 96), 36 at 576 KiB (H 384, d_e 128), 55 at 2.8 MiB (H 576, d_e 424),
//   64 at 4.2 MiB (H 672, d_e 544): limits 16 under 256 KiB, 32 under 1 MiB, 48 above.
//   AVX-512 EPYC (the rows kernel up to 1 MiB, brgemm on AVX-512 above): about 6, 7, 12 and
//   17 rows at the first four: limits 6 under 256 KiB, 8 under 512 KiB, 12 under 1 MiB, 16
//   above. With the AVX2 limits there, SMELT's 100M experts (2.8 MiB) at 43 rows each ran the
//   few-rows path at 1.47x the panels' time.
inline int64_t few_rows_limit(int64_t expert_bytes) {
  constexpr int64_t KiB = 1024;
  if (cpu_has_avx512())
    return expert_bytes < 256 * KiB ? 6 : expert_bytes < 512 * KiB ? 8 : expert_bytes < 1024 * KiB ? 12 : 16;
  return expert_bytes < 256 * KiB ? 16 : expert_bytes < 1024 * KiB ? 32 : 48;
}

// Whether the forward may use the few-rows path (SMELT_CPU_DECODE=0 turns it off, e.g. to
// compare it with the panel kernels).
bool use_decode_path();

// Sorted rows [r0, r0 + m) of one expert: prep rows (2 d_e, when prep is not null) and out
// rows (H) at their sorted positions. w1e (2 d_e x H) and w2e (H x d_e) are the expert's
// weights; order maps sorted rows to (token, slot) pairs; pf is advanced through the next
// item's weights while this one computes.
template <typename ST>
void decode_item(const ST* x, const ST* w1e, const ST* w2e, const int32_t* order, int64_t k, int64_t H,
                 int64_t de, int64_t r0, int64_t m, ST* prep, ST* out, LinePrefetch* pf);

}  // namespace smelt_moe
