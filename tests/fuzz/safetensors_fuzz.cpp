// libFuzzer target for the safetensors header parser (braid::ckpt::parse_safetensors_header).
//
// Input: a whole safetensors file. Every input must either parse into a header whose
// invariants hold (checked here: any violation aborts, and libFuzzer keeps the input) or throw
// braid::ConfigError. Anything else -- another exception, a read outside the buffer (ASan),
// undefined behaviour (UBSan), a hang -- is a bug. The seeds in tests/fuzz/safetensors_corpus
// are small files the Python `safetensors` library wrote and corrupt variants of them. A
// longer run, from a build dir:
//   tests/cpp/ckpt/safetensors_fuzzer -max_total_time=600 <new corpus dir> \
//       ../tests/fuzz/safetensors_corpus

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>

#include "braid/ckpt/safetensors.h"
#include "braid/core/error.h"

namespace {

void require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "safetensors_fuzz: the parser accepted a header that breaks: %s\n", what);
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace braid::ckpt;
  try {
    SafetensorsHeader h = parse_safetensors_header(std::span<const uint8_t>(data, size), "fuzz");
    require(h.header_bytes <= kMaxHeaderBytes, "header within the limit");
    require(h.data_start == 8 + h.header_bytes && h.data_start <= size, "data area in the file");
    uint64_t covered = 0;
    for (const TensorInfo& t : h.tensors) {
      require(t.name != "__metadata__", "no tensor called __metadata__");
      require(safetensors_dtype_size(t.dtype) > 0, "known dtype");
      require(t.begin == covered && t.begin <= t.end, "tensors back to back from byte 0");
      uint64_t n = safetensors_dtype_size(t.dtype);
      for (int64_t d : t.shape) {
        require(d >= 0, "non-negative dims");
        n *= uint64_t(d);  // cannot overflow: the parser checked
      }
      require(n == t.nbytes(), "bytes = numel * itemsize");
      covered = t.end;
    }
    require(covered == size - h.data_start, "the tensors cover the data area exactly");
  } catch (const braid::ConfigError&) {
    // a rejected file: fine
  }
  return 0;
}
