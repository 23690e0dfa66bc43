// Python module for the native CPU extension smelt_kernels._cpu.
//
// The ops are registered by each kernel's source file (TORCH_LIBRARY_FRAGMENT(smelt_cpu, m)
// + TORCH_LIBRARY_IMPL(smelt_cpu, CPU, m)) and called as torch.ops.smelt_cpu.<name>. The
// block pool the kernels share (cpu_pool.h) registers its two ops here.
#include <torch/extension.h>

#include "cpu_pool.h"

namespace {

int64_t pool_release() { return smelt::BlockPool::get().release(); }

std::tuple<int64_t, int64_t, int64_t> pool_stats() { return smelt::BlockPool::get().stats(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(smelt_cpu, m) {
  m.def("pool_release() -> int", &pool_release);
  m.def("pool_stats() -> (int held_bytes, int reused, int fresh)", &pool_stats);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "smelt native CPU kernels (ops live under torch.ops.smelt_cpu)";
}
