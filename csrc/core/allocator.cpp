#include "braid/core/allocator.h"

#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <new>

#include "braid/core/error.h"
#include "device_runtime.h"

namespace braid {
namespace {

// Host memory, 64-byte aligned (one cache line; enough for AVX-512 loads).
//
// Large blocks (>= 1 MiB) are kept after they are freed and handed out again for a request
// of the same size class: a training step allocates the same activation shapes every
// iteration, and glibc returns blocks this large to the kernel at once, so without the cache
// every step pays page faults and zeroing for hundreds of MiB (the logits alone are
// tokens x vocab floats). At most kMaxCachedBytes stay cached; beyond that blocks go back.
class HostAllocator final : public Allocator {
 public:
  void* allocate(size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    size_t size = size_class(nbytes);
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = cached_.find(size);
      if (it != cached_.end()) {
        p = it->second;
        cached_.erase(it);
        cached_bytes_ -= int64_t(size);
      }
    }
    if (p == nullptr) p = std::aligned_alloc(64, size);
    if (p == nullptr) {  // give the cached blocks back and try once more
      release_cached();
      p = std::aligned_alloc(64, size);
    }
    BRAID_CHECK(p != nullptr, "host allocation of ", nbytes, " bytes failed (in use ",
                current_.load(), " bytes)");
    int64_t now = current_.fetch_add(int64_t(nbytes)) + int64_t(nbytes);
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    return p;
  }
  void deallocate(void* ptr, size_t nbytes) override {
    if (ptr == nullptr) return;
    current_.fetch_sub(int64_t(nbytes));
    size_t size = size_class(nbytes);
    if (size >= kMinCachedBytes) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (cached_bytes_ + int64_t(size) <= kMaxCachedBytes) {
        cached_.emplace(size, ptr);
        cached_bytes_ += int64_t(size);
        return;
      }
    }
    std::free(ptr);
  }
  MemoryStats stats() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    int64_t cur = current_.load();
    return {cur, peak_.load(), cur + cached_bytes_};
  }
  void reset_peak() override { peak_.store(current_.load()); }
  void release_cached() override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [size, ptr] : cached_) std::free(ptr);
    cached_.clear();
    cached_bytes_ = 0;
  }

 private:
  static constexpr size_t kMinCachedBytes = size_t(1) << 20;
  static constexpr int64_t kMaxCachedBytes = int64_t(2) << 30;

  // Small blocks: 64-byte multiples. Cached sizes: multiples of 64 KiB, so that shapes
  // that differ by a little (a shorter last batch) still reuse a block.
  static size_t size_class(size_t nbytes) {
    size_t granule = nbytes >= kMinCachedBytes ? (size_t(64) << 10) : 64;
    return (nbytes + granule - 1) / granule * granule;
  }

  std::atomic<int64_t> current_{0};
  std::atomic<int64_t> peak_{0};
  mutable std::mutex mutex_;
  std::multimap<size_t, void*> cached_;
  int64_t cached_bytes_ = 0;
};

}  // namespace

Allocator& allocator_for(Device device) {
  if (device.is_cpu()) {
    // Never destroyed: tensors held by other static objects may be freed after main().
    static HostAllocator* host = new HostAllocator;
    return *host;
  }
#ifdef BRAID_WITH_CUDA
  return detail::cuda_caching_allocator(device.index);
#else
  BRAID_FAIL("device ", device.str(),
             " requested, but braid was built without CUDA (BRAID_CUDA=OFF)");
#endif
}

MemoryStats memory_stats(Device device) { return allocator_for(device).stats(); }
void reset_peak_memory(Device device) { allocator_for(device).reset_peak(); }
void empty_cache(Device device) { allocator_for(device).release_cached(); }

int cuda_device_count() {
#ifdef BRAID_WITH_CUDA
  return detail::cuda_device_count();
#else
  return 0;
#endif
}

bool cuda_available() { return cuda_device_count() > 0; }

std::string cuda_device_name(int index) {
  const int count = cuda_device_count();
  BRAID_CONFIG_CHECK(index >= 0 && index < count, "cuda:", index, " requested, but ", count,
                     " CUDA device(s) are visible");
#ifdef BRAID_WITH_CUDA
  return detail::cuda_device_name(index);
#else
  return "";
#endif
}

}  // namespace braid
