#include "braid/data/gpt_dataset.h"

#include <sys/stat.h>

#include <filesystem>
#include <sstream>

#include "braid/core/log.h"
#include "braid/data/gpt_indices.h"
#include "braid/data/index_cache.h"

namespace braid::data {

namespace fs = std::filesystem;

namespace {

// Bump when the indices' layout or the algorithm that builds them changes.
constexpr int kIndexFormatVersion = 1;

std::string file_identity(const std::string& path) {
  struct stat st {};
  BRAID_CONFIG_CHECK(::stat(path.c_str(), &st) == 0, "cannot stat ", path);
  std::ostringstream out;
  out << st.st_size << " bytes, mtime " << st.st_mtim.tv_sec << "." << st.st_mtim.tv_nsec;
  return out.str();
}

}  // namespace

std::string default_cache_dir(const std::string& path_prefix) {
  return (fs::path(path_prefix) / "cache" / "GPTDataset_indices").string();
}

GPTDataset::GPTDataset(std::shared_ptr<const IndexedDataset> data, DocumentRange documents,
                       Split split, std::optional<int64_t> num_samples,
                       const GPTDatasetConfig& config)
    : data_(std::move(data)), split_(split), seq_length_(config.seq_length) {
  BRAID_CHECK(data_, "GPTDataset: no indexed dataset");
  const std::string& prefix = data_->path_prefix();
  BRAID_CONFIG_CHECK(config.seq_length >= 1, "seq_length must be at least 1, got ",
                     config.seq_length);
  BRAID_CONFIG_CHECK(0 <= documents.begin && documents.begin <= documents.end &&
                         documents.end <= int64_t(data_->num_sequences()),
                     prefix, ": documents [", documents.begin, ", ", documents.end,
                     ") out of range for ", data_->num_sequences(), " sequences");
  BRAID_CONFIG_CHECK(documents.size() > 0, prefix, ": the ", split_name(split),
                     " split has no documents (too few documents for --split?)");

  std::ostringstream d;
  d << "braid GPTDataset indices, format " << kIndexFormatVersion << "\n"
    << "path_prefix: " << fs::absolute(prefix).lexically_normal().string() << "\n"
    << "idx: " << file_identity(prefix + ".idx") << "\n"
    << "bin: " << file_identity(prefix + ".bin") << "\n"
    << "sequences: " << data_->num_sequences() << "\n"
    << "split: " << split_name(split) << ", documents [" << documents.begin << ", " << documents.end
    << ")\n"
    << "seq_length: " << config.seq_length << "\n"
    << "num_samples: " << (num_samples ? std::to_string(*num_samples) : "one epoch") << "\n"
    << "seed: " << config.seed << "\n"
    << "sample: seq_length + 1 tokens, the last partial sample dropped\n";
  description_ = d.str();

  auto build = [&] {
    std::vector<int32_t> lengths = data_->sequence_lengths().to_vector();
    GPTIndices indices =
        build_gpt_indices(lengths, documents.begin, documents.end,
                          GPTIndexConfig{config.seq_length, num_samples, config.seed});
    log::info(prefix, " ", split_name(split), ": built ", indices.num_samples(), " samples of ",
              config.seq_length, " tokens over ", indices.num_epochs, " epoch(s)",
              indices.separate_final_epoch ? " (the last shuffled on its own)" : "");
    int64_t documents_len = int64_t(indices.document_index.size());
    int64_t samples_len = int64_t(indices.sample_index.size() / 2);
    int64_t shuffle_len = int64_t(indices.shuffle_index.size());
    return std::vector<Tensor>{
        tensor_from_vector(std::move(indices.document_index), {documents_len}),
        tensor_from_vector(std::move(indices.sample_index), {samples_len, 2}),
        tensor_from_vector(std::move(indices.shuffle_index), {shuffle_len})};
  };
  std::string dir = config.use_cache
                        ? (config.cache_dir.empty() ? default_cache_dir(prefix) : config.cache_dir)
                        : "";
  CachedArrays cached =
      load_or_build(dir, std::string("GPTDataset-") + split_name(split), description_,
                    {"document_index", "sample_index", "shuffle_index"}, build);
  document_index_ = cached.arrays[0];
  sample_index_ = cached.arrays[1];
  shuffle_index_ = cached.arrays[2];
  from_cache_ = cached.from_cache;
  cache_prefix_ = cached.path_prefix;

  // Shapes and dtypes that agree (read() checks each entry it uses).
  BRAID_CONFIG_CHECK(document_index_.dtype() == DType::i32 && document_index_.dim() == 1 &&
                         sample_index_.dtype() == DType::i64 && sample_index_.dim() == 2 &&
                         sample_index_.size(1) == 2 && shuffle_index_.dtype() == DType::i64 &&
                         shuffle_index_.dim() == 1 &&
                         sample_index_.size(0) >= shuffle_index_.size(0) + 1,
                     "GPTDataset cache ", cache_prefix_, ": arrays of unexpected shapes");
  documents_ = document_index_.data_ptr<int32_t>();
  samples_ = sample_index_.data_ptr<int64_t>();
  shuffle_ = shuffle_index_.data_ptr<int64_t>();
  if (num_samples)
    BRAID_CONFIG_CHECK(size() >= *num_samples, "GPTDataset: ", size(), " samples, asked for ",
                       *num_samples);
}

void GPTDataset::read(int64_t i, int32_t* out) const {
  BRAID_CHECK(0 <= i && i < size(), "sample ", i, " out of range [0, ", size(), ")");
  // Cache files are inputs like any other: every entry used is checked against its array, so a
  // damaged cache fails with a message instead of reading outside an array.
  const int64_t j = shuffle_[i];
  BRAID_CHECK(0 <= j && j + 1 < sample_index_.size(0), "shuffle index entry ", j,
              " out of range (a damaged index cache?)");
  const int64_t first = samples_[2 * j], first_offset = samples_[2 * j + 1];
  const int64_t last = samples_[2 * j + 2], last_offset = samples_[2 * j + 3];
  BRAID_CHECK(0 <= first && first <= last && last < document_index_.numel(),
              "sample index entries ", first, ", ", last, " out of range (a damaged index cache?)");
  // The sample runs from first_offset in the first document to last_offset (included) in the
  // last one, through every document between.
  auto lengths = data_->sequence_lengths();
  int64_t written = 0;
  for (int64_t k = first; k <= last; ++k) {
    const size_t doc = size_t(documents_[k]);
    const int64_t offset = k == first ? first_offset : 0;
    const int64_t length = (k == last ? last_offset + 1 : lengths[doc]) - offset;
    BRAID_CHECK(length >= 0 && written + length <= seq_length_ + 1, "sample ", i, " overruns its ",
                seq_length_ + 1, " tokens (a damaged index cache?)");
    data_->read(doc, offset, length, out + written);
    written += length;
  }
  BRAID_CHECK(written == seq_length_ + 1, "sample ", i, " has ", written, " tokens, expected ",
              seq_length_ + 1, " (a damaged index cache?)");
}

}  // namespace braid::data
