#pragma once
// Levelled logging to stderr. The level comes from BRAID_LOG_LEVEL (debug, info, warn,
// error; default info) and can be changed at run time.
//
//   log::info("step ", step, " loss ", loss);

#include <string>

#include "braid/core/error.h"

namespace braid::log {

enum class Level { debug = 0, info = 1, warn = 2, error = 3 };

Level level();
void set_level(Level level);
Level level_from_name(const std::string& name);  // ConfigError on an unknown name
void write(Level level, const std::string& message);

template <typename... Parts>
void debug(const Parts&... parts) {
  if (level() <= Level::debug) write(Level::debug, detail::concat(parts...));
}
template <typename... Parts>
void info(const Parts&... parts) {
  if (level() <= Level::info) write(Level::info, detail::concat(parts...));
}
template <typename... Parts>
void warn(const Parts&... parts) {
  if (level() <= Level::warn) write(Level::warn, detail::concat(parts...));
}
template <typename... Parts>
void error(const Parts&... parts) {
  write(Level::error, detail::concat(parts...));
}

}  // namespace braid::log
