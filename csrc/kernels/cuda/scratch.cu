// Per-stream scratch buffers and cached device properties (declared in common.cuh).

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "kernels/cuda/common.cuh"

namespace braid::ops::cuda::detail {

int sm_count(int device) {
  static std::mutex mutex;
  static std::vector<int> counts;
  std::lock_guard<std::mutex> lock(mutex);
  if (device >= int(counts.size())) counts.resize(size_t(device) + 1, 0);
  if (counts[size_t(device)] == 0) {
    int count = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
    counts[size_t(device)] = count;
  }
  return counts[size_t(device)];
}

namespace {

struct ScratchBuffer {
  void* data = nullptr;
  size_t nbytes = 0;
};

// Buffers live as long as the process: they are returned to the caching allocator only when
// they grow, and never at exit (the CUDA context may already be gone by then).
std::mutex scratch_mutex;
std::map<std::pair<int, cudaStream_t>, ScratchBuffer>& scratch_buffers() {
  static auto* buffers = new std::map<std::pair<int, cudaStream_t>, ScratchBuffer>();
  return *buffers;
}

}  // namespace

void* stream_scratch(Device device, cudaStream_t stream, size_t nbytes) {
  if (nbytes == 0) nbytes = 1;
  std::lock_guard<std::mutex> lock(scratch_mutex);
  ScratchBuffer& buffer = scratch_buffers()[{device.index, stream}];
  if (buffer.nbytes >= nbytes) return buffer.data;
  Allocator& allocator = allocator_for(device);
  if (buffer.data != nullptr) {
    // Kernels queued earlier on this stream may still use the old buffer.
    CUDA_CHECK(cudaStreamSynchronize(stream));
    allocator.deallocate(buffer.data, buffer.nbytes);
    buffer = {};
  }
  size_t grown = std::max(nbytes, size_t(1) << 20);
  buffer.data = allocator.allocate(grown);
  buffer.nbytes = grown;
  return buffer.data;
}

}  // namespace braid::ops::cuda::detail
