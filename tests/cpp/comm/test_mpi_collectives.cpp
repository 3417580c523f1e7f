// Every collective of the MPI communicator × dtype × size × in-place/out-of-place, checked
// exactly against values computed locally (integer-valued data, as nccl-tests does), on the
// world and — with 8 ranks — on the TP, DP and PP groups of a 2×2×2 grid.

#include <gtest/gtest.h>

#include <array>
#include <cmath>

#include "braid/comm/launch.h"
#include "braid/comm/parallel_state.h"

using namespace braid;
using namespace braid::comm;

namespace {

const DType kDTypes[] = {DType::f32, DType::bf16, DType::f16, DType::i32, DType::i64};
const ReduceOp kOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min};
constexpr int64_t k64MiB = int64_t(64) << 20;

struct Group {
  std::string name;
  std::shared_ptr<Communicator> comm;
  std::vector<int> members;  // global ranks, in group-rank order
};

// The world, plus the TP, DP and PP groups of a 2×2×2 grid when there are 8 ranks.
const std::vector<Group>& groups() {
  static std::vector<Group> all = [] {
    std::shared_ptr<MpiCommunicator> world = init_distributed().world;
    std::vector<int> everyone;
    for (int r = 0; r < world->size(); ++r) everyone.push_back(r);
    std::vector<Group> g{{"world", world, everyone}};
    if (world->size() == 8) {
      static ParallelState state(world, {.tp = 2, .pp = 2, .dp = 2});
      auto keep = [](Communicator& c) { return std::shared_ptr<Communicator>(&c, [](auto*) {}); };
      const RankGrid& grid = state.grid();
      g.push_back({"tp", keep(state.tp()), grid.tp_group(world->rank())});
      g.push_back({"dp", keep(state.dp()), grid.dp_group(world->rank())});
      g.push_back({"pp", keep(state.pp()), grid.pp_group(world->rank())});
    }
    return g;
  }();
  return all;
}

// The count that makes the full buffer 64 MiB.
int64_t count_64mib(DType dtype, int divide_by) {
  return k64MiB / int64_t(dtype_size(dtype)) / divide_by;
}

// Sizes in elements: {0, 1, 7, 1 Mi + 3} and count_64mib.
std::vector<int64_t> counts(DType dtype, int divide_by) {
  std::vector<int64_t> out{0, 1, 7, (int64_t(1) << 20) + 3};
  // 64 MiB in the gradient buffers' dtypes only (bf16 covers the 16-bit staging f16 shares):
  // the others differ in the MPI datatype alone, which the smaller sizes cover, and 64 MiB of
  // each would more than double the suite's time on an oversubscribed 8-rank job.
  if (dtype == DType::f32 || dtype == DType::bf16) out.push_back(count_64mib(dtype, divide_by));
  return out;
}

// The value member `rank` contributes at element `i`: small integers, exact in every dtype
// and in every sum of up to 8 of them; i64 values need more than 32 bits.
double value(DType dtype, int rank, int64_t i) {
  const double base = double((rank * 7 + i * 3) % 17) - 8.0;
  switch (dtype) {
    case DType::i64:
      return base * double(int64_t(1) << 36) + rank;
    case DType::i32:
      return base * 1000.0 + rank;
    default:
      return base;
  }
}

// `x` rounded to what `dtype` holds (avg of floating dtypes is the only inexact result).
double in_dtype(DType dtype, double x) {
  switch (dtype) {
    case DType::bf16:
      return bf16_to_float(float_to_bf16(float(x)));
    case DType::f16:
      return f16_to_float(float_to_f16(float(x)));
    case DType::f32:
      return double(float(x));
    default:
      return x;
  }
}

template <typename F>
void for_each_typed(const Tensor& t, F f) {
  switch (t.dtype()) {
    case DType::f32:
      f(t.data_ptr<float>());
      break;
    case DType::i32:
      f(t.data_ptr<int32_t>());
      break;
    case DType::i64:
      f(t.data_ptr<int64_t>());
      break;
    default:
      f(t.data_ptr<uint16_t>());
      break;
  }
}

template <typename T>
T encode(DType dtype, double v) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    return dtype == DType::bf16 ? float_to_bf16(float(v)) : float_to_f16(float(v));
  } else {
    return T(v);
  }
}

template <typename T>
double decode(DType dtype, T v) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    return dtype == DType::bf16 ? bf16_to_float(v) : f16_to_float(v);
  } else {
    return double(v);
  }
}

// Every value below depends on the element index only through i mod 17, so one period of
// encoded values fills and checks 64 MiB at memory speed.
constexpr int kPeriod = 17;

template <typename T, typename F>
std::array<T, kPeriod> period(DType dtype, F f) {
  std::array<T, kPeriod> values;
  for (int k = 0; k < kPeriod; ++k) values[size_t(k)] = encode<T>(dtype, f(int64_t(k)));
  return values;
}

