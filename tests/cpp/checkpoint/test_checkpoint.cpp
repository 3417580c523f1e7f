// Distributed checkpoints: resharding across layouts, bit-exact resume, clear errors.

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "braid/ckpt/safetensors.h"
#include "braid/comm/launch.h"
#include "braid/comm/parallel_state.h"
#include "braid/engine/checkpoint.h"
#include "dp/parallel_test_models.h"
#include "tp/tp_test_util.h"

using namespace braid;
using namespace braid::engine;
using model::GPTModel;
using model::TransformerConfig;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kGlobalRows = 8;
using parallel_testing::gpt2;
using parallel_testing::kSeq;
using parallel_testing::llama;

// The schedules count samples (Megatron's), in global batches of kGlobalRows.
TrainerConfig trainer_config() {
  TrainerConfig config = parallel_testing::trainer_config(12);
  config.global_batch_size = kGlobalRows;
  return config;
}

tp_testing::Batch global_batch(int64_t vocab, int64_t step) {
  return tp_testing::batch(kGlobalRows, kSeq, vocab, 500 + uint64_t(step));
}

struct Layout {
  int tp, pp, dp;
  bool zero;
  int virtual_stages = 1;
  std::optional<int> first_stage_layers = std::nullopt;  // uneven pipeline stages
  std::optional<int> last_stage_layers = std::nullopt;
  int ep = 1;  // expert parallelism, carved out of dp (of tp · dp with whole experts)
  bool whole_experts = false;  // --expert-tensor-parallel-size 1 (with sequence parallelism)
  std::string str() const {
    std::ostringstream out;
    out << "(" << tp << ", " << pp << ", " << dp << ")" << (zero ? " zero" : "")
        << (virtual_stages > 1 ? " v2" : "");
    if (ep > 1) out << " ep" << ep;
    if (whole_experts) out << " etp1";
    if (first_stage_layers) out << " first " << *first_stage_layers;
    if (last_stage_layers) out << " last " << *last_stage_layers;
    return out.str();
  }
};

// A model and trainer of one layout; a one-process one when the layout is (1, 1, 1) (on every
// rank, no communication).
struct Job {
  std::unique_ptr<comm::ParallelState> state;
  std::unique_ptr<GPTModel> single;
  std::unique_ptr<ParallelModel> model;
  std::unique_ptr<Trainer> trainer;
  int dp_rank = 0, dp = 1;

  Job(const TransformerConfig& config, const Layout& l, uint64_t seed) {
    if (l.tp * l.pp * l.dp == 1) {
      single = std::make_unique<GPTModel>(config, Device::cpu(), seed);
      model = std::make_unique<ParallelModel>(*single);
    } else {
      state = std::make_unique<comm::ParallelState>(
          comm::init_distributed().world,
          comm::ParallelLayout{
              .tp = l.tp, .pp = l.pp, .dp = l.dp, .ep = l.ep, .etp = l.whole_experts ? 1 : 0});
      ParallelConfig parallel;
      parallel.sequence_parallel = l.whole_experts;
      parallel.virtual_stages = l.virtual_stages;
      parallel.first_stage_layers = l.first_stage_layers;
      parallel.last_stage_layers = l.last_stage_layers;
      parallel.ddp.use_distributed_optimizer = l.zero;
      parallel.ddp.overlap_grad_reduce = l.zero;
      parallel.ddp.bucket_size = 5000;
      model = std::make_unique<ParallelModel>(config, Device::cpu(), seed, *state, parallel);
      dp_rank = state->dp_rank();
      dp = l.dp;
    }
    trainer = std::make_unique<Trainer>(*model, trainer_config());
  }

  float step(const TransformerConfig& config) {
    const tp_testing::Batch b = global_batch(config.vocab_size, trainer->iteration());
    const int64_t rows = kGlobalRows / dp;
    return trainer
        ->train_step(parallel_testing::dp_share(b.ids, dp, dp_rank),
                     parallel_testing::dp_share(b.targets, dp, dp_rank), int(rows))
        .loss;
  }
};

