#include "braid/data/data_loader.h"

#include <chrono>
#include <cstring>
#include <vector>

namespace braid::data {

Tensor Batch::microbatch_tokens(int64_t m) const {
  BRAID_CHECK(tokens.defined(), "this loader does not read tokens (needs_tokens=false)");
  BRAID_CHECK(0 <= m && m < num_microbatches, "microbatch ", m, " of ", num_microbatches);
  return tokens.narrow(m * micro_batch_size, micro_batch_size);
}

Tensor Batch::microbatch_labels(int64_t m) const {
  BRAID_CHECK(labels.defined(), "this loader does not read labels (needs_labels=false)");
  BRAID_CHECK(0 <= m && m < num_microbatches, "microbatch ", m, " of ", num_microbatches);
  return labels.narrow(m * micro_batch_size, micro_batch_size);
}

DataLoader::DataLoader(std::shared_ptr<const SampleDataset> dataset, BatchLayout layout,
                       LoaderOptions options)
    : dataset_(std::move(dataset)),
      layout_(layout),
      options_(options),
      consumed_(options.consumed_samples) {
  BRAID_CHECK(dataset_, "DataLoader: no dataset");
  layout_.validate();
  BRAID_CONFIG_CHECK(options_.consumed_samples >= 0, "consumed_samples must not be negative, got ",
                     options_.consumed_samples);
  BRAID_CONFIG_CHECK(options_.prefetch >= 1, "prefetch must be at least 1, got ",
                     options_.prefetch);
  thread_ = std::thread([this] { run(); });
}

DataLoader::~DataLoader() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  space_.notify_all();
  if (thread_.joinable()) thread_.join();
}

int64_t DataLoader::steps_left() const {
  if (finished_) return 0;
  return layout_.steps_between(consumed_, dataset_->size());
}

Batch DataLoader::load(int64_t consumed) const {
  const int64_t seq = dataset_->seq_length();
  Batch b;
  b.global_batch_size = layout_.global_batch_size_at(consumed);
  b.micro_batch_size = layout_.micro_batch_size;
  b.num_microbatches = b.global_batch_size / (layout_.micro_batch_size * layout_.dp_size);
  b.consumed_samples = consumed + b.global_batch_size;
  const int64_t rows = b.num_microbatches * b.micro_batch_size;
  if (!options_.needs_tokens && !options_.needs_labels) return b;
  if (options_.needs_tokens) b.tokens = Tensor::empty({rows, seq}, DType::i32);
  if (options_.needs_labels) b.labels = Tensor::empty({rows, seq}, DType::i32);
  int32_t* tokens = options_.needs_tokens ? b.tokens.data_ptr<int32_t>() : nullptr;
  int32_t* labels = options_.needs_labels ? b.labels.data_ptr<int32_t>() : nullptr;
  std::vector<int32_t> sample(size_t(seq + 1));
  for (int64_t m = 0; m < b.num_microbatches; ++m) {
    for (int64_t r = 0; r < layout_.micro_batch_size; ++r) {
      dataset_->read(layout_.sample(consumed, m, r), sample.data());
      const int64_t row = m * layout_.micro_batch_size + r;
      if (tokens) std::memcpy(tokens + row * seq, sample.data(), size_t(seq) * 4);
      if (labels) std::memcpy(labels + row * seq, sample.data() + 1, size_t(seq) * 4);
    }
  }
  return b;
}

void DataLoader::push(Item item) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(item));
  }
  ready_.notify_one();
}

void DataLoader::run() {
  try {
    for (int64_t consumed = options_.consumed_samples;
         consumed + layout_.global_batch_size_at(consumed) <= dataset_->size();
         consumed += layout_.global_batch_size_at(consumed)) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        space_.wait(lock, [&] { return stop_ || int64_t(queue_.size()) < options_.prefetch; });
        if (stop_) return;
      }
      push(Item{load(consumed), nullptr});
    }
    push(Item{std::nullopt, nullptr});
  } catch (...) {
    push(Item{std::nullopt, std::current_exception()});
  }
}

std::optional<Batch> DataLoader::next() {
  if (error_) std::rethrow_exception(error_);
  if (finished_) return std::nullopt;
  Item item;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (queue_.empty()) {
      auto start = std::chrono::steady_clock::now();
      ready_.wait(lock, [&] { return !queue_.empty(); });
      wait_seconds_ +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    item = std::move(queue_.front());
    queue_.pop_front();
  }
  space_.notify_one();
  if (item.error) {
    error_ = item.error;
    finished_ = true;
    std::rethrow_exception(error_);
  }
  if (!item.batch) {
    finished_ = true;
    return std::nullopt;
  }
  consumed_ = item.batch->consumed_samples;
  return std::move(item.batch);
}

}  // namespace braid::data