// t[i] = f(i + offset)
template <typename F>
void fill(const Tensor& t, F f, int64_t offset = 0) {
  for_each_typed(t, [&](auto* p) {
    const auto values = period<std::remove_pointer_t<decltype(p)>>(t.dtype(), f);
    size_t k = size_t(offset % kPeriod);
    for (int64_t i = 0, n = t.numel(); i < n; ++i) {
      p[i] = values[k];
      if (++k == kPeriod) k = 0;
    }
  });
}

// The number of elements of `t` that differ from f(i + offset); reports the first.
template <typename F>
int64_t mismatches(const Tensor& t, F f, int64_t offset = 0) {
  int64_t bad = 0;
  for_each_typed(t, [&](auto* p) {
    const auto values = period<std::remove_pointer_t<decltype(p)>>(t.dtype(), f);
    size_t k = size_t(offset % kPeriod);
    for (int64_t i = 0, n = t.numel(); i < n; ++i) {
      if (p[i] != values[k] && bad++ == 0) {
        ADD_FAILURE() << "element " << i << ": got " << decode(t.dtype(), p[i]) << ", want "
                      << decode(t.dtype(), values[k]);
      }
      if (++k == kPeriod) k = 0;
    }
  });
  return bad;
}

// The reduction over the group's members of value(member, i), as the communicator defines it.
double reduced(DType dtype, ReduceOp op, const std::vector<int>& members, int64_t i) {
  double acc = value(dtype, members[0], i);
  for (size_t m = 1; m < members.size(); ++m) {
    const double v = value(dtype, members[m], i);
    acc = op == ReduceOp::max ? std::max(acc, v) : op == ReduceOp::min ? std::min(acc, v) : acc + v;
  }
  if (op == ReduceOp::avg) return in_dtype(dtype, double(float(acc) / float(members.size())));
  return acc;
}

std::string label(const Group& g, DType dtype, int64_t count, bool in_place, const char* op = "") {
  return detail::concat("group ", g.name, " (size ", g.members.size(), ") ", dtype_name(dtype), " ",
                        op, " count ", count, in_place ? " in-place" : " out-of-place");
}

// avg is for floating dtypes. The 64 MiB size runs with sum only: the other ops change only
// the MPI_Op of the same call (and avg one division), which every smaller size covers, while
// 64 MiB per op would quadruple the suite's time on an oversubscribed 8-rank job.
bool skip(DType dtype, ReduceOp op, int64_t count, int64_t largest) {
  return (op == ReduceOp::avg && !is_floating(dtype)) || (op != ReduceOp::sum && count == largest);
}

}  // namespace

TEST(MpiCollectives, AllReduce) {
  for (const Group& g : groups()) {
    const int me = g.comm->rank();
    for (DType dtype : kDTypes) {
      for (ReduceOp op : kOps) {
        for (int64_t count : counts(dtype, 1)) {
          if (skip(dtype, op, count, count_64mib(dtype, 1))) continue;
          for (bool in_place : {true, false}) {
            SCOPED_TRACE(label(g, dtype, count, in_place, reduce_op_name(op)));
            Tensor input = Tensor::empty({count}, dtype);
            fill(input, [&](int64_t i) { return value(dtype, g.members[me], i); });
            Tensor output = in_place ? input : Tensor::empty({count}, dtype);
            g.comm->all_reduce(input, output, op)->wait();
            EXPECT_EQ(
                mismatches(output, [&](int64_t i) { return reduced(dtype, op, g.members, i); }), 0);
          }
        }
      }
    }
  }
}

TEST(MpiCollectives, ReduceScatter) {
  for (const Group& g : groups()) {
    const int me = g.comm->rank();
    const int n = g.comm->size();
    for (DType dtype : kDTypes) {
      for (ReduceOp op : kOps) {
        for (int64_t count : counts(dtype, n)) {
          if (skip(dtype, op, count, count_64mib(dtype, n))) continue;
          for (bool in_place : {true, false}) {
            SCOPED_TRACE(label(g, dtype, count, in_place, reduce_op_name(op)));
            Tensor input = Tensor::empty({count * n}, dtype);
            fill(input, [&](int64_t i) { return value(dtype, g.members[me], i); });
            Tensor output =
                in_place ? input.slice(count * me, {count}) : Tensor::empty({count}, dtype);
            g.comm->reduce_scatter(input, output, op)->wait();
            EXPECT_EQ(mismatches(
                          output, [&](int64_t i) { return reduced(dtype, op, g.members, i); },
                          count * me),
                      0);
          }
        }
      }
    }
  }
}

TEST(MpiCollectives, AllGather) {
  for (const Group& g : groups()) {
    const int me = g.comm->rank();
    const int n = g.comm->size();
    for (DType dtype : kDTypes) {
      for (int64_t count : counts(dtype, n)) {
        for (bool in_place : {true, false}) {
          SCOPED_TRACE(label(g, dtype, count, in_place));
          Tensor output = Tensor::empty({count * n}, dtype);
          Tensor input =
              in_place ? output.slice(count * me, {count}) : Tensor::empty({count}, dtype);
          fill(input, [&](int64_t i) { return value(dtype, g.members[me], i); });
          g.comm->all_gather(input, output)->wait();
          for (int r = 0; r < n; ++r) {
            EXPECT_EQ(mismatches(output.slice(count * r, {count}),
                                 [&](int64_t i) { return value(dtype, g.members[r], i); }),
                      0)
                << "slot " << r;
          }
        }
      }
    }
  }
}

