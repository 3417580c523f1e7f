#include "braid/engine/exit_conditions.h"

#include <atomic>

namespace braid::engine {
namespace {

volatile std::sig_atomic_t g_signal = 0;  // the last SIGTERM/SIGUSR1 received, 0: none
std::atomic<bool> g_installed{false};

extern "C" void record_signal(int signal) { g_signal = signal; }

}  // namespace

ExitConditions::ExitConditions(const ExitConfig& config)
    : config_(config), start_(std::chrono::steady_clock::now()) {
  BRAID_CONFIG_CHECK(config.exit_interval >= 0, "--exit-interval must be >= 0, got ",
                     config.exit_interval);
  BRAID_CONFIG_CHECK(config.exit_duration_minutes >= 0,
                     "--exit-duration-in-mins must be >= 0, got ", config.exit_duration_minutes);
  if (!config_.signals) return;
  BRAID_CHECK(!g_installed.exchange(true), "ExitConditions: one instance at a time");
  g_signal = 0;
  struct sigaction action {};
  action.sa_handler = record_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &action, &previous_term_);
  sigaction(SIGUSR1, &action, &previous_usr1_);
}

ExitConditions::~ExitConditions() {
  if (!config_.signals) return;
  sigaction(SIGTERM, &previous_term_, nullptr);
  sigaction(SIGUSR1, &previous_usr1_, nullptr);
  g_installed = false;
}

std::string ExitConditions::check(const ParallelModel& model, int64_t iteration) {
  const double minutes =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count() / 60.0;
  // [signal, duration passed]: the max over ranks, so one rank's signal or clock stops all.
  Tensor flags = Tensor::empty({2}, DType::i32);
  flags.data_ptr<int32_t>()[0] = int32_t(g_signal);
  flags.data_ptr<int32_t>()[1] =
      config_.exit_duration_minutes > 0 && minutes >= config_.exit_duration_minutes;
  if (const comm::ParallelState* state = model.state();
      state != nullptr && state->world().size() > 1) {
    Tensor on_device = flags.to(state->world().device());
    state->world().all_reduce(on_device, comm::ReduceOp::max)->wait();
    flags = on_device.to(Device::cpu());
  }
  const int signal = flags.data_ptr<int32_t>()[0];
  if (signal == SIGTERM) return "SIGTERM";
  if (signal == SIGUSR1) return "SIGUSR1";
  if (flags.data_ptr<int32_t>()[1] != 0) return "--exit-duration-in-mins";
  if (config_.exit_interval > 0 && iteration % config_.exit_interval == 0) return "--exit-interval";
  return "";
}

}  // namespace braid::engine
