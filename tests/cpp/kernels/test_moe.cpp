// Mixture of experts: top-k routing against a sort-based double reference (tie rule, both
// probability recipes, score sums) and its gradient against finite differences; the token
// dispatch gather, the weighted combine and its weight gradient against double references and
// against finite differences of the combine; their argument checks.
#include <algorithm>
#include <cstdlib>
#include <limits>
#include <numeric>

#include "kernel_test_util.h"

namespace braid::testing {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// ---------------------------------------------------------------- host tensors

Tensor f32_tensor(const Shape& shape, const std::vector<double>& v) {
  Tensor t = Tensor::empty(shape, DType::f32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data_ptr<float>()[i] = float(v[size_t(i)]);
  return t;
}

Tensor i32_tensor(const Shape& shape, const std::vector<int32_t>& v) {
  Tensor t = Tensor::empty(shape, DType::i32);
  std::copy(v.begin(), v.end(), t.data_ptr<int32_t>());
  return t;
}

// A host f32 tensor of one value (NaN: garbage an output must overwrite).
Tensor filled(const Shape& shape, float value) {
  Tensor t = Tensor::empty(shape, DType::f32);
  std::fill_n(t.data_ptr<float>(), t.numel(), value);
  return t;
}

// Any i32 tensor as a host vector.
std::vector<int32_t> ints(const Tensor& t) {
  Tensor h = t.to(Device::cpu());
  return std::vector<int32_t>(h.data_ptr<int32_t>(), h.data_ptr<int32_t>() + h.numel());
}

// The indices that sort x[0, n) ascending: a random permutation for random x.
std::vector<int32_t> argsort(const float* x, int64_t n) {
  std::vector<int32_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return x[a] < x[b]; });
  return order;
}

std::vector<int32_t> permutation(int64_t n, uint64_t seed) {
  Tensor r = random_tensor({n}, seed);
  return argsort(r.data_ptr<float>(), n);
}

// ---------------------------------------------------------------- routing reference

std::vector<double> softmax(const double* x, int64_t n) {
  const double m = *std::max_element(x, x + n);
  std::vector<double> s(static_cast<size_t>(n));
  double sum = 0;
  for (int64_t e = 0; e < n; ++e) sum += s[size_t(e)] = std::exp(x[e] - m);
  for (double& v : s) v /= sum;
  return s;
}

// The k experts of a row by a full sort: larger logits first, equal logits the lower expert.
std::vector<int32_t> top_k(const double* row, int64_t n, int64_t k) {
  std::vector<int32_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int32_t a, int32_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
  order.resize(size_t(k));
  return order;
}

// probs of one token for a fixed choice of experts.
std::vector<double> route_probs(const double* row, int64_t n, const int32_t* chosen, int64_t k,
                                bool softmax_first) {
  std::vector<double> p(static_cast<size_t>(k));
  if (softmax_first) {
    const std::vector<double> s = softmax(row, n);
    for (int64_t j = 0; j < k; ++j) p[size_t(j)] = s[size_t(chosen[j])];
  } else {
    std::vector<double> top(static_cast<size_t>(k));
    for (int64_t j = 0; j < k; ++j) top[size_t(j)] = row[chosen[j]];
    p = softmax(top.data(), k);
  }
  return p;
}

struct Routing {
  std::vector<int32_t> experts;
  std::vector<double> probs, score_sums;
};

Routing route(const std::vector<double>& logits, int64_t t_count, int64_t n, int64_t k,
              bool softmax_first) {
  Routing r;
  r.score_sums.assign(size_t(n), 0.0);
  for (int64_t t = 0; t < t_count; ++t) {
    const double* row = logits.data() + t * n;
    const std::vector<int32_t> chosen = top_k(row, n, k);
    const std::vector<double> p = route_probs(row, n, chosen.data(), k, softmax_first);
    r.experts.insert(r.experts.end(), chosen.begin(), chosen.end());
    r.probs.insert(r.probs.end(), p.begin(), p.end());
    const std::vector<double> s = softmax(row, n);
    for (int64_t e = 0; e < n; ++e) r.score_sums[size_t(e)] += s[size_t(e)];
  }
  return r;
}

// One token's share of L = sum(dprobs * probs) + sum_e aux[e] softmax(logits)[e], the experts
// held fixed; aux may be nullptr.
double token_loss(const double* row, int64_t n, const int32_t* chosen, int64_t k, const double* g,
                  const double* aux, bool softmax_first) {
  const std::vector<double> p = route_probs(row, n, chosen, k, softmax_first);
  double loss = 0;
  for (int64_t j = 0; j < k; ++j) loss += g[j] * p[size_t(j)];
  if (aux != nullptr) {
    const std::vector<double> s = softmax(row, n);
    for (int64_t e = 0; e < n; ++e) loss += aux[e] * s[size_t(e)];
  }
  return loss;
}

