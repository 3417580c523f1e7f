#pragma once
// The three indices of a GPT dataset, built as megatron-core's GPTDataset builds them, so that a
// seed gives braid the samples, in the order, that Megatron gives:
//
//   document index  the documents of the split, repeated for as many epochs as the requested
//                   samples need and shuffled (int32, one entry per document per epoch)
//   sample index    where each sample starts: (position in the document index, token offset in
//                   that document); sample i is the tokens from entry i up to and including the
//                   first token of entry i + 1, i.e. seq_length + 1 tokens that may span
//                   documents, and consecutive samples share one token ([num_samples + 1, 2])
//   shuffle index   a permutation of the samples (int64)
//
// Randomness is numpy's RandomState(seed) (numpy_random.h), used in Megatron's order: the
// document shuffle(s) first, then the sample shuffle(s). When more than one epoch is needed and
// the last one contributes less than 80% of an epoch's samples, the last epoch is shuffled on
// its own (documents and samples), so the few samples taken from it are not spread over the run.
//
// Pure functions of the sequence lengths and the parameters; gpt_dataset.h caches their result.

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "braid/data/numpy_random.h"

namespace braid::data {

struct GPTIndexConfig {
  int64_t seq_length = 0;              // tokens per sample; a sample reads seq_length + 1
  std::optional<int64_t> num_samples;  // at least this many samples; nullopt: one epoch
  uint32_t seed = 1234;
};

struct GPTIndices {
  std::vector<int32_t> document_index;
  std::vector<int64_t> sample_index;  // (document index position, offset) pairs, row-major
  std::vector<int64_t> shuffle_index;
  int64_t num_epochs = 0;
  bool separate_final_epoch = false;

  int64_t num_samples() const { return int64_t(shuffle_index.size()); }
};

// Tokens in documents [begin, end).
int64_t count_tokens(std::span<const int32_t> lengths, int64_t begin, int64_t end);
// Epochs needed for num_samples samples of seq_length (+1) tokens: 1 when num_samples is nullopt.
int64_t num_epochs_for(int64_t tokens_per_epoch, std::optional<int64_t> num_samples,
                       int64_t seq_length);
// Samples that num_epochs epochs hold (the last partial sample is dropped).
int64_t samples_in_epochs(int64_t num_epochs, int64_t tokens_per_epoch, int64_t seq_length);

// Documents [begin, end) num_epochs times, shuffled; with separate_final_epoch the first
// num_epochs - 1 epochs are shuffled together and the last one after them on its own.
std::vector<int32_t> build_document_index(int64_t begin, int64_t end, int64_t num_epochs,
                                          NumpyRandomState& random, bool separate_final_epoch);
// Megatron's build_sample_idx: walks the concatenated documents in steps of seq_length tokens.
std::vector<int64_t> build_sample_index(std::span<const int32_t> lengths,
                                        std::span<const int32_t> document_index, int64_t seq_length,
                                        int64_t num_epochs, int64_t tokens_per_epoch);
// [0, first) shuffled, then [first, total) shuffled on its own (first == total: one shuffle).
std::vector<int64_t> build_shuffle_index(int64_t first, int64_t total, NumpyRandomState& random);

// All three for documents [begin, end) of a dataset with these sequence lengths.
// ConfigError when the range holds fewer than two tokens or seq_length < 1.
GPTIndices build_gpt_indices(std::span<const int32_t> lengths, int64_t begin, int64_t end,
                             const GPTIndexConfig& config);

}  // namespace braid::data
