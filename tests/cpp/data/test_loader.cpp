// DataLoader: Megatron's sample order per DP rank (the union of the ranks is the global batch,
// disjoint), resuming from consumed_samples, the end of the data, errors from the loading thread,
// shutdown, the tokens/labels flags, and batch-size ramps (--rampup-batch-size).

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>

#include "braid/core/error.h"
#include "braid/data/data_loader.h"

namespace braid::data {
namespace {

// Sample i is the tokens i * 100 + t, t = 0..seq_length; reading `fail_at` throws.
class CountingDataset final : public SampleDataset {
 public:
  CountingDataset(int64_t size, int64_t seq, int64_t fail_at = -1)
      : size_(size), seq_(seq), fail_at_(fail_at) {}
  int64_t size() const override { return size_; }
  int64_t seq_length() const override { return seq_; }
  void read(int64_t i, int32_t* out) const override {
    ++reads;
    if (i == fail_at_) BRAID_FAIL("sample ", i, " is damaged");
    for (int64_t t = 0; t <= seq_; ++t) out[t] = int32_t(i * 100 + t);
  }
  const std::string& description() const override { return description_; }
  mutable std::atomic<int64_t> reads{0};

 private:
  int64_t size_, seq_, fail_at_;
  std::string description_ = "counting";
};

int64_t sample_of_row(const Tensor& tokens, int64_t row) {
  return tokens.data_ptr<int32_t>()[row * tokens.size(1)] / 100;
}

// Megatron's MegatronPretrainingSampler, written out: the microbatches of one rank.
std::vector<std::vector<int64_t>> megatron_sampler(int64_t total, int64_t consumed, int64_t mbs,
                                                   int64_t dp_rank, int64_t dp_size) {
  std::vector<std::vector<int64_t>> out;
  std::vector<int64_t> batch;
  for (int64_t idx = consumed; idx < total; ++idx) {
    batch.push_back(idx);
    if (int64_t(batch.size()) == mbs * dp_size) {
      out.emplace_back(batch.begin() + dp_rank * mbs, batch.begin() + (dp_rank + 1) * mbs);
      batch.clear();
    }
  }
  return out;
}

TEST(Loader, DataParallelRanksSplitEachGlobalBatchInMegatronOrder) {
  auto ds = std::make_shared<CountingDataset>(1000, 8);
  for (int64_t dp : {1, 2, 4}) {
    const int64_t mbs = 2, gbs = 16;
    std::vector<std::unique_ptr<DataLoader>> loaders;
    for (int64_t r = 0; r < dp; ++r)
      loaders.push_back(std::make_unique<DataLoader>(ds, BatchLayout{mbs, gbs, r, dp}));
    std::vector<std::vector<std::vector<int64_t>>> reference;
    for (int64_t r = 0; r < dp; ++r) reference.push_back(megatron_sampler(1000, 0, mbs, r, dp));
    for (int64_t step = 0; step < 5; ++step) {
      std::set<int64_t> seen;
      for (int64_t r = 0; r < dp; ++r) {
        std::optional<Batch> b = loaders[size_t(r)]->next();
        ASSERT_TRUE(b);
        ASSERT_EQ(b->num_microbatches, gbs / (mbs * dp));
        ASSERT_EQ(b->tokens.size(0), gbs / dp);
        for (int64_t m = 0; m < b->num_microbatches; ++m) {
          Tensor mb = b->microbatch_tokens(m);
          const auto& want = reference[size_t(r)][size_t(step * b->num_microbatches + m)];
          for (int64_t row = 0; row < mbs; ++row) {
            int64_t s = sample_of_row(mb, row);
            EXPECT_EQ(s, want[size_t(row)]) << "dp " << dp << " rank " << r << " step " << step;
            EXPECT_TRUE(seen.insert(s).second) << "sample " << s << " read twice";
          }
        }
        EXPECT_EQ(b->consumed_samples, (step + 1) * gbs);
      }
      // The ranks together read exactly global batch `step`.
      ASSERT_EQ(int64_t(seen.size()), gbs);
      EXPECT_EQ(*seen.begin(), step * gbs);
      EXPECT_EQ(*seen.rbegin(), step * gbs + gbs - 1);
    }
  }
}

TEST(Loader, LabelsAreTheTokensShiftedByOne) {
  auto ds = std::make_shared<CountingDataset>(64, 5);
  DataLoader loader(ds, BatchLayout{4, 8, 0, 1});
  Batch b = *loader.next();
  ASSERT_EQ(b.tokens.shape(), (Shape{8, 5}));
  ASSERT_EQ(b.labels.shape(), (Shape{8, 5}));
  const int32_t* t = b.tokens.data_ptr<int32_t>();
  const int32_t* l = b.labels.data_ptr<int32_t>();
  for (int64_t row = 0; row < 8; ++row)
    for (int64_t k = 0; k < 5; ++k) {
      EXPECT_EQ(t[row * 5 + k], row * 100 + k);
      EXPECT_EQ(l[row * 5 + k], row * 100 + k + 1);
    }
}

TEST(Loader, ResumingYieldsWhatAnUninterruptedRunYields) {
  auto ds = std::make_shared<CountingDataset>(500, 4);
  const BatchLayout layout{3, 12, 1, 2};  // rank 1 of 2, 2 microbatches of 3
  std::vector<std::vector<int32_t>> uninterrupted;
  std::vector<int64_t> consumed;
  {
    DataLoader loader(ds, layout);
    for (int step = 0; step < 10; ++step) {
      Batch b = *loader.next();
      const int32_t* p = b.labels.data_ptr<int32_t>();
      uninterrupted.emplace_back(p, p + b.labels.numel());
      consumed.push_back(loader.consumed_samples());
    }
  }
  // Stop after step 4 (consumed[3] samples), restart from the checkpointed count.
  DataLoader resumed(ds, layout, LoaderOptions{consumed[3], 3, true, true});
  for (int step = 4; step < 10; ++step) {
    Batch b = *resumed.next();
    const int32_t* p = b.labels.data_ptr<int32_t>();
    EXPECT_EQ(std::vector<int32_t>(p, p + b.labels.numel()), uninterrupted[size_t(step)])
        << "step " << step;
    EXPECT_EQ(resumed.consumed_samples(), consumed[size_t(step)]);
  }
}

TEST(Loader, EndsWhenLessThanAGlobalBatchIsLeft) {
  auto ds = std::make_shared<CountingDataset>(100, 4);
  DataLoader loader(ds, BatchLayout{2, 16, 0, 2});
  EXPECT_EQ(loader.steps_left(), 6);
  int steps = 0;
  while (loader.next()) ++steps;
  EXPECT_EQ(steps, 6);
  EXPECT_EQ(loader.steps_left(), 0);
  EXPECT_FALSE(loader.next());
  EXPECT_EQ(loader.consumed_samples(), 96);
}

TEST(Loader, ErrorsOnTheThreadReachTheConsumer) {
  auto ds = std::make_shared<CountingDataset>(100, 4, /*fail_at=*/37);
  DataLoader loader(ds, BatchLayout{4, 8, 0, 1});
  int good = 0;
  try {
    while (loader.next()) ++good;
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("sample 37 is damaged"), std::string::npos) << e.message();
  }
  EXPECT_EQ(good, 4);                  // steps 0..3 hold samples 0..31
  EXPECT_THROW(loader.next(), Error);  // and it stays failed
}

TEST(Loader, StopsCleanlyWithAFullQueueOrRightAway) {
  { DataLoader loader(std::make_shared<CountingDataset>(100000, 16), BatchLayout{8, 64, 0, 1}); }
  {
    auto ds = std::make_shared<CountingDataset>(100000, 16);
    DataLoader loader(ds, BatchLayout{8, 64, 0, 1}, LoaderOptions{0, 3, true, true});
    // Let the thread fill its queue, then check that it stopped there.
    for (int i = 0; i < 200 && ds->reads < 3 * 64; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_EQ(ds->reads, 3 * 64);
  }
}

TEST(Loader, StagesThatNeedNoTokensOrLabelsReadNothing) {
  auto ds = std::make_shared<CountingDataset>(100, 4);
  DataLoader middle(ds, BatchLayout{2, 4, 0, 1}, LoaderOptions{0, 2, false, false});
  Batch b = *middle.next();
  EXPECT_FALSE(b.tokens.defined());
  EXPECT_FALSE(b.labels.defined());
  EXPECT_EQ(middle.consumed_samples(), 4);
  EXPECT_THROW(b.microbatch_tokens(0), Error);

  DataLoader last(ds, BatchLayout{2, 4, 0, 1}, LoaderOptions{0, 2, false, true});
  b = *last.next();
  EXPECT_FALSE(b.tokens.defined());
  EXPECT_TRUE(b.labels.defined());
}

TEST(Loader, BadLayoutIsAConfigError) {
  auto ds = std::make_shared<CountingDataset>(100, 4);
  EXPECT_THROW(DataLoader(ds, BatchLayout{3, 16, 0, 1}), ConfigError);  // 3 does not divide 16
  EXPECT_THROW(DataLoader(ds, BatchLayout{2, 16, 2, 2}), ConfigError);  // rank out of range
  EXPECT_THROW(DataLoader(ds, BatchLayout{0, 16, 0, 1}), ConfigError);
  EXPECT_THROW(DataLoader(ds, BatchLayout{2, 16, 0, 1}, LoaderOptions{-1, 2, true, true}),
               ConfigError);
  EXPECT_THROW(DataLoader(ds, BatchLayout{2, 16, 0, 1}, LoaderOptions{0, 0, true, true}),
               ConfigError);
}

// --rampup-batch-size 4 4 100 up to 16: 3 increments, one per 100 / 3 samples. Megatron's
// batch after c samples is 4 + 4 * int(c / 33.33) while c <= 100: 4 for c = 0..32 (9 steps,
// to 36), 8 for 36..60 (4 steps, to 68), 12 for 68..92 (3 steps, to 104), then 16.
const BatchRampup kRamp{4, 4, 100};
const std::vector<int64_t> kRampSteps{4, 4, 4, 4, 4, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 16, 16};

TEST(BatchRamp, GrowsAsMegatronsCalculatorDoes) {
  const BatchLayout layout{2, 16, 0, 2, kRamp};
  layout.validate();
  int64_t consumed = 0;
  for (size_t step = 0; step < kRampSteps.size(); ++step) {
    EXPECT_EQ(layout.global_batch_size_at(consumed), kRampSteps[step]) << "step " << step;
    consumed += kRampSteps[step];
  }
  EXPECT_EQ(layout.global_batch_size_at(100), 16);  // the last ramp sample: 4 + 4 * 3
  EXPECT_EQ(layout.global_batch_size_at(1000000), 16);
  EXPECT_EQ((BatchLayout{2, 16, 0, 2}).global_batch_size_at(0), 16);  // no ramp
}

TEST(BatchRamp, StepsAreMegatronsTrainingIterations) {
  const BatchLayout layout{2, 16, 0, 2, kRamp};
  // 16 ramp steps read 104 samples; then whole batches of 16, a partial last one dropped.
  EXPECT_EQ(layout.steps_between(0, 320), 16 + (320 - 104) / 16);
  EXPECT_EQ(layout.steps_between(0, 104), 16);
  EXPECT_EQ(layout.steps_between(0, 103), 15);  // inside the ramp: the 12 from 92 does not fit
  EXPECT_EQ(layout.steps_between(0, 3), 0);
  EXPECT_EQ(layout.steps_between(36, 104), 7);  // from a ramp step's end
  EXPECT_EQ((BatchLayout{2, 16, 0, 2}).steps_between(6, 100), 5);
  for (int64_t steps : {0, 1, 9, 13, 16, 17, 30}) {  // the samples those steps read
    int64_t consumed = 0;
    for (int64_t s = 0; s < steps; ++s)
      consumed += s < int64_t(kRampSteps.size()) ? kRampSteps[size_t(s)] : 16;
    EXPECT_EQ(layout.samples_after(steps), consumed) << steps << " steps";
    EXPECT_EQ(layout.steps_between(0, consumed), steps) << steps << " steps";
  }
}

TEST(BatchRamp, EveryBatchOfTheRampMustSplitIntoMicrobatches) {
  // micro_batch_size 2 x dp 2: the start and the increment must be multiples of 4.
  EXPECT_THROW((BatchLayout{2, 16, 0, 2, BatchRampup{6, 2, 100}}).validate(), ConfigError);
  EXPECT_THROW((BatchLayout{2, 16, 0, 2, BatchRampup{4, 6, 100}}).validate(), ConfigError);
  EXPECT_THROW((BatchLayout{2, 16, 0, 2, BatchRampup{20, 4, 100}}).validate(), ConfigError);
  EXPECT_THROW((BatchLayout{2, 16, 0, 2, BatchRampup{4, 8, 100}}).validate(), ConfigError);
  EXPECT_THROW((BatchLayout{2, 16, 0, 2, BatchRampup{4, 4, 0}}).validate(), ConfigError);
  (BatchLayout{2, 16, 0, 2, BatchRampup{16, 3, 100}}).validate();  // nothing to ramp
  for (const auto& [ramp, which] : {std::pair{BatchRampup{4, 6, 100}, "the increment is not"},
                                    std::pair{BatchRampup{6, 2, 100}, "the start is not"}}) {
    try {
      (BatchLayout{2, 16, 0, 2, ramp}).validate();
      ADD_FAILURE() << "accepted " << which;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(which), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("--rampup-batch-size"), std::string::npos);
    }
  }
}

TEST(BatchRamp, LoaderStepsGrowAndTheRanksReadConsecutiveSamples) {
  auto ds = std::make_shared<CountingDataset>(200, 4);
  std::vector<std::unique_ptr<DataLoader>> ranks;
  for (int64_t r = 0; r < 2; ++r)
    ranks.push_back(std::make_unique<DataLoader>(ds, BatchLayout{2, 16, r, 2, kRamp}));
  EXPECT_EQ(ranks[0]->steps_left(), 16 + (200 - 104) / 16);
  int64_t next_sample = 0;
  for (size_t step = 0;; ++step) {
    std::optional<Batch> b0 = ranks[0]->next(), b1 = ranks[1]->next();
    ASSERT_EQ(b0.has_value(), b1.has_value());
    if (!b0) {
      EXPECT_EQ(step, size_t(16 + (200 - 104) / 16));
      break;
    }
    const int64_t batch = step < kRampSteps.size() ? kRampSteps[step] : 16;
    ASSERT_EQ(b0->global_batch_size, batch) << "step " << step;
    ASSERT_EQ(b0->num_microbatches, batch / 4);
    ASSERT_EQ(b0->tokens.size(0), batch / 2);
    // Microbatch m of rank r holds samples next + 4m + 2r, +1.
    for (int64_t m = 0; m < b0->num_microbatches; ++m)
      for (int64_t row = 0; row < 2; ++row) {
        EXPECT_EQ(sample_of_row(b0->tokens, m * 2 + row), next_sample + 4 * m + row);
        EXPECT_EQ(sample_of_row(b1->tokens, m * 2 + row), next_sample + 4 * m + 2 + row);
      }
    next_sample += batch;
    EXPECT_EQ(ranks[0]->consumed_samples(), next_sample);
  }
}

TEST(BatchRamp, ResumingInsideTheRampYieldsWhatAnUninterruptedRunYields) {
  auto ds = std::make_shared<CountingDataset>(300, 4);
  const BatchLayout layout{2, 16, 1, 2, kRamp};
  std::vector<std::vector<int32_t>> uninterrupted;
  std::vector<int64_t> consumed;
  {
    DataLoader loader(ds, layout);
    while (std::optional<Batch> b = loader.next()) {
      const int32_t* p = b->labels.data_ptr<int32_t>();
      uninterrupted.emplace_back(p, p + b->labels.numel());
      consumed.push_back(loader.consumed_samples());
    }
  }
  for (size_t stop : {size_t(5), size_t(11), size_t(15)}) {  // in the 4s, the 8s, the 12s
    DataLoader resumed(ds, layout, LoaderOptions{consumed[stop - 1], 2, true, true});
    EXPECT_EQ(resumed.steps_left(), int64_t(uninterrupted.size() - stop));
    for (size_t step = stop; step < uninterrupted.size(); ++step) {
      Batch b = *resumed.next();
      const int32_t* p = b.labels.data_ptr<int32_t>();
      ASSERT_EQ(std::vector<int32_t>(p, p + b.labels.numel()), uninterrupted[step])
          << "resumed after " << stop << ", step " << step;
    }
    EXPECT_FALSE(resumed.next().has_value());
  }
}

}  // namespace
}  // namespace braid::data
