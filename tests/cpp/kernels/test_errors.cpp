// Bad arguments: every op raises braid::Error naming itself (shapes, dtypes, devices, undefined
// tensors). Zero-sized inputs: every op accepts them and changes nothing it should not.
#include <limits>

#include "kernel_test_util.h"

namespace braid::testing {
namespace {

class Errors : public KernelTest {};

TEST_P(Errors, ShapeMismatchesNameTheOp) {
  Tensor a = empty({4, 8}), b = empty({7, 16}), out = empty({4, 16});
  EXPECT_TRUE(raises([&] { ops::matmul(out, a, b, {}, false, false); },
                     "matmul: a [4, 8] and b [7, 16] disagree on K (8 vs 7)"));
  EXPECT_TRUE(raises(
      [&] {
        ops::matmul(empty({4, 15}), a, empty({8, 16}), {}, false, false);
      },
      "matmul: out"));
  EXPECT_TRUE(raises(
      [&] {
        ops::matmul(out, a, empty({8, 16}), empty({15}), false, false);
      },
      "matmul: bias"));
  EXPECT_TRUE(raises([&] { ops::bias_backward(zeros_f32({15}), out); }, "bias_backward"));
  EXPECT_TRUE(raises([&] { ops::add(out, out, empty({4, 15})); }, "add"));
  EXPECT_TRUE(raises([&] { ops::scale(empty({4, 15}), out, 2.0f); }, "scale"));
  EXPECT_TRUE(raises([&] { ops::cast(empty_f32({3}), empty({4})); }, "cast"));
  EXPECT_TRUE(raises([&] { ops::gelu_forward(empty({3}), empty({4})); }, "gelu_forward"));
  EXPECT_TRUE(
      raises([&] { ops::gelu_backward(empty({4}), empty({3}), empty({4})); }, "gelu_backward"));
  EXPECT_TRUE(raises([&] { ops::glu_forward(empty({2, 4}), empty({2, 7})); }, "glu_forward"));
  EXPECT_TRUE(raises([&] { ops::glu_forward(empty({2, 3}), empty({2, 8})); }, "glu_forward"));
  EXPECT_TRUE(raises(
      [&] {
        ops::glu_backward(empty({2, 8}), empty({2, 5}), empty({2, 8}));
      },
      "glu_backward"));
  EXPECT_TRUE(raises([&] { ops::dropout_forward(empty({4}), empty({4}), 1.5f, 1, 1); },
                     "dropout_forward: p = 1.5"));
  EXPECT_TRUE(raises([&] { ops::dropout_backward(empty({4}), empty({5}), 0.1f, 1, 1); },
                     "dropout_backward"));
  Tensor x = empty({6, 10}), stat = empty_f32({6});
  EXPECT_TRUE(raises(
      [&] {
        ops::layernorm_forward(empty({6, 10}), stat, stat, x, empty({9}), empty({10}), 1e-5f);
      },
      "layernorm_forward: weight"));
  EXPECT_TRUE(raises(
      [&] {
        ops::layernorm_forward(empty({6, 10}), empty_f32({5}), stat, x, empty({10}), empty({10}),
                               1e-5f);
      },
      "layernorm_forward: mean"));
  EXPECT_TRUE(raises(
      [&] {
        ops::layernorm_backward(empty({6, 10}), zeros_f32({10}), zeros_f32({9}), x, x, empty({10}),
                                stat, stat);
      },
      "layernorm_backward: dbias"));
  EXPECT_TRUE(raises(
      [&] {
        ops::rmsnorm_forward(empty({6, 11}), stat, x, empty({10}), 1e-6f);
      },
      "rmsnorm_forward"));
  EXPECT_TRUE(raises(
      [&] {
        ops::rmsnorm_backward(empty({6, 10}), zeros_f32({10}), x, x, empty({10}), empty_f32({7}));
      },
      "rmsnorm_backward: rstd"));
  EXPECT_TRUE(raises(
      [&] {
        ops::rope_forward(empty({2, 3, 4, 7}), empty({2, 3, 4, 7}), {1e4f});
      },
      "rope_forward"));
  EXPECT_TRUE(raises(
      [&] {
        ops::rope_backward(empty({2, 3, 8}), empty({2, 3, 8}), {1e4f});
      },
      "rope_backward"));
  Tensor ids = Tensor::empty({2, 3}, DType::i32, device());
  EXPECT_TRUE(raises(
      [&] {
        ops::embedding_forward(empty({2, 3, 5}), ids, empty({10, 4}));
      },
      "embedding_forward"));
  EXPECT_TRUE(raises(
      [&] {
        ops::embedding_forward(empty({2, 3, 4}), empty_f32({2, 3}), empty({10, 4}));
      },
      "embedding_forward: ids must be i32"));
  EXPECT_TRUE(raises(
      [&] {
        ops::embedding_backward(zeros_f32({10, 4}), empty({6, 4}), ids);
      },
      "embedding_backward"));
  Tensor q = empty({1, 5, 4, 8}), kv = empty({1, 5, 3, 8}), lse = empty_f32({1, 4, 5});
  EXPECT_TRUE(raises(
      [&] {
        ops::attention_forward(empty({1, 5, 4, 8}), lse, q, kv, kv);
      },
      "attention_forward: q has 4 heads"));
  Tensor k2 = empty({1, 5, 2, 8});
  EXPECT_TRUE(raises(
      [&] {
        ops::attention_forward(empty({1, 5, 4, 8}), empty_f32({1, 5, 4}), q, k2, k2);
      },
      "attention_forward: lse"));
  EXPECT_TRUE(raises(
      [&] {
        ops::attention_forward(empty({1, 5, 4, 8}), lse, q, empty({1, 4, 2, 8}),
                               empty({1, 4, 2, 8}));  // fewer keys than queries
      },
      "attention_forward"));
  EXPECT_TRUE(raises(
      [&] {
        ops::attention_backward(q, empty({1, 5, 2, 4}), k2, q, q, k2, k2, q, lse);
      },
      "attention_backward: dk"));
  Tensor logits = empty({3, 11}), targets = Tensor::empty({3}, DType::i32, device()),
         row = empty_f32({3});
  EXPECT_TRUE(
      raises([&] { ops::cross_entropy_partials(row, row, empty_f32({4}), logits, targets); },
             "cross_entropy_partials: target_logit"));
  EXPECT_TRUE(raises(
      [&] {
        ops::cross_entropy_partials(row, row, row, logits,
                                    Tensor::empty({4}, DType::i32, device()));
      },
      "cross_entropy_partials: targets"));
  EXPECT_TRUE(raises([&] { ops::cross_entropy_loss(empty_f32({2}), row, row, row, targets); },
                     "cross_entropy_loss: loss"));
  EXPECT_TRUE(raises(
      [&] {
        ops::cross_entropy_backward(empty({3, 10}), logits, targets, row, row, row);
      },
      "cross_entropy_backward: dlogits"));
  ops::AdamWGroup g{zeros_f32({5}), zeros_f32({4}), zeros_f32({5}), zeros_f32({5}), 0.0f, {}};
  EXPECT_TRUE(raises([&] { ops::adamw_step(std::span(&g, 1), {}); }, "adamw_step (group 0): grad"));
  ops::AdamWHyper bad;
  bad.step = 0;
  EXPECT_TRUE(raises([&] { ops::adamw_step({}, bad); }, "adamw_step: step"));
  EXPECT_TRUE(raises([&] { ops::sum_of_squares(empty_f32({2}), {}); }, "sum_of_squares: out"));
}

TEST_P(Errors, WrongDtypesNameTheOp) {
  EXPECT_TRUE(raises(
      [&] { ops::add(empty({4}), empty({4}), Tensor::empty({4}, DType::f16, device())); }, "add"));
  EXPECT_TRUE(raises(
      [&] {
        ops::bias_backward(Tensor::empty({4}, DType::bf16, device()), empty({2, 4}));
      },
      "bias_backward: dbias must be f32"));
  EXPECT_TRUE(raises(
      [&] {
        ops::layernorm_forward(empty({2, 4}), empty_f32({2}),
                               Tensor::empty({2}, DType::i32, device()), empty({2, 4}), empty({4}),
                               empty({4}), 1e-5f);
      },
      "layernorm_forward: rstd must be f32"));
  EXPECT_TRUE(raises(
      [&] {
        ops::attention_forward(empty({1, 2, 1, 8}), Tensor::empty({1, 1, 2}, DType::bf16, device()),
                               empty({1, 2, 1, 8}), empty({1, 2, 1, 8}), empty({1, 2, 1, 8}));
      },
      "attention_forward: lse must be f32"));
  EXPECT_TRUE(raises(
      [&] {
        ops::cross_entropy_partials(empty_f32({2}), empty_f32({2}), empty_f32({2}), empty({2, 5}),
                                    empty_f32({2}));
      },
      "cross_entropy_partials: targets must be i32"));
  EXPECT_TRUE(
      raises([&] { ops::cast(Tensor::empty({2}, DType::i32, device()), empty({2})); }, "cast"));
  EXPECT_TRUE(raises(
      [&] {
        ops::sum_of_squares(empty_f32({1}),
                            std::vector<Tensor>{Tensor::empty({2}, DType::i32, device())});
      },
      "sum_of_squares: tensor 0"));
  ops::AdamWGroup g{zeros_f32({5}), zeros_f32({5}), zeros_f32({5}),
                    zeros_f32({5}), 0.0f,           Tensor::empty({5}, DType::i32, device())};
  EXPECT_TRUE(
      raises([&] { ops::adamw_step(std::span(&g, 1), {}); }, "adamw_step (group 0): model_param"));
}

TEST_P(Errors, GluSpecAndSinksNameTheOp) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Tensor x = empty({2, 8}), h = empty({2, 4});
  EXPECT_TRUE(raises(
      [&] {
        ops::glu_forward(h, x, {false, -1.0f, 0.0f});
      },
      "glu_forward: clamp = -1 must be finite and >= 0"));
  EXPECT_TRUE(raises(
      [&] {
        ops::glu_forward(h, x, {true, inf, 0.0f});
      },
      "glu_forward: clamp = inf"));
  EXPECT_TRUE(raises(
      [&] {
        ops::glu_backward(x, h, x, {false, nan, 0.0f});
      },
      "glu_backward: clamp = nan"));
  EXPECT_TRUE(raises(
      [&] {
        ops::glu_backward(x, h, x, {false, 7.0f, nan});
      },
      "glu_backward: linear_offset = nan must be finite"));
  EXPECT_TRUE(raises(
      [&] {
        ops::glu_forward(h, x, {false, 0.0f, -inf});
      },
      "glu_forward: linear_offset = -inf"));

