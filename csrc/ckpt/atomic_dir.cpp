// Crash-safe directory and file writes: include/braid/ckpt/atomic_dir.h.

#include "braid/ckpt/atomic_dir.h"

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include "braid/core/error.h"

namespace braid::ckpt {

namespace fs = std::filesystem;

namespace {

std::string errno_text() { return std::strerror(errno); }

// Unique among processes on every host sharing the file system, and among calls here.
std::string unique_suffix() {
  static std::atomic<uint64_t> counter{0};
  char host[64] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "host");
  return std::string(kTmpMarker) + host + "-" + std::to_string(::getpid()) + "-" +
         std::to_string(counter++);
}

fs::path parent_of(const fs::path& path) {
  fs::path parent = path.parent_path();
  return parent.empty() ? fs::path(".") : parent;
}

void fsync_tree(const fs::path& dir) {
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    if (entry.is_regular_file() || entry.is_directory()) fsync_path(entry.path());
  }
  fsync_path(dir);
}

}  // namespace

void fsync_path(const fs::path& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  BRAID_CHECK(fd >= 0, "fsync: cannot open ", path.string(), ": ", errno_text());
  int rc = ::fsync(fd);
  const std::string why = rc == 0 ? "" : errno_text();
  ::close(fd);
  BRAID_CHECK(rc == 0, "fsync of ", path.string(), ": ", why);
}

void write_file(const fs::path& path, std::string_view contents) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  BRAID_CHECK(fd >= 0, "cannot create ", path.string(), ": ", errno_text());
  const char* p = contents.data();
  size_t n = contents.size();
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const std::string why = errno_text();
      ::close(fd);
      BRAID_FAIL("writing ", path.string(), ": ", why);
    }
    p += w;
    n -= size_t(w);
  }
  if (::fsync(fd) != 0) {
    const std::string why = errno_text();
    ::close(fd);
    BRAID_FAIL("fsync of ", path.string(), ": ", why);
  }
  BRAID_CHECK(::close(fd) == 0, "closing ", path.string(), ": ", errno_text());
}

void replace_file_atomically(const fs::path& path, std::string_view contents) {
  fs::path tmp = path;
  tmp += unique_suffix();
  try {
    write_file(tmp, contents);
    BRAID_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, "cannot rename ", tmp.string(), " to ",
                path.string(), ": ", errno_text());
  } catch (...) {
    std::error_code ignored;
    fs::remove(tmp, ignored);
    throw;
  }
  fsync_path(parent_of(path));
}

AtomicDirectory::AtomicDirectory(fs::path final_path, Existing existing)
    : final_(std::move(final_path)), existing_(existing) {
  BRAID_CONFIG_CHECK(!final_.filename().empty(), "AtomicDirectory: '", final_.string(),
                     "' does not name a directory (trailing slash?)");
  BRAID_CONFIG_CHECK(existing_ == Existing::replace || !fs::exists(final_), "checkpoint directory ",
                     final_.string(), " already exists; refusing to overwrite it");
  tmp_ = final_;
  tmp_ += unique_suffix();
  std::error_code error;
  BRAID_CHECK(fs::create_directory(tmp_, error) && !error, "cannot create ", tmp_.string(), ": ",
              error ? error.message() : "it already exists");
}

AtomicDirectory::~AtomicDirectory() {
  if (committed_) return;
  std::error_code ignored;
  fs::remove_all(tmp_, ignored);
}

void AtomicDirectory::commit() {
  BRAID_CHECK(!committed_, "AtomicDirectory ", final_.string(), ": committed twice");
  fsync_tree(tmp_);
  // RENAME_NOREPLACE: a directory that appeared meanwhile is never clobbered by accident.
  if (::renameat2(AT_FDCWD, tmp_.c_str(), AT_FDCWD, final_.c_str(), RENAME_NOREPLACE) == 0) {
    committed_ = true;
    fsync_path(parent_of(final_));
    return;
  }
  const int first = errno;
  BRAID_CONFIG_CHECK(!(first == EEXIST && existing_ == Existing::refuse), "checkpoint directory ",
                     final_.string(), " already exists; refusing to overwrite it");
  BRAID_CHECK(first == EEXIST, "cannot rename ", tmp_.string(), " to ", final_.string(), ": ",
              std::strerror(first));
  BRAID_CHECK(::renameat2(AT_FDCWD, tmp_.c_str(), AT_FDCWD, final_.c_str(), RENAME_EXCHANGE) == 0,
              "cannot exchange ", tmp_.string(), " with the existing ", final_.string(), ": ",
              errno_text());
  committed_ = true;
  fsync_path(parent_of(final_));
  // The old directory now sits under the temporary name.
  std::error_code error;
  fs::remove_all(tmp_, error);
  BRAID_CHECK(!error, "replaced ", final_.string(), " but could not remove the old copy at ",
              tmp_.string(), ": ", error.message());
}

std::vector<fs::path> stale_temporaries(const fs::path& parent) {
  std::vector<fs::path> out;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(parent, error)) {
    if (entry.path().filename().string().find(kTmpMarker) != std::string::npos)
      out.push_back(entry.path());
  }
  BRAID_CHECK(!error, "cannot list ", parent.string(), ": ", error.message());
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<fs::path> remove_stale_temporaries(const fs::path& parent) {
  std::vector<fs::path> removed = stale_temporaries(parent);
  for (const fs::path& p : removed) {
    std::error_code error;
    fs::remove_all(p, error);
    BRAID_CHECK(!error, "cannot remove ", p.string(), ": ", error.message());
  }
  return removed;
}

}  // namespace braid::ckpt
