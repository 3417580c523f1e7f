// A distributed program that goes wrong on purpose, for tests/cpp/comm/fault_tests.py:
//
//   comm_fault_driver layout TP PP DP       build a ParallelState (a bad one must fail alike
//                                           on every rank: exit 2, one line each)
//   comm_fault_driver kill RANK             all-reduces in a loop; RANK SIGKILLs itself
//   comm_fault_driver skip RANK             all-reduces on the TP groups of a tp=2 grid;
//                                           RANK skips one: the others' deadline must fire
//   ... [--distributed-timeout-minutes M]

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "braid/comm/launch.h"
#include "braid/comm/parallel_state.h"

using namespace braid;
using namespace braid::comm;

int main(int argc, char** argv) {
  return run_main([&] {
    BRAID_CONFIG_CHECK(argc >= 3, "usage: comm_fault_driver layout|kill|skip ARGS...");
    const std::string command = argv[1];
    double minutes = 10;
    for (int i = 1; i + 1 < argc; ++i)
      if (std::string(argv[i]) == "--distributed-timeout-minutes") minutes = std::atof(argv[i + 1]);
    Distributed dist = init_distributed(timeout_from_minutes(minutes));
    Communicator& world = *dist.world;

    if (command == "layout") {
      BRAID_CONFIG_CHECK(argc >= 5, "usage: comm_fault_driver layout TP PP DP");
      ParallelState state(
          dist.world,
          {.tp = std::atoi(argv[2]), .pp = std::atoi(argv[3]), .dp = std::atoi(argv[4])});
      state.world().barrier()->wait();
      if (world.rank() == 0)
        std::printf("layout ok: tp %d pp %d dp %d\n", state.grid().tp(), state.grid().pp(),
                    state.grid().dp());
      return 0;
    }
    const int victim = std::atoi(argv[2]);
    Tensor t = Tensor::zeros({1 << 20}, DType::f32);
    if (command == "kill") {
      for (int step = 0; step < 100000; ++step) {
        if (step == 20 && world.rank() == victim) std::raise(SIGKILL);
        world.all_reduce(t)->wait();
      }
      return 0;
    }
    if (command == "skip") {
      ParallelState state(dist.world, {.tp = 2});
      for (int step = 0; step < 5; ++step) {
        if (step == 2 && world.rank() == victim) continue;
        state.tp().all_reduce(t)->wait();
      }
      return 0;  // (no final barrier: its deadline would race the skipped all-reduce's)
    }
    BRAID_CONFIG_CHECK(false, "comm_fault_driver: unknown command '", command, "'");
    return 2;
  });
}
