// GPT samples: datasets built from --data-path / --split, blends, and the DataLoader.

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <array>
#include <optional>
#include <sstream>

#include "bindings.h"
#include "braid/data/blended_dataset.h"
#include "braid/data/data_loader.h"
#include "braid/data/dataset_builder.h"
#include "braid/data/gpt_dataset.h"
#include "braid/data/mock_dataset.h"

namespace braid::python {
namespace {

using namespace data;

// --data-path as a list, or one string of space-separated words ("0.3 A 0.7 B").
std::vector<std::string> data_path_words(py::handle arg) {
  if (!py::isinstance<py::str>(arg)) return arg.cast<std::vector<std::string>>();
  std::istringstream in(arg.cast<std::string>());
  std::vector<std::string> words;
  for (std::string w; in >> w;) words.push_back(w);
  return words;
}

Split split_arg(const std::string& name) {
  for (Split s : {Split::train, Split::valid, Split::test})
    if (name == split_name(s)) return s;
  BRAID_CONFIG_CHECK(false, "split must be 'train', 'valid' or 'test', got '", name, "'");
  return Split::train;
}

py::object optional_tensor(const Tensor& t) { return t.defined() ? py::cast(t) : py::none(); }

}  // namespace

void bind_gpt_data(py::module_& m) {
  py::class_<SampleDataset, std::shared_ptr<SampleDataset>>(
      m, "SampleDataset",
      "Samples of seq_length + 1 tokens (inputs: the first seq_length, labels: the last). "
      "ds[i] copies sample i into a new int32 array.")
      .def("__len__", &SampleDataset::size)
      .def_property_readonly("seq_length", &SampleDataset::seq_length)
      .def_property_readonly("description", &SampleDataset::description)
      .def("__getitem__", [](const SampleDataset& d, int64_t i) {
        if (i < 0) i += d.size();
        if (i < 0 || i >= d.size()) throw py::index_error("sample index out of range");
        py::array_t<int32_t> out(d.seq_length() + 1);
        int32_t* p = out.mutable_data();
        py::gil_scoped_release release;
        d.read(i, p);
        return out;
      });

  py::class_<GPTDataset, SampleDataset, std::shared_ptr<GPTDataset>>(
      m, "GPTDataset",
      "One split of one indexed dataset in Megatron's sample order. The document, sample and "
      "shuffle indices are cached under cache_path (default: <path_prefix>/cache/"
      "GPTDataset_indices) and mapped on the next start.")
      .def(py::init([](const std::string& path_prefix, int64_t seq_length,
                       std::optional<int64_t> num_samples,
                       std::optional<std::pair<int64_t, int64_t>> documents,
                       const std::string& split, uint32_t seed, const std::string& cache_path,
                       bool use_cache) {
             auto ds = std::make_shared<const IndexedDataset>(IndexedDataset::open(path_prefix));
             DocumentRange range{0, int64_t(ds->num_sequences())};
             if (documents) range = {documents->first, documents->second};
             py::gil_scoped_release release;
             return std::make_shared<GPTDataset>(
                 ds, range, split_arg(split), num_samples,
                 GPTDatasetConfig{seq_length, seed, cache_path, use_cache});
           }),
           py::arg("path_prefix"), py::arg("seq_length"), py::arg("num_samples") = py::none(),
           py::arg("documents") = py::none(), py::arg("split") = "train", py::arg("seed") = 1234,
           py::arg("cache_path") = "", py::arg("use_cache") = true,
           "documents: (begin, end) sequence range (default: all); num_samples: at least this "
           "many samples (default: one epoch).")
      .def_property_readonly("document_index", &GPTDataset::document_index)
      .def_property_readonly("sample_index", &GPTDataset::sample_index)
      .def_property_readonly("shuffle_index", &GPTDataset::shuffle_index)
      .def_property_readonly("split", [](const GPTDataset& d) { return split_name(d.split()); })
      .def_property_readonly("path_prefix",
                             [](const GPTDataset& d) { return d.data().path_prefix(); })
      .def_property_readonly("loaded_from_cache", &GPTDataset::loaded_from_cache)
      .def_property_readonly("cache_path_prefix", &GPTDataset::cache_path_prefix);

  py::class_<BlendedDataset, SampleDataset, std::shared_ptr<BlendedDataset>>(
      m, "BlendedDataset",
      "Samples drawn from several datasets in proportion to weights (Megatron's greedy order).")
      .def_property_readonly("datasets", &BlendedDataset::datasets)
      .def_property_readonly("weights", &BlendedDataset::weights)
      .def_property_readonly("dataset_index", &BlendedDataset::dataset_index)
      .def_property_readonly("dataset_sample_index", &BlendedDataset::dataset_sample_index)
      .def_property_readonly("loaded_from_cache", &BlendedDataset::loaded_from_cache);

  m.def(
      "build_gpt_datasets",
      [](py::handle data_path, int64_t seq_length,
         std::array<std::optional<int64_t>, kNumSplits> num_samples, const std::string& split,
         uint32_t seed, const std::string& cache_path, bool use_cache) {
        GPTDataConfig c;
        c.blend = parse_data_path(data_path_words(data_path));
        c.split = split;
        c.seq_length = seq_length;
        c.seed = seed;
        c.cache_dir = cache_path;
        c.use_cache = use_cache;
        py::gil_scoped_release release;
        return build_gpt_datasets(c, num_samples);
      },
      py::arg("data_path"), py::arg("seq_length"),
      py::arg("num_samples") = std::array<std::optional<int64_t>, kNumSplits>{},
      py::arg("split") = "969,30,1", py::arg("seed") = 1234, py::arg("cache_path") = "",
      py::arg("use_cache") = true,
      "Megatron's train/valid/test datasets: data_path is --data-path (a list, or one string: "
      "'A', '0.3 A 0.7 B', 'A B'), split is --split, num_samples the samples each split must "
      "provide (None: one epoch). Returns (train, valid, test), None where a split is absent.");

  m.def(
      "build_mock_gpt_datasets",
      [](const py::array_t<int32_t, py::array::c_style | py::array::forcecast>& lengths,
         int64_t seq_length, std::array<std::optional<int64_t>, kNumSplits> num_samples,
         int64_t vocab_size, int64_t eod, const std::string& split, uint32_t seed) {
        MockDataConfig c{split, seq_length, seed, vocab_size, eod};
        std::span<const int32_t> l(lengths.data(), size_t(lengths.size()));
        py::gil_scoped_release release;
        return build_mock_gpt_datasets(l, c, num_samples);
      },
      py::arg("lengths"), py::arg("seq_length"), py::arg("num_samples"), py::arg("vocab_size"),
      py::arg("eod"), py::arg("split") = "969,30,1", py::arg("seed") = 1234,
      "Megatron's mock train/valid/test datasets (--mock-data) over the mock documents of these "
      "lengths (braid.data.mock_lengths()); None where a split is absent.");

  m.def("parse_split", &parse_split, py::arg("split"),
        "--split weights, normalised: '969,30,1' -> (0.969, 0.03, 0.001).");
  m.def(
      "split_documents",
      [](const std::string& split, int64_t num_documents) {
        std::vector<std::optional<std::pair<int64_t, int64_t>>> out;
        for (const auto& r : split_documents(parse_split(split), num_documents))
          out.push_back(r ? std::optional(std::pair(r->begin, r->end)) : std::nullopt);
        return out;
      },
      py::arg("split"), py::arg("num_documents"),
      "Megatron's document range (begin, end) of each split, None for a split of weight 0.");
  m.def(
      "parse_data_path",
      [](py::handle data_path) {
        Blend b = parse_data_path(data_path_words(data_path));
        return py::make_tuple(b.prefixes, b.weights);
      },
      py::arg("data_path"), "--data-path -> (prefixes, weights or None).");
  m.def(
      "build_blending_indices",
      [](std::vector<double> weights, int64_t size) {
        py::array_t<int32_t> which(size);
        py::array_t<int64_t> sample(size);
        build_blending_indices(weights, std::span<int32_t>(which.mutable_data(), size_t(size)),
                               std::span<int64_t>(sample.mutable_data(), size_t(size)));
        return py::make_tuple(which, sample);
      },
      py::arg("weights"), py::arg("size"),
      "Megatron's blending order: (dataset_index, dataset_sample_index) for normalised weights.");

  py::class_<Batch>(m, "Batch",
                    "One training step's rows for this DP rank: tokens and labels "
                    "[num_microbatches * micro_batch_size, seq_length] int32 (None when the "
                    "loader was told not to read them).")
      .def_property_readonly("tokens", [](const Batch& b) { return optional_tensor(b.tokens); })
      .def_property_readonly("labels", [](const Batch& b) { return optional_tensor(b.labels); })
      .def_readonly("num_microbatches", &Batch::num_microbatches)
      .def_readonly("micro_batch_size", &Batch::micro_batch_size)
      .def_readonly("global_batch_size", &Batch::global_batch_size)
      .def_readonly("consumed_samples", &Batch::consumed_samples)
      .def(
          "microbatch",
          [](const Batch& b, int64_t m) {
            return py::make_tuple(
                b.tokens.defined() ? py::cast(b.microbatch_tokens(m)) : py::none(),
                b.labels.defined() ? py::cast(b.microbatch_labels(m)) : py::none());
          },
          py::arg("m"), "(tokens, labels) of microbatch m (views).");

  py::class_<BatchLayout>(
      m, "BatchLayout",
      "Which samples a DP rank reads per step (Megatron's sampler), and with rampup_batch_size "
      "= (start, increment, samples) each step's global batch under Megatron's "
      "--rampup-batch-size. A ValueError names the rule a bad layout breaks.")
      .def(py::init([](int64_t micro_batch_size, int64_t global_batch_size, int64_t dp_rank,
                       int64_t dp_size, std::optional<std::array<int64_t, 3>> rampup) {
             BatchLayout layout{micro_batch_size, global_batch_size, dp_rank, dp_size};
             if (rampup) layout.rampup = BatchRampup{(*rampup)[0], (*rampup)[1], (*rampup)[2]};
             layout.validate();
             return layout;
           }),
           py::arg("micro_batch_size"), py::arg("global_batch_size"), py::arg("dp_rank") = 0,
           py::arg("dp_size") = 1, py::arg("rampup_batch_size") = py::none())
      .def_readonly("global_batch_size", &BatchLayout::global_batch_size)
      .def("__repr__",
           [](const BatchLayout& l) {
             std::ostringstream out;
             out << "BatchLayout(micro_batch_size=" << l.micro_batch_size
                 << ", global_batch_size=" << l.global_batch_size << ", dp_rank=" << l.dp_rank
                 << ", dp_size=" << l.dp_size;
             if (l.rampup)
               out << ", rampup_batch_size=(" << l.rampup->start << ", " << l.rampup->increment
                   << ", " << l.rampup->samples << ")";
             out << ")";
             return out.str();
           })
      .def("global_batch_size_at", &BatchLayout::global_batch_size_at, py::arg("consumed_samples"),
           "The global batch of the step after consumed_samples.")
      .def("steps_between", &BatchLayout::steps_between, py::arg("consumed_samples"),
           py::arg("end"),
           "The whole steps from consumed_samples that end by sample `end` (from 0 to "
           "--train-samples: Megatron's training iterations).")
      .def("samples_after", &BatchLayout::samples_after, py::arg("steps"),
           "The samples consumed after the first `steps` steps.");

  py::class_<DataLoader>(
      m, "DataLoader",
      "A DP rank's batches of a dataset in Megatron's order, loaded on a background thread "
      "(prefetch steps ahead). Iterate it, or call next() (None at the end); consumed_samples "
      "is what a checkpoint stores and where a resumed loader starts. Errors on the loading "
      "thread are raised by next().")
      .def(py::init([](std::shared_ptr<SampleDataset> dataset, int64_t micro_batch_size,
                       int64_t global_batch_size, int64_t dp_rank, int64_t dp_size,
                       int64_t consumed_samples, int64_t prefetch, bool needs_tokens,
                       bool needs_labels, std::optional<std::array<int64_t, 3>> rampup) {
             BatchLayout layout{micro_batch_size, global_batch_size, dp_rank, dp_size};
             if (rampup) layout.rampup = BatchRampup{(*rampup)[0], (*rampup)[1], (*rampup)[2]};
             return std::make_unique<DataLoader>(
                 std::move(dataset), layout,
                 LoaderOptions{consumed_samples, prefetch, needs_tokens, needs_labels});
           }),
           py::arg("dataset"), py::arg("micro_batch_size"), py::arg("global_batch_size"),
           py::arg("dp_rank") = 0, py::arg("dp_size") = 1, py::arg("consumed_samples") = 0,
           py::arg("prefetch") = 2, py::arg("needs_tokens") = true, py::arg("needs_labels") = true,
           py::arg("rampup_batch_size") = py::none(),
           "rampup_batch_size: (start, increment, samples), Megatron's --rampup-batch-size.")
      .def(
          "next",
          [](DataLoader& l) {
            py::gil_scoped_release release;
            return l.next();
          },
          "The next step's Batch, or None at the end of the data.")
      .def("__iter__", [](py::object self) { return self; })
      .def("__next__",
           [](DataLoader& l) {
             std::optional<Batch> b;
             {
               py::gil_scoped_release release;
               b = l.next();
             }
             if (!b) throw py::stop_iteration();
             return std::move(*b);
           })
      .def_property_readonly("consumed_samples", &DataLoader::consumed_samples)
      .def_property_readonly("steps_left", &DataLoader::steps_left)
      .def_property_readonly("num_microbatches",
                             [](const DataLoader& l) { return l.layout().num_microbatches(); })
      .def_property_readonly("wait_seconds", &DataLoader::wait_seconds,
                             "Total time next() has waited for the loading thread.");
}

}  // namespace braid::python
