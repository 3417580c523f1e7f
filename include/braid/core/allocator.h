#pragma once
// Allocators. Every byte a Tensor owns comes from one of these, so their counters are
// the memory figures braid reports (current and peak bytes per device).

#include <cstddef>
#include <cstdint>
#include <string>

#include "braid/core/dtype.h"

namespace braid {

struct MemoryStats {
  int64_t current_bytes = 0;   // bytes handed out to tensors and not yet returned
  int64_t peak_bytes = 0;      // high-water mark of current_bytes since the last reset_peak
  int64_t reserved_bytes = 0;  // bytes held from the system (caching allocators hold more)
};

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(size_t nbytes) = 0;
  virtual void deallocate(void* ptr, size_t nbytes) = 0;
  virtual MemoryStats stats() const = 0;
  virtual void reset_peak() = 0;
  // Gives the free blocks it keeps for reuse back to the system (reserved_bytes drops to
  // current_bytes, or by what it cached).
  virtual void release_cached() = 0;
};

// The process-wide allocator for a device: 64-byte-aligned host memory on the CPU, a
// caching cudaMalloc allocator (never managed memory) on CUDA devices.
Allocator& allocator_for(Device device);

MemoryStats memory_stats(Device device);
void reset_peak_memory(Device device);
// The device allocator's Allocator::release_cached (torch.cuda.empty_cache(); Megatron's
// --empty-unused-memory-level). On CUDA it synchronizes the device first.
void empty_cache(Device device);

// True when braid was built with CUDA and at least one device is visible.
bool cuda_available();
int cuda_device_count();
// The device's name as the driver reports it ("NVIDIA H200"); ConfigError for a device that
// is not visible.
std::string cuda_device_name(int index);

}  // namespace braid
