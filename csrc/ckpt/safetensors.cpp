// safetensors: the writer and the mapped reader (the header parser: safetensors_header.cpp).
// The format and the rules: include/braid/ckpt/safetensors.h.

#include "braid/ckpt/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

#include "braid/ckpt/crc32c.h"
#include "ckpt/safetensors_internal.h"

namespace braid::ckpt {

namespace {

std::string errno_text() { return std::strerror(errno); }

void write_all(int fd, const void* data, size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, p, std::min<size_t>(n, size_t(1) << 30));
    if (w < 0 && errno == EINTR) continue;
    BRAID_CHECK(w > 0, "safetensors: writing ", path, ": ", errno_text());
    p += w;
    n -= size_t(w);
  }
}

void pwrite_all(int fd, const std::string& data, off_t at, const std::string& path) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t w = ::pwrite(fd, data.data() + done, data.size() - done, at + off_t(done));
    if (w < 0 && errno == EINTR) continue;
    BRAID_CHECK(w > 0, "safetensors: writing ", path, ": ", errno_text());
    done += size_t(w);
  }
}

std::string checksum_key(const std::string& name) { return "crc32c." + name; }

std::string hex8(uint32_t v) {
  char text[9];
  std::snprintf(text, sizeof text, "%08x", v);
  return text;
}

}  // namespace

// ---- the writer ----

void SafetensorsWriter::check_new_name(const std::string& name) const {
  BRAID_CONFIG_CHECK(name != "__metadata__", "safetensors: '__metadata__' is not a tensor name");
  for (const Entry& e : entries_)
    BRAID_CONFIG_CHECK(e.name != name, "safetensors: tensor '", name, "' added twice");
}

void SafetensorsWriter::add(const std::string& name, const Tensor& tensor) {
  BRAID_CONFIG_CHECK(tensor.defined(), "safetensors: tensor '", name, "' is undefined");
  check_new_name(name);
  Entry e;
  e.name = name;
  e.dtype = safetensors_dtype(tensor.dtype());
  e.shape.assign(tensor.shape().begin(), tensor.shape().end());
  e.tensor = tensor;
  e.nbytes = tensor.nbytes();
  entries_.push_back(std::move(e));
}

void SafetensorsWriter::add_bytes(const std::string& name, std::string_view dtype,
                                  std::span<const int64_t> shape, std::span<const uint8_t> bytes) {
  check_new_name(name);
  const size_t itemsize = safetensors_dtype_size(dtype);
  BRAID_CONFIG_CHECK(itemsize > 0, "safetensors: tensor '", name, "': unknown dtype '", dtype, "'");
  auto expected = byte_size(shape, itemsize);
  BRAID_CONFIG_CHECK(expected && *expected == bytes.size(), "safetensors: tensor '", name,
                     "': shape ", shape_str(shape), " of ", dtype, " does not match ", bytes.size(),
                     " bytes");
  Entry e;
  e.name = name;
  e.dtype = std::string(dtype);
  e.shape.assign(shape.begin(), shape.end());
  e.bytes.assign(bytes.begin(), bytes.end());
  e.nbytes = bytes.size();
  entries_.push_back(std::move(e));
}

void SafetensorsWriter::set_metadata(const std::string& key, const std::string& value) {
  metadata_[key] = value;
}

std::vector<const SafetensorsWriter::Entry*> SafetensorsWriter::ordered() const {
  std::vector<const Entry*> order;
  for (const Entry& e : entries_) order.push_back(&e);
  std::sort(order.begin(), order.end(), [](const Entry* a, const Entry* b) {
    int ra = dtype_rank(a->dtype), rb = dtype_rank(b->dtype);
    return ra != rb ? ra > rb : a->name < b->name;
  });
  return order;
}

std::string SafetensorsWriter::header() const {
  std::map<std::string, std::string> metadata = metadata_;
  if (checksums_)
    for (const Entry& e : entries_) metadata[checksum_key(e.name)] = hex8(0);
  return header_with(metadata);
}