// dL/dlogits by central differences in double (h = 1e-5: truncation and rounding ~1e-10).
std::vector<double> router_gradient_fd(const std::vector<double>& logits, int64_t t_count,
                                       int64_t n, int64_t k, const std::vector<int32_t>& experts,
                                       const std::vector<double>& dprobs,
                                       const std::vector<double>& aux, bool softmax_first) {
  const double h = 1e-5;
  std::vector<double> grad(size_t(t_count * n));
  for (int64_t t = 0; t < t_count; ++t) {
    std::vector<double> row(logits.begin() + t * n, logits.begin() + (t + 1) * n);
    auto loss = [&] {
      return token_loss(row.data(), n, experts.data() + t * k, k, dprobs.data() + t * k,
                        aux.empty() ? nullptr : aux.data(), softmax_first);
    };
    for (int64_t e = 0; e < n; ++e) {
      const double orig = row[size_t(e)];
      row[size_t(e)] = orig + h;
      const double up = loss();
      row[size_t(e)] = orig - h;
      const double down = loss();
      row[size_t(e)] = orig;
      grad[size_t(t * n + e)] = (up - down) / (2 * h);
    }
  }
  return grad;
}

// Logits whose values within a row are at least spacing / 2 >= 0.05 apart (a shuffled ladder
// with jitter): a finite-difference step of 1e-2 never changes the selection or its order.
Tensor separated_logits(int64_t t_count, int64_t n, uint64_t seed) {
  const double spacing = std::max(0.1, 6.0 / double(n));
  Tensor r = random_tensor({t_count, n}, seed),
         jitter = random_tensor({t_count, n}, seed + 1, 0.25f);
  Tensor x = Tensor::empty({t_count, n}, DType::f32);
  for (int64_t t = 0; t < t_count; ++t) {
    const std::vector<int32_t> order = argsort(r.data_ptr<float>() + t * n, n);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t e = t * n + order[size_t(i)];
      x.data_ptr<float>()[e] =
          float(spacing * (double(i) - double(n) / 2 + jitter.data_ptr<float>()[e]));
    }
  }
  return x;
}

struct RouterShape {
  int64_t t, e, k;
};

// ---------------------------------------------------------------- routing

// The router computes in f32 whatever the activation dtype: one case per device.
class MoeRouter : public KernelTest {};

std::vector<KernelCase> f32_cases() {
  std::vector<KernelCase> cases;
  for (const KernelCase& c : kernel_cases()) {
    if (c.dtype == DType::f32) cases.push_back(c);
  }
  return cases;
}

TEST_P(MoeRouter, ForwardMatchesSortedReference) {
  // k = 1, k = E, E = 1, E not a multiple of 32, E = 128, many tokens (CPU threads, several
  // CUDA column splits of the score sums), k > 32 (choices beyond one warp's lanes), no tokens.
  const std::vector<RouterShape> shapes = {{37, 8, 2},    {5, 1, 1},   {9, 7, 7},    {13, 7, 3},
                                           {33, 60, 4},   {19, 60, 1}, {21, 128, 8}, {600, 64, 6},
                                           {3, 1000, 40}, {0, 16, 2}};
  uint64_t seed = 1;
  for (const RouterShape& s : shapes) {
    Tensor x = random_tensor({s.t, s.e}, seed++, 4.0f);
    const std::vector<double> xv = values(x);
    for (bool softmax_first : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "T " << s.t << " E " << s.e << " k " << s.k
                                        << " softmax_first " << softmax_first);
      const Routing want = route(xv, s.t, s.e, s.k, softmax_first);
      Tensor probs = up_f32(filled({s.t, s.k}, kNaN));
      Tensor experts =
          i32_tensor({s.t, s.k}, std::vector<int32_t>(size_t(s.t * s.k), -7)).to(device());
      Tensor sums = up_f32(filled({s.e}, kNaN));
      ops::moe_router_forward(probs, experts, sums, up_f32(x), softmax_first);
      EXPECT_EQ(ints(experts), want.experts);
      EXPECT_TRUE(all_close(probs, want.probs, {1e-6, 1e-5}));
      EXPECT_TRUE(all_close(sums, want.score_sums, {2e-5, 5e-5}));  // f32 sums of 600 on CUDA
      // Without score sums: the same routing.
      Tensor probs2 = up_f32(filled({s.t, s.k}, kNaN));
      Tensor experts2 = Tensor::zeros({s.t, s.k}, DType::i32, device());
      ops::moe_router_forward(probs2, experts2, Tensor(), up_f32(x), softmax_first);
      EXPECT_EQ(ints(experts2), want.experts);
      EXPECT_TRUE(all_close(probs2, values(probs), {0, 0}));
    }
  }
}

