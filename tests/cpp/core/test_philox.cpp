#include <gtest/gtest.h>

#include <cmath>

#include "braid/core/philox.h"

namespace braid {
namespace {

// Known-answer vectors of Philox4x32-10 published with Random123 (kat_vectors).
TEST(Philox, KnownAnswers) {
  auto check = [](philox::Words4 ctr, uint32_t k0, uint32_t k1, philox::Words4 expect) {
    philox::Words4 got = philox::philox4x32(ctr, k0, k1);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(got.x[i], expect.x[i]) << "word " << i;
  };
  check({{0, 0, 0, 0}}, 0, 0, {{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}});
  check({{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}}, 0xffffffff, 0xffffffff,
        {{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}});
  check({{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}}, 0xa4093822, 0x299f31d0,
        {{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}});
}

TEST(Philox, NormalsHaveUnitMoments) {
  double sum = 0, sum_sq = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    philox::Words4 w = philox::random_words(1234, philox::stream_of("layer.weight"), uint64_t(i));
    double x = philox::normal_from_words(w.x[0], w.x[1]);
    sum += x;
    sum_sq += x * x;
  }
  EXPECT_NEAR(sum / n, 0.0, 0.01);
  EXPECT_NEAR(sum_sq / n, 1.0, 0.01);
}

TEST(Philox, StreamsDiffer) {
  EXPECT_NE(philox::stream_of("a.weight"), philox::stream_of("b.weight"));
  philox::Words4 a = philox::random_words(1, 2, 3), b = philox::random_words(1, 3, 3);
  EXPECT_NE(a.x[0], b.x[0]);
  float u = philox::uniform_from_word(0);
  EXPECT_GT(u, 0.0f);
  EXPECT_EQ(philox::uniform_from_word(0xffffffff), 1.0f);
}

// Attention dropout's streams, one per (run-wide sequence, head): sequences 2^32 apart, and
// swapped parts, are other streams (the parts are mixed, not packed into one word).
TEST(Philox, SubstreamsOfEveryPartDiffer) {
  const uint64_t stream = (uint64_t(1) << 31) + 3, far = uint64_t(1) << 32;
  for (uint64_t sequence : {uint64_t(0), uint64_t(7), far - 1, uint64_t(3) << 40}) {
    for (uint64_t head : {0, 1, 5}) {
      const uint64_t s = philox::substream(stream, sequence, head);
      EXPECT_NE(s, philox::substream(stream, sequence + far, head)) << sequence << " " << head;
      EXPECT_NE(s, philox::substream(stream, sequence, head + 1)) << sequence << " " << head;
      EXPECT_NE(s, philox::substream(stream + 1, sequence, head)) << sequence << " " << head;
      if (sequence != head) {
        EXPECT_NE(s, philox::substream(stream, head, sequence)) << sequence << " " << head;
      }
    }
  }
}

}  // namespace
}  // namespace braid