std::string scratch(const std::string& name) {
  // One directory for all ranks of the job (rank 0's pid), fresh per test.
  static const std::string root = [] {
    Tensor pid = Tensor::empty({1}, DType::i64);
    pid.data_ptr<int64_t>()[0] = int64_t(getpid());
    comm::init_distributed().world->broadcast(pid, 0)->wait();
    return (fs::temp_directory_path() / ("braid_ckpt_test_" + std::to_string(pid.item(0))))
        .string();
  }();
  return root + "/" + name;
}

void barrier() { comm::init_distributed().world->barrier()->wait(); }

bool is_single(const Layout& l) { return l.tp * l.pp * l.dp == 1; }

// Saved under `saving` after 3 steps; every layout of `loading` that loads it takes the same
// next 3 steps as the saving layout does. Returns the checkpoint directory.
std::string check_reshard(const std::string& name, const TransformerConfig& config,
                          const Layout& saving, const std::vector<Layout>& loading) {
  SCOPED_TRACE(name + " saved at " + saving.str());
  static int saves = 0;
  const std::string dir = scratch("reshard_" + std::to_string(saves++));
  std::vector<float> want;
  {
    Job job(config, saving, 11);
    for (int s = 0; s < 3; ++s) job.step(config);
    // A one-process layout runs on every rank alike; one of them saves.
    if (!is_single(saving) || comm::init_distributed().world->rank() == 0)
      save_checkpoint(dir, *job.trainer, {.consumed_samples = 3 * kGlobalRows});
    if (is_single(saving)) barrier();
    for (int s = 0; s < 3; ++s) want.push_back(job.step(config));
  }
  for (const Layout& l : loading) {
    SCOPED_TRACE("loaded at " + l.str());
    Job job(config, l, 99);  // another seed: everything must come from the checkpoint
    const LoopState loop = load_checkpoint(dir, *job.trainer);
    EXPECT_EQ(loop.consumed_samples, 3 * kGlobalRows);
    EXPECT_EQ(job.trainer->iteration(), 3);
    EXPECT_EQ(job.trainer->optimizer().step(), 3);
    for (int s = 0; s < 3; ++s) {
      const float loss = job.step(config);
      EXPECT_NEAR(loss, want[size_t(s)], 2e-5 * std::abs(want[size_t(s)])) << "step " << 4 + s;
    }
    barrier();
  }
  return dir;
}

TEST(CheckpointReshard, SavedAt222WithZeroLoadsEverywhere) {
  if (comm::init_distributed().world->size() != 8) GTEST_SKIP() << "runs on 8 ranks";
  const Layout saving{2, 2, 2, true};
  const std::vector<Layout> loading{{1, 1, 1, false},        {4, 2, 1, false}, {1, 4, 2, true},
                                    {2, 1, 4, true},         {2, 2, 2, false}, {1, 4, 2, false, 2},
                                    {1, 4, 2, true, 1, 3, 1}};  // uneven stages: 3 | 2 | 2 | 1
                                                                // layers
  check_reshard("gpt2", gpt2(), saving, loading);
  check_reshard("llama", llama(), saving, loading);
  // Dropout masks follow the samples: the same drops on any number of ranks.
  TransformerConfig dropout = gpt2(0.1f);
  dropout.attention_dropout = 0.1f;
  check_reshard("gpt2 with dropout", dropout, saving,
                {{1, 1, 1, false}, {1, 4, 2, true}, {2, 1, 4, true}, {1, 1, 8, false}});
}

// Uneven stages saved (5 | 3 layers) load under even stages, one process included, and under
// other uneven ones (2 | 6 layers, interleaved: chunks of 1 on rank 0, of 3 on rank 1).
TEST(CheckpointReshard, SavedWithUnevenStagesLoadsEverywhere) {
  if (comm::init_distributed().world->size() != 8) GTEST_SKIP() << "runs on 8 ranks";
  const Layout saving{2, 2, 2, true, 1, std::nullopt, 3};
  check_reshard("gpt2", gpt2(), saving,
                {{1, 1, 1, false}, {2, 4, 1, true}, {1, 2, 4, false, 2, 2, std::nullopt}});
}

