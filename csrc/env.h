// The one place native code reads smelt's environment variables. What each one changes is
// listed in smelt_kernels.backends.ENVIRONMENT (and shown by backends.report()). Each is
// read when its choice is made, so a process that sets or clears one later is honoured.
#pragma once

#include <cstdlib>
#include <cstring>
#include <string>

namespace smelt {

// The value of variable `name`, or "" when it is unset.
inline std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

// Whether variable `name` is set to something other than "" or "0".
inline bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0' && std::strcmp(v, "0") != 0;
}

}  // namespace smelt
