#pragma once
// Megatron's mock data (--mock-data): megatron-core's MockGPTLowLevelDataset under its
// MockGPTDataset, so that a mock run trains on Megatron's samples in Megatron's order.
//
// The low-level dataset is kMockDocuments documents; document d of length L (numpy's
// default_rng(0).integers(1, 4096) for each, which the caller draws: braid.data.mock_lengths)
// holds (1, 2, ..., L - 1) mod vocab_size and then the end-of-document token. Each split takes its
// documents by --split (split_documents) and its samples, document index and shuffle as a
// GPTDataset over those lengths (gpt_indices.h); nothing is cached, as in Megatron.

#include <array>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "braid/data/gpt_indices.h"
#include "braid/data/sample_dataset.h"
#include "braid/data/split.h"

namespace braid::data {

constexpr int64_t kMockDocuments = 100000;        // MockGPTLowLevelDataset.size
constexpr int64_t kMockMaxDocumentLength = 4096;  // its max_sequence_length (exclusive)

struct MockDataConfig {
  std::string split = "969,30,1";
  int64_t seq_length = 0;
  uint32_t seed = 1234;
  int64_t vocab_size = 0;  // the tokenizer's (the tokens wrap around it)
  int64_t eod = 0;         // the tokenizer's end-of-document token
};

class MockGPTDataset final : public SampleDataset {
 public:
  // Documents `documents` of the mock documents of these lengths; at least `num_samples`
  // samples (nullopt: one epoch).
  MockGPTDataset(std::shared_ptr<const std::vector<int32_t>> lengths, DocumentRange documents,
                 Split split, std::optional<int64_t> num_samples, const MockDataConfig& config);

  int64_t size() const override { return indices_.num_samples(); }
  int64_t seq_length() const override { return config_.seq_length; }
  void read(int64_t i, int32_t* out) const override;
  const std::string& description() const override { return description_; }

 private:
  std::shared_ptr<const std::vector<int32_t>> lengths_;
  MockDataConfig config_;
  GPTIndices indices_;
  std::string description_;
};

// The train, valid and test mock datasets (null where a split has weight 0 or asks for 0
// samples); `lengths` holds the kMockDocuments document lengths.
std::array<std::shared_ptr<SampleDataset>, kNumSplits> build_mock_gpt_datasets(
    std::span<const int32_t> lengths, const MockDataConfig& config,
    const std::array<std::optional<int64_t>, kNumSplits>& num_samples);

}  // namespace braid::data
