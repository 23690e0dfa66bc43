// Python module for the optional CUDA extension smelt_kernels._cuda.
//
// The ops themselves are registered with the dispatcher by each kernel's binding file
// (TORCH_LIBRARY_FRAGMENT(smelt_cuda, m) + TORCH_LIBRARY_IMPL(smelt_cuda, CUDA, m)) and
// are called from Python as torch.ops.smelt_cuda.<name>. Importing this module loads them.
#include <torch/extension.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "smelt CUDA kernels (ops live under torch.ops.smelt_cuda)";
}
