#pragma once
// Shared by the GPT data tests: a scratch directory per test and small indexed datasets whose
// tokens name their place (document d, position t: token d * 1000 + t).

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "braid/data/indexed_dataset.h"

namespace braid::data::testing {

namespace fs = std::filesystem;

inline fs::path scratch_dir(const std::string& tag) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  fs::path dir = fs::temp_directory_path() / ("braid_" + tag + "_" + std::to_string(::getpid()) +
                                              "_" + info->test_suite_name() + "_" + info->name());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

inline int32_t token_at(int64_t document, int64_t position) {
  return int32_t(document * 1000 + position);
}

// Documents of random lengths in [1, max_length] (< 1000); returns the lengths.
inline std::vector<int32_t> write_dataset(const std::string& prefix, size_t documents,
                                          int max_length, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> dist(1, max_length);
  std::vector<int32_t> lengths;
  IndexedDatasetWriter writer(prefix, TokenType::i32);
  for (size_t d = 0; d < documents; ++d) {
    int32_t n = dist(gen);
    std::vector<int32_t> tokens(static_cast<size_t>(n));
    for (int32_t t = 0; t < n; ++t) tokens[size_t(t)] = token_at(int64_t(d), t);
    writer.add_document(tokens);
    lengths.push_back(n);
  }
  writer.finalize();
  return lengths;
}

}  // namespace braid::data::testing
