// Gradient buckets (make_buckets) under expert parallelism: with split_experts no bucket mixes
// experts' parameters with the others and expert buckets are marked; without it the buckets are
// exactly those of the rule before expert parallelism (non-EP runs must not change).

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "braid/core/error.h"
#include "braid/engine/grad_buffer.h"
#include "braid/engine/parallel_model.h"
#include "braid/model/parameters.h"

namespace braid::engine {
namespace {

using model::ParamLayout;
using model::TransformerConfig;

int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }
int64_t round_down(int64_t n, int64_t multiple) { return n / multiple * multiple; }

ElementRange elements_of(const ParamLayout& layout, size_t i) {
  return {layout.offsets[i], layout.offsets[i] + layout.shards[i].shape.numel()};
}

// The rule as it was before expert parallelism, written out again as the oracle.
std::vector<Bucket> pre_expert_rule(const ParamLayout& layout, int dp, int64_t bucket_size,
                                    bool bucketed, bool separate_embedding) {
  const size_t n = layout.specs.size();
  int64_t floor = separate_embedding ? round_up(elements_of(layout, 0).end, dp) : 0;
  const int64_t end = std::max(round_up(layout.num_elements, dp), floor);
  std::vector<Bucket> buckets;
  int64_t bucket_end = end;
  for (size_t i = n; i-- > 0;) {
    const int64_t start = std::max(round_down(layout.offsets[i], dp), floor);
    const bool last = i == 0 || start == floor;
    if ((bucketed && bucket_end - start >= bucket_size && start < bucket_end) ||
        (last && start < bucket_end)) {
      const int64_t begin = last ? floor : start;
      buckets.push_back(Bucket{{begin, bucket_end}, {}, false});
      bucket_end = begin;
      if (begin == floor) break;
    }
  }
  if (separate_embedding) buckets.push_back(Bucket{{0, floor}, {}, false});
  for (Bucket& b : buckets)
    for (size_t i = 0; i < n; ++i) {
      const ElementRange e = elements_of(layout, i);
      if (e.size() > 0 && e.begin < b.range.end && b.range.begin < e.end) b.params.push_back(i);
    }
  return buckets;
}

// 4 experts over 3 layers, the first dense, with a gated shared expert (not an expert's
// parameter) and biases, so dense and expert runs alternate in the flat buffer.
TransformerConfig moe() {
  TransformerConfig c = TransformerConfig::preset("gpt2-tiny");
  c.num_layers = 3;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.num_query_groups = 4;
  c.ffn_hidden_size = 40;
  c.vocab_size = 100;
  c.max_position_embeddings = 16;
  c.num_experts = 4;
  c.moe_router_topk = 2;
  c.moe_ffn_hidden_size = 24;
  c.moe_shared_expert_intermediate_size = 16;
  c.moe_shared_expert_gate = true;
  c.moe_layers = {0, 1, 1};
  return c;
}

TransformerConfig dense_model() {
  TransformerConfig c = moe();
  c.num_experts = 0;
  c.moe_layers.clear();
  c.moe_shared_expert_intermediate_size = 0;
  c.moe_shared_expert_gate = false;
  return c;
}

// Layouts of the whole model and of EP rank 1 of 2 (experts 2 and 3), at tp 1 and 2.
// The MoE model's layouts at tp 1 and 2, all experts and the second EP rank's of 2, with each
// layer's run of experts aligned to `expert_alignment` elements.
std::vector<ParamLayout> moe_layouts(int64_t expert_alignment = 1, bool biases = true) {
  TransformerConfig c = moe();
  c.add_bias_linear = biases;
  std::vector<ParamLayout> layouts;
  for (int tp : {1, 2}) {
    model::ModelChunk chunk;
    chunk.expert_alignment = expert_alignment;
    layouts.push_back(model::parameter_layout(c, 0, tp, chunk));
    chunk.first_expert = 2;
    chunk.end_expert = 4;
    layouts.push_back(model::parameter_layout(c, tp - 1, tp, chunk));
  }
  return layouts;
}

void expect_same(const std::vector<Bucket>& got, const std::vector<Bucket>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t b = 0; b < got.size(); ++b) {
    EXPECT_EQ(got[b].range.begin, want[b].range.begin) << "bucket " << b;
    EXPECT_EQ(got[b].range.end, want[b].range.end) << "bucket " << b;
    EXPECT_EQ(got[b].params, want[b].params) << "bucket " << b;
    EXPECT_EQ(got[b].expert, want[b].expert) << "bucket " << b;
  }
}

TEST(GradBuckets, WithoutSplitExpertsTheBucketsAreThePreExpertRules) {
  std::vector<ParamLayout> layouts = moe_layouts();
  const TransformerConfig dense = dense_model();
  layouts.push_back(model::parameter_layout(dense));
  for (const ParamLayout& layout : layouts)
    for (int dp : {1, 2, 3, 4, 6, 8})
      for (int64_t size : {int64_t(300), int64_t(2000), int64_t(1) << 40})
        for (bool bucketed : {false, true})
          for (bool separate : {false, true}) {
            SCOPED_TRACE("dp " + std::to_string(dp) + " size " + std::to_string(size) +
                         (bucketed ? " bucketed" : "") + (separate ? " separate" : ""));
            const std::vector<Bucket> got = make_buckets(layout, dp, size, bucketed, separate);
            expect_same(got, pre_expert_rule(layout, dp, size, bucketed, separate));
            if (bucketed && size == 300) {
              EXPECT_GT(got.size(), 10u);
            }
          }
}

