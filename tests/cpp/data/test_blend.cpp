// --split and --data-path parsing, Megatron's document ranges, and the blending indices:
// proportions within one sample per 1000, determinism, the exhaustive blend.

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "braid/core/error.h"
#include "braid/data/blended_dataset.h"
#include "braid/data/dataset_builder.h"
#include "braid/data/split.h"

namespace braid::data {
namespace {

TEST(Split, ParsesMegatronStrings) {
  auto w = parse_split("969,30,1");
  EXPECT_DOUBLE_EQ(w[0], 0.969);
  EXPECT_DOUBLE_EQ(w[1], 0.030);
  EXPECT_DOUBLE_EQ(w[2], 0.001);
  w = parse_split("99,1");
  EXPECT_DOUBLE_EQ(w[0], 0.99);
  EXPECT_DOUBLE_EQ(w[2], 0.0);
  w = parse_split("1");
  EXPECT_DOUBLE_EQ(w[0], 1.0);
  w = parse_split("0.5 0.25/0.25");
  EXPECT_DOUBLE_EQ(w[1], 0.25);
  EXPECT_THROW(parse_split("1,2,3,4"), ConfigError);
  EXPECT_THROW(parse_split("0,0,0"), ConfigError);
  EXPECT_THROW(parse_split(""), ConfigError);
  EXPECT_THROW(parse_split("90,-10"), ConfigError);
  EXPECT_THROW(parse_split("1..2"), ConfigError);
}

TEST(Split, DocumentRangesAreContiguousAndRoundHalfToEven) {
  auto r = split_documents(parse_split("969,30,1"), 1000);
  ASSERT_TRUE(r[0] && r[1] && r[2]);
  EXPECT_EQ(r[0]->begin, 0);
  EXPECT_EQ(r[0]->end, 969);
  EXPECT_EQ(r[1]->begin, 969);
  EXPECT_EQ(r[1]->end, 999);
  EXPECT_EQ(r[2]->end, 1000);

  // 0.5 * 5 = 2.5 rounds to 2 (Python's round), not 3.
  r = split_documents(parse_split("1,1"), 5);
  ASSERT_TRUE(r[0] && r[1]);
  EXPECT_FALSE(r[2]);  // weight 0: no test split
  EXPECT_EQ(r[0]->end, 2);
  EXPECT_EQ(r[1]->begin, 2);
  EXPECT_EQ(r[1]->end, 5);
}

TEST(DataPath, WeightsAndPrefixesAlternateOrPrefixesAlone) {
  Blend b = parse_data_path({"0.3", "A", "0.7", " B "});
  EXPECT_EQ(b.prefixes, (std::vector<std::string>{"A", "B"}));
  ASSERT_TRUE(b.weights);
  EXPECT_EQ(*b.weights, (std::vector<double>{0.3, 0.7}));

  b = parse_data_path({"A"});
  EXPECT_EQ(b.prefixes, (std::vector<std::string>{"A"}));
  EXPECT_FALSE(b.weights);
  b = parse_data_path({"A", "B"});  // even, but "A" is no number: prefixes alone
  EXPECT_EQ(b.prefixes.size(), 2u);
  EXPECT_FALSE(b.weights);
  b = parse_data_path({"A", "B", "C"});
  EXPECT_EQ(b.prefixes.size(), 3u);

  EXPECT_THROW(parse_data_path({}), ConfigError);
  EXPECT_THROW(parse_data_path({"0", "A", "1", "B"}), ConfigError);
  EXPECT_THROW(parse_data_path({"-1", "A"}), ConfigError);
}

TEST(Blending, ProportionsWithinOneSamplePerThousand) {
  for (std::vector<double> weights : std::vector<std::vector<double>>{
           {0.3, 0.7}, {0.2, 0.5, 0.3}, {1.0 / 3, 1.0 / 3, 1.0 / 3}, {0.01, 0.09, 0.9}}) {
    const int64_t n = 100000;
    std::vector<int32_t> which(n);
    std::vector<int64_t> sample(n);
    build_blending_indices(weights, which, sample);
    std::vector<int64_t> counts(weights.size(), 0);
    for (int64_t i = 0; i < n; ++i) {
      int32_t d = which[size_t(i)];
      // Each dataset's samples are taken in order 0, 1, 2, ...
      ASSERT_EQ(sample[size_t(i)], counts[size_t(d)]);
      ++counts[size_t(d)];
      // Every prefix of the blend is within one sample (+1 for the max(i, 1) start) of exact.
      if (i % 997 == 0) {
        for (size_t k = 0; k < weights.size(); ++k)
          EXPECT_LE(std::abs(double(counts[k]) - weights[k] * double(i + 1)), 2.0) << i;
      }
    }
    for (size_t k = 0; k < weights.size(); ++k)
      EXPECT_LE(std::abs(double(counts[k]) - weights[k] * double(n)), double(n) / 1000) << k;
  }
}

TEST(Blending, DeterministicAndGreedy) {
  std::vector<double> w = {0.3, 0.7};
  std::vector<int32_t> a(10), a2(10);
  std::vector<int64_t> s(10), s2(10);
  build_blending_indices(w, a, s);
  build_blending_indices(w, a2, s2);
  EXPECT_EQ(a, a2);
  // Megatron's greedy order for 0.3 / 0.7 (helpers.cpp build_blending_indices).
  EXPECT_EQ(a, (std::vector<int32_t>{1, 0, 1, 1, 0, 1, 1, 0, 1, 1}));
}

TEST(Blending, ExhaustiveTakesEverySampleOnce) {
  std::vector<int64_t> sizes = {5, 0, 12, 3};
  std::vector<int32_t> which(20);
  std::vector<int64_t> sample(20);
  build_exhaustive_blending_indices(sizes, which, sample);
  std::vector<int64_t> counts(4, 0);
  for (size_t i = 0; i < 20; ++i) {
    EXPECT_EQ(sample[i], counts[size_t(which[i])]++);
  }
  EXPECT_EQ(counts, sizes);
}

}  // namespace
}  // namespace braid::data
