// NcclCommunicator as a real MPI job (one GPU per rank): every collective × dtype × a few sizes
// × in/out-of-place against values computed here for every rank, p2p around the ring (to
// itself at world size 1), split, barrier, the caller's stream, bad arguments, and the
// deadline path (in a child process, since it ends the job). Without a CUDA device every test
// skips, unless BRAID_TEST_DEVICE=cuda makes that a failure.

#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "braid/comm/launch.h"
#include "braid/comm/nccl_communicator.h"
#include "test_devices.h"

namespace braid::comm {
namespace {

constexpr DType kDTypes[] = {DType::f32, DType::bf16, DType::f16, DType::i32, DType::i64};
constexpr ReduceOp kOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min};
// Per-rank element counts: empty, one, odd, and one large enough for NCCL's ring pipeline.
constexpr int64_t kCounts[] = {0, 1, 7, 1000, (1 << 20) + 3};

// What rank `rank` contributes at element `i`: small integers, exact in every dtype, different
// on every rank so that max and min are not trivial.
double value(int rank, int64_t i) { return double((i * 7 + rank * 3) % 11) - 5.0; }

Tensor host_tensor(DType dtype, int64_t n, const std::function<double(int64_t)>& f) {
  Tensor t = Tensor::empty({n}, dtype);
  for (int64_t i = 0; i < n; ++i) t.set_item(i, f(i));
  return t;
}

// The result of reducing value(r, i) over ranks 0..size-1.
double reduced(ReduceOp op, int size, int64_t i) {
  double acc = value(0, i);
  for (int r = 1; r < size; ++r) {
    const double v = value(r, i);
    acc = op == ReduceOp::max ? std::max(acc, v) : op == ReduceOp::min ? std::min(acc, v) : acc + v;
  }
  return op == ReduceOp::avg ? acc / size : acc;
}

// bf16/f16 sums are rounded at every step of NCCL's ring; the values here are small integers,
// so only avg (a division) is inexact.
double tolerance(DType dtype) {
  return dtype == DType::bf16 ? 1e-2 : dtype == DType::f16 ? 1e-3 : dtype == DType::f32 ? 1e-6 : 0;
}

Tensor to_host(const Tensor& device_tensor) {
  Tensor host = device_tensor.to(Device::cpu());
  synchronize(device_tensor.device());
  return host;
}

void expect_values(const Tensor& device_tensor, const std::function<double(int64_t)>& expected,
                   DType dtype) {
  const Tensor host = to_host(device_tensor);
  int64_t bad = 0;
  for (int64_t i = 0; i < host.numel(); ++i) {
    const double want = expected(i);
    if (std::abs(host.item(i) - want) > tolerance(dtype) * std::max(1.0, std::abs(want))) {
      if (++bad <= 3) ADD_FAILURE() << "element " << i << ": " << host.item(i) << ", want " << want;
    }
  }
  EXPECT_EQ(bad, 0) << "of " << host.numel() << " elements";
}

class NcclCommunicatorTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!cuda_available()) return;
    Distributed dist = init_distributed();
    device_ = select_cuda_device(dist.launch);
    comm_ = NcclCommunicator::create(*dist.world, device_);
  }
  static void TearDownTestSuite() { comm_.reset(); }

  void SetUp() override {
    if (!cuda_available()) {
      if (braid::testing::cuda_required()) FAIL() << "BRAID_TEST_DEVICE=cuda but no CUDA device";
      GTEST_SKIP() << "no CUDA device";
    }
    ASSERT_NE(comm_, nullptr);
  }

  static Tensor device_tensor(DType dtype, int64_t n, const std::function<double(int64_t)>& f) {
    Tensor t = host_tensor(dtype, n, f).to(Device::cuda(device_));
    synchronize(Device::cuda(device_));
    return t;
  }

  static inline std::shared_ptr<NcclCommunicator> comm_;
  static inline int device_ = 0;
};

TEST_F(NcclCommunicatorTest, Identity) {
  EXPECT_EQ(comm_->size(), init_distributed().world->size());
  EXPECT_EQ(comm_->rank(), init_distributed().world->rank());
  EXPECT_EQ(comm_->device(), Device::cuda(device_));
  EXPECT_EQ(comm_->name(), "world");
  EXPECT_EQ(comm_->timeout(), init_distributed().world->timeout());
  EXPECT_NE(comm_->handle(), nullptr);
}

