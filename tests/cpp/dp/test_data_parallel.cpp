// Data parallelism and 3D layouts: 5 training steps of the Trainer on this rank's share equal
// the one-process Trainer's on the same global batch - every step's loss, and every parameter
// afterwards (gathered from all shards and stages) - with ZeRO-1 on and off, bucket reductions
// overlapped with the backward or not, sequence parallelism, interleaved and uneven pipelines
// where the layout has them. Rows of the global batch carry different numbers of ignored targets,
// so only the mean over the global batch's tokens (not a mean of microbatch means) matches.
// Models with multi-token prediction depths (the last stage's own embed_tokens copy, summed
// with the first stage's) match too, their depths' losses included.

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "braid/comm/launch.h"
#include "braid/comm/parallel_state.h"
#include "braid/engine/trainer.h"
#include "dp/parallel_test_models.h"
#include "tp/tp_test_util.h"

using namespace braid;
using namespace braid::engine;
using model::GPTModel;
using model::TransformerConfig;

namespace {

constexpr int kSteps = 5;
constexpr int64_t kGlobalRows = 16;
using parallel_testing::dp_share;
using parallel_testing::gpt2;
using parallel_testing::kSeq;
using parallel_testing::llama;
using parallel_testing::llama_mtp;

TransformerConfig with_attention_dropout(TransformerConfig c) {
  c.attention_dropout = 0.1f;
  return c;
}

TransformerConfig model_named(const std::string& name) {
  if (name == "llama") return llama();
  if (name == "gpt2") return gpt2();
  if (name == "mtp") return llama_mtp();
  if (name == "mtp_tied_dropout") return with_attention_dropout(llama_mtp(true, 0.1f));
  if (name == "gpt2_dropout") return with_attention_dropout(gpt2(0.1f));
  throw std::invalid_argument("no test model " + name);
}

TrainerConfig trainer_config() { return parallel_testing::trainer_config(kSteps); }

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
  std::vector<std::vector<double>> mtp_losses;  // per step, per depth
  float eval_loss = 0;        // Trainer::evaluate on the validation batch after the steps
  std::vector<float> params;  // the whole model's flat buffer after the steps
  float params_norm = 0;      // Trainer's optimizer().params_norm() after the steps
};

constexpr int kValidStep = 99;  // global_batch(vocab, kValidStep) is the validation batch

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
    const StepStats stats = trainer.train_step(b.ids, b.targets, int(kGlobalRows));
    run.losses.push_back(stats.loss);
    run.mtp_losses.push_back(stats.mtp_losses);
    EXPECT_EQ(stats.mtp_losses.size(), size_t(config.mtp_num_layers));
  }
  const tp_testing::Batch valid = global_batch(config.vocab_size, kValidStep);
  run.eval_loss = trainer.evaluate(valid.ids, valid.targets, 4);  // other microbatches: same mean
  run.params = floats(model.flat_params());
  run.params_norm = trainer.optimizer().params_norm();
  double squares = 0;
  for (float v : run.params) squares += double(v) * v;
  EXPECT_NEAR(run.params_norm, std::sqrt(squares), 1e-6 * std::sqrt(squares));
  return cache.emplace(name, std::move(run)).first->second;
}

struct Layout {
  int tp, pp, dp;
  int virtual_stages = 1;
  int micro_batch_size = 1;
  bool zero = false;
  bool overlap = false;
  bool sequence_parallel = false;
  std::optional<int> first_stage_layers = std::nullopt;  // uneven pipeline stages
  std::optional<int> last_stage_layers = std::nullopt;
  std::vector<int> model_chunk_layers = {};  // a pipeline layout
  std::vector<int> rank_layers = {};         // the layers each pipeline rank must hold, when given
  std::string str() const {
    return "tp " + std::to_string(tp) + " pp " + std::to_string(pp) + " dp " + std::to_string(dp) +
           " v " + std::to_string(virtual_stages) + " mbs " + std::to_string(micro_batch_size) +
           (zero ? " zero" : "") + (overlap ? " overlap" : "") + (sequence_parallel ? " sp" : "") +
           (first_stage_layers ? " first " + std::to_string(*first_stage_layers) : "") +
           (last_stage_layers ? " last " + std::to_string(*last_stage_layers) : "") +
           (model_chunk_layers.empty() ? "" : " layout " + layout_str());
  }
  std::string layout_str() const {
    std::string s;
    for (int n : model_chunk_layers) {
      if (!s.empty()) s.push_back('|');
      s.append(std::to_string(n));
    }
    return s;
  }
};

