// SafetensorsWriter / SafetensorsFile: round trips of every dtype (empty and 0-dim tensors
// too), the exact bytes of a small file, alignment, metadata, one real corrupt file on disk per
// validation rule, and the CRC-32C of each tensor (against RFC 3720's test vectors) that
// record_checksums() writes and check_checksum() checks.

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include "braid/ckpt/crc32c.h"
#include "braid/ckpt/safetensors.h"
#include "braid/core/error.h"
#include "test_devices.h"

namespace braid::ckpt {
namespace {

namespace fs = std::filesystem;

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_bytes(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}

// A file from a header (no padding added) and a data area.
std::string make_file(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header + data;
}

// Expects fn to throw a ConfigError whose message contains every part.
void expect_config_error(const std::function<void()>& fn,
                         std::initializer_list<std::string> parts) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one mentioning " << *parts.begin();
  } catch (const ConfigError& e) {
    for (const std::string& part : parts) {
      EXPECT_NE(e.message().find(part), std::string::npos)
          << "message \"" << e.message() << "\" lacks \"" << part << "\"";
    }
  }
}

// Element i is scale * i + offset.
Tensor filled(const Shape& shape, DType dtype, double scale, double offset = -3) {
  Tensor t = Tensor::empty(shape, dtype);
  for (int64_t i = 0; i < t.numel(); ++i) t.set_item(i, scale * double(i) + offset);
  return t;
}

void expect_same(const Tensor& a, const Tensor& b) {
  ASSERT_EQ(a.dtype(), b.dtype());
  ASSERT_EQ(a.shape(), b.shape());
  ASSERT_EQ(a.nbytes(), b.nbytes());
  if (a.nbytes() > 0) {
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0);
  }
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string test = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::replace(test.begin(), test.end(), '/', '_');  // parameterized: "Name/cpu"
    dir_ = fs::temp_directory_path() / ("braid_st_" + std::to_string(::getpid()) + "_" + test);
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // Writes `bytes` as a file and expects open() to fail naming the file and every part.
  void expect_corrupt(const std::string& name, const std::string& bytes,
                      std::initializer_list<std::string> parts) {
    SCOPED_TRACE(name);
    write_bytes(path(name), bytes);
    expect_config_error([&] { SafetensorsFile::open(path(name)); }, {path(name)});
    expect_config_error([&] { SafetensorsFile::open(path(name)); }, parts);
  }

  fs::path dir_;
};

TEST_F(SafetensorsTest, RoundTripsEveryDtype) {
  SafetensorsWriter w;
  std::vector<std::pair<std::string, Tensor>> tensors = {
      {"f32", filled({3, 4}, DType::f32, 0.5)},
      {"bf16", filled({2, 3, 1}, DType::bf16, 0.25)},
      {"f16", filled({7}, DType::f16, 0.125)},
      {"i32", filled({2, 2}, DType::i32, 100000)},
      {"i64", filled({5}, DType::i64, 1e12)},
      {"u8", filled({9}, DType::u8, 7, 0)},
      {"empty", Tensor::empty({0, 3}, DType::f32)},
      {"scalar", filled({}, DType::f32, -1.5)},
      {"five_dims", filled({1, 2, 1, 2, 3}, DType::bf16, 1)},
  };
  for (auto& [name, t] : tensors) w.add(name, t);
  const int64_t raw_shape[] = {2, 3};
  const uint8_t raw[] = {1, 2, 3, 4, 5, 6};
  w.add_bytes("raw_i8", "I8", raw_shape, raw);
  w.set_metadata("format", "pt");
  w.set_metadata("note", "quotes \" backslash \\ newline \n unicode \xc3\xa9");
  w.write(path("a.safetensors"));

  SafetensorsFile f = SafetensorsFile::open(path("a.safetensors"));
  EXPECT_EQ(f.names().size(), tensors.size() + 1);
  for (auto& [name, t] : tensors) {
    SCOPED_TRACE(name);
    EXPECT_EQ(f.info(name).dtype, safetensors_dtype(t.dtype()));
    expect_same(f.read(name), t);
    expect_same(f.view(name), t);
  }
  EXPECT_EQ(f.info("scalar").shape.size(), 0u);
  EXPECT_EQ(f.info("empty").nbytes(), 0u);
  EXPECT_EQ(f.info("raw_i8").dtype, "I8");
  auto b = f.bytes("raw_i8");
  EXPECT_EQ(std::vector<uint8_t>(b.begin(), b.end()), std::vector<uint8_t>(raw, raw + 6));
  expect_config_error([&] { f.read("raw_i8"); }, {"raw_i8", "I8"});
  expect_config_error([&] { f.info("nope"); }, {"nope", path("a.safetensors")});
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.metadata().at("note"), "quotes \" backslash \\ newline \n unicode \xc3\xa9");
  EXPECT_FALSE(f.contains("nope"));
}

