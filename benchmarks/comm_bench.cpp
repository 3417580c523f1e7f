// comm_bench: braid's collectives against the raw library calls they wrap, measured in the
// same run, in the table nccl-tests prints (size, count, type, redop, time, algbw, busbw).
//
//   mpirun -np 4 build/benchmarks/comm_bench -b 8 -e 128M -f 2 -n 20 -w 5 -d float
//
// Transports: MPI on CPU tensors (MpiCommunicator vs MPI_Allreduce, MPI_Reduce_scatter_block,
// MPI_Allgather, MPI_Sendrecv on the same MPI communicator) and, where a GPU is visible, NCCL
// (NcclCommunicator vs ncclAllReduce, ... on a separate blocking NCCL communicator).
// Bus bandwidth uses nccl-tests' factors: all_reduce 2(n-1)/n, reduce_scatter and all_gather
// (n-1)/n, sendrecv 1. "overhead" is braid's time over raw's, minus one.

#include "comm_bench.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "braid/core/error.h"

namespace braid::bench {

const char* coll_name(Coll c) {
  switch (c) {
    case Coll::all_reduce:
      return "all_reduce";
    case Coll::reduce_scatter:
      return "reduce_scatter";
    case Coll::all_gather:
      return "all_gather";
    case Coll::sendrecv:
      return "sendrecv";
  }
  return "?";
}

namespace {

const char* nccl_tests_type(DType t) {
  switch (t) {
    case DType::f32:
      return "float";
    case DType::bf16:
      return "bfloat16";
    case DType::f16:
      return "half";
    case DType::i32:
      return "int32";
    case DType::i64:
      return "int64";
    case DType::u8:
      return "uint8";
  }
  return "?";
}

bool is_reduction(Coll c) { return c == Coll::all_reduce || c == Coll::reduce_scatter; }

double bus_factor(Coll c, int n) {
  switch (c) {
    case Coll::all_reduce:
      return 2.0 * (n - 1) / n;
    case Coll::reduce_scatter:
    case Coll::all_gather:
      return double(n - 1) / n;
    case Coll::sendrecv:
      return 1.0;
  }
  return 1.0;
}

int64_t parse_bytes(std::string_view text) {
  char* end = nullptr;
  const std::string s(text);
  const double value = std::strtod(s.c_str(), &end);
  int64_t scale = 1;
  switch (end != nullptr ? *end : '\0') {
    case 'K':
    case 'k':
      scale = int64_t(1) << 10;
      break;
    case 'M':
    case 'm':
      scale = int64_t(1) << 20;
      break;
    case 'G':
    case 'g':
      scale = int64_t(1) << 30;
      break;
    case '\0':
      break;
    default:
      BRAID_CONFIG_CHECK(false, "comm_bench: '", text, "' is not a byte count (8, 64K, 128M, 1G)");
  }
  BRAID_CONFIG_CHECK(value > 0, "comm_bench: '", text, "' must be positive");
  return int64_t(value * double(scale));
}

DType parse_dtype(std::string_view name) {
  if (name == "float" || name == "f32") return DType::f32;
  if (name == "half" || name == "f16") return DType::f16;
  if (name == "bfloat16" || name == "bf16") return DType::bf16;
  if (name == "int32" || name == "i32") return DType::i32;
  if (name == "int64" || name == "i64") return DType::i64;
  BRAID_CONFIG_CHECK(false, "comm_bench: -d ", name, ": float, half, bfloat16, int32 or int64");
  return DType::f32;
}

comm::ReduceOp parse_op(std::string_view name) {
  if (name == "sum") return comm::ReduceOp::sum;
  if (name == "avg") return comm::ReduceOp::avg;
  if (name == "max") return comm::ReduceOp::max;
  if (name == "min") return comm::ReduceOp::min;
  BRAID_CONFIG_CHECK(false, "comm_bench: -o ", name, ": sum, avg, max or min");
  return comm::ReduceOp::sum;
}

std::vector<Coll> parse_colls(std::string_view list) {
  std::vector<Coll> out;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t end = std::min(list.find(',', start), list.size());
    const std::string_view item = list.substr(start, end - start);
    bool known = false;
    for (Coll c : {Coll::all_reduce, Coll::reduce_scatter, Coll::all_gather, Coll::sendrecv}) {
      if (item == coll_name(c)) {
        out.push_back(c);
        known = true;
      }
    }
    BRAID_CONFIG_CHECK(known, "comm_bench: --colls ", item,
                       ": all_reduce, reduce_scatter, all_gather or sendrecv");
    start = end + 1;
  }
  return out;
}

constexpr const char* kUsage =
    "usage: comm_bench [-b MINBYTES] [-e MAXBYTES] [-f FACTOR] [-n ITERS] [-w WARMUP]\n"
    "                  [-r ROUNDS] [-d float|half|bfloat16|int32|int64] [-o sum|avg|max|min]\n"
    "                  [-c 0|1] [--colls all_reduce,reduce_scatter,all_gather,sendrecv]\n"
    "                  [--transport mpi|nccl|all] [--mpi-raw blocking|nonblocking]\n"
    "                  [--distributed-timeout-minutes M]\n";

struct Parsed {
  Options opt;
  double timeout_minutes = 10.0;
};

Parsed parse_args(int argc, char** argv) {
  Parsed p;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    BRAID_CONFIG_CHECK(i + 1 < argc, "comm_bench: ", a, " needs a value\n", kUsage);
    const std::string_view v = argv[++i];
    const std::string vs(v);
    if (a == "-b") {
      p.opt.min_bytes = parse_bytes(v);
    } else if (a == "-e") {
      p.opt.max_bytes = parse_bytes(v);
    } else if (a == "-f") {
      p.opt.factor = std::atof(vs.c_str());
    } else if (a == "-n") {
      p.opt.iters = std::atoi(vs.c_str());
    } else if (a == "-w") {
      p.opt.warmup = std::atoi(vs.c_str());
    } else if (a == "-r") {
      p.opt.rounds = std::atoi(vs.c_str());
    } else if (a == "-d") {
      p.opt.dtype = parse_dtype(v);
    } else if (a == "-o") {
      p.opt.op = parse_op(v);
    } else if (a == "-c") {
      p.opt.check = v != "0";
    } else if (a == "--colls") {
      p.opt.colls = parse_colls(v);
    } else if (a == "--transport") {
      BRAID_CONFIG_CHECK(v == "mpi" || v == "nccl" || v == "all", "comm_bench: --transport ", v,
                         ": mpi, nccl or all");
      p.opt.transports = vs;
    } else if (a == "--mpi-raw") {
      BRAID_CONFIG_CHECK(v == "blocking" || v == "nonblocking", "comm_bench: --mpi-raw ", v,
                         ": blocking or nonblocking");
      p.opt.raw_nonblocking = v == "nonblocking";
    } else if (a == "--distributed-timeout-minutes") {
      p.timeout_minutes = std::atof(vs.c_str());
    } else {
      BRAID_CONFIG_CHECK(false, "comm_bench: unknown option ", a, "\n", kUsage);
    }
  }
  BRAID_CONFIG_CHECK(p.opt.factor > 1.0, "comm_bench: -f must be above 1");
  BRAID_CONFIG_CHECK(p.opt.iters >= 1 && p.opt.warmup >= 0 && p.opt.rounds >= 1,
                     "comm_bench: -n and -r must be at least 1, -w at least 0");
  BRAID_CONFIG_CHECK(p.opt.min_bytes <= p.opt.max_bytes, "comm_bench: -b is above -e");
  BRAID_CONFIG_CHECK(p.opt.op != comm::ReduceOp::avg || is_floating(p.opt.dtype),
                     "comm_bench: -o avg needs a floating dtype");
  return p;
}

