// Python module for the native CPU extension smelt_kernels._cpu.
//
// The ops are registered by each kernel's source file (TORCH_LIBRARY_FRAGMENT(smelt_cpu, m)
// + TORCH_LIBRARY_IMPL(smelt_cpu, CPU, m)) and called as torch.ops.smelt_cpu.<name>. The
// block pool the kernels share (cpu_pool.h) registers its two ops here, and so does
// settings(): what the kernels make of smelt's environment variables now.
#include <torch/extension.h>

#include <string>
#include <vector>

#include "cpu_alloc.h"
#include "cpu_pool.h"
#include "settings.h"

namespace {

int64_t pool_release() { return smelt::BlockPool::get().release(); }

std::tuple<int64_t, int64_t, int64_t> pool_stats() { return smelt::BlockPool::get().stats(); }

// "VARIABLE=what is in use" for each variable the kernels read. Asking for the attention form
// fixes it for the process, as the first attention call would.
std::vector<std::string> settings() {
  const size_t cap_mb = smelt::BlockPool::cap() >> 20;
  const std::string pool = cap_mb ? "block pool keeps up to " + std::to_string(cap_mb) + " MiB" : "block pool off";
  return {
      "SMELT_ATTENTION_ISA=attention kernel " + smelt_att::attention_isa(),
      "SMELT_ROUTE_ISA=router top-k " + smelt_moe::route_isa(),
      std::string("SMELT_CPU_GENERIC=") +
          (smelt_moe::rows_kernel_allowed() ? "MoE rows kernel where it fits" : "MoE packed panels only"),
      std::string("SMELT_CPU_DECODE=") + (smelt_moe::use_decode_path() ? "MoE few-rows path on" : "MoE few-rows path off"),
      "SMELT_CPU_POOL_MB=" + pool,
      std::string("SMELT_POISON=") + (smelt::poisoning() ? "outputs poisoned" : "outputs not poisoned"),
  };
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(smelt_cpu, m) {
  m.def("pool_release() -> int", &pool_release);
  m.def("pool_stats() -> (int held_bytes, int reused, int fresh)", &pool_stats);
  m.def("settings() -> str[]", &settings);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "smelt native CPU kernels (ops live under torch.ops.smelt_cpu)";
}
