#include "braid/data/dataset_builder.h"

#include <cmath>
#include <cstdlib>

#include "braid/core/error.h"
#include "braid/data/blended_dataset.h"
#include "braid/data/gpt_dataset.h"
#include "braid/data/indexed_dataset.h"

namespace braid::data {

namespace {

std::string strip(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\n\r"), e = s.find_last_not_of(" \t\n\r");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

std::optional<double> parse_number(const std::string& text) {
  std::string s = strip(text);
  if (s.empty()) return std::nullopt;
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size()) return std::nullopt;
  return v;
}

}  // namespace

Blend parse_data_path(const std::vector<std::string>& args) {
  BRAID_CONFIG_CHECK(!args.empty(), "--data-path: no datasets");
  Blend blend;
  if (args.size() % 2 == 0) {
    std::vector<double> weights;
    for (size_t i = 0; i < args.size(); i += 2) {
      std::optional<double> w = parse_number(args[i]);
      if (!w) {
        weights.clear();
        break;
      }
      weights.push_back(*w);
    }
    if (!weights.empty()) {
      for (size_t i = 1; i < args.size(); i += 2) blend.prefixes.push_back(strip(args[i]));
      for (double w : weights)
        BRAID_CONFIG_CHECK(std::isfinite(w) && w > 0, "--data-path: weight ", w,
                           " (weights must be positive)");
      blend.weights = std::move(weights);
      return blend;
    }
  }
  // Not WEIGHT PREFIX pairs: prefixes alone (Megatron's reading), unless a number comes first.
  BRAID_CONFIG_CHECK(args.size() == 1 || !parse_number(args[0]), "--data-path: ", args.size(),
                     " words starting with the weight ", args[0],
                     ": give WEIGHT PREFIX pairs, or prefixes alone");
  for (const std::string& a : args) blend.prefixes.push_back(strip(a));
  for (const std::string& p : blend.prefixes)
    BRAID_CONFIG_CHECK(!p.empty(), "--data-path: an empty dataset prefix");
  return blend;
}

std::array<std::shared_ptr<SampleDataset>, kNumSplits> build_gpt_datasets(
    const GPTDataConfig& config,
    const std::array<std::optional<int64_t>, kNumSplits>& num_samples) {
  const Blend& blend = config.blend;
  BRAID_CONFIG_CHECK(!blend.prefixes.empty(), "no dataset (--data-path)");
  BRAID_CONFIG_CHECK(!blend.weights || blend.weights->size() == blend.prefixes.size(),
                     "--data-path: ", blend.prefixes.size(), " prefixes with ",
                     blend.weights ? blend.weights->size() : 0, " weights");
  for (const auto& n : num_samples)
    BRAID_CONFIG_CHECK(!n || *n >= 0, "a negative number of samples");
  const std::array<double, kNumSplits> split = parse_split(config.split);

  std::vector<std::shared_ptr<const IndexedDataset>> data;
  std::vector<std::array<std::optional<DocumentRange>, kNumSplits>> ranges;
  for (const std::string& prefix : blend.prefixes) {
    data.push_back(std::make_shared<const IndexedDataset>(IndexedDataset::open(prefix)));
    ranges.push_back(split_documents(split, int64_t(data.back()->num_sequences())));
  }
  auto member = [&](size_t d, int s, std::optional<int64_t> n) {
    GPTDatasetConfig c{config.seq_length, config.seed, config.cache_dir, config.use_cache};
    return std::make_shared<GPTDataset>(data[d], *ranges[d][size_t(s)], Split(s), n, c);
  };
  const std::string blend_cache = !config.use_cache ? ""
                                  : config.cache_dir.empty()
                                      ? default_cache_dir(blend.prefixes.front())
                                      : config.cache_dir;

  std::array<std::shared_ptr<SampleDataset>, kNumSplits> out;
  for (int s = 0; s < kNumSplits; ++s) {
    if (!ranges[0][size_t(s)] || (num_samples[size_t(s)] && *num_samples[size_t(s)] == 0)) continue;
    const std::optional<int64_t> n = num_samples[size_t(s)];
    const char* name = split_name(Split(s));
    if (blend.prefixes.size() == 1 && !blend.weights) {
      out[size_t(s)] = member(0, s, n);
      continue;
    }
    std::vector<std::shared_ptr<const SampleDataset>> members;
    std::vector<double> weights;
    std::optional<int64_t> size;
    if (blend.weights) {
      BRAID_CONFIG_CHECK(n, "a weighted blend needs the number of ", name, " samples");
      double sum = 0;
      for (double w : *blend.weights) sum += w;
      size = 0;
      for (size_t d = 0; d < blend.prefixes.size(); ++d) {
        const double w = (*blend.weights)[d] / sum;
        const int64_t target = int64_t(std::ceil(double(*n) * w));
        const int64_t buffer =
            int64_t(std::ceil(double(target) * (1.0 + config.mid_level_dataset_surplus)));
        members.push_back(member(d, s, buffer));
        weights.push_back(w);
        *size += target;
      }
    } else {
      // Weighted by the members' sizes, one epoch each.
      int64_t total = 0;
      for (size_t d = 0; d < blend.prefixes.size(); ++d) {
        members.push_back(member(d, s, std::nullopt));
        weights.push_back(double(members.back()->size()));
        total += members.back()->size();
      }
      if (n) size = std::min(*n, total);
    }
    out[size_t(s)] = std::make_shared<BlendedDataset>(std::move(members), std::move(weights), size,
                                                      blend_cache, name);
  }
  return out;
}

}  // namespace braid::data
