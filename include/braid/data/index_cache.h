#pragma once
// The on-disk cache of dataset indices: a second start maps them instead of rebuilding.
//
// A set of arrays is keyed by its description, a text naming every input that shapes it (the
// data files with their sizes and modification times, the document range, seq_length, the
// number of samples, the seed, the format version, ...). In `dir` it is the files
//   <hash>-<kind>-<name>.npy      one per array (numpy can np.load them)
//   <hash>-<kind>-description.txt the description, written last: the set is complete when it
//                                 exists and matches the description word for word
// where <hash> is a 128-bit hash of the description.
//
// Concurrency: every file is written under a temporary name and renamed into place, so a reader
// never sees half a file and a crash leaves no file that looks complete. Processes that need the
// same set (the ranks of one job, on one node or sharing a file system) take an flock on
// <hash>-<kind>.lock: one builds and writes, the others wait and then map its files. Where the
// file system has no flock each process builds the same bytes (the build is deterministic) and
// the renames race harmlessly. A directory that cannot be written logs a warning and the arrays
// live in memory for this run.

#include <functional>
#include <string>
#include <vector>

#include "braid/core/tensor.h"

namespace braid::data {

struct CachedArrays {
  std::vector<Tensor> arrays;  // in the order of `names`
  bool from_cache = false;     // mapped from files an earlier build wrote
  std::string path_prefix;     // <dir>/<hash>-<kind>; empty when nothing is on disk
};

// Maps the set from `dir` when it is there, else runs `build` (which returns the arrays in the
// order of `names`), stores them and maps the stored files. An empty `dir` only builds.
CachedArrays load_or_build(const std::string& dir, const std::string& kind,
                           const std::string& description, const std::vector<std::string>& names,
                           const std::function<std::vector<Tensor>()>& build);

// 32 hex digits (two 64-bit FNV-1a hashes with different bases).
std::string description_hash(const std::string& description);

// Writes `path` through `write(temporary_path)` and renames it into place (the temporary is
// removed when `write` throws).
void write_atomically(const std::string& path,
                      const std::function<void(const std::string&)>& write);

// A tensor that owns `values` (no copy).
template <typename T>
Tensor tensor_from_vector(std::vector<T>&& values, const Shape& shape) {
  auto owner = std::make_shared<std::vector<T>>(std::move(values));
  BRAID_CHECK(int64_t(owner->size()) == shape.numel(), "tensor_from_vector: ", owner->size(),
              " values for shape ", shape);
  return Tensor::from_blob(owner->empty() ? nullptr : owner->data(), shape, DTypeOf<T>::value,
                           Device::cpu(), [owner] {});
}

}  // namespace braid::data
