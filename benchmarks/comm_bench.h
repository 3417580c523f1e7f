#pragma once
// comm_bench's shared harness: the options, the per-size measurement that alternates braid and
// the raw library call, and the nccl-tests-style table. comm_bench.cpp drives MPI;
// comm_bench_nccl.cpp (CUDA builds) drives NCCL.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "braid/comm/launch.h"

namespace braid::bench {

enum class Coll { all_reduce, reduce_scatter, all_gather, sendrecv };
const char* coll_name(Coll c);

struct Options {
  int64_t min_bytes = 8;
  int64_t max_bytes = int64_t(128) << 20;
  double factor = 2.0;
  int iters = 20;
  int warmup = 5;
  int rounds = 5;  // braid and raw alternate this many times per size; the best round counts
  DType dtype = DType::f32;
  comm::ReduceOp op = comm::ReduceOp::sum;
  std::vector<Coll> colls = {Coll::all_reduce, Coll::reduce_scatter, Coll::all_gather,
                             Coll::sendrecv};
  std::string transports = "all";  // mpi, nccl or all (nccl only where a GPU is visible)
  bool check = true;
  // MPI's raw baseline: blocking calls (MPI_Allreduce, ...: what a program would write) or the
  // non-blocking ones braid itself issues (MPI_Iallreduce + MPI_Wait: braid's own cost only).
  // OpenMPI runs the two through different components (coll/tuned vs coll/libnbc).
  bool raw_nonblocking = false;
};

// Element counts of one row: `count` is nccl-tests' count (elements of the larger buffer),
// `chunk` the per-rank block of reduce_scatter / all_gather (count / ranks).
struct Shape {
  int64_t count = 0;
  int64_t chunk = 0;
  size_t bytes = 0;  // count × element size: the row's "size"
};
Shape shape_for(Coll coll, int64_t bytes, DType dtype, int ranks);  // count 0: skip the row

// One row's operations. `braid` and `raw` each issue one operation; `sync` after each timed
// batch makes sure everything issued has completed (CUDA: braid waits its last Work, raw
// synchronises the stream). `raw` may be empty when the raw library has no such call.
struct RowOps {
  std::function<void()> braid, braid_sync, raw, raw_sync;
  std::function<int64_t()> check;  // runs braid once on fresh inputs; elements that are wrong
};

struct RowTimes {
  double braid_us = 0, raw_us = 0;  // per operation; raw_us 0: no raw call
};

// Warm-up, then `rounds` rounds of `iters` back-to-back operations for braid and raw, in
// alternating order. Each round's time is the slowest rank's; a row keeps its best round.
RowTimes measure(comm::MpiCommunicator& world, const Options& opt, const RowOps& ops);

// The table on rank 0; `run_transport` builds the RowOps of one (collective, shape).
void run_table(comm::MpiCommunicator& world, const Options& opt, const std::string& transport,
               const std::string& raw_name,
               const std::function<RowOps(Coll, const Shape&)>& make_row);

// The value rank `rank` contributes at element `i`, and what each collective should produce:
// small integers, exact in every dtype.
double input_value(int rank, int64_t i);
double expected_value(Coll coll, comm::ReduceOp op, int ranks, int rank, const Shape& s, int64_t i);
Tensor host_filled(DType dtype, int64_t n, const std::function<double(int64_t)>& f);
int64_t count_wrong(const Tensor& host_result, const std::function<double(int64_t)>& expected);

// Defined in comm_bench_nccl.cpp (CUDA builds).
void run_nccl(comm::MpiCommunicator& world, const comm::LaunchInfo& launch, const Options& opt);

}  // namespace braid::bench
