// Mixture-of-experts routing: top-k routing against a sort-based double reference (tie rule;
// softmax, softmax-first and sigmoid scores; expert bias; group-limited routing; scaling factor;
// score sums per group of tokens; logsumexp), hand-worked cases, and its gradient against
// finite differences; its argument checks.
#include <algorithm>
#include <cstdlib>
#include <limits>
#include <numeric>

#include "moe_test_util.h"

namespace braid::testing {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// ---------------------------------------------------------------- routing reference
// ops.h's routing written out in double from its comment (Megatron's
// topk_routing_with_score_function, group_limited_topk, compute_routing_scores_for_aux_loss and
// z_loss_func), with full sorts.

using ops::MoeRouterSpec;

std::vector<double> softmax(const double* x, int64_t n) {
  const double m = *std::max_element(x, x + n);
  std::vector<double> s(static_cast<size_t>(n));
  double sum = 0;
  for (int64_t e = 0; e < n; ++e) sum += s[size_t(e)] = std::exp(x[e] - m);
  for (double& v : s) v /= sum;
  return s;
}

double sigmoid(double x) { return 1 / (1 + std::exp(-x)); }

double logsumexp(const double* x, int64_t n) {
  const double m = *std::max_element(x, x + n);
  double sum = 0;
  for (int64_t e = 0; e < n; ++e) sum += std::exp(x[e] - m);
  return m + std::log(sum);
}

// The k largest of x[0, n) among the `allowed` (empty: all) by a full sort: larger first, equal
// values the lower index.
std::vector<int32_t> top_k(const double* x, int64_t n, int64_t k,
                           const std::vector<bool>& allowed = {}) {
  std::vector<int32_t> order;
  for (int64_t e = 0; e < n; ++e) {
    if (allowed.empty() || allowed[size_t(e)]) order.push_back(int32_t(e));
  }
  std::sort(order.begin(), order.end(),
            [&](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); });
  order.resize(size_t(k));
  return order;
}

// What the top k of a row is taken of: the logits, s = softmax (softmax_first), or s =
// sigmoid plus the bias (empty: none).
std::vector<double> choice_scores(const double* row, int64_t n, const MoeRouterSpec& spec,
                                  const std::vector<double>& bias) {
  if (spec.softmax_first) return softmax(row, n);
  std::vector<double> c(row, row + n);
  if (!spec.sigmoid) return c;
  for (int64_t e = 0; e < n; ++e) {
    c[size_t(e)] = sigmoid(row[e]) + (bias.empty() ? 0.0 : bias[size_t(e)]);
  }
  return c;
}

// A row's k experts; group-limited: only among the group_topk groups whose k / group_topk
// largest choice scores sum highest.
std::vector<int32_t> choose(const double* row, int64_t n, int64_t k, const MoeRouterSpec& spec,
                            const std::vector<double>& bias) {
  const std::vector<double> c = choice_scores(row, n, spec, bias);
  std::vector<bool> allowed;
  if (spec.num_groups > 0) {
    const int64_t size = n / spec.num_groups, best = k / spec.group_topk;
    std::vector<double> group_score;
    for (int64_t g = 0; g < spec.num_groups; ++g) {
      std::vector<double> v(c.begin() + g * size, c.begin() + (g + 1) * size);
      std::sort(v.begin(), v.end(), std::greater<>());
      group_score.push_back(std::accumulate(v.begin(), v.begin() + best, 0.0));
    }
    allowed.assign(size_t(n), false);
    for (int32_t g : top_k(group_score.data(), spec.num_groups, spec.group_topk)) {
      std::fill_n(allowed.begin() + g * size, size, true);
    }
  }
  return top_k(c.data(), n, k, allowed);
}

// probs of one token for a fixed choice of experts.
std::vector<double> route_probs(const double* row, int64_t n, const int32_t* chosen, int64_t k,
                                const MoeRouterSpec& spec) {
  std::vector<double> p(static_cast<size_t>(k));
  if (spec.sigmoid) {
    double sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += p[size_t(j)] = sigmoid(row[chosen[j]]);
    if (k > 1) {
      for (double& v : p) v /= sum + 1e-20;
    }
  } else if (spec.softmax_first) {
    const std::vector<double> s = softmax(row, n);
    for (int64_t j = 0; j < k; ++j) p[size_t(j)] = s[size_t(chosen[j])];
  } else {
    std::vector<double> top(static_cast<size_t>(k));
    for (int64_t j = 0; j < k; ++j) top[size_t(j)] = row[chosen[j]];
    p = softmax(top.data(), k);
  }
  for (double& v : p) v *= spec.scaling_factor;
  return p;
}

// The load-balancing scores of a row: softmax, or sigmoid over its sum + 1e-20.
std::vector<double> balance_scores(const double* row, int64_t n, const MoeRouterSpec& spec) {
  if (!spec.sigmoid) return softmax(row, n);
  std::vector<double> s(static_cast<size_t>(n));
  double sum = 0;
  for (int64_t e = 0; e < n; ++e) sum += s[size_t(e)] = sigmoid(row[e]);
  for (double& v : s) v /= sum + 1e-20;
  return s;
}

