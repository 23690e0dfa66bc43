// Output allocation for the native CPU kernels, with the same optional poisoning as
// smelt_kernels/_alloc.py: with SMELT_POISON set (and not "0") every buffer a kernel is meant
// to write completely is filled with NaN (floating types) or the most negative integer before
// the kernel runs, so an element it forgets to write fails the comparison instead of passing
// by luck. Without it this is at::empty.
#pragma once

#include <ATen/ATen.h>

#include "cpu_pool.h"

#include <cstdlib>
#include <cstring>
#include <limits>

namespace smelt {

// Read on every call (getenv is a short scan) so that a test which sets or clears the
// variable after the extension loaded is honoured.
inline bool poisoning() {
  const char* v = std::getenv("SMELT_POISON");
  return v != nullptr && v[0] != '\0' && std::strcmp(v, "0") != 0;
}

inline at::Tensor& poison(at::Tensor& t) {
  if (t.numel() == 0) return t;
  const at::ScalarType s = t.scalar_type();
  if (at::isFloatingType(s)) t.fill_(std::numeric_limits<double>::quiet_NaN());
  else if (s == at::kBool) t.fill_(true);
  else if (s == at::kInt) t.fill_(std::numeric_limits<int32_t>::min());
  else if (s == at::kLong) t.fill_(std::numeric_limits<int64_t>::min());
  else if (s == at::kByte) t.fill_(0xff);
  return t;
}

// at::empty, poisoned when SMELT_POISON asks for it.
inline at::Tensor output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = at::empty(sizes, options);
  if (poisoning()) poison(t);
  return t;
}

inline at::Tensor output_like(const at::Tensor& like) { return output(like.sizes(), like.options()); }

// output() on a block of the pool in cpu_pool.h: for the large per-call outputs, which would
// otherwise be first-touched page by page on every call. CPU, contiguous.
inline at::Tensor pooled_output(at::IntArrayRef sizes, at::ScalarType dtype) {
  at::Tensor t = pooled_empty(sizes, dtype);
  if (poisoning()) poison(t);
  return t;
}

inline at::Tensor pooled_output_like(const at::Tensor& like) {
  return pooled_output(like.sizes(), like.scalar_type());
}

}  // namespace smelt
