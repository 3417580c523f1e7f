// IndexedDataset / IndexedDatasetWriter: round trips for every token type, the exact bytes of
// a small file, and one real corrupt file on disk per validation rule.

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

#include "braid/core/error.h"
#include "braid/data/indexed_dataset.h"

namespace braid::data {
namespace {

namespace fs = std::filesystem;

std::vector<char> read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(in), {});
}

void write_file(const fs::path& p, const std::vector<char>& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}

template <typename T>
void put(std::vector<char>& bytes, size_t offset, T value) {
  ASSERT_LE(offset + sizeof(T), bytes.size());
  std::memcpy(bytes.data() + offset, &value, sizeof(T));
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

class IndexedDatasetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("braid_idx_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string prefix(const std::string& name = "ds") const { return (dir_ / name).string(); }

  // 3 documents: {[1 2 3], [4]}, {}, {[5 6]} -- the empty document is legal, as in Megatron.
  std::string write_small(TokenType type = TokenType::u16) {
    IndexedDatasetWriter w(prefix(), type);
    w.add_sequence(std::vector<int32_t>{1, 2, 3});
    w.add_sequence(std::vector<int32_t>{4});
    w.end_document();
    w.end_document();
    w.add_document(std::vector<int32_t>{5, 6});
    w.finalize();
    return prefix();
  }

  fs::path dir_;
};

TEST_F(IndexedDatasetTest, ExactBytesOfASmallFile) {
  const std::string p = write_small(TokenType::u16);
  std::vector<char> idx = read_file(p + ".idx");
  std::vector<char> expected;
  auto append = [&](const void* data, size_t n) {
    expected.insert(expected.end(), static_cast<const char*>(data),
                    static_cast<const char*>(data) + n);
  };
  append("MMIDIDX\0\0", 9);
  const uint64_t version = 1, num_sequences = 3, num_doc_entries = 4;
  const uint8_t code = 8;
  append(&version, 8);
  append(&code, 1);
  append(&num_sequences, 8);
  append(&num_doc_entries, 8);
  const int32_t lengths[] = {3, 1, 2};
  const int64_t pointers[] = {0, 6, 8};
  const int64_t docs[] = {0, 2, 2, 3};
  append(lengths, sizeof(lengths));
  append(pointers, sizeof(pointers));
  append(docs, sizeof(docs));
  EXPECT_EQ(idx, expected);
  const uint16_t tokens[] = {1, 2, 3, 4, 5, 6};
  std::vector<char> bin = read_file(p + ".bin");
  ASSERT_EQ(bin.size(), sizeof(tokens));
  EXPECT_EQ(std::memcmp(bin.data(), tokens, sizeof(tokens)), 0);
}

TEST_F(IndexedDatasetTest, RoundTripEveryTokenType) {
  for (TokenType type : {TokenType::u8, TokenType::i8, TokenType::i16, TokenType::i32,
                         TokenType::i64, TokenType::f64, TokenType::f32, TokenType::u16}) {
    SCOPED_TRACE(token_type_name(type));
    const bool is_signed = type != TokenType::u8 && type != TokenType::u16;
    std::vector<std::vector<int32_t>> docs = {{0, 1, 2, 127}, {}, {100}, {7, 7, 7, 7, 7}};
    if (is_signed) docs.push_back({-1, -128, 5});
    const std::string p = prefix(token_type_name(type));
    {
      IndexedDatasetWriter w(p, type);
      for (const auto& d : docs) w.add_document(d);
      EXPECT_FALSE(fs::exists(p + ".idx"));  // only temporary names until finalize
      w.finalize();
      EXPECT_TRUE(w.finalized());
    }
    EXPECT_FALSE(fs::exists(p + ".bin.tmp"));
    IndexedDataset ds = IndexedDataset::open(p);
    EXPECT_EQ(ds.token_type(), type);
    ASSERT_EQ(ds.num_sequences(), docs.size());
    EXPECT_EQ(ds.num_documents(), docs.size());
    EXPECT_FALSE(ds.multimodal());
    EXPECT_TRUE(ds.sequence_modes().empty());
    int64_t total = 0;
    for (size_t i = 0; i < docs.size(); ++i) {
      EXPECT_EQ(ds.read(i), docs[i]);
      EXPECT_EQ(ds.sequence_lengths()[i], int32_t(docs[i].size()));
      EXPECT_EQ(ds.sequence_pointers()[i], total * int64_t(token_size(type)));
      EXPECT_EQ(ds.document_indices()[i + 1], int64_t(i + 1));
      EXPECT_EQ(ds.sequence_bytes(i).size(), docs[i].size() * token_size(type));
      total += int64_t(docs[i].size());
    }
    EXPECT_EQ(ds.num_tokens(), total);
  }
}

TEST_F(IndexedDatasetTest, PartialReadsAndBounds) {
  IndexedDataset ds = IndexedDataset::open(write_small());
  EXPECT_EQ(ds.num_sequences(), 3u);
  EXPECT_EQ(ds.num_documents(), 3u);
  EXPECT_EQ(ds.document_indices().to_vector(), (std::vector<int64_t>{0, 2, 2, 3}));
  int32_t out[3] = {};
  ds.read(0, 1, 2, out);
  EXPECT_EQ(out[0], 2);
  EXPECT_EQ(out[1], 3);
  ds.read(0, 3, 0, out);  // empty read at the end is fine
  expect_config_error([&] { ds.read(0, 2, 2, out); }, {"tokens [2, 4) of sequence 0", "3 tokens"});
  expect_config_error([&] { ds.read(0, -1, 1, out); }, {"out of range"});
  expect_config_error([&] { ds.read(3, 0, 1, out); }, {"sequence 3 out of range"});
  expect_config_error([&] { ds.sequence_bytes(7); }, {"sequence 7 out of range"});
  // Sample indexing searches the document boundaries; the packed arrays are ranges.
  auto docs = ds.document_indices();
  EXPECT_EQ(std::ranges::upper_bound(docs, 2) - docs.begin(), 3);
  // Moving a dataset keeps its views valid.
  IndexedDataset moved = std::move(ds);
  EXPECT_EQ(moved.read(2), (std::vector<int32_t>{5, 6}));
}

TEST_F(IndexedDatasetTest, WideTokensThatDoNotFitInt32AreAnErrorOnRead) {
  IndexedDatasetWriter w(prefix(), TokenType::i64);
  w.add_document(std::vector<int64_t>{int64_t(1) << 40, 3});
  w.finalize();
  IndexedDataset ds = IndexedDataset::open(prefix());
  expect_config_error([&] { ds.read(0); }, {"1099511627776", "int32"});
  int32_t out = 0;
  ds.read(0, 1, 1, &out);
  EXPECT_EQ(out, 3);
}

TEST_F(IndexedDatasetTest, WriterChecksTokensAndState) {
  IndexedDatasetWriter w(prefix(), TokenType::u8);
  expect_config_error(
      [&] {
        w.add_sequence(std::vector<int32_t>{1, 256});
      },
      {"token 256", "position 1", "u8"});
  expect_config_error([&] { w.add_sequence(std::vector<int32_t>{-1}); }, {"token -1"});
  IndexedDatasetWriter f(prefix("f32"), TokenType::f32);
  expect_config_error([&] { f.add_sequence(std::vector<int32_t>{(1 << 24) + 1}); }, {"f32"});
  w.add_sequence(std::vector<int32_t>{1, 2});  // left open: finalize ends the document
  w.finalize();
  expect_config_error([&] { w.add_sequence(std::vector<int32_t>{1}); }, {"finalized"});
  expect_config_error([&] { w.finalize(); }, {"twice"});
  IndexedDataset ds = IndexedDataset::open(prefix());
  EXPECT_EQ(ds.num_documents(), 1u);
  expect_config_error([&] { IndexedDatasetWriter(prefix("no/such/dir/x"), TokenType::u8); },
                      {"no/such/dir/x.bin.tmp", "cannot create"});
}

TEST_F(IndexedDatasetTest, AddDocumentsIsAddSequenceInOneCall) {
  {
    IndexedDatasetWriter w(prefix("one"), TokenType::i16);
    w.add_sequence(std::vector<int32_t>{1, 2, 3});
    w.add_sequence(std::vector<int32_t>{4, 5});
    w.end_document();
    w.end_document();
    w.add_document(std::vector<int32_t>{-6});
    w.finalize();
  }
  IndexedDatasetWriter w(prefix("batch"), TokenType::i16);
  const std::vector<int32_t> tokens = {1, 2, 3, 4, 5, -6};
  w.add_documents(tokens, std::vector<int64_t>{3, 2, 1}, std::vector<int64_t>{2, 0, 1});
  expect_config_error(
      [&] {
        w.add_documents(tokens, std::vector<int64_t>{3, 2}, {});
      },
      {"add up to 5, but there are 6 tokens"});
  expect_config_error(
      [&] { w.add_documents(tokens, std::vector<int64_t>{6}, std::vector<int64_t>{2}); },
      {"documents hold 2 sequences, but there are 1 sequence lengths"});
  expect_config_error(
      [&] {
        w.add_documents(tokens, std::vector<int64_t>{7, -1}, {});
      },
      {"sequence_lengths[0] = 7"});
  expect_config_error(
      [&] {
        w.add_documents(std::vector<int32_t>{1, 40000}, std::vector<int64_t>{2},
                        std::vector<int64_t>{1});
      },
      {"token 40000", "i16"});
  EXPECT_EQ(w.num_sequences(), 3u);  // the bad batches added nothing
  w.finalize();
  for (const char* ext : {".bin", ".idx"}) {
    EXPECT_EQ(read_file(prefix("one") + ext), read_file(prefix("batch") + ext)) << ext;
  }
}

TEST_F(IndexedDatasetTest, WriterWithoutFinalizeLeavesNothing) {
  {
    IndexedDatasetWriter w(prefix(), TokenType::i32);
    w.add_document(std::vector<int32_t>{1, 2, 3});
    EXPECT_TRUE(fs::exists(prefix() + ".bin.tmp"));
  }
  EXPECT_TRUE(fs::is_empty(dir_));
  IndexedDatasetWriter w(prefix(), TokenType::i32);
  w.discard();
  EXPECT_TRUE(fs::is_empty(dir_));
}

TEST_F(IndexedDatasetTest, EmptyDatasetRoundTrips) {
  IndexedDatasetWriter(prefix(), TokenType::u16).finalize();
  IndexedDataset ds = IndexedDataset::open(prefix());
  EXPECT_EQ(ds.num_sequences(), 0u);
  EXPECT_EQ(ds.num_documents(), 0u);
  EXPECT_EQ(ds.num_tokens(), 0);
  EXPECT_EQ(read_file(prefix() + ".idx").size(), 34u + 8u);
}

TEST_F(IndexedDatasetTest, SmallestTokenTypeIsMegatrons) {
  EXPECT_EQ(smallest_token_type(257), TokenType::u16);
  EXPECT_EQ(smallest_token_type(65499), TokenType::u16);
  EXPECT_EQ(smallest_token_type(65500), TokenType::i32);
  EXPECT_EQ(smallest_token_type(128256), TokenType::i32);
  EXPECT_EQ(token_type_from_name("uint16"), TokenType::u16);
  EXPECT_EQ(token_type_from_name("i64"), TokenType::i64);
  expect_config_error([] { token_type_from_name("bf16"); }, {"unknown token type 'bf16'"});
}

TEST_F(IndexedDatasetTest, MultimodalModesAreRead) {
  const std::string p = write_small(TokenType::i32);
  std::vector<char> idx = read_file(p + ".idx");
  idx.insert(idx.end(), {char(0), char(1), char(-3)});  // one int8 mode per sequence
  write_file(p + ".idx", idx);
  IndexedDataset ds = IndexedDataset::open(p);
  EXPECT_TRUE(ds.multimodal());
  EXPECT_EQ(ds.sequence_modes().to_vector(), (std::vector<int8_t>{0, 1, -3}));
  EXPECT_EQ(ds.read(2), (std::vector<int32_t>{5, 6}));
}

// ---- corrupt files: each is a real file on disk, opened through IndexedDataset::open --------

// Layout of write_small(): header 34, lengths at 34 (3 x 4), pointers at 46 (3 x 8),
// document indices at 70 (4 x 8), 102 bytes in all; .bin 6 tokens.
constexpr size_t kLengths = 34, kPointers = 46, kDocs = 70;

class CorruptIndexTest : public IndexedDatasetTest {
 protected:
  // Writes the small dataset, lets `edit` change the .idx bytes, and expects open() to fail
  // with a message naming the file and containing `parts`.
  void expect_open_error(TokenType type, const std::function<void(std::vector<char>&)>& edit,
                         std::initializer_list<std::string> parts) {
    const std::string p = write_small(type);
    std::vector<char> idx = read_file(p + ".idx");
    edit(idx);
    write_file(p + ".idx", idx);
    expect_config_error([&] { IndexedDataset::open(p); }, parts);
  }
  void expect_open_error(const std::function<void(std::vector<char>&)>& edit,
                         std::initializer_list<std::string> parts) {
    expect_open_error(TokenType::u16, edit, parts);
  }
};

TEST_F(CorruptIndexTest, Header) {
  const std::string idx = prefix() + ".idx";
  expect_open_error([](auto& b) { b[3] = 'X'; }, {idx, "magic", "MMIXIDX"});
  expect_open_error([](auto& b) { b.resize(5); }, {idx, "magic", "truncated"});
  expect_open_error([](auto& b) { b.clear(); }, {idx, "magic", "truncated (0 bytes"});
  expect_open_error([](auto& b) { put<uint64_t>(b, 9, 2); }, {idx, "version", "got 2"});
  expect_open_error([](auto& b) { b.resize(12); }, {idx, "version", "truncated"});
  expect_open_error([](auto& b) { b[17] = 0; }, {idx, "token type", "unknown code 0"});
  expect_open_error([](auto& b) { b[17] = 9; }, {idx, "token type", "unknown code 9"});
  expect_open_error([](auto& b) { b.resize(30); }, {idx, "count", "truncated"});
}

TEST_F(CorruptIndexTest, Counts) {
  const std::string idx = prefix() + ".idx";
  expect_open_error([](auto& b) { put<uint64_t>(b, 18, 4); }, {idx, "count", "4 sequences"});
  expect_open_error([](auto& b) { put<uint64_t>(b, 18, 2); }, {idx, "count", "102 bytes"});
  expect_open_error([](auto& b) { put<uint64_t>(b, 18, uint64_t(1) << 62); },
                    {idx, "sequence count", "4611686018427387904"});
  expect_open_error([](auto& b) { put<uint64_t>(b, 26, ~uint64_t(0)); }, {idx, "document count"});
  expect_open_error([](auto& b) { put<uint64_t>(b, 26, 5); }, {idx, "document count"});
  expect_open_error([](auto& b) { put<uint64_t>(b, 26, 3); }, {idx, "count", "102 bytes"});
  expect_open_error([](auto& b) { b.resize(101); }, {idx, "count", "101 bytes"});
  expect_open_error([](auto& b) { b.push_back(0); }, {idx, "count", "103 bytes"});
}

TEST_F(CorruptIndexTest, DocumentCountZero) {
  // A file whose counts are consistent with its size but has no document entries at all.
  const std::string p = prefix();
  std::vector<char> idx(34);
  std::memcpy(idx.data(), "MMIDIDX\0\0", 9);
  put<uint64_t>(idx, 9, 1);
  idx[17] = 4;
  write_file(p + ".idx", idx);
  write_file(p + ".bin", {});
  expect_config_error([&] { IndexedDataset::open(p); }, {p + ".idx", "document count: 0"});
}

TEST_F(CorruptIndexTest, SequenceLengths) {
  const std::string idx = prefix() + ".idx";
  expect_open_error([](auto& b) { put<int32_t>(b, kLengths + 4, -3); },
                    {idx, "sequence_lengths[1] = -3 is negative"});
  // A longer sequence than the .bin holds.
  expect_open_error([](auto& b) { put<int32_t>(b, kLengths + 8, 3); },
                    {idx, "sequence 2", "past the end of", ".bin (12 bytes)"});
}

TEST_F(CorruptIndexTest, SequencePointers) {
  const std::string idx = prefix() + ".idx";
  expect_open_error([](auto& b) { put<int64_t>(b, kPointers, 2); },
                    {idx, "sequence_pointers[0] = 2", "byte 0"});
  expect_open_error([](auto& b) { put<int64_t>(b, kPointers + 16, 4); },
                    {idx, "sequence_pointers[2] = 4 overlaps sequence 1"});
  expect_open_error([](auto& b) { put<int64_t>(b, kPointers + 16, -8); },
                    {idx, "sequence_pointers[2] = -8"});
  expect_open_error([](auto& b) { put<int64_t>(b, kPointers + 8, 0); },
                    {idx, "sequence_pointers[1] = 0 overlaps"});
  expect_open_error([](auto& b) { put<int64_t>(b, kPointers + 16, 10); },
                    {idx, "sequence_pointers[2] = 10 leaves a gap"});
  expect_open_error([](auto& b) { put<int64_t>(b, kPointers + 16, 1000); },
                    {idx, "sequence_pointers[2] = 1000 points past the end of", ".bin"});
}

TEST_F(CorruptIndexTest, DocumentIndices) {
  const std::string idx = prefix() + ".idx";
  expect_open_error([](auto& b) { put<int64_t>(b, kDocs, 1); },
                    {idx, "document_indices[0] = 1, expected 0"});
  expect_open_error([](auto& b) { put<int64_t>(b, kDocs + 16, 1); },
                    {idx, "document_indices[2] = 1 is less than document_indices[1] = 2"});
  expect_open_error([](auto& b) { put<int64_t>(b, kDocs + 24, 2); },
                    {idx, "document_indices[3] = 2", "equal the sequence count 3"});
  expect_open_error([](auto& b) { put<int64_t>(b, kDocs + 16, 9); },
                    {idx, "document_indices[2] = 9 is past the sequence count 3"});
}

TEST_F(CorruptIndexTest, BinFile) {
  const std::string p = write_small(TokenType::i32);
  std::vector<char> bin = read_file(p + ".bin");
  write_file(p + ".bin", std::vector<char>(bin.begin(), bin.end() - 1));
  expect_config_error([&] { IndexedDataset::open(p); },
                      {p + ".idx", "sequence 2", "past the end of " + p + ".bin (23 bytes)"});
  bin.resize(bin.size() + 8);
  write_file(p + ".bin", bin);
  expect_config_error([&] { IndexedDataset::open(p); }, {p + ".bin", "8 bytes left over"});
  fs::remove(p + ".bin");
  expect_config_error([&] { IndexedDataset::open(p); }, {p + ".bin", "cannot open"});
  expect_config_error([&] { IndexedDataset::open(prefix("missing")); },
                      {prefix("missing") + ".idx", "cannot open"});
  fs::create_directories(prefix("dir") + ".idx");
  expect_config_error([&] { IndexedDataset::open(prefix("dir")); }, {"not a regular file"});
}

TEST_F(CorruptIndexTest, ParseIndexOnAnyPrefixOfAValidFileNeverReadsOutside) {
  // Every truncation of a valid .idx is rejected by the in-memory parser (ASan checks the reads
  // in the sanitizer build; the fuzz target explores the rest).
  const std::string p = write_small(TokenType::u16);
  std::vector<char> idx = read_file(p + ".idx");
  for (size_t n = 0; n < idx.size(); ++n) {
    std::vector<std::byte> copy(n);
    if (n > 0) std::memcpy(copy.data(), idx.data(), n);
    EXPECT_THROW(parse_index(copy, 12, p), ConfigError) << n;
  }
  std::vector<std::byte> full(idx.size());
  std::memcpy(full.data(), idx.data(), idx.size());
  Index index = parse_index(full, 12, p);
  EXPECT_EQ(index.num_sequences(), 3u);
}

}  // namespace
}  // namespace braid::data
