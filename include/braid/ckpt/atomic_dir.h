#pragma once
// Crash-safe writes: a checkpoint directory appears under its final name complete or not at
// all, and a small file (`latest`) is replaced whole or not at all.
//
// AtomicDirectory creates `<final>.tmp-<host>-<pid>-<n>` beside the final path; the caller
// writes files into path(); commit() fsyncs every file and directory inside, renames the
// directory to its final name and fsyncs the parent, so after commit() returns the directory
// survives a power cut, and a crash before that leaves only the temporary (find them with
// stale_temporaries(), remove them with remove_stale_temporaries()).
//
// An existing final directory is refused by default (ConfigError). With
// Existing::replace the new directory takes its place by one atomic exchange
// (renameat2 RENAME_EXCHANGE) and the old one is deleted afterwards: at every moment the final
// name holds either the old directory or the new one, never neither.

#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace braid::ckpt {

// fsync a file or a directory by path (throws braid::Error naming it).
void fsync_path(const std::filesystem::path& path);
// Writes `contents` to `path` (created or truncated) and fsyncs it. Not atomic by itself.
void write_file(const std::filesystem::path& path, std::string_view contents);
// Writes `contents` to a temporary beside `path`, fsyncs it, renames it over `path` and
// fsyncs the parent directory: readers see the old contents or the new, never a mix.
void replace_file_atomically(const std::filesystem::path& path, std::string_view contents);

class AtomicDirectory {
 public:
  enum class Existing { refuse, replace };

  explicit AtomicDirectory(std::filesystem::path final_path, Existing existing = Existing::refuse);
  // Not committed: the temporary is removed (best effort), e.g. when a save throws.
  ~AtomicDirectory();
  AtomicDirectory(const AtomicDirectory&) = delete;
  AtomicDirectory& operator=(const AtomicDirectory&) = delete;

  const std::filesystem::path& path() const { return tmp_; }  // write files here
  const std::filesystem::path& final_path() const { return final_; }
  bool committed() const { return committed_; }
  void commit();

 private:
  std::filesystem::path final_;
  std::filesystem::path tmp_;
  Existing existing_;
  bool committed_ = false;
};

// The marker between a final name and its temporary's suffix.
constexpr std::string_view kTmpMarker = ".tmp-";
// Entries of `parent` (directories, and files from replace_file_atomically) whose name
// contains kTmpMarker: left by a crashed save -- or being written right now by another
// process, so call these only when no save is running.
std::vector<std::filesystem::path> stale_temporaries(const std::filesystem::path& parent);
// Removes them (recursively); returns what it removed.
std::vector<std::filesystem::path> remove_stale_temporaries(const std::filesystem::path& parent);

}  // namespace braid::ckpt