void check_layout(const std::string& name, const Layout& l) {
  SCOPED_TRACE(name + " " + l.str());
  const TransformerConfig config = model_named(name);
  const Run& want = reference(name, config);
  std::shared_ptr<comm::MpiCommunicator> world = comm::init_distributed().world;
  comm::ParallelState state(world, {.tp = l.tp, .pp = l.pp, .dp = l.dp});
  ParallelConfig parallel;
  parallel.sequence_parallel = l.sequence_parallel;
  parallel.virtual_stages = l.virtual_stages;
  parallel.first_stage_layers = l.first_stage_layers;
  parallel.last_stage_layers = l.last_stage_layers;
  parallel.model_chunk_layers = l.model_chunk_layers;
  parallel.ddp.use_distributed_optimizer = l.zero;
  parallel.ddp.overlap_grad_reduce = l.overlap;
  parallel.ddp.overlap_param_gather = l.zero && l.overlap;
  parallel.ddp.bucket_size = l.overlap ? 4000 : 0;  // several buckets per chunk when overlapped
  ParallelModel model(config, Device::cpu(), 7, state, parallel);
  if (!l.rank_layers.empty()) {
    int held = 0;
    for (int c = 0; c < model.num_chunks(); ++c)
      held += model.chunk(c).chunk().end_layer - model.chunk(c).chunk().first_layer;
    EXPECT_EQ(held, l.rank_layers[size_t(state.pp_rank())]) << "pp rank " << state.pp_rank();
  }
  Trainer trainer(model, trainer_config());

  const int64_t rows = kGlobalRows / l.dp;  // this DP rank's share
  const int microbatches = int(rows / l.micro_batch_size);
  for (int s = 0; s < kSteps; ++s) {
    const tp_testing::Batch b = global_batch(config.vocab_size, s);
    const StepStats stats = trainer.train_step(
        dp_share(b.ids, l.dp, state.dp_rank(), l.micro_batch_size),
        dp_share(b.targets, l.dp, state.dp_rank(), l.micro_batch_size), microbatches);
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
    ASSERT_EQ(stats.mtp_losses.size(), want.mtp_losses[size_t(s)].size());
    for (size_t k = 0; k < stats.mtp_losses.size(); ++k) {
      const double w = want.mtp_losses[size_t(s)][k];
      EXPECT_NEAR(stats.mtp_losses[k], w, 2e-5 * std::abs(w))
          << "step " << s + 1 << " depth " << k + 1;
    }
  }
  EXPECT_EQ(trainer.consumed_samples(), kSteps * kGlobalRows);
  // Validation: forwards only (the forward-only pipeline schedule under pp > 1), the same loss
  // as one process, twice alike; no counter or dropout state moves (the parameters are
  // compared below).
  {
    const tp_testing::Batch valid = global_batch(config.vocab_size, kValidStep);
    const int64_t first = state.dp_rank() * rows;
    const int64_t consumed = trainer.consumed_samples();
    const int64_t forwarded = model.chunk(0).dropout_samples();
    const float eval_loss = trainer.evaluate(valid.ids.narrow(first, rows).clone(),
                                             valid.targets.narrow(first, rows).clone(), int(rows));
    EXPECT_NEAR(eval_loss, want.eval_loss, 2e-5 * std::abs(want.eval_loss));
    EXPECT_EQ(trainer.evaluate(valid.ids.narrow(first, rows).clone(),
                               valid.targets.narrow(first, rows).clone(), int(rows)),
              eval_loss);
    EXPECT_EQ(trainer.consumed_samples(), consumed);
    EXPECT_EQ(model.chunk(0).dropout_samples(), forwarded);
    EXPECT_EQ(trainer.iteration(), kSteps);
    for (int c = 0; c < model.num_chunks(); ++c) EXPECT_FALSE(model.chunk(c).has_activations(0));
  }
  // The parameter norm counts every element once: TP replicas (kv heads at tp 8, norms), the
  // tied embedding's second copy, ZeRO shards, pipeline stages.
  EXPECT_NEAR(trainer.optimizer().params_norm(), want.params_norm, 1e-5 * want.params_norm);
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
      check_layout("mtp", {.tp = 1, .pp = 1, .dp = dp, .zero = zero, .overlap = overlap});
    }
  // Dropout masks follow the samples, wherever and in whichever microbatch they are: every
  // DP and micro-batch size drops what one process drops, one row per microbatch.
  for (int mbs : {1, 2})
    check_layout("gpt2_dropout",
                 {.tp = 1, .pp = 1, .dp = dp, .micro_batch_size = mbs, .zero = mbs == 2});
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

