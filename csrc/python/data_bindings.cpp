// Indexed datasets (.bin/.idx): the reader with zero-copy numpy views, and the writer.

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <limits>
#include <optional>

#include "bindings.h"
#include "braid/data/indexed_dataset.h"

namespace braid::python {
namespace {

using data::IndexedDataset;
using data::IndexedDatasetWriter;
using data::PackedArray;
using data::TokenType;

const char* numpy_name(TokenType t) {
  switch (t) {
    case TokenType::u8:
      return "uint8";
    case TokenType::i8:
      return "int8";
    case TokenType::i16:
      return "int16";
    case TokenType::u16:
      return "uint16";
    case TokenType::i32:
      return "int32";
    case TokenType::i64:
      return "int64";
    case TokenType::f32:
      return "float32";
    case TokenType::f64:
      return "float64";
  }
  return "invalid";
}

// A read-only numpy view of `count` items at `data`, kept alive by `owner`. The .idx arrays are
// unaligned; numpy reads unaligned arrays correctly (its ALIGNED flag is false for them).
py::array readonly_view(const char* dtype, size_t count, const std::byte* data, py::handle owner) {
  py::dtype dt(dtype);
  py::array a(dt, {py::ssize_t(count)}, {py::ssize_t(dt.itemsize())},
              count ? static_cast<const void*>(data) : nullptr, count ? owner : py::handle());
  a.attr("flags").attr("writeable") = false;
  return a;
}

template <typename T>
py::array packed_view(PackedArray<T> a, const char* dtype, py::handle owner) {
  return readonly_view(dtype, a.size(), a.bytes(), owner);
}

TokenType token_type_arg(py::handle t) {
  if (py::isinstance<py::str>(t)) return data::token_type_from_name(t.cast<std::string>());
  // numpy dtypes and scalar types (np.uint16, np.dtype("uint16"))
  py::object dt = py::module_::import("numpy").attr("dtype")(t);
  return data::token_type_from_name(py::str(dt).cast<std::string>());
}

// Adds tokens (any integer array-like) as one sequence; int32 arrays are not copied.
void add_sequence(IndexedDatasetWriter& w, py::handle tokens) {
  py::array a = py::module_::import("numpy").attr("asarray")(tokens);
  BRAID_CONFIG_CHECK(a.ndim() == 1, "tokens must be 1-D, got ", a.ndim(), " dimensions");
  const char kind = a.dtype().kind();
  BRAID_CONFIG_CHECK(kind == 'i' || kind == 'u' || a.size() == 0,
                     "tokens must be integers, got numpy dtype ",
                     py::str(a.dtype()).cast<std::string>());
  if (kind == 'u' && a.itemsize() == 8 && a.size() > 0) {
    BRAID_CONFIG_CHECK(
        a.attr("max")().cast<uint64_t>() <= uint64_t(std::numeric_limits<int64_t>::max()),
        "token ids above 2^63 - 1");
  }
  if (kind == 'i' && a.itemsize() == 4) {
    auto t = py::array_t<int32_t, py::array::c_style | py::array::forcecast>::ensure(a);
    py::gil_scoped_release release;
    w.add_sequence(std::span<const int32_t>(t.data(), size_t(t.size())));
  } else {
    auto t = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(a);
    py::gil_scoped_release release;
    w.add_sequence(std::span<const int64_t>(t.data(), size_t(t.size())));
  }
}

// An integer array-like as a C-contiguous array of T (ConfigError if it is not integers or a
// value does not fit T).
template <typename T>
py::array_t<T> integer_array(py::handle values, const char* what) {
  py::array a = py::module_::import("numpy").attr("asarray")(values);
  BRAID_CONFIG_CHECK(a.ndim() == 1, what, " must be 1-D, got ", a.ndim(), " dimensions");
  const char kind = a.dtype().kind();
  BRAID_CONFIG_CHECK(kind == 'i' || kind == 'u' || a.size() == 0, what,
                     " must be integers, got numpy dtype ", py::str(a.dtype()).cast<std::string>());
  if (a.size() > 0 && !py::isinstance<py::array_t<T>>(a)) {
    const auto lo = a.attr("min")(), hi = a.attr("max")();
    BRAID_CONFIG_CHECK(lo.template cast<py::int_>() >= py::int_(std::numeric_limits<T>::min()) &&
                           hi.template cast<py::int_>() <= py::int_(std::numeric_limits<T>::max()),
                       what, ": values from ", py::str(lo).cast<std::string>(), " to ",
                       py::str(hi).cast<std::string>(), " do not fit ",
                       sizeof(T) == 4 ? "int32" : "int64");
  }
  return py::array_t<T, py::array::c_style | py::array::forcecast>::ensure(a);
}

}  // namespace

void bind_data(py::module_& m) {
  py::class_<IndexedDataset>(
      m, "IndexedDataset",
      "A Megatron indexed dataset (prefix.bin / prefix.idx), memory-mapped read-only and "
      "validated when opened (ValueError naming the file and field if not). ds[i] is sequence "
      "i's tokens as stored (a read-only numpy view, no copy); ds.read(i) copies them to int32.")
      .def(py::init(&IndexedDataset::open), py::arg("path_prefix"))
      .def_property_readonly("path_prefix", &IndexedDataset::path_prefix)
      .def_property_readonly(
          "token_type",
          [](const IndexedDataset& d) { return data::token_type_name(d.token_type()); })
      .def_property_readonly(
          "dtype", [](const IndexedDataset& d) { return py::dtype(numpy_name(d.token_type())); })
      .def_property_readonly("num_sequences", &IndexedDataset::num_sequences)
      .def_property_readonly("num_documents", &IndexedDataset::num_documents)
      .def_property_readonly("num_tokens", &IndexedDataset::num_tokens)
      .def_property_readonly("multimodal", &IndexedDataset::multimodal)
      .def("__len__", &IndexedDataset::num_sequences)
      .def_property_readonly("sequence_lengths",
                             [](py::object self) {
                               return packed_view(
                                   self.cast<const IndexedDataset&>().sequence_lengths(), "int32",
                                   self);
                             })
      .def_property_readonly("sequence_pointers",
                             [](py::object self) {
                               return packed_view(
                                   self.cast<const IndexedDataset&>().sequence_pointers(), "int64",
                                   self);
                             })
      .def_property_readonly("document_indices",
                             [](py::object self) {
                               return packed_view(
                                   self.cast<const IndexedDataset&>().document_indices(), "int64",
                                   self);
                             })
      .def_property_readonly(
          "sequence_modes",
          [](py::object self) -> py::object {
            const auto& d = self.cast<const IndexedDataset&>();
            if (!d.multimodal()) return py::none();
            return packed_view(d.sequence_modes(), "int8", self);
          },
          "One int8 mode per sequence in multimodal datasets; None otherwise.")
      .def("__getitem__",
           [](py::object self, int64_t i) {
             const auto& d = self.cast<const IndexedDataset&>();
             const int64_t n = int64_t(d.num_sequences());
             if (i < 0) i += n;
             if (i < 0 || i >= n) throw py::index_error("sequence index out of range");
             std::span<const std::byte> bytes = d.sequence_bytes(size_t(i));
             return readonly_view(numpy_name(d.token_type()),
                                  bytes.size() / data::token_size(d.token_type()), bytes.data(),
                                  self);
           })
      .def(
          "read",
          [](const IndexedDataset& d, size_t i, int64_t offset, std::optional<int64_t> length) {
            BRAID_CONFIG_CHECK(i < d.num_sequences(), d.path_prefix(), ": sequence ", i,
                               " out of range (", d.num_sequences(), " sequences)");
            const int64_t n = length ? *length : d.sequence_lengths()[i] - offset;
            BRAID_CONFIG_CHECK(n >= 0, d.path_prefix(), ": offset ", offset,
                               " is past the end of sequence ", i);
            py::array_t<int32_t> out(n);
            int32_t* p = out.mutable_data();
            py::gil_scoped_release release;
            d.read(i, offset, n, p);
            return out;
          },
          py::arg("i"), py::arg("offset") = 0, py::arg("length") = py::none(),
          "Tokens [offset, offset + length) of sequence i as a new int32 array (to its end when "
          "length is None).")
      .def(py::pickle([](const IndexedDataset& d) { return py::make_tuple(d.path_prefix()); },
                      [](py::tuple t) { return IndexedDataset::open(t[0].cast<std::string>()); }))
      .def("__repr__", [](const IndexedDataset& d) {
        return "IndexedDataset('" + d.path_prefix() + "', " +
               data::token_type_name(d.token_type()) + ", " + std::to_string(d.num_sequences()) +
               " sequences, " + std::to_string(d.num_documents()) + " documents, " +
               std::to_string(d.num_tokens()) + " tokens)";
      });

  py::class_<IndexedDatasetWriter>(
      m, "IndexedDatasetWriter",
      "Writes prefix.bin / prefix.idx, byte for byte as megatron-core's IndexedDatasetBuilder. "
      "Files are written under temporary names and renamed by finalize(). As a context manager "
      "it finalizes on success and discards the files if the block raises.")
      .def(py::init([](const std::string& prefix, py::object token_type) {
             return std::make_unique<IndexedDatasetWriter>(prefix, token_type_arg(token_type));
           }),
           py::arg("path_prefix"), py::arg("token_type") = "i32",
           "token_type: 'u8', 'i8', 'i16', 'u16', 'i32', 'i64', 'f32', 'f64' or a numpy dtype.")
      .def("add_sequence", &add_sequence, py::arg("tokens"),
           "Appends one sequence (an integer array-like) to the current document.")
      .def("end_document", &IndexedDatasetWriter::end_document)
      .def(
          "add_document",
          [](IndexedDatasetWriter& w, py::handle tokens) {
            add_sequence(w, tokens);
            w.end_document();
          },
          py::arg("tokens"), "add_sequence(tokens), then end_document().")
      .def(
          "add_documents",
          [](IndexedDatasetWriter& w, py::handle tokens, py::handle sequence_lengths,
             py::handle sequences_per_document) {
            auto t = integer_array<int32_t>(tokens, "tokens");
            auto lengths = integer_array<int64_t>(sequence_lengths, "sequence_lengths");
            py::array_t<int64_t> docs =
                sequences_per_document.is_none()
                    ? py::array_t<int64_t>(
                          py::module_::import("numpy").attr("ones")(lengths.size(), "int64"))
                    : integer_array<int64_t>(sequences_per_document, "sequences_per_document");
            py::gil_scoped_release release;
            w.add_documents(std::span<const int32_t>(t.data(), size_t(t.size())),
                            std::span<const int64_t>(lengths.data(), size_t(lengths.size())),
                            std::span<const int64_t>(docs.data(), size_t(docs.size())));
          },
          py::arg("tokens"), py::arg("sequence_lengths"),
          py::arg("sequences_per_document") = py::none(),
          "Many documents in one call: tokens back to back, cut into sequences by "
          "sequence_lengths, and the sequences into documents by sequences_per_document (default: "
          "one sequence per document). All is checked before anything is written.")
      .def("finalize", &IndexedDatasetWriter::finalize)
      .def("discard", &IndexedDatasetWriter::discard)
      .def_property_readonly("path_prefix", &IndexedDatasetWriter::path_prefix)
      .def_property_readonly(
          "token_type",
          [](const IndexedDatasetWriter& w) { return data::token_type_name(w.token_type()); })
      .def_property_readonly("num_sequences", &IndexedDatasetWriter::num_sequences)
      .def_property_readonly("num_documents", &IndexedDatasetWriter::num_documents)
      .def_property_readonly("num_tokens", &IndexedDatasetWriter::num_tokens)
      .def_property_readonly("finalized", &IndexedDatasetWriter::finalized)
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](IndexedDatasetWriter& w, py::handle type, py::handle, py::handle) {
        if (type.is_none()) {
          if (!w.finalized()) w.finalize();
        } else {
          w.discard();
        }
        return false;
      });

  m.def(
      "smallest_token_type",
      [](int64_t vocab_size) {
        return data::token_type_name(data::smallest_token_type(vocab_size));
      },
      py::arg("vocab_size"),
      "Megatron's token type for a vocabulary: 'u16' below 65500, else 'i32'.");
}

}  // namespace braid::python
