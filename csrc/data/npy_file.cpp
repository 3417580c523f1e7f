#include "braid/data/npy_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

namespace braid::data {

namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicSize = 6;
constexpr size_t kPreamble = kMagicSize + 2 + 2;  // magic, version, header length (v1.0)

const char* descr_of(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return "<f4";
    case DType::i32:
      return "<i4";
    case DType::i64:
      return "<i8";
    case DType::u8:
      return "|u1";
    default:
      return nullptr;
  }
}

DType dtype_of(const std::string& descr, const std::string& path) {
  for (DType t : {DType::f32, DType::i32, DType::i64, DType::u8})
    if (descr == descr_of(t)) return t;
  BRAID_CONFIG_CHECK(false, path, ": unsupported .npy dtype '", descr, "'");
  return DType::u8;
}

// The value that follows 'key': in the header dict, up to the next top-level comma or brace.
std::string header_value(const std::string& header, const std::string& key,
                         const std::string& path) {
  size_t at = header.find("'" + key + "'");
  BRAID_CONFIG_CHECK(at != std::string::npos, path, ": .npy header has no '", key, "'");
  at = header.find(':', at);
  BRAID_CONFIG_CHECK(at != std::string::npos, path, ": bad .npy header");
  ++at;
  while (at < header.size() && header[at] == ' ') ++at;
  size_t end = at;
  if (at < header.size() && header[at] == '(') {
    end = header.find(')', at);
    BRAID_CONFIG_CHECK(end != std::string::npos, path, ": bad .npy shape");
    return header.substr(at + 1, end - at - 1);
  }
  while (end < header.size() && header[end] != ',' && header[end] != '}') ++end;
  std::string v = header.substr(at, end - at);
  while (!v.empty() && v.back() == ' ') v.pop_back();
  if (v.size() >= 2 && (v.front() == '\'' || v.front() == '"')) v = v.substr(1, v.size() - 2);
  return v;
}

std::vector<int64_t> parse_shape(const std::string& text, const std::string& path) {
  std::vector<int64_t> dims;
  size_t i = 0;
  while (i < text.size()) {
    if (text[i] == ' ' || text[i] == ',') {
      ++i;
      continue;
    }
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(text.substr(i), &used);
    } catch (const std::exception&) {
      BRAID_CONFIG_CHECK(false, path, ": bad .npy shape (", text, ")");
    }
    BRAID_CONFIG_CHECK(v >= 0, path, ": negative .npy dimension");
    dims.push_back(v);
    i += used;
  }
  BRAID_CONFIG_CHECK(dims.size() <= size_t(kMaxDims), path, ": .npy with ", dims.size(),
                     " dims (at most ", kMaxDims, ")");
  return dims;
}

}  // namespace

void write_npy(const std::string& path, const Tensor& tensor) {
  BRAID_CHECK(tensor.device().is_cpu(), "write_npy: a CPU tensor, got ", tensor.device().str());
  const char* descr = descr_of(tensor.dtype());
  BRAID_CHECK(descr, "write_npy: unsupported dtype ", dtype_name(tensor.dtype()));
  std::string shape;  // "n, 2"; a single dim is "n," as in Python's tuple
  for (int i = 0; i < tensor.dim(); ++i) shape += (i ? ", " : "") + std::to_string(tensor.size(i));
  if (tensor.dim() == 1) shape += ",";
  std::string header =
      std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': (" + shape + "), }";
  size_t total = (kPreamble + header.size() + 1 + 63) / 64 * 64;
  header.append(total - kPreamble - header.size() - 1, ' ');
  header += '\n';

  std::FILE* f = std::fopen(path.c_str(), "wb");
  BRAID_CHECK(f, "cannot write ", path, ": ", std::strerror(errno));
  uint16_t header_len = uint16_t(header.size());
  unsigned char version[2] = {1, 0};
  bool ok = std::fwrite(kMagic, 1, kMagicSize, f) == kMagicSize &&
            std::fwrite(version, 1, 2, f) == 2 &&
            std::fwrite(&header_len, 2, 1, f) == 1 &&  // little-endian hosts only
            std::fwrite(header.data(), 1, header.size(), f) == header.size() &&
            (tensor.nbytes() == 0 ||
             std::fwrite(tensor.data(), 1, tensor.nbytes(), f) == tensor.nbytes());
  ok = (std::fflush(f) == 0) && ok;
  ok = (std::fclose(f) == 0) && ok;
  BRAID_CHECK(ok, "cannot write ", path, ": ", std::strerror(errno));
}

Tensor read_npy(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  BRAID_CONFIG_CHECK(fd >= 0, "cannot open ", path, ": ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    BRAID_CONFIG_CHECK(false, "cannot stat ", path, ": ", std::strerror(errno));
  }
  const size_t size = size_t(st.st_size);
  void* map = nullptr;
  if (size > 0) map = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  ::close(fd);
  BRAID_CONFIG_CHECK(map != MAP_FAILED, "cannot map ", path, ": ", std::strerror(errno));
  auto unmap = [map, size] {
    if (map) ::munmap(map, size);
  };
  try {
    const char* bytes = static_cast<const char*>(map);
    BRAID_CONFIG_CHECK(size >= kPreamble && std::memcmp(bytes, kMagic, kMagicSize) == 0, path,
                       ": not a .npy file");
    BRAID_CONFIG_CHECK(bytes[6] == 1, path, ": .npy version ", int(bytes[6]),
                       ".x (braid reads 1.0)");
    uint16_t header_len;
    std::memcpy(&header_len, bytes + 8, 2);
    size_t offset = kPreamble + header_len;
    BRAID_CONFIG_CHECK(offset <= size, path, ": truncated .npy header");
    std::string header(bytes + kPreamble, header_len);
    DType dtype = dtype_of(header_value(header, "descr", path), path);
    BRAID_CONFIG_CHECK(header_value(header, "fortran_order", path) == "False", path,
                       ": Fortran-order .npy");
    std::vector<int64_t> dims = parse_shape(header_value(header, "shape", path), path);
    Shape shape{std::span<const int64_t>(dims)};
    size_t nbytes = size_t(shape.numel()) * dtype_size(dtype);
    BRAID_CONFIG_CHECK(size - offset == nbytes, path, ": ", size - offset,
                       " bytes of data, the header says ", nbytes, " (truncated or corrupt)");
    if (offset % dtype_size(dtype) != 0) {  // not written by braid: copy to aligned memory
      Tensor out = Tensor::empty(shape, dtype);
      if (nbytes) std::memcpy(out.data(), bytes + offset, nbytes);
      unmap();
      return out;
    }
    return Tensor::from_blob(nbytes ? const_cast<char*>(bytes) + offset : nullptr, shape, dtype,
                             Device::cpu(), unmap);
  } catch (...) {
    unmap();
    throw;
  }
}

}  // namespace braid::data