// ---- MPI ---------------------------------------------------------------------------------------

MPI_Op mpi_op(comm::ReduceOp op) {
  return op == comm::ReduceOp::max ? MPI_MAX : op == comm::ReduceOp::min ? MPI_MIN : MPI_SUM;
}

RowOps mpi_row(comm::MpiCommunicator& world, const Options& opt, Coll coll, const Shape& s) {
  const int n = world.size(), rank = world.rank();
  const int next = (rank + 1) % n, prev = (rank + n - 1) % n;
  const DType dt = opt.dtype;
  const int64_t in_count = coll == Coll::all_gather ? s.chunk : s.count;
  const int64_t out_count = coll == Coll::reduce_scatter ? s.chunk : s.count;
  Tensor in = host_filled(dt, in_count, [&](int64_t i) { return input_value(rank, i); });
  Tensor out = Tensor::zeros({out_count}, dt);
  Tensor raw_in = in.clone();
  Tensor raw_out = Tensor::zeros({out_count}, dt);
  const MPI_Comm c = world.handle();
  const MPI_Datatype type = comm::MpiCommunicator::datatype(dt);
  // MPI reduces no 16-bit floats and has no avg: no raw reduction then.
  const bool raw_ok = !is_reduction(coll) ||
                      (!(dt == DType::bf16 || dt == DType::f16) && opt.op != comm::ReduceOp::avg);
  RowOps ops;
  auto run_braid = [&world, coll, in, out, next, prev, op = opt.op]() {
    switch (coll) {
      case Coll::all_reduce:
        return world.all_reduce(in, out, op);
      case Coll::reduce_scatter:
        return world.reduce_scatter(in, out, op);
      case Coll::all_gather:
        return world.all_gather(in, out);
      case Coll::sendrecv:
        break;
    }
    const comm::P2POp p2p[] = {comm::P2POp::send(in, next), comm::P2POp::recv(out, prev)};
    return world.p2p(p2p);
  };
  ops.braid = [run_braid] { run_braid()->wait(); };
  ops.braid_sync = [] {};
  if (raw_ok) {
    ops.raw = [=, nb = opt.raw_nonblocking] {
      void* send = raw_in.data();
      void* recv = raw_out.data();
      const MPI_Op mop = mpi_op(opt.op);
      MPI_Request req[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
      switch (coll) {
        case Coll::all_reduce:
          if (nb) {
            MPI_Iallreduce(send, recv, int(s.count), type, mop, c, req);
          } else {
            MPI_Allreduce(send, recv, int(s.count), type, mop, c);
          }
          break;
        case Coll::reduce_scatter:
          if (nb) {
            MPI_Ireduce_scatter_block(send, recv, int(s.chunk), type, mop, c, req);
          } else {
            MPI_Reduce_scatter_block(send, recv, int(s.chunk), type, mop, c);
          }
          break;
        case Coll::all_gather:
          if (nb) {
            MPI_Iallgather(send, int(s.chunk), type, recv, int(s.chunk), type, c, req);
          } else {
            MPI_Allgather(send, int(s.chunk), type, recv, int(s.chunk), type, c);
          }
          break;
        case Coll::sendrecv:
          if (nb) {
            MPI_Irecv(recv, int(s.count), type, prev, 7, c, &req[0]);
            MPI_Isend(send, int(s.count), type, next, 7, c, &req[1]);
          } else {
            MPI_Sendrecv(send, int(s.count), type, next, 7, recv, int(s.count), type, prev, 7, c,
                         MPI_STATUS_IGNORE);
          }
          break;
      }
      if (nb) MPI_Waitall(2, req, MPI_STATUSES_IGNORE);
    };
    ops.raw_sync = [] {};
  }
  ops.check = [=, &world]() mutable {
    out.zero_();
    run_braid()->wait();
    return count_wrong(out, [&](int64_t i) {
      return expected_value(coll, opt.op, world.size(), world.rank(), s, i);
    });
  };
  return ops;
}

}  // namespace

