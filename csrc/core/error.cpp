#include "braid/core/error.h"

#include <atomic>

namespace braid {
namespace {
std::atomic<int> g_rank{-1};

std::string located(const std::string& message, const char* file, int line, int rank) {
  std::string where = std::string(file) + ":" + std::to_string(line);
  if (rank >= 0) where = "rank " + std::to_string(rank) + ", " + where;
  return message + " [" + where + "]";
}
}  // namespace

void set_error_rank(int rank) { g_rank.store(rank); }
int error_rank() { return g_rank.load(); }

Error::Error(const std::string& message, const char* file, int line)
    : std::runtime_error(located(message, file, line, g_rank.load())),
      message_(message),
      file_(file),
      line_(line),
      rank_(g_rank.load()) {}

}  // namespace braid