TEST_P(MoeRouter, TiesGoToTheLowerExpert) {
  // E = 60, k = 5; tied experts in different warp lanes and on both sides of the k-th place.
  const int64_t n = 60, k = 5;
  std::vector<double> x(4 * n);
  std::fill(x.begin(), x.begin() + n, 0.5);  // row 0: all equal
  std::fill(x.begin() + n, x.begin() + 2 * n, -1.0);
  x[n + 37] = x[n + 5] = 2.0;
  x[n + 40] = x[n + 8] = x[n + 59] = 1.0;
  std::fill(x.begin() + 2 * n, x.begin() + 3 * n, -3.0);  // row 2: -0 equals +0
  x[2 * n + 33] = -0.0;
  x[2 * n + 2] = 0.0;
  x[2 * n + 50] = 0.0;
  std::fill(x.begin() + 3 * n, x.end(), -1.0);  // row 3: a tie across the k-th place
  x[3 * n + 10] = 3.0;
  x[3 * n + 52] = x[3 * n + 45] = x[3 * n + 30] = x[3 * n + 20] = x[3 * n + 7] = 2.0;
  // Worked out by hand, independently of the reference's sort.
  const std::vector<int32_t> hand = {0, 1,  2,  3, 4, 5,  37, 8,  40, 59,
                                     2, 33, 50, 0, 1, 10, 7,  20, 30, 45};
  for (bool softmax_first : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "softmax_first " << softmax_first);
    const Routing want = route(x, 4, n, k, softmax_first);
    ASSERT_EQ(want.experts, hand);
    Tensor probs = empty_f32({4, k}), experts = Tensor::zeros({4, k}, DType::i32, device());
    Tensor sums = empty_f32({n});
    ops::moe_router_forward(probs, experts, sums, up_f32(f32_tensor({4, n}, x)), softmax_first);
    EXPECT_EQ(ints(experts), hand);
    EXPECT_TRUE(all_close(probs, want.probs, {1e-6, 1e-5}));
    EXPECT_TRUE(all_close(sums, want.score_sums, {1e-5, 1e-5}));
  }
  // k = E with every logit equal: the experts in index order, uniform probabilities.
  Tensor probs = empty_f32({2, 7}), experts = Tensor::zeros({2, 7}, DType::i32, device());
  ops::moe_router_forward(probs, experts, Tensor(), up_f32(filled({2, 7}, 1.25f)), false);
  EXPECT_EQ(ints(experts), std::vector<int32_t>({0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6}));
  EXPECT_TRUE(all_close(probs, std::vector<double>(14, 1.0 / 7), {1e-7, 1e-6}));
}

TEST_P(MoeRouter, NoTokensGiveZeroScoreSums) {
  for (bool softmax_first : {false, true}) {
    Tensor sums = up_f32(filled({16}, kNaN));
    ops::moe_router_forward(empty_f32({0, 2}), Tensor::empty({0, 2}, DType::i32, device()), sums,
                            empty_f32({0, 16}), softmax_first);
    EXPECT_TRUE(all_close(sums, std::vector<double>(16, 0.0), {0, 0}));
    ops::moe_router_backward(empty_f32({0, 16}), empty_f32({0, 2}), empty_f32({0, 16}),
                             Tensor::empty({0, 2}, DType::i32, device()), softmax_first,
                             zeros_f32({16}));
  }
}

