// CUDA side of core: the caching allocator, copies, memset, synchronisation.

#include <cuda_runtime.h>

#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "../device_runtime.h"
#include "braid/core/cuda_check.h"

namespace braid::detail {
namespace {

// Blocks from cudaMalloc are kept after they are freed and handed out again for requests
// of the same rounded size class (512 B granularity, then powers of two above 1 MiB
// rounded to 2 MiB), so a training step after the first allocates nothing from the
// driver. Never managed memory. On an allocation failure the cache is released and the
// allocation retried once before the error is raised.
class CudaCachingAllocator final : public Allocator {
 public:
  explicit CudaCachingAllocator(int device) : device_(device) {}

  void* allocate(size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    size_t size = round_size(nbytes);
    std::lock_guard<std::mutex> lock(mutex_);
    void* ptr = nullptr;
    auto it = free_.lower_bound(size);
    if (it != free_.end() && it->first <= size * 2) {  // reuse a block no more than 2x bigger
      ptr = it->second;
      size = it->first;
      free_.erase(it);
    } else {
      int previous;
      CUDA_CHECK(cudaGetDevice(&previous));
      CUDA_CHECK(cudaSetDevice(device_));
      cudaError_t status = cudaMalloc(&ptr, size);
      if (status == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        release_cached_locked();
        status = cudaMalloc(&ptr, size);
      }
      cudaSetDevice(previous);
      if (status != cudaSuccess) {
        (void)cudaGetLastError();
        BRAID_FAIL("cudaMalloc of ", size, " bytes on cuda:", device_,
                   " failed: ", cudaGetErrorString(status), " (in use ", stats_.current_bytes,
                   ", reserved ", stats_.reserved_bytes, ")");
      }
      stats_.reserved_bytes += int64_t(size);
    }
    block_size_[ptr] = size;
    stats_.current_bytes += int64_t(nbytes);
    stats_.peak_bytes = std::max(stats_.peak_bytes, stats_.current_bytes);
    return ptr;
  }

  void deallocate(void* ptr, size_t nbytes) override {
    if (ptr == nullptr) return;
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = block_size_.find(ptr);
    if (it == block_size_.end()) return;
    // Work queued on other streams may still read the block; callers that free across
    // streams synchronise first (the engine frees activations after their backward).
    free_.emplace(it->second, ptr);
    block_size_.erase(it);
    stats_.current_bytes -= int64_t(nbytes);
  }

  MemoryStats stats() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }

  void reset_peak() override {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.peak_bytes = stats_.current_bytes;
  }

  void release_cached() override {
    std::lock_guard<std::mutex> lock(mutex_);
    int previous;
    CUDA_CHECK(cudaGetDevice(&previous));
    CUDA_CHECK(cudaSetDevice(device_));
    release_cached_locked();
    cudaSetDevice(previous);
  }

 private:
  static size_t round_size(size_t n) {
    constexpr size_t kSmall = 512, kLarge = size_t(2) << 20;
    if (n < (size_t(1) << 20)) return (n + kSmall - 1) / kSmall * kSmall;
    return (n + kLarge - 1) / kLarge * kLarge;
  }

  void release_cached_locked() {
    cudaDeviceSynchronize();
    for (auto& [size, ptr] : free_) {
      cudaFree(ptr);
      stats_.reserved_bytes -= int64_t(size);
    }
    free_.clear();
  }

  int device_;
  mutable std::mutex mutex_;
  std::multimap<size_t, void*> free_;
  std::map<void*, size_t> block_size_;
  MemoryStats stats_;
};

}  // namespace

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no device: report none
    return 0;
  }
  return count;
}

std::string cuda_device_name(int index) {
  cudaDeviceProp properties{};
  CUDA_CHECK(cudaGetDeviceProperties(&properties, index));
  return properties.name;
}

Allocator& cuda_caching_allocator(int device_index) {
  // Never destroyed: CUDA tensors held by static objects may be freed after main().
  static auto* mutex = new std::mutex;
  static auto* allocators = new std::vector<std::unique_ptr<CudaCachingAllocator>>;
  std::lock_guard<std::mutex> lock(*mutex);
  int count = cuda_device_count();
  BRAID_CHECK(device_index >= 0 && device_index < count, "cuda:", device_index, " requested, but ",
              count, " CUDA device(s) are visible");
  if (allocators->empty()) allocators->resize(size_t(count));
  auto& slot = (*allocators)[size_t(device_index)];
  if (!slot) slot = std::make_unique<CudaCachingAllocator>(device_index);
  return *slot;
}

void cuda_copy(void* dst, Device dst_device, const void* src, Device src_device, size_t nbytes) {
  cudaMemcpyKind kind = dst_device.is_cpu()   ? cudaMemcpyDeviceToHost
                        : src_device.is_cpu() ? cudaMemcpyHostToDevice
                                              : cudaMemcpyDeviceToDevice;
  CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, kind, nullptr));
  // Host memory may be pageable and is read or written by the caller right after.
  if (dst_device.is_cpu() || src_device.is_cpu()) CUDA_CHECK(cudaStreamSynchronize(nullptr));
}

void cuda_zero(void* ptr, Device /*device*/, size_t nbytes) {
  CUDA_CHECK(cudaMemsetAsync(ptr, 0, nbytes, nullptr));
}

void cuda_synchronize(Device device, Stream stream) {
  int previous;
  CUDA_CHECK(cudaGetDevice(&previous));
  CUDA_CHECK(cudaSetDevice(device.index));
  CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream.handle)));
  CUDA_CHECK(cudaSetDevice(previous));
}

namespace {

// Makes `device` current for the scope of one call, restoring the caller's device after.
class DeviceScope {
 public:
  explicit DeviceScope(Device device) {
    CUDA_CHECK(cudaGetDevice(&previous_));
    CUDA_CHECK(cudaSetDevice(device.index));
  }
  ~DeviceScope() { cudaSetDevice(previous_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace

void cuda_stream_wait(Device device, Stream waiter, Stream producer) {
  DeviceScope scope(device);
  cudaEvent_t event;
  CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventRecord(event, static_cast<cudaStream_t>(producer.handle)));
  CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(waiter.handle), event, 0));
  CUDA_CHECK(cudaEventDestroy(event));  // released once the wait has passed
}

Stream cuda_stream_create(Device device) {
  DeviceScope scope(device);
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return Stream{stream};
}

void cuda_stream_destroy(Device device, Stream stream) {
  DeviceScope scope(device);
  cudaStreamDestroy(static_cast<cudaStream_t>(stream.handle));
}

}  // namespace braid::detail
