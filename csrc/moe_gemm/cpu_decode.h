// The few-rows path of the CPU MoE forward (decode): an expert with at most kDecodeRows
// sorted rows runs both GEMMs as dot products against its weights where they lie, row-major
// as stored, with SwiGLU between them. Nothing is packed or transposed, and every weight
// row is read from memory once per item: four weight rows at a time stay in L1 while the
// item's token rows (three at a time) are dotted against them.
#pragma once

#include "cpu_rows.h"

namespace smelt_moe {

// Experts with at most this many rows in a call take the few-rows path.
constexpr int64_t kDecodeRows = 16;

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