TEST_P(MoeRouter, BackwardMatchesFiniteDifferencesOfTheReference) {
  const std::vector<RouterShape> shapes = {{13, 7, 3}, {9, 60, 4},  {5, 8, 8},
                                           {4, 1, 1},  {6, 128, 8}, {3, 1000, 40}};
  uint64_t seed = 20;
  for (const RouterShape& s : shapes) {
    Tensor x = separated_logits(s.t, s.e, seed);
    Tensor dprobs = random_tensor({s.t, s.k}, seed + 2), aux = random_tensor({s.e}, seed + 3);
    seed += 4;
    const std::vector<double> xv = values(x), gv = values(dprobs), av = values(aux);
    for (bool softmax_first : {false, true}) {
      for (bool with_aux : {false, true}) {
        SCOPED_TRACE(::testing::Message()
                     << "T " << s.t << " E " << s.e << " k " << s.k << " softmax_first "
                     << softmax_first << " aux " << with_aux);
        const std::vector<int32_t> experts = route(xv, s.t, s.e, s.k, softmax_first).experts;
        const std::vector<double> want = router_gradient_fd(
            xv, s.t, s.e, s.k, experts, gv, with_aux ? av : std::vector<double>(), softmax_first);
        Tensor dlogits = up_f32(filled({s.t, s.e}, kNaN));
        ops::moe_router_backward(dlogits, up_f32(dprobs), up_f32(x),
                                 i32_tensor({s.t, s.k}, experts).to(device()), softmax_first,
                                 with_aux ? up_f32(aux) : Tensor());
        EXPECT_TRUE(all_close(dlogits, want, {2e-6, 1e-5}));
        if (softmax_first || with_aux) continue;
        // Only the chosen experts' logits move the probabilities: the rest are exactly zero.
        const std::vector<double> got = values(dlogits);
        int64_t nonzero = 0;
        for (int64_t t = 0; t < s.t; ++t) {
          for (int64_t e = 0; e < s.e; ++e) {
            const auto first = experts.begin() + t * s.k, last = first + s.k;
            if (std::find(first, last, int32_t(e)) == last && got[size_t(t * s.e + e)] != 0.0) {
              ++nonzero;
            }
          }
        }
        EXPECT_EQ(nonzero, 0) << "entries of unchosen experts that are not 0";
      }
    }
  }
}

// End to end through the op's own forward (f32 finite differences, the repo's GradCheck): the
// objective sum(w * [probs, score_sums]) has dprobs = w[:T k] and aux_grad = w[T k:].
TEST_P(MoeRouter, BackwardIsTheGradientOfTheForward) {
  for (const RouterShape& s : std::vector<RouterShape>{{5, 7, 3}, {6, 60, 4}}) {
    for (bool softmax_first : {false, true}) {
      for (bool with_aux : {false, true}) {
        SCOPED_TRACE(::testing::Message()
                     << "E " << s.e << " softmax_first " << softmax_first << " aux " << with_aux);
        auto route_on = [s, softmax_first](const Tensor& logits, const Tensor& sums) {
          Tensor probs = f32_as(logits, {s.t, s.k});
          Tensor experts = Tensor::empty({s.t, s.k}, DType::i32, logits.device());
          ops::moe_router_forward(probs, experts, sums, logits, softmax_first);
          return std::make_pair(probs, experts);
        };
        GradCheck g;
        g.inputs = {separated_logits(s.t, s.e, 40 + uint64_t(s.e))};
        g.wrt = {0};
        g.samples = 64;
        g.f32_tol = {1e-3, 2e-3};
        g.forward = [s, with_aux, route_on](const Tensors& in) {
          Tensor sums = with_aux ? f32_as(in[0], {s.e}) : Tensor();
          Tensor probs = route_on(in[0], sums).first;
          if (!with_aux) return probs;
          std::vector<double> v = values(probs), sv = values(sums);
          v.insert(v.end(), sv.begin(), sv.end());
          return f32_tensor({s.t * s.k + s.e}, v);
        };
        g.backward = [s, with_aux, softmax_first, route_on](const Tensors& in, const Tensor& w) {
          const Tensor experts = route_on(in[0], Tensor()).second;
          const std::vector<double> wv = values(w);
          const auto split = wv.begin() + s.t * s.k;
          Tensor dprobs = f32_tensor({s.t, s.k}, std::vector<double>(wv.begin(), split));
          Tensor aux =
              with_aux ? f32_tensor({s.e}, std::vector<double>(split, wv.end())) : Tensor();
          Tensor dlogits = f32_as(in[0], {s.t, s.e});
          ops::moe_router_backward(dlogits, dprobs.to(in[0].device()), in[0], experts,
                                   softmax_first,
                                   aux.defined() ? aux.to(in[0].device()) : Tensor());
          return Tensors{dlogits};
        };
        check_gradients(GetParam(), g);
      }
    }
  }
}