TEST(GradBuckets, SplitExpertsChangesNothingWithoutExperts) {
  const TransformerConfig dense = dense_model();
  const ParamLayout layout = model::parameter_layout(dense);
  for (int dp : {1, 3, 8})
    for (bool bucketed : {false, true})
      expect_same(make_buckets(layout, dp, 500, bucketed, false, true),
                  make_buckets(layout, dp, 500, bucketed, false, false));
}

// Every bucket holds one kind, marked; the buckets still tile the buffer in pieces of dp; a
// boundary sits wherever the kind changes. ParallelModel aligns each layer's run of experts to
// dp, which always gives that boundary.
TEST(GradBuckets, SplitExpertsNeverMixesKinds) {
  for (int dp = 1; dp <= 8; ++dp)
    for (const ParamLayout& layout : moe_layouts(dp))
      for (int64_t size : {int64_t(300), int64_t(1) << 40})
        for (bool bucketed : {false, true}) {
          SCOPED_TRACE("tp " + std::to_string(layout.tp_size) + " experts from " +
                       std::to_string(layout.chunk.first_expert) + " dp " + std::to_string(dp) +
                       " size " + std::to_string(size) + (bucketed ? " bucketed" : ""));
          const std::vector<Bucket> buckets = make_buckets(layout, dp, size, bucketed, false, true);
          int expert_buckets = 0;
          int64_t end = 0;
          for (auto it = buckets.rbegin(); it != buckets.rend(); ++it) {  // ascending
            EXPECT_EQ(it->range.begin, end);
            EXPECT_EQ(it->range.size() % dp, 0);
            end = it->range.end;
            expert_buckets += it->expert;
            for (size_t p : it->params)
              EXPECT_EQ(layout.specs[p].expert >= 0, it->expert) << layout.specs[p].name;
          }
          EXPECT_GE(end, layout.num_elements);
          // Two expert layers, each one run of experts: at least two expert buckets, and a
          // dense one before, between and after them.
          EXPECT_GE(expert_buckets, 2);
          EXPECT_GE(int(buckets.size()) - expert_buckets, 3);
          // Every parameter is in some bucket.
          std::vector<int> seen(layout.specs.size(), 0);
          for (const Bucket& b : buckets)
            for (size_t p : b.params) ++seen[p];
          for (size_t p = 0; p < seen.size(); ++p) EXPECT_GE(seen[p], 1) << layout.specs[p].name;
        }
}

// Without that alignment a dp that does not divide kParamGroupAlignment can find no boundary
// between the kinds: a ConfigError naming it, never a mixed bucket.
TEST(GradBuckets, UnalignedExpertsThatShareABucketAreRefused) {
  // Without biases the router's weight (128 elements: no padding after it) ends where the
  // experts start, so a bucket boundary rounded down to a multiple of dp takes some of it.
  int refused = 0;
  for (int dp : {3, 5, 6, 7})
    for (const ParamLayout& layout : moe_layouts(1, false)) {
      try {
        make_buckets(layout, dp, int64_t(1) << 40, false, false, true);
      } catch (const ConfigError& e) {
        EXPECT_NE(std::string(e.what()).find("share a gradient bucket"), std::string::npos);
        ++refused;
      }
    }
  EXPECT_GT(refused, 0);
}

// The expert alignment costs padding only where the run of experts does not start or end on a
// multiple of dp already, and moves nothing else: the layout of experts is what it was.
TEST(GradBuckets, ExpertAlignmentPadsOnlyAroundExperts) {
  for (int tp : {1, 2}) {
    const ParamLayout plain = moe_layouts()[size_t(2 * (tp - 1))];
    const ParamLayout aligned = moe_layouts(6)[size_t(2 * (tp - 1))];
    ASSERT_EQ(plain.specs.size(), aligned.specs.size());
    EXPECT_GE(aligned.num_elements, plain.num_elements);
    EXPECT_LE(aligned.num_elements,
              plain.num_elements + 4 * std::lcm(int64_t(6), model::kParamGroupAlignment));
    for (size_t i = 0; i + 1 < aligned.specs.size(); ++i) {
      const bool enters = aligned.specs[i].expert < 0 && aligned.specs[i + 1].expert >= 0;
      const bool leaves = aligned.specs[i].expert >= 0 && aligned.specs[i + 1].expert < 0;
      if (enters || leaves) {
        EXPECT_EQ(aligned.offsets[i + 1] % 6, 0) << aligned.specs[i + 1].name;
      }
    }
  }
}

// ParallelConfig::validate refuses, on every rank alike and before any communication, experts
// that do not split over the EP ranks; layouts whose dp does not divide the alignment are fine.
TEST(GradBuckets, ValidateChecksTheExpertSplit) {
  const TransformerConfig c = moe();
  ParallelConfig parallel;
  parallel.validate(c, comm::RankGrid(8, {.dp = 8, .ep = 2}));
  parallel.validate(c, comm::RankGrid(8, {.tp = 2, .pp = 1, .dp = 2, .cp = 2, .ep = 4}));
  parallel.validate(c, comm::RankGrid(12, {.tp = 2, .dp = 6, .ep = 2}));
  parallel.validate(c, comm::RankGrid(12, {.tp = 2, .dp = 3, .cp = 2, .ep = 2}));
  EXPECT_THROW(parallel.validate(c, comm::RankGrid(8, {.dp = 8, .ep = 8})), ConfigError);
}

}  // namespace
}  // namespace braid::engine