struct Routing {
  std::vector<int32_t> experts;
  std::vector<double> probs, score_sums, lse;  // score_sums [sum_groups, E]
};

Routing route(const std::vector<double>& logits, int64_t t_count, int64_t n, int64_t k,
              const MoeRouterSpec& spec, const std::vector<double>& bias = {},
              int64_t sum_groups = 1) {
  Routing r;
  r.score_sums.assign(size_t(sum_groups * n), 0.0);
  for (int64_t t = 0; t < t_count; ++t) {
    const double* row = logits.data() + t * n;
    const std::vector<int32_t> chosen = choose(row, n, k, spec, bias);
    const std::vector<double> p = route_probs(row, n, chosen.data(), k, spec);
    r.experts.insert(r.experts.end(), chosen.begin(), chosen.end());
    r.probs.insert(r.probs.end(), p.begin(), p.end());
    const std::vector<double> s = balance_scores(row, n, spec);
    const int64_t group = t / (t_count / sum_groups);
    for (int64_t e = 0; e < n; ++e) r.score_sums[size_t(group * n + e)] += s[size_t(e)];
    r.lse.push_back(logsumexp(row, n));
  }
  return r;
}

// The terms of the loss whose gradient moe_router_backward gives; aux [G, E] may be empty.
struct RouterLoss {
  std::vector<double> dprobs, aux;
  double z_grad = 0;
};

// One token's share of L = sum(dprobs * probs) + sum_e aux[group of t, e] scores[e] + z_grad / 2
// lse^2, the experts held fixed; aux_row may be nullptr.
double token_loss(const double* row, int64_t n, const int32_t* chosen, int64_t k, const double* g,
                  const double* aux_row, double z_grad, const MoeRouterSpec& spec) {
  const std::vector<double> p = route_probs(row, n, chosen, k, spec);
  double loss = 0;
  for (int64_t j = 0; j < k; ++j) loss += g[j] * p[size_t(j)];
  if (aux_row != nullptr) {
    const std::vector<double> s = balance_scores(row, n, spec);
    for (int64_t e = 0; e < n; ++e) loss += aux_row[e] * s[size_t(e)];
  }
  const double lse = logsumexp(row, n);
  return loss + z_grad / 2 * lse * lse;
}