TEST_P(MoeRouter, BadArgumentsNameTheOp) {
  auto i32 = [&](const Shape& shape) { return Tensor::zeros(shape, DType::i32, device()); };
  Tensor logits = zeros_f32({4, 6}), probs = zeros_f32({4, 2}), experts = i32({4, 2});
  const char* fwd = "moe_router_forward";
  EXPECT_TRUE(raises([&] { ops::moe_router_forward(probs, probs, Tensor(), logits, false); },
                     "moe_router_forward: experts must be i32"));
  EXPECT_TRUE(raises(  // k > E
      [&] {
        ops::moe_router_forward(zeros_f32({4, 7}), i32({4, 7}), Tensor(), logits, false);
      },
      "moe_router_forward: experts"));
  EXPECT_TRUE(raises(  // k = 0
      [&] {
        ops::moe_router_forward(zeros_f32({4, 0}), i32({4, 0}), Tensor(), logits, false);
      },
      "moe_router_forward: experts"));
  EXPECT_TRUE(raises(
      [&] {
        ops::moe_router_forward(zeros_f32({5, 2}), i32({5, 2}), Tensor(), logits, true);
      },
      "moe_router_forward: experts"));
  EXPECT_TRUE(raises(
      [&] {
        ops::moe_router_forward(zeros_f32({4, 3}), experts, Tensor(), logits, false);
      },
      "moe_router_forward: probs"));
  EXPECT_TRUE(
      raises([&] { ops::moe_router_forward(probs, experts, zeros_f32({7}), logits, false); },
             "moe_router_forward: score_sums"));
  EXPECT_TRUE(raises(
      [&] {
        ops::moe_router_forward(probs, experts, Tensor(),
                                Tensor::zeros({4, 6}, DType::bf16, device()), false);
      },
      "moe_router_forward: logits must be f32"));
  EXPECT_TRUE(raises(
      [&] {
        ops::moe_router_forward(probs, experts, Tensor(), zeros_f32({4, 1025}), false);
      },
      fwd));
  EXPECT_TRUE(raises(
      [&] { ops::moe_router_forward(probs, experts, Tensor(), zeros_f32({24}), false); }, fwd));
  EXPECT_TRUE(raises([&] { ops::moe_router_forward(probs, Tensor(), Tensor(), logits, false); },
                     "moe_router_forward: experts is undefined"));

  Tensor dlogits = zeros_f32({4, 6});
  const char* bwd = "moe_router_backward";
  EXPECT_TRUE(
      raises([&] { ops::moe_router_backward(dlogits, probs, logits, probs, false, Tensor()); },
             "moe_router_backward: experts must be i32"));
  EXPECT_TRUE(raises(  // k > E
      [&] {
        ops::moe_router_backward(dlogits, zeros_f32({4, 7}), logits, i32({4, 7}), true, Tensor());
      },
      bwd));
  EXPECT_TRUE(raises(
      [&] {
        ops::moe_router_backward(dlogits, zeros_f32({4, 3}), logits, experts, false, Tensor());
      },
      bwd));
  EXPECT_TRUE(raises(
      [&] {
        ops::moe_router_backward(zeros_f32({4, 5}), probs, logits, experts, false, Tensor());
      },
      "moe_router_backward: dlogits"));
  EXPECT_TRUE(raises(
      [&] { ops::moe_router_backward(dlogits, probs, logits, experts, false, zeros_f32({5})); },
      "moe_router_backward: aux_grad"));
}

INSTANTIATE_TEST_SUITE_P(Devices, MoeRouter, ::testing::ValuesIn(f32_cases()), kernel_case_name);

// ---------------------------------------------------------------- dispatch and combine

class MoeDispatch : public KernelTest {};

TEST_P(MoeDispatch, GatherRowsCopiesAndScalesRows) {
  const int64_t t_count = 6;
  const std::vector<int32_t> index = {3, 0, 3, 3, 5, 1, 0, 2};  // repeats; row 4 unused
  const int64_t n = int64_t(index.size());
  for (int64_t c : {24, 13}) {  // whole vector packs, and single elements
    Tensor x = random_tensor({t_count, c}, uint64_t(c)), scale = random_tensor({n}, 7, 2.0f);
    const std::vector<double> xv = values(seen(x)), sv = values(scale);
    for (bool scaled : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "C " << c << " scaled " << scaled);
      std::vector<double> want;
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t j = 0; j < c; ++j) {
          want.push_back((scaled ? sv[size_t(i)] : 1.0) * xv[size_t(index[size_t(i)] * c + j)]);
        }
      }
      Tensor out = up(filled({n, c}, kNaN));
      ops::gather_rows(out, up(x), up(i32_tensor({n}, index)), scaled ? up_f32(scale) : Tensor());
      // A copy is exact; a scaled row is one rounding of the product (twice in bf16).
      EXPECT_TRUE(all_close(out, want, scaled ? tol({0, 1e-7}, {0, 4e-3}) : Tolerance{0, 0}));
    }
  }
}

struct CombineCase {
  int64_t t, k, n, c;
  std::vector<int32_t> rows;  // empty: a permutation of the T k rows, as the dispatch plan makes
};

const std::vector<CombineCase>& combine_cases() {
  static const std::vector<CombineCase> cases = {
      {9, 1, 9, 40, {}},
      {7, 3, 21, 40, {}},
      {33, 3, 99, 13, {}},
      {5, 3, 4, 13, {0, 0, 0, 3, 1, 3, 2, 2, 1, 0, 3, 3, 1, 1, 1}},  // repeated rows
      {4, 1, 2, 16, {1, 1, 0, 1}},
  };
  return cases;
}