  // attention_sink_forward / _backward: out [1, 5, 4, 8], lse [1, 4, 5], sinks [4] of out's dtype.
  Tensor out = empty({1, 5, 4, 8}), lse = empty_f32({1, 4, 5}), sinks = empty({4});
  const DType other = dtype() == DType::f32 ? DType::bf16 : DType::f32;
  EXPECT_TRUE(raises([&] { ops::attention_sink_forward(out, lse, empty({5})); },
                     "attention_sink_forward: sinks must be [4]"));
  EXPECT_TRUE(raises(
      [&] {
        ops::attention_sink_forward(out, empty_f32({1, 5, 4}), sinks);
      },
      "attention_sink_forward: lse must be [1, 4, 5]"));
  EXPECT_TRUE(raises(
      [&] {
        ops::attention_sink_forward(out, Tensor::empty({1, 4, 5}, DType::bf16, device()), sinks);
      },
      "attention_sink_forward: lse must be f32"));
  EXPECT_TRUE(
      raises([&] { ops::attention_sink_forward(out, lse, Tensor::empty({4}, other, device())); },
             "attention_sink_forward: sinks is"));
  EXPECT_TRUE(raises(
      [&] {
        ops::attention_sink_forward(empty({5, 4, 8}), lse, sinks);
      },
      "attention_sink_forward: out must be [B, Sq, Hq, D]"));
  EXPECT_TRUE(raises([&] { ops::attention_sink_forward(out, lse, Tensor()); },
                     "attention_sink_forward: sinks is undefined"));
  EXPECT_TRUE(raises(
      [&] {
        ops::attention_sink_backward(Tensor::empty({4}, DType::bf16, device()), out, out, lse,
                                     sinks);
      },
      "attention_sink_backward: dsinks must be f32"));
  EXPECT_TRUE(raises([&] { ops::attention_sink_backward(zeros_f32({3}), out, out, lse, sinks); },
                     "attention_sink_backward: dsinks must be [4]"));
  EXPECT_TRUE(raises(
      [&] {
        ops::attention_sink_backward(zeros_f32({4}), empty({1, 5, 4, 9}), out, lse, sinks);
      },
      "attention_sink_backward: dout"));
  EXPECT_TRUE(
      raises([&] { ops::attention_sink_backward(zeros_f32({4}), out, out, lse, empty({2})); },
             "attention_sink_backward: sinks must be [4]"));

