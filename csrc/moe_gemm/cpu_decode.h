// The few-rows path of the CPU MoE forward (decode): an expert with at most
// few_rows_limit(its weight bytes) sorted rows runs both GEMMs as dot products against its
// weights where they lie, row-major as stored, with SwiGLU between them. Nothing is packed
// or transposed, and every weight row is read from memory once per item: four weight rows at
// a time stay in L1 while the item's token rows (three at a time) are dotted against them.
#pragma once

#include "cpu_rows.h"

namespace smelt_moe {

// Experts with at most this many rows in a call take the few-rows path: 16 for experts
// under 256 KiB of weights, 32 under 1 MiB, 48 above. The packed panels cost a transpose of
// the expert's weights per item, which larger experts (more of it from memory) amortise only
// over more rows. Crossovers measured in fp32 on an AVX2 EPYC, either path timed on the same
// call: about 22 rows at 196 KiB (H 256, d_e 64), 33 at 368 KiB (H 320, d_e 96), 36 at
// 576 KiB (H 384, d_e 128), 55 at 2.8 MiB (H 576, d_e 424) and 64 at 4.2 MiB (H 672,
// d_e 544).
inline int64_t few_rows_limit(int64_t expert_bytes) {
  return expert_bytes < (int64_t(256) << 10) ? 16 : expert_bytes < (int64_t(1) << 20) ? 32 : 48;
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