std::vector<int32_t> rows_of(const CombineCase& cc, uint64_t seed) {
  return cc.rows.empty() ? permutation(cc.t * cc.k, seed) : cc.rows;
}

TEST_P(MoeDispatch, CombineRowsSumsWeightedRows) {
  uint64_t seed = 10;
  for (const CombineCase& cc : combine_cases()) {
    const std::vector<int32_t> rows = rows_of(cc, seed);
    Tensor y = random_tensor({cc.n, cc.c}, seed + 1),
           weight = random_tensor({cc.t, cc.k}, seed + 2);
    seed += 3;
    const std::vector<double> yv = values(seen(y)), wv = values(weight);
    for (bool weighted : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "T " << cc.t << " k " << cc.k << " N " << cc.n << " C "
                                        << cc.c << " weighted " << weighted);
      std::vector<double> want(size_t(cc.t * cc.c), 0.0);
      for (int64_t t = 0; t < cc.t; ++t) {
        for (int64_t j = 0; j < cc.k; ++j) {
          const double f = weighted ? wv[size_t(t * cc.k + j)] : 1.0;
          const int32_t r = rows[size_t(t * cc.k + j)];
          for (int64_t i = 0; i < cc.c; ++i) {
            want[size_t(t * cc.c + i)] += f * yv[size_t(r * cc.c + i)];
          }
        }
      }
      Tensor out = up(filled({cc.t, cc.c}, kNaN));  // overwritten, not accumulated into
      ops::combine_rows(out, up(y), up(i32_tensor({cc.t, cc.k}, rows)),
                        weighted ? up_f32(weight) : Tensor());
      EXPECT_TRUE(all_close(out, want, tol({1e-6, 1e-5}, {1e-5, 8e-3})));
    }
  }
}

TEST_P(MoeDispatch, CombineRowsWeightGradIsADotProduct) {
  uint64_t seed = 30;
  std::vector<CombineCase> cases = combine_cases();
  cases.push_back({6, 2, 12, 520, {}});  // rows longer than one pass of a warp's packs
  for (const CombineCase& cc : cases) {
    SCOPED_TRACE(::testing::Message()
                 << "T " << cc.t << " k " << cc.k << " N " << cc.n << " C " << cc.c);
    const std::vector<int32_t> rows = rows_of(cc, seed);
    Tensor y = random_tensor({cc.n, cc.c}, seed + 1), dout = random_tensor({cc.t, cc.c}, seed + 2);
    seed += 3;
    const std::vector<double> yv = values(seen(y)), gv = values(seen(dout));
    std::vector<double> want;
    for (int64_t t = 0; t < cc.t; ++t) {
      for (int64_t j = 0; j < cc.k; ++j) {
        const int32_t r = rows[size_t(t * cc.k + j)];
        double dot = 0;
        for (int64_t i = 0; i < cc.c; ++i)
          dot += gv[size_t(t * cc.c + i)] * yv[size_t(r * cc.c + i)];
        want.push_back(dot);
      }
    }
    Tensor dweight = up_f32(filled({cc.t, cc.k}, kNaN));
    ops::combine_rows_weight_grad(dweight, up(dout), up(y), up(i32_tensor({cc.t, cc.k}, rows)));
    // bf16 inputs multiply exactly in f32: only the f32 accumulation differs from the reference.
    EXPECT_TRUE(all_close(dweight, want, {2e-5, 2e-5}));
  }
}