TEST_F(SafetensorsTest, ExactBytesAlignedAndOrderedLikeThePythonLibrary) {
  SafetensorsWriter w;
  w.add("b", filled({2}, DType::f32, 1));
  w.add("a", filled({1}, DType::u8, 1, 0));
  w.add("c", filled({1}, DType::i64, 1));
  w.add("d", filled({}, DType::bf16, 1));
  w.set_metadata("k", "v");
  w.write(path("x.safetensors"));
  // Widest dtype first (I64 > F32 > BF16 > U8), then names; spaces up to 8-byte alignment.
  const std::string json =
      "{\"__metadata__\":{\"k\":\"v\"},"
      "\"c\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[0,8]},"
      "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]},"
      "\"d\":{\"dtype\":\"BF16\",\"shape\":[],\"data_offsets\":[16,18]},"
      "\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[18,19]}}";
  std::string padded = json + std::string((8 - json.size() % 8) % 8, ' ');
  const std::string bytes = read_bytes(path("x.safetensors"));
  ASSERT_EQ(bytes.size(), 8 + padded.size() + 19);
  EXPECT_EQ(bytes.substr(8, padded.size()), padded);
  uint64_t n;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n, padded.size());
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(w.header(), bytes.substr(0, 8 + padded.size()));
  // The file of no tensors: "{}" and six spaces.
  SafetensorsWriter().write(path("empty.safetensors"));
  EXPECT_EQ(read_bytes(path("empty.safetensors")), make_file("{}      ", ""));
  EXPECT_TRUE(SafetensorsFile::open(path("empty.safetensors")).names().empty());
}

TEST_F(SafetensorsTest, ViewsAreZeroCopyAndOutliveTheFileObject) {
  SafetensorsWriter w;
  w.add("w", filled({4, 4}, DType::f32, 1));
  w.write(path("v.safetensors"));
  Tensor v;
  {
    SafetensorsFile f = SafetensorsFile::open(path("v.safetensors"));
    v = f.view("w");
    EXPECT_EQ(v.data(), static_cast<const void*>(f.bytes("w").data()));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(v.data()) % 8, 0u);
  }
  EXPECT_EQ(v.item(5), 2.0);
  v.set_item(5, 42);  // private mapping: the file keeps its bytes
  EXPECT_EQ(SafetensorsFile::open(path("v.safetensors")).read("w").item(5), 2.0);
}

TEST_F(SafetensorsTest, WriterRefusesBadInput) {
  SafetensorsWriter w;
  w.add("x", filled({1}, DType::f32, 1));
  expect_config_error([&] { w.add("x", filled({1}, DType::f32, 1)); }, {"'x'", "twice"});
  expect_config_error([&] { w.add("__metadata__", filled({1}, DType::f32, 1)); }, {"__metadata__"});
  const int64_t shape[] = {3};
  const uint8_t two[] = {1, 2};
  expect_config_error([&] { w.add_bytes("r", "I16", shape, two); }, {"'r'", "[3]", "2 bytes"});
  expect_config_error([&] { w.add_bytes("r", "Q7", shape, two); }, {"'r'", "Q7"});
  SafetensorsWriter bad;
  bad.set_metadata("k", "\xff\xfe");
  expect_config_error([&] { bad.write(path("bad.safetensors")); }, {"UTF-8"});
}

