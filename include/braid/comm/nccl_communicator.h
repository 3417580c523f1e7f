#pragma once
// NcclCommunicator: the Communicator for CUDA tensors, over NCCL. Built only with CUDA
// (BRAID_WITH_CUDA); its creation is collective over a CPU communicator that carries NCCL's
// unique id (an MpiCommunicator in practice).
//
// NCCL communicators are created non-blocking (ncclConfig_t::blocking = 0), so that no NCCL
// call can hang the host: every call that answers ncclInProgress is polled with
// ncclCommGetAsyncError against the communicator's timeout, and a stuck collective can be
// aborted (ncclCommAbort) before the job is ended (see communicator.h, "Deadlines").
//
// Streams: a collective is enqueued on the caller's stream (Stream{cudaStream_t}; nullptr is
// the legacy default stream) and its Work records a CUDA event after it. Work::wait blocks the
// host until that event has passed; to order later GPU work after a collective, enqueue it on
// the same stream (no host wait needed). A Work keeps its tensors alive until it has been
// seen complete: keep it until then, since freed device memory may be reused at once.
//
// barrier() all-reduces one int on the communicator's own stream: waiting on its Work is a
// host-side rendezvous of the ranks; it does not order GPU work queued on other streams.
//
// Not thread-safe against concurrent calls on one communicator from several threads beyond
// what NCCL allows: calls are serialised by an internal mutex; Works may be waited on from
// any thread.

#include <memory>
#include <string>

#include "braid/comm/communicator.h"

struct ncclComm;  // nccl.h: typedef struct ncclComm* ncclComm_t

namespace braid::comm {

class NcclCommunicator : public Communicator {
 public:
  // Collective over `bootstrap` (a CPU communicator): its rank 0 makes NCCL's unique id and
  // broadcasts it; each rank becomes the same rank of a new NCCL communicator on CUDA device
  // `cuda_device`. The name and timeout are the bootstrap's unless given.
  static std::shared_ptr<NcclCommunicator> create(Communicator& bootstrap, int cuda_device);
  static std::shared_ptr<NcclCommunicator> create(Communicator& bootstrap, int cuda_device,
                                                  const std::string& name, Duration timeout);

  // Without a bootstrap: `unique_id` (ncclUniqueId's 128 bytes, made by unique_id() on one
  // process and carried to the others by any means) identifies the communicator. A world of
  // size 1 needs nothing else.
  static std::string unique_id();
  static std::shared_ptr<NcclCommunicator> create(const std::string& unique_id, int rank, int size,
                                                  int cuda_device, const std::string& name,
                                                  Duration timeout);

  ~NcclCommunicator() override;  // finalises (polled against the timeout), then destroys

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return Device::cuda(cuda_device_); }
  ncclComm* handle() const;

  WorkPtr all_reduce(Tensor tensor, ReduceOp op = ReduceOp::sum, Stream stream = {}) override;
  WorkPtr all_reduce(const Tensor& input, Tensor output, ReduceOp op = ReduceOp::sum,
                     Stream stream = {}) override;
  WorkPtr reduce_scatter(const Tensor& input, Tensor output, ReduceOp op = ReduceOp::sum,
                         Stream stream = {}) override;
  WorkPtr all_gather(const Tensor& input, Tensor output, Stream stream = {}) override;
  WorkPtr broadcast(Tensor tensor, int root, Stream stream = {}) override;
  WorkPtr p2p(std::span<const P2POp> ops, Stream stream = {}) override;
  WorkPtr barrier() override;
  // ncclCommSplit; color < 0 is NCCL_SPLIT_NOCOLOR and returns nullptr.
  std::shared_ptr<Communicator> split(int color, int key, const std::string& name) override;

  struct State;  // the NCCL handle, shared with the Works still in flight

 private:
  NcclCommunicator(std::shared_ptr<State> state, std::string name, Duration timeout);
  std::shared_ptr<State> state_;
  int rank_ = 0;
  int size_ = 1;
  int cuda_device_ = 0;
};

}  // namespace braid::comm