TEST_F(NcclCommunicatorTest, AllReduce) {
  const int rank = comm_->rank(), size = comm_->size();
  for (DType dtype : kDTypes) {
    for (ReduceOp op : kOps) {
      if (op == ReduceOp::avg && !is_floating(dtype)) continue;
      for (int64_t n : kCounts) {
        for (bool in_place : {true, false}) {
          SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " " << reduce_op_name(op)
                                            << " n=" << n << (in_place ? " in place" : ""));
          Tensor input = device_tensor(dtype, n, [&](int64_t i) { return value(rank, i); });
          Tensor output = in_place ? input : device_tensor(dtype, n, [](int64_t) { return 99; });
          WorkPtr work =
              in_place ? comm_->all_reduce(input, op) : comm_->all_reduce(input, output, op);
          work->wait();
          EXPECT_TRUE(work->is_completed());
          work->wait();  // twice is allowed
          expect_values(
              output, [&](int64_t i) { return reduced(op, size, i); }, dtype);
          if (!in_place) {
            expect_values(
                input, [&](int64_t i) { return value(rank, i); }, dtype);
          }
        }
      }
    }
  }
}

TEST_F(NcclCommunicatorTest, ReduceScatter) {
  const int rank = comm_->rank(), size = comm_->size();
  for (DType dtype : kDTypes) {
    for (ReduceOp op : kOps) {
      if (op == ReduceOp::avg && !is_floating(dtype)) continue;
      for (int64_t n : kCounts) {
        for (bool in_place : {true, false}) {
          SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " " << reduce_op_name(op)
                                            << " n=" << n << (in_place ? " in place" : ""));
          Tensor input = device_tensor(dtype, n * size, [&](int64_t i) { return value(rank, i); });
          Tensor output = in_place ? input.slice(rank * n, {n})
                                   : device_tensor(dtype, n, [](int64_t) { return 99; });
          comm_->reduce_scatter(input, output, op)->wait();
          expect_values(
              output, [&](int64_t i) { return reduced(op, size, rank * n + i); }, dtype);
        }
      }
    }
  }
}

TEST_F(NcclCommunicatorTest, AllGather) {
  const int rank = comm_->rank(), size = comm_->size();
  for (DType dtype : kDTypes) {
    for (int64_t n : kCounts) {
      for (bool in_place : {true, false}) {
        SCOPED_TRACE(::testing::Message()
                     << dtype_name(dtype) << " n=" << n << (in_place ? " in place" : ""));
        // Rank r's block holds value(r, i); in place, the other blocks start as garbage.
        Tensor output = device_tensor(dtype, n * size, [&](int64_t i) {
          return i / std::max<int64_t>(n, 1) == rank ? value(rank, i % n) : 99;
        });
        Tensor input = in_place
                           ? output.slice(rank * n, {n})
                           : device_tensor(dtype, n, [&](int64_t i) { return value(rank, i); });
        if (!in_place) {
          output = device_tensor(dtype, n * size, [](int64_t) { return 99; });
        }
        comm_->all_gather(input, output)->wait();
        expect_values(
            output, [&](int64_t i) { return value(int(i / n), i % n); }, dtype);
      }
    }
  }
}

TEST_F(NcclCommunicatorTest, Broadcast) {
  const int rank = comm_->rank(), size = comm_->size();
  for (DType dtype : kDTypes) {
    for (int64_t n : kCounts) {
      for (int root = 0; root < size; ++root) {
        SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " n=" << n << " root " << root);
        Tensor t = device_tensor(dtype, n, [&](int64_t i) { return value(rank, i); });
        comm_->broadcast(t, root)->wait();
        expect_values(
            t, [&](int64_t i) { return value(root, i); }, dtype);
      }
    }
  }
}

TEST_F(NcclCommunicatorTest, RingExchange) {
  // Send to the next rank, receive from the previous one, in one group (at size 1: to itself).
  const int rank = comm_->rank(), size = comm_->size();
  const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
  for (DType dtype : kDTypes) {
    for (int64_t n : kCounts) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " n=" << n);
      Tensor send = device_tensor(dtype, n, [&](int64_t i) { return value(rank, i); });
      Tensor recv = device_tensor(dtype, n, [](int64_t) { return 99; });
      const P2POp ops[] = {P2POp::send(send, next), P2POp::recv(recv, prev)};
      WorkPtr work = comm_->p2p(ops);
      EXPECT_EQ(work->info().name, "p2p");
      EXPECT_EQ(work->info().bytes, 2 * send.nbytes());
      work->wait();
      expect_values(
          recv, [&](int64_t i) { return value(prev, i); }, dtype);
    }
  }
  const std::vector<P2POp> none;
  comm_->p2p(none)->wait();  // an empty batch completes
}