// dL/dlogits by central differences in double (h = 1e-5: truncation and rounding ~1e-10).
std::vector<double> router_gradient_fd(const std::vector<double>& logits, int64_t t_count,
                                       int64_t n, int64_t k, const std::vector<int32_t>& experts,
                                       const RouterLoss& l, const MoeRouterSpec& spec) {
  const double h = 1e-5;
  const int64_t per_group = l.aux.empty() ? 1 : t_count / (int64_t(l.aux.size()) / n);
  std::vector<double> grad(size_t(t_count * n));
  for (int64_t t = 0; t < t_count; ++t) {
    std::vector<double> row(logits.begin() + t * n, logits.begin() + (t + 1) * n);
    const double* aux_row = l.aux.empty() ? nullptr : l.aux.data() + (t / per_group) * n;
    auto loss = [&] {
      return token_loss(row.data(), n, experts.data() + t * k, k, l.dprobs.data() + t * k, aux_row,
                        l.z_grad, spec);
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

// An expert bias [n] that alone decides a sigmoid routing, for every token, with margins no
// finite-difference step of the logits can cross: shuffled groups spaced by more than a group's
// spread, shuffled experts 1.1 apart within a group, so the choice scores s + bias (s in (0, 1))
// are >= 0.1 apart and the groups' sums far apart.
Tensor dominant_bias(int64_t n, int64_t groups, uint64_t seed) {
  const int64_t size = n / std::max<int64_t>(groups, 1);
  const std::vector<int32_t> group_rank = permutation(n / size, seed);
  Tensor b = Tensor::empty({n}, DType::f32);
  for (int64_t g = 0; g < n / size; ++g) {
    const std::vector<int32_t> rank = permutation(size, seed + 1 + uint64_t(g));
    for (int64_t i = 0; i < size; ++i) {
      b.data_ptr<float>()[g * size + i] =
          float((1.1 * double(size) + 1) * group_rank[size_t(g)] + 1.1 * rank[size_t(i)]);
    }
  }
  return b;
}

struct RouterShape {
  int64_t t, e, k;
};

// The spec of a test case, named for SCOPED_TRACE.
struct NamedSpec {
  const char* name;
  MoeRouterSpec spec;
  bool bias = false;  // sigmoid only
};

const std::vector<NamedSpec>& score_functions() {
  static const std::vector<NamedSpec> specs = {
      {"softmax", {}},
      {"softmax_first", {.softmax_first = true}},
      {"sigmoid", {.sigmoid = true}},
      {"sigmoid+bias", {.sigmoid = true}, true},
      {"softmax x2.5", {.scaling_factor = 2.5f}},
      {"sigmoid+bias x2.5", {.sigmoid = true, .scaling_factor = 2.5f}, true},
  };
  return specs;
}

// ---------------------------------------------------------------- routing

// The router computes in f32 whatever the activation dtype: one case per device.
class MoeRouter : public KernelTest {
 protected:
  struct Outputs {
    Tensor probs, experts, score_sums, lse;
  };
  // moe_router_forward on the device under test into outputs that start as garbage (NaN,
  // -7); score sums [sum_groups, E] when sum_groups > 0, and lse when asked for.
  Outputs forward(const Tensor& logits, int64_t k, const MoeRouterSpec& spec,
                  const Tensor& bias = Tensor(), int64_t sum_groups = 1, bool lse = true) const {
    const int64_t t = logits.size(0), n = logits.size(1);
    Outputs o;
    o.probs = up_f32(filled({t, k}, kNaN));
    o.experts = i32_tensor({t, k}, std::vector<int32_t>(size_t(t * k), -7)).to(device());
    if (sum_groups > 0) o.score_sums = up_f32(filled({sum_groups, n}, kNaN));
    if (lse) o.lse = up_f32(filled({t}, kNaN));
    ops::moe_router_forward(o.probs, o.experts, o.score_sums, o.lse, up_f32(logits),
                            bias.defined() ? up_f32(bias) : Tensor(), spec);
    return o;
  }
  // The outputs against the reference: the same experts, and the values up to f32 rounding.
  static void expect_routing(const Outputs& got, const Routing& want) {
    EXPECT_EQ(ints(got.experts), want.experts);
    EXPECT_TRUE(all_close(got.probs, want.probs, {1e-6, 1e-5})) << "probs";
    if (got.score_sums.defined()) {  // f32 sums of up to 1200 tokens on CUDA
      EXPECT_TRUE(all_close(got.score_sums, want.score_sums, {2e-5, 5e-5})) << "score_sums";
    }
    if (got.lse.defined()) {
      EXPECT_TRUE(all_close(got.lse, want.lse, {2e-6, 1e-6})) << "lse";
    }
  }
};

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
    Tensor x = random_tensor({s.t, s.e}, seed++, 4.0f), bias = random_tensor({s.e}, seed++, 0.5f);
    const std::vector<double> xv = values(x), bv = values(bias);
    for (const NamedSpec& ns : score_functions()) {
      SCOPED_TRACE(::testing::Message()
                   << "T " << s.t << " E " << s.e << " k " << s.k << " " << ns.name);
      const Routing want = route(xv, s.t, s.e, s.k, ns.spec, ns.bias ? bv : std::vector<double>());
      const Outputs got = forward(x, s.k, ns.spec, ns.bias ? bias : Tensor());
      expect_routing(got, want);
      // Without score sums and lse: the same routing.
      const Outputs bare = forward(x, s.k, ns.spec, ns.bias ? bias : Tensor(), 0, false);
      EXPECT_EQ(ints(bare.experts), want.experts);
      EXPECT_TRUE(all_close(bare.probs, values(got.probs), {0, 0}));
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
  // Worked out by hand, independently of the reference's sort; equal logits give equal scores
  // whatever the score function.
  const std::vector<int32_t> hand = {0, 1,  2,  3, 4, 5,  37, 8,  40, 59,
                                     2, 33, 50, 0, 1, 10, 7,  20, 30, 45};
  for (const NamedSpec& ns : score_functions()) {
    if (ns.bias) continue;
    SCOPED_TRACE(ns.name);
    const Routing want = route(x, 4, n, k, ns.spec);
    ASSERT_EQ(want.experts, hand);
    expect_routing(forward(f32_tensor({4, n}, x), k, ns.spec), want);
  }
  // k = E with every logit equal: the experts in index order, uniform probabilities.
  const Outputs all = forward(filled({2, 7}, 1.25f), 7, {});
  EXPECT_EQ(ints(all.experts), std::vector<int32_t>({0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6}));
  EXPECT_TRUE(all_close(all.probs, std::vector<double>(14, 1.0 / 7), {1e-7, 1e-6}));
}

// Sigmoid routing by hand: probs are s at the chosen experts, normalised over them when k > 1
// only, times the scaling factor.
TEST_P(MoeRouter, SigmoidProbsAreNormalisedWhenKIsAboveOne) {
  const std::vector<double> x = {0.5, -1.0, 2.0, 1.5, -0.25, 1.0};
  const std::vector<double> s = {sigmoid(0.5), sigmoid(-1.0),  sigmoid(2.0),
                                 sigmoid(1.5), sigmoid(-0.25), sigmoid(1.0)};
  for (float scale : {1.0f, 2.5f}) {
    SCOPED_TRACE(::testing::Message() << "scaling_factor " << scale);
    const MoeRouterSpec spec{.sigmoid = true, .scaling_factor = scale};
    const Outputs k1 = forward(f32_tensor({1, 6}, x), 1, spec);
    EXPECT_EQ(ints(k1.experts), std::vector<int32_t>({2}));
    EXPECT_TRUE(all_close(k1.probs, {scale * s[2]}, {1e-7, 1e-6}));
    const Outputs k3 = forward(f32_tensor({1, 6}, x), 3, spec);
    EXPECT_EQ(ints(k3.experts), std::vector<int32_t>({2, 3, 5}));
    const double sum = s[2] + s[3] + s[5];
    EXPECT_TRUE(all_close(k3.probs, {scale * s[2] / sum, scale * s[3] / sum, scale * s[5] / sum},
                          {1e-7, 1e-6}));
  }
}

// The expert bias moves the choice (of s + bias) but not the probs (s at the chosen experts).
TEST_P(MoeRouter, ExpertBiasChangesTheChoiceNotTheProbs) {
  const std::vector<double> x = {2.0, 1.5, -1.0, 0.0, -0.5, 1.0, -2.0, 0.5};
  const std::vector<double> b = {0.0, 0.0, 0.9, 0.0, 0.6, 0.0, 0.0, 0.1};
  // s + b: 0.881, 0.818, 1.169, 0.5, 0.978, 0.731, 0.119, 0.722.
  const Tensor logits = f32_tensor({1, 8}, x), bias = f32_tensor({8}, b);
  const MoeRouterSpec spec{.sigmoid = true};
  EXPECT_EQ(ints(forward(logits, 3, spec).experts), std::vector<int32_t>({0, 1, 5}));
  const Outputs biased = forward(logits, 3, spec, bias);
  EXPECT_EQ(ints(biased.experts), std::vector<int32_t>({2, 4, 0}));
  const double s2 = sigmoid(-1.0), s4 = sigmoid(-0.5), s0 = sigmoid(2.0), sum = s2 + s4 + s0;
  EXPECT_TRUE(all_close(biased.probs, {s2 / sum, s4 / sum, s0 / sum}, {1e-7, 1e-6}));
  const Outputs top1 = forward(logits, 1, spec, bias);
  EXPECT_EQ(ints(top1.experts), std::vector<int32_t>({2}));
  EXPECT_TRUE(all_close(top1.probs, {s2}, {1e-7, 1e-6}));
  // The load-balancing scores do not see the bias either.
  EXPECT_TRUE(all_close(biased.score_sums, balance_scores(x.data(), 8, spec), {1e-7, 1e-6}));
}

// Group-limited routing by hand: expert 0 is the best single expert, but its group's sum of its
// two best scores loses to groups 1 and 2 under every score function, so the top 4 comes from
// groups 1 and 2 only; with a bias, group 3 wins and takes group 2's place.
TEST_P(MoeRouter, GroupLimitedRoutingSkipsTheLosingGroups) {
  const std::vector<double> x = {3.0,  -4.0, -4.5, 2.8, 2.6, -4.0,  // groups of 3
                                 -4.0, 2.7,  2.5,  2.0, 1.0, 0.0};
  // Group sums of the 2 best: logits -1, 5.4, 5.2, 3; exp 20.1, 29.9, 27.1, 10.1; sigmoid 0.971,
  // 1.874, 1.861, 1.612; sigmoid + bias (0.3 on experts 9 and 10) 0.971, 1.874, 1.861, 2.212.
  std::vector<double> b(12, 0.0);
  b[9] = b[10] = 0.3;
  const Tensor logits = f32_tensor({1, 12}, x), bias = f32_tensor({12}, b);
  const MoeRouterSpec groups{.num_groups = 4, .group_topk = 2};
  struct Case {
    const char* name;
    MoeRouterSpec spec;
    bool bias;
    std::vector<int32_t> plain, grouped;
  };
  const std::vector<Case> cases = {
      {"softmax", groups, false, {0, 3, 7, 4}, {3, 7, 4, 8}},
      {"softmax_first",
       {.softmax_first = true, .num_groups = 4, .group_topk = 2},
       false,
       {0, 3, 7, 4},
       {3, 7, 4, 8}},
      {"sigmoid",
       {.sigmoid = true, .num_groups = 4, .group_topk = 2},
       false,
       {0, 3, 7, 4},
       {3, 7, 4, 8}},
      {"sigmoid+bias",
       {.sigmoid = true, .num_groups = 4, .group_topk = 2},
       true,
       {9, 10, 0, 3},
       {9, 10, 3, 4}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    MoeRouterSpec plain = c.spec;
    plain.num_groups = plain.group_topk = 0;
    const Tensor bias_or_none = c.bias ? bias : Tensor();
    EXPECT_EQ(ints(forward(logits, 4, plain, bias_or_none).experts), c.plain);
    const Outputs got = forward(logits, 4, c.spec, bias_or_none);
    EXPECT_EQ(ints(got.experts), c.grouped);
    const Routing want = route(x, 1, 12, 4, c.spec, c.bias ? b : std::vector<double>());
    ASSERT_EQ(want.experts, c.grouped);
    expect_routing(got, want);
  }
  // Tied group sums (logits 2, 2, 1) go to the lower group: experts 0 and 1, not 2 and 4.
  const Tensor tied = f32_tensor({1, 6}, {1.0, 1.0, 0.5, 1.5, 2.0, -1.0});
  const Outputs got = forward(tied, 2, {.num_groups = 3, .group_topk = 1});
  EXPECT_EQ(ints(got.experts), std::vector<int32_t>({0, 1}));
  EXPECT_EQ(ints(forward(tied, 2, {}).experts), std::vector<int32_t>({4, 3}));
}

TEST_P(MoeRouter, GroupLimitedRoutingMatchesReference) {
  struct Case {
    int64_t t, e, k, groups, group_topk;
  };
  // One group; groups narrower than a warp's segments; 8 groups of 32 (DeepSeek-V3: 256
  // experts, top 4 groups, k = 8); more groups than lanes; groups of one expert; E = 1000.
  const std::vector<Case> cases = {{37, 8, 2, 4, 2},    {9, 60, 6, 1, 1},     {19, 90, 6, 6, 2},
                                   {13, 60, 6, 3, 3},   {21, 256, 8, 8, 4},   {600, 64, 6, 4, 2},
                                   {13, 128, 4, 64, 4}, {5, 1000, 40, 40, 8}, {4, 1024, 8, 1024, 8},
                                   {7, 96, 12, 48, 12}};
  uint64_t seed = 70;
  for (const Case& c : cases) {
    Tensor x = random_tensor({c.t, c.e}, seed++, 4.0f), bias = random_tensor({c.e}, seed++, 0.5f);
    const std::vector<double> xv = values(x), bv = values(bias);
    for (const NamedSpec& ns : score_functions()) {
      SCOPED_TRACE(::testing::Message() << "T " << c.t << " E " << c.e << " k " << c.k << " groups "
                                        << c.groups << " top " << c.group_topk << " " << ns.name);
      MoeRouterSpec spec = ns.spec;
      spec.num_groups = c.groups;
      spec.group_topk = c.group_topk;
      const Routing want = route(xv, c.t, c.e, c.k, spec, ns.bias ? bv : std::vector<double>());
      expect_routing(forward(x, c.k, spec, ns.bias ? bias : Tensor()), want);
    }
  }
}

// score_sums [G, E]: row g sums the scores of the g-th T / G consecutive tokens.
TEST_P(MoeRouter, ScoreSumsArePerGroupOfTokens) {
  const std::vector<RouterShape> shapes = {{24, 16, 2}, {1200, 40, 4}};
  uint64_t seed = 90;
  for (const RouterShape& s : shapes) {
    Tensor x = random_tensor({s.t, s.e}, seed++, 4.0f);
    const std::vector<double> xv = values(x);
    for (int64_t sum_groups : {1, 2, 3, 6, 24}) {
      for (bool sigmoid_scores : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "T " << s.t << " E " << s.e << " G " << sum_groups
                                          << " sigmoid " << sigmoid_scores);
        const MoeRouterSpec spec{.sigmoid = sigmoid_scores};
        const Routing want = route(xv, s.t, s.e, s.k, spec, {}, sum_groups);
        expect_routing(forward(x, s.k, spec, Tensor(), sum_groups), want);
      }
    }
  }
}

// lse is the logsumexp of each row, also where exp of the logits overflows f32.
TEST_P(MoeRouter, LseIsTheLogsumexpOfEachRow) {
  for (float scale : {4.0f, 200.0f}) {
    SCOPED_TRACE(::testing::Message() << "logits up to " << scale);
    Tensor x = random_tensor({40, 70}, 95, scale);
    const std::vector<double> xv = values(x);
    std::vector<double> want;
    for (int64_t t = 0; t < 40; ++t) want.push_back(logsumexp(xv.data() + t * 70, 70));
    for (const NamedSpec& ns : score_functions()) {
      const Outputs got = forward(x, 3, ns.spec, Tensor(), 0);
      EXPECT_TRUE(all_close(got.lse, want, {1e-6, 1e-6})) << ns.name;
    }
  }
}

TEST_P(MoeRouter, NoTokensGiveZeroScoreSums) {
  for (const NamedSpec& ns : score_functions()) {
    const Tensor bias = ns.bias ? zeros_f32({16}) : Tensor();
    for (int64_t sum_groups : {1, 3}) {
      Tensor sums = up_f32(filled({sum_groups, 16}, kNaN));
      ops::moe_router_forward(empty_f32({0, 2}), Tensor::empty({0, 2}, DType::i32, device()), sums,
                              empty_f32({0}), empty_f32({0, 16}), bias, ns.spec);
      EXPECT_TRUE(all_close(sums, std::vector<double>(size_t(sum_groups * 16), 0.0), {0, 0}));
      ops::moe_router_backward(empty_f32({0, 16}), empty_f32({0, 2}), empty_f32({0, 16}),
                               Tensor::empty({0, 2}, DType::i32, device()), ns.spec,
                               zeros_f32({sum_groups, 16}), 0.5f);
    }
  }
}

// Every part of the backward against central differences of the reference loss, the experts
// held fixed: each score function, k = 1 and k > 1, groups and bias (they only move the
// choice), the scaling factor, the load-balancing scores per group of tokens, the z-loss.
TEST_P(MoeRouter, BackwardMatchesFiniteDifferencesOfTheReference) {
  struct Case {
    int64_t t, e, k, groups, group_topk;
  };
  const std::vector<Case> cases = {{12, 7, 3, 0, 0},    {12, 8, 1, 4, 1}, {9, 60, 4, 6, 2},
                                   {6, 8, 8, 2, 2},     {4, 1, 1, 0, 0},  {6, 128, 8, 8, 4},
                                   {3, 1000, 40, 40, 8}};
  struct Variant {
    const char* name;
    bool groups, scaled;
    int64_t aux_groups;  // 0: no aux_grad; -1: one per token
    double z_grad;
  };
  const std::vector<Variant> variants = {{"plain", false, false, 0, 0},
                                         {"aux", false, false, 1, 0},
                                         {"groups x2.5", true, true, 0, 0},
                                         {"aux per token, z", false, false, -1, 0.7},
                                         {"all", true, true, 3, 0.7}};
  uint64_t seed = 20;
  for (const Case& c : cases) {
    Tensor x = separated_logits(c.t, c.e, seed), dprobs = random_tensor({c.t, c.k}, seed + 2),
           aux = random_tensor({c.t, c.e}, seed + 3), bias = random_tensor({c.e}, seed + 4, 0.5f);
    seed += 5;
    const std::vector<double> xv = values(x), gv = values(dprobs), av = values(aux),
                              bv = values(bias);
    for (const NamedSpec& ns : score_functions()) {
      for (const Variant& v : variants) {
        const int64_t aux_groups = v.aux_groups < 0 ? c.t : v.aux_groups;
        if ((v.groups && c.groups == 0) || (aux_groups > 0 && c.t % aux_groups != 0)) continue;
        SCOPED_TRACE(::testing::Message() << "T " << c.t << " E " << c.e << " k " << c.k << " "
                                          << ns.name << " " << v.name);
        MoeRouterSpec spec = ns.spec;
        if (v.groups) {
          spec.num_groups = c.groups;
          spec.group_topk = c.group_topk;
        }
        if (v.scaled) spec.scaling_factor = 2.5f;
        RouterLoss loss{gv, {}, v.z_grad};
        Tensor aux_grad;
        if (aux_groups > 0) {
          loss.aux.assign(av.begin(), av.begin() + aux_groups * c.e);
          aux_grad = f32_tensor({aux_groups, c.e}, loss.aux);
        }
        const std::vector<int32_t> experts =
            route(xv, c.t, c.e, c.k, spec, ns.bias ? bv : std::vector<double>()).experts;
        const std::vector<double> want = router_gradient_fd(xv, c.t, c.e, c.k, experts, loss, spec);
        Tensor dlogits = up_f32(filled({c.t, c.e}, kNaN));
        ops::moe_router_backward(dlogits, up_f32(dprobs), up_f32(x),
                                 i32_tensor({c.t, c.k}, experts).to(device()), spec,
                                 aux_grad.defined() ? up_f32(aux_grad) : Tensor(), float(v.z_grad));
        EXPECT_TRUE(all_close(dlogits, want, {2e-6, 1e-5}));
        if (ns.spec.softmax_first || aux_groups > 0 || v.z_grad != 0) continue;
        // Only the chosen experts' logits move the probabilities: the rest are exactly zero.
        const std::vector<double> got = values(dlogits);
        int64_t nonzero = 0;
        for (int64_t t = 0; t < c.t; ++t) {
          for (int64_t e = 0; e < c.e; ++e) {
            const auto first = experts.begin() + t * c.k, last = first + c.k;
            if (std::find(first, last, int32_t(e)) == last && got[size_t(t * c.e + e)] != 0.0) {
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
// objective sum(w * [probs, score_sums, sum of lse^2 / 2]) has dprobs = w[:T k], aux_grad =
// the next G E entries and z_grad = the last. A dominant bias keeps the sigmoid choice away
// from every step's reach; the softmax ones choose on separated logits.
TEST_P(MoeRouter, BackwardIsTheGradientOfTheForward) {
  struct Case {
    RouterShape s;
    NamedSpec ns;
    int64_t sum_groups;  // 0: no score sums
    bool z;
  };
  const std::vector<Case> cases = {
      {{5, 7, 3}, {"softmax", {}}, 0, false},
      {{6, 60, 4}, {"softmax", {}}, 1, false},
      {{6, 60, 4}, {"softmax x2.5, z", {.scaling_factor = 2.5f}}, 3, true},
      {{5, 7, 3}, {"softmax_first", {.softmax_first = true}}, 1, false},
      {{6, 60, 4}, {"softmax_first, z", {.softmax_first = true}}, 2, true},
      {{6, 60, 1}, {"sigmoid k=1", {.sigmoid = true}}, 1, true},
      {{6, 60, 6},
       {"sigmoid+bias, groups, x2.5",
        {.sigmoid = true, .num_groups = 6, .group_topk = 3, .scaling_factor = 2.5f},
        true},
       2,
       true},
  };
  for (const Case& c : cases) {
    const RouterShape s = c.s;
    const MoeRouterSpec spec = c.ns.spec;
    const int64_t sum_groups = c.sum_groups;
    const bool z = c.z;
    SCOPED_TRACE(::testing::Message() << "E " << s.e << " k " << s.k << " " << c.ns.name << " G "
                                      << sum_groups << " z " << z);
    const Tensor bias = c.ns.bias ? dominant_bias(s.e, spec.num_groups, 60) : Tensor();
    auto route_on = [s, spec, bias](const Tensor& logits, const Tensor& sums, const Tensor& lse) {
      Tensor probs = f32_as(logits, {s.t, s.k});
      Tensor experts = Tensor::empty({s.t, s.k}, DType::i32, logits.device());
      ops::moe_router_forward(probs, experts, sums, lse, logits,
                              bias.defined() ? bias.to(logits.device()) : Tensor(), spec);
      return std::make_pair(probs, experts);
    };
    GradCheck g;
    g.inputs = {separated_logits(s.t, s.e, 40 + uint64_t(s.e))};
    g.wrt = {0};
    g.samples = 64;
    g.f32_tol = {1e-3, 2e-3};
    g.forward = [s, sum_groups, z, route_on](const Tensors& in) {
      Tensor sums = sum_groups > 0 ? f32_as(in[0], {sum_groups, s.e}) : Tensor();
      Tensor lse = z ? f32_as(in[0], {s.t}) : Tensor();
      std::vector<double> v = values(route_on(in[0], sums, lse).first);
      if (sums.defined()) {
        const std::vector<double> sv = values(sums);
        v.insert(v.end(), sv.begin(), sv.end());
      }
      if (z) {
        double half_sum_sq = 0;
        for (double l : values(lse)) half_sum_sq += l * l / 2;
        v.push_back(half_sum_sq);
      }
      return f32_tensor({int64_t(v.size())}, v);
    };
    g.backward = [s, spec, sum_groups, z, route_on](const Tensors& in, const Tensor& w) {
      const Tensor experts = route_on(in[0], Tensor(), Tensor()).second;
      const std::vector<double> wv = values(w);
      const auto split = wv.begin() + s.t * s.k, aux_end = split + sum_groups * s.e;
      Tensor dprobs = f32_tensor({s.t, s.k}, std::vector<double>(wv.begin(), split));
      Tensor aux = sum_groups > 0
                       ? f32_tensor({sum_groups, s.e}, std::vector<double>(split, aux_end))
                       : Tensor();
      const Device d = in[0].device();
      Tensor dlogits = f32_as(in[0], {s.t, s.e});
      ops::moe_router_backward(dlogits, dprobs.to(d), in[0], experts, spec,
                               aux.defined() ? aux.to(d) : Tensor(), z ? float(wv.back()) : 0.0f);
      return Tensors{dlogits};
    };
    check_gradients(GetParam(), g);
  }
}

TEST_P(MoeRouter, BadArgumentsNameTheOp) {
  auto i32 = [&](const Shape& shape) { return Tensor::zeros(shape, DType::i32, device()); };
  Tensor logits = zeros_f32({4, 6}), probs = zeros_f32({4, 2}), experts = i32({4, 2});
  const MoeRouterSpec softmax{}, sigmoid{.sigmoid = true};
  auto fwd = [&](const Tensor& p, const Tensor& ex, const Tensor& sums, const Tensor& l,
                 const MoeRouterSpec& spec = {}, const Tensor& lse = Tensor(),
                 const Tensor& bias = Tensor()) {
    return [=] { ops::moe_router_forward(p, ex, sums, lse, l, bias, spec); };
  };
  const char* f = "moe_router_forward";
  EXPECT_TRUE(
      raises(fwd(probs, probs, Tensor(), logits), "moe_router_forward: experts must be i32"));
  EXPECT_TRUE(raises(fwd(zeros_f32({4, 7}), i32({4, 7}), Tensor(), logits),  // k > E
                     "moe_router_forward: experts"));
  EXPECT_TRUE(raises(fwd(zeros_f32({4, 0}), i32({4, 0}), Tensor(), logits),  // k = 0
                     "moe_router_forward: experts"));
  EXPECT_TRUE(raises(fwd(zeros_f32({5, 2}), i32({5, 2}), Tensor(), logits, {.softmax_first = true}),
                     "moe_router_forward: experts"));
  EXPECT_TRUE(
      raises(fwd(zeros_f32({4, 3}), experts, Tensor(), logits), "moe_router_forward: probs"));
  EXPECT_TRUE(
      raises(fwd(probs, experts, zeros_f32({7}), logits), "moe_router_forward: score_sums"));
  EXPECT_TRUE(
      raises(fwd(probs, experts, zeros_f32({1, 7}), logits), "moe_router_forward: score_sums"));
  EXPECT_TRUE(raises(fwd(probs, experts, zeros_f32({3, 6}), logits),  // 3 does not divide 4
                     "with G dividing the 4 tokens"));
  EXPECT_TRUE(raises(fwd(probs, experts, zeros_f32({6}), logits),  // the old [E] form
                     "moe_router_forward: score_sums"));
  EXPECT_TRUE(raises(fwd(probs, experts, Tensor(), Tensor::zeros({4, 6}, DType::bf16, device())),
                     "moe_router_forward: logits must be f32"));
  EXPECT_TRUE(raises(fwd(probs, experts, Tensor(), zeros_f32({4, 1025})), f));
  EXPECT_TRUE(raises(fwd(probs, experts, Tensor(), zeros_f32({24})), f));
  EXPECT_TRUE(
      raises(fwd(probs, Tensor(), Tensor(), logits), "moe_router_forward: experts is undefined"));
  EXPECT_TRUE(raises(fwd(probs, experts, Tensor(), logits, softmax, zeros_f32({3})),
                     "moe_router_forward: lse"));
  EXPECT_TRUE(raises(fwd(probs, experts, Tensor(), logits, softmax, zeros_f32({4, 1})),
                     "moe_router_forward: lse"));
  EXPECT_TRUE(raises(fwd(probs, experts, Tensor(), logits, softmax, Tensor(), zeros_f32({6})),
                     "moe_router_forward: expert_bias is for the sigmoid score function"));
  EXPECT_TRUE(raises(fwd(probs, experts, Tensor(), logits, sigmoid, Tensor(), zeros_f32({5})),
                     "moe_router_forward: expert_bias"));
  EXPECT_TRUE(
      raises(fwd(probs, experts, Tensor(), logits, {.sigmoid = true, .softmax_first = true}),
             "moe_router_forward: softmax_first is for the softmax score function"));
  for (float scale : {0.0f, -1.0f, std::numeric_limits<float>::infinity(), kNaN}) {
    EXPECT_TRUE(raises(fwd(probs, experts, Tensor(), logits, {.scaling_factor = scale}),
                       "moe_router_forward: scaling_factor must be > 0 and finite"));
  }
  // E = 6, k = 2: num_groups must divide 6, group_topk be in [1, num_groups] and divide 2, and
  // 2 / group_topk fit in a group.
  for (const auto& [groups, top] : std::vector<std::pair<int64_t, int64_t>>{
           {4, 1}, {-1, 1}, {3, 0}, {3, 4}, {2, 3}, {6, 1}, {7, 1}}) {
    SCOPED_TRACE(::testing::Message() << "num_groups " << groups << " group_topk " << top);
    const MoeRouterSpec spec{.num_groups = groups, .group_topk = top};
    EXPECT_TRUE(
        raises(fwd(probs, experts, Tensor(), logits, spec), "moe_router_forward: num_groups"));
    EXPECT_TRUE(raises(
        [&] {
          ops::moe_router_backward(zeros_f32({4, 6}), probs, logits, experts, spec, Tensor(), 0.0f);
        },
        "moe_router_backward: num_groups"));
  }
  EXPECT_TRUE(raises(fwd(probs, experts, Tensor(), logits, {.group_topk = 1}),
                     "moe_router_forward: group_topk 1 needs num_groups"));

  Tensor dlogits = zeros_f32({4, 6});
  auto bwd = [&](const Tensor& dl, const Tensor& dp, const Tensor& ex, const Tensor& aux,
                 const MoeRouterSpec& spec = {}, float z_grad = 0.0f) {
    return [=] { ops::moe_router_backward(dl, dp, logits, ex, spec, aux, z_grad); };
  };
  const char* b = "moe_router_backward";
  EXPECT_TRUE(
      raises(bwd(dlogits, probs, probs, Tensor()), "moe_router_backward: experts must be i32"));
  EXPECT_TRUE(raises(bwd(dlogits, zeros_f32({4, 7}), i32({4, 7}), Tensor()), b));  // k > E
  EXPECT_TRUE(raises(bwd(dlogits, zeros_f32({4, 3}), experts, Tensor()), b));
  EXPECT_TRUE(
      raises(bwd(zeros_f32({4, 5}), probs, experts, Tensor()), "moe_router_backward: dlogits"));
  EXPECT_TRUE(
      raises(bwd(dlogits, probs, experts, zeros_f32({5})), "moe_router_backward: aux_grad"));
  EXPECT_TRUE(
      raises(bwd(dlogits, probs, experts, zeros_f32({1, 5})), "moe_router_backward: aux_grad"));
  EXPECT_TRUE(raises(bwd(dlogits, probs, experts, zeros_f32({3, 6})),  // 3 does not divide 4
                     "moe_router_backward: aux_grad"));
  EXPECT_TRUE(
      raises(bwd(dlogits, probs, experts, Tensor(), {.sigmoid = true, .softmax_first = true}),
             "moe_router_backward: softmax_first is for the softmax score function"));
  for (float z : {std::numeric_limits<float>::infinity(), kNaN}) {
    EXPECT_TRUE(raises(bwd(dlogits, probs, experts, Tensor(), {}, z),
                       "moe_router_backward: z_grad must be finite"));
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, MoeRouter, ::testing::ValuesIn(f32_cases()), kernel_case_name);

}  // namespace
}  // namespace braid::testing
