// GPT indices: numpy's RandomState words and shuffles (known answers from numpy 2.x), and the
// document / sample / shuffle index invariants on random document lengths.

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "braid/core/error.h"
#include "braid/data/gpt_indices.h"
#include "braid/data/numpy_random.h"

namespace braid::data {
namespace {

TEST(NumpyRandomState, Mt19937Words) {
  // np.random.RandomState(0).randint(0, 2**32, size=3, dtype=np.uint64)
  NumpyRandomState r(0);
  EXPECT_EQ(r.next32(), 2357136044u);
  EXPECT_EQ(r.next32(), 2546248239u);
  EXPECT_EQ(r.next32(), 3071714933u);
}

TEST(NumpyRandomState, ShuffleMatchesNumpy) {
  // a = np.arange(10); np.random.RandomState(1234).shuffle(a)
  std::vector<int32_t> a(10);
  std::iota(a.begin(), a.end(), 0);
  NumpyRandomState r(1234);
  r.shuffle(std::span<int32_t>(a));
  EXPECT_EQ(a, (std::vector<int32_t>{7, 2, 9, 1, 0, 8, 4, 5, 6, 3}));

  // a = np.arange(1000); np.random.RandomState(7).shuffle(a): the first 8 and the last 3
  std::vector<int64_t> b(1000);
  std::iota(b.begin(), b.end(), 0);
  NumpyRandomState r7(7);
  r7.shuffle(std::span<int64_t>(b));
  EXPECT_EQ(std::vector<int64_t>(b.begin(), b.begin() + 8),
            (std::vector<int64_t>{778, 334, 271, 802, 216, 408, 812, 94}));
  EXPECT_EQ(std::vector<int64_t>(b.end() - 3, b.end()), (std::vector<int64_t>{537, 196, 175}));
}

TEST(NumpyRandomState, IntervalStaysInRange) {
  NumpyRandomState r(3);
  for (uint64_t max : {0ull, 1ull, 2ull, 5ull, 1000ull, 0xffffffffull, 0x1ffffffffull}) {
    for (int i = 0; i < 200; ++i) EXPECT_LE(r.interval(max), max);
  }
}

std::vector<int32_t> random_lengths(size_t n, int max_length, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> dist(0, max_length);
  std::vector<int32_t> lengths(n);
  for (auto& l : lengths) l = dist(gen);
  return lengths;
}

// The concatenated token stream of the document index, as (document, offset) per token.
struct Stream {
  std::vector<int64_t> start;  // start[k]: stream position of document_index[k]
};

Stream stream_of(const std::vector<int32_t>& lengths, const std::vector<int32_t>& documents) {
  Stream s;
  int64_t pos = 0;
  for (int32_t d : documents) {
    s.start.push_back(pos);
    pos += lengths[size_t(d)];
  }
  s.start.push_back(pos);
  return s;
}

TEST(GPTIndices, SamplesTileTheStreamWithOneSharedToken) {
  for (int64_t seq : {1, 7, 64, 300}) {
    std::vector<int32_t> lengths = random_lengths(200, 120, uint32_t(seq));
    lengths[5] = 0;  // empty documents are skipped
    const int64_t begin = 10, end = 190;
    GPTIndices idx = build_gpt_indices(lengths, begin, end, {seq, 5000, 99});
    const int64_t tokens = count_tokens(lengths, begin, end);
    EXPECT_EQ(idx.num_epochs, num_epochs_for(tokens, 5000, seq));
    EXPECT_GE(idx.num_samples(), 5000);
    EXPECT_EQ(idx.num_samples(), samples_in_epochs(idx.num_epochs, tokens, seq));
    ASSERT_EQ(int64_t(idx.document_index.size()), (end - begin) * idx.num_epochs);

    // Every document of the range appears once per epoch.
    std::vector<int64_t> seen(lengths.size(), 0);
    for (int32_t d : idx.document_index) ++seen[size_t(d)];
    for (int64_t d = 0; d < int64_t(lengths.size()); ++d)
      EXPECT_EQ(seen[size_t(d)], (d >= begin && d < end) ? idx.num_epochs : 0) << d;

    // Sample i starts at stream position i * seq and holds seq + 1 tokens.
    Stream s = stream_of(lengths, idx.document_index);
    for (int64_t i = 0; i <= idx.num_samples(); ++i) {
      int64_t k = idx.sample_index[size_t(2 * i)], offset = idx.sample_index[size_t(2 * i + 1)];
      ASSERT_GE(offset, 0);
      ASSERT_LT(offset, std::max<int32_t>(lengths[size_t(idx.document_index[size_t(k)])], 1));
      ASSERT_EQ(s.start[size_t(k)] + offset, i * seq) << "seq " << seq << " sample " << i;
    }

    // The shuffle index is a permutation.
    std::vector<int64_t> sorted = idx.shuffle_index;
    std::sort(sorted.begin(), sorted.end());
    for (int64_t i = 0; i < int64_t(sorted.size()); ++i) ASSERT_EQ(sorted[size_t(i)], i);
  }
}

TEST(GPTIndices, OneEpochWithoutANumber) {
  std::vector<int32_t> lengths = random_lengths(50, 40, 1);
  GPTIndices idx = build_gpt_indices(lengths, 0, 50, {16, std::nullopt, 1});
  EXPECT_EQ(idx.num_epochs, 1);
  EXPECT_EQ(idx.num_samples(), (count_tokens(lengths, 0, 50) - 1) / 16);
  EXPECT_FALSE(idx.separate_final_epoch);
}

TEST(GPTIndices, DeterministicGivenTheSeed) {
  std::vector<int32_t> lengths = random_lengths(300, 50, 2);
  GPTIndices a = build_gpt_indices(lengths, 0, 300, {32, 2000, 5});
  GPTIndices b = build_gpt_indices(lengths, 0, 300, {32, 2000, 5});
  GPTIndices c = build_gpt_indices(lengths, 0, 300, {32, 2000, 6});
  EXPECT_EQ(a.document_index, b.document_index);
  EXPECT_EQ(a.sample_index, b.sample_index);
  EXPECT_EQ(a.shuffle_index, b.shuffle_index);
  EXPECT_NE(a.shuffle_index, c.shuffle_index);
}

TEST(GPTIndices, ASmallFinalEpochIsShuffledOnItsOwn) {
  std::vector<int32_t> lengths(100, 10);  // 1000 tokens: 124 samples of 8 per epoch
  // 1.1 epochs: the last epoch gives 13 samples (< 80% of 124): separate.
  GPTIndices small = build_gpt_indices(lengths, 0, 100, {8, 137, 3});
  EXPECT_EQ(small.num_epochs, 2);
  EXPECT_TRUE(small.separate_final_epoch);
  const int64_t before = samples_in_epochs(1, 1000, 8);
  // The first epoch's documents are a permutation of the range, and so is the last's.
  std::vector<int32_t> first(small.document_index.begin(), small.document_index.begin() + 100);
  std::sort(first.begin(), first.end());
  for (int i = 0; i < 100; ++i) EXPECT_EQ(first[size_t(i)], i);
  // Samples before the final epoch are shuffled among themselves, the rest among themselves.
  for (int64_t i = 0; i < small.num_samples(); ++i)
    EXPECT_EQ(small.shuffle_index[size_t(i)] < before, i < before) << i;

  // 1.9 epochs: the last epoch gives most of an epoch: one shuffle over both.
  GPTIndices large = build_gpt_indices(lengths, 0, 100, {8, 230, 3});
  EXPECT_EQ(large.num_epochs, 2);
  EXPECT_FALSE(large.separate_final_epoch);
}

TEST(GPTIndices, BadInputIsAConfigError) {
  std::vector<int32_t> lengths = {3, 4};
  EXPECT_THROW(build_gpt_indices(lengths, 0, 2, {7, 1, 1}), ConfigError);   // 7 tokens < 8
  EXPECT_THROW(build_gpt_indices(lengths, 0, 2, {0, 1, 1}), ConfigError);   // seq_length 0
  EXPECT_THROW(build_gpt_indices(lengths, 0, 2, {2, -1, 1}), ConfigError);  // negative count
  EXPECT_NO_THROW(build_gpt_indices(lengths, 0, 2, {6, 1, 1}));             // exactly one sample
}

}  // namespace
}  // namespace braid::data