// ---- shared harness ----------------------------------------------------------------------------

Shape shape_for(Coll coll, int64_t bytes, DType dtype, int ranks) {
  Shape s;
  const int64_t elements = bytes / int64_t(dtype_size(dtype));
  if (coll == Coll::reduce_scatter || coll == Coll::all_gather) {
    s.chunk = elements / ranks;
    s.count = s.chunk * ranks;
  } else {
    s.count = elements;
    s.chunk = elements;
  }
  s.bytes = size_t(s.count) * dtype_size(dtype);
  return s;
}

double input_value(int rank, int64_t i) { return double((i + 3 * rank) % 7); }

double expected_value(Coll coll, comm::ReduceOp op, int ranks, int rank, const Shape& s,
                      int64_t i) {
  const int prev = (rank + ranks - 1) % ranks;
  switch (coll) {
    case Coll::sendrecv:
      return input_value(prev, i);
    case Coll::all_gather:
      return input_value(int(i / s.chunk), i % s.chunk);
    case Coll::all_reduce:
    case Coll::reduce_scatter:
      break;
  }
  const int64_t j = coll == Coll::reduce_scatter ? rank * s.chunk + i : i;
  double acc = input_value(0, j);
  for (int r = 1; r < ranks; ++r) {
    const double v = input_value(r, j);
    acc = op == comm::ReduceOp::max   ? std::max(acc, v)
          : op == comm::ReduceOp::min ? std::min(acc, v)
                                      : acc + v;
  }
  return op == comm::ReduceOp::avg ? acc / ranks : acc;
}

