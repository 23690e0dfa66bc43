// Output allocation for the native CPU kernels, with the same optional poisoning as
// smelt_kernels/_alloc.py: with SMELT_POISON set (and not "0") every buffer a kernel is meant
// to write completely is filled with NaN (floating types) or the most negative integer before
// the kernel runs, so an element it forgets to write fails the comparison instead of passing
// by luck. Without it this is at::empty.
//
// Running out of memory is an error, never a crash: every allocation here, and the large
// ones of the kernels, raise torch.OutOfMemoryError (a RuntimeError) with the bytes asked
// for, and each op's entry point (named_op) puts its name in front of the message.
#pragma once

#include <ATen/ATen.h>
#include "env.h"
#include <c10/util/Exception.h>

#include "cpu_pool.h"

#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <vector>

namespace smelt {

[[noreturn]] inline void out_of_memory(const char* what, int64_t bytes) {
  TORCH_CHECK_WITH(OutOfMemoryError, false, "out of memory: could not allocate ", bytes, " bytes for ", what);
}

// fn() with the out-of-memory errors of what it calls (ours, ATen's allocator, std::bad_alloc)
// raised as one torch.OutOfMemoryError that starts with the op's name.
template <typename Fn>
auto named_op(const char* op, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const c10::OutOfMemoryError& e) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, op, ": ", e.what_without_backtrace());
  } catch (const std::bad_alloc&) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, op, ": out of memory");
  } catch (const c10::Error& e) {
    // ATen's CPU allocator reports a failed allocation as a plain error
    const std::string msg = e.what_without_backtrace();
    if (msg.find("allocate") != std::string::npos && msg.find("memory") != std::string::npos)
      TORCH_CHECK_WITH(OutOfMemoryError, false, op, ": ", msg);
    throw;
  }
}

// A std::vector<T> of n elements (value-initialised), or out_of_memory naming `what`.
template <typename T>
std::vector<T> sized(int64_t n, const char* what) {
  try {
    return std::vector<T>(static_cast<size_t>(n));
  } catch (const std::bad_alloc&) {
    out_of_memory(what, n * static_cast<int64_t>(sizeof(T)));
  }
}

// v.resize(n) for a work buffer that only grows, or out_of_memory naming `what`.
template <typename T>
T* grow(std::vector<T>& v, int64_t n, const char* what) {
  if (static_cast<int64_t>(v.size()) < n) {
    try {
      v.resize(static_cast<size_t>(n));
    } catch (const std::bad_alloc&) {
      out_of_memory(what, n * static_cast<int64_t>(sizeof(T)));
    }
  }
  return v.data();
}

// at::empty, raising out_of_memory with the bytes when the allocation fails.
inline at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options, const char* what = "an output") {
  try {
    return at::empty(sizes, options);
  } catch (const c10::OutOfMemoryError&) {
    throw;
  } catch (const c10::Error&) {
    out_of_memory(what, c10::multiply_integers(sizes) * static_cast<int64_t>(c10::elementSize(
                            c10::typeMetaToScalarType(options.dtype()))));
  }
}

// Read on every call so that a test which sets or clears the variable after the extension
// loaded is honoured.
inline bool poisoning() { return smelt::env_flag("SMELT_POISON"); }

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
  at::Tensor t = empty(sizes, options);
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
