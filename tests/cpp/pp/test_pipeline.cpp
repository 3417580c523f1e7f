// Pipeline parallelism as real MPI jobs: pp ∈ {2, 4} (and pp = 2 with tp = 2 on 4 ranks) ×
// GPipe, 1F1B and interleaved 1F1B (v = 2) give the loss and every gradient of the
// single-rank model within f32 tolerance, tied embeddings included (summed over the
// embedding group), dropout included (every chunk draws the masks of the layers it holds).

#include <gtest/gtest.h>

#include <cmath>

#include "braid/comm/launch.h"
#include "braid/comm/parallel_state.h"
#include "braid/engine/pipeline.h"
#include "tp/tp_test_util.h"

using namespace braid;
using namespace braid::model;
using namespace braid::tp_testing;

namespace {

TransformerConfig gpt2() {  // tied embeddings, learned positions, dropout
  TransformerConfig c = TransformerConfig::preset("gpt2-tiny");
  c.num_layers = 8;
  c.hidden_size = 32;
  c.ffn_hidden_size = 64;
  c.vocab_size = 96;
  c.make_vocab_size_divisible_by = 32;
  c.max_position_embeddings = 16;
  c.hidden_dropout = 0.1f;
  c.attention_dropout = 0.1f;
  c.init_std = 0.1f;
  return c;
}

TransformerConfig llama() {  // untied, GQA
  TransformerConfig c = TransformerConfig::preset("llama-tiny");
  c.num_layers = 8;
  c.hidden_size = 32;
  c.ffn_hidden_size = 48;
  c.vocab_size = 96;
  c.make_vocab_size_divisible_by = 32;
  c.max_position_embeddings = 16;
  c.init_std = 0.1f;
  return c;
}

struct Layout {
  int tp, pp, v;
  const char* schedule;
};

engine::Schedule make(const Layout& l, int m) {
  const std::string s = l.schedule;
  if (s == "gpipe") return engine::make_gpipe(l.pp, m);
  if (s == "1f1b") return engine::make_1f1b(l.pp, m);
  return engine::make_interleaved_1f1b(l.pp, m, l.v);
}

void check_pipeline(const TransformerConfig& config, const Layout& layout) {
  SCOPED_TRACE(testing::Message() << "tp " << layout.tp << " pp " << layout.pp << " v " << layout.v
                                  << " " << layout.schedule);
  std::shared_ptr<comm::MpiCommunicator> world = comm::init_distributed().world;
  comm::ParallelState state(world, {.tp = layout.tp, .pp = layout.pp});
  const int m = 4, stage = state.pp_rank();
  const uint64_t seed = 99;

  // The reference: the whole model on every rank, same weights, same microbatches.
  GPTModel reference(config, Device::cpu(), seed);
  const auto global = perturbed(reference);
  set_from_global(reference, global);
  std::vector<Tensor> ids, targets;
  for (int i = 0; i < m; ++i) {
    const Batch b = batch(1, 8, config.vocab_size, 40 + i);
    ids.push_back(b.ids);
    targets.push_back(b.targets);
  }
  double loss_ref = 0;
  for (int i = 0; i < m; ++i) {
    loss_ref += reference.forward(ids[size_t(i)], targets[size_t(i)], i);
    reference.backward(i, 1.0f / m);
  }
  loss_ref /= m;

  // This rank's chunks.
  const auto layers = engine::stage_layers(int(config.num_layers), layout.pp, layout.v);
  std::vector<std::unique_ptr<GPTModel>> chunks;
  std::vector<GPTModel*> pointers;
  const engine::Schedule schedule = make(layout, m);
  for (int c = 0; c < layout.v; ++c) {
    const int model_chunk = schedule.model_chunk(stage, c);
    const engine::LayerRange range = layers[size_t(stage)][size_t(c)];
    ModelChunk held{range.begin, range.end, model_chunk == 0,
                    model_chunk == schedule.num_model_chunks() - 1};
    chunks.push_back(std::make_unique<GPTModel>(config, Device::cpu(), seed,
                                                TensorParallel{&state.tp(), false}, held));
    // The chunk's parameters from the same global values.
    std::vector<std::vector<float>> mine;
    for (const ParamSpec& spec : chunks.back()->layout().specs) {
      const auto& specs = reference.layout().specs;
      size_t i = 0;
      while (specs[i].name != spec.name) ++i;
      mine.push_back(global[i]);
    }
    set_from_global(*chunks.back(), mine);
    chunks.back()->set_embedding_group(state.embedding());
    pointers.push_back(chunks.back().get());
  }
  engine::PipelineExecutor executor(schedule, pointers, state.pp());
  const float loss = executor.run(ids, targets, std::vector<float>(size_t(m), 1.0f / m));
  for (auto& chunk : chunks) chunk->finalize_grads();

  if (state.is_last_stage()) {
    EXPECT_NEAR(loss, loss_ref, 1e-5 * std::abs(loss_ref));
  } else {
    EXPECT_EQ(loss, 0.0f);
  }
  for (auto& chunk : chunks) {
    const auto& specs = chunk->layout().specs;
    for (size_t i = 0; i < specs.size(); ++i) {
      size_t r = 0;
      while (reference.layout().specs[r].name != specs[i].name) ++r;
      const float* want = reference.flat_grads().data_ptr<float>() + reference.layout().offsets[r];
      const auto got = gather_global(*chunk, i, chunk->flat_grads(), &state.tp());
      EXPECT_LE(excess(got, std::vector<float>(want, want + got.size()), 2e-6, 1e-4), 0.0)
          << specs[i].name << " gradient on stage " << stage;
    }
  }
  world->barrier()->wait();
}

std::vector<Layout> layouts(int ranks) {
  std::vector<Layout> all;
  for (const char* s : {"gpipe", "1f1b", "interleaved"}) {
    all.push_back({1, ranks, std::string(s) == "interleaved" ? 2 : 1, s});
    if (ranks == 4) all.push_back({2, 2, std::string(s) == "interleaved" ? 2 : 1, s});
  }
  return all;
}

TEST(PipelineEqualsOneRank, Gpt2TiedEmbeddingsWithDropout) {
  const int ranks = comm::init_distributed().world->size();
  if (ranks == 1) GTEST_SKIP() << "needs at least 2 ranks";
  for (const Layout& l : layouts(ranks)) check_pipeline(gpt2(), l);
}

TEST(PipelineEqualsOneRank, LlamaUntiedGqa) {
  const int ranks = comm::init_distributed().world->size();
  if (ranks == 1) GTEST_SKIP() << "needs at least 2 ranks";
  for (const Layout& l : layouts(ranks)) check_pipeline(llama(), l);
}

TEST(PipelineExecutor, ChunksThatDoNotMatchTheScheduleAreAnError) {
  std::shared_ptr<comm::MpiCommunicator> world = comm::init_distributed().world;
  if (world->size() == 1) GTEST_SKIP() << "needs at least 2 ranks";
  comm::ParallelState state(world, {.pp = world->size()});
  GPTModel whole(gpt2(), Device::cpu(), 1);  // holds embedding and head: not a middle stage
  const engine::Schedule schedule = engine::make_1f1b(world->size(), 4);
  EXPECT_THROW(engine::PipelineExecutor(schedule, {&whole}, state.pp()), Error);
  EXPECT_THROW(engine::PipelineExecutor(schedule, {&whole, &whole}, state.pp()), ConfigError);
  world->barrier()->wait();
}

}  // namespace
