// comm_bench's NCCL rows: NcclCommunicator (non-blocking communicator, a Work per call) against
// the raw NCCL calls on a second, blocking communicator over the same GPUs — what nccl-tests
// measures. Both issue `iters` operations back to back on one stream; braid then waits on its
// last Work, raw synchronises the stream.

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdio>
#include <cstring>

#include "braid/comm/nccl_communicator.h"
#include "braid/core/cuda_check.h"
#include "comm_bench.h"

namespace braid::bench {

namespace {

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32:
      return ncclFloat32;
    case DType::bf16:
      return ncclBfloat16;
    case DType::f16:
      return ncclFloat16;
    case DType::i32:
      return ncclInt32;
    case DType::i64:
      return ncclInt64;
    case DType::u8:
      break;
  }
  return ncclUint8;
}

ncclRedOp_t nccl_op(comm::ReduceOp op) {
  switch (op) {
    case comm::ReduceOp::sum:
      return ncclSum;
    case comm::ReduceOp::avg:
      return ncclAvg;
    case comm::ReduceOp::max:
      return ncclMax;
    case comm::ReduceOp::min:
      return ncclMin;
  }
  return ncclSum;
}

}  // namespace

void run_nccl(comm::MpiCommunicator& world, const comm::LaunchInfo& launch, const Options& opt) {
  const int device = comm::select_cuda_device(launch);
  const Device dev = Device::cuda(device);
  auto braid_comm = comm::NcclCommunicator::create(world, device, "bench", world.timeout());

  // The raw communicator: blocking, as nccl-tests makes it.
  ncclUniqueId id;
  if (world.rank() == 0) NCCL_CHECK(ncclGetUniqueId(&id));
  MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, world.handle());
  ncclComm_t raw = nullptr;
  NCCL_CHECK(ncclCommInitRank(&raw, world.size(), id, world.rank()));
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  const int n = world.size(), rank = world.rank();
  const int next = (rank + 1) % n, prev = (rank + n - 1) % n;
  const ncclDataType_t type = nccl_type(opt.dtype);
  const ncclRedOp_t redop = nccl_op(opt.op);
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  run_table(
      world, opt, std::string("NCCL (CUDA tensors, NcclCommunicator) on ") + prop.name, "raw NCCL",
      [&](Coll coll, const Shape& s) {
        const int64_t in_count = coll == Coll::all_gather ? s.chunk : s.count;
        const int64_t out_count = coll == Coll::reduce_scatter ? s.chunk : s.count;
        Tensor in = host_filled(opt.dtype, in_count, [&](int64_t i) {
                      return input_value(rank, i);
                    }).to(dev);
        Tensor out = Tensor::zeros({out_count}, opt.dtype, dev);
        Tensor raw_out = Tensor::zeros({out_count}, opt.dtype, dev);
        synchronize(dev);
        const Stream st{stream};
        auto last = std::make_shared<comm::WorkPtr>();
        auto issue = [&, in, out, st, last, coll] {
          switch (coll) {
            case Coll::all_reduce:
              *last = braid_comm->all_reduce(in, out, opt.op, st);
              return;
            case Coll::reduce_scatter:
              *last = braid_comm->reduce_scatter(in, out, opt.op, st);
              return;
            case Coll::all_gather:
              *last = braid_comm->all_gather(in, out, st);
              return;
            case Coll::sendrecv: {
              const comm::P2POp ops[] = {comm::P2POp::send(in, next), comm::P2POp::recv(out, prev)};
              *last = braid_comm->p2p(ops, st);
              return;
            }
          }
        };
        RowOps ops;
        ops.braid = issue;
        ops.braid_sync = [last] {
          if (*last) (*last)->wait();
          last->reset();
        };
        ops.raw = [=, &raw] {
          const void* send = in.data();
          void* recv = raw_out.data();
          switch (coll) {
            case Coll::all_reduce:
              NCCL_CHECK(ncclAllReduce(send, recv, size_t(s.count), type, redop, raw, stream));
              break;
            case Coll::reduce_scatter:
              NCCL_CHECK(ncclReduceScatter(send, recv, size_t(s.chunk), type, redop, raw, stream));
              break;
            case Coll::all_gather:
              NCCL_CHECK(ncclAllGather(send, recv, size_t(s.chunk), type, raw, stream));
              break;
            case Coll::sendrecv:
              NCCL_CHECK(ncclGroupStart());
              NCCL_CHECK(ncclSend(send, size_t(s.count), type, next, raw, stream));
              NCCL_CHECK(ncclRecv(recv, size_t(s.count), type, prev, raw, stream));
              NCCL_CHECK(ncclGroupEnd());
              break;
          }
        };
        ops.raw_sync = [stream] { CUDA_CHECK(cudaStreamSynchronize(stream)); };
        ops.check = [=, &world, &opt]() mutable {
          out.zero_();
          synchronize(dev);
          issue();
          (*last)->wait();
          last->reset();
          const Tensor host = out.to(Device::cpu());
          synchronize(dev);
          return count_wrong(host, [&](int64_t i) {
            return expected_value(coll, opt.op, world.size(), world.rank(), s, i);
          });
        };
        return ops;
      });

  CUDA_CHECK(cudaStreamSynchronize(stream));
  CUDA_CHECK(cudaStreamDestroy(stream));
  NCCL_CHECK(ncclCommDestroy(raw));
}

}  // namespace braid::bench