TEST_F(NcclCommunicatorTest, CallerStream) {
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const int rank = comm_->rank(), size = comm_->size();
  const int64_t n = 1 << 16;
  Tensor t = device_tensor(DType::f32, n, [&](int64_t i) { return value(rank, i); });
  WorkPtr first = comm_->all_reduce(t, ReduceOp::sum, Stream{stream});
  // A second collective on the same stream runs after the first without a host wait.
  WorkPtr second = comm_->all_reduce(t, ReduceOp::max, Stream{stream});
  second->wait();
  EXPECT_TRUE(first->is_completed());  // events on one stream pass in order
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  expect_values(
      t, [&](int64_t i) { return reduced(ReduceOp::sum, size, i); }, DType::f32);
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

TEST_F(NcclCommunicatorTest, Barrier) {
  WorkPtr work = comm_->barrier();
  EXPECT_EQ(work->info().name, "barrier");
  work->wait();
  EXPECT_TRUE(work->is_completed());
  comm_->barrier()->wait();
}

TEST_F(NcclCommunicatorTest, Split) {
  const int rank = comm_->rank(), size = comm_->size();
  // Two groups by parity, each ordered backwards (key = -rank).
  std::shared_ptr<Communicator> half = comm_->split(rank % 2, -rank, "parity");
  ASSERT_NE(half, nullptr);
  // The parent is usable at once: split() returns only when NCCL has released it (NCCL 2.28's
  // ncclCommSplit returns ncclSuccess while the parent is still busy with the split).
  comm_->barrier()->wait();
  std::vector<int> members;
  for (int r = rank % 2; r < size; r += 2) members.push_back(r);
  EXPECT_EQ(half->size(), int(members.size()));
  EXPECT_EQ(half->rank(), int(members.size()) - 1 - rank / 2);
  EXPECT_EQ(half->name(), "parity");
  EXPECT_EQ(half->timeout(), comm_->timeout());
  EXPECT_EQ(half->device(), comm_->device());
  Tensor t = device_tensor(DType::f32, 5, [&](int64_t i) { return value(rank, i); });
  half->all_reduce(t)->wait();
  expect_values(
      t,
      [&](int64_t i) {
        double sum = 0;
        for (int r : members) sum += value(r, i);
        return sum;
      },
      DType::f32);

  // Rank 0 stays out of the second split; everyone else forms one group.
  std::shared_ptr<Communicator> rest = comm_->split(rank == 0 ? -1 : 0, rank, "rest");
  if (rank == 0) {
    EXPECT_EQ(rest, nullptr);
  } else {
    ASSERT_NE(rest, nullptr);
    EXPECT_EQ(rest->size(), size - 1);
    EXPECT_EQ(rest->rank(), rank - 1);
    rest->barrier()->wait();
  }
  half.reset();
  rest.reset();
  comm_->barrier()->wait();  // the parent is unaffected by its children's destruction
}

TEST_F(NcclCommunicatorTest, BadArgumentsThrowAndLeaveTheCommunicatorUsable) {
  Tensor f32 = device_tensor(DType::f32, 4, [](int64_t) { return 1; });
  Tensor i32 = device_tensor(DType::i32, 4, [](int64_t) { return 1; });
  Tensor u8 = Tensor::zeros({4}, DType::u8, Device::cuda(device_));
  Tensor host = Tensor::zeros({4}, DType::f32);
  EXPECT_THROW(comm_->all_reduce(host), Error);
  EXPECT_THROW(comm_->all_reduce(u8), Error);
  EXPECT_THROW(comm_->all_reduce(i32, ReduceOp::avg), Error);
  EXPECT_THROW(comm_->all_reduce(f32, i32), Error);
  EXPECT_THROW(comm_->all_reduce(f32, f32.slice(0, {3})), Error);
  EXPECT_THROW(comm_->reduce_scatter(f32, f32.slice(0, {3})), Error);
  EXPECT_THROW(comm_->all_gather(f32, f32.slice(0, {3})), Error);
  EXPECT_THROW(comm_->broadcast(f32, comm_->size()), Error);
  EXPECT_THROW(comm_->send(f32, -1), Error);
  EXPECT_THROW(NcclCommunicator::create(*init_distributed().world, 1 << 20), Error);
  comm_->all_reduce(f32)->wait();
  expect_values(
      f32, [&](int64_t) { return comm_->size(); }, DType::f32);
}

// The deadline ends the job, so it runs in a child process (test_nccl_deadline_probe.cpp, a
// world of one without MPI): a collective stuck behind a blocked stream must abort it with
// the one-line message naming the collective, the group, its size, the bytes and the rank.
TEST_F(NcclCommunicatorTest, DeadlineAbortsWithAMessage) {
  if (comm_->rank() != 0) GTEST_SKIP() << "rank 0 runs the probe";
  const std::string command = std::string("ulimit -c 0; ") + BRAID_NCCL_DEADLINE_PROBE + " " +
                              std::to_string(device_) + " 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char buffer[512];
  while (fgets(buffer, sizeof(buffer), pipe) != nullptr) output += buffer;
  const int status = pclose(pipe);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_NE(WEXITSTATUS(status), 0) << output;
  EXPECT_EQ(output.find("wait returned"), std::string::npos) << output;
  EXPECT_NE(output.find("all_reduce on group 'deadline_probe' (size 1"), std::string::npos)
      << output;
  EXPECT_NE(output.find("4096 bytes"), std::string::npos) << output;
  EXPECT_NE(output.find("did not complete within"), std::string::npos) << output;
}

}  // namespace
}  // namespace braid::comm