std::string SafetensorsWriter::header_with(
    const std::map<std::string, std::string>& metadata) const {
  nlohmann::ordered_json json = nlohmann::ordered_json::object();
  if (!metadata.empty()) json["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const Entry* e : ordered()) {
    nlohmann::ordered_json entry;
    entry["dtype"] = e->dtype;
    entry["shape"] = e->shape;
    entry["data_offsets"] = {offset, offset + e->nbytes};
    json[e->name] = std::move(entry);
    offset += e->nbytes;
  }
  std::string text;
  try {
    text = json.dump();
  } catch (const nlohmann::json::exception& e) {
    BRAID_CONFIG_CHECK(false,
                       "safetensors: a tensor name or metadata string is not UTF-8: ", e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = char((uint64_t(text.size()) >> (8 * i)) & 0xff);
  return out + text;
}

void SafetensorsWriter::write(const std::string& path) const {
  const std::string head = header();
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  BRAID_CHECK(fd >= 0, "safetensors: cannot create ", path, ": ", errno_text());
  try {
    write_all(fd, head.data(), head.size(), path);
    constexpr int64_t kChunkBytes = int64_t(64) << 20;  // host staging for device tensors
    std::map<std::string, std::string> metadata = metadata_;
    for (const Entry* e : ordered()) {
      uint32_t crc = 0;
      auto put = [&](const void* data, size_t n) {
        write_all(fd, data, n, path);
        if (checksums_) crc = crc32c({static_cast<const uint8_t*>(data), n}, crc);
      };
      if (!e->tensor.defined()) {
        put(e->bytes.data(), e->bytes.size());
      } else if (e->tensor.device().is_cpu()) {
        if (e->nbytes > 0) put(e->tensor.data(), e->nbytes);
      } else {
        const Tensor flat = e->tensor.view({e->tensor.numel()});
        const int64_t step = std::max<int64_t>(1, kChunkBytes / int64_t(dtype_size(flat.dtype())));
        for (int64_t at = 0; at < flat.numel(); at += step) {
          const int64_t count = std::min(step, flat.numel() - at);
          Tensor host = flat.slice(at, {count}).to(Device::cpu());
          put(host.data(), host.nbytes());
        }
      }
      if (checksums_) metadata[checksum_key(e->name)] = hex8(crc);
    }
    if (checksums_) {
      const std::string final_head = header_with(metadata);
      BRAID_CHECK(final_head.size() == head.size(), "safetensors: ", path,
                  ": the header with the checksums changed length");
      pwrite_all(fd, final_head, 0, path);
    }
    BRAID_CHECK(::fsync(fd) == 0, "safetensors: fsync of ", path, ": ", errno_text());
  } catch (...) {
    ::close(fd);
    throw;
  }
  BRAID_CHECK(::close(fd) == 0, "safetensors: closing ", path, ": ", errno_text());
}

// ---- the reader ----

struct SafetensorsFile::Mapping {
  void* data = nullptr;
  size_t size = 0;
  ~Mapping() {
    if (data) ::munmap(data, size);
  }
};

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile f;
  f.path_ = path;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  BRAID_CONFIG_CHECK(fd >= 0, "safetensors file ", path, ": cannot open: ", errno_text());
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const std::string why = errno_text();
    ::close(fd);
    BRAID_FAIL("safetensors file ", path, ": fstat: ", why);
  }
  f.mapping_ = std::make_shared<Mapping>();
  f.mapping_->size = size_t(st.st_size);
  if (f.mapping_->size > 0) {
    // Private and writable: a view may be written to, and the file never changes.
    void* p = ::mmap(nullptr, f.mapping_->size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_NORESERVE,
                     fd, 0);
    if (p == MAP_FAILED) {
      const std::string why = errno_text();
      ::close(fd);
      BRAID_FAIL("safetensors file ", path, ": mmap: ", why);
    }
    f.mapping_->data = p;
  }
  ::close(fd);
  const auto* bytes = static_cast<const uint8_t*>(f.mapping_->data);
  f.header_ = parse_safetensors_header({bytes, f.mapping_->size}, path);
  for (size_t i = 0; i < f.header_.tensors.size(); ++i) f.index_[f.header_.tensors[i].name] = i;
  return f;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  for (const TensorInfo& info : header_.tensors) out.push_back(info.name);
  return out;
}

