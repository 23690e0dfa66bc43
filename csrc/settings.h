// What the native CPU kernels make of smelt's environment variables, as they run now: each
// part of the extension defines its own, and smelt_cpu::settings() (cpu_module.cpp) hands
// them to backends.report(), which shows them next to the variables.
#pragma once

#include <string>

namespace smelt_att {
std::string attention_isa();  // cpu_attention.cpp: the vector form picked at the first call
}  // namespace smelt_att

namespace smelt_moe {
std::string route_isa();      // cpu_route.cpp: the router's top-k form
bool rows_kernel_allowed();   // cpu_forward.cpp: whether fp32 experts may take the rows kernel
bool use_decode_path();       // cpu_decode.cpp: whether the few-rows path is on
}  // namespace smelt_moe