// ---- expert parallelism -------------------------------------------------------------------

// A mixture of experts in every layer: 4 experts, top 2.
TransformerConfig moe() {
  TransformerConfig c = llama();
  c.num_experts = 4;
  c.moe_router_topk = 2;
  c.moe_ffn_hidden_size = 32;
  return c;
}

Layout with_ep(int tp, int pp, int dp, bool zero, int ep, bool whole_experts = false) {
  return Layout{
      .tp = tp, .pp = pp, .dp = dp, .zero = zero, .ep = ep, .whole_experts = whole_experts};
}

// The files of a checkpoint saved under (tp, pp, ep) are Megatron's, mp_rank_TT_PPP (ep = 1) or
// mp_rank_TT_PPP_EEE, and each holds what its position writes: under EP the experts of EP rank
// e, and the other tensors in EP rank 0's file only. With whole experts the ranks of a stage
// write: TP rank t's dense shards the file (t, t % ep), EP rank e's whole experts (e % tp, e).
void check_files(const std::string& dir, int64_t iteration, int tp, int pp, int ep,
                 int64_t num_experts, bool whole_experts = false) {
  if (comm::init_distributed().world->rank() != 0) return;
  const std::string path = iteration_directory(dir, iteration);
  std::vector<std::string> files, want{"metadata.json"};
  for (const auto& entry : fs::directory_iterator(path))
    files.push_back(entry.path().filename().string());
  std::sort(files.begin(), files.end());
  for (int t = 0; t < tp; ++t) {
    for (int p = 0; p < pp; ++p) {
      for (int e = 0; e < ep; ++e) {
        const bool has_dense = whole_experts ? e == t % ep : e == 0;
        const bool has_experts = !whole_experts || t == e % tp;
        if (!has_dense && !has_experts) continue;
        char name[64];
        if (ep > 1)
          std::snprintf(name, sizeof(name), "mp_rank_%02d_%03d_%03d.safetensors", t, p, e);
        else
          std::snprintf(name, sizeof(name), "mp_rank_%02d_%03d.safetensors", t, p);
        want.push_back(name);
        const ckpt::SafetensorsFile file = ckpt::SafetensorsFile::open(path + "/" + name);
        int experts = 0, dense = 0;
        for (const std::string& key : file.names()) {
          const size_t at = key.find("mlp.experts.");
          if (at == std::string::npos) {
            ++dense;
            continue;
          }
          const int64_t j = std::stoll(key.substr(at + std::strlen("mlp.experts.")));
          EXPECT_GE(j, e * num_experts / ep) << name << " holds " << key;
          EXPECT_LT(j, (e + 1) * num_experts / ep) << name << " holds " << key;
          ++experts;
        }
        if (has_experts)
          EXPECT_GT(experts, 0) << name;
        else
          EXPECT_EQ(experts, 0) << name;
        if (has_dense)
          EXPECT_GT(dense, 0) << name;
        else
          EXPECT_EQ(dense, 0) << name;
      }
    }
  }
  std::sort(want.begin(), want.end());
  EXPECT_EQ(files, want);
  std::ifstream in(path + "/metadata.json");
  const nlohmann::json meta = nlohmann::json::parse(in);
  EXPECT_EQ(meta.at("layout").at("expert_model_parallel_size").get<int>(), ep);
  EXPECT_EQ(meta.at("layout").at("expert_tensor_parallel_size").get<int>(), whole_experts ? 1 : tp);
}