bool SafetensorsFile::contains(const std::string& name) const { return index_.count(name) > 0; }

const TensorInfo& SafetensorsFile::info(const std::string& name) const {
  auto it = index_.find(name);
  BRAID_CONFIG_CHECK(it != index_.end(), "safetensors file ", path_, ": no tensor '", name, "'");
  return header_.tensors[it->second];
}

std::span<const uint8_t> SafetensorsFile::bytes(const std::string& name) const {
  const TensorInfo& i = info(name);
  const auto* base = static_cast<const uint8_t*>(mapping_->data);
  if (i.nbytes() == 0) return {};
  return {base + header_.data_start + i.begin, size_t(i.nbytes())};
}

bool SafetensorsFile::check_checksum(const std::string& name) const {
  const auto it = header_.metadata.find(checksum_key(name));
  if (it == header_.metadata.end()) return false;
  const std::string found = hex8(crc32c(bytes(name)));
  BRAID_CONFIG_CHECK(found == it->second, "safetensors file ", path_, ": tensor '", name,
                     "' does not match the CRC-32C saved with it (saved ", it->second, ", read ",
                     found, "): the file was damaged after it was written");
  return true;
}

namespace {
Shape braid_shape(const TensorInfo& info, const std::string& path) {
  BRAID_CONFIG_CHECK(info.shape.size() <= size_t(kMaxDims), "safetensors file ", path, ": tensor '",
                     info.name, "' has ", info.shape.size(), " dims; braid tensors have at most ",
                     kMaxDims);
  return Shape(std::span<const int64_t>(info.shape));
}
}  // namespace

Tensor SafetensorsFile::view(const std::string& name) const {
  const TensorInfo& i = info(name);
  auto dtype = braid_dtype(i.dtype);
  BRAID_CONFIG_CHECK(dtype.has_value(), "safetensors file ", path_, ": tensor '", name,
                     "' has dtype ", i.dtype, ", which braid tensors do not have (use bytes())");
  Shape shape = braid_shape(i, path_);
  auto* p = static_cast<uint8_t*>(mapping_->data) + header_.data_start + i.begin;
  BRAID_CONFIG_CHECK(reinterpret_cast<uintptr_t>(p) % dtype_size(*dtype) == 0, "safetensors file ",
                     path_, ": tensor '", name,
                     "' is not aligned to its dtype in the file (read() copies it)");
  if (i.nbytes() == 0) return Tensor::empty(shape, *dtype);
  std::shared_ptr<Mapping> keep = mapping_;
  return Tensor::from_blob(p, shape, *dtype, Device::cpu(), [keep] {});
}

Tensor SafetensorsFile::read(const std::string& name, Device device) const {
  const TensorInfo& i = info(name);
  auto dtype = braid_dtype(i.dtype);
  BRAID_CONFIG_CHECK(dtype.has_value(), "safetensors file ", path_, ": tensor '", name,
                     "' has dtype ", i.dtype, ", which braid tensors do not have (use bytes())");
  Shape shape = braid_shape(i, path_);
  Tensor host = Tensor::empty(shape, *dtype);
  std::span<const uint8_t> src = bytes(name);
  if (!src.empty()) std::memcpy(host.data(), src.data(), src.size());
  return device.is_cpu() ? host : host.to(device);
}

}  // namespace braid::ckpt
