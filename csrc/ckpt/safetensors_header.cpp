// safetensors: the dtype table and the header parser and validator (pure: no I/O, no
// tensors -- the fuzz target links this file alone). The rules: include/braid/ckpt/safetensors.h.

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>

#include "braid/ckpt/safetensors.h"
#include "ckpt/safetensors_internal.h"

namespace braid::ckpt {

namespace {

struct DTypeRow {
  const char* name;
  size_t size;
};
// In the Python library's (Rust enum) order: the writer sorts by descending position.
constexpr DTypeRow kDTypes[] = {
    {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"F8_E8M0", 1},
    {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},     {"U32", 4},
    {"F32", 4},  {"F64", 8}, {"I64", 8}, {"U64", 8},
};

}  // namespace

int dtype_rank(std::string_view dtype) {
  for (size_t i = 0; i < std::size(kDTypes); ++i)
    if (dtype == kDTypes[i].name) return int(i);
  return -1;
}

std::optional<uint64_t> byte_size(std::span<const int64_t> shape, uint64_t itemsize) {
  uint64_t n = itemsize;
  for (int64_t d : shape) {
    if (d < 0) return std::nullopt;
    if (d != 0 && n > UINT64_MAX / uint64_t(d)) return std::nullopt;
    n *= uint64_t(d);
  }
  return n;
}

std::string shape_str(std::span<const int64_t> shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

size_t safetensors_dtype_size(std::string_view dtype) {
  int r = dtype_rank(dtype);
  return r < 0 ? 0 : kDTypes[r].size;
}

std::optional<DType> braid_dtype(std::string_view dtype) {
  if (dtype == "F32") return DType::f32;
  if (dtype == "BF16") return DType::bf16;
  if (dtype == "F16") return DType::f16;
  if (dtype == "I32") return DType::i32;
  if (dtype == "I64") return DType::i64;
  if (dtype == "U8") return DType::u8;
  return std::nullopt;
}

const char* safetensors_dtype(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return "F32";
    case DType::bf16:
      return "BF16";
    case DType::f16:
      return "F16";
    case DType::i32:
      return "I32";
    case DType::i64:
      return "I64";
    case DType::u8:
      return "U8";
  }
  BRAID_FAIL("safetensors: no safetensors dtype for braid dtype ", int(dtype));
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// ---- the header ----

SafetensorsHeader parse_safetensors_header(std::span<const uint8_t> file,
                                           std::string_view filename) {
  const std::string where = "safetensors file " + std::string(filename);
  BRAID_CONFIG_CHECK(file.size() >= 8, where, ": truncated: ", file.size(),
                     " bytes, shorter than the 8-byte header length");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | file[i];
  BRAID_CONFIG_CHECK(n <= kMaxHeaderBytes, where, ": header length ", n, " is over the limit of ",
                     kMaxHeaderBytes, " bytes");
  BRAID_CONFIG_CHECK(n <= file.size() - 8, where, ": truncated: the header length is ", n,
                     " bytes but only ", file.size() - 8, " follow the length");
  SafetensorsHeader header;
  header.header_bytes = n;
  header.data_start = 8 + n;
  const uint64_t data_size = file.size() - header.data_start;

  // Duplicate names would silently shadow each other (JSON objects keep one): refuse them.
  std::set<std::string> seen;
  std::string duplicate;
  auto on_event = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& value) {
    if (depth == 1 && event == nlohmann::json::parse_event_t::key && duplicate.empty()) {
      const std::string& key = value.get_ref<const std::string&>();
      if (!seen.insert(key).second) duplicate = key;
    }
    return true;
  };
  nlohmann::json json;
  const char* text = reinterpret_cast<const char*>(file.data() + 8);
  try {
    json = nlohmann::json::parse(text, text + n, on_event);
  } catch (const nlohmann::json::exception& e) {
    BRAID_CONFIG_CHECK(false, where, ": the header is not valid JSON: ", e.what());
  }
  BRAID_CONFIG_CHECK(duplicate.empty(), where, ": tensor '", duplicate,
                     "' appears twice in the header");
  BRAID_CONFIG_CHECK(json.is_object(), where, ": the header is not a JSON object");

  for (auto& [name, entry] : json.items()) {
    const std::string at = where + ": tensor '" + name + "'";
    if (name == "__metadata__") {
      BRAID_CONFIG_CHECK(entry.is_object(), where, ": __metadata__ is not an object");
      for (auto& [key, value] : entry.items()) {
        BRAID_CONFIG_CHECK(value.is_string(), where, ": __metadata__ entry '", key,
                           "' is not a string");
        header.metadata[key] = value.get<std::string>();
      }
      continue;
    }
    BRAID_CONFIG_CHECK(entry.is_object(), at, ": the entry is not an object");
    for (auto& [field, _] : entry.items())
      BRAID_CONFIG_CHECK(field == "dtype" || field == "shape" || field == "data_offsets", at,
                         ": unknown field '", field, "'");
    TensorInfo info;
    info.name = name;
    auto dtype = entry.find("dtype");
    BRAID_CONFIG_CHECK(dtype != entry.end() && dtype->is_string(), at,
                       ": dtype is missing or not a string");
    info.dtype = dtype->get<std::string>();
    const size_t itemsize = safetensors_dtype_size(info.dtype);
    BRAID_CONFIG_CHECK(itemsize > 0, at, ": unknown dtype '", info.dtype, "'");
    auto shape = entry.find("shape");
    BRAID_CONFIG_CHECK(shape != entry.end() && shape->is_array(), at,
                       ": shape is missing or not a list");
    for (auto& d : *shape) {
      BRAID_CONFIG_CHECK(d.is_number_unsigned() && d.get<uint64_t>() <= uint64_t(INT64_MAX), at,
                         ": shape ", shape->dump(), " is not a list of non-negative integers");
      info.shape.push_back(int64_t(d.get<uint64_t>()));
    }
    auto offsets = entry.find("data_offsets");
    BRAID_CONFIG_CHECK(offsets != entry.end() && offsets->is_array() && offsets->size() == 2 &&
                           (*offsets)[0].is_number_unsigned() && (*offsets)[1].is_number_unsigned(),
                       at, ": data_offsets is missing or not [begin, end]");
    info.begin = (*offsets)[0].get<uint64_t>();
    info.end = (*offsets)[1].get<uint64_t>();
    BRAID_CONFIG_CHECK(info.begin <= info.end, at, ": data_offsets [", info.begin, ", ", info.end,
                       "] end before they begin");
    auto expected = byte_size(info.shape, itemsize);
    BRAID_CONFIG_CHECK(expected.has_value(), at, ": shape ", shape_str(info.shape),
                       " overflows 64 bits");
    BRAID_CONFIG_CHECK(info.end - info.begin == *expected, at, ": shape ", shape_str(info.shape),
                       " of ", info.dtype, " needs ", *expected, " bytes but data_offsets [",
                       info.begin, ", ", info.end, "] hold ", info.end - info.begin);
    BRAID_CONFIG_CHECK(info.end <= data_size, at, ": data_offsets [", info.begin, ", ", info.end,
                       "] lie outside the data area of ", data_size, " bytes (file truncated?)");
    header.tensors.push_back(std::move(info));
  }

  std::sort(header.tensors.begin(), header.tensors.end(),
            [](const TensorInfo& a, const TensorInfo& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
            });
  uint64_t covered = 0;
  const TensorInfo* previous = nullptr;
  for (const TensorInfo& info : header.tensors) {
    BRAID_CONFIG_CHECK(info.begin >= covered, where, ": tensor '", info.name, "' (bytes [",
                       info.begin, ", ", info.end, ")) overlaps tensor '",
                       previous ? previous->name : "", "' (which ends at ", covered, ")");
    BRAID_CONFIG_CHECK(info.begin == covered, where, ": tensor '", info.name, "' begins at byte ",
                       info.begin, " of the data area, leaving a hole at [", covered, ", ",
                       info.begin, ")");
    covered = info.end;
    previous = &info;
  }
  BRAID_CONFIG_CHECK(covered == data_size, where, ": the tensors end at byte ", covered,
                     " of the data area but the file holds ", data_size, " (", data_size - covered,
                     " trailing bytes)");
  return header;
}

}  // namespace braid::ckpt
