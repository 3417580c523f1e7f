#pragma once
// Megatron's indexed dataset ("MMIDIDX"): `prefix.bin` holds the tokens of every sequence back
// to back; `prefix.idx` says how long each sequence is, where it starts in `.bin`, and which
// sequences make up each document. Byte-compatible with megatron-core's IndexedDataset and
// IndexedDatasetBuilder in both directions; docs/formats.md gives the layout byte by byte.
//
//   IndexedDataset::open(prefix)   maps both files read-only; nothing is copied
//   IndexedDatasetWriter           writes prefix.bin / prefix.idx (temporary names until finalize)
//   parse_index(bytes, bin_size)   the validating .idx parser on its own (the fuzz target's entry)
//
// Every field of an .idx is checked when it is opened (magic, version, token type, counts,
// lengths, pointers against the .bin's size, document indices), so a corrupt or mismatched
// pair fails at open with the file and the field in the message (a ConfigError: ValueError in
// Python), never later with a crash or a silently wrong sample.

#include <compare>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace braid::data {

// The numeric codes are megatron-core's DType enum (the byte at offset 17 of an .idx).
enum class TokenType : uint8_t {
  u8 = 1,
  i8 = 2,
  i16 = 3,
  i32 = 4,
  i64 = 5,
  f64 = 6,
  f32 = 7,
  u16 = 8
};

size_t token_size(TokenType type);                   // bytes per token
const char* token_type_name(TokenType type);         // "u16", ...
TokenType token_type_from_name(std::string_view s);  // "u16" or numpy's "uint16"; ConfigError else
bool is_valid_token_type_code(uint8_t code);
// Megatron's choice for a vocabulary of this size: u16 below 65500 tokens, i32 otherwise.
TokenType smallest_token_type(int64_t vocab_size);
// Whether `token` is stored exactly by `type` (floats: integers up to 2^24 / 2^53 in magnitude).
bool token_fits(TokenType type, int64_t token);

// A read-only array of T stored at any byte offset (the .idx arrays start at byte 34, so they
// are never aligned for their types, and a T* into them would be undefined behaviour). Reads go
// through memcpy, which compiles to one plain load. Zero-copy: it points into the mapped file,
// and is valid while the dataset that handed it out is alive.
template <typename T>
class PackedArray {
 public:
  class iterator {
   public:
    using iterator_concept = std::random_access_iterator_tag;
    using iterator_category = std::random_access_iterator_tag;
    using value_type = T;
    using difference_type = std::ptrdiff_t;
    using reference = T;
    using pointer = void;

    iterator() = default;
    explicit iterator(const std::byte* p) : p_(p) {}
    T operator*() const { return load(p_); }
    T operator[](difference_type n) const { return load(p_ + n * difference_type(sizeof(T))); }
    iterator& operator++() { return *this += 1; }
    iterator operator++(int) { return std::exchange(*this, *this + 1); }
    iterator& operator--() { return *this -= 1; }
    iterator operator--(int) { return std::exchange(*this, *this - 1); }
    iterator& operator+=(difference_type n) {
      p_ += n * difference_type(sizeof(T));
      return *this;
    }
    iterator& operator-=(difference_type n) { return *this += -n; }
    friend iterator operator+(iterator it, difference_type n) { return it += n; }
    friend iterator operator+(difference_type n, iterator it) { return it += n; }
    friend iterator operator-(iterator it, difference_type n) { return it -= n; }
    friend difference_type operator-(iterator a, iterator b) {
      return (a.p_ - b.p_) / difference_type(sizeof(T));
    }
    friend bool operator==(iterator a, iterator b) { return a.p_ == b.p_; }
    friend auto operator<=>(iterator a, iterator b) { return a.p_ <=> b.p_; }

   private:
    const std::byte* p_ = nullptr;
  };

  PackedArray() = default;
  PackedArray(const std::byte* data, size_t size) : data_(data), size_(size) {}

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  T operator[](size_t i) const { return load(data_ + i * sizeof(T)); }
  T front() const { return (*this)[0]; }
  T back() const { return (*this)[size_ - 1]; }
  iterator begin() const { return iterator(data_); }
  iterator end() const { return iterator(data_ + size_ * sizeof(T)); }
  const std::byte* bytes() const { return data_; }  // the raw little-endian entries
  size_t nbytes() const { return size_ * sizeof(T); }
  std::vector<T> to_vector() const { return std::vector<T>(begin(), end()); }

 private:
  static T load(const std::byte* p) {
    T v;
    std::memcpy(&v, p, sizeof(T));
    return v;
  }
  const std::byte* data_ = nullptr;
  size_t size_ = 0;
};

// A parsed and validated .idx, as views into the buffer it was parsed from.
struct Index {
  TokenType token_type = TokenType::i32;
  PackedArray<int32_t> sequence_lengths;   // tokens per sequence
  PackedArray<int64_t> sequence_pointers;  // byte offset of each sequence in .bin
  PackedArray<int64_t> document_indices;   // num_documents + 1 entries: 0, ..., num_sequences
  PackedArray<int8_t> sequence_modes;      // multimodal files only (one per sequence), else empty
  bool multimodal = false;

  size_t num_sequences() const { return sequence_lengths.size(); }
  size_t num_documents() const { return document_indices.size() - 1; }
};

