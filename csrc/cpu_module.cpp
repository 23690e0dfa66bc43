// Python module for the native CPU extension smelt_kernels._cpu.
//
// The ops are registered by each kernel's source file (TORCH_LIBRARY_FRAGMENT(smelt_cpu, m)
// + TORCH_LIBRARY_IMPL(smelt_cpu, CPU, m)) and called as torch.ops.smelt_cpu.<name>.
#include <torch/extension.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "smelt native CPU kernels (ops live under torch.ops.smelt_cpu)";
}