// A MoE model saved under expert parallelism (with and without ZeRO, whose expert buckets shard
// over the expert-DP group) resumes without it, and one saved without it resumes under EP: the
// loader takes each expert by name from whichever file holds it.
TEST(CheckpointExpertParallel, SavedUnderEpLoadsUnderAnyOtherEp) {
  const int world = comm::init_distributed().world->size();
  const TransformerConfig config = moe();
  if (world == 2) {
    const std::string ep_dir =
        check_reshard("moe", config, with_ep(1, 1, 2, true, 2),
                      {{1, 1, 1, false}, {1, 1, 2, true}, with_ep(1, 1, 2, false, 2)});
    check_files(ep_dir, 3, 1, 1, 2, config.num_experts);
    const std::string dense_dir = check_reshard(
        "moe", config, {1, 1, 1, false}, {with_ep(1, 1, 2, true, 2), with_ep(1, 1, 2, false, 2)});
    check_files(dense_dir, 3, 1, 1, 1, config.num_experts);
  } else if (world == 8) {
    // tp2 · ep2 (dp 4, expert DP 2) with ZeRO, loaded down to one process and across ep 1, 2, 4.
    const std::string ep_dir = check_reshard("moe", config, with_ep(2, 1, 4, true, 2),
                                             {{1, 1, 1, false},
                                              with_ep(1, 1, 8, true, 4),
                                              with_ep(2, 2, 2, false, 2),
                                              {4, 1, 2, true},
                                              with_ep(1, 2, 4, true, 4)});
    check_files(ep_dir, 3, 2, 1, 2, config.num_experts);
    const std::string pp_dir = check_reshard("moe", config, with_ep(1, 2, 4, true, 4),
                                             {with_ep(2, 1, 4, true, 2), {2, 2, 2, true}});
    check_files(pp_dir, 3, 1, 2, 4, config.num_experts);
    const std::string dense_dir = check_reshard(
        "moe", config, {1, 1, 1, false}, {with_ep(2, 1, 4, true, 2), with_ep(1, 1, 8, false, 4)});
    check_files(dense_dir, 3, 1, 1, 1, config.num_experts);
  } else {
    GTEST_SKIP() << "runs on 2 or 8 ranks";
  }
  barrier();
}

// Whole experts (--expert-tensor-parallel-size 1): each EP rank's experts are written whole by
// one rank of the stage, and load under split experts, other EP sizes and one process; split
// experts load as whole ones.
TEST(CheckpointExpertParallel, WholeExpertsLoadUnderAnyLayout) {
  const int world = comm::init_distributed().world->size();
  const TransformerConfig config = moe();
  if (world == 2) {
    const std::string dir = check_reshard("moe", config, with_ep(2, 1, 1, true, 2, true),
                                          {{1, 1, 1, false},
                                           {2, 1, 1, false},
                                           with_ep(1, 1, 2, false, 2),
                                           with_ep(2, 1, 1, false, 1, true)});
    check_files(dir, 3, 2, 1, 2, config.num_experts, true);
    check_reshard("moe", config, {2, 1, 1, true}, {with_ep(2, 1, 1, false, 2, true)});
    // ep 1: both TP ranks hold every expert whole; TP rank 0 writes them.
    const std::string ep1 = check_reshard("moe", config, with_ep(2, 1, 1, true, 1, true),
                                          {{1, 1, 1, false}, {2, 1, 1, false}});
    check_files(ep1, 3, 2, 1, 1, config.num_experts, true);
  } else if (world == 8) {
    // ep 4 over tp 2 × dp 2 per stage, so the dense files of TP rank 1 are EP rank 1's.
    const std::string dir = check_reshard("moe", config, with_ep(2, 2, 2, true, 4, true),
                                          {{1, 1, 1, false},
                                           with_ep(2, 1, 4, true, 2),
                                           with_ep(4, 1, 2, false, 4, true),
                                           with_ep(4, 1, 2, true, 1, true)});
    check_files(dir, 3, 2, 2, 4, config.num_experts, true);
    // tp 4 with ep 2: TP ranks 2 and 3 write dense shards into EP rank 0's and 1's files.
    const std::string tp4 = check_reshard("moe", config, with_ep(4, 1, 2, true, 2, true),
                                          {with_ep(2, 2, 2, false, 4, true), {1, 1, 1, false}});
    check_files(tp4, 3, 4, 1, 2, config.num_experts, true);
  } else {
    GTEST_SKIP() << "runs on 2 or 8 ranks";
  }
  barrier();
}