// Multi-token prediction depths on the last stage: its embed_tokens copy (the depths' lookup
// table, untied; also the output weight, tied) summed with the first stage's, sharded by ZeRO
// in a bucket of its own; eh_proj and the depths' norms summed over TP under SP; dropout
// streams of their own.
TEST(DataParallelEqualsOneRank, MultiTokenPrediction) {
  if (world_size() != 4) GTEST_SKIP() << "runs on 4 ranks";
  check_layout("mtp", {.tp = 1, .pp = 2, .dp = 2, .zero = true, .overlap = true});
  check_layout("mtp", {.tp = 2, .pp = 1, .dp = 2, .zero = true, .overlap = true});
  for (const char* name : {"mtp", "mtp_tied_dropout"}) {
    check_layout(name, {.tp = 2, .pp = 2, .dp = 1, .sequence_parallel = true});
    check_layout(name, {.tp = 1, .pp = 4, .dp = 1, .virtual_stages = 2});
    check_layout(name, {.tp = 4, .pp = 1, .dp = 1, .sequence_parallel = true});
  }
  check_layout("mtp_tied_dropout",
               {.tp = 1, .pp = 2, .dp = 2, .micro_batch_size = 2, .zero = true, .overlap = true});
  check_layout("mtp_tied_dropout", {.tp = 2, .pp = 1, .dp = 2, .sequence_parallel = true});
}

// Uneven stages (Megatron's --decoder-first/last-pipeline-num-layers) of the 8 layers: the
// same training as one process, tied embeddings across stages of different sizes included.
TEST(DataParallelEqualsOneRank, UnevenPipelineStages) {
  if (world_size() != 4) GTEST_SKIP() << "runs on 4 ranks";
  // pp 4: layers 3 | 2 | 2 | 1 (the head's stage lightest).
  check_layout("gpt2", {.tp = 1,
                        .pp = 4,
                        .dp = 1,
                        .first_stage_layers = 3,
                        .last_stage_layers = 1,
                        .rank_layers = {3, 2, 2, 1}});
  // pp 2 x dp 2, ZeRO, overlapped: 5 | 3.
  check_layout("llama", {.tp = 1,
                         .pp = 2,
                         .dp = 2,
                         .zero = true,
                         .overlap = true,
                         .last_stage_layers = 3,
                         .rank_layers = {5, 3}});
  // pp 2, interleaved: rank 0 holds 2 layers (chunks of 1), rank 1 holds 6 (chunks of 3).
  check_layout("gpt2", {.tp = 2,
                        .pp = 2,
                        .dp = 1,
                        .virtual_stages = 2,
                        .sequence_parallel = true,
                        .first_stage_layers = 2,
                        .rank_layers = {2, 6}});
}

// Pipeline layouts (Megatron's --pipeline-model-parallel-layout, and its
// --account-for-embedding/loss-in-pipeline-split): every model chunk's layers given, the
// first chunk with the embeddings alone and the last with the head alone included.
TEST(DataParallelEqualsOneRank, PipelineLayouts) {
  if (world_size() != 4) GTEST_SKIP() << "runs on 4 ranks";
  // "E|tt|ttt|tttL": a middle stage heavier than its neighbours.
  check_layout(
      "gpt2",
      {.tp = 1, .pp = 4, .dp = 1, .model_chunk_layers = {0, 2, 3, 3}, .rank_layers = {0, 2, 3, 3}});
  // pp 2 x v 2 x dp 2, ZeRO: "Ettt|t|tt|ttL".
  check_layout("llama", {.tp = 1,
                         .pp = 2,
                         .dp = 2,
                         .virtual_stages = 2,
                         .zero = true,
                         .overlap = true,
                         .model_chunk_layers = {3, 1, 2, 2},
                         .rank_layers = {5, 3}});
  // "E|tttt|tttt|mmL": the MTP depths alone with the head in the last chunk.
  check_layout("mtp", {.tp = 1,
                       .pp = 2,
                       .dp = 2,
                       .virtual_stages = 2,
                       .model_chunk_layers = {0, 4, 4, 0},
                       .rank_layers = {4, 4}});
  check_layout("mtp", {.tp = 2,
                       .pp = 2,
                       .dp = 1,
                       .sequence_parallel = true,
                       .model_chunk_layers = {1, 7},
                       .rank_layers = {1, 7}});
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
        const Layout l{.tp = tp,
                       .pp = pp,
                       .dp = dp,
                       .virtual_stages = v,
                       .zero = zero,
                       .overlap = zero,
                       .sequence_parallel = zero && tp > 1};
        check_layout("llama", l);
        check_layout("gpt2", l);
      }
    }
    // Hidden and attention dropout: the same masks in every layout.
    check_layout("gpt2_dropout", {.tp = tp,
                                  .pp = pp,
                                  .dp = dp,
                                  .micro_batch_size = dp < 8 ? 2 : 1,
                                  .sequence_parallel = tp > 1});
  }
}

}  // namespace

