#pragma once
// The stream an op runs on. On CUDA it holds a cudaStream_t (nullptr: the legacy default
// stream); on the CPU ops run synchronously and ignore it. Callers order CUDA work by
// passing the same stream; the runtime never picks one behind their back.

#include "braid/core/dtype.h"

namespace braid {

struct Stream {
  void* handle = nullptr;  // cudaStream_t on CUDA
};

// Blocks the host until all work queued on `stream` of `device` is done (no-op on CPU).
void synchronize(const Device& device, Stream stream = {});

}  // namespace braid
