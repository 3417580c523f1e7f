#include "braid/data/mock_dataset.h"

#include <sstream>

#include "braid/core/error.h"
#include "braid/core/log.h"

namespace braid::data {

MockGPTDataset::MockGPTDataset(std::shared_ptr<const std::vector<int32_t>> lengths,
                               DocumentRange documents, Split split,
                               std::optional<int64_t> num_samples, const MockDataConfig& config)
    : lengths_(std::move(lengths)), config_(config) {
  BRAID_CONFIG_CHECK(config.vocab_size > 0 && 0 <= config.eod && config.eod < config.vocab_size,
                     "mock data: the end-of-document token ", config.eod,
                     " must be in the vocabulary [0, ", config.vocab_size, ")");
  indices_ = build_gpt_indices(*lengths_, documents.begin, documents.end,
                               GPTIndexConfig{config.seq_length, num_samples, config.seed});
  log::info("mock data ", split_name(split), ": built ", indices_.num_samples(), " samples of ",
            config.seq_length, " tokens over ", indices_.num_epochs, " epoch(s)");
  std::ostringstream d;
  d << "Megatron's mock data, " << split_name(split) << " documents [" << documents.begin << ", "
    << documents.end << "), seq_length " << config.seq_length << ", seed " << config.seed
    << ", vocabulary " << config.vocab_size << ", end of document " << config.eod << "\n";
  description_ = d.str();
}

void MockGPTDataset::read(int64_t i, int32_t* out) const {
  BRAID_CHECK(0 <= i && i < size(), "sample ", i, " out of range [0, ", size(), ")");
  const int64_t j = indices_.shuffle_index[size_t(i)];
  const int64_t* samples = indices_.sample_index.data();
  const int64_t first = samples[2 * j], first_offset = samples[2 * j + 1];
  const int64_t last = samples[2 * j + 2], last_offset = samples[2 * j + 3];
  int64_t written = 0;
  for (int64_t k = first; k <= last; ++k) {
    const int64_t length = (*lengths_)[size_t(indices_.document_index[size_t(k)])];
    const int64_t begin = k == first ? first_offset : 0, end = k == last ? last_offset + 1 : length;
    // MockGPTLowLevelDataset: (arange(L - 1) + 1) % vocab_size, then the end of document.
    for (int64_t o = begin; o < end; ++o)
      out[written++] = int32_t(o == length - 1 ? config_.eod : (o + 1) % config_.vocab_size);
  }
  BRAID_CHECK(written == config_.seq_length + 1, "mock sample ", i, " has ", written,
              " tokens, expected ", config_.seq_length + 1);
}

std::array<std::shared_ptr<SampleDataset>, kNumSplits> build_mock_gpt_datasets(
    std::span<const int32_t> lengths, const MockDataConfig& config,
    const std::array<std::optional<int64_t>, kNumSplits>& num_samples) {
  BRAID_CONFIG_CHECK(int64_t(lengths.size()) == kMockDocuments, "mock data: ", lengths.size(),
                     " document lengths, expected ", kMockDocuments);
  for (int32_t l : lengths) {
    BRAID_CONFIG_CHECK(1 <= l && l < kMockMaxDocumentLength, "mock data: a document length ", l,
                       " outside [1, ", kMockMaxDocumentLength, ")");
  }
  auto shared = std::make_shared<const std::vector<int32_t>>(lengths.begin(), lengths.end());
  const auto ranges = split_documents(parse_split(config.split), kMockDocuments);
  std::array<std::shared_ptr<SampleDataset>, kNumSplits> out;
  for (int s = 0; s < kNumSplits; ++s) {
    const auto& n = num_samples[size_t(s)];
    if (!ranges[size_t(s)] || (n && *n == 0)) continue;
    out[size_t(s)] =
        std::make_shared<MockGPTDataset>(shared, *ranges[size_t(s)], Split(s), n, config);
  }
  return out;
}

}  // namespace braid::data
