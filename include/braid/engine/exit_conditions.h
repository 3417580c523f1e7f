#pragma once
// Leaving a run cleanly, as Megatron does: on SIGTERM or SIGUSR1 (a scheduler preempting the
// job, the GPUs being taken back), every --exit-interval iterations, or after
// --exit-duration-in-mins. The training loop calls check() after each iteration; it is
// collective (one all-reduce of two integers over the world), so every rank stops after the
// same iteration even when the signal reached only some of them - then the loop saves and
// exits 0.

#include <chrono>
#include <csignal>
#include <cstdint>
#include <string>

#include "braid/engine/parallel_model.h"

namespace braid::engine {

struct ExitConfig {
  int64_t exit_interval = 0;         // --exit-interval: stop when iteration % this == 0
  double exit_duration_minutes = 0;  // --exit-duration-in-mins, from construction
  bool signals = true;               // catch SIGTERM and SIGUSR1
};

class ExitConditions {
 public:
  // Installs the signal handlers (they only record the signal); the destructor restores the
  // previous ones. One instance at a time.
  explicit ExitConditions(const ExitConfig& config);
  ~ExitConditions();
  ExitConditions(const ExitConditions&) = delete;
  ExitConditions& operator=(const ExitConditions&) = delete;

  // After `iteration` completed: why to stop now ("SIGTERM", "SIGUSR1", "--exit-interval",
  // "--exit-duration-in-mins"), or "" to go on. Collective over the model's world.
  std::string check(const ParallelModel& model, int64_t iteration);

 private:
  ExitConfig config_;
  std::chrono::steady_clock::time_point start_;
  struct sigaction previous_term_ {};
  struct sigaction previous_usr1_ {};
};

}  // namespace braid::engine
