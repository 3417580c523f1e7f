#pragma once
// The train / valid / test datasets of a run from Megatron's data arguments, built as
// megatron-core's BlendedMegatronDatasetBuilder builds them:
//
//   --data-path A                one dataset, split by --split
//   --data-path 0.3 A 0.7 B      a blend: each prefix is split by --split, each split draws
//                                30% / 70% of its samples from A / B; each member is built with
//                                ceil(ceil(n * w) * 1.005) samples (a 0.5% surplus) and the blend
//                                has sum_d ceil(n * w_d) >= n samples
//   --data-path A B              a blend weighted by the members' sizes (one epoch of each);
//                                n = min(requested, their total)
//
// Every rank calls it with the same arguments and gets the same datasets; the indices are
// cached (gpt_dataset.h, blended_dataset.h), and ranks that find them missing build them once
// between them (index_cache.h).

#include <array>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "braid/data/sample_dataset.h"
#include "braid/data/split.h"

namespace braid::data {

struct Blend {
  std::vector<std::string> prefixes;
  std::optional<std::vector<double>> weights;  // as given (not normalised)
};

// Megatron's --data-path list: weights and prefixes alternating ("0.3 A 0.7 B"), or prefixes
// alone when the count is odd or any would-be weight is not a number. ConfigError when empty or
// a weight is not positive.
Blend parse_data_path(const std::vector<std::string>& args);

struct GPTDataConfig {
  Blend blend;
  std::string split = "969,30,1";
  int64_t seq_length = 0;
  uint32_t seed = 1234;
  std::string cache_dir;  // --data-cache-path; empty: next to each dataset (a blend: the first)
  bool use_cache = true;
  double mid_level_dataset_surplus = 0.005;
};

// One dataset per split (train, valid, test); null where the split has weight 0 or asks for 0
// samples. num_samples[s]: the samples split s must provide (nullopt: one epoch of each
// dataset; a weighted blend needs a number).
std::array<std::shared_ptr<SampleDataset>, kNumSplits> build_gpt_datasets(
    const GPTDataConfig& config, const std::array<std::optional<int64_t>, kNumSplits>& num_samples);

}  // namespace braid::data
