#include "braid/data/gpt_indices.h"

#include <limits>
#include <numeric>

#include "braid/core/error.h"

namespace braid::data {

int64_t count_tokens(std::span<const int32_t> lengths, int64_t begin, int64_t end) {
  BRAID_CHECK(0 <= begin && begin <= end && end <= int64_t(lengths.size()), "documents [", begin,
              ", ", end, ") out of range for ", lengths.size(), " documents");
  return std::accumulate(lengths.begin() + begin, lengths.begin() + end, int64_t(0));
}

int64_t num_epochs_for(int64_t tokens_per_epoch, std::optional<int64_t> num_samples,
                       int64_t seq_length) {
  if (!num_samples) return 1;
  BRAID_CHECK(tokens_per_epoch > 0, "an epoch with no tokens");
  // num_samples samples read num_samples * seq_length + 1 tokens (the last label).
  int64_t needed = *num_samples * seq_length + 1;
  return std::max<int64_t>(1, (needed + tokens_per_epoch - 1) / tokens_per_epoch);
}

int64_t samples_in_epochs(int64_t num_epochs, int64_t tokens_per_epoch, int64_t seq_length) {
  return (num_epochs * tokens_per_epoch - 1) / seq_length;
}

namespace {

std::vector<int32_t> shuffled_documents(int64_t begin, int64_t end, int64_t num_epochs,
                                        NumpyRandomState& random) {
  std::vector<int32_t> index;
  index.reserve(size_t((end - begin) * num_epochs));
  for (int64_t e = 0; e < num_epochs; ++e)
    for (int64_t d = begin; d < end; ++d) index.push_back(int32_t(d));
  random.shuffle(std::span<int32_t>(index));
  return index;
}

}  // namespace

std::vector<int32_t> build_document_index(int64_t begin, int64_t end, int64_t num_epochs,
                                          NumpyRandomState& random, bool separate_final_epoch) {
  BRAID_CHECK(end <= std::numeric_limits<int32_t>::max(),
              "document ids beyond int32 (Megatron's document index is int32)");
  if (!separate_final_epoch || num_epochs == 1)
    return shuffled_documents(begin, end, num_epochs, random);
  std::vector<int32_t> index = shuffled_documents(begin, end, num_epochs - 1, random);
  std::vector<int32_t> last = shuffled_documents(begin, end, 1, random);
  index.insert(index.end(), last.begin(), last.end());
  return index;
}

std::vector<int64_t> build_sample_index(std::span<const int32_t> lengths,
                                        std::span<const int32_t> document_index, int64_t seq_length,
                                        int64_t num_epochs, int64_t tokens_per_epoch) {
  const int64_t num_samples = samples_in_epochs(num_epochs, tokens_per_epoch, seq_length);
  std::vector<int64_t> index(static_cast<size_t>(2 * (num_samples + 1)));
  int64_t position = 0;  // into document_index
  int64_t offset = 0;    // token offset in document_index[position]
  index[0] = 0;
  index[1] = 0;
  const int64_t last = int64_t(document_index.size()) - 1;
  for (int64_t sample = 1; sample <= num_samples; ++sample) {
    // A sample is seq_length + 1 tokens; the next one starts on this one's last token.
    int64_t remaining = seq_length + 1;
    while (remaining != 0) {
      int64_t length = lengths[size_t(document_index[size_t(position)])] - offset;
      remaining -= length;
      if (remaining <= 0) {
        offset += remaining + length - 1;
        remaining = 0;
      } else if (position == last) {
        // Out of documents: only the last sample may end here, on the last token.
        BRAID_CHECK(sample == num_samples, "sample index ran out of documents at sample ", sample,
                    " of ", num_samples);
        offset = lengths[size_t(document_index[size_t(position)])] - 1;
        break;
      } else {
        ++position;
        offset = 0;
      }
    }
    index[size_t(2 * sample)] = position;
    index[size_t(2 * sample + 1)] = offset;
  }
  return index;
}

std::vector<int64_t> build_shuffle_index(int64_t first, int64_t total, NumpyRandomState& random) {
  BRAID_CHECK(0 <= first && first <= total, "shuffle index: bad ranges [0, ", first, ") [", first,
              ", ", total, ")");
  std::vector<int64_t> index(static_cast<size_t>(total));
  std::iota(index.begin(), index.end(), int64_t(0));
  std::span<int64_t> all(index);
  random.shuffle(all.first(size_t(first)));
  if (first < total) random.shuffle(all.subspan(size_t(first)));
  return index;
}

GPTIndices build_gpt_indices(std::span<const int32_t> lengths, int64_t begin, int64_t end,
                             const GPTIndexConfig& config) {
  BRAID_CONFIG_CHECK(config.seq_length >= 1, "seq_length must be at least 1, got ",
                     config.seq_length);
  BRAID_CONFIG_CHECK(!config.num_samples || *config.num_samples >= 0,
                     "num_samples must not be negative, got ", *config.num_samples);
  const int64_t tokens = count_tokens(lengths, begin, end);
  BRAID_CONFIG_CHECK(tokens > config.seq_length, "documents [", begin, ", ", end, ") hold ", tokens,
                     " tokens, too few for one sample of ", config.seq_length, " + 1");
  GPTIndices out;
  out.num_epochs = num_epochs_for(tokens, config.num_samples, config.seq_length);

  int64_t samples_before_final = 0;
  if (out.num_epochs > 1) {
    samples_before_final = samples_in_epochs(out.num_epochs - 1, tokens, config.seq_length);
    int64_t from_final = *config.num_samples - samples_before_final;
    int64_t per_epoch = samples_in_epochs(1, tokens, config.seq_length);
    out.separate_final_epoch = from_final < int64_t(0.80 * double(per_epoch));
  }

  NumpyRandomState random(config.seed);
  out.document_index =
      build_document_index(begin, end, out.num_epochs, random, out.separate_final_epoch);
  out.sample_index =
      build_sample_index(lengths, out.document_index, config.seq_length, out.num_epochs, tokens);
  const int64_t total = int64_t(out.sample_index.size() / 2) - 1;
  out.shuffle_index =
      build_shuffle_index(out.separate_final_epoch ? samples_before_final : total, total, random);
  return out;
}

}  // namespace braid::data
