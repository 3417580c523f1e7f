#pragma once
// GPTDataset: the samples of one split of one indexed dataset, in Megatron's order
// (gpt_indices.h), with the indices cached next to the data (index_cache.h).
//
// The cache directory is `cache_dir` when set (--data-cache-path), else Megatron's default
// `<path_prefix>/cache/GPTDataset_indices`. The key covers the absolute path prefix, the size and
// modification time of .bin and .idx, the number of sequences, the split and its document range,
// seq_length, the number of samples, the seed and the index format version.

#include <memory>
#include <optional>
#include <string>

#include "braid/core/tensor.h"
#include "braid/data/indexed_dataset.h"
#include "braid/data/sample_dataset.h"
#include "braid/data/split.h"

namespace braid::data {

struct GPTDatasetConfig {
  int64_t seq_length = 0;
  uint32_t seed = 1234;
  std::string cache_dir;  // empty: <path_prefix>/cache/GPTDataset_indices
  bool use_cache = true;  // false: build in memory, write nothing
};

// Megatron's default cache directory for a dataset prefix.
std::string default_cache_dir(const std::string& path_prefix);

class GPTDataset final : public SampleDataset {
 public:
  // Sequences [documents.begin, documents.end) of `data`; at least `num_samples` samples
  // (nullopt: one epoch). ConfigError when the range holds too few tokens for one sample.
  GPTDataset(std::shared_ptr<const IndexedDataset> data, DocumentRange documents, Split split,
             std::optional<int64_t> num_samples, const GPTDatasetConfig& config);

  int64_t size() const override { return shuffle_index_.numel(); }
  int64_t seq_length() const override { return seq_length_; }
  void read(int64_t i, int32_t* out) const override;
  const std::string& description() const override { return description_; }

  const IndexedDataset& data() const { return *data_; }
  Split split() const { return split_; }
  const Tensor& document_index() const { return document_index_; }  // i32 [documents * epochs]
  const Tensor& sample_index() const { return sample_index_; }      // i64 [size + 1, 2]
  const Tensor& shuffle_index() const { return shuffle_index_; }    // i64 [size]
  bool loaded_from_cache() const { return from_cache_; }
  const std::string& cache_path_prefix() const { return cache_prefix_; }  // "" if not on disk

 private:
  std::shared_ptr<const IndexedDataset> data_;
  Split split_;
  int64_t seq_length_;
  std::string description_;
  Tensor document_index_, sample_index_, shuffle_index_;
  const int32_t* documents_ = nullptr;  // the three indices' data
  const int64_t* samples_ = nullptr;
  const int64_t* shuffle_ = nullptr;
  bool from_cache_ = false;
  std::string cache_prefix_;
};

}  // namespace braid::data