// ---- one corrupt file per rule ----

const std::string kOneTensor = "{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}";

TEST_F(SafetensorsTest, ValidHandMadeFileOpens) {
  write_bytes(path("ok.safetensors"), make_file(kOneTensor, std::string(8, '\0')));
  EXPECT_EQ(SafetensorsFile::open(path("ok.safetensors")).read("t").numel(), 2);
}

TEST_F(SafetensorsTest, MissingFile) {
  expect_config_error([&] { SafetensorsFile::open(path("absent.safetensors")); },
                      {path("absent.safetensors"), "cannot open"});
}

TEST_F(SafetensorsTest, TruncatedLength) {
  expect_corrupt("short.safetensors", std::string("\x10\x00\x00", 3), {"truncated", "3 bytes"});
  expect_corrupt("zero.safetensors", "", {"truncated", "0 bytes"});
}

TEST_F(SafetensorsTest, TruncatedHeader) {
  std::string f = make_file(kOneTensor, std::string(8, '\0'));
  expect_corrupt("trunc_header.safetensors", f.substr(0, 20), {"truncated", "header length"});
}

TEST_F(SafetensorsTest, TruncatedData) {
  std::string f = make_file(kOneTensor, std::string(8, '\0'));
  expect_corrupt("trunc_data.safetensors", f.substr(0, f.size() - 3),
                 {"'t'", "outside the data area of 5 bytes", "truncated"});
}

TEST_F(SafetensorsTest, HeaderTooBig) {
  std::string f = make_file("{}", "");
  uint64_t n = kMaxHeaderBytes + 1;
  std::memcpy(f.data(), &n, 8);
  expect_corrupt("huge.safetensors", f, {"100000001", "over the limit"});
}

TEST_F(SafetensorsTest, NotJson) {
  expect_corrupt("notjson.safetensors", make_file("{\"t\": [1, 2", ""), {"not valid JSON"});
  expect_corrupt("array.safetensors", make_file("[1, 2]  ", ""), {"not a JSON object"});
  expect_corrupt("badutf8.safetensors", make_file("{\"\xff\":1}", ""), {"not valid JSON"});
}

TEST_F(SafetensorsTest, OverlappingOffsets) {
  expect_corrupt("overlap.safetensors",
                 make_file("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                           "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
                           std::string(12, '\0')),
                 {"'b'", "overlaps tensor 'a'"});
}

TEST_F(SafetensorsTest, OffsetsOutOfRange) {
  expect_corrupt("range.safetensors",
                 make_file("{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}",
                           std::string(8, '\0')),
                 {"'t'", "[8, 16]", "outside the data area"});
  expect_corrupt("reversed.safetensors",
                 make_file("{\"t\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,0]}}",
                           std::string(8, '\0')),
                 {"'t'", "end before they begin"});
}

TEST_F(SafetensorsTest, Hole) {
  expect_corrupt("hole.safetensors",
                 make_file("{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
                           std::string(12, '\0')),
                 {"'t'", "hole at [0, 4)"});
  expect_corrupt("trailing.safetensors", make_file(kOneTensor, std::string(12, '\0')),
                 {"4 trailing bytes"});
}

TEST_F(SafetensorsTest, BadDtype) {
  expect_corrupt("dtype.safetensors",
                 make_file("{\"t\":{\"dtype\":\"F33\",\"shape\":[2],\"data_offsets\":[0,8]}}",
                           std::string(8, '\0')),
                 {"'t'", "unknown dtype 'F33'"});
  expect_corrupt("nodtype.safetensors",
                 make_file("{\"t\":{\"shape\":[2],\"data_offsets\":[0,8]}}", std::string(8, '\0')),
                 {"'t'", "dtype is missing"});
}