// The combine's gradients: combine_rows_weight_grad for the weights, and for y the gather of
// dout by each row's token, scaled by its weight (the rows are a permutation, so every row of y
// feeds exactly one token). Checked against finite differences of combine_rows (linear in both:
// exact up to rounding); for bf16 against the f32 CPU on the same rounded inputs.
TEST_P(MoeDispatch, CombineGradientsMatchFiniteDifferences) {
  for (int64_t k : {1, 3}) {
    SCOPED_TRACE(::testing::Message() << "k " << k);
    const int64_t t_count = 5, n = t_count * k, c = 16;
    GradCheck g;
    g.inputs = {random_tensor({n, c}, 50 + uint64_t(k)),
                i32_tensor({t_count, k}, permutation(n, 51 + uint64_t(k))),
                random_tensor({t_count, k}, 52 + uint64_t(k))};
    g.wrt = {0, 2};
    g.samples = 40;
    g.f32_tol = {1e-4, 1e-4};
    // The weights travel as activations in GradCheck; combine_rows wants them in f32.
    auto weight_f32 = [](const Tensor& w) { return upload(download(w), w.device(), DType::f32); };
    g.forward = [=](const Tensors& in) {
      Tensor out = empty_as(in[0], {t_count, c});
      ops::combine_rows(out, in[0], in[1], weight_f32(in[2]));
      return out;
    };
    g.backward = [=](const Tensors& in, const Tensor& dout) {
      const std::vector<int32_t> rows = ints(in[1]);
      const std::vector<double> wv = values(weight_f32(in[2]));
      std::vector<int32_t> token(static_cast<size_t>(n));
      std::vector<double> scale(static_cast<size_t>(n));
      for (int64_t p = 0; p < t_count * k; ++p) {
        token[size_t(rows[size_t(p)])] = int32_t(p / k);
        scale[size_t(rows[size_t(p)])] = wv[size_t(p)];
      }
      const Device d = in[0].device();
      Tensor dy = empty_as(in[0], {n, c});
      ops::gather_rows(dy, dout, i32_tensor({n}, token).to(d), f32_tensor({n}, scale).to(d));
      Tensor dweight = f32_as(in[0], {t_count, k});
      ops::combine_rows_weight_grad(dweight, dout, in[0], in[1]);
      return Tensors{dy, dweight};
    };
    check_gradients(GetParam(), g);
  }
}

TEST_P(MoeDispatch, ZeroSizedInputsDoNothing) {
  auto i32 = [&](const Shape& shape) { return Tensor::zeros(shape, DType::i32, device()); };
  Tensor x = up(random_tensor({6, 8}, 1));
  ops::gather_rows(empty({0, 8}), x, i32({0}), Tensor());
  ops::gather_rows(empty({0, 8}), x, i32({0}), zeros_f32({0}));
  ops::gather_rows(empty({0, 8}), empty({0, 8}), i32({0}), Tensor());
  ops::combine_rows(empty({0, 8}), x, i32({0, 2}), Tensor());
  ops::combine_rows(empty({0, 8}), empty({0, 8}), i32({0, 3}), zeros_f32({0, 3}));
  ops::combine_rows_weight_grad(zeros_f32({0, 2}), empty({0, 8}), x, i32({0, 2}));
}

TEST_P(MoeDispatch, BadArgumentsNameTheOp) {
  auto i32 = [&](const Shape& shape) { return Tensor::zeros(shape, DType::i32, device()); };
  const DType other = is_f32() ? DType::f16 : DType::f32;  // an activation dtype x is not
  Tensor x = zeros({6, 8}), index = i32({4}), out = zeros({4, 8});
  EXPECT_TRUE(raises([&] { ops::gather_rows(out, x, zeros_f32({4}), Tensor()); },
                     "gather_rows: index must be i32"));
  EXPECT_TRUE(raises(
      [&] {
        ops::gather_rows(zeros({4, 9}), x, index, Tensor());
      },
      "gather_rows: out"));
  EXPECT_TRUE(raises(
      [&] {
        ops::gather_rows(zeros({5, 8}), x, index, Tensor());
      },
      "gather_rows: out"));
  EXPECT_TRUE(raises(
      [&] {
        ops::gather_rows(Tensor::zeros({4, 8}, other, device()), x, index, Tensor());
      },
      "gather_rows: out"));
  EXPECT_TRUE(
      raises([&] { ops::gather_rows(out, x, index, zeros_f32({5})); }, "gather_rows: scale"));
  EXPECT_TRUE(
      raises([&] { ops::gather_rows(out, x, index, Tensor::zeros({4}, DType::bf16, device())); },
             "gather_rows: scale must be f32"));
  EXPECT_TRUE(
      raises([&] { ops::gather_rows(out, zeros({48}), index, Tensor()); }, "gather_rows: x"));
  EXPECT_TRUE(raises(
      [&] {
        ops::gather_rows(zeros({4, 2, 8}), x, i32({4, 2}), Tensor());
      },
      "gather_rows: index"));

  Tensor y = zeros({6, 8}), rows = i32({3, 2}), combined = zeros({3, 8});
  EXPECT_TRUE(raises(
      [&] {
        ops::combine_rows(combined, y, rows, zeros_f32({3, 3}));
      },
      "combine_rows: weight"));
  EXPECT_TRUE(raises(
      [&] {
        ops::combine_rows(combined, y, rows, Tensor::zeros({3, 2}, DType::bf16, device()));
      },
      "combine_rows: weight must be f32"));
  EXPECT_TRUE(raises(
      [&] {
        ops::combine_rows(zeros({2, 8}), y, rows, Tensor());
      },
      "combine_rows: out"));
  EXPECT_TRUE(raises(
      [&] {
        ops::combine_rows(zeros({3, 7}), y, rows, Tensor());
      },
      "combine_rows: out"));
  EXPECT_TRUE(raises(
      [&] {
        ops::combine_rows(combined, y, zeros_f32({3, 2}), Tensor());
      },
      "combine_rows: rows must be i32"));
  EXPECT_TRUE(
      raises([&] { ops::combine_rows(combined, y, i32({6}), Tensor()); }, "combine_rows: rows"));
  EXPECT_TRUE(raises(
      [&] {
        ops::combine_rows(Tensor::zeros({3, 8}, other, device()), y, rows, Tensor());
      },
      "combine_rows: out"));

  EXPECT_TRUE(raises(
      [&] {
        ops::combine_rows_weight_grad(zeros_f32({3, 3}), combined, y, rows);
      },
      "combine_rows_weight_grad: dweight"));
  EXPECT_TRUE(raises(
      [&] {
        ops::combine_rows_weight_grad(Tensor::zeros({3, 2}, DType::bf16, device()), combined, y,
                                      rows);
      },
      "combine_rows_weight_grad: dweight must be f32"));
  EXPECT_TRUE(raises(
      [&] {
        ops::combine_rows_weight_grad(zeros_f32({3, 2}), zeros({3, 7}), y, rows);
      },
      "combine_rows_weight_grad: dout"));
  EXPECT_TRUE(raises(
      [&] {
        ops::combine_rows_weight_grad(zeros_f32({3, 2}), Tensor::zeros({3, 8}, other, device()), y,
                                      rows);
      },
      "combine_rows_weight_grad: dout"));
}