// Parses and validates the bytes of an .idx whose .bin has `bin_size` bytes. `name` is the path
// prefix; errors read "<name>.idx: <field>: ..." (ConfigError). Checked: the magic, version 1,
// the token type code, that the counts match the file's size exactly (with or without
// multimodal sequence modes, told apart by that size), lengths >= 0, pointers that start at 0
// and run back to back (each sequence starts where the previous one ended) and end exactly at
// the end of .bin, document indices that start at 0, never decrease and end at the sequence
// count. Sequence modes may be any int8 (megatron-core gives them no meaning of its own). Never
// reads outside `idx`.
Index parse_index(std::span<const std::byte> idx, uint64_t bin_size, const std::string& name);

// A read-only memory mapping of a whole file (empty files map to an empty span).
class MappedFile {
 public:
  explicit MappedFile(const std::string& path);  // ConfigError if it cannot be opened
  ~MappedFile();
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  std::span<const std::byte> bytes() const { return {data_, size_}; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const std::byte* data_ = nullptr;
  size_t size_ = 0;
};

class IndexedDataset {
 public:
  // Maps path_prefix.idx and path_prefix.bin read-only and validates the index.
  static IndexedDataset open(const std::string& path_prefix);

  TokenType token_type() const { return index_.token_type; }
  size_t num_sequences() const { return index_.num_sequences(); }
  size_t num_documents() const { return index_.num_documents(); }
  int64_t num_tokens() const { return num_tokens_; }
  PackedArray<int32_t> sequence_lengths() const { return index_.sequence_lengths; }
  PackedArray<int64_t> sequence_pointers() const { return index_.sequence_pointers; }
  PackedArray<int64_t> document_indices() const { return index_.document_indices; }
  bool multimodal() const { return index_.multimodal; }
  PackedArray<int8_t> sequence_modes() const { return index_.sequence_modes; }

  // Tokens [offset, offset + length) of sequence i, widened to int32 (ConfigError if out of
  // bounds, or if a stored token does not fit int32 exactly: i64 beyond int32, fractional f32).
  void read(size_t i, int64_t offset, int64_t length, int32_t* out) const;
  std::vector<int32_t> read(size_t i) const;  // the whole sequence
  // Sequence i's tokens as stored (token_size(token_type()) bytes each), zero-copy.
  std::span<const std::byte> sequence_bytes(size_t i) const;

  const std::string& path_prefix() const { return path_prefix_; }

 private:
  IndexedDataset(std::string path_prefix, MappedFile idx, MappedFile bin);

  std::string path_prefix_;
  MappedFile idx_;
  MappedFile bin_;
  Index index_;
  int64_t num_tokens_ = 0;
};

// Writes path_prefix.bin and path_prefix.idx as megatron-core's IndexedDatasetBuilder does
// (the same bytes for the same input). Both are written under temporary names
// (path_prefix.bin.tmp, path_prefix.idx.tmp) and renamed by finalize(), .idx last, so a crash
// never leaves a pair that looks complete; destroying a writer that was not finalized removes
// the temporary files.
class IndexedDatasetWriter {
 public:
  IndexedDatasetWriter(const std::string& path_prefix, TokenType type);
  ~IndexedDatasetWriter();
  IndexedDatasetWriter(IndexedDatasetWriter&&) noexcept = default;
  IndexedDatasetWriter& operator=(IndexedDatasetWriter&&) = delete;
  IndexedDatasetWriter(const IndexedDatasetWriter&) = delete;
  IndexedDatasetWriter& operator=(const IndexedDatasetWriter&) = delete;

  // Appends one sequence to the current document (ConfigError if a token does not fit the type).
  void add_sequence(std::span<const int32_t> tokens);
  void add_sequence(std::span<const int64_t> tokens);
  // Closes the current document (a document with no sequences is allowed, as in Megatron).
  void end_document();
  void add_document(std::span<const int32_t> tokens) {
    add_sequence(tokens);
    end_document();
  }
  void add_document(std::span<const int64_t> tokens) {
    add_sequence(tokens);
    end_document();
  }
  // Many documents at once: `tokens` back to back, cut into sequences by `sequence_lengths` and
  // the sequences into documents by `sequences_per_document`. Everything is checked before
  // anything is written (the sums must match, every token must fit), so a bad batch adds nothing.
  void add_documents(std::span<const int32_t> tokens, std::span<const int64_t> sequence_lengths,
                     std::span<const int64_t> sequences_per_document);
  // Ends a document left open, writes the .idx and renames both files into place.
  void finalize();
  // Gives up: closes and removes the temporary files (what the destructor does when finalize()
  // was not called). Nothing can be added afterwards.
  void discard() noexcept;

  TokenType token_type() const { return type_; }
  size_t num_sequences() const { return lengths_.size(); }
  size_t num_documents() const { return documents_.size() - 1; }
  int64_t num_tokens() const { return num_tokens_; }
  bool finalized() const { return finalized_; }
  const std::string& path_prefix() const { return path_prefix_; }

 private:
  struct FileCloser {
    void operator()(std::FILE* f) const;
  };
  template <typename T>
  void add_tokens(std::span<const T> tokens);

  std::string path_prefix_;
  TokenType type_;
  std::unique_ptr<std::FILE, FileCloser> bin_;
  std::vector<int32_t> lengths_;
  std::vector<int64_t> documents_{0};
  std::vector<std::byte> buffer_;  // one sequence converted to the file's type
  int64_t num_tokens_ = 0;
  bool finalized_ = false;
};

}  // namespace braid::data
