#pragma once
// What a loader reads: a fixed number of samples of seq_length + 1 tokens each (the inputs are
// the first seq_length tokens, the labels the last seq_length). GPTDataset and BlendedDataset
// are the two kinds.

#include <cstdint>
#include <string>

namespace braid::data {

class SampleDataset {
 public:
  virtual ~SampleDataset() = default;

  virtual int64_t size() const = 0;        // samples
  virtual int64_t seq_length() const = 0;  // a sample is seq_length + 1 tokens
  // Writes sample i's seq_length + 1 tokens to `out`. Safe to call from several threads.
  virtual void read(int64_t i, int32_t* out) const = 0;
  // Names every input that decides the samples and their order (a blend's cache key includes it).
  virtual const std::string& description() const = 0;
};

}  // namespace braid::data
