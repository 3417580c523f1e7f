// A checkpoint knows its own files: every file a save writes carries the save's id (metadata.json's
// save_id) and each tensor's CRC-32C. A load names a tensor whose bytes changed on disk, and a
// file copied in from another save (another run, the same iteration, the same shapes), instead
// of resuming from them; a checkpoint without ids and checksums (the converters write none) loads.
// One process (the reader is the same for every layout; tests/cpp/checkpoint/test_checkpoint.cpp
// reshards).

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "braid/ckpt/crc32c.h"
#include "braid/ckpt/safetensors.h"
#include "braid/engine/checkpoint.h"
#include "dp/parallel_test_models.h"
#include "tp/tp_test_util.h"

using namespace braid;
using namespace braid::engine;
namespace fs = std::filesystem;

namespace {

constexpr const char* kShard = "mp_rank_00_000.safetensors";

std::string file_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

// A one-process Llama that trains one step from `seed` and saves into `dir`.
struct Saved {
  model::TransformerConfig config = parallel_testing::llama();
  std::unique_ptr<model::GPTModel> model;
  std::unique_ptr<ParallelModel> parallel;
  std::unique_ptr<Trainer> trainer;

  explicit Saved(uint64_t seed) {
    model = std::make_unique<model::GPTModel>(config, Device::cpu(), seed);
    parallel = std::make_unique<ParallelModel>(*model);
    trainer = std::make_unique<Trainer>(*parallel, parallel_testing::trainer_config(12));
  }
  void step() {
    const tp_testing::Batch b = tp_testing::batch(4, parallel_testing::kSeq, config.vocab_size, 7);
    trainer->train_step(b.ids, b.targets, 4);
  }
};

class CheckpointIntegrity : public testing::Test {
 protected:
  void SetUp() override {
    root_ =
        fs::temp_directory_path() / ("braid_integrity_" + std::to_string(getpid()) + "_" +
                                     testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    dir_ = (root_ / "ckpt").string();
    Saved saved(3);
    saved.step();
    save_checkpoint(dir_, *saved.trainer, {});
    iteration_ = fs::path(iteration_directory(dir_, 1));
  }
  void TearDown() override { fs::remove_all(root_); }

  // The error of loading dir_ into a fresh model ("" when it loads).
  std::string load_error() const {
    Saved fresh(9);
    try {
      load_checkpoint(dir_, *fresh.trainer);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "";
  }

  fs::path root_, iteration_;
  std::string dir_;
};

TEST_F(CheckpointIntegrity, EveryFileCarriesTheSaveIdAndEveryTensorItsChecksum) {
  const std::string id =
      nlohmann::json::parse(file_text(iteration_ / "metadata.json")).at("save_id");
  EXPECT_EQ(id.size(), 16u);
  const ckpt::SafetensorsFile f = ckpt::SafetensorsFile::open((iteration_ / kShard).string());
  EXPECT_EQ(f.metadata().at("braid.save_id"), id);
  int tensors = 0;
  for (const std::string& name : f.names()) {
    char want[9];
    std::snprintf(want, sizeof want, "%08x", ckpt::crc32c(f.bytes(name)));
    EXPECT_EQ(f.metadata().at("crc32c." + name), want) << name;
    ++tensors;
  }
  EXPECT_GT(tensors, 10);  // the parameters and both Adam moments
  EXPECT_EQ(load_error(), "");
}

TEST_F(CheckpointIntegrity, ADamagedTensorIsNamed) {
  // One bit of model.norm.weight's data flips on disk.
  const fs::path shard = iteration_ / kShard;
  std::string bytes = file_text(shard);
  const ckpt::SafetensorsHeader header = ckpt::parse_safetensors_header(
      {reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()});
  for (const ckpt::TensorInfo& t : header.tensors)
    if (t.name == "model.norm.weight") bytes[size_t(header.data_start + t.begin + 5)] ^= 0x04;
  write_text(shard, bytes);
  const std::string error = load_error();
  for (const std::string& part : {shard.string(), std::string("'model.norm.weight'"),
                                  std::string("CRC-32C"), std::string("damaged")})
    EXPECT_NE(error.find(part), std::string::npos) << error;
}

TEST_F(CheckpointIntegrity, AFileOfAnotherSaveIsNamed) {
  // Another run of the same model saves its iteration 1; its shard is copied over ours.
  const std::string other = (root_ / "other").string();
  {
    Saved saved(4);
    saved.step();
    save_checkpoint(other, *saved.trainer, {});
  }
  fs::copy_file(fs::path(iteration_directory(other, 1)) / kShard, iteration_ / kShard,
                fs::copy_options::overwrite_existing);
  const std::string error = load_error();
  EXPECT_NE(error.find((iteration_ / kShard).string() + " was written by another save"),
            std::string::npos)
      << error;
  EXPECT_NE(error.find("mixes the files of two checkpoints"), std::string::npos) << error;
}

TEST_F(CheckpointIntegrity, ACheckpointWithoutIdsAndChecksumsLoads) {
  // What the converters write: metadata.json without save_id, files without braid's metadata.
  const fs::path meta = iteration_ / "metadata.json";
  nlohmann::json m = nlohmann::json::parse(file_text(meta));
  m.erase("save_id");
  write_text(meta, m.dump(1));
  const ckpt::SafetensorsFile f = ckpt::SafetensorsFile::open((iteration_ / kShard).string());
  ckpt::SafetensorsWriter plain;
  for (const std::string& name : f.names()) plain.add(name, f.read(name));
  plain.write((root_ / "plain.safetensors").string());
  fs::rename(root_ / "plain.safetensors", iteration_ / kShard);
  EXPECT_EQ(load_error(), "");
}

}  // namespace
