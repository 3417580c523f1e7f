#include "braid/data/index_cache.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include "braid/core/log.h"
#include "braid/data/npy_file.h"

namespace braid::data {

namespace fs = std::filesystem;

std::string description_hash(const std::string& description) {
  auto fnv1a = [&](uint64_t h) {
    for (unsigned char c : description) h = (h ^ c) * 0x100000001b3ull;
    return h;
  };
  char out[33];
  std::snprintf(out, sizeof out, "%016llx%016llx",
                static_cast<unsigned long long>(fnv1a(0xcbf29ce484222325ull)),
                static_cast<unsigned long long>(fnv1a(0x84222325cbf29ce4ull)));
  return out;
}

void write_atomically(const std::string& path,
                      const std::function<void(const std::string&)>& write) {
  static std::atomic<uint64_t> counter{0};
  std::string tmp = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
  try {
    write(tmp);
  } catch (...) {
    std::remove(tmp.c_str());
    throw;
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    std::remove(tmp.c_str());
    BRAID_FAIL("cannot rename ", tmp, " to ", path, ": ", std::strerror(err));
  }
}

namespace {

std::optional<std::string> read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// The set under `prefix` if it is complete and matches `description`.
std::optional<std::vector<Tensor>> try_load(const std::string& prefix,
                                            const std::string& description,
                                            const std::vector<std::string>& names) {
  std::optional<std::string> stored = read_text(prefix + "-description.txt");
  if (!stored) return std::nullopt;
  if (*stored != description) {
    log::warn("index cache ", prefix, ": the description differs (a hash collision?); rebuilding");
    return std::nullopt;
  }
  std::vector<Tensor> arrays;
  try {
    for (const std::string& name : names) arrays.push_back(read_npy(prefix + "-" + name + ".npy"));
  } catch (const Error& e) {
    log::warn("index cache ", prefix, ": ", e.message(), "; rebuilding");
    return std::nullopt;
  }
  return arrays;
}

// An exclusive flock held for the object's lifetime; a no-op where it cannot be had.
class FileLock {
 public:
  explicit FileLock(const std::string& path) {
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd_ < 0) {
      log::warn("index cache: cannot open lock ", path, " (", std::strerror(errno),
                "); building without it");
      return;
    }
    int rc;
    while ((rc = ::flock(fd_, LOCK_EX)) != 0 && errno == EINTR) {
    }
    if (rc != 0) {
      log::debug("index cache: no flock on ", path, " (", std::strerror(errno), ")");
      ::close(fd_);
      fd_ = -1;
    }
  }
  ~FileLock() {
    if (fd_ >= 0) ::close(fd_);  // releases the lock
  }
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

 private:
  int fd_ = -1;
};

std::vector<Tensor> build_checked(const std::function<std::vector<Tensor>()>& build,
                                  const std::vector<std::string>& names) {
  std::vector<Tensor> arrays = build();
  BRAID_CHECK(arrays.size() == names.size(), "index cache: built ", arrays.size(), " arrays for ",
              names.size(), " names");
  return arrays;
}

}  // namespace

CachedArrays load_or_build(const std::string& dir, const std::string& kind,
                           const std::string& description, const std::vector<std::string>& names,
                           const std::function<std::vector<Tensor>()>& build) {
  if (dir.empty()) return {build_checked(build, names), false, ""};
  const std::string prefix =
      (fs::path(dir) / (description_hash(description) + "-" + kind)).string();
  if (auto arrays = try_load(prefix, description, names)) return {std::move(*arrays), true, prefix};

  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    log::warn("index cache: cannot create ", dir, " (", ec.message(),
              "); the indices live in memory for this run (set the cache path to a writable "
              "directory to keep them)");
    return {build_checked(build, names), false, ""};
  }
  FileLock lock(prefix + ".lock");
  // Another process may have built the set while this one waited for the lock.
  if (auto arrays = try_load(prefix, description, names)) return {std::move(*arrays), true, prefix};

  std::vector<Tensor> arrays = build_checked(build, names);
  try {
    for (size_t i = 0; i < names.size(); ++i)
      write_atomically(prefix + "-" + names[i] + ".npy",
                       [&](const std::string& tmp) { write_npy(tmp, arrays[i]); });
    write_atomically(prefix + "-description.txt", [&](const std::string& tmp) {
      std::ofstream out(tmp, std::ios::binary);
      out << description;
      out.close();
      BRAID_CHECK(out, "cannot write ", tmp);
    });
  } catch (const Error& e) {
    log::warn("index cache: ", e.message(), "; the indices live in memory for this run");
    return {std::move(arrays), false, ""};
  }
  // Serve the mapped files (the page cache) rather than a second copy on the heap.
  if (auto mapped = try_load(prefix, description, names))
    return {std::move(*mapped), false, prefix};
  return {std::move(arrays), false, prefix};
}

}  // namespace braid::data
