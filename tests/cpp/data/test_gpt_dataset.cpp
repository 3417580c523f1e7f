// GPTDataset on real files: samples are the right tokens, the indices are cached and reloaded,
// the cache key notices changes, a damaged cache is rebuilt, concurrent builders agree; and the
// train/valid/test builder with --split and blends.

#include <gtest/gtest.h>

#include <fstream>
#include <thread>

#include "braid/core/error.h"
#include "braid/data/blended_dataset.h"
#include "braid/data/dataset_builder.h"
#include "braid/data/gpt_dataset.h"
#include "braid/data/index_cache.h"
#include "braid/data/npy_file.h"
#include "test_gpt_util.h"

namespace braid::data {
namespace {

namespace fs = std::filesystem;
using testing::scratch_dir;
using testing::token_at;
using testing::write_dataset;

std::shared_ptr<const IndexedDataset> open_shared(const std::string& prefix) {
  return std::make_shared<const IndexedDataset>(IndexedDataset::open(prefix));
}

// Sample i of `ds` from first principles: the documents in document-index order, concatenated,
// cut at shuffle_index[i] * seq_length.
std::vector<int32_t> expected_sample(const GPTDataset& ds, const std::vector<int32_t>& lengths,
                                     int64_t i) {
  const int64_t seq = ds.seq_length();
  const int64_t j = ds.shuffle_index().data_ptr<int64_t>()[i];
  const int32_t* docs = ds.document_index().data_ptr<int32_t>();
  std::vector<int32_t> out;
  int64_t pos = 0;
  for (int64_t k = 0; k < ds.document_index().numel() && int64_t(out.size()) < seq + 1; ++k) {
    int32_t d = docs[k];
    for (int32_t t = 0; t < lengths[size_t(d)]; ++t, ++pos)
      if (pos >= j * seq && pos <= j * seq + seq) out.push_back(token_at(d, t));
  }
  return out;
}

size_t count_files(const fs::path& dir, const std::string& needle) {
  size_t n = 0;
  if (!fs::exists(dir)) return 0;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().find(needle) != std::string::npos) ++n;
  return n;
}

TEST(GPTDataset, SamplesAreTheTokensOfTheStream) {
  fs::path dir = scratch_dir("gpt");
  std::string prefix = (dir / "corpus").string();
  std::vector<int32_t> lengths = write_dataset(prefix, 120, 60, 1);
  GPTDatasetConfig config{24, 7, "", true};
  GPTDataset ds(open_shared(prefix), {10, 110}, Split::train, 400, config);
  ASSERT_GE(ds.size(), 400);
  std::vector<int32_t> sample(25);
  for (int64_t i : {int64_t(0), int64_t(1), int64_t(57), ds.size() - 1}) {
    ds.read(i, sample.data());
    EXPECT_EQ(sample, expected_sample(ds, lengths, i)) << "sample " << i;
  }
  EXPECT_THROW(ds.read(ds.size(), sample.data()), Error);
}

TEST(GPTDataset, IndicesAreCachedNextToTheData) {
  fs::path dir = scratch_dir("gpt");
  std::string prefix = (dir / "corpus").string();
  write_dataset(prefix, 80, 40, 2);
  GPTDatasetConfig config{16, 3, "", true};
  GPTDataset first(open_shared(prefix), {0, 80}, Split::train, 300, config);
  EXPECT_FALSE(first.loaded_from_cache());
  fs::path cache = default_cache_dir(prefix);
  EXPECT_EQ(cache, dir / "corpus" / "cache" / "GPTDataset_indices");
  EXPECT_EQ(count_files(cache, "-GPTDataset-train-"), 4u);  // three arrays and the description
  EXPECT_EQ(count_files(cache, ".tmp."), 0u);

  GPTDataset second(open_shared(prefix), {0, 80}, Split::train, 300, config);
  EXPECT_TRUE(second.loaded_from_cache());
  EXPECT_EQ(second.cache_path_prefix(), first.cache_path_prefix());
  ASSERT_EQ(second.size(), first.size());
  for (int64_t i = 0; i < first.size(); ++i)
    ASSERT_EQ(second.shuffle_index().data_ptr<int64_t>()[i],
              first.shuffle_index().data_ptr<int64_t>()[i]);

  // Every parameter that shapes the indices is part of the key.
  GPTDataset other_seed(open_shared(prefix), {0, 80}, Split::train, 300, {16, 4, "", true});
  EXPECT_FALSE(other_seed.loaded_from_cache());
  GPTDataset other_count(open_shared(prefix), {0, 80}, Split::train, 301, config);
  EXPECT_FALSE(other_count.loaded_from_cache());
  GPTDataset other_range(open_shared(prefix), {0, 79}, Split::train, 300, config);
  EXPECT_FALSE(other_range.loaded_from_cache());
  GPTDataset other_split(open_shared(prefix), {0, 80}, Split::valid, 300, config);
  EXPECT_FALSE(other_split.loaded_from_cache());

  // New data under the same name (other sizes / times): rebuilt, not reused.
  write_dataset(prefix, 81, 40, 9);
  GPTDataset rewritten(open_shared(prefix), {0, 80}, Split::train, 300, config);
  EXPECT_FALSE(rewritten.loaded_from_cache());
}

TEST(GPTDataset, CacheDirectoryAndNoCache) {
  fs::path dir = scratch_dir("gpt");
  std::string prefix = (dir / "corpus").string();
  write_dataset(prefix, 40, 40, 3);
  fs::path cache = dir / "elsewhere";
  GPTDataset a(open_shared(prefix), {0, 40}, Split::train, 50, {8, 1, cache.string(), true});
  EXPECT_EQ(count_files(cache, "description.txt"), 1u);
  EXPECT_FALSE(fs::exists(default_cache_dir(prefix)));

  GPTDataset b(open_shared(prefix), {0, 40}, Split::train, 50, {8, 1, "", false});
  EXPECT_FALSE(fs::exists(default_cache_dir(prefix)));
  EXPECT_EQ(b.cache_path_prefix(), "");
  EXPECT_EQ(b.size(), a.size());

  // A cache path that cannot be created: a warning, and the indices live in memory.
  std::ofstream(dir / "a_file") << "x";
  GPTDataset c(open_shared(prefix), {0, 40}, Split::train, 50,
               {8, 1, (dir / "a_file" / "sub").string(), true});
  EXPECT_EQ(c.size(), a.size());
  EXPECT_EQ(c.cache_path_prefix(), "");
}

TEST(GPTDataset, DamagedCacheIsRebuilt) {
  fs::path dir = scratch_dir("gpt");
  std::string prefix = (dir / "corpus").string();
  write_dataset(prefix, 60, 30, 4);
  GPTDatasetConfig config{8, 1, "", true};
  std::string cache_prefix;
  std::vector<int64_t> shuffle;
  {
    GPTDataset a(open_shared(prefix), {0, 60}, Split::train, 100, config);
    cache_prefix = a.cache_path_prefix();
    const int64_t* p = a.shuffle_index().data_ptr<int64_t>();
    shuffle.assign(p, p + a.size());
  }
  fs::resize_file(cache_prefix + "-shuffle_index.npy", 100);  // truncated
  GPTDataset b(open_shared(prefix), {0, 60}, Split::train, 100, config);
  EXPECT_FALSE(b.loaded_from_cache());
  ASSERT_EQ(b.size(), int64_t(shuffle.size()));
  for (int64_t i = 0; i < b.size(); ++i)
    ASSERT_EQ(b.shuffle_index().data_ptr<int64_t>()[i], shuffle[size_t(i)]);
  GPTDataset c(open_shared(prefix), {0, 60}, Split::train, 100, config);
  EXPECT_TRUE(c.loaded_from_cache());
}

TEST(GPTDataset, ConcurrentBuildersAgree) {
  fs::path dir = scratch_dir("gpt");
  std::string prefix = (dir / "corpus").string();
  write_dataset(prefix, 200, 50, 5);
  auto data = open_shared(prefix);
  constexpr int kThreads = 4;
  std::vector<std::unique_ptr<GPTDataset>> built(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      built[size_t(t)] = std::make_unique<GPTDataset>(data, DocumentRange{0, 200}, Split::train,
                                                      2000, GPTDatasetConfig{32, 11, "", true});
    });
  for (auto& th : threads) th.join();
  int built_here = 0;
  for (const auto& ds : built) {
    built_here += ds->loaded_from_cache() ? 0 : 1;
    ASSERT_EQ(ds->size(), built[0]->size());
    for (int64_t i = 0; i < ds->size(); ++i)
      ASSERT_EQ(ds->shuffle_index().data_ptr<int64_t>()[i],
                built[0]->shuffle_index().data_ptr<int64_t>()[i]);
  }
  EXPECT_EQ(built_here, 1);  // the lock: one builds, the others map its files
  EXPECT_EQ(count_files(default_cache_dir(prefix), ".tmp."), 0u);
}

