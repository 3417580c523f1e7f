#include "braid/core/log.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>

namespace braid::log {
namespace {

Level initial_level() {
  const char* env = std::getenv("BRAID_LOG_LEVEL");
  return env ? level_from_name(env) : Level::info;
}

std::atomic<Level>& current() {
  static std::atomic<Level> value{initial_level()};
  return value;
}

}  // namespace

Level level() { return current().load(std::memory_order_relaxed); }
void set_level(Level level) { current().store(level); }

Level level_from_name(const std::string& name) {
  if (name == "debug") return Level::debug;
  if (name == "info") return Level::info;
  if (name == "warn" || name == "warning") return Level::warn;
  if (name == "error") return Level::error;
  BRAID_CONFIG_CHECK(false, "unknown log level '", name, "' (expected debug, info, warn or error)");
  return Level::info;
}

void write(Level level, const std::string& message) {
  static const char* names[] = {"debug", "info", "warn", "error"};
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  int rank = error_rank();
  if (rank >= 0) {
    std::fprintf(stderr, "[braid %s rank %d] %s\n", names[int(level)], rank, message.c_str());
  } else {
    std::fprintf(stderr, "[braid %s] %s\n", names[int(level)], message.c_str());
  }
}

}  // namespace braid::log