TEST(MpiCollectives, Broadcast) {
  for (const Group& g : groups()) {
    const int me = g.comm->rank();
    const int root = g.comm->size() - 1;
    for (DType dtype : kDTypes) {
      for (int64_t count : counts(dtype, 1)) {
        SCOPED_TRACE(label(g, dtype, count, true));
        Tensor t = Tensor::empty({count}, dtype);
        fill(t, [&](int64_t i) { return value(dtype, g.members[me == root ? root : me], i + 1); });
        g.comm->broadcast(t, root)->wait();
        EXPECT_EQ(mismatches(t, [&](int64_t i) { return value(dtype, g.members[root], i + 1); }),
                  0);
      }
    }
  }
}

// Each rank sends to the next and receives from the previous, both posted as one operation.
TEST(MpiCollectives, PointToPointRing) {
  for (const Group& g : groups()) {
    const int me = g.comm->rank();
    const int n = g.comm->size();
    const int next = (me + 1) % n, prev = (me + n - 1) % n;
    for (DType dtype : kDTypes) {
      for (int64_t count : counts(dtype, 1)) {
        SCOPED_TRACE(label(g, dtype, count, false));
        Tensor out = Tensor::empty({count}, dtype);
        Tensor in = Tensor::empty({count}, dtype);
        fill(out, [&](int64_t i) { return value(dtype, g.members[me], i); });
        P2POp ops[] = {P2POp::send(out, next), P2POp::recv(in, prev)};
        g.comm->p2p(ops)->wait();
        EXPECT_EQ(mismatches(in, [&](int64_t i) { return value(dtype, g.members[prev], i); }), 0);
      }
    }
  }
}

TEST(MpiCollectives, SplitAndBarrier) {
  Communicator& world = *groups()[0].comm;
  auto halves = world.split(world.rank() % 2, -world.rank(), "halves");  // reversed order
  ASSERT_NE(halves, nullptr);
  EXPECT_EQ(halves->size(), (world.size() + 1 - world.rank() % 2) / 2);
  EXPECT_EQ(halves->name(), "halves");
  Tensor ranks = Tensor::empty({halves->size()}, DType::i32);
  Tensor mine = Tensor::empty({1}, DType::i32);
  mine.data_ptr<int32_t>()[0] = world.rank();
  halves->all_gather(mine, ranks)->wait();
  for (int i = 1; i < halves->size(); ++i) EXPECT_GT(ranks.item(i - 1), ranks.item(i));
  auto only_zero = world.split(world.rank() == 0 ? 0 : -1, 0, "zero");
  EXPECT_EQ(only_zero == nullptr, world.rank() != 0);
  auto work = world.barrier();
  work->wait();
  EXPECT_TRUE(work->is_completed());
  work->wait();  // a second wait returns at once
}

TEST(MpiCollectives, AsyncCallsCompleteInAnyWaitOrder) {
  Communicator& world = *groups()[0].comm;
  Tensor a = Tensor::empty({1 << 16}, DType::f32), b = Tensor::empty({1 << 16}, DType::f32);
  fill(a, [&](int64_t) { return 1.0; });
  fill(b, [&](int64_t) { return 2.0; });
  WorkPtr wa = world.all_reduce(a), wb = world.all_reduce(b);
  wb->wait();
  wa->wait();
  EXPECT_EQ(a.item(7), world.size());
  EXPECT_EQ(b.item(7), 2.0 * world.size());
  EXPECT_EQ(wa->info().name, "all_reduce");
  EXPECT_EQ(wa->info().bytes, size_t(4) << 16);
}

TEST(MpiCollectives, BadCallsAreErrorsOnEveryRank) {
  Communicator& world = *groups()[0].comm;
  const int n = world.size();
  Tensor i32 = Tensor::empty({4}, DType::i32), f32 = Tensor::empty({4}, DType::f32);
  EXPECT_THROW(world.all_reduce(i32, ReduceOp::avg), Error);
  EXPECT_THROW(world.all_reduce(Tensor::empty({4}, DType::u8)), Error);
  EXPECT_THROW(world.all_reduce(f32, Tensor::empty({5}, DType::f32)), Error);
  EXPECT_THROW(world.all_reduce(f32, i32), Error);
  EXPECT_THROW(world.reduce_scatter(Tensor::empty({4 * n + 1}, DType::f32), f32), Error);
  EXPECT_THROW(world.all_gather(f32, Tensor::empty({4 * n + 1}, DType::f32)), Error);
  EXPECT_THROW(world.broadcast(f32, n), Error);
  EXPECT_THROW(world.send(f32, -1), Error);
  Tensor big = Tensor::empty({8 * n}, DType::f32);
  EXPECT_THROW(world.all_gather(big.slice(1, {4}), big.slice(0, {4 * int64_t(n)})), Error);
  EXPECT_THROW(world.set_timeout(Duration(0)), ConfigError);
  world.barrier()->wait();
}