Tensor host_filled(DType dtype, int64_t n, const std::function<double(int64_t)>& f) {
  Tensor t = Tensor::empty({n}, dtype);
  for (int64_t i = 0; i < n; ++i) t.set_item(i, f(i));
  return t;
}

int64_t count_wrong(const Tensor& host_result, const std::function<double(int64_t)>& expected) {
  const double tol = host_result.dtype() == DType::bf16 ? 1e-2 : 1e-3;
  int64_t wrong = 0;
  for (int64_t i = 0; i < host_result.numel(); ++i) {
    const double want = expected(i);
    if (std::abs(host_result.item(i) - want) > tol * std::max(1.0, std::abs(want))) ++wrong;
  }
  return wrong;
}

RowTimes measure(comm::MpiCommunicator& world, const Options& opt, const RowOps& ops) {
  const MPI_Comm c = world.handle();
  auto timed = [&](const std::function<void()>& op, const std::function<void()>& sync) {
    MPI_Barrier(c);
    const double t0 = MPI_Wtime();
    for (int i = 0; i < opt.iters; ++i) op();
    sync();
    double us = (MPI_Wtime() - t0) * 1e6 / opt.iters;
    MPI_Allreduce(MPI_IN_PLACE, &us, 1, MPI_DOUBLE, MPI_MAX, c);  // the slowest rank
    return us;
  };
  for (int i = 0; i < opt.warmup; ++i) {
    ops.braid();
    if (ops.raw) ops.raw();
  }
  ops.braid_sync();
  if (ops.raw) ops.raw_sync();
  RowTimes best{1e300, ops.raw ? 1e300 : 0.0};
  for (int r = 0; r < opt.rounds; ++r) {
    const bool braid_first = r % 2 == 0;
    for (int k = 0; k < 2; ++k) {
      if ((k == 0) == braid_first) {
        best.braid_us = std::min(best.braid_us, timed(ops.braid, ops.braid_sync));
      } else if (ops.raw) {
        best.raw_us = std::min(best.raw_us, timed(ops.raw, ops.raw_sync));
      }
    }
  }
  return best;
}