TEST_F(SafetensorsTest, ShapeSizeMismatch) {
  expect_corrupt("mismatch.safetensors",
                 make_file("{\"t\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}",
                           std::string(8, '\0')),
                 {"'t'", "needs 12 bytes", "hold 8"});
  expect_corrupt("negative.safetensors",
                 make_file("{\"t\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}",
                           std::string(8, '\0')),
                 {"'t'", "non-negative integers"});
  expect_corrupt("float.safetensors",
                 make_file("{\"t\":{\"dtype\":\"F32\",\"shape\":[2.0],\"data_offsets\":[0,8]}}",
                           std::string(8, '\0')),
                 {"'t'", "non-negative integers"});
  expect_corrupt(
      "overflow.safetensors",
      make_file("{\"t\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":"
                "[0,8]}}",
                std::string(8, '\0')),
      {"'t'", "overflows"});
}

TEST_F(SafetensorsTest, NonStringMetadata) {
  expect_corrupt("meta.safetensors", make_file("{\"__metadata__\":{\"k\":1}}", ""),
                 {"__metadata__", "'k'", "not a string"});
  expect_corrupt("meta_list.safetensors", make_file("{\"__metadata__\":[]}", ""),
                 {"__metadata__", "not an object"});
}

TEST_F(SafetensorsTest, DuplicateAndUnknownFields) {
  expect_corrupt("dup.safetensors",
                 make_file(kOneTensor.substr(0, kOneTensor.size() - 1) + "," + kOneTensor.substr(1),
                           std::string(8, '\0')),
                 {"'t'", "twice"});
  expect_corrupt(
      "field.safetensors",
      make_file("{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"x\":1}}",
                std::string(8, '\0')),
      {"'t'", "unknown field 'x'"});
}

TEST_F(SafetensorsTest, TooManyDimsForBraidTensors) {
  SafetensorsWriter w;
  const int64_t shape[] = {1, 1, 1, 1, 1, 2};
  const uint8_t data[] = {0, 0, 0, 0, 0, 0, 0, 0};
  w.add_bytes("six", "F32", shape, data);
  w.write(path("six.safetensors"));
  SafetensorsFile f = SafetensorsFile::open(path("six.safetensors"));
  EXPECT_EQ(f.info("six").shape.size(), 6u);
  expect_config_error([&] { f.read("six"); }, {"'six'", "6 dims"});
}

// Device tensors are written through host chunks of 64 MiB (this one takes two) and read back
// onto the device.
class SafetensorsDeviceTest : public SafetensorsTest,
                              public ::testing::WithParamInterface<Device> {};

TEST_P(SafetensorsDeviceTest, WritesAndReadsDeviceTensors) {
  const Device device = GetParam();
  const int64_t n = device.is_cpu() ? 1000 : (int64_t(17) << 20);
  Tensor big = testing::random_tensor({n}, 7);
  Tensor small = filled({3, 5}, DType::bf16, 0.5);
  SafetensorsWriter w;
  w.add("big", big.to(device));
  w.add("small", small.to(device));
  w.write(path("d.safetensors"));
  SafetensorsFile f = SafetensorsFile::open(path("d.safetensors"));
  Tensor back = f.read("big", device);
  EXPECT_EQ(back.device(), device);
  expect_same(back.to(Device::cpu()), big);
  expect_same(f.read("small", device).to(Device::cpu()), small);
}

INSTANTIATE_TEST_SUITE_P(Devices, SafetensorsDeviceTest,
                         ::testing::ValuesIn(testing::test_devices()), testing::device_test_name);

