#pragma once
// braid::Error and the check macros every layer uses.
//
//   BRAID_CHECK(cond, parts...)        -> throws braid::Error (RuntimeError in Python)
//   BRAID_CONFIG_CHECK(cond, parts...) -> throws braid::ConfigError (ValueError in Python)
//
// The message parts are streamed together, so call sites read like
//   BRAID_CHECK(a.dim() == 2, "matmul: a must be 2-D, got ", a.shape());

#include <sstream>
#include <stdexcept>
#include <string>

namespace braid {

// The rank printed in error messages; set once by the launcher (-1: not distributed).
void set_error_rank(int rank);
int error_rank();

class Error : public std::runtime_error {
 public:
  Error(const std::string& message, const char* file, int line);
  const std::string& message() const { return message_; }  // without the location
  const char* file() const { return file_; }
  int line() const { return line_; }
  int rank() const { return rank_; }

 private:
  std::string message_;
  const char* file_;
  int line_;
  int rank_;
};

// A bad configuration or argument supplied by the user (Python: ValueError).
class ConfigError : public Error {
 public:
  using Error::Error;
};

namespace detail {
template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}
}  // namespace detail

}  // namespace braid

#define BRAID_CHECK(cond, ...)                                                        \
  do {                                                                                \
    if (!(cond)) [[unlikely]]                                                         \
      throw ::braid::Error(::braid::detail::concat(__VA_ARGS__), __FILE__, __LINE__); \
  } while (0)

#define BRAID_CONFIG_CHECK(cond, ...)                                                       \
  do {                                                                                      \
    if (!(cond)) [[unlikely]]                                                               \
      throw ::braid::ConfigError(::braid::detail::concat(__VA_ARGS__), __FILE__, __LINE__); \
  } while (0)

#define BRAID_FAIL(...) \
  throw ::braid::Error(::braid::detail::concat(__VA_ARGS__), __FILE__, __LINE__)
