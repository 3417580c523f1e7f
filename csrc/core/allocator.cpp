#include "braid/core/allocator.h"

#include <atomic>
#include <cstdlib>
#include <new>

#include "braid/core/error.h"
#include "device_runtime.h"

namespace braid {
namespace {

// Host memory, 64-byte aligned (one cache line; enough for AVX-512 loads).
class HostAllocator final : public Allocator {
 public:
  void* allocate(size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    size_t rounded = (nbytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded);
    BRAID_CHECK(p != nullptr, "host allocation of ", nbytes, " bytes failed");
    int64_t now = current_.fetch_add(int64_t(nbytes)) + int64_t(nbytes);
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    return p;
  }
  void deallocate(void* ptr, size_t nbytes) override {
    if (ptr == nullptr) return;
    std::free(ptr);
    current_.fetch_sub(int64_t(nbytes));
  }
  MemoryStats stats() const override {
    int64_t cur = current_.load();
    return {cur, peak_.load(), cur};
  }
  void reset_peak() override { peak_.store(current_.load()); }

 private:
  std::atomic<int64_t> current_{0};
  std::atomic<int64_t> peak_{0};
};

}  // namespace

Allocator& allocator_for(Device device) {
  if (device.is_cpu()) {
    static HostAllocator host;
    return host;
  }
#ifdef BRAID_WITH_CUDA
  return detail::cuda_caching_allocator(device.index);
#else
  BRAID_FAIL("device ", device.str(), " requested, but braid was built without CUDA (BRAID_CUDA=OFF)");
#endif
}

MemoryStats memory_stats(Device device) { return allocator_for(device).stats(); }
void reset_peak_memory(Device device) { allocator_for(device).reset_peak(); }

int cuda_device_count() {
#ifdef BRAID_WITH_CUDA
  return detail::cuda_device_count();
#else
  return 0;
#endif
}

bool cuda_available() { return cuda_device_count() > 0; }

}  // namespace braid