  // attention_cached_forward's sinks: [Hq] of q's dtype.
  Tensor q = empty({1, 2, 4, 8}), cache = empty({1, 6, 2, 8});
  EXPECT_TRUE(raises([&] { ops::attention_cached_forward(q, q, cache, cache, 3, -1, empty({2})); },
                     "attention_cached_forward: sinks must be [4]"));
  EXPECT_TRUE(raises(
      [&] {
        ops::attention_cached_forward(q, q, cache, cache, 3, -1,
                                      Tensor::empty({4}, other, device()));
      },
      "attention_cached_forward: sinks is"));
}

TEST_P(Errors, UndefinedTensorsNameTheOp) {
  EXPECT_TRUE(
      raises([&] { ops::gelu_forward(Tensor(), empty({4})); }, "gelu_forward: out is undefined"));
  EXPECT_TRUE(raises(
      [&] {
        ops::matmul(empty({2, 2}), Tensor(), empty({2, 2}), {}, false, false);
      },
      "matmul: a is undefined"));
  EXPECT_TRUE(raises(
      [&] {
        ops::layernorm_forward(empty({2, 4}), empty_f32({2}), empty_f32({2}), empty({2, 4}),
                               empty({4}), Tensor(), 1e-5f);
      },
      "layernorm_forward: bias is undefined"));
}

TEST_P(Errors, ZeroSizedInputsDoNothing) {
  Tensor none = empty({0, 8});
  ops::matmul(empty({0, 5}), none, empty({5, 8}), empty({5}), false, true);
  Tensor db = up_f32(random_tensor({8}, 1));
  std::vector<double> db0 = values(db);
  ops::bias_backward(db, none);
  ops::add(none, none, none);
  ops::scale(none, none, 3.0f);
  ops::cast(empty_f32({0}), empty({0}));
  ops::gelu_forward(none, none);
  ops::gelu_backward(none, none, none);
  ops::glu_forward(empty({0, 4}), none, {true, 7.0f, 1.0f});
  ops::glu_backward(none, empty({0, 4}), none, {true, 7.0f, 1.0f});
  ops::dropout_forward(none, none, 0.5f, 1, 2);
  ops::dropout_backward(none, none, 0.5f, 1, 2);
  Tensor dw = up_f32(random_tensor({8}, 2));
  std::vector<double> dw0 = values(dw);
  ops::layernorm_forward(none, empty_f32({0}), empty_f32({0}), none, empty({8}), empty({8}), 1e-5f);
  ops::layernorm_backward(none, dw, db, none, none, empty({8}), empty_f32({0}), empty_f32({0}));
  ops::rmsnorm_forward(none, empty_f32({0}), none, empty({8}), 1e-6f);
  ops::rmsnorm_backward(none, dw, none, none, empty({8}), empty_f32({0}));
  ops::rope_forward(empty({0, 3, 2, 8}), empty({0, 3, 2, 8}), {1e4f});
  ops::rope_backward(empty({2, 0, 2, 8}), empty({2, 0, 2, 8}), {1e4f});
  Tensor ids = Tensor::empty({0}, DType::i32, device());
  ops::embedding_forward(none, ids, empty({10, 8}));
  Tensor table = up_f32(random_tensor({10, 8}, 3));
  std::vector<double> table0 = values(table);
  ops::embedding_backward(table, none, ids);
  Tensor q = empty({2, 0, 4, 8}), kv = empty({2, 0, 2, 8}), lse = empty_f32({2, 4, 0});
  ops::attention_forward(q, lse, q, kv, kv);
  ops::attention_backward(q, kv, kv, q, q, kv, kv, q, lse);
  Tensor dsinks = up_f32(random_tensor({4}, 4));
  const std::vector<double> dsinks0 = values(dsinks);
  ops::attention_sink_forward(q, lse, empty({4}));
  ops::attention_sink_backward(dsinks, q, q, lse, empty({4}));
  Tensor targets = Tensor::empty({0}, DType::i32, device()), row = empty_f32({0});
  ops::cross_entropy_partials(row, row, row, empty({0, 50}), targets);
  ops::cross_entropy_loss(row, row, row, row, targets);
  ops::cross_entropy_backward(empty({0, 50}), empty({0, 50}), targets, row, row, row);
  std::vector<ops::AdamWGroup> groups = {
      {empty_f32({0}), empty_f32({0}), empty_f32({0}), empty_f32({0}), 0.1f, {}}};
  ops::adamw_step(groups, {});
  Tensor sum = empty_f32({1});
  ops::sum_of_squares(sum, std::vector<Tensor>{empty_f32({0})});
  EXPECT_EQ(values(sum)[0], 0.0);
  // Accumulating ops with nothing to add left their buffers as they were.
  EXPECT_TRUE(all_close(db, db0, {0, 0}));
  EXPECT_TRUE(all_close(dw, dw0, {0, 0}));
  EXPECT_TRUE(all_close(table, table0, {0, 0}));
  EXPECT_TRUE(all_close(dsinks, dsinks0, {0, 0}));
}

BRAID_KERNEL_TEST_SUITE(Errors);

// The CPU computes in f32: a bf16 activation is refused with a message naming op and dtype.
TEST(KernelErrors, Bf16IsNotSupportedOnCpu) {
  Tensor x = Tensor::empty({2, 4}, DType::bf16), y = Tensor::empty({2, 4}, DType::bf16);
  EXPECT_TRUE(
      raises([&] { ops::gelu_forward(y, x); }, "gelu_forward: bf16 is not supported on cpu"));
  EXPECT_TRUE(raises([&] { ops::add(y, x, x); }, "add: bf16 is not supported on cpu"));
  EXPECT_TRUE(raises(
      [&] {
        ops::matmul(Tensor::empty({2, 2}, DType::f32), x, x, {}, false, true);
      },
      "matmul: bf16 is not supported on cpu"));
  EXPECT_TRUE(raises(
      [&] {
        ops::layernorm_forward(y, Tensor::empty({2}, DType::f32), Tensor::empty({2}, DType::f32), x,
                               Tensor::empty({4}, DType::bf16), Tensor::empty({4}, DType::bf16),
                               1e-5f);
      },
      "layernorm_forward: bf16 is not supported on cpu"));
  EXPECT_TRUE(raises(
      [&] {
        ops::attention_forward(
            Tensor::empty({1, 2, 1, 4}, DType::bf16), Tensor::empty({1, 1, 2}, DType::f32),
            Tensor::empty({1, 2, 1, 4}, DType::bf16), Tensor::empty({1, 2, 1, 4}, DType::bf16),
            Tensor::empty({1, 2, 1, 4}, DType::bf16));
      },
      "attention_forward: bf16 is not supported on cpu"));
  EXPECT_TRUE(raises(
      [&] {
        ops::cross_entropy_partials(Tensor::empty({2}, DType::f32), Tensor::empty({2}, DType::f32),
                                    Tensor::empty({2}, DType::f32), x,
                                    Tensor::empty({2}, DType::i32));
      },
      "cross_entropy_partials: bf16 is not supported on cpu"));
  EXPECT_TRUE(raises(
      [&] {
        ops::embedding_forward(y.view({1, 2, 4}), Tensor::empty({1, 2}, DType::i32), x);
      },
      "embedding_forward: bf16 is not supported on cpu"));
}

// Tensors of one call share a device. A host buffer labelled cuda:0 (from_blob allocates
// nothing) is never dereferenced: the device check comes first.
TEST(KernelErrors, MixedDevicesNameTheOp) {
  std::vector<float> host(8);
  Tensor on_gpu = Tensor::from_blob(host.data(), {2, 4}, DType::f32, Device::cuda(0));
  Tensor on_cpu = Tensor::empty({2, 4}, DType::f32);
  EXPECT_TRUE(
      raises([&] { ops::add(on_cpu, on_cpu, on_gpu); }, "add: b is on cuda:0 but out is on cpu"));
  EXPECT_TRUE(raises([&] { ops::gelu_forward(on_gpu, on_cpu); }, "gelu_forward"));
  Tensor q = Tensor::empty({1, 2, 4, 2}, DType::f32),
         cache = Tensor::empty({1, 3, 2, 2}, DType::f32);
  EXPECT_TRUE(raises(
      [&] { ops::attention_cached_forward(q, q, cache, cache, 3, -1, on_gpu.slice(0, {4})); },
      "attention_cached_forward: sinks is on cuda:0"));
  EXPECT_TRUE(raises(
      [&] { ops::sum_of_squares(Tensor::empty({1}, DType::f32), std::vector<Tensor>{on_gpu}); },
      "sum_of_squares: tensor 0 is on cuda:0"));
#ifndef BRAID_WITH_CUDA
  EXPECT_TRUE(raises([&] { ops::scale(on_gpu, on_gpu, 2.0f); },
                     "scale: tensors are on cuda:0 but braid was built without CUDA"));
#endif
}

}  // namespace
}  // namespace braid::testing
