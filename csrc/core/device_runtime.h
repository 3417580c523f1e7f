#pragma once
// Internal: the few device-runtime calls core needs, implemented for the CPU in
// tensor.cpp and for CUDA in csrc/core/cuda/device_runtime.cu.

#include <cstddef>
#include <string>

#include "braid/core/allocator.h"
#include "braid/core/stream.h"

namespace braid::detail {

#ifdef BRAID_WITH_CUDA
Allocator& cuda_caching_allocator(int device_index);
int cuda_device_count();
std::string cuda_device_name(int index);
// Copies between any two of host and CUDA memory; asynchronous on the default stream.
void cuda_copy(void* dst, Device dst_device, const void* src, Device src_device, size_t nbytes);
void cuda_zero(void* ptr, Device device, size_t nbytes);
void cuda_synchronize(Device device, Stream stream);
void cuda_stream_wait(Device device, Stream waiter, Stream producer);
Stream cuda_stream_create(Device device);
void cuda_stream_destroy(Device device, Stream stream);
#endif

}  // namespace braid::detail
