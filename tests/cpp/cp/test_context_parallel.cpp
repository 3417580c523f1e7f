// Context parallelism as real MPI jobs: with cp = the job's size (and tp 2 × cp = size / 2,
// with sequence parallelism), GPT-2 (learned positions) and Llama-style models (RoPE, GQA,
// q/k norms, partial rotary, sliding windows) under every recompute policy give the
// single-rank model's loss and every gradient (summed over the CP group, gathered over TP)
// within f32 tolerance; the CP group carries exactly the collectives the all-gather scheme
// implies; bad input fails alike on every rank.

#include <gtest/gtest.h>

#include <cmath>

#include "../tp/tp_test_util.h"
#include "braid/comm/launch.h"
#include "braid/comm/parallel_state.h"
#include "braid/core/allocator.h"

using namespace braid;
using namespace braid::model;
using namespace braid::tp_testing;

namespace {

TransformerConfig gpt2() {
  TransformerConfig c = TransformerConfig::preset("gpt2-tiny");  // learned positions, layernorm
  c.hidden_size = 32;
  c.ffn_hidden_size = 64;
  c.vocab_size = 200;
  c.make_vocab_size_divisible_by = 64;
  c.max_position_embeddings = 32;
  c.init_std = 0.1f;
  return c;
}

TransformerConfig llama() {
  TransformerConfig c = TransformerConfig::preset("llama-tiny");  // 4 heads, 2 kv heads, rope
  c.hidden_size = 32;
  c.ffn_hidden_size = 48;
  c.vocab_size = 120;
  c.make_vocab_size_divisible_by = 64;
  c.max_position_embeddings = 32;
  c.init_std = 0.1f;
  return c;
}

TransformerConfig qk_norm_selective() {
  TransformerConfig c = llama();
  c.qk_layernorm = true;  // selective recompute rotates the normed q and k again
  c.recompute = Recompute::selective;
  return c;
}

TransformerConfig partial_rotary_full() {
  TransformerConfig c = llama();
  c.kv_channels = 16;
  c.rotary_percent = 0.5;
  c.recompute = Recompute::full;
  return c;
}

TransformerConfig sliding_window() {
  TransformerConfig c = llama();
  c.num_layers = 3;
  c.window_size = 5;  // spans 2 to 4 chunks of the 16-token sequences
  c.window_layers = {1, 0, 1};
  c.recompute = Recompute::full;  // the backward reruns the windowed attention
  return c;
}

// Multi-latent attention: the key's shared RoPE part turned at each chunk's positions, the
// padded value heads gathered with the keys.
TransformerConfig latent_selective() {
  TransformerConfig c = llama();
  c.num_query_groups = 0;
  c.multi_latent_attention = true;
  c.q_lora_rank = 16;
  c.kv_lora_rank = 12;
  c.qk_head_dim = 6;
  c.qk_pos_emb_head_dim = 4;
  c.v_head_dim = 8;
  c.qk_layernorm = true;
  c.recompute = Recompute::selective;
  return c;
}

// Selective with the up projections recomputed (--recompute-modules mla_up_proj), without a
// query latent: q_proj reruns on the gathered input (under SP an all-gather in the backward).
TransformerConfig latent_up_selective() {
  TransformerConfig c = latent_selective();
  c.q_lora_rank = 0;
  c.recompute_mla_up_proj = true;
  return c;
}

// Two multi-token prediction depths, the second's layer windowed like the last (a window that
// spans chunks); each depth reads ids and targets shifted across chunk and rank boundaries.
TransformerConfig mtp_window_full() {
  TransformerConfig c = sliding_window();
  c.mtp_num_layers = 2;
  c.mtp_loss_scaling_factor = 0.5f;
  return c;
}

// GPT-OSS's attention: learnable sinks joined once to softmaxes merged over the chunks, a window
// across chunks, biases; selective recomputation keeps the sink softmax's output and lse.
TransformerConfig sinks_window_selective() {
  TransformerConfig c = sliding_window();
  c.softmax_type = SoftmaxType::learnable;
  c.add_bias_linear = true;
  c.recompute = Recompute::selective;
  return c;
}

// Hidden and attention dropout: each chunk draws the whole sequences' hidden masks at its
// tokens (a sequence-parallel shard at its chunks' part of them) and their
// attention mask at its queries and keys (a window across chunks, sinks; selective
// recomputation keeps the dropped output, the backward draws the mask again), and each TP rank
// its heads'.
TransformerConfig dropout_sinks() {
  TransformerConfig c = sinks_window_selective();
  c.hidden_dropout = 0.2f;
  c.attention_dropout = 0.3f;
  return c;
}

// ... under full recomputation, whose backward reruns the dropped block first; MLA.
TransformerConfig dropout_latent_full() {
  TransformerConfig c = latent_selective();
  c.recompute = Recompute::full;
  c.hidden_dropout = 0.2f;
  c.attention_dropout = 0.3f;
  return c;
}

// ... in the MTP depths too: their layers' hidden and attention masks, and their embedding
// outputs'.
TransformerConfig dropout_mtp_window_full() {
  TransformerConfig c = mtp_window_full();
  c.hidden_dropout = 0.2f;
  c.attention_dropout = 0.3f;
  return c;
}

TransformerConfig gpt2_selective() {
  TransformerConfig c = gpt2();
  c.recompute = Recompute::selective;
  return c;
}

struct Case {
  const char* name;
  TransformerConfig (*config)();
  int tp;
  bool sequence_parallel;
};

const Case kCases[] = {{"gpt2", gpt2, 1, false},
                       {"gpt2_selective", gpt2_selective, 1, false},
                       {"llama_gqa", llama, 1, false},
                       {"qk_norm_selective", qk_norm_selective, 1, false},
                       {"partial_rotary_full", partial_rotary_full, 1, false},
                       {"sliding_window", sliding_window, 1, false},
                       {"tp2_sliding_window_sp", sliding_window, 2, true},
                       {"tp2_llama_sp", llama, 2, true},
                       {"tp2_gpt2", gpt2, 2, false},
                       {"tp2_qk_norm_selective_sp", qk_norm_selective, 2, true},
                       {"latent_selective", latent_selective, 1, false},
                       {"tp2_latent_selective_sp", latent_selective, 2, true},
                       {"latent_up_selective", latent_up_selective, 1, false},
                       {"tp2_latent_up_selective_sp", latent_up_selective, 2, true},
                       {"mtp_window_full", mtp_window_full, 1, false},
                       {"tp2_mtp_window_full_sp", mtp_window_full, 2, true},
                       {"sinks_window_selective", sinks_window_selective, 1, false},
                       {"tp2_sinks_window_selective_sp", sinks_window_selective, 2, true},
                       {"dropout_sinks", dropout_sinks, 1, false},
                       {"tp2_dropout_sinks_sp", dropout_sinks, 2, true},
                       {"dropout_latent_full", dropout_latent_full, 1, false},
                       {"tp2_dropout_latent_full", dropout_latent_full, 2, false},
                       {"dropout_mtp_window_full", dropout_mtp_window_full, 1, false},
                       {"tp2_dropout_mtp_window_full_sp", dropout_mtp_window_full, 2, true}};

class ContextParallelEqualsOneRank : public ::testing::TestWithParam<Case> {};

TEST_P(ContextParallelEqualsOneRank, LossAndGradients) {
  const Case& c = GetParam();
  std::shared_ptr<comm::MpiCommunicator> world = comm::init_distributed().world;
  if (world->size() % c.tp != 0 || world->size() / c.tp < 2)
    GTEST_SKIP() << "needs tp " << c.tp << " × cp >= 2 ranks";
  comm::ParallelState state(world, {.tp = c.tp, .cp = world->size() / c.tp});
  const TransformerConfig config = c.config();
  const uint64_t seed = 4321;
  GPTModel reference(config, Device::cpu(), seed);
  GPTModel sharded(config, Device::cpu(), seed, TensorParallel{&state.tp(), c.sequence_parallel},
                   {}, 0, ContextParallel{&state.cp()});
  const auto global = perturbed(reference);
  set_from_global(reference, global);
  set_from_global(sharded, global);

  // Two microbatches of 2 sequences of 16: 2·cp chunks of 16 / (2 cp) positions.
  double loss_ref = 0, loss_cp = 0;
  for (int m = 0; m < 2; ++m) {
    Batch b = batch(2, 16, config.vocab_size, 20 + m);
    b.targets.data_ptr<int32_t>()[3] = -1;  // an ignored target inside a chunk
    // What a forward keeps for its backward (all of it per token: activations, statistics,
    // ids, logits) is exactly the whole model's divided by cp (compared without TP, whose own
    // split tests/cpp/tp and tp_memory_bench check).
    const int64_t before_ref = memory_stats(Device::cpu()).current_bytes;
    loss_ref += reference.forward(b.ids, b.targets, m);
    const int64_t kept_ref = memory_stats(Device::cpu()).current_bytes - before_ref;
    const int64_t before_cp = memory_stats(Device::cpu()).current_bytes;
    loss_cp += sharded.forward(b.ids, b.targets, m);
    const int64_t kept_cp = memory_stats(Device::cpu()).current_bytes - before_cp;
    if (c.tp == 1) {
      EXPECT_EQ(kept_cp * state.cp().size(), kept_ref) << "bytes kept by forward";
    }
    reference.backward(m, 0.5f);
    sharded.backward(m, 0.5f);
  }
  reference.finalize_grads();
  sharded.finalize_grads();
  state.cp().all_reduce(const_cast<Tensor&>(sharded.flat_grads()))->wait();
  EXPECT_NEAR(loss_cp, loss_ref, 1e-5 * std::abs(loss_ref));
  const auto mtp_ref = reference.take_mtp_losses(), mtp_cp = sharded.take_mtp_losses();
  ASSERT_EQ(mtp_cp.size(), size_t(config.mtp_num_layers));
  ASSERT_EQ(mtp_ref.size(), mtp_cp.size());
  for (size_t k = 0; k < mtp_ref.size(); ++k) {
    EXPECT_EQ(mtp_cp[k].count, mtp_ref[k].count) << "MTP depth " << k + 1;
    EXPECT_NEAR(mtp_cp[k].sum, mtp_ref[k].sum, 1e-5 * std::abs(mtp_ref[k].sum))
        << "MTP depth " << k + 1;
  }
  const auto& specs = reference.layout().specs;
  for (size_t i = 0; i < specs.size(); ++i) {
    const int64_t n = specs[i].shape.numel();
    const float* p = reference.flat_grads().data_ptr<float>() + reference.layout().offsets[i];
    const std::vector<float> want(p, p + n);
    const auto got = gather_global(sharded, i, sharded.flat_grads(), &state.tp());
    EXPECT_LE(excess(got, want, 2e-6, 1e-4), 0.0) << specs[i].name << " gradient";
  }
}

INSTANTIATE_TEST_SUITE_P(Models, ContextParallelEqualsOneRank, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

// The CP group's collectives in one forward and backward: per layer, forward all-gathers the
// keys and values (cp × the local k bytes each, as OpInfo counts the gathered buffer); backward
// gathers them again and reduce-scatters their gradients (from cp × the local bytes); the loss
// is summed once.
TEST(ContextParallelCommunication, MatchesTheAllGatherScheme) {
  std::shared_ptr<comm::MpiCommunicator> world = comm::init_distributed().world;
  const int cp = world->size();
  auto counted = std::make_shared<CountingCommunicator>(world);
  TransformerConfig config = llama();
  config.num_layers = 3;
  GPTModel model(config, Device::cpu(), 7, {}, {}, 0, ContextParallel{counted.get()});
  const int64_t b = 2, s = 16, kv = config.kv_heads() * config.head_dim();
  const Batch data = batch(b, s, config.vocab_size, 3);
  counted->calls.clear();
  model.forward(data.ids, data.targets);
  const std::vector<CountingCommunicator::Call> forward = counted->calls;
  counted->calls.clear();
  model.backward();
  const std::vector<CountingCommunicator::Call> backward = counted->calls;

  using Call = CountingCommunicator::Call;
  const size_t local_kv = size_t(b * s / cp * kv) * 4;  // f32 bytes of this rank's k
  const Call ag{"all_gather", size_t(cp) * local_kv}, rs{"reduce_scatter", size_t(cp) * local_kv};
  std::vector<Call> want_fwd, want_bwd;
  for (int l = 0; l < config.num_layers; ++l) {
    want_fwd.insert(want_fwd.end(), {ag, ag});
    want_bwd.insert(want_bwd.end(), {ag, ag, rs, rs});
  }
  want_fwd.push_back({"all_reduce", 4});  // the loss
  EXPECT_EQ(forward, want_fwd);
  EXPECT_EQ(backward, want_bwd);
}

// Megatron's (and Transformer Engine's) load balance: of 2·cp chunks, rank r holds r and
// 2cp − 1 − r, chunk-major over the batch; gather_sequence puts every rank's chunks back in
// position order, and scatter_sequence sums each position's values to the rank holding it.
TEST(ContextParallelLayout, RanksHoldBalancedChunksAndGatherThemBack) {
  std::shared_ptr<comm::MpiCommunicator> world = comm::init_distributed().world;
  const int cp = world->size(), r = world->rank();
  const ContextParallel group{world.get()};
  const int64_t b = 2, s = 4 * cp, len = s / (2 * cp);
  Tensor positions = Tensor::empty({b, s}, DType::i32);
  for (int64_t i = 0; i < b * s; ++i) positions.data_ptr<int32_t>()[i] = int32_t(i);
  const Tensor local = split_sequence(group, positions);
  ASSERT_EQ(local.shape(), (Shape{2 * b, len}));
  for (int64_t row = 0; row < 2 * b; ++row) {
    const int64_t chunk = row < b ? r : 2 * cp - 1 - r, seq = row % b;
    for (int64_t i = 0; i < len; ++i) {
      EXPECT_EQ(local.data_ptr<int32_t>()[row * len + i], seq * s + chunk * len + i);
      EXPECT_EQ(group.position(row * len + i, b, len), chunk * len + i);
    }
  }
  // [2B, L, 1, 1] f32 of the positions -> the whole [B, S, 1, 1], in order.
  Tensor mine = Tensor::empty({2 * b, len, 1, 1}, DType::f32);
  for (int64_t i = 0; i < mine.numel(); ++i)
    mine.data_ptr<float>()[i] = float(local.data_ptr<int32_t>()[i]);
  const Tensor whole = gather_sequence(group, mine);
  ASSERT_EQ(whole.shape(), (Shape{b, s, 1, 1}));
  for (int64_t i = 0; i < b * s; ++i) EXPECT_EQ(whole.data_ptr<float>()[i], float(i));
  const Tensor summed = scatter_sequence(group, whole);  // every rank contributed the same
  for (int64_t i = 0; i < summed.numel(); ++i)
    EXPECT_EQ(summed.data_ptr<float>()[i], float(cp) * mine.data_ptr<float>()[i]);
}

TEST(ContextParallelInput, BadInputFailsAlikeOnEveryRank) {
  std::shared_ptr<comm::MpiCommunicator> world = comm::init_distributed().world;
  const int cp = world->size();
  GPTModel model(llama(), Device::cpu(), 1, {}, {}, 0, ContextParallel{world.get()});
  auto message = [&](auto&& f) -> std::string {
    try {
      f();
    } catch (const ConfigError& e) {
      return e.message();
    }
    return "";
  };
  const Batch odd = batch(1, 2 * cp + 2, llama().vocab_size, 1);  // not 2·cp chunks
  EXPECT_NE(message([&] { model.forward(odd.ids, odd.targets); })
                .find("not divisible by 2 × --context-parallel-size (" + std::to_string(cp) +
                      ") = " + std::to_string(2 * cp)),
            std::string::npos);
  const Batch even = batch(1, 4 * cp, llama().vocab_size, 1);
  EXPECT_NE(message([&] { model.logits(even.ids); }).find("context parallelism"),
            std::string::npos);
  world->barrier()->wait();  // every rank got here: nothing was left half-communicated
}

}  // namespace