namespace {

// ZeRO-1: each DP rank allocates 1/dp of the optimizer state (f32 parameters: the two
// moments; the master weights are the model's own buffer), as the allocator counts it.
TEST(DistributedOptimizer, StateBytesAreOneOverDp) {
  std::shared_ptr<comm::MpiCommunicator> world = comm::init_distributed().world;
  const int dp = world->size();
  comm::ParallelState state(world, {.dp = dp});
  for (int64_t bucket_size : {int64_t(0), int64_t(3000)}) {
    SCOPED_TRACE("bucket size " + std::to_string(bucket_size));
    int64_t bytes[2] = {0, 0}, elements = 0;
    size_t buckets = 0;
    for (bool zero : {false, true}) {
      ParallelConfig parallel;
      parallel.ddp.use_distributed_optimizer = zero;
      parallel.ddp.overlap_grad_reduce = bucket_size > 0;
      parallel.ddp.bucket_size = bucket_size;
      ParallelModel model(llama(), Device::cpu(), 7, state, parallel);
      elements = model.chunk(0).layout().num_elements;
      buckets = model.grad_buffer(0).buckets().size();
      const int64_t before = memory_stats(Device::cpu()).current_bytes;
      Trainer trainer(model, trainer_config());
      bytes[zero] = memory_stats(Device::cpu()).current_bytes - before;
      EXPECT_EQ(bytes[zero], trainer.optimizer().state_bytes());
    }
    // Unsharded: 8 bytes per element of the buffer (padded to a multiple of dp at most per
    // bucket); sharded: exactly 1/dp of the padded buffer.
    const int64_t padding_bytes = int64_t(buckets) * (dp - 1) * 8;
    EXPECT_GE(bytes[0], 8 * elements);
    EXPECT_LE(bytes[0], 8 * elements + padding_bytes);
    EXPECT_EQ(bytes[1] * dp, bytes[0])
        << "ZeRO " << bytes[1] << " bytes × dp " << dp << " vs unsharded " << bytes[0];
    if (dp > 1 && bucket_size > 0) {
      EXPECT_GT(buckets, 2u);
    }
  }
  world->barrier()->wait();
}

std::vector<float> all_params(const ParallelModel& model) {
  std::vector<float> out;
  for (int c = 0; c < model.num_chunks(); ++c) {
    const std::vector<float> p = floats(model.chunk(c).flat_params());
    out.insert(out.end(), p.begin(), p.end());
  }
  return out;
}

// Loss scaling: steps whose scaled gradients overflow are skipped on every rank (nothing
// changes) and halve the scale; the first step that goes through equals the unscaled
// one-process step - the loss is reported unscaled and the gradients are unscaled before
// clipping and AdamW.
TEST(LossScaling, OverflowSkipsAndBacksOffThenMatchesTheUnscaledStep) {
  std::shared_ptr<comm::MpiCommunicator> world = comm::init_distributed().world;
  const int dp = world->size() >= 2 ? 2 : 1;
  comm::ParallelState state(world, {.tp = world->size() / dp, .dp = dp});
  const tp_testing::Batch b = global_batch(llama().vocab_size, 0);

  GPTModel one(llama(), Device::cpu(), 7);
  const TrainerConfig config = trainer_config();
  Trainer reference_trainer(one, config.optimizer, config.schedule);
  const float want_loss = reference_trainer.train_step(b.ids, b.targets, int(kGlobalRows)).loss;
  const std::vector<float> want = floats(one.flat_params());

  ParallelConfig parallel;
  parallel.ddp.use_distributed_optimizer = true;
  parallel.ddp.overlap_grad_reduce = true;
  parallel.ddp.bucket_size = 4000;
  ParallelModel model(llama(), Device::cpu(), 7, state, parallel);
  TrainerConfig scaled = config;
  scaled.loss_scale.dynamic = true;
  scaled.loss_scale.initial_loss_scale = 0x1p127f;  // overflows the squares of the norm
  scaled.loss_scale.hysteresis = 1;
  Trainer trainer(model, scaled);
  const int64_t rows = kGlobalRows / dp, first = state.dp_rank() * rows;
  const Tensor ids = b.ids.narrow(first, rows).clone();
  const Tensor targets = b.targets.narrow(first, rows).clone();
  const std::vector<float> initial = all_params(model);
  StepStats stats;
  float scale = 0x1p127f;
  int skipped = 0;
  while ((stats = trainer.train_step(ids, targets, int(rows))).skipped) {
    ASSERT_EQ(stats.loss_scale, scale);
    ASSERT_EQ(all_params(model), initial) << "a skipped step changed the parameters";
    scale /= 2;
    ASSERT_LT(++skipped, 100);
  }
  EXPECT_GT(skipped, 10);
  EXPECT_EQ(stats.loss_scale, scale);
  EXPECT_EQ(trainer.skipped_iterations(), skipped);
  EXPECT_EQ(trainer.optimizer().step(), 1);
  EXPECT_EQ(trainer.update_samples(), kGlobalRows);  // every DP rank's rows, the update's only
  EXPECT_NEAR(stats.loss, want_loss, 2e-5 * want_loss);
  GPTModel whole(llama(), Device::cpu(), 1);
  model.gather_into(whole);
  const std::vector<float> got = floats(whole.flat_params());
  const auto& layout = whole.layout();
  for (size_t i = 0; i < layout.specs.size(); ++i) {
    if (layout.specs[i].name.ends_with("k_proj.bias")) continue;  // see check_layout
    const size_t at = size_t(layout.offsets[i]), n = size_t(layout.specs[i].shape.numel());
    EXPECT_LE(
        tp_testing::excess(std::vector<float>(got.begin() + long(at), got.begin() + long(at + n)),
                           std::vector<float>(want.begin() + long(at), want.begin() + long(at + n)),
                           1e-5, 1e-4),
        0.0)
        << layout.specs[i].name;
  }
  world->barrier()->wait();
}

// Without a loss scaler (bf16, f32) a non-finite loss skips the step on every rank, and the
// optimizer takes no step.
TEST(LossScaling, NonFiniteLossSkipsTheStepWithoutAScaler) {
  std::shared_ptr<comm::MpiCommunicator> world = comm::init_distributed().world;
  comm::ParallelState state(world, {.tp = 1, .pp = 1, .dp = world->size()});
  ParallelConfig parallel;
  parallel.ddp.use_distributed_optimizer = world->size() > 1;
  ParallelModel model(gpt2(), Device::cpu(), 7, state, parallel);
  Trainer trainer(model, trainer_config());
  model.chunk(0).parameter("model.norm.weight").value.set_item(3, std::nan(""));
  const std::vector<float> before = all_params(model);
  const tp_testing::Batch b = global_batch(gpt2().vocab_size, 0);
  const int64_t rows = kGlobalRows / world->size(), first = state.dp_rank() * rows;
  const StepStats stats = trainer.train_step(b.ids.narrow(first, rows).clone(),
                                             b.targets.narrow(first, rows).clone(), 1);
  EXPECT_TRUE(stats.skipped);
  EXPECT_TRUE(std::isnan(stats.loss));
  EXPECT_EQ(trainer.optimizer().step(), 0);
  EXPECT_EQ(trainer.skipped_iterations(), 1);
  EXPECT_EQ(trainer.iteration(), 1);
  EXPECT_EQ(trainer.update_samples(), 0);
  const std::vector<float> after = all_params(model);
  ASSERT_EQ(after.size(), before.size());
  EXPECT_EQ(0, std::memcmp(after.data(), before.data(), after.size() * sizeof(float)))
      << "a skipped step changed the parameters";
  world->barrier()->wait();
}

}  // namespace