std::span<const uint8_t> as_bytes(const std::string& s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

TEST(Crc32c, MatchesRfc3720TestVectors) {
  std::string up(32, '\0'), down(32, '\0');
  for (int i = 0; i < 32; ++i) {
    up[size_t(i)] = char(i);
    down[size_t(i)] = char(31 - i);
  }
  const std::vector<std::pair<std::string, uint32_t>> vectors = {
      {std::string(32, '\0'), 0x8A9136AAu},
      {std::string(32, '\xFF'), 0x62A8AB43u},
      {up, 0x46DD794Eu},
      {down, 0x113FDB5Cu},
      {"123456789", 0xE3069283u},
      {"", 0u}};
  for (const auto& [data, want] : vectors) {
    EXPECT_EQ(crc32c(as_bytes(data)), want) << data.size() << " bytes";
    EXPECT_EQ(detail::crc32c_table(as_bytes(data), 0), want) << data.size() << " bytes";
  }
}

TEST(Crc32c, InstructionAndTableAgreeAndContinue) {
  std::string data(1000, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = char((i * 2654435761u) >> 13);
  for (size_t n : {size_t(1), size_t(7), size_t(8), size_t(9), size_t(63), size_t(1000)}) {
    const auto part = as_bytes(data).first(n);
    EXPECT_EQ(crc32c(part), detail::crc32c_table(part, 0)) << n << " bytes";
    for (size_t cut : {size_t(0), n / 3, n}) {  // crc(a + b) = crc(b) continued from crc(a)
      EXPECT_EQ(crc32c(part.subspan(cut), crc32c(part.first(cut))), crc32c(part))
          << n << " bytes cut at " << cut;
    }
  }
}

TEST_F(SafetensorsTest, ChecksumsAreRecordedAndChecked) {
  SafetensorsWriter w;
  const Tensor a = filled({3, 5}, DType::f32, 0.5), b = filled({7}, DType::bf16, 2.0);
  w.add("a", a);
  w.add("b", b);
  w.add("empty", Tensor::empty({0}, DType::f32));
  w.set_metadata("note", "kept");
  w.record_checksums();
  w.write(path("sums.safetensors"));
  const std::string bytes = read_bytes(path("sums.safetensors"));
  {
    const SafetensorsFile f = SafetensorsFile::open(path("sums.safetensors"));
    EXPECT_EQ(f.metadata().at("note"), "kept");
    for (const char* name : {"a", "b", "empty"}) {
      char want[9];
      std::snprintf(want, sizeof want, "%08x", crc32c(f.bytes(name)));
      EXPECT_EQ(f.metadata().at(std::string("crc32c.") + name), want) << name;
      EXPECT_TRUE(f.check_checksum(name)) << name;
    }
    expect_same(f.read("a"), a);
  }
  // One flipped bit in b's data: b is named as damaged, a still checks.
  std::string damaged = bytes;
  const SafetensorsHeader header = parse_safetensors_header(as_bytes(bytes));
  const auto b_info = std::find_if(header.tensors.begin(), header.tensors.end(),
                                   [](const TensorInfo& t) { return t.name == "b"; });
  ASSERT_NE(b_info, header.tensors.end());
  damaged[size_t(header.data_start + b_info->begin + 3)] ^= 0x10;
  write_bytes(path("damaged.safetensors"), damaged);
  const SafetensorsFile g = SafetensorsFile::open(path("damaged.safetensors"));
  EXPECT_TRUE(g.check_checksum("a"));
  expect_config_error([&] { g.check_checksum("b"); },
                      {path("damaged.safetensors"), "tensor 'b'", "CRC-32C", "damaged"});
  // A file without checksums has nothing to check.
  SafetensorsWriter plain;
  plain.add("a", a);
  plain.write(path("plain.safetensors"));
  EXPECT_FALSE(SafetensorsFile::open(path("plain.safetensors")).check_checksum("a"));
}

TEST(SafetensorsHeader, ParsesFromMemory) {
  std::string f = make_file(kOneTensor, std::string(8, '\0'));
  auto h = parse_safetensors_header({reinterpret_cast<const uint8_t*>(f.data()), f.size()});
  ASSERT_EQ(h.tensors.size(), 1u);
  EXPECT_EQ(h.data_start, 8 + kOneTensor.size());
  EXPECT_EQ(h.tensors[0].numel(), 2);
}

}  // namespace
}  // namespace braid::ckpt