// Same layout, f32 on the CPU: stopping at step 4 and resuming gives bit-identical losses for
// steps 5..14 - parameters, moments, step counts, LR and the dropout streams all restored.
TEST(CheckpointResume, BitIdenticalToAnUninterruptedRun) {
  const int world = comm::init_distributed().world->size();
  const Layout layout = world == 8 ? Layout{2, 2, 2, true} : Layout{1, 1, 2, true};
  const TransformerConfig config = gpt2(0.1f);
  std::vector<float> straight, resumed;
  {
    Job job(config, layout, 5);
    for (int s = 0; s < 14; ++s) straight.push_back(job.step(config));
  }
  const std::string dir = scratch("resume");
  {
    Job job(config, layout, 5);
    for (int s = 0; s < 4; ++s) resumed.push_back(job.step(config));
    save_checkpoint(dir, *job.trainer, {.consumed_samples = 4 * kGlobalRows});
  }
  {
    Job job(config, layout, 77);
    load_checkpoint(dir, *job.trainer);
    for (int s = 4; s < 14; ++s) resumed.push_back(job.step(config));
  }
  ASSERT_EQ(resumed.size(), straight.size());
  for (size_t s = 0; s < straight.size(); ++s)
    EXPECT_EQ(std::memcmp(&resumed[s], &straight[s], sizeof(float)), 0)
        << "step " << s + 1 << ": " << resumed[s] << " vs " << straight[s];
  barrier();
}

}  // namespace

namespace {

// Every way a checkpoint can be wrong is one clear ConfigError, the same on every rank (each
// rank names what it found; the others say another rank failed), and nothing is loaded half.
class CheckpointErrors : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = scratch("errors_" +
                   std::string(testing::UnitTest::GetInstance()->current_test_info()->name()));
    job_ = std::make_unique<Job>(llama(), layout(), 3);
    job_->step(llama());
    save_checkpoint(dir_, *job_->trainer, {});
    path_ = iteration_directory(dir_, 1);
  }
  static Layout layout() {
    const int world = comm::init_distributed().world->size();
    return world == 8 ? Layout{2, 2, 2, true} : Layout{1, 1, world, true};
  }
  bool root() const { return comm::init_distributed().world->rank() == 0; }

  // Loads into a fresh job and returns the error message (empty: it loaded).
  std::string load_error(const TransformerConfig& config, const LoadOptions& options = {}) {
    barrier();
    Job job(config, layout(), 9);
    try {
      load_checkpoint(dir_, *job.trainer, options);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "";
  }

  void edit_metadata(const std::function<void(std::string&)>& edit) {
    if (root()) {
      std::ifstream in(path_ + "/metadata.json");
      std::stringstream text;
      text << in.rdbuf();
      std::string s = text.str();
      edit(s);
      std::ofstream(path_ + "/metadata.json") << s;
    }
  }

  std::string dir_, path_;
  std::unique_ptr<Job> job_;
};

// "what" contains one of the needles.
testing::AssertionResult Mentions(const std::string& what,
                                  std::initializer_list<const char*> needles) {
  for (const char* n : needles)
    if (what.find(n) != std::string::npos) return testing::AssertionSuccess();
  return testing::AssertionFailure() << "the error '" << what << "' mentions none of the expected";
}

