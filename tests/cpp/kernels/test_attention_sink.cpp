// Attention sinks (GPT-OSS's learnable softmax offsets): attention_forward followed by
// attention_sink_forward against a double reference whose softmax runs over [scores..., sink]
// (causal, GQA, sliding window, document masking, fewer queries than keys); attention_backward on
// the sink-corrected out and lse plus attention_sink_backward against finite differences of the
// composition; a very negative sink is no sink; and attention_cached_forward with sinks equals
// the two training ops on the same keys.
#include "attention_reference.h"
#include "kernel_test_util.h"

namespace braid::testing {
namespace {

class AttentionSink : public KernelTest {};

// s key positions; the queries are the last `q_rows` of them (0: all s); window: the keys before
// its own each query sees (-1: all); documents: sequence b is cut into documents of 5 + 4 b
// positions (key_start).
struct SinkShape {
  int64_t b, s, hq, hkv, d, q_rows = 0, window = -1;
  bool documents = false;
  int64_t sq() const { return q_rows > 0 ? q_rows : s; }
};

std::ostream& operator<<(std::ostream& out, const SinkShape& a) {
  return out << "B " << a.b << " Sq " << a.sq() << " Sk " << a.s << " Hq " << a.hq << " Hkv "
             << a.hkv << " D " << a.d << " window " << a.window << " documents " << a.documents;
}

// key_start [B, S] i32 on the host (undefined without documents).
Tensor key_start_of(const SinkShape& a) {
  if (!a.documents) return {};
  Tensor t = Tensor::empty({a.b, a.s}, DType::i32);
  for (int64_t b = 0; b < a.b; ++b) {
    const int64_t len = 5 + 4 * b;
    for (int64_t p = 0; p < a.s; ++p) t.data_ptr<int32_t>()[b * a.s + p] = int32_t(p / len * len);
  }
  return t;
}

// out [B, Sq, Hq, D] and lse [B, Hq, Sq] of the softmax over each row's visible scores and the
// head's sink.
std::pair<std::vector<double>, std::vector<double>> sink_reference(
    const SinkShape& a, const std::vector<double>& q, const std::vector<double>& k,
    const std::vector<double>& v, const std::vector<double>& sinks) {
  AttentionReference ref{a.b, a.sq(), a.s, a.hq, a.hkv, a.d};
  ref.first_key = [a](int64_t b, int64_t p) {
    int64_t first = a.window < 0 ? 0 : std::max<int64_t>(0, p - a.window);
    if (a.documents) {
      const int64_t len = 5 + 4 * b;  // key_start_of's documents
      first = std::max(first, p / len * len);
    }
    return first;
  };
  ref.sink = [&sinks](int64_t h) { return sinks[size_t(h)]; };
  return ref(q, k, v);
}

// Sinks [Hq] spread over [-3, 3]: some outweigh every key, some hardly count.
Tensor sinks_of(int64_t hq, uint64_t seed) { return random_tensor({hq}, seed, 3.0f); }

// attention_forward (with attention dropout when `drop` has p > 0) then attention_sink_forward
// on device tensors; returns {out, lse}.
Tensors sink_attention(const SinkShape& a, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& sinks, const Tensor& key_start,
                       const ops::AttentionDropout& drop = {}) {
  Tensor out = empty_as(q, {a.b, a.sq(), a.hq, a.d}), lse = f32_as(q, {a.b, a.hq, a.sq()});
  const Tensor ks = key_start.defined() ? key_start.to(q.device()) : Tensor();
  ops::attention_forward(out, lse, q, k, v, a.window, ks, drop);
  ops::attention_sink_forward(out, lse, sinks);
  return {out, lse};
}

TEST_P(AttentionSink, ForwardMatchesReference) {
  const std::vector<SinkShape> shapes = {{2, 9, 4, 4, 8},
                                         {2, 17, 4, 2, 16},
                                         {1, 33, 4, 1, 8},
                                         {1, 70, 2, 1, 64},
                                         {2, 40, 4, 2, 16, 9},
                                         {1, 90, 2, 1, 32, 41, 33},
                                         {2, 50, 4, 2, 16, 0, 5},
                                         {1, 33, 4, 1, 8, 0, 0},
                                         {2, 45, 4, 2, 16, 0, -1, true},
                                         {2, 45, 4, 2, 16, 0, 6, true},
                                         {2, 40, 4, 2, 8, 13, -1, true}};
  int seed = 1;
  for (const SinkShape& a : shapes) {
    SCOPED_TRACE(::testing::Message() << a);
    Tensor q = random_tensor({a.b, a.sq(), a.hq, a.d}, seed++, 2.0f);
    Tensor k = random_tensor({a.b, a.s, a.hkv, a.d}, seed++, 2.0f);
    Tensor v = random_tensor({a.b, a.s, a.hkv, a.d}, seed++);
    Tensor sinks = sinks_of(a.hq, seed++);
    Tensors got = sink_attention(a, up(q), up(k), up(v), up(sinks), key_start_of(a));
    auto [want_out, want_lse] =
        sink_reference(a, values(seen(q)), values(seen(k)), values(seen(v)), values(seen(sinks)));
    EXPECT_TRUE(all_close(got[0], want_out, tol({2e-5, 1e-4})));
    EXPECT_TRUE(all_close(got[1], want_lse, tol({2e-5, 1e-5}, {2e-2, 1e-2})));
  }
}

TEST_P(AttentionSink, BackwardMatchesFiniteDifferences) {
  // dq, dk, dv from attention_backward given the sink-corrected out and lse, and dsinks from
  // attention_sink_backward, against finite differences of sum(out * R) through both forwards;
  // each shape also with attention dropout (GPT-OSS trained with none, Megatron's default has it).
  const std::vector<SinkShape> shapes = {{1, 9, 4, 2, 8},
                                         {2, 13, 4, 2, 8, 5},
                                         {1, 21, 2, 1, 8, 0, 4},
                                         {2, 17, 2, 2, 8, 0, -1, true},
                                         {1, 24, 4, 2, 16, 0, 6, true},
                                         {1, 16, 2, 1, 16, 7, 3, true}};
  int seed = 40;
  for (const SinkShape& a : shapes) {
    for (const float p : {0.0f, 0.3f}) {
      SCOPED_TRACE(::testing::Message() << a << " attention dropout " << p);
      ops::AttentionDropout drop;
      drop.p = p;
      drop.seed = 77;
      drop.stream = uint64_t(seed);
      drop.first_head = 1;
      const Tensor key_start = key_start_of(a);
      GradCheck g;
      g.inputs = {random_tensor({a.b, a.sq(), a.hq, a.d}, seed++, 1.5f),
                  random_tensor({a.b, a.s, a.hkv, a.d}, seed++, 1.5f),
                  random_tensor({a.b, a.s, a.hkv, a.d}, seed++), sinks_of(a.hq, seed++)};
      g.wrt = {0, 1, 2, 3};
      g.samples = 32;
      g.forward = [a, key_start, drop](const Tensors& in) {
        return sink_attention(a, in[0], in[1], in[2], in[3], key_start, drop)[0];
      };
      g.backward = [a, key_start, drop](const Tensors& in, const Tensor& dout) {
        Tensors fwd = sink_attention(a, in[0], in[1], in[2], in[3], key_start, drop);
        const Tensor ks = key_start.defined() ? key_start.to(in[0].device()) : Tensor();
        Tensor dq = empty_as(in[0], in[0].shape()), dk = empty_as(in[0], in[1].shape()),
               dv = empty_as(in[0], in[2].shape());
        ops::attention_backward(dq, dk, dv, dout, in[0], in[1], in[2], fwd[0], fwd[1], a.window, ks,
                                drop);
        Tensor dsinks = zeros_f32_as(in[0], {a.hq});
        ops::attention_sink_backward(dsinks, dout, fwd[0], fwd[1], in[3]);
        return Tensors{dq, dk, dv, dsinks};
      };
      g.step = 1e-2;
      g.f32_tol = {2e-3, 3e-3};
      check_gradients(GetParam(), g);
    }
  }
}

TEST_P(AttentionSink, SinkGradientAccumulatesItsFormula) {
  // dsinks[h] += -sum over b, i of exp(sinks[h] - lse[b, h, i]) dot(dout, out) on the forward's
  // out and lse, added to what dsinks held.
  const SinkShape a{2, 37, 6, 2, 24, 0, 9};
  Tensor q = random_tensor({a.b, a.s, a.hq, a.d}, 70, 2.0f);
  Tensor k = random_tensor({a.b, a.s, a.hkv, a.d}, 71, 2.0f);
  Tensor v = random_tensor({a.b, a.s, a.hkv, a.d}, 72), dout = random_tensor(q.shape(), 73);
  Tensor sinks = sinks_of(a.hq, 74), initial = random_tensor({a.hq}, 75);
  Tensors fwd = sink_attention(a, up(q), up(k), up(v), up(sinks), {});
  Tensor dsinks = up_f32(initial);
  ops::attention_sink_backward(dsinks, up(dout), fwd[0], fwd[1], up(sinks));
  const std::vector<double> o = values(fwd[0]), l = values(fwd[1]), g = values(seen(dout)),
                            sv = values(seen(sinks));
  std::vector<double> want = values(initial);
  for (int64_t b = 0; b < a.b; ++b) {
    for (int64_t i = 0; i < a.s; ++i) {
      for (int64_t h = 0; h < a.hq; ++h) {
        double dot = 0;
        for (int64_t d = 0; d < a.d; ++d) {
          const size_t at = size_t(((b * a.s + i) * a.hq + h) * a.d + d);
          dot += g[at] * o[at];
        }
        want[size_t(h)] -= std::exp(sv[size_t(h)] - l[size_t((b * a.hq + h) * a.s + i)]) * dot;
      }
    }
  }
  EXPECT_TRUE(all_close(dsinks, want, {1e-4, 1e-4}));
}

TEST_P(AttentionSink, VeryNegativeSinkIsNoSink) {
  // exp(-1e4 - lse) is 0 in f32: out and lse are plain attention's, bit for bit, and the sinks'
  // gradient adds nothing.
  const SinkShape a{2, 33, 4, 2, 16, 0, 7};
  Tensor q = random_tensor({a.b, a.s, a.hq, a.d}, 80, 2.0f);
  Tensor k = random_tensor({a.b, a.s, a.hkv, a.d}, 81, 2.0f);
  Tensor v = random_tensor({a.b, a.s, a.hkv, a.d}, 82);
  Tensor sinks = Tensor::empty({a.hq}, DType::f32);
  for (int64_t h = 0; h < a.hq; ++h) sinks.data_ptr<float>()[h] = -1e4f;
  Tensors with = sink_attention(a, up(q), up(k), up(v), up(sinks), {});
  Tensor out = empty({a.b, a.s, a.hq, a.d}), lse = empty_f32({a.b, a.hq, a.s});
  ops::attention_forward(out, lse, up(q), up(k), up(v), a.window);
  EXPECT_EQ(values(with[0]), values(out));
  EXPECT_EQ(values(with[1]), values(lse));
  Tensor dsinks = up_f32(random_tensor({a.hq}, 83));
  const std::vector<double> before = values(dsinks);
  ops::attention_sink_backward(dsinks, up(random_tensor(q.shape(), 84)), with[0], with[1],
                               up(sinks));
  EXPECT_EQ(values(dsinks), before);
}

// The last n rows of dim 1 of a [B, S, ...] host tensor, as [B, n, ...].
Tensor last_rows(const Tensor& t, int64_t n) {
  const int64_t b = t.size(0), s = t.size(1), row = t.numel() / (b * s);
  Tensor out = Tensor::empty({b, n, t.size(2), t.size(3)}, t.dtype());
  for (int64_t i = 0; i < b; ++i)
    out.slice(i * n * row, {n * row}).copy_from(t.slice((i * s + s - n) * row, {n * row}));
  return out;
}

TEST_P(AttentionSink, CachedForwardEqualsTheTrainingOps) {
  // The queries of the last n positions over a cache holding the s keys (and garbage past them)
  // give the last n rows of attention_forward + attention_sink_forward over the same keys.
  struct Case {
    int64_t b, s, hq, hkv, d, window;
  };
  int seed = 90;
  for (const Case& c :
       {Case{2, 37, 6, 2, 40, -1}, Case{1, 50, 4, 1, 64, 7}, Case{2, 45, 4, 4, 16, 33},
        Case{1, 20, 2, 1, 128, -1}, Case{1, 70, 8, 2, 32, 0}}) {
    SCOPED_TRACE(::testing::Message() << "B " << c.b << " S " << c.s << " Hq " << c.hq << " Hkv "
                                      << c.hkv << " D " << c.d << " window " << c.window);
    const int64_t cap = c.s + 9;
    const SinkShape a{c.b, c.s, c.hq, c.hkv, c.d, 0, c.window};
    Tensor q = random_tensor({c.b, c.s, c.hq, c.d}, seed++, 2.0f);
    Tensor k = random_tensor({c.b, c.s, c.hkv, c.d}, seed++, 2.0f);
    Tensor v = random_tensor({c.b, c.s, c.hkv, c.d}, seed++);
    Tensor sinks = sinks_of(c.hq, seed++);
    const std::vector<double> full =
        values(sink_attention(a, up(q), up(k), up(v), up(sinks), {})[0]);
    Tensor kc = random_tensor({c.b, cap, c.hkv, c.d}, seed++, 100.0f);
    Tensor vc = random_tensor({c.b, cap, c.hkv, c.d}, seed++, 100.0f);
    const int64_t row = c.hkv * c.d;
    for (int64_t i = 0; i < c.b; ++i) {
      kc.slice(i * cap * row, {c.s * row}).copy_from(k.slice(i * c.s * row, {c.s * row}));
      vc.slice(i * cap * row, {c.s * row}).copy_from(v.slice(i * c.s * row, {c.s * row}));
    }
    for (int64_t n : {int64_t(1), int64_t(3), c.s}) {
      SCOPED_TRACE(::testing::Message() << n << " new positions");
      Tensor got = empty({c.b, n, c.hq, c.d});
      ops::attention_cached_forward(got, up(last_rows(q, n)), up(kc), up(vc), c.s, c.window,
                                    up(sinks));
      std::vector<double> want;
      const int64_t width = c.hq * c.d;
      for (int64_t i = 0; i < c.b; ++i) {
        want.insert(want.end(), full.begin() + (i * c.s + c.s - n) * width,
                    full.begin() + (i * c.s + c.s) * width);
      }
      EXPECT_TRUE(all_close(got, want, tol({1e-5, 1e-4})));
    }
  }
}

BRAID_KERNEL_TEST_SUITE(AttentionSink);

}  // namespace
}  // namespace braid::testing
