// DropoutContext::token_runs_of: where each token of a rank's activation is among the run's
// tokens, against the token-by-token definition, for whole sequences and context-parallel
// chunks, sequence-parallel shards that cut rows anywhere, and runs that do not start at 0.

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "braid/model/transformer_layer.h"

namespace braid::model {
namespace {

// The run's token of each of the rank's tokens, from the runs.
std::vector<int64_t> tokens_of(const std::vector<DropoutContext::TokenRun>& runs, int64_t count) {
  std::vector<int64_t> tokens(size_t(count), -1);
  int64_t local = 0;
  for (const DropoutContext::TokenRun& run : runs) {
    EXPECT_EQ(run.local, local) << "the runs cover the tokens in order, without gaps";
    EXPECT_GT(run.count, 0);
    for (int64_t t = 0; t < run.count && run.local + t < count; ++t)
      tokens[size_t(run.local + t)] = run.first + t;
    local += run.count;
  }
  EXPECT_EQ(local, count);
  return tokens;
}

TEST(DropoutTokenRuns, EveryTokenIsWhereTheRunHasIt) {
  const int64_t first_token = 1000;  // the microbatch's first sequence starts there
  for (int cp : {1, 2, 3}) {
    for (int64_t sequences : {1, 2, 3}) {
      for (int64_t len : {1, 3, 4}) {
        const int64_t rows = cp > 1 ? 2 * sequences : sequences;
        const int64_t seq = cp > 1 ? 2 * cp * len : len;
        for (int cp_rank = 0; cp_rank < cp; ++cp_rank) {
          for (int tp : {1, 2, 3, 4}) {
            if ((rows * len) % tp != 0) continue;
            const int64_t count = rows * len / tp;
            for (int tp_rank = 0; tp_rank < tp; ++tp_rank) {
              SCOPED_TRACE("cp " + std::to_string(cp_rank) + "/" + std::to_string(cp) +
                           " sequences " + std::to_string(sequences) + " len " +
                           std::to_string(len) + " tp " + std::to_string(tp_rank) + "/" +
                           std::to_string(tp));
              const auto runs = DropoutContext::token_runs_of(rows, len, cp_rank, cp,
                                                              tp_rank * count, count, first_token);
              const std::vector<int64_t> got = tokens_of(runs, count);
              for (int64_t t = 0; t < count; ++t) {
                const int64_t g = tp_rank * count + t, row = g / len, at = g % len;
                const int64_t sequence = cp > 1 ? row % sequences : row;
                const int64_t chunk =
                    cp > 1 ? ContextParallel::chunk_of(cp_rank, cp, int(row / sequences)) : 0;
                EXPECT_EQ(got[size_t(t)], first_token + sequence * seq + chunk * len + at)
                    << "token " << t;
              }
              // Without context parallelism the rank's tokens are the run's in order: one run.
              if (cp == 1) {
                EXPECT_EQ(runs.size(), 1u);
              }
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace braid::model