// A missing EP rank's file is named, as any missing file is.
TEST(CheckpointExpertParallel, MissingExpertFileIsNamed) {
  const int world = comm::init_distributed().world->size();
  if (world != 2 && world != 8) GTEST_SKIP() << "runs on 2 or 8 ranks";
  const TransformerConfig config = moe();
  const Layout saving = world == 2 ? with_ep(1, 1, 2, true, 2) : with_ep(2, 1, 4, true, 2);
  const std::string dir = scratch("ep_missing");
  {
    Job job(config, saving, 3);
    job.step(config);
    save_checkpoint(dir, *job.trainer, {});
  }
  barrier();
  const std::string file = iteration_directory(dir, 1) + "/mp_rank_00_000_001.safetensors";
  if (comm::init_distributed().world->rank() == 0) fs::remove(file);
  barrier();
  for (const Layout& l : {Layout{1, 1, 1, false}, saving}) {
    SCOPED_TRACE("loaded at " + l.str());
    Job job(config, l, 9);
    try {
      load_checkpoint(dir, *job.trainer);
      ADD_FAILURE() << "loaded without " << file;
    } catch (const ConfigError& e) {
      EXPECT_TRUE(Mentions(e.what(), {"mp_rank_00_000_001.safetensors", "another rank"}));
    }
    barrier();
  }
}

TEST_F(CheckpointErrors, NothingSaved) {
  const std::string empty = scratch("nothing_here");
  Job job(llama(), layout(), 9);
  try {
    load_checkpoint(empty, *job.trainer);
    FAIL() << "loaded from an empty directory";
  } catch (const ConfigError& e) {
    EXPECT_TRUE(Mentions(e.what(), {"latest_checkpointed_iteration.txt"}));
  }
  barrier();
}

TEST(CheckpointTracker, HoldsOneIterationNumber) {
  // Megatron's tracker file holds the iteration alone; anything else is named, never misread
  // (a number past 2^63 - 1 used to read as 2^63 - 1).
  const std::string dir = scratch("tracker");
  const bool root = comm::init_distributed().world->rank() == 0;
  const std::vector<std::pair<std::string, int64_t>> cases = {
      {"42\n", 42},   {"7x", -1}, {"", -1}, {"-3", -1}, {"99999999999999999999", -1},
      {"release", -1}};
  for (const auto& [text, want] : cases) {
    SCOPED_TRACE("tracker '" + text + "'");
    if (root) {
      fs::create_directories(dir);
      std::ofstream(fs::path(dir) / "latest_checkpointed_iteration.txt") << text;
    }
    barrier();
    if (want >= 0) {
      EXPECT_EQ(latest_iteration(dir), want);
    } else {
      try {
        latest_iteration(dir);
        ADD_FAILURE() << "read an iteration";
      } catch (const ConfigError& e) {
        EXPECT_TRUE(Mentions(e.what(), {"latest_checkpointed_iteration.txt"}));
        EXPECT_TRUE(Mentions(e.what(), {"should hold an iteration number"}));
        EXPECT_NE(std::string(e.what()).find("'" + text + "'"), std::string::npos) << e.what();
      }
    }
    barrier();
  }
}

TEST_F(CheckpointErrors, MissingFileIsNamed) {
  if (root()) fs::remove(path_ + "/mp_rank_00_000.safetensors");
  const std::string error = load_error(llama());
  EXPECT_TRUE(Mentions(error, {"mp_rank_00_000.safetensors", "another rank"}));
  EXPECT_FALSE(error.empty());
  barrier();
}

TEST_F(CheckpointErrors, TruncatedFileIsNamed) {
  if (root()) {
    const std::string file = path_ + "/mp_rank_00_000.safetensors";
    fs::resize_file(file, fs::file_size(file) - 100);
  }
  const std::string error = load_error(llama());
  EXPECT_TRUE(Mentions(error, {"mp_rank_00_000.safetensors", "another rank"}));
  EXPECT_FALSE(error.empty());
  barrier();
}

TEST_F(CheckpointErrors, DifferentModelNamesTheField) {
  TransformerConfig other = llama();
  other.ffn_hidden_size = 128;
  EXPECT_TRUE(Mentions(load_error(other), {"ffn_hidden_size is 96 in the checkpoint"}));
  barrier();
}

TEST_F(CheckpointErrors, FutureFormatVersion) {
  edit_metadata([](std::string& s) {
    const std::string key = "\"format_version\": 1";
    s.replace(s.find(key), key.size(), "\"format_version\": 99");
  });
  EXPECT_TRUE(Mentions(load_error(llama()), {"format version 99 is newer"}));
  barrier();
}

