// A child process of test_nccl_communicator.cpp's deadline test: an NCCL world of one (no MPI)
// whose all-reduce is queued behind a host function that blocks the stream for 5 s, waited on
// with a 300 ms timeout. The wait must not return: it aborts NCCL and ends the process with
// the deadline message. Usage: test_nccl_deadline_probe CUDA_DEVICE
//
// Only the wait has the short deadline: creating the communicator takes NCCL over 300 ms on an
// H200 (topology discovery, buffers), which then ended the probe in nccl_init instead.

#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "braid/comm/nccl_communicator.h"

int main(int argc, char** argv) {
  using namespace braid;
  const int device = argc > 1 ? std::atoi(argv[1]) : 0;
  if (!cuda_available()) {
    std::fprintf(stderr, "probe: no CUDA device\n");
    return 0;  // the parent test expects a failure exit: this is a failure for it
  }
  auto comm = comm::NcclCommunicator::create(comm::NcclCommunicator::unique_id(), 0, 1, device,
                                             "deadline_probe", std::chrono::minutes(2));
  if (cudaSetDevice(device) != cudaSuccess) return 3;
  cudaStream_t stream = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) return 3;
  Tensor t = Tensor::zeros({1024}, DType::f32, Device::cuda(device));
  synchronize(Device::cuda(device));
  auto block = [](void*) { std::this_thread::sleep_for(std::chrono::seconds(5)); };
  if (cudaLaunchHostFunc(stream, block, nullptr) != cudaSuccess) return 3;
  comm::WorkPtr work = comm->all_reduce(t, comm::ReduceOp::sum, Stream{stream});
  work->wait(std::chrono::milliseconds(300));
  std::fprintf(stderr, "probe: wait returned\n");
  return 0;
}
