// Document masking (Megatron's --reset-attention-mask and --reset-position-ids) in the kernels:
// attention with key_start equals each document's attention run alone, forward and backward,
// with as many queries as keys, with fewer (context parallelism's chunks) and with a window; its
// gradients match finite differences; rope with per-token positions equals rope of each row at
// its own offset.
#include "kernel_test_util.h"

namespace braid::testing {
namespace {

class DocumentMasking : public KernelTest {};

// key_start [B, ld] i32 on the host of B sequences cut into documents of the given lengths
// (each row's lengths sum to at least ld's first `s` positions; positions past them repeat the
// last document).
Tensor key_start_of(const std::vector<std::vector<int64_t>>& docs, int64_t ld) {
  Tensor t = Tensor::empty({int64_t(docs.size()), ld}, DType::i32);
  for (size_t b = 0; b < docs.size(); ++b) {
    int64_t start = 0, p = 0;
    for (int64_t len : docs[b]) {
      for (int64_t i = 0; i < len && p < ld; ++i)
        t.data_ptr<int32_t>()[int64_t(b) * ld + p++] = int32_t(start);
      start += len;
    }
    for (; p < ld; ++p)
      t.data_ptr<int32_t>()[int64_t(b) * ld + p] = int32_t(start - docs[b].back());
  }
  return t;
}

// Rows [from, from + count) of sequence b of a host [B, S, H, D] tensor, as [1, count, H, D].
Tensor rows_of(const Tensor& t, int64_t b, int64_t from, int64_t count) {
  const int64_t width = t.size(2) * t.size(3);
  Tensor out = Tensor::empty({1, count, t.size(2), t.size(3)}, t.dtype());
  out.copy_from(t.slice((b * t.size(1) + from) * width, {1, count, t.size(2), t.size(3)}));
  return out;
}

std::vector<double> slice_values(const std::vector<double>& v, int64_t from, int64_t count) {
  return {v.begin() + from, v.begin() + from + count};
}

TEST_P(DocumentMasking, EachDocumentAttendsAsIfAlone) {
  // Documents inside a 16-column chunk and a 32-key tile, across them, of one token, and a
  // sequence that is one document; with and without a window.
  const int64_t b = 3, s = 45, hq = 4, hkv = 2, d = 16;
  const std::vector<std::vector<int64_t>> docs = {{7, 20, 18}, {1, 30, 13, 1}, {45}};
  const Tensor key_start = key_start_of(docs, s);
  Tensor q = random_tensor({b, s, hq, d}, 1, 2.0f), k = random_tensor({b, s, hkv, d}, 2, 2.0f);
  Tensor v = random_tensor({b, s, hkv, d}, 3), dout = random_tensor({b, s, hq, d}, 4);
  for (int64_t window : {int64_t(-1), int64_t(5)}) {
    SCOPED_TRACE(::testing::Message() << "window " << window);
    Tensor out = empty({b, s, hq, d}), lse = empty_f32({b, hq, s});
    ops::attention_forward(out, lse, up(q), up(k), up(v), window, key_start.to(device()));
    Tensor dq = empty({b, s, hq, d}), dk = empty({b, s, hkv, d}), dv = empty({b, s, hkv, d});
    ops::attention_backward(dq, dk, dv, up(dout), up(q), up(k), up(v), out, lse, window,
                            key_start.to(device()));
    const std::vector<double> all_out = values(out), all_lse = values(lse), all_dq = values(dq),
                              all_dk = values(dk), all_dv = values(dv);
    for (int64_t seq = 0; seq < b; ++seq) {
      int64_t first = 0;
      for (int64_t len : docs[size_t(seq)]) {
        SCOPED_TRACE(::testing::Message() << "sequence " << seq << " document at " << first);
        Tensor o = empty({1, len, hq, d}), l = empty_f32({1, hq, len});
        const Tensor qd = up(rows_of(q, seq, first, len)), kd = up(rows_of(k, seq, first, len)),
                     vd = up(rows_of(v, seq, first, len));
        ops::attention_forward(o, l, qd, kd, vd, window);
        Tensor gq = empty({1, len, hq, d}), gk = empty({1, len, hkv, d}),
               gv = empty({1, len, hkv, d});
        ops::attention_backward(gq, gk, gv, up(rows_of(dout, seq, first, len)), qd, kd, vd, o, l,
                                window);
        const Tolerance t = tol({1e-6, 1e-5}, {1e-2, 1e-2});
        const Tolerance tg = tol({1e-5, 1e-4}, {3e-2, 2e-2});
        EXPECT_TRUE(
            all_close(o, slice_values(all_out, (seq * s + first) * hq * d, len * hq * d), t));
        EXPECT_TRUE(
            all_close(gq, slice_values(all_dq, (seq * s + first) * hq * d, len * hq * d), tg));
        EXPECT_TRUE(
            all_close(gk, slice_values(all_dk, (seq * s + first) * hkv * d, len * hkv * d), tg));
        EXPECT_TRUE(
            all_close(gv, slice_values(all_dv, (seq * s + first) * hkv * d, len * hkv * d), tg));
        std::vector<double> want_lse;
        for (int64_t h = 0; h < hq; ++h) {
          const auto row = slice_values(all_lse, (seq * hq + h) * s + first, len);
          want_lse.insert(want_lse.end(), row.begin(), row.end());
        }
        EXPECT_TRUE(all_close(l, want_lse, t));
        first += len;
      }
    }
  }
}

TEST_P(DocumentMasking, TrailingQueriesSeeTheirDocumentOfTheWholeSequence) {
  // Context parallelism's chunks: the last Sq of Sk positions, key_start over a longer sequence
  // (its row stride ld > Sk), equal the last rows of the whole masked attention; backward with
  // the output gradient zero on the other rows, its dq's last rows and all of its dk and dv;
  // with and without a window.
  const int64_t b = 2, s = 40, sq = 11, ld = 64, hq = 2, hkv = 1, d = 8;
  const Tensor key_start = key_start_of({{12, 20, 32}, {29, 3, 32}}, ld);
  Tensor q = random_tensor({b, s, hq, d}, 10, 2.0f), k = random_tensor({b, s, hkv, d}, 11, 2.0f);
  Tensor v = random_tensor({b, s, hkv, d}, 12), dout = random_tensor({b, s, hq, d}, 13);
  // The trailing rows of a [B, S, H, D] host tensor as [B, sq, H, D], and the whole with the
  // leading rows zeroed.
  auto trailing = [&](const Tensor& t) {
    const int64_t row = t.size(2) * t.size(3);
    Tensor out = Tensor::empty({b, sq, t.size(2), t.size(3)}, DType::f32);
    for (int64_t i = 0; i < b; ++i)
      out.slice(i * sq * row, {sq * row}).copy_from(t.slice((i * s + s - sq) * row, {sq * row}));
    return out;
  };
  Tensor dout_masked = Tensor::zeros(dout.shape(), DType::f32);
  for (int64_t i = 0; i < b; ++i) {
    dout_masked.slice((i * s + s - sq) * hq * d, {sq * hq * d})
        .copy_from(dout.slice((i * s + s - sq) * hq * d, {sq * hq * d}));
  }
  for (int64_t window : {int64_t(-1), int64_t(5)}) {
    SCOPED_TRACE(::testing::Message() << "window " << window);
    const Tensor starts = key_start.to(device());
    Tensor out = empty({b, s, hq, d}), lse = empty_f32({b, hq, s});
    ops::attention_forward(out, lse, up(q), up(k), up(v), window, starts);
    Tensor dq = empty({b, s, hq, d}), dk = empty({b, s, hkv, d}), dv = empty({b, s, hkv, d});
    ops::attention_backward(dq, dk, dv, up(dout_masked), up(q), up(k), up(v), out, lse, window,
                            starts);
    const Tensor q_tail = up(trailing(q));
    Tensor out_t = empty({b, sq, hq, d}), lse_t = empty_f32({b, hq, sq});
    ops::attention_forward(out_t, lse_t, q_tail, up(k), up(v), window, starts);
    Tensor dq_t = empty({b, sq, hq, d}), dk_t = empty({b, s, hkv, d}), dv_t = empty({b, s, hkv, d});
    ops::attention_backward(dq_t, dk_t, dv_t, up(trailing(dout)), q_tail, up(k), up(v), out_t,
                            lse_t, window, starts);
    const Tolerance t = tol({1e-6, 1e-5}, {1e-2, 1e-2}), tg = tol({1e-5, 1e-4}, {3e-2, 2e-2});
    EXPECT_TRUE(all_close(out_t, values(trailing(download(out))), t));
    EXPECT_TRUE(all_close(dq_t, values(trailing(download(dq))), tg));
    EXPECT_TRUE(all_close(dk_t, values(dk), tg));
    EXPECT_TRUE(all_close(dv_t, values(dv), tg));
  }
}

TEST_P(DocumentMasking, BackwardMatchesFiniteDifferences) {
  const int64_t b = 2, s = 21, hq = 4, hkv = 2, d = 8;
  const Tensor key_start = key_start_of({{5, 9, 7}, {1, 20}}, s);
  GradCheck g;
  g.inputs = {random_tensor({b, s, hq, d}, 20, 1.5f), random_tensor({b, s, hkv, d}, 21, 1.5f),
              random_tensor({b, s, hkv, d}, 22)};
  g.wrt = {0, 1, 2};
  g.samples = 32;
  auto forward = [=](const Tensors& in, Tensor& out, Tensor& lse) {
    out = empty_as(in[0], {b, s, hq, d});
    lse = f32_as(in[0], {b, hq, s});
    ops::attention_forward(out, lse, in[0], in[1], in[2], -1, key_start.to(in[0].device()));
  };
  g.forward = [=](const Tensors& in) {
    Tensor out, lse;
    forward(in, out, lse);
    return out;
  };
  g.backward = [=](const Tensors& in, const Tensor& dout) {
    Tensor out, lse;
    forward(in, out, lse);
    Tensor dq = empty_as(in[0], in[0].shape()), dk = empty_as(in[0], in[1].shape()),
           dv = empty_as(in[0], in[2].shape());
    ops::attention_backward(dq, dk, dv, dout, in[0], in[1], in[2], out, lse, -1,
                            key_start.to(in[0].device()));
    return Tensors{dq, dk, dv};
  };
  g.step = 1e-2;
  g.f32_tol = {2e-3, 3e-3};
  check_gradients(GetParam(), g);
}

TEST_P(DocumentMasking, KeyStartOfTheWrongShapeOrDtypeIsAnError) {
  Tensor q = up(random_tensor({2, 5, 2, 8}, 30));
  Tensor out = empty({2, 5, 2, 8}), lse = empty_f32({2, 2, 5});
  const Tensor shorter = Tensor::zeros({2, 4}, DType::i32).to(device());
  const Tensor one_row = Tensor::zeros({1, 5}, DType::i32).to(device());
  const Tensor floats = Tensor::zeros({2, 5}, DType::f32).to(device());
  for (const Tensor& bad : {shorter, one_row, floats}) {
    EXPECT_THROW(ops::attention_forward(out, lse, q, q, q, -1, bad), Error);
  }
  if (!device().is_cpu()) return;  // the CPU kernels check the values too
  for (const std::vector<int32_t>& row : {std::vector<int32_t>{0, 0, 3, 1, 1},  // decreasing
                                          std::vector<int32_t>{0, 2, 2, 2, 2},  // past p = 1
                                          std::vector<int32_t>{1, 1, 1, 1, 1}}) {
    Tensor bad = Tensor::zeros({2, 5}, DType::i32);
    for (int64_t p = 0; p < 5; ++p) bad.data_ptr<int32_t>()[5 + p] = row[size_t(p)];
    EXPECT_THROW(ops::attention_forward(out, lse, q, q, q, -1, bad), Error);
  }
}

TEST_P(DocumentMasking, RopeAtEachTokensPositionEqualsRopeOfEachRowAtItsOffset) {
  const int64_t b = 2, s = 9, h = 3, d = 16, offset = 4;
  const ops::RotaryFrequencies rotary{10000.0f};
  Tensor x = random_tensor({b, s, h, d}, 40);
  Tensor positions = Tensor::empty({b, s}, DType::i32);
  const int32_t own[] = {0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 0, 7};
  for (int64_t i = 0; i < b * s; ++i) positions.data_ptr<int32_t>()[i] = own[i];
  Tensor out = empty({b, s, h, d});
  ops::rope_forward(out, up(x), rotary, offset, positions.to(device()));
  Tensor back = empty({b, s, h, d});
  ops::rope_backward(back, out, rotary, offset, positions.to(device()));
  const std::vector<double> all = values(out);
  for (int64_t i = 0; i < b * s; ++i) {
    SCOPED_TRACE(::testing::Message() << "row " << i << " at position " << own[i]);
    Tensor row = empty({1, 1, h, d});
    ops::rope_forward(row, up(rows_of(x, i / s, i % s, 1)), rotary, offset + own[i]);
    EXPECT_EQ(values(row), slice_values(all, i * h * d, h * d));
  }
  EXPECT_TRUE(all_close(back, values(seen(x)), tol({1e-6, 1e-5}, {2e-2, 2e-2})));
  EXPECT_THROW(
      ops::rope_forward(out, up(x), rotary, 0, Tensor::zeros({b, s - 1}, DType::i32).to(device())),
      Error);
}

BRAID_KERNEL_TEST_SUITE(DocumentMasking);

}  // namespace
}  // namespace braid::testing
