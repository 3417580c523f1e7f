// Per-stream scratch buffers, pinned staging for host-to-device copies, and cached device
// properties (declared in common.cuh).

#include <algorithm>
#include <cstring>
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

namespace {

// Pinned host buffers for copy_to_device_async, per device, each with an event recorded
// after the last copy that reads it. Kept for the life of the process, like the scratch.
struct StagingBuffer {
  void* host = nullptr;
  size_t nbytes = 0;
  cudaEvent_t done = nullptr;
};

std::mutex staging_mutex;
std::map<int, std::vector<StagingBuffer>>& staging_buffers() {
  static auto* buffers = new std::map<int, std::vector<StagingBuffer>>();
  return *buffers;
}

// True when every copy queued from `buffer` has completed.
bool staging_idle(const StagingBuffer& buffer) {
  cudaError_t status = cudaEventQuery(buffer.done);
  if (status == cudaErrorNotReady) {
    (void)cudaGetLastError();  // not an error: the copy is still queued
    return false;
  }
  CUDA_CHECK(status);
  return true;
}

}  // namespace

void copy_to_device_async(Device device, cudaStream_t stream, void* dst, const void* src,
                          size_t nbytes) {
  if (nbytes == 0) return;
  std::lock_guard<std::mutex> lock(staging_mutex);
  std::vector<StagingBuffer>& pool = staging_buffers()[device.index];
  StagingBuffer* buffer = nullptr;
  for (StagingBuffer& b : pool) {
    if (b.nbytes >= nbytes && staging_idle(b)) {
      buffer = &b;
      break;
    }
  }
  if (buffer == nullptr) {
    // Every buffer is busy or too small: add one (the pool grows only as far as copies are
    // in flight at once, a handful in practice).
    StagingBuffer fresh;
    fresh.nbytes = std::max(nbytes, size_t(64) << 10);
    CUDA_CHECK(cudaHostAlloc(&fresh.host, fresh.nbytes, cudaHostAllocPortable));
    CUDA_CHECK(cudaEventCreateWithFlags(&fresh.done, cudaEventDisableTiming));  // on `device`
    pool.push_back(fresh);
    buffer = &pool.back();
  }
  std::memcpy(buffer->host, src, nbytes);
  CUDA_CHECK(cudaMemcpyAsync(dst, buffer->host, nbytes, cudaMemcpyHostToDevice, stream));
  CUDA_CHECK(cudaEventRecord(buffer->done, stream));
}

}  // namespace braid::ops::cuda::detail
