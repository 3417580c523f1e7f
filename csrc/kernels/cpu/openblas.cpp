#include "kernels/cpu/openblas.h"

#include <dlfcn.h>

#include <cstdlib>
#include <optional>

#include "braid/core/error.h"

namespace braid::ops::cpu {
namespace {

// Sets an environment variable for a scope and puts back what was there (nothing, or a value).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

template <typename F>
F symbol(void* library, const char* name, const std::string& file) {
  void* found = dlsym(library, name);
  BRAID_CHECK(found != nullptr, "OpenBLAS (", file, ") has no ", name);
  return reinterpret_cast<F>(found);
}

// The OPENBLAS_CORETYPE braid gives OpenBLAS on this CPU where the environment has none ("":
// OpenBLAS's own choice stands: no AVX2, or not x86-64).
std::string openblas_coretype_for_this_cpu() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl"))
    return "SkylakeX";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "Haswell";
#endif
  return "";
}

OpenBlas load() {
  // The library braid was built against first (BRAID_OPENBLAS_LIBRARY, from CMake), then the
  // one the dynamic loader finds by its soname (an installed wheel on another machine).
  const std::string candidates[] = {BRAID_OPENBLAS_LIBRARY, "libopenblas.so.0"};
  OpenBlas blas;
  const char* user_core = std::getenv("OPENBLAS_CORETYPE");
  if (user_core != nullptr && *user_core == '\0') user_core = nullptr;  // set empty: unset
  const std::string chosen = user_core ? "" : openblas_coretype_for_this_cpu();
  std::string tried;
  void* library = nullptr;
  {
    std::optional<ScopedEnv> core;
    if (!chosen.empty()) core.emplace("OPENBLAS_CORETYPE", chosen);
    for (const std::string& file : candidates) {
      // Already loaded in this process (another library linked it): its kernels are chosen.
      library = dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
      if (library != nullptr) {
        blas.info.chosen_by = "already loaded in this process when braid first needed it";
      } else {
        library = dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
      }
      if (library != nullptr) {
        blas.info.library = file;
        break;
      }
      const char* error = dlerror();
      tried += "\n  " + file + ": " + (error ? error : "not found");
    }
  }
  BRAID_CHECK(library != nullptr, "cannot load OpenBLAS, braid's CPU GEMM (on Debian: ",
              "apt-get install libopenblas0-pthread); tried:", tried);
  blas.sgemm = symbol<decltype(&cblas_sgemm)>(library, "cblas_sgemm", blas.info.library);
  blas.get_parallel =
      symbol<decltype(&openblas_get_parallel)>(library, "openblas_get_parallel", blas.info.library);
  blas.set_num_threads = symbol<decltype(&openblas_set_num_threads)>(
      library, "openblas_set_num_threads", blas.info.library);
  blas.info.kernels = symbol<decltype(&openblas_get_corename)>(library, "openblas_get_corename",
                                                               blas.info.library)();
  if (blas.info.chosen_by.empty()) {
    blas.info.chosen_by =
        user_core        ? "OPENBLAS_CORETYPE=" + std::string(user_core) + " (yours)"
        : chosen.empty() ? "OpenBLAS's own choice"
                         : "OPENBLAS_CORETYPE=" + chosen + ", chosen by braid from the CPU's " +
                               (chosen == "SkylakeX" ? "AVX-512" : "AVX2 and FMA");
  }
  return blas;
}

}  // namespace

const OpenBlas& openblas() {
  static const OpenBlas blas = load();
  return blas;
}

}  // namespace braid::ops::cpu

namespace braid::ops {

CpuBlas cpu_blas() { return cpu::openblas().info; }

}  // namespace braid::ops
