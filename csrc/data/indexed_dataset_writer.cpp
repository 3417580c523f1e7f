// IndexedDatasetWriter: the same bytes as megatron-core's IndexedDatasetBuilder for the same
// input. Layout: docs/formats.md.

#include <cerrno>
#include <cstdio>
#include <limits>

#include "braid/core/error.h"
#include "braid/data/indexed_dataset.h"

namespace braid::data {

namespace {

constexpr size_t kBinBufferBytes = size_t(1) << 20;

void write_or_fail(std::FILE* f, const void* data, size_t bytes, const std::string& path) {
  if (bytes == 0) return;
  BRAID_CHECK(std::fwrite(data, 1, bytes, f) == bytes, path,
              ": write failed: ", std::strerror(errno));
}

template <typename Out, typename In>
void convert(std::span<const In> tokens, std::byte* out) {
  for (size_t k = 0; k < tokens.size(); ++k) {
    const Out v = static_cast<Out>(tokens[k]);
    std::memcpy(out + k * sizeof(Out), &v, sizeof(Out));
  }
}

}  // namespace

void IndexedDatasetWriter::FileCloser::operator()(std::FILE* f) const { std::fclose(f); }

IndexedDatasetWriter::IndexedDatasetWriter(const std::string& path_prefix, TokenType type)
    : path_prefix_(path_prefix), type_(type) {
  BRAID_CONFIG_CHECK(is_valid_token_type_code(uint8_t(type)), path_prefix,
                     ": invalid token type code ", int(type));
  const std::string tmp = path_prefix_ + ".bin.tmp";
  bin_.reset(std::fopen(tmp.c_str(), "wb"));
  BRAID_CONFIG_CHECK(bin_ != nullptr, tmp, ": cannot create: ", std::strerror(errno));
  std::setvbuf(bin_.get(), nullptr, _IOFBF, kBinBufferBytes);
}

IndexedDatasetWriter::~IndexedDatasetWriter() { discard(); }

void IndexedDatasetWriter::discard() noexcept {
  if (!bin_) return;  // finalized, or moved from
  bin_.reset();
  std::remove((path_prefix_ + ".bin.tmp").c_str());
  std::remove((path_prefix_ + ".idx.tmp").c_str());
}

template <typename T>
void IndexedDatasetWriter::add_tokens(std::span<const T> tokens) {
  BRAID_CONFIG_CHECK(bin_ != nullptr, path_prefix_,
                     ": the writer is finalized; no more sequences can be added");
  BRAID_CONFIG_CHECK(tokens.size() <= size_t(std::numeric_limits<int32_t>::max()), path_prefix_,
                     ": a sequence of ", tokens.size(),
                     " tokens is longer than the format's int32 lengths allow");
  for (size_t k = 0; k < tokens.size(); ++k) {
    BRAID_CONFIG_CHECK(token_fits(type_, int64_t(tokens[k])), path_prefix_, ": token ", tokens[k],
                       " (position ", k, " of sequence ", lengths_.size(),
                       ") does not fit the dataset's token type ", token_type_name(type_));
  }
  const size_t bytes = tokens.size() * token_size(type_);
  if (type_ == TokenType::i32 && std::is_same_v<T, int32_t>) {
    write_or_fail(bin_.get(), tokens.data(), bytes, path_prefix_ + ".bin.tmp");
  } else {
    buffer_.resize(bytes);
    switch (type_) {
      case TokenType::u8:
        convert<uint8_t>(tokens, buffer_.data());
        break;
      case TokenType::i8:
        convert<int8_t>(tokens, buffer_.data());
        break;
      case TokenType::i16:
        convert<int16_t>(tokens, buffer_.data());
        break;
      case TokenType::u16:
        convert<uint16_t>(tokens, buffer_.data());
        break;
      case TokenType::i32:
        convert<int32_t>(tokens, buffer_.data());
        break;
      case TokenType::i64:
        convert<int64_t>(tokens, buffer_.data());
        break;
      case TokenType::f32:
        convert<float>(tokens, buffer_.data());
        break;
      case TokenType::f64:
        convert<double>(tokens, buffer_.data());
        break;
    }
    write_or_fail(bin_.get(), buffer_.data(), bytes, path_prefix_ + ".bin.tmp");
  }
  lengths_.push_back(int32_t(tokens.size()));
  num_tokens_ += int64_t(tokens.size());
}

void IndexedDatasetWriter::add_sequence(std::span<const int32_t> tokens) { add_tokens(tokens); }
void IndexedDatasetWriter::add_sequence(std::span<const int64_t> tokens) { add_tokens(tokens); }

void IndexedDatasetWriter::add_documents(std::span<const int32_t> tokens,
                                         std::span<const int64_t> sequence_lengths,
                                         std::span<const int64_t> sequences_per_document) {
  BRAID_CONFIG_CHECK(bin_ != nullptr, path_prefix_,
                     ": the writer is finalized; no more documents can be added");
  uint64_t total = 0;
  for (size_t i = 0; i < sequence_lengths.size(); ++i) {
    BRAID_CONFIG_CHECK(sequence_lengths[i] >= 0 && uint64_t(sequence_lengths[i]) <= tokens.size(),
                       path_prefix_, ": add_documents: sequence_lengths[", i,
                       "] = ", sequence_lengths[i], " is negative or longer than the tokens");
    total += uint64_t(sequence_lengths[i]);
  }
  BRAID_CONFIG_CHECK(total == tokens.size(), path_prefix_,
                     ": add_documents: the sequence lengths add up to ", total, ", but there are ",
                     tokens.size(), " tokens");
  uint64_t sequences = 0;
  for (size_t d = 0; d < sequences_per_document.size(); ++d) {
    BRAID_CONFIG_CHECK(sequences_per_document[d] >= 0, path_prefix_,
                       ": add_documents: sequences_per_document[", d,
                       "] = ", sequences_per_document[d], " is negative");
    sequences += uint64_t(sequences_per_document[d]);
  }
  BRAID_CONFIG_CHECK(sequences == sequence_lengths.size(), path_prefix_,
                     ": add_documents: the documents hold ", sequences,
                     " sequences, but there are ", sequence_lengths.size(), " sequence lengths");
  for (size_t k = 0; k < tokens.size(); ++k) {
    BRAID_CONFIG_CHECK(token_fits(type_, tokens[k]), path_prefix_, ": token ", tokens[k],
                       " (position ", k, " of the batch) does not fit the dataset's token type ",
                       token_type_name(type_));
  }
  size_t position = 0, sequence = 0;
  for (int64_t count : sequences_per_document) {
    for (int64_t s = 0; s < count; ++s, ++sequence) {
      add_tokens(tokens.subspan(position, size_t(sequence_lengths[sequence])));
      position += size_t(sequence_lengths[sequence]);
    }
    end_document();
  }
}

void IndexedDatasetWriter::end_document() {
  BRAID_CONFIG_CHECK(bin_ != nullptr, path_prefix_,
                     ": the writer is finalized; no more documents can be added");
  documents_.push_back(int64_t(lengths_.size()));
}

void IndexedDatasetWriter::finalize() {
  BRAID_CONFIG_CHECK(bin_ != nullptr, path_prefix_, ": finalize() called twice");
  if (documents_.back() != int64_t(lengths_.size())) end_document();
  const std::string bin_tmp = path_prefix_ + ".bin.tmp";
  const std::string idx_tmp = path_prefix_ + ".idx.tmp";
  try {
    BRAID_CHECK(std::fflush(bin_.get()) == 0, bin_tmp, ": write failed: ", std::strerror(errno));
    std::FILE* raw = bin_.release();
    BRAID_CHECK(std::fclose(raw) == 0, bin_tmp, ": write failed: ", std::strerror(errno));
    std::unique_ptr<std::FILE, FileCloser> idx(std::fopen(idx_tmp.c_str(), "wb"));
    BRAID_CHECK(idx != nullptr, idx_tmp, ": cannot create: ", std::strerror(errno));

    const uint64_t version = 1;
    const uint8_t code = uint8_t(type_);
    const uint64_t num_sequences = lengths_.size();
    const uint64_t num_doc_entries = documents_.size();
    write_or_fail(idx.get(), "MMIDIDX\0\0", 9, idx_tmp);
    write_or_fail(idx.get(), &version, 8, idx_tmp);
    write_or_fail(idx.get(), &code, 1, idx_tmp);
    write_or_fail(idx.get(), &num_sequences, 8, idx_tmp);
    write_or_fail(idx.get(), &num_doc_entries, 8, idx_tmp);
    write_or_fail(idx.get(), lengths_.data(), lengths_.size() * 4, idx_tmp);
    std::vector<int64_t> pointers(lengths_.size());
    int64_t pointer = 0;
    for (size_t i = 0; i < lengths_.size(); ++i) {
      pointers[i] = pointer;
      pointer += int64_t(lengths_[i]) * int64_t(token_size(type_));
    }
    write_or_fail(idx.get(), pointers.data(), pointers.size() * 8, idx_tmp);
    write_or_fail(idx.get(), documents_.data(), documents_.size() * 8, idx_tmp);
    BRAID_CHECK(std::fclose(idx.release()) == 0, idx_tmp, ": write failed: ", std::strerror(errno));

    // A stale .idx goes first and the new one comes last: whenever an .idx is present, the
    // .bin beside it is complete and belongs to it.
    BRAID_CHECK(std::remove((path_prefix_ + ".idx").c_str()) == 0 || errno == ENOENT, path_prefix_,
                ".idx: cannot replace: ", std::strerror(errno));
    BRAID_CHECK(std::rename(bin_tmp.c_str(), (path_prefix_ + ".bin").c_str()) == 0, bin_tmp,
                ": cannot rename to ", path_prefix_, ".bin: ", std::strerror(errno));
    BRAID_CHECK(std::rename(idx_tmp.c_str(), (path_prefix_ + ".idx").c_str()) == 0, idx_tmp,
                ": cannot rename to ", path_prefix_, ".idx: ", std::strerror(errno));
  } catch (...) {
    bin_.reset();
    std::remove(bin_tmp.c_str());
    std::remove(idx_tmp.c_str());
    throw;
  }
  finalized_ = true;
}

}  // namespace braid::data
