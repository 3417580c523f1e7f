#pragma once
// safetensors files, read and written by braid itself (no Python, no pickle: loading never
// executes code from a checkpoint).
//
// The format: 8 bytes little-endian N, then N bytes of JSON header, then the data area.
// The header is an object: "__metadata__" (optional, string -> string) and one entry per tensor,
//   "name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}
// with offsets relative to the data area. braid writes what the Python `safetensors` library
// writes, byte for byte: compact JSON, tensors ordered by dtype (widest first, the library's
// order) then name, "__metadata__" first (keys sorted; the library's order is a hash map's),
// the header padded with spaces so the data starts 8-byte aligned, data contiguous, no holes.
//
// Reading is strict: every rule below is checked before any tensor is touched, and a broken
// file throws braid::ConfigError naming the file, the tensor and the rule:
//   - the file holds the 8-byte length; N <= 100,000,000 (kMaxHeaderBytes) and 8 + N <= size;
//   - the header is one JSON object (UTF-8), no duplicate names, "__metadata__" maps strings
//     to strings, tensor entries have exactly dtype, shape and data_offsets;
//   - dtype is a known safetensors dtype; shape is a list of non-negative integers;
//     data_offsets is [begin, end], begin <= end, end - begin == numel * itemsize;
//   - the tensors tile the data area exactly: sorted by offset each begins where the previous
//     ended, the first at 0, the last ends at the end of the file (no overlaps, no holes, no
//     trailing bytes) -- the same rule the Python library enforces.

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "braid/core/tensor.h"

namespace braid::ckpt {

constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // the Python library's limit

// safetensors dtype names ("F32", "BF16", "I64", "U8", "BOOL", "F8_E4M3", ...).
size_t safetensors_dtype_size(std::string_view dtype);     // 0: not a known (byte-sized) dtype
std::optional<DType> braid_dtype(std::string_view dtype);  // F32 BF16 F16 I32 I64 U8 -> braid
const char* safetensors_dtype(DType dtype);                // braid -> "F32", "BF16", ...

struct TensorInfo {
  std::string name;
  std::string dtype;           // the safetensors name
  std::vector<int64_t> shape;  // any number of dims; [] is a scalar
  uint64_t begin = 0;          // byte span within the data area
  uint64_t end = 0;

  uint64_t nbytes() const { return end - begin; }
  int64_t numel() const;
};

struct SafetensorsHeader {
  uint64_t header_bytes = 0;        // N
  uint64_t data_start = 0;          // 8 + N: where the data area starts in the file
  std::vector<TensorInfo> tensors;  // in data-offset order
  std::map<std::string, std::string> metadata;
};

// Parses and validates the header of a whole safetensors file held in `file` (all of it:
// the data area's size is part of the rules). Pure: reads only `file`; `filename` only names
// the file in errors. Throws braid::ConfigError on any broken rule.
SafetensorsHeader parse_safetensors_header(std::span<const uint8_t> file,
                                           std::string_view filename = "<memory>");

// Collects tensors and metadata, then writes one file. Tensors are kept by reference (a
// Tensor shares its storage) and copied to the host piece by piece while writing, so the file
// is never built in memory. Device tensors are copied on the default stream: the caller
// synchronizes the streams that wrote them first.
class SafetensorsWriter {
 public:
  // Any braid dtype, any device; the tensor must stay unchanged until write() returns.
  void add(const std::string& name, const Tensor& tensor);
  // Raw bytes of any safetensors dtype (copied now): numel(shape) * itemsize bytes.
  void add_bytes(const std::string& name, std::string_view dtype, std::span<const int64_t> shape,
                 std::span<const uint8_t> bytes);
  void set_metadata(const std::string& key, const std::string& value);
  // write() also records each tensor's CRC-32C (braid/ckpt/crc32c.h) of the bytes it writes, as
  // the metadata "crc32c.<name>" = 8 lowercase hex digits: it writes the header with zeros
  // there, the data, then the header again with the values (the same length).
  void record_checksums() { checksums_ = true; }

  // The header (length prefix and padding included) that write() writes first (with
  // record_checksums(), every checksum 00000000).
  std::string header() const;
  // Writes the file (created or truncated; mode 0644) and fsyncs it. Not atomic by itself:
  // write into an AtomicDirectory (braid/ckpt/atomic_dir.h) for that.
  void write(const std::string& path) const;

 private:
  struct Entry {
    std::string name;
    std::string dtype;
    std::vector<int64_t> shape;
    Tensor tensor;               // defined: the bytes come from here
    std::vector<uint8_t> bytes;  // otherwise: these
    uint64_t nbytes = 0;
  };
  std::vector<const Entry*> ordered() const;
  void check_new_name(const std::string& name) const;
  std::string header_with(const std::map<std::string, std::string>& metadata) const;

  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
  bool checksums_ = false;
};

// A safetensors file mapped into memory and validated on open.
class SafetensorsFile {
 public:
  static SafetensorsFile open(const std::string& path);

  const std::string& path() const { return path_; }
  std::vector<std::string> names() const;  // in data-offset order
  bool contains(const std::string& name) const;
  const TensorInfo& info(const std::string& name) const;  // ConfigError naming the file if absent
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }

  // The tensor's bytes inside the mapping (valid while this object or a view lives).
  std::span<const uint8_t> bytes(const std::string& name) const;
  // Where the file records a CRC-32C for `name` (SafetensorsWriter::record_checksums), checks
  // its bytes against it: ConfigError naming the file and the tensor when they differ (the
  // file was damaged after it was written). Nothing to check: returns false.
  bool check_checksum(const std::string& name) const;
  // A copy on `device`; braid dtypes only, at most kMaxDims dims.
  Tensor read(const std::string& name, Device device = Device::cpu()) const;
  // A zero-copy host tensor over the mapping, which it keeps alive. The mapping is private:
  // writes through the view stay in this process and never reach the file. Needs the data
  // aligned to the dtype's size (always so in files braid or the Python library wrote).
  Tensor view(const std::string& name) const;

 private:
  struct Mapping;

  std::string path_;
  std::shared_ptr<Mapping> mapping_;
  SafetensorsHeader header_;
  std::map<std::string, size_t> index_;  // name -> header_.tensors[i]
};

}  // namespace braid::ckpt