TEST_F(CheckpointErrors, ShapeThatDisagreesWithTheConfigNamesTheTensor) {
  edit_metadata([](std::string& s) {
    // model.norm.weight's global shape [64] becomes [65].
    const std::string key = "\"model.norm.weight\": {";
    const size_t at = s.find("[", s.find(key));
    s.replace(at, s.find("]", at) - at + 1, "[\n   65\n  ]");
  });
  // Ranks whose stage holds the final norm name it; the others say another rank failed.
  EXPECT_TRUE(Mentions(load_error(llama()), {"model.norm.weight is [65]", "another rank"}));
  barrier();
}

// The samples of the updates (where the LR schedule stands under a batch ramp) are read back;
// a checkpoint from before they were saved had full batches only: iterations x global batch.
TEST_F(CheckpointErrors, UpdateSamplesAreRestoredOrDerived) {
  const std::string saved = "\"update_samples\": 8";
  auto loaded_samples = [&] {
    barrier();
    Job job(llama(), layout(), 9);
    load_checkpoint(dir_, *job.trainer);
    return job.trainer->update_samples();
  };
  EXPECT_EQ(loaded_samples(), 8);
  edit_metadata(
      [&](std::string& s) { s.replace(s.find(saved), saved.size(), "\"update_samples\": 4"); });
  EXPECT_EQ(loaded_samples(), 4);
  edit_metadata([&](std::string& s) {  // the key gone (renamed: no comma to mend)
    const std::string key = "\"update_samples\": 4";
    s.replace(s.find(key), key.size(), "\"not_saved_then\": 4");
  });
  EXPECT_EQ(loaded_samples(), 8);
  barrier();
}

TEST_F(CheckpointErrors, NoOptimizerStateNeedsNoLoadOptim) {
  barrier();
  save_checkpoint(dir_, *job_->trainer, {}, {.save_optim = false});
  EXPECT_TRUE(Mentions(load_error(llama()), {"--no-load-optim"}));
  EXPECT_EQ(load_error(llama(), {.load_optim = false}), "");
  barrier();
}

}  // namespace

namespace {

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A file of the save in `iteration_dir` with the save's random id (metadata.json's save_id,
// in every file it wrote) blanked out.
std::string file_bytes_without_save_id(const std::string& iteration_dir, const std::string& name) {
  const std::string id =
      nlohmann::json::parse(file_bytes(iteration_dir + "/metadata.json")).at("save_id");
  std::string bytes = file_bytes(iteration_dir + "/" + name);
  for (size_t at = bytes.find(id); at != std::string::npos; at = bytes.find(id, at))
    bytes.replace(at, id.size(), std::string(id.size(), '-'));
  return bytes;
}

// --async-save: the state is copied when save() returns, so training on while the thread
// writes changes nothing: the files equal a synchronous save's of the same iteration, byte
// for byte but for the saves' ids; it becomes the latest only once committed.
TEST(CheckpointAsync, FilesEqualASynchronousSaveWhileTrainingGoesOn) {
  const int world = comm::init_distributed().world->size();
  const Layout layout = world == 8 ? Layout{2, 2, 2, true} : Layout{1, 1, world, true};
  const std::string sync_dir = scratch("sync"), async_dir = scratch("async");
  Job job(llama(), layout, 4);
  for (int s = 0; s < 3; ++s) job.step(llama());
  save_checkpoint(sync_dir, *job.trainer, {.consumed_samples = 24});
  CheckpointSaver saver(async_dir, true);
  saver.save(*job.trainer, {.consumed_samples = 24});
  EXPECT_TRUE(saver.in_flight());
  for (int s = 0; s < 3; ++s) {
    job.step(llama());  // changes every parameter and moment the thread may still be writing
    saver.poll(*job.model);
  }
  saver.wait(*job.model);
  EXPECT_FALSE(saver.in_flight());
  EXPECT_EQ(saver.last_committed(), 3);
  EXPECT_EQ(latest_iteration(async_dir), 3);
  barrier();
  if (comm::init_distributed().world->rank() == 0) {
    const std::string a = iteration_directory(sync_dir, 3), b = iteration_directory(async_dir, 3);
    int files = 0;
    for (const auto& entry : fs::directory_iterator(a)) {
      const std::string name = entry.path().filename().string();
      EXPECT_EQ(file_bytes_without_save_id(a, name), file_bytes_without_save_id(b, name)) << name;
      ++files;
    }
    EXPECT_EQ(files, std::distance(fs::directory_iterator(b), fs::directory_iterator()));
  }
  barrier();
}

}  // namespace

