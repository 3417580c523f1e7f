#pragma once
// DataLoader: a DP rank's batches of a SampleDataset, loaded on a background thread.
//
// Each step is the global batch that begins at the samples consumed so far (from
// consumed_samples on): global_batch_size samples, or under a ramp the layout's
// global_batch_size_at them; this rank's rows are its microbatches in Megatron's order
// (batch_layout.h). A bounded queue holds up to `prefetch` loaded steps; next() takes
// the oldest and waits only when the thread is behind. The loader ends (next() returns nullopt)
// when the next step's samples are not all left; an error on the thread (a damaged file, a
// bad index) is rethrown by next(), message and type intact. Destroying the loader stops the
// thread and joins it.
//
// Resuming: a checkpoint stores consumed_samples(); a loader started there yields exactly the
// batches an uninterrupted loader yields from that step on. Pipeline stages that read neither
// tokens nor labels pass needs_tokens = needs_labels = false and still count consumed samples.

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "braid/core/tensor.h"
#include "braid/data/batch_layout.h"
#include "braid/data/sample_dataset.h"

namespace braid::data {

struct LoaderOptions {
  int64_t consumed_samples = 0;  // over all DP ranks; where a resumed run starts
  int64_t prefetch = 2;          // steps loaded ahead of the consumer
  bool needs_tokens = true;      // the first pipeline stage
  bool needs_labels = true;      // the last pipeline stage
};

struct Batch {
  Tensor tokens;  // i32 [num_microbatches * micro_batch_size, seq_length]; undefined if not needed
  Tensor labels;  // i32, the same shape: each row's tokens shifted by one
  int64_t num_microbatches = 0;
  int64_t micro_batch_size = 0;
  int64_t global_batch_size = 0;  // this step's, over all DP ranks (ramps: it grows)
  int64_t consumed_samples = 0;   // after this step, over all DP ranks

  Tensor microbatch_tokens(int64_t m) const;  // views of microbatch m's rows
  Tensor microbatch_labels(int64_t m) const;
};

class DataLoader {
 public:
  // ConfigError for a bad layout, a negative start or prefetch < 1.
  DataLoader(std::shared_ptr<const SampleDataset> dataset, BatchLayout layout,
             LoaderOptions options = {});
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  // The next step's batch; nullopt at the end of the data.
  std::optional<Batch> next();

  int64_t consumed_samples() const { return consumed_; }  // after the last batch next() returned
  int64_t steps_left() const;                             // whole steps not yet returned
  const BatchLayout& layout() const { return layout_; }
  const SampleDataset& dataset() const { return *dataset_; }
  double wait_seconds() const { return wait_seconds_; }  // next()'s total time waiting

 private:
  struct Item {
    std::optional<Batch> batch;  // empty with no error: the end
    std::exception_ptr error;
  };
  void run();
  Batch load(int64_t consumed) const;
  void push(Item item);

  std::shared_ptr<const SampleDataset> dataset_;
  BatchLayout layout_;
  LoaderOptions options_;
  int64_t consumed_;
  bool finished_ = false;
  std::exception_ptr error_;
  double wait_seconds_ = 0;

  std::mutex mutex_;
  std::condition_variable ready_;  // an item was queued
  std::condition_variable space_;  // an item was taken, or stop
  std::deque<Item> queue_;
  bool stop_ = false;
  std::thread thread_;  // last: started when everything above exists
};

}  // namespace braid::data
