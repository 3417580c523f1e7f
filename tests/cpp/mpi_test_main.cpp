// GoogleTest main for MPI jobs (braid_add_mpi_test): every rank runs every test. Rank 0 prints
// the usual progress; every rank prints its own failures, tagged with its rank; the job fails
// on every rank when any rank failed. BRAID_TEST_TIMEOUT_MINUTES (default 3) bounds every
// wait, so a test that desynchronises the ranks aborts instead of hanging.

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>

#include "braid/comm/launch.h"

namespace {

class RankFailurePrinter : public testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: failure\n%s\n", rank_,
                 result.file_name() ? result.file_name() : "?", result.line_number(),
                 result.summary());
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  return braid::comm::run_main([] {
    const char* minutes = std::getenv("BRAID_TEST_TIMEOUT_MINUTES");
    auto dist = braid::comm::init_distributed(
        braid::comm::timeout_from_minutes(minutes ? std::atof(minutes) : 3.0));
    auto& world = *dist.world;
    if (world.rank() != 0) {
      testing::TestEventListeners& listeners = testing::UnitTest::GetInstance()->listeners();
      delete listeners.Release(listeners.default_result_printer());
      listeners.Append(new RankFailurePrinter(world.rank()));
    }
    braid::Tensor failed = braid::Tensor::empty({1}, braid::DType::i32);
    failed.data_ptr<int32_t>()[0] = RUN_ALL_TESTS() != 0 ? 1 : 0;
    world.all_reduce(failed, braid::comm::ReduceOp::max)->wait();
    const bool any_failed = failed.data_ptr<int32_t>()[0] != 0;
    if (any_failed && world.rank() == 0) std::fprintf(stderr, "some rank failed a test\n");
    return any_failed ? 1 : 0;
  });
}
