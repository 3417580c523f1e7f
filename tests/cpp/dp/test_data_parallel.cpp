// Data parallelism and 3D layouts: 5 training steps of the Trainer on this rank's share equal
// the one-process Trainer's on the same global batch - every step's loss, and every parameter
// afterwards (gathered from all shards and stages) - with ZeRO-1 on and off, bucket reductions
// overlapped with the backward or not, sequence parallelism and interleaved pipelines where
// the layout has them. Rows of the global batch carry different numbers of ignored targets,
// so only the mean over the global batch's tokens (not a mean of microbatch means) matches.

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "braid/comm/launch.h"
#include "braid/comm/parallel_state.h"
#include "braid/engine/trainer.h"
#include "tp/tp_test_util.h"

using namespace braid;
using namespace braid::engine;
using model::GPTModel;
using model::TransformerConfig;

namespace {

constexpr int kSteps = 5;
constexpr int64_t kGlobalRows = 16;
constexpr int64_t kSeq = 16;

TransformerConfig llama() {  // untied, GQA (kv heads replicated at tp = 8)
  TransformerConfig c = TransformerConfig::preset("llama-tiny");
  c.num_layers = 8;
  c.hidden_size = 64;
  c.num_attention_heads = 8;
  c.num_query_groups = 4;
  c.ffn_hidden_size = 96;
  c.vocab_size = 96;
  c.make_vocab_size_divisible_by = 32;  // at tp = 8 ranks 3..7 hold only padding rows
  c.max_position_embeddings = kSeq;
  c.init_std = 0.1f;
  return c;
}

TransformerConfig gpt2() {  // tied embeddings (two copies under pp), learned positions, biases
  TransformerConfig c = TransformerConfig::preset("gpt2-tiny");
  c.num_layers = 8;
  c.hidden_size = 64;
  c.num_attention_heads = 8;
  c.num_query_groups = 8;
  c.ffn_hidden_size = 128;
  c.vocab_size = 96;
  c.make_vocab_size_divisible_by = 32;
  c.max_position_embeddings = kSeq;
  c.init_std = 0.1f;
  return c;
}

TrainerConfig trainer_config() {
  TrainerConfig t;
  t.optimizer.lr = 1e-3f;
  t.optimizer.weight_decay = 0.1f;
  t.optimizer.clip_grad = 0.5f;  // clips: the global norm must be right too
  t.schedule.lr = 1e-3f;
  t.schedule.min_lr = 1e-4f;
  t.schedule.warmup_iters = 2;
  t.schedule.decay_iters = kSteps;
  return t;
}

// Step s's global batch; row r ignores its last (r % 5) targets.
tp_testing::Batch global_batch(int64_t vocab, int step) {
  tp_testing::Batch b = tp_testing::batch(kGlobalRows, kSeq, vocab, 100 + uint64_t(step));
  int32_t* t = b.targets.data_ptr<int32_t>();
  for (int64_t r = 0; r < kGlobalRows; ++r)
    for (int64_t j = kSeq - r % 5; j < kSeq; ++j) t[r * kSeq + j] = -1;
  return b;
}

struct Run {
  std::vector<float> losses;
  std::vector<float> params;  // the whole model's flat buffer after the steps
};

std::vector<float> floats(const Tensor& t) {
  const Tensor f = t.to(Device::cpu());
  return std::vector<float>(f.data_ptr<float>(), f.data_ptr<float>() + f.numel());
}

// The one-process trainer, one row per microbatch (computed once per model, on every rank).
const Run& reference(const std::string& name, const TransformerConfig& config) {
  static std::map<std::string, Run> cache;
  auto it = cache.find(name);
  if (it != cache.end()) return it->second;
  GPTModel model(config, Device::cpu(), 7);
  const TrainerConfig t = trainer_config();
  Trainer trainer(model, t.optimizer, t.schedule);
  Run run;
  for (int s = 0; s < kSteps; ++s) {
    const tp_testing::Batch b = global_batch(config.vocab_size, s);
    run.losses.push_back(trainer.train_step(b.ids, b.targets, int(kGlobalRows)).loss);
  }
  run.params = floats(model.flat_params());
  return cache.emplace(name, std::move(run)).first->second;
}

struct Layout {
  int tp, pp, dp;
  int virtual_stages = 1;
  bool zero = false;
  bool overlap = false;
  bool sequence_parallel = false;
  std::string str() const {
    return "tp " + std::to_string(tp) + " pp " + std::to_string(pp) + " dp " + std::to_string(dp) +
           " v " + std::to_string(virtual_stages) + (zero ? " zero" : "") +
           (overlap ? " overlap" : "") + (sequence_parallel ? " sp" : "");
  }
};

void check_layout(const std::string& name, const Layout& l) {
  SCOPED_TRACE(name + " " + l.str());
  const TransformerConfig config = name == "llama" ? llama() : gpt2();
  const Run& want = reference(name, config);
  std::shared_ptr<comm::MpiCommunicator> world = comm::init_distributed().world;
  comm::ParallelState state(world, {.tp = l.tp, .pp = l.pp, .dp = l.dp});
  ParallelConfig parallel;
  parallel.sequence_parallel = l.sequence_parallel;
  parallel.virtual_stages = l.virtual_stages;
  parallel.ddp.use_distributed_optimizer = l.zero;
  parallel.ddp.overlap_grad_reduce = l.overlap;
  parallel.ddp.overlap_param_gather = l.zero && l.overlap;
  parallel.ddp.bucket_size = l.overlap ? 4000 : 0;  // several buckets per chunk when overlapped
  ParallelModel model(config, Device::cpu(), 7, state, parallel);
  Trainer trainer(model, trainer_config());

  const int64_t rows = kGlobalRows / l.dp;  // this DP rank's contiguous share, one per microbatch
  for (int s = 0; s < kSteps; ++s) {
    const tp_testing::Batch b = global_batch(config.vocab_size, s);
    const int64_t first = state.dp_rank() * rows;
    const StepStats stats = trainer.train_step(b.ids.narrow(first, rows).clone(),
                                               b.targets.narrow(first, rows).clone(), int(rows));
    EXPECT_FALSE(stats.skipped);
    for (int c = 0; c < model.num_chunks() && l.dp > 1; ++c) {
      // Every bucket reduced once; with overlap, each posted by the backward as it finished it.
      const GradBuffer& buffer = model.grad_buffer(c);
      ASSERT_EQ(buffer.reduce_spans().size(), buffer.buckets().size());
      for (const GradBuffer::Span& span : buffer.reduce_spans())
        EXPECT_EQ(span.during_backward, l.overlap) << "chunk " << c << " bucket " << span.bucket;
      if (l.overlap && c == 0) {
        EXPECT_GT(buffer.buckets().size(), 2u);
      }
    }
    EXPECT_NEAR(stats.loss, want.losses[size_t(s)], 2e-5 * std::abs(want.losses[size_t(s)]))
        << "step " << s + 1;
  }
  GPTModel whole(config, Device::cpu(), 1);
  model.gather_into(whole);
  const std::vector<float> got = floats(whole.flat_params());
  ASSERT_EQ(got.size(), want.params.size());
  const auto& layout = whole.layout();
  for (size_t i = 0; i < layout.specs.size(); ++i) {
    const size_t at = size_t(layout.offsets[i]), n = size_t(layout.specs[i].shape.numel());
    const std::vector<float> a(got.begin() + long(at), got.begin() + long(at + n));
    const std::vector<float> b(want.params.begin() + long(at), want.params.begin() + long(at + n));
    // k_proj's bias adds q·b_k to every score of a query's row, which the softmax cancels: its
    // true gradient is 0 and the computed one rounding noise (~1e-9), whose sign differs between
    // summation orders; Adam turns either sign into a full step of ±lr. So it can only agree to
    // within the steps taken.
    const bool noise_only = layout.specs[i].name.ends_with("k_proj.bias");
    const double atol = noise_only ? 2.0 * kSteps * trainer_config().optimizer.lr : 1e-5;
    EXPECT_LE(tp_testing::excess(a, b, atol, 1e-4), 0.0)
        << layout.specs[i].name << " after " << kSteps << " steps";
  }
  world->barrier()->wait();
}

int world_size() { return comm::init_distributed().world->size(); }

TEST(DataParallelEqualsOneRank, ZeroAndOverlapOnAndOff) {
  const int dp = world_size();
  if (dp == 8) GTEST_SKIP() << "8 ranks run the 3D matrix";
  for (bool zero : {false, true})
    for (bool overlap : {false, true}) {
      check_layout("llama", {.tp = 1, .pp = 1, .dp = dp, .zero = zero, .overlap = overlap});
      check_layout("gpt2", {.tp = 1, .pp = 1, .dp = dp, .zero = zero, .overlap = overlap});
    }
}

TEST(DataParallelEqualsOneRank, WithTensorAndPipelineParallelism) {
  if (world_size() != 4) GTEST_SKIP() << "runs on 4 ranks";
  for (bool zero : {false, true}) {
    check_layout("gpt2", {.tp = 1, .pp = 2, .dp = 2, .zero = zero, .overlap = true});
    check_layout(
        "llama",
        {.tp = 2, .pp = 1, .dp = 2, .zero = zero, .overlap = zero, .sequence_parallel = true});
  }
}

// The matrix on 8 ranks, where the heads allow (8 heads, 4 kv groups: every tp <= 8).
TEST(ThreeDParallelEqualsOneRank, Matrix) {
  if (world_size() != 8) GTEST_SKIP() << "runs on 8 ranks";
  const std::vector<std::array<int, 3>> layouts = {{2, 2, 2}, {1, 2, 4}, {2, 1, 4}, {4, 2, 1},
                                                   {2, 4, 1}, {1, 1, 8}, {8, 1, 1}};
  for (const auto& [tp, pp, dp] : layouts) {
    for (bool zero : {false, true}) {
      // Interleaving where there are stages to interleave; overlap with ZeRO; SP with TP.
      for (int v : pp > 1 ? std::vector<int>{1, 2} : std::vector<int>{1}) {
        const Layout l{tp, pp, dp, v, zero, zero, zero && tp > 1};
        check_layout("llama", l);
        check_layout("gpt2", l);
      }
    }
  }
}

}  // namespace
