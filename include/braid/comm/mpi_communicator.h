#pragma once
// MpiCommunicator: the Communicator for CPU tensors, over MPI (OpenMPI). It is also how every
// process finds the others: the NCCL communicator's unique id travels over it.
//
// Calls are MPI's non-blocking collectives (MPI_Iallreduce, ...); Work::wait polls MPI_Test
// until the deadline, which is also what drives their progress. MPI is initialised with
// MPI_THREAD_MULTIPLE (when the library provides it) so a communication thread may call it.

#include <mpi.h>

#include <memory>

#include "braid/comm/communicator.h"

namespace braid::comm {

class MpiCommunicator : public Communicator {
 public:
  // All processes of the job, named "world". Initialises MPI on first use (and finalises it
  // at exit if it did); collective over MPI_COMM_WORLD then. The same object on every call.
  static std::shared_ptr<MpiCommunicator> world();
  // Whether MPI is initialised with MPI_THREAD_MULTIPLE (a ProgressThread may poll it).
  static bool thread_multiple();
  ~MpiCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return Device::cpu(); }
  MPI_Comm handle() const { return comm_; }

  WorkPtr all_reduce(Tensor tensor, ReduceOp op = ReduceOp::sum, Stream stream = {}) override;
  WorkPtr all_reduce(const Tensor& input, Tensor output, ReduceOp op = ReduceOp::sum,
                     Stream stream = {}) override;
  WorkPtr reduce_scatter(const Tensor& input, Tensor output, ReduceOp op = ReduceOp::sum,
                         Stream stream = {}) override;
  WorkPtr all_gather(const Tensor& input, Tensor output, Stream stream = {}) override;
  WorkPtr broadcast(Tensor tensor, int root, Stream stream = {}) override;
  WorkPtr p2p(std::span<const P2POp> ops, Stream stream = {}) override;
  WorkPtr barrier() override;
  std::shared_ptr<Communicator> split(int color, int key, const std::string& name) override;

  // The MPI datatype of a braid dtype for transfers (bf16/f16: 16-bit unsigned integers).
  static MPI_Datatype datatype(DType dtype);

 private:
  MpiCommunicator(MPI_Comm comm, std::string name, Duration timeout, bool owned);
  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
  bool owned_;  // MPI_Comm_free on destruction (not for MPI_COMM_WORLD)
};

}  // namespace braid::comm