void run_table(comm::MpiCommunicator& world, const Options& opt, const std::string& transport,
               const std::string& raw_name,
               const std::function<RowOps(Coll, const Shape&)>& make_row) {
  const int n = world.size();
  const bool print = world.rank() == 0;
  if (print) {
    std::printf(
        "# %s: %d ranks, %d iters x best of %d alternating rounds, %d warm-up; time is "
        "the slowest rank's mean\n",
        transport.c_str(), n, opt.iters, opt.rounds, opt.warmup);
  }
  for (Coll coll : opt.colls) {
    if (print) {
      std::printf("#\n# %s: braid vs %s\n", coll_name(coll), raw_name.c_str());
      std::printf("# %10s %11s %8s %6s | %10s %8s %8s | %10s %8s %8s | %8s %6s\n", "size(B)",
                  "count", "type", "redop", "braid(us)", "algbw", "busbw", "raw(us)", "algbw",
                  "busbw", "overhead", "#wrong");
    }
    double big_sum = 0, big_max = -1e300;
    int big_rows = 0;
    for (double b = double(opt.min_bytes); b <= double(opt.max_bytes) * (1 + 1e-9);
         b *= opt.factor) {
      const Shape s = shape_for(coll, int64_t(b), opt.dtype, n);
      if (s.count == 0) continue;
      const RowOps ops = make_row(coll, s);
      const RowTimes t = measure(world, opt, ops);
      int64_t wrong = 0;
      if (opt.check) {
        wrong = ops.check();
        MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_INT64_T, MPI_SUM, world.handle());
      }
      if (!print) continue;
      const double gb = double(s.bytes) / 1e9;
      const double f = bus_factor(coll, n);
      const char* redop = is_reduction(coll) ? comm::reduce_op_name(opt.op) : "none";
      std::printf("  %10zu %11lld %8s %6s | %10.1f %8.3f %8.3f |", s.bytes, (long long)s.count,
                  nccl_tests_type(opt.dtype), redop, t.braid_us, gb / (t.braid_us * 1e-6),
                  gb / (t.braid_us * 1e-6) * f);
      if (t.raw_us > 0) {
        const double overhead = t.braid_us / t.raw_us - 1.0;
        std::printf(" %10.1f %8.3f %8.3f | %+7.1f%% %6lld\n", t.raw_us, gb / (t.raw_us * 1e-6),
                    gb / (t.raw_us * 1e-6) * f, overhead * 100, (long long)wrong);
        if (s.bytes >= (size_t(1) << 20)) {
          big_sum += overhead;
          big_max = std::max(big_max, overhead);
          ++big_rows;
        }
      } else {
        std::printf(" %10s %8s %8s | %8s %6lld\n", "n/a", "", "", "", (long long)wrong);
      }
      std::fflush(stdout);
    }
    if (print && big_rows > 0) {
      std::printf("# %s overhead at >= 1 MiB: mean %+.1f%%, max %+.1f%% (%d sizes)\n",
                  coll_name(coll), big_sum / big_rows * 100, big_max * 100, big_rows);
    }
  }
}

#if !BRAID_WITH_CUDA
void run_nccl(comm::MpiCommunicator& world, const comm::LaunchInfo&, const Options&) {
  if (world.rank() == 0) std::printf("# NCCL: not built (BRAID_CUDA=OFF)\n");
}
#endif

}  // namespace braid::bench

int main(int argc, char** argv) {
  using namespace braid;
  return comm::run_main([&] {
    const auto parsed = bench::parse_args(argc, argv);
    const bench::Options& opt = parsed.opt;
    comm::Distributed dist =
        comm::init_distributed(comm::timeout_from_minutes(parsed.timeout_minutes));
    comm::MpiCommunicator& world = *dist.world;
    if (world.rank() == 0) {
      std::printf("# braid comm_bench: %d ranks (%s), -b %lld -e %lld -f %g -n %d -w %d -r %d\n",
                  world.size(), dist.launch.launcher.c_str(), (long long)opt.min_bytes,
                  (long long)opt.max_bytes, opt.factor, opt.iters, opt.warmup, opt.rounds);
    }
    if (opt.transports != "nccl") {
      bench::run_table(
          world, opt, "MPI (CPU tensors, MpiCommunicator)",
          opt.raw_nonblocking ? "raw non-blocking MPI (MPI_I* + MPI_Waitall)" : "raw blocking MPI",
          [&](bench::Coll coll, const bench::Shape& s) {
            return bench::mpi_row(world, opt, coll, s);
          });
    }
    if (opt.transports != "mpi") {
      if (cuda_available()) {
        bench::run_nccl(world, dist.launch, opt);
      } else if (world.rank() == 0) {
        std::printf("#\n# NCCL: skipped, no CUDA device visible\n");
      }
    }
    return 0;
  });
}
