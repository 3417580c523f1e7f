#include "braid/data/blended_dataset.h"

#include <cmath>
#include <limits>
#include <numeric>
#include <sstream>

#include "braid/data/index_cache.h"

namespace braid::data {

namespace {

constexpr int kBlendFormatVersion = 1;

// The dataset whose count lags its share the most after `i` samples, among those `open` allows.
template <typename Open>
int32_t most_behind(std::span<const double> weights, std::span<const int64_t> counts, int64_t i,
                    Open open) {
  const double n = std::max(double(i), 1.0);
  int32_t best = -1;
  double best_error = std::numeric_limits<double>::lowest();
  for (size_t d = 0; d < weights.size(); ++d) {
    if (!open(d)) continue;
    double error = weights[d] * n - double(counts[d]);
    if (best < 0 || error > best_error) {
      best = int32_t(d);
      best_error = error;
    }
  }
  return best;
}

}  // namespace

void build_blending_indices(std::span<const double> weights, std::span<int32_t> dataset_index,
                            std::span<int64_t> dataset_sample_index) {
  BRAID_CHECK(dataset_index.size() == dataset_sample_index.size(),
              "blending indices of different sizes");
  std::vector<int64_t> counts(weights.size(), 0);
  for (size_t i = 0; i < dataset_index.size(); ++i) {
    int32_t d = most_behind(weights, counts, int64_t(i), [](size_t) { return true; });
    dataset_index[i] = d;
    dataset_sample_index[i] = counts[size_t(d)]++;
  }
}

void build_exhaustive_blending_indices(std::span<const int64_t> sizes,
                                       std::span<int32_t> dataset_index,
                                       std::span<int64_t> dataset_sample_index) {
  const int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t(0));
  BRAID_CHECK(
      int64_t(dataset_index.size()) == total && int64_t(dataset_sample_index.size()) == total,
      "exhaustive blending indices: ", dataset_index.size(), " entries for ", total, " samples");
  std::vector<double> weights(sizes.size());
  for (size_t d = 0; d < sizes.size(); ++d) weights[d] = double(sizes[d]) / double(total);
  std::vector<int64_t> counts(sizes.size(), 0);
  for (int64_t i = 0; i < total; ++i) {
    int32_t d = most_behind(weights, counts, i, [&](size_t k) { return counts[k] < sizes[k]; });
    dataset_index[size_t(i)] = d;
    dataset_sample_index[size_t(i)] = counts[size_t(d)]++;
  }
}

BlendedDataset::BlendedDataset(std::vector<std::shared_ptr<const SampleDataset>> datasets,
                               std::vector<double> weights, std::optional<int64_t> num_samples,
                               const std::string& cache_dir, const std::string& split_name)
    : datasets_(std::move(datasets)), weights_(std::move(weights)) {
  BRAID_CONFIG_CHECK(!datasets_.empty(), "a blend of no datasets");
  BRAID_CONFIG_CHECK(datasets_.size() < 32767, "a blend of at most 32766 datasets");
  BRAID_CONFIG_CHECK(weights_.size() == datasets_.size(), "a blend of ", datasets_.size(),
                     " datasets with ", weights_.size(), " weights");
  double sum = 0;
  for (size_t d = 0; d < datasets_.size(); ++d) {
    BRAID_CHECK(datasets_[d], "blend: dataset ", d, " is null");
    BRAID_CONFIG_CHECK(datasets_[d]->seq_length() == datasets_[0]->seq_length(),
                       "blend: datasets of different seq_length");
    BRAID_CONFIG_CHECK(weights_[d] > 0 && std::isfinite(weights_[d]),
                       "blend weights must be positive, got ", weights_[d]);
    sum += weights_[d];
  }
  BRAID_CONFIG_CHECK(!num_samples || *num_samples >= 0, "blend size must not be negative");
  std::vector<int64_t> exact_sizes;
  if (!num_samples) {
    // Megatron's exhaustive blend: the weights are the datasets' sizes.
    for (const auto& d : datasets_) exact_sizes.push_back(d->size());
  }
  for (double& w : weights_) w /= sum;

  std::ostringstream d;
  d << "braid BlendedDataset indices, format " << kBlendFormatVersion << "\n"
    << "split: " << split_name << "\n"
    << "size: " << (num_samples ? std::to_string(*num_samples) : "exhaustive") << "\n"
    << "weights:";
  d.precision(17);
  for (double w : weights_) d << " " << w;
  d << "\n";
  for (size_t k = 0; k < datasets_.size(); ++k)
    d << "--- dataset " << k << " ---\n" << datasets_[k]->description();
  description_ = d.str();

  auto build = [&] {
    int64_t n = num_samples ? *num_samples
                            : std::accumulate(exact_sizes.begin(), exact_sizes.end(), int64_t(0));
    std::vector<int32_t> which(static_cast<size_t>(n), 0);
    std::vector<int64_t> sample(static_cast<size_t>(n), 0);
    if (num_samples)
      build_blending_indices(weights_, which, sample);
    else
      build_exhaustive_blending_indices(exact_sizes, which, sample);
    return std::vector<Tensor>{tensor_from_vector(std::move(which), {n}),
                               tensor_from_vector(std::move(sample), {n})};
  };
  CachedArrays cached = load_or_build(cache_dir, "BlendedDataset-" + split_name, description_,
                                      {"dataset_index", "dataset_sample_index"}, build);
  dataset_index_ = cached.arrays[0];
  dataset_sample_index_ = cached.arrays[1];
  from_cache_ = cached.from_cache;
  BRAID_CONFIG_CHECK(dataset_index_.dtype() == DType::i32 && dataset_index_.dim() == 1 &&
                         dataset_sample_index_.dtype() == DType::i64 &&
                         dataset_sample_index_.shape() == dataset_index_.shape(),
                     "BlendedDataset cache ", cached.path_prefix, ": arrays of unexpected shapes");

  // Megatron's check: a blend may not ask a dataset for more samples than it has.
  std::vector<int64_t> counts(datasets_.size(), 0);
  const int32_t* which = dataset_index_.data_ptr<int32_t>();
  for (int64_t i = 0; i < size(); ++i) {
    BRAID_CONFIG_CHECK(0 <= which[i] && size_t(which[i]) < datasets_.size(),
                       "BlendedDataset cache ", cached.path_prefix, ": bad dataset index");
    ++counts[size_t(which[i])];
  }
  for (size_t k = 0; k < datasets_.size(); ++k)
    BRAID_CONFIG_CHECK(counts[k] <= datasets_[k]->size(), "the ", split_name, " blend takes ",
                       counts[k], " samples from dataset ", k, ", which has ",
                       datasets_[k]->size());
}

void BlendedDataset::read(int64_t i, int32_t* out) const {
  BRAID_CHECK(0 <= i && i < size(), "sample ", i, " out of range [0, ", size(), ")");
  int32_t d = dataset_index_.data_ptr<int32_t>()[i];
  datasets_[size_t(d)]->read(dataset_sample_index_.data_ptr<int64_t>()[i], out);
}

}  // namespace braid::data
