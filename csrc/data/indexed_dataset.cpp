// The .idx parser, the read-only mappings and the reader (the writer is in
// indexed_dataset_writer.cpp). Layout: docs/formats.md.

#include "braid/data/indexed_dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <limits>

#include "braid/core/error.h"

namespace braid::data {

static_assert(std::endian::native == std::endian::little,
              "the .idx/.bin format is little-endian; braid reads it in place");

namespace {

constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr size_t kHeaderBytes = 34;  // magic 9, version 8, token type 1, two counts 8 + 8

template <typename T>
T load(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

std::string printable(std::span<const std::byte> bytes) {
  std::string out;
  for (std::byte b : bytes) {
    auto c = static_cast<unsigned char>(b);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out += char(c);
    } else {
      static const char* hex = "0123456789abcdef";
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  return out;
}

}  // namespace

size_t token_size(TokenType type) {
  switch (type) {
    case TokenType::u8:
    case TokenType::i8:
      return 1;
    case TokenType::i16:
    case TokenType::u16:
      return 2;
    case TokenType::i32:
    case TokenType::f32:
      return 4;
    case TokenType::i64:
    case TokenType::f64:
      return 8;
  }
  BRAID_FAIL("token_size: invalid token type code ", int(type));
}

const char* token_type_name(TokenType type) {
  switch (type) {
    case TokenType::u8:
      return "u8";
    case TokenType::i8:
      return "i8";
    case TokenType::i16:
      return "i16";
    case TokenType::i32:
      return "i32";
    case TokenType::i64:
      return "i64";
    case TokenType::f64:
      return "f64";
    case TokenType::f32:
      return "f32";
    case TokenType::u16:
      return "u16";
  }
  return "invalid";
}

TokenType token_type_from_name(std::string_view s) {
  static const std::pair<std::string_view, TokenType> names[] = {
      {"u8", TokenType::u8},     {"uint8", TokenType::u8},    {"i8", TokenType::i8},
      {"int8", TokenType::i8},   {"i16", TokenType::i16},     {"int16", TokenType::i16},
      {"i32", TokenType::i32},   {"int32", TokenType::i32},   {"i64", TokenType::i64},
      {"int64", TokenType::i64}, {"f64", TokenType::f64},     {"float64", TokenType::f64},
      {"f32", TokenType::f32},   {"float32", TokenType::f32}, {"u16", TokenType::u16},
      {"uint16", TokenType::u16}};
  for (const auto& [name, type] : names) {
    if (name == s) return type;
  }
  BRAID_CONFIG_CHECK(false, "unknown token type '", s,
                     "' (expected u8, i8, i16, u16, i32, i64, f32 or f64)");
  return TokenType::i32;
}

bool is_valid_token_type_code(uint8_t code) { return code >= 1 && code <= 8; }

TokenType smallest_token_type(int64_t vocab_size) {
  BRAID_CONFIG_CHECK(vocab_size >= 0, "smallest_token_type: vocab_size must be >= 0, got ",
                     vocab_size);
  return vocab_size < 65500 ? TokenType::u16 : TokenType::i32;
}

bool token_fits(TokenType type, int64_t t) {
  switch (type) {
    case TokenType::u8:
      return t >= 0 && t <= 255;
    case TokenType::i8:
      return t >= -128 && t <= 127;
    case TokenType::i16:
      return t >= -32768 && t <= 32767;
    case TokenType::u16:
      return t >= 0 && t <= 65535;
    case TokenType::i32:
      return t >= std::numeric_limits<int32_t>::min() && t <= std::numeric_limits<int32_t>::max();
    case TokenType::i64:
      return true;
    case TokenType::f32:
      return t >= -(int64_t(1) << 24) && t <= (int64_t(1) << 24);
    case TokenType::f64:
      return t >= -(int64_t(1) << 53) && t <= (int64_t(1) << 53);
  }
  return false;
}

// ---- the parser --------------------------------------------------------------------------

Index parse_index(std::span<const std::byte> idx, uint64_t bin_size, const std::string& name) {
  const std::string file = name + ".idx";
  const uint64_t size = idx.size();
  const std::byte* p = idx.data();
  auto need = [&](uint64_t bytes, const char* field) {
    BRAID_CONFIG_CHECK(size >= bytes, file, ": ", field, ": file is truncated (", size,
                       " bytes, the header needs ", kHeaderBytes, ")");
  };

  need(9, "magic");
  BRAID_CONFIG_CHECK(std::memcmp(p, kMagic, 9) == 0, file,
                     ": magic: expected \"MMIDIDX\\x00\\x00\"", ", got \"", printable(idx.first(9)),
                     "\" (not a Megatron indexed dataset)");
  need(17, "version");
  const uint64_t version = load<uint64_t>(p + 9);
  BRAID_CONFIG_CHECK(version == 1, file, ": version: expected 1, got ", version);
  need(18, "token type");
  const auto code = static_cast<uint8_t>(p[17]);
  BRAID_CONFIG_CHECK(is_valid_token_type_code(code), file, ": token type: unknown code ", int(code),
                     " (megatron-core's DType codes are 1 to 8)");
  need(kHeaderBytes, "sequence/document count");
  const uint64_t num_sequences = load<uint64_t>(p + 18);
  const uint64_t num_doc_entries = load<uint64_t>(p + 26);

  // The counts must account for every byte of the file. Divide first: the counts are
  // untrusted and 12 * count could wrap.
  const uint64_t body = size - kHeaderBytes;
  BRAID_CONFIG_CHECK(num_sequences <= body / 12, file, ": sequence count: ", num_sequences,
                     " sequences (12 bytes each) need more than the file's ", size, " bytes");
  BRAID_CONFIG_CHECK(num_doc_entries <= (body - 12 * num_sequences) / 8, file,
                     ": document count: ", num_doc_entries, " document indices (8 bytes each) and ",
                     num_sequences, " sequences need more than the file's ", size, " bytes");
  BRAID_CONFIG_CHECK(num_doc_entries >= 1, file,
                     ": document count: 0, but the document indices start with 0 (megatron-core "
                     "counts that entry: the count is the number of documents + 1)");
  const uint64_t plain = kHeaderBytes + 12 * num_sequences + 8 * num_doc_entries;
  Index index;
  index.token_type = TokenType(code);
  if (size == plain + num_sequences && num_sequences > 0) {
    index.multimodal = true;  // one int8 mode per sequence follows the document indices
  } else {
    BRAID_CONFIG_CHECK(size == plain, file, ": sequence/document count: ", num_sequences,
                       " sequences and ", num_doc_entries, " document indices make a ", plain,
                       "-byte file (", plain + num_sequences,
                       " with multimodal sequence modes), but it has ", size, " bytes");
  }

  const std::byte* at = p + kHeaderBytes;
  index.sequence_lengths = PackedArray<int32_t>(at, num_sequences);
  at += 4 * num_sequences;
  index.sequence_pointers = PackedArray<int64_t>(at, num_sequences);
  at += 8 * num_sequences;
  index.document_indices = PackedArray<int64_t>(at, num_doc_entries);
  at += 8 * num_doc_entries;
  if (index.multimodal) index.sequence_modes = PackedArray<int8_t>(at, num_sequences);

  // Sequences lie back to back in .bin from byte 0, exactly as megatron-core writes them, and
  // the last one ends at the end of .bin.
  const uint64_t item = token_size(index.token_type);
  uint64_t end = 0;  // where the previous sequence ended, <= bin_size
  for (uint64_t i = 0; i < num_sequences; ++i) {
    const int32_t length = index.sequence_lengths[i];
    BRAID_CONFIG_CHECK(length >= 0, file, ": sequence_lengths[", i, "] = ", length, " is negative");
    const int64_t pointer = index.sequence_pointers[i];
    if (uint64_t(pointer) != end || pointer < 0) {
      BRAID_CONFIG_CHECK(i > 0, file, ": sequence_pointers[0] = ", pointer,
                         ": the first sequence must start at byte 0 of ", name, ".bin");
      BRAID_CONFIG_CHECK(pointer > 0 && uint64_t(pointer) > end, file, ": sequence_pointers[", i,
                         "] = ", pointer, " overlaps sequence ", i - 1, " (bytes ",
                         index.sequence_pointers[i - 1], " to ", end, " of ", name,
                         ".bin) or goes backwards");
      BRAID_CONFIG_CHECK(uint64_t(pointer) <= bin_size, file, ": sequence_pointers[", i,
                         "] = ", pointer, " points past the end of ", name, ".bin (", bin_size,
                         " bytes)");
      BRAID_CONFIG_CHECK(false, file, ": sequence_pointers[", i, "] = ", pointer,
                         " leaves a gap after sequence ", i - 1, ", which ends at byte ", end,
                         " (sequences must be back to back)");
    }
    const uint64_t bytes = uint64_t(length) * item;
    BRAID_CONFIG_CHECK(bytes <= bin_size - end, file, ": sequence ", i, " (sequence_pointers[", i,
                       "] = ", pointer, ", sequence_lengths[", i, "] = ", length, ") ends at byte ",
                       end + bytes, ", past the end of ", name, ".bin (", bin_size,
                       " bytes): the .bin is truncated or belongs to another .idx");
    end += bytes;
  }
  BRAID_CONFIG_CHECK(end == bin_size, name, ".bin: has ", bin_size, " bytes, but the sequences in ",
                     file, " end at byte ", end, " (", bin_size - end,
                     " bytes left over): the .bin belongs to another .idx");

  int64_t previous = 0;
  for (uint64_t j = 0; j < num_doc_entries; ++j) {
    const int64_t d = index.document_indices[j];
    BRAID_CONFIG_CHECK(j > 0 || d == 0, file, ": document_indices[0] = ", d, ", expected 0");
    BRAID_CONFIG_CHECK(d >= previous, file, ": document_indices[", j, "] = ", d,
                       " is less than document_indices[", j - 1, "] = ", previous,
                       " (must not decrease)");
    BRAID_CONFIG_CHECK(uint64_t(d) <= num_sequences, file, ": document_indices[", j, "] = ", d,
                       " is past the sequence count ", num_sequences);
    previous = d;
  }
  BRAID_CONFIG_CHECK(uint64_t(previous) == num_sequences, file, ": document_indices[",
                     num_doc_entries - 1, "] = ", previous,
                     ": the last document index must equal the sequence count ", num_sequences);
  return index;
}

// ---- MappedFile --------------------------------------------------------------------------

MappedFile::MappedFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  BRAID_CONFIG_CHECK(fd >= 0, path, ": cannot open: ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    BRAID_FAIL(path, ": cannot stat: ", std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    BRAID_CONFIG_CHECK(false, path, ": not a regular file");
  }
  size_ = size_t(st.st_size);
  if (size_ > 0) {
    void* m = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
    int e = errno;
    ::close(fd);  // the mapping keeps the file
    BRAID_CHECK(m != MAP_FAILED, path, ": cannot map ", size_, " bytes: ", std::strerror(e));
    data_ = static_cast<const std::byte*>(m);
  } else {
    ::close(fd);
  }
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<std::byte*>(data_), size_);
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : path_(std::move(other.path_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    if (data_) ::munmap(const_cast<std::byte*>(data_), size_);
    path_ = std::move(other.path_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

// ---- IndexedDataset ----------------------------------------------------------------------

IndexedDataset IndexedDataset::open(const std::string& path_prefix) {
  MappedFile idx(path_prefix + ".idx");
  MappedFile bin(path_prefix + ".bin");
  return IndexedDataset(path_prefix, std::move(idx), std::move(bin));
}

IndexedDataset::IndexedDataset(std::string path_prefix, MappedFile idx, MappedFile bin)
    : path_prefix_(std::move(path_prefix)), idx_(std::move(idx)), bin_(std::move(bin)) {
  // The views point into idx_'s mapping, which moves with the dataset (the pointer, not the
  // pages), so they stay valid when the dataset is moved.
  index_ = parse_index(idx_.bytes(), bin_.bytes().size(), path_prefix_);
  num_tokens_ = int64_t(bin_.bytes().size() / token_size(index_.token_type));
}

std::span<const std::byte> IndexedDataset::sequence_bytes(size_t i) const {
  BRAID_CONFIG_CHECK(i < num_sequences(), path_prefix_, ": sequence ", i, " out of range (",
                     num_sequences(), " sequences)");
  const size_t item = token_size(index_.token_type);
  return bin_.bytes().subspan(size_t(index_.sequence_pointers[i]),
                              size_t(index_.sequence_lengths[i]) * item);
}

namespace {

// Widens n stored tokens to int32; the pointer is aligned for T (sequences start at multiples
// of the token size in a page-aligned mapping).
template <typename T>
void widen(const std::byte* src, int64_t n, int32_t* out, const std::string& prefix, size_t seq) {
  const T* in = reinterpret_cast<const T*>(src);
  for (int64_t k = 0; k < n; ++k) {
    const T v = in[k];
    if constexpr (std::is_floating_point_v<T>) {
      BRAID_CONFIG_CHECK(v >= T(std::numeric_limits<int32_t>::min()) &&
                             v <= T(std::numeric_limits<int32_t>::max()) && v == T(int64_t(v)),
                         prefix, ".bin: sequence ", seq, " holds ", v,
                         ", which is not an int32 token id");
    } else if constexpr (sizeof(T) > 4) {
      BRAID_CONFIG_CHECK(
          v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max(),
          prefix, ".bin: sequence ", seq, " holds ", v, ", which does not fit an int32 token id");
    }
    out[k] = int32_t(v);
  }
}

}  // namespace

void IndexedDataset::read(size_t i, int64_t offset, int64_t length, int32_t* out) const {
  BRAID_CONFIG_CHECK(i < num_sequences(), path_prefix_, ": sequence ", i, " out of range (",
                     num_sequences(), " sequences)");
  const int64_t n = index_.sequence_lengths[i];
  BRAID_CONFIG_CHECK(offset >= 0 && length >= 0 && offset <= n && length <= n - offset,
                     path_prefix_, ": tokens [", offset, ", ", offset + length, ") of sequence ", i,
                     " are out of range (it has ", n, " tokens)");
  if (length == 0) return;
  const size_t item = token_size(index_.token_type);
  const std::byte* src = bin_.bytes().data() + index_.sequence_pointers[i] + size_t(offset) * item;
  switch (index_.token_type) {
    case TokenType::u8:
      return widen<uint8_t>(src, length, out, path_prefix_, i);
    case TokenType::i8:
      return widen<int8_t>(src, length, out, path_prefix_, i);
    case TokenType::i16:
      return widen<int16_t>(src, length, out, path_prefix_, i);
    case TokenType::u16:
      return widen<uint16_t>(src, length, out, path_prefix_, i);
    case TokenType::i32:
      std::memcpy(out, src, size_t(length) * 4);
      return;
    case TokenType::i64:
      return widen<int64_t>(src, length, out, path_prefix_, i);
    case TokenType::f32:
      return widen<float>(src, length, out, path_prefix_, i);
    case TokenType::f64:
      return widen<double>(src, length, out, path_prefix_, i);
  }
}

std::vector<int32_t> IndexedDataset::read(size_t i) const {
  BRAID_CONFIG_CHECK(i < num_sequences(), path_prefix_, ": sequence ", i, " out of range (",
                     num_sequences(), " sequences)");
  std::vector<int32_t> out(size_t(index_.sequence_lengths[i]));
  read(i, 0, int64_t(out.size()), out.data());
  return out;
}

}  // namespace braid::data