BRAID_KERNEL_TEST_SUITE(MoeDispatch);

// The CPU rejects row indices outside their tensor (CUDA reads zero rows instead, see moe.cu).
TEST(MoeCpu, OutOfRangeRowsAreErrors) {
  Tensor x = random_tensor({5, 4}, 1), out = Tensor::empty({2, 4}, DType::f32);
  EXPECT_TRUE(raises(
      [&] {
        ops::gather_rows(out, x, i32_tensor({2}, {0, 5}), Tensor());
      },
      "gather_rows: index[1] = 5"));
  EXPECT_TRUE(raises(
      [&] {
        ops::gather_rows(out, x, i32_tensor({2}, {-1, 0}), Tensor());
      },
      "gather_rows: index[0] = -1"));
  Tensor y = random_tensor({3, 4}, 2);
  EXPECT_TRUE(raises(
      [&] {
        ops::combine_rows(out, y, i32_tensor({2, 2}, {0, 1, 2, 3}), Tensor());
      },
      "combine_rows: rows[1, 1] = 3"));
  EXPECT_TRUE(raises(
      [&] {
        ops::combine_rows_weight_grad(Tensor::empty({2, 2}, DType::f32), out, y,
                                      i32_tensor({2, 2}, {0, -2, 1, 2}));
      },
      "combine_rows_weight_grad: rows[0, 1] = -2"));
}

// The CPU computes activations in f32 only.
TEST(MoeCpu, Bf16IsNotSupported) {
  Tensor x = Tensor::empty({3, 4}, DType::bf16), index = i32_tensor({2}, {0, 1});
  EXPECT_TRUE(raises(
      [&] {
        ops::gather_rows(Tensor::empty({2, 4}, DType::bf16), x, index, Tensor());
      },
      "gather_rows: bf16 is not supported on cpu"));
  EXPECT_TRUE(raises(
      [&] {
        ops::combine_rows(Tensor::empty({1, 4}, DType::bf16), x, i32_tensor({1, 2}, {0, 1}),
                          Tensor());
      },
      "combine_rows: bf16 is not supported on cpu"));
}

// An empty sum (k = 0 choices, or rows of C = 0 columns) is zeros, as on CUDA.
TEST(MoeCpu, EmptySumsAreZeros) {
  auto all_zero = [](const Tensor& t) {
    const std::vector<double> got = values(t);
    return std::all_of(got.begin(), got.end(), [](double v) { return v == 0.0; });
  };
  Tensor out = filled({3, 4}, kNaN);
  ops::combine_rows(out, random_tensor({2, 4}, 1), Tensor::empty({3, 0}, DType::i32), Tensor());
  EXPECT_TRUE(all_zero(out)) << "combine_rows with k = 0";
  Tensor dweight = filled({3, 2}, kNaN);
  ops::combine_rows_weight_grad(dweight, Tensor::empty({3, 0}, DType::f32),
                                Tensor::empty({2, 0}, DType::f32),
                                Tensor::zeros({3, 2}, DType::i32));
  EXPECT_TRUE(all_zero(dweight)) << "combine_rows_weight_grad with C = 0";
}

}  // namespace
}  // namespace braid::testing
