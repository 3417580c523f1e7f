// checkpoint_bench: how fast braid saves, against a raw write of the same bytes to the same
// disk, and how long an asynchronous save keeps training waiting.
//
//   mpirun -np 2 build/benchmarks/checkpoint_bench [--dir DIR --layers 4 --hidden 1024
//       --vocab 32000 --repeats 3]
//
// A data-parallel job (dp = the job's ranks, ZeRO-1) of a GPT with f32 parameters: a checkpoint
// holds parameters and both Adam moments (12 bytes per parameter), written by DP rank 0 after
// the moments are gathered. Per repeat, in this order, into DIR (default: the system's temp
// directory - pass a directory on the disk you care about):
//   raw    rank 0 writes the same number of bytes to one file in 64 MiB write() calls, fsync
//   sync   save_checkpoint(): gather, write, fsync, metadata, rename, tracker
//   async  CheckpointSaver::save() returns after the gather and the host copy; training steps
//          run (each followed by poll()) until the save is committed. "blocked" is the time
//          save() kept the caller; "to commit" the time from its start to the commit.
//   load   load_checkpoint() of the sync save (every rank: its ZeRO part), against rank 0
//          reading the raw file back; both come from the page cache, so this compares the CPU
//          work: parsing, checking each tensor's CRC-32C, scattering into the shards. The
//          CRC-32C of the raw file's bytes is timed alone too.
// Throughput is checkpoint bytes / time; the ratios compare with raw in the same run (medians
// over the repeats). The disk's page cache makes every figure optimistic alike: each write
// ends with fsync, so what is timed reached the device.

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "braid/ckpt/crc32c.h"
#include "braid/comm/launch.h"
#include "braid/comm/parallel_state.h"
#include "braid/engine/checkpoint.h"

using namespace braid;
namespace fs = std::filesystem;

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int64_t directory_bytes(const fs::path& dir) {
  int64_t total = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) total += int64_t(e.file_size());
  return total;
}

void raw_write(const fs::path& path, int64_t bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  BRAID_CHECK(fd >= 0, "cannot create ", path.string());
  std::vector<char> chunk(size_t(64) << 20, 1);
  for (int64_t left = bytes; left > 0;) {
    const ssize_t n =
        ::write(fd, chunk.data(), size_t(std::min<int64_t>(left, int64_t(chunk.size()))));
    BRAID_CHECK(n > 0, "write failed on ", path.string());
    left -= n;
  }
  BRAID_CHECK(::fsync(fd) == 0, "fsync failed on ", path.string());
  ::close(fd);
}

// Reads `path` in 64 MiB read() calls; returns the seconds reading took and, in *crc_s, those
// the CRC-32C of what was read took.
double raw_read(const fs::path& path, double* crc_s) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  BRAID_CHECK(fd >= 0, "cannot open ", path.string());
  std::vector<uint8_t> chunk(size_t(64) << 20);
  double read_s = 0;
  uint32_t crc = 0;
  *crc_s = 0;
  for (;;) {
    auto start = std::chrono::steady_clock::now();
    const ssize_t n = ::read(fd, chunk.data(), chunk.size());
    read_s += seconds_since(start);
    BRAID_CHECK(n >= 0, "read failed on ", path.string());
    if (n == 0) break;
    start = std::chrono::steady_clock::now();
    crc = ckpt::crc32c({chunk.data(), size_t(n)}, crc);
    *crc_s += seconds_since(start);
  }
  ::close(fd);
  return read_s;
}

}  // namespace