TEST(GPTDataset, TooFewDocumentsIsAConfigError) {
  fs::path dir = scratch_dir("gpt");
  std::string prefix = (dir / "corpus").string();
  write_dataset(prefix, 10, 5, 6);
  auto data = open_shared(prefix);
  EXPECT_THROW(GPTDataset(data, {3, 3}, Split::test, 1, {8, 1, "", false}), ConfigError);
  EXPECT_THROW(GPTDataset(data, {0, 11}, Split::train, 1, {8, 1, "", false}), ConfigError);
  EXPECT_THROW(GPTDataset(data, {0, 1}, Split::train, 1, {100, 1, "", false}), ConfigError);
}

TEST(NpyFile, RoundTripAndBadFiles) {
  fs::path dir = scratch_dir("npy");
  std::vector<int64_t> values = {1, -2, 3, 4, 5, 6};
  Tensor t = tensor_from_vector(std::vector<int64_t>(values), {3, 2});
  std::string path = (dir / "a.npy").string();
  write_npy(path, t);
  Tensor back = read_npy(path);
  EXPECT_EQ(back.shape(), (Shape{3, 2}));
  EXPECT_EQ(back.dtype(), DType::i64);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(back.data_ptr<int64_t>()[i], values[size_t(i)]);
  EXPECT_EQ((fs::file_size(path) - 48) % 64, 0u);  // the data starts at a multiple of 64

  write_npy((dir / "e.npy").string(), tensor_from_vector(std::vector<int32_t>{}, {0}));
  EXPECT_EQ(read_npy((dir / "e.npy").string()).numel(), 0);

  fs::resize_file(path, 100);
  EXPECT_THROW(read_npy(path), ConfigError);
  std::ofstream(dir / "junk.npy") << "not numpy at all";
  EXPECT_THROW(read_npy((dir / "junk.npy").string()), ConfigError);
  EXPECT_THROW(read_npy((dir / "missing.npy").string()), ConfigError);
}

