#pragma once
// BlendedDataset: samples drawn from several datasets in proportion to weights, by Megatron's
// greedy rule: sample i comes from the dataset whose count lags its share the most,
// argmax_d(weight_d * max(i, 1) - count_d) (the first such d on ties). After n samples every
// count is within one sample of weight_d * n, and the order is the same for every run.
//
// The two index arrays are cached like a GPTDataset's (index_cache.h), keyed by the weights, the
// size and every member's description.

#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "braid/core/tensor.h"
#include "braid/data/sample_dataset.h"

namespace braid::data {

// Fills dataset_index[i] (which dataset) and dataset_sample_index[i] (its sample number) for
// `size` samples with the normalised `weights`.
void build_blending_indices(std::span<const double> weights, std::span<int32_t> dataset_index,
                            std::span<int64_t> dataset_sample_index);
// Takes exactly sizes[d] samples from dataset d (sum(sizes) in all), in the same greedy order.
void build_exhaustive_blending_indices(std::span<const int64_t> sizes,
                                       std::span<int32_t> dataset_index,
                                       std::span<int64_t> dataset_sample_index);

class BlendedDataset final : public SampleDataset {
 public:
  // `weights` (positive, normalised here) for num_samples samples; without a number, every sample
  // of every dataset once, blended in proportion to their sizes. ConfigError when the blend needs
  // more samples of a dataset than it has, or the datasets' seq_length differ.
  BlendedDataset(std::vector<std::shared_ptr<const SampleDataset>> datasets,
                 std::vector<double> weights, std::optional<int64_t> num_samples,
                 const std::string& cache_dir, const std::string& split_name);

  int64_t size() const override { return dataset_index_.numel(); }
  int64_t seq_length() const override { return datasets_.front()->seq_length(); }
  void read(int64_t i, int32_t* out) const override;
  const std::string& description() const override { return description_; }

  const std::vector<std::shared_ptr<const SampleDataset>>& datasets() const { return datasets_; }
  const std::vector<double>& weights() const { return weights_; }               // normalised
  const Tensor& dataset_index() const { return dataset_index_; }                // i32 [size]
  const Tensor& dataset_sample_index() const { return dataset_sample_index_; }  // i64 [size]
  bool loaded_from_cache() const { return from_cache_; }

 private:
  std::vector<std::shared_ptr<const SampleDataset>> datasets_;
  std::vector<double> weights_;
  std::string description_;
  Tensor dataset_index_, dataset_sample_index_;
  bool from_cache_ = false;
};

}  // namespace braid::data
