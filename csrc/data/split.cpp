#include "braid/data/split.h"

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <vector>

#include "braid/core/error.h"

namespace braid::data {

const char* split_name(Split split) {
  switch (split) {
    case Split::train:
      return "train";
    case Split::valid:
      return "valid";
    case Split::test:
      return "test";
  }
  return "?";
}

std::array<double, kNumSplits> parse_split(std::string_view text) {
  // Megatron reads the numbers as re.findall(r"[.0-9]+"): runs of digits and dots.
  std::vector<double> values;
  size_t i = 0;
  while (i < text.size()) {
    auto is_number_char = [&](size_t k) {
      return k < text.size() &&
             (std::isdigit(static_cast<unsigned char>(text[k])) || text[k] == '.');
    };
    BRAID_CONFIG_CHECK(text[i] != '-', "--split \"", text, "\": weights must not be negative");
    if (!is_number_char(i)) {
      ++i;
      continue;
    }
    size_t j = i;
    while (is_number_char(j)) ++j;
    std::string number(text.substr(i, j - i));
    char* end = nullptr;
    double v = std::strtod(number.c_str(), &end);
    BRAID_CONFIG_CHECK(end == number.c_str() + number.size() && std::isfinite(v), "--split \"",
                       text, "\": \"", number, "\" is not a number");
    values.push_back(v);
    i = j;
  }
  BRAID_CONFIG_CHECK(!values.empty() && values.size() <= size_t(kNumSplits), "--split \"", text,
                     "\": expected one to three weights (train,valid,test), got ", values.size());
  std::array<double, kNumSplits> weights{};
  double sum = 0;
  for (size_t k = 0; k < values.size(); ++k) {
    weights[k] = values[k];
    sum += values[k];
  }
  BRAID_CONFIG_CHECK(sum > 0, "--split \"", text, "\": the weights sum to 0");
  for (double& w : weights) w /= sum;
  return weights;
}

std::array<std::optional<DocumentRange>, kNumSplits> split_documents(
    const std::array<double, kNumSplits>& weights, int64_t num_documents) {
  std::array<std::optional<DocumentRange>, kNumSplits> ranges;
  double start = 0;
  for (int k = 0; k < kNumSplits; ++k) {
    BRAID_CONFIG_CHECK(weights[k] >= 0, "split weights must not be negative");
    double stop = start + weights[k];
    if (stop > start) {
      // std::nearbyint rounds half to even under the default rounding mode, as Python's round.
      ranges[k] = DocumentRange{int64_t(std::nearbyint(start * double(num_documents))),
                                int64_t(std::nearbyint(stop * double(num_documents)))};
    }
    start = stop;
  }
  return ranges;
}

}  // namespace braid::data