TEST(DatasetBuilder, SplitsAndSizes) {
  fs::path dir = scratch_dir("build");
  std::string prefix = (dir / "corpus").string();
  write_dataset(prefix, 100, 40, 7);
  GPTDataConfig config;
  config.blend = parse_data_path({prefix});
  config.split = "80,20,0";
  config.seq_length = 16;
  auto splits = build_gpt_datasets(config, {300, 20, 5});
  ASSERT_TRUE(splits[0] && splits[1]);
  EXPECT_FALSE(splits[2]);  // weight 0
  auto* train = dynamic_cast<GPTDataset*>(splits[0].get());
  ASSERT_TRUE(train);
  EXPECT_GE(train->size(), 300);
  // Train documents are 0..79, valid 80..99.
  const int32_t* docs = train->document_index().data_ptr<int32_t>();
  for (int64_t k = 0; k < train->document_index().numel(); ++k) EXPECT_LT(docs[k], 80);
  auto* valid = dynamic_cast<GPTDataset*>(splits[1].get());
  ASSERT_TRUE(valid);
  docs = valid->document_index().data_ptr<int32_t>();
  for (int64_t k = 0; k < valid->document_index().numel(); ++k) EXPECT_GE(docs[k], 80);

  // A split that asks for no samples is not built.
  EXPECT_FALSE(build_gpt_datasets(config, {300, 0, 0})[1]);
}

TEST(DatasetBuilder, WeightedBlendDrawsInProportion) {
  fs::path dir = scratch_dir("build");
  std::string a = (dir / "a").string(), b = (dir / "b").string();
  write_dataset(a, 50, 30, 8);
  write_dataset(b, 70, 30, 9);
  GPTDataConfig config;
  config.blend = parse_data_path({"0.3", a, "0.7", b});
  config.split = "1";
  config.seq_length = 8;
  config.cache_dir = (dir / "cache").string();
  auto splits = build_gpt_datasets(config, {2000, std::nullopt, std::nullopt});
  auto* blend = dynamic_cast<BlendedDataset*>(splits[0].get());
  ASSERT_TRUE(blend);
  EXPECT_EQ(blend->size(), 600 + 1400);
  EXPECT_EQ(blend->datasets()[0]->size() >= 603, true);  // ceil(600 * 1.005)
  std::vector<int64_t> counts(2, 0);
  const int32_t* which = blend->dataset_index().data_ptr<int32_t>();
  for (int64_t i = 0; i < blend->size(); ++i) ++counts[size_t(which[i])];
  EXPECT_EQ(counts[0], 600);
  EXPECT_EQ(counts[1], 1400);
  // Samples come from the right files: tokens of dataset a are a's (documents < 50 there).
  std::vector<int32_t> sample(9);
  blend->read(0, sample.data());
  EXPECT_FALSE(blend->loaded_from_cache());
  auto again = build_gpt_datasets(config, {2000, std::nullopt, std::nullopt});
  EXPECT_TRUE(dynamic_cast<BlendedDataset*>(again[0].get())->loaded_from_cache());

  // Prefixes without weights: weighted by their sizes, capped at their total.
  config.blend = parse_data_path({a, b});
  auto unweighted = build_gpt_datasets(config, {100000, std::nullopt, std::nullopt});
  auto* u = dynamic_cast<BlendedDataset*>(unweighted[0].get());
  ASSERT_TRUE(u);
  EXPECT_EQ(u->size(), u->datasets()[0]->size() + u->datasets()[1]->size());

  // A weighted blend needs a sample count.
  config.blend = parse_data_path({"1", a, "1", b});
  EXPECT_THROW(build_gpt_datasets(config, {std::nullopt, std::nullopt, std::nullopt}), ConfigError);
}

}  // namespace
}  // namespace braid::data
