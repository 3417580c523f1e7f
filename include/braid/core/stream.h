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

// Orders `waiter` after the work queued on `producer` so far (an event recorded on producer,
// waited on by waiter; the host does not block). No-op on CPU, or when they are one stream.
void stream_wait(const Device& device, Stream waiter, Stream producer);

// A non-blocking CUDA stream of its own, destroyed with the object (the CPU: the null Stream,
// which ops ignore). Used to run communication beside the compute on the default stream.
class SideStream {
 public:
  explicit SideStream(const Device& device);
  ~SideStream();
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;
  Stream get() const { return stream_; }

 private:
  Device device_;
  Stream stream_;
};

}  // namespace braid