namespace {

// Megatron's options: --no-load-optim continues the iteration (LR schedule, data position) with
// fresh optimizer state; --finetune takes the parameters only and starts counting from zero.
TEST(CheckpointOptions, NoLoadOptimAndFinetune) {
  const int world = comm::init_distributed().world->size();
  const Layout layout = world == 8 ? Layout{2, 2, 2, true} : Layout{1, 1, world, true};
  const std::string dir = scratch("options");
  {
    Job job(llama(), layout, 4);
    for (int s = 0; s < 3; ++s) job.step(llama());
    save_checkpoint(dir, *job.trainer, {.consumed_samples = 24, .device_seconds = 1234.5});
  }
  {
    Job job(llama(), layout, 8);
    const LoopState loop = load_checkpoint(dir, *job.trainer, {.load_optim = false});
    EXPECT_EQ(loop.consumed_samples, 24);
    EXPECT_EQ(loop.device_seconds, 1234.5);  // the run's cost so far goes on too
    EXPECT_EQ(job.trainer->iteration(), 3);
    EXPECT_EQ(job.trainer->update_samples(), 3 * kGlobalRows);
    EXPECT_EQ(job.trainer->optimizer().step(), 0);
    for (const AdamW::Segment& s : job.trainer->optimizer().segments())
      for (float v : std::vector<float>(s.exp_avg.data_ptr<float>(),
                                        s.exp_avg.data_ptr<float>() + s.exp_avg.numel()))
        ASSERT_EQ(v, 0.0f);
    const tp_testing::Batch b = global_batch(llama().vocab_size, 3);
    const int64_t rows = kGlobalRows / job.dp;
    const StepStats stats =
        job.trainer->train_step(b.ids.narrow(job.dp_rank * rows, rows).clone(),
                                b.targets.narrow(job.dp_rank * rows, rows).clone(), int(rows));
    EXPECT_EQ(stats.lr, trainer_config().schedule.lr_at(3));  // the schedule goes on
  }
  {
    // Saved without the dropout streams at iteration 3: resuming must say so (Megatron too);
    // with --no-load-rng it continues.
    const std::string no_rng = scratch("options_no_rng");
    {
      Job job(llama(), layout, 4);
      for (int s = 0; s < 3; ++s) job.step(llama());
      save_checkpoint(no_rng, *job.trainer, {.consumed_samples = 24}, {.save_rng = false});
    }
    Job job(llama(), layout, 8);
    try {
      load_checkpoint(no_rng, *job.trainer);
      ADD_FAILURE() << "loaded a checkpoint without RNG state as a resume";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("saved without RNG state at iteration 3; load with "
                                           "--no-load-rng"),
                std::string::npos)
          << e.what();
    }
    EXPECT_EQ(load_checkpoint(no_rng, *job.trainer, {.load_rng = false}).consumed_samples, 24);
  }
  {
    Job job(llama(), layout, 8);
    const LoopState loop = load_checkpoint(dir, *job.trainer, {.finetune = true});
    EXPECT_EQ(loop.consumed_samples, 0);
    EXPECT_EQ(loop.device_seconds, 0.0);  // a new run
    EXPECT_EQ(job.trainer->iteration(), 0);
    EXPECT_EQ(job.trainer->optimizer().step(), 0);
  }
  barrier();
}

}  // namespace
