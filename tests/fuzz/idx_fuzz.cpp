// libFuzzer target for the .idx parser (braid::data::parse_index).
//
// Input: 8 bytes little-endian, the size of the .bin beside the index, then the .idx bytes.
// Every input must either parse into an index whose invariants hold (checked here: any
// violation aborts, and libFuzzer keeps the input) or throw braid::ConfigError. Anything else
// -- another exception, a read outside the buffer (ASan), undefined behaviour (UBSan), a hang --
// is a bug. How to run it: docs/formats.md.

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>

#include "braid/core/error.h"
#include "braid/data/indexed_dataset.h"

namespace {

void require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "idx_fuzz: parse_index accepted an index that breaks: %s\n", what);
    std::abort();
  }
}

void check_invariants(const braid::data::Index& index, uint64_t bin_size, size_t idx_size) {
  const size_t n = index.num_sequences();
  require(index.sequence_pointers.size() == n, "one pointer per sequence");
  require(!index.document_indices.empty(), "at least one document index");
  require(index.multimodal == (index.sequence_modes.size() == n && n > 0), "modes iff multimodal");
  require(34 + 12 * n + 8 * index.document_indices.size() + index.sequence_modes.size() == idx_size,
          "the arrays cover the file exactly");
  const uint64_t item = braid::data::token_size(index.token_type);
  uint64_t end = 0;
  for (size_t i = 0; i < n; ++i) {
    require(index.sequence_lengths[i] >= 0, "lengths >= 0");
    require(uint64_t(index.sequence_pointers[i]) == end, "sequences back to back from byte 0");
    end += uint64_t(index.sequence_lengths[i]) * item;
    require(end <= bin_size, "every sequence inside .bin");
  }
  require(end == bin_size, "the sequences end at the end of .bin");
  int64_t previous = 0;
  for (int64_t d : index.document_indices) {
    require(d >= previous, "document indices never decrease");
    previous = d;
  }
  require(index.document_indices.front() == 0, "document indices start at 0");
  require(uint64_t(index.document_indices.back()) == n, "document indices end at the count");
  for (int8_t mode : index.sequence_modes) (void)mode;  // readable
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 8) return 0;
  uint64_t bin_size;
  std::memcpy(&bin_size, data, 8);
  std::span<const std::byte> idx(reinterpret_cast<const std::byte*>(data + 8), size - 8);
  try {
    braid::data::Index index = braid::data::parse_index(idx, bin_size, "fuzz");
    check_invariants(index, bin_size, idx.size());
  } catch (const braid::ConfigError&) {
    // a rejected index: the expected outcome for almost every input
  }
  return 0;
}
