#pragma once
// Megatron's --split: "969,30,1" weights become train / valid / test ranges of documents.
//
// The weights are normalised, accumulated into bookends [0, w0), [w0, w0 + w1), ... and each
// bookend is scaled by the number of documents and rounded half to even (Python's round), so
// the ranges are contiguous, disjoint and cover every document. A split of weight 0 is absent.

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace braid::data {

enum class Split : int { train = 0, valid = 1, test = 2 };
constexpr int kNumSplits = 3;
const char* split_name(Split split);  // "train", "valid", "test"

// "969,30,1", "99,1", "1" (missing weights are 0; any non-numeric characters separate numbers).
// ConfigError for more than three weights, a negative or unparsable one, or a zero sum.
std::array<double, kNumSplits> parse_split(std::string_view text);

struct DocumentRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
};

// The document range of each split; nullopt where the split's weight is 0.
std::array<std::optional<DocumentRange>, kNumSplits> split_documents(
    const std::array<double, kNumSplits>& weights, int64_t num_documents);

}  // namespace braid::data
