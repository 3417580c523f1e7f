// Attention dropout (ops::AttentionDropout, Megatron's --attention-dropout): the forward against
// a double reference that draws the mask from ops.h's rule with Philox directly, the backward
// against finite differences (the mask is a function of the seed, not of the inputs), the
// fraction dropped, and the property the parallel layouts rely on: a shard of the heads, one
// sequence of the batch or a chunk of the queries draws exactly the unsplit call's mask there.
#include <cmath>

#include "attention_reference.h"
#include "braid/core/philox.h"
#include "kernel_test_util.h"

namespace braid::testing {
namespace {

class AttentionDropoutTest : public KernelTest {};

// s keys; the queries are the last q_rows of them (0: all); window -1: none; documents > 1:
// document masking (key_start) with documents of about s / documents positions.
struct Case {
  int64_t b, s, hq, hkv, d, q_rows = 0, window = -1, documents = 1;
  int64_t sq() const { return q_rows > 0 ? q_rows : s; }
};

std::ostream& operator<<(std::ostream& out, const Case& a) {
  return out << "B " << a.b << " Sq " << a.sq() << " Sk " << a.s << " Hq " << a.hq << " Hkv "
             << a.hkv << " D " << a.d << " window " << a.window << " documents " << a.documents;
}

// ops.h's rule, written out: the multiplier of the probability of query head h of sequence b
// at position qp for the key at position kp.
double multiplier(const ops::AttentionDropout& drop, int64_t b, int64_t h, int64_t qp, int64_t kp) {
  const uint64_t stream = philox::substream(drop.stream, uint64_t(drop.first_sequence + b),
                                            uint64_t(drop.first_head + h));
  const philox::Words4 w =
      philox::random_words(drop.seed, stream, (uint64_t(qp) << 32) | uint64_t(kp / 4));
  return philox::uniform_from_word(w.x[kp % 4]) > drop.p ? double(1.0f / (1.0f - drop.p)) : 0.0;
}

// key_start [B, S] i32 on the host: sequence b's documents start every s / documents positions,
// shifted by b.
Tensor document_starts(const Case& a) {
  Tensor t = Tensor::empty({a.b, a.s}, DType::i32);
  int32_t* p = t.data_ptr<int32_t>();
  const int64_t length = std::max<int64_t>(1, a.s / a.documents);
  for (int64_t b = 0; b < a.b; ++b) {
    for (int64_t pos = 0; pos < a.s; ++pos) {
      const int64_t shifted = pos + b;
      p[b * a.s + pos] = int32_t(std::max<int64_t>(0, shifted / length * length - b));
    }
  }
  return t;
}

// out [B, Sq, Hq, D] of attention with dropout, in double.
std::vector<double> reference(const Case& a, const std::vector<double>& q,
                              const std::vector<double>& k, const std::vector<double>& v,
                              const Tensor& key_start, const ops::AttentionDropout& drop) {
  AttentionReference ref{a.b, a.sq(), a.s, a.hq, a.hkv, a.d};
  ref.first_key = [&](int64_t b, int64_t p) {
    const int64_t first = a.window < 0 ? 0 : std::max<int64_t>(0, p - a.window);
    if (!key_start.defined()) return first;
    return std::max<int64_t>(first, key_start.data_ptr<int32_t>()[b * a.s + p]);
  };
  ref.multiplier = [&drop](int64_t b, int64_t h, int64_t p, int64_t j) {
    return multiplier(drop, b, h, drop.first_position + p, drop.first_position + j);
  };
  return ref(q, k, v).first;
}

ops::AttentionDropout dropout_of(float p, uint64_t stream, int64_t first_sequence = 0,
                                 int64_t first_head = 0, int64_t first_position = 0) {
  ops::AttentionDropout d;
  d.p = p;
  d.seed = 0x5EEDull;
  d.stream = stream;
  d.first_sequence = first_sequence;
  d.first_head = first_head;
  d.first_position = first_position;
  return d;
}

TEST_P(AttentionDropoutTest, ForwardMatchesReference) {
  const std::vector<std::pair<Case, ops::AttentionDropout>> cases = {
      {{2, 9, 4, 4, 8}, dropout_of(0.1f, 1)},
      {{2, 17, 4, 2, 16}, dropout_of(0.5f, 2)},
      {{1, 70, 2, 1, 64}, dropout_of(0.3f, 3, 5, 6, 11)},
      {{2, 40, 4, 2, 16, 9}, dropout_of(0.2f, 4, 0, 2, 7)},
      {{1, 70, 2, 1, 32, 0, 20}, dropout_of(0.1f, 5)},
      {{2, 50, 4, 2, 16, 17, 7}, dropout_of(0.4f, 6, 3)},
      {{2, 48, 2, 1, 16, 0, -1, 3}, dropout_of(0.25f, 7, 0, 0, 3)},
      // a context-parallel chunk with document masking: fewer queries, documents, an offset
      {{2, 48, 4, 2, 16, 20, -1, 3}, dropout_of(0.3f, 9, 1, 0, 16)},
      {{1, 40, 2, 1, 8, 11, 6, 2}, dropout_of(0.5f, 10)},
      {{1, 33, 4, 2, 8, 0, 9, 4}, dropout_of(0.6f, 8)}};
  int seed = 1;
  for (const auto& [a, drop] : cases) {
    SCOPED_TRACE(::testing::Message() << a << " p " << drop.p);
    Tensor q = random_tensor({a.b, a.sq(), a.hq, a.d}, seed++, 2.0f);
    Tensor k = random_tensor({a.b, a.s, a.hkv, a.d}, seed++, 2.0f);
    Tensor v = random_tensor({a.b, a.s, a.hkv, a.d}, seed++);
    const Tensor starts = a.documents > 1 ? document_starts(a) : Tensor();
    Tensor out = empty({a.b, a.sq(), a.hq, a.d}), lse = empty_f32({a.b, a.hq, a.sq()});
    ops::attention_forward(out, lse, up(q), up(k), up(v), a.window,
                           starts.defined() ? starts.to(device()) : Tensor(), drop);
    EXPECT_TRUE(all_close(
        out, reference(a, values(seen(q)), values(seen(k)), values(seen(v)), starts, drop),
        tol({3e-5, 1e-4})));
  }
}

TEST_P(AttentionDropoutTest, BackwardMatchesFiniteDifferences) {
  const std::vector<std::pair<Case, ops::AttentionDropout>> cases = {
      {{1, 9, 4, 2, 8}, dropout_of(0.3f, 11)},
      {{2, 13, 4, 2, 8, 5}, dropout_of(0.5f, 12, 1, 4, 3)},
      {{1, 37, 2, 1, 16, 6, 4}, dropout_of(0.2f, 13)},
      {{2, 21, 4, 2, 8, 0, 3}, dropout_of(0.4f, 14)},
      {{2, 24, 2, 2, 8, 0, -1, 3}, dropout_of(0.3f, 15)},
      {{2, 30, 2, 1, 8, 12, -1, 3}, dropout_of(0.3f, 16, 2, 0, 9)}};
  int seed = 30;
  for (const auto& [a, drop] : cases) {
    SCOPED_TRACE(::testing::Message() << a << " p " << drop.p);
    const Tensor starts = a.documents > 1 ? document_starts(a) : Tensor();
    GradCheck g;
    g.inputs = {random_tensor({a.b, a.sq(), a.hq, a.d}, seed++, 1.5f),
                random_tensor({a.b, a.s, a.hkv, a.d}, seed++, 1.5f),
                random_tensor({a.b, a.s, a.hkv, a.d}, seed++)};
    g.wrt = {0, 1, 2};
    g.samples = 32;
    auto forward = [a, drop, starts](const Tensors& in, Tensor& out, Tensor& lse) {
      out = empty_as(in[0], {a.b, a.sq(), a.hq, a.d});
      lse = f32_as(in[0], {a.b, a.hq, a.sq()});
      ops::attention_forward(out, lse, in[0], in[1], in[2], a.window,
                             starts.defined() ? starts.to(in[0].device()) : Tensor(), drop);
    };
    g.forward = [forward](const Tensors& in) {
      Tensor out, lse;
      forward(in, out, lse);
      return out;
    };
    g.backward = [a, drop, starts, forward](const Tensors& in, const Tensor& dout) {
      Tensor out, lse;
      forward(in, out, lse);
      Tensor dq = empty_as(in[0], in[0].shape()), dk = empty_as(in[0], in[1].shape()),
             dv = empty_as(in[0], in[2].shape());
      ops::attention_backward(dq, dk, dv, dout, in[0], in[1], in[2], out, lse, a.window,
                              starts.defined() ? starts.to(in[0].device()) : Tensor(), drop);
      return Tensors{dq, dk, dv};
    };
    g.step = 1e-2;
    g.f32_tol = {2e-3, 3e-3};
    check_gradients(GetParam(), g);
  }
}

// The mask made visible: with q = 0 every visible key has probability 1 / (i + 1), and with
// v[j] = e_j out[b, i, h, j] = that probability times the multiplier of key j. Returns
// out * (i + 1) * (1 - p) [B, Sq, Hq, S]: 1 where kept, 0 where dropped or not visible.
std::vector<double> revealed_mask(Device device, DType dtype, int64_t b, int64_t sq, int64_t s,
                                  int64_t heads, const ops::AttentionDropout& drop) {
  Tensor q = Tensor::zeros({b, sq, heads, s}, DType::f32);
  Tensor v = Tensor::zeros({b, s, heads, s}, DType::f32);
  float* pv = v.data_ptr<float>();
  for (int64_t bb = 0; bb < b; ++bb) {
    for (int64_t j = 0; j < s; ++j) {
      for (int64_t h = 0; h < heads; ++h) pv[((bb * s + j) * heads + h) * s + j] = 1.0f;
    }
  }
  Tensor out = Tensor::empty({b, sq, heads, s}, dtype, device);
  Tensor lse = Tensor::empty({b, heads, sq}, DType::f32, device);
  ops::attention_forward(out, lse, upload(q, device, dtype), upload(v, device, dtype),
                         upload(v, device, dtype), -1, {}, drop);
  std::vector<double> got = values(out);
  for (size_t e = 0; e < got.size(); ++e) {
    const int64_t i = int64_t(e) / (s * heads) % sq;
    got[e] = std::round(got[e] * double(s - sq + i + 1) * (1.0 - drop.p));
  }
  return got;
}

TEST_P(AttentionDropoutTest, DropsTheFractionP) {
  const int64_t b = 2, s = 96, heads = 4;
  for (float p : {0.1f, 0.5f}) {
    const std::vector<double> mask =
        revealed_mask(device(), dtype(), b, s, s, heads, dropout_of(p, 21));
    int64_t visible = 0, kept = 0;
    for (size_t e = 0; e < mask.size(); ++e) {
      const int64_t j = int64_t(e) % s, i = int64_t(e) / (s * heads) % s;
      if (j > i) {
        EXPECT_EQ(mask[e], 0.0) << "a key after its query";
        continue;
      }
      ++visible;
      kept += mask[e] == 1.0;
      EXPECT_TRUE(mask[e] == 0.0 || mask[e] == 1.0) << mask[e];
    }
    // Binomial: kept / visible within 5 standard deviations of 1 - p.
    const double sd = std::sqrt(double(p) * (1.0 - p) / double(visible));
    EXPECT_NEAR(double(kept) / double(visible), 1.0 - p, 5 * sd) << "p " << p;
  }
  // p = 0 keeps everything; another stream draws another mask.
  EXPECT_EQ(revealed_mask(device(), dtype(), 1, 8, 8, 1, {}),
            revealed_mask(device(), dtype(), 1, 8, 8, 1, dropout_of(0.0f, 21)));
  EXPECT_NE(revealed_mask(device(), dtype(), b, s, s, heads, dropout_of(0.5f, 21)),
            revealed_mask(device(), dtype(), b, s, s, heads, dropout_of(0.5f, 22)));
}

TEST_P(AttentionDropoutTest, SplitCallsDrawTheUnsplitMask) {
  // The full call: 3 sequences, 4 heads, 40 positions.
  const int64_t b = 3, s = 40, heads = 4;
  const ops::AttentionDropout drop = dropout_of(0.5f, 31);
  const std::vector<double> full = revealed_mask(device(), dtype(), b, s, s, heads, drop);
  auto at = [&](int64_t bb, int64_t i, int64_t h, int64_t j) {
    return full[size_t(((bb * s + i) * heads + h) * s + j)];
  };
  // Heads 2 and 3 alone (tensor parallelism's second rank of two).
  {
    const std::vector<double> shard =
        revealed_mask(device(), dtype(), b, s, s, 2, dropout_of(0.5f, 31, 0, 2));
    int64_t mismatches = 0;
    for (int64_t bb = 0; bb < b; ++bb)
      for (int64_t i = 0; i < s; ++i)
        for (int64_t h = 0; h < 2; ++h)
          for (int64_t j = 0; j < s; ++j)
            mismatches += shard[size_t(((bb * s + i) * 2 + h) * s + j)] != at(bb, i, h + 2, j);
    EXPECT_EQ(mismatches, 0) << "heads 2..3 of 4";
  }
  // Sequence 2 alone, and its last 12 queries over keys 20 .. 39 (a context-parallel chunk:
  // keys from position 20, queries at 28 .. 39).
  {
    const std::vector<double> one =
        revealed_mask(device(), dtype(), 1, s, s, heads, dropout_of(0.5f, 31, 2));
    int64_t mismatches = 0;
    for (int64_t i = 0; i < s; ++i)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t j = 0; j < s; ++j)
          mismatches += one[size_t((i * heads + h) * s + j)] != at(2, i, h, j);
    EXPECT_EQ(mismatches, 0) << "sequence 2 of 3";
  }
  {
    // With q = 0 the chunk's probabilities are 1 / (keys it sees) = 1 / (i + 1 + 8), so
    // revealed_mask's scaling (by s - sq + i + 1 with s = 20 keys) fits them.
    const int64_t first_key = 20, keys = 20, queries = 12;
    const std::vector<double> chunk = revealed_mask(device(), dtype(), 1, queries, keys, heads,
                                                    dropout_of(0.5f, 31, 2, 0, first_key));
    int64_t mismatches = 0;
    for (int64_t i = 0; i < queries; ++i)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t j = 0; j < keys; ++j)
          mismatches += chunk[size_t((i * heads + h) * keys + j)] !=
                        at(2, first_key + keys - queries + i, h, first_key + j);
    EXPECT_EQ(mismatches, 0) << "a chunk of queries 28..39 over keys 20..39";
  }
}

TEST_P(AttentionDropoutTest, BadProbabilityIsRefused) {
  Tensor q = up(random_tensor({1, 4, 2, 8}, 50));
  Tensor out = empty({1, 4, 2, 8}), lse = empty_f32({1, 2, 4});
  for (float p : {1.0f, -0.1f, std::nanf("")}) {
    try {
      ops::attention_forward(out, lse, q, q, q, -1, {}, dropout_of(p, 1));
      ADD_FAILURE() << "p " << p << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("attention_forward: dropout probability"),
                std::string::npos)
          << e.what();
    }
  }
}

BRAID_KERNEL_TEST_SUITE(AttentionDropoutTest);

}  // namespace
}  // namespace braid::testing