int main(int argc, char** argv) {
  return comm::run_main([&] {
    std::string dir = (fs::temp_directory_path() / "braid_checkpoint_bench").string();
    int64_t layers = 4, hidden = 1024, vocab = 32000;
    int repeats = 3;
    for (int i = 1; i < argc; ++i) {
      const std::string flag = argv[i];
      if (flag == "-h" || flag == "--help") {
        std::printf(
            "checkpoint_bench [--dir DIR] [--layers L] [--hidden H] [--vocab V] "
            "[--repeats N]\n  writes checkpoints of a GPT (about 1 GB at the defaults) under "
            "DIR (default %s), then removes them\n",
            dir.c_str());
        return 0;
      }
      BRAID_CONFIG_CHECK(i + 1 < argc, "checkpoint_bench: ", flag, " needs a value");
      const char* value = argv[++i];
      if (flag == "--dir")
        dir = value;
      else if (flag == "--layers")
        layers = std::atoll(value);
      else if (flag == "--hidden")
        hidden = std::atoll(value);
      else if (flag == "--vocab")
        vocab = std::atoll(value);
      else if (flag == "--repeats")
        repeats = std::atoi(value);
      else
        BRAID_CONFIG_CHECK(false, "checkpoint_bench: unknown flag ", flag);
    }
    auto world = comm::init_distributed().world;
    const bool root = world->rank() == 0;
    comm::ParallelState state(world, {.dp = world->size()});
    model::TransformerConfig config = model::TransformerConfig::preset("gpt2-tiny");
    config.num_layers = layers;
    config.hidden_size = hidden;
    config.num_attention_heads = hidden / 64;
    config.num_query_groups = hidden / 64;
    config.ffn_hidden_size = 4 * hidden;
    config.vocab_size = vocab;
    config.max_position_embeddings = 32;
    engine::ParallelConfig parallel;
    parallel.ddp.use_distributed_optimizer = true;
    engine::ParallelModel model(config, Device::cpu(), 1, state, parallel);
    engine::TrainerConfig tc;
    tc.schedule.style = engine::LRDecayStyle::constant;
    engine::Trainer trainer(model, tc);
    Tensor ids = Tensor::zeros({1, 32}, DType::i32), targets = Tensor::zeros({1, 32}, DType::i32);
    auto step = [&] { trainer.train_step(ids, targets, 1); };
    step();
    if (root) fs::remove_all(dir);
    world->barrier()->wait();

    std::vector<double> raw_s, sync_s, blocked_s, commit_s, steps_during, load_s, read_s, crc_s;
    int64_t bytes = 0;
    for (int r = 0; r < repeats; ++r) {
      // sync
      world->barrier()->wait();
      auto start = std::chrono::steady_clock::now();
      const std::string saved =
          engine::save_checkpoint(dir + "/sync", trainer, {.consumed_samples = 0});
      sync_s.push_back(seconds_since(start));
      if (root) bytes = directory_bytes(saved);
      // raw, the same bytes
      world->barrier()->wait();
      if (root) {
        start = std::chrono::steady_clock::now();
        raw_write(fs::path(dir) / "raw.bin", bytes);
        raw_s.push_back(seconds_since(start));
        double crc = 0;
        read_s.push_back(raw_read(fs::path(dir) / "raw.bin", &crc));
        crc_s.push_back(crc);
        fs::remove(fs::path(dir) / "raw.bin");
      }
      // load the sync save back
      world->barrier()->wait();
      start = std::chrono::steady_clock::now();
      engine::load_checkpoint(dir + "/sync", trainer);
      load_s.push_back(seconds_since(start));
      // async, training on
      world->barrier()->wait();
      engine::CheckpointSaver saver(dir + "/async", true);
      start = std::chrono::steady_clock::now();
      saver.save(trainer, {.consumed_samples = 0});
      blocked_s.push_back(saver.last_blocked_seconds());
      int steps = 0;
      while (saver.in_flight()) {
        step();
        ++steps;
        saver.poll(model);
      }
      commit_s.push_back(seconds_since(start));
      steps_during.push_back(steps);
      step();
    }
    if (root) {
      const double gb = double(bytes) / 1e9;
      const double raw = median(raw_s), sync = median(sync_s);
      std::printf(
          "# checkpoint_bench: %lld parameters, %d ranks (ZeRO-1), %.3f GB per checkpoint, "
          "%d repeats, medians, into %s\n",
          static_cast<long long>(model.chunk(0).num_parameters()), world->size(), gb, repeats,
          dir.c_str());
      std::printf("%-28s %10s %12s %12s\n", "", "seconds", "GB/s", "vs raw");
      std::printf("%-28s %10.3f %12.3f %12.2f\n", "raw write + fsync", raw, gb / raw, 1.0);
      std::printf("%-28s %10.3f %12.3f %12.2f\n", "save_checkpoint (sync)", sync, gb / sync,
                  raw / sync);
      const double commit = median(commit_s), blocked = median(blocked_s);
      std::printf("%-28s %10.3f %12.3f %12.2f\n", "async: start to commit", commit, gb / commit,
                  raw / commit);
      std::printf("%-28s %10.3f %12s %12s\n", "async: training blocked", blocked, "", "");
      const double read = median(read_s), load = median(load_s), crc = median(crc_s);
      std::printf("%-28s %10.3f %12.3f %12.2f\n", "raw read (page cache)", read, gb / read, 1.0);
      std::printf("%-28s %10.3f %12.3f %12.2f\n", "load_checkpoint", load, gb / load, read / load);
      std::printf("%-28s %10.3f %12.3f %12.2f\n", "crc32c of the bytes", crc, gb / crc, read / crc);
      std::printf(
          "async: training was blocked for %.1f%% of the synchronous save's time and ran "
          "%.0f steps while the save was written\n",
          100.0 * blocked / sync, median(steps_during));
      fs::remove_all(dir);
    }
    return 0;
  });
}
