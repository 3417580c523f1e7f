#include "braid/model/moe.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "braid/kernels/ops.h"

namespace braid::model {
namespace {

Tensor host_copy(const Tensor& t) { return t.device().is_cpu() ? t : t.to(Device::cpu()); }

Tensor on(Device device, const Tensor& host) { return device.is_cpu() ? host : host.to(device); }

// The experts the load-balancing loss counts, on the host: the top k of its scores (softmax,
// or sigmoid normalised) over every expert, as Megatron's compute_routing_scores_for_aux_loss
// picks them - the chosen experts when neither groups nor a bias steered the choice. Under TP
// rank 0's, like the choice, unless each TP rank routes its own tokens.
Tensor balancing_choice(const Tensor& logits, const Tensor& chosen, const Tensor& expert_bias,
                        const TransformerConfig& config, const TensorParallel& tp,
                        bool tp_shards_tokens) {
  ops::MoeRouterSpec spec = router_spec(config);
  if (spec.num_groups == 0 && !expert_bias.defined()) return host_copy(chosen);
  spec.num_groups = spec.group_topk = 0;
  spec.softmax_first = !spec.sigmoid;  // the top k of the softmax, not of the logits
  Tensor experts = Tensor::empty(chosen.shape(), DType::i32, chosen.device());
  Tensor probs = Tensor::empty(chosen.shape(), DType::f32, chosen.device());
  ops::moe_router_forward(probs, experts, {}, {}, logits, {}, spec);
  if (tp.active() && !tp_shards_tokens) tp.group->broadcast(experts, 0)->wait();
  return host_copy(experts);
}

// Megatron's token dropping (apply_router_token_dropping): each expert keeps at most
// ceil(T · k / E · factor) of the pairs routed to it - those of the highest probabilities or the
// first ones, in Megatron's token order (ties too). 1 per kept pair of experts [T, k], whose T
// tokens are `rows` runs of sequences (or, under CP, of their two local chunks, chunk-major).
std::vector<uint8_t> kept_pairs(const Tensor& experts, const Tensor& probs, int64_t rows,
                                bool context_parallel, const TransformerConfig& config) {
  const int64_t n = experts.numel(), e_count = config.num_experts, k = experts.size(1);
  const int64_t t_count = experts.size(0), length = t_count / rows;
  const auto capacity =
      int64_t(std::ceil(double(n) / double(e_count) * config.moe_expert_capacity_factor));
  // Megatron's order: position-major ([S, B] flattened; under CP a rank's two chunks in a row).
  const int64_t batch = context_parallel ? rows / 2 : rows;
  auto order = [&](int64_t pair) {
    const int64_t t = pair / k, run = t / length, position = (run / batch) * length + t % length;
    return position * batch + run % batch;
  };
  const Tensor p_host = host_copy(probs);
  const float* p = p_host.data_ptr<float>();
  auto ranked = [&](int64_t pair) { return std::isnan(p[pair]) ? -INFINITY : p[pair]; };
  std::vector<std::vector<int64_t>> pairs(static_cast<size_t>(e_count));
  const int32_t* ex = experts.data_ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i) pairs[size_t(ex[i])].push_back(i);
  std::vector<uint8_t> kept(size_t(n), 1);
  for (std::vector<int64_t>& list : pairs) {
    if (int64_t(list.size()) <= capacity) continue;
    const bool by_probs = config.moe_token_drop_policy == MoeTokenDropPolicy::probs;
    std::sort(list.begin(), list.end(), [&](int64_t a, int64_t b) {
      if (by_probs && ranked(a) != ranked(b)) return ranked(a) > ranked(b);
      return order(a) < order(b);
    });
    for (size_t j = size_t(capacity); j < list.size(); ++j) kept[size_t(list[j])] = 0;
  }
  return kept;
}

// kept_pairs over the tokens of the whole TP group, when each TP rank routes its own
// sequence-parallel shard of them: the same pairs are kept as when every rank routes them all.
std::vector<uint8_t> kept_pairs_of_shard(const Tensor& experts, const Tensor& probs, int64_t rows,
                                         bool context_parallel, const TransformerConfig& config,
                                         const TensorParallel& tp) {
  const Device dev = tp.group->device();
  const int64_t n = experts.numel();
  Tensor all_experts = Tensor::empty({n * tp.size()}, DType::i32, dev);
  Tensor all_probs = Tensor::empty({n * tp.size()}, DType::f32, dev);
  tp.group->all_gather(on(dev, experts.view({n})), all_experts)->wait();
  tp.group->all_gather(probs.view({n}), all_probs)->wait();
  const int64_t k = experts.size(1), t_all = n / k * tp.size();
  const std::vector<uint8_t> all =
      kept_pairs(host_copy(all_experts).view({t_all, k}), all_probs.view({t_all, k}), rows,
                 context_parallel, config);
  const auto first = all.begin() + tp.rank() * n;
  return std::vector<uint8_t>(first, first + n);
}

// Where this rank's tokens sit among the load-balancing runs of its TP group's tokens (each TP
// rank's shard of them when it routes its own, else all of them): `count` local runs from global
// run `first`; a shard inside one run is one local run.
struct LocalRuns {
  int64_t first = 0, count = 1, tokens_per_run = 0;
};
LocalRuns local_runs(int64_t t_count, int64_t runs, const TensorParallel& tp, bool sharded) {
  const int64_t total = sharded ? t_count * tp.size() : t_count;
  const int64_t offset = sharded ? t_count * tp.rank() : 0;
  LocalRuns l;
  l.tokens_per_run = total / runs;
  BRAID_CHECK(t_count > 0 && (t_count % l.tokens_per_run == 0 || l.tokens_per_run % t_count == 0),
              "route_tokens: a shard of ", t_count, " tokens neither holds whole runs of ",
              l.tokens_per_run, " nor lies within one (check_sequence_shards)");
  l.first = offset / l.tokens_per_run;
  l.count = std::max<int64_t>(1, t_count / l.tokens_per_run);
  return l;
}

}  // namespace

void check_sequence_shards(const TransformerConfig& config, int64_t rows, const TensorParallel& tp,
                           bool tp_shards_tokens, const ContextParallel& cp) {
  if (!tp_shards_tokens || !tp.active() || config.num_experts == 0 ||
      config.moe_aux_loss_coeff == 0 ||
      config.moe_router_load_balancing_type != MoeLoadBalancing::seq_aux_loss)
    return;
  const int64_t runs = rows * (cp.active() ? 2 : 1);
  BRAID_CONFIG_CHECK(runs % tp.size() == 0 || tp.size() % runs == 0,
                     "the per-sequence load-balancing loss (seq_aux_loss) with "
                     "--expert-tensor-parallel-size 1: each of the ",
                     tp.size(), " TP ranks' token shards must hold whole sequences",
                     cp.active() ? " (context-parallel chunks)" : "", " or lie within one; ",
                     "--micro-batch-size ", rows, " gives ", runs,
                     cp.active() ? " chunks" : " sequences", ", which neither divides nor is ",
                     "divided by --tensor-model-parallel-size ", tp.size());
}

ops::MoeRouterSpec router_spec(const TransformerConfig& config) {
  ops::MoeRouterSpec spec;
  spec.sigmoid = config.moe_router_score_function == MoeScoreFunction::sigmoid;
  spec.softmax_first = config.moe_router_pre_softmax;
  spec.num_groups = config.moe_router_num_groups;
  spec.group_topk = config.moe_router_group_topk;
  spec.scaling_factor = config.moe_router_topk_scaling_factor;
  return spec;
}

MoeRouting route_tokens(const Tensor& logits, int64_t rows, const Tensor& expert_bias,
                        const TransformerConfig& config, const TensorParallel& tp,
                        bool tp_shards_tokens, const ContextParallel& cp, bool training,
                        bool drop) {
  const int64_t t_count = logits.size(0), e_count = config.num_experts;
  const int64_t k = config.moe_router_topk, n = t_count * k;
  const Device device = logits.device();
  const bool aux = training && config.moe_aux_loss_coeff > 0;
  const bool z = training && config.moe_z_loss_coeff > 0;
  // Each TP rank routes its own tokens, or every one all of them alike.
  const bool sharded = tp_shards_tokens && tp.active();
  const int tp_share = sharded ? tp.size() : 1;
  // The load-balancing groups: the microbatch, or each of its sequences. `rows` runs of tokens
  // (ops.h's score-sum groups) hold them: the sequences themselves, or under context
  // parallelism each sequence's two local chunks, chunk-major (context_parallel.h). A rank that
  // routes its own shard holds `runs.count` of them (or part of one).
  const bool per_sequence = config.moe_router_load_balancing_type == MoeLoadBalancing::seq_aux_loss;
  const int64_t all_runs = aux && per_sequence ? rows : 1;
  const int64_t groups = aux && per_sequence ? (cp.active() ? rows / 2 : rows) : 1;
  BRAID_CHECK(t_count * tp_share % all_runs == 0 && all_runs % groups == 0,
              "route_tokens: ", t_count * tp_share, " tokens do not split into ", rows, " rows");
  const LocalRuns runs = local_runs(t_count, all_runs, tp, sharded);
  MoeRouting r;
  r.probs = Tensor::empty({t_count, k}, DType::f32, device);
  r.experts = Tensor::empty({t_count, k}, DType::i32, device);
  Tensor score_sums = aux ? Tensor::empty({runs.count, e_count}, DType::f32, device) : Tensor();
  Tensor lse = z ? Tensor::empty({t_count}, DType::f32, device) : Tensor();
  ops::moe_router_forward(r.probs, r.experts, score_sums, lse, logits, expert_bias,
                          router_spec(config));
  if (tp.active() && !sharded) {
    tp.group->broadcast(r.experts, 0)->wait();
    tp.group->broadcast(r.probs, 0)->wait();
  }

  // Counting sort of the kept (token, choice) pairs by expert, stable in token order.
  const Tensor chosen = host_copy(r.experts);
  const int32_t* ex = chosen.data_ptr<int32_t>();
  std::vector<uint8_t> kept(size_t(n), 1);
  if (drop && config.moe_expert_capacity_factor > 0) {
    kept = sharded ? kept_pairs_of_shard(chosen, r.probs, rows, cp.active(), config, tp)
                   : kept_pairs(chosen, r.probs, rows, cp.active(), config);
  }
  r.offsets.assign(size_t(e_count + 1), 0);
  for (int64_t i = 0; i < n; ++i) r.offsets[size_t(ex[i]) + 1] += kept[size_t(i)];
  for (int64_t e = 0; e < e_count; ++e) r.offsets[size_t(e + 1)] += r.offsets[size_t(e)];
  const int64_t rows_kept = r.offsets.back();
  r.dropped = n - rows_kept;
  Tensor row_token = Tensor::empty({rows_kept}, DType::i32);
  Tensor row_slot = Tensor::empty({rows_kept}, DType::i32);
  Tensor token_rows = Tensor::empty({t_count, k}, DType::i32);
  std::vector<int64_t> next(r.offsets.begin(), r.offsets.end() - 1);
  for (int64_t i = 0; i < n; ++i) {
    if (!kept[size_t(i)]) {
      token_rows.data_ptr<int32_t>()[i] = int32_t(rows_kept);  // the zero row
      continue;
    }
    const int64_t row = next[size_t(ex[i])]++;
    row_token.data_ptr<int32_t>()[row] = int32_t(i / k);
    row_slot.data_ptr<int32_t>()[row] = int32_t(i);
    token_rows.data_ptr<int32_t>()[i] = int32_t(row);
  }
  r.row_token = on(device, row_token);
  r.token_rows = on(device, token_rows);
  r.row_prob = Tensor::empty({rows_kept}, DType::f32, device);
  ops::gather_rows(r.row_prob.view({rows_kept, 1}), r.probs.view({n, 1}), on(device, row_slot), {});

  // The router losses average over the microbatch's tokens: those of every CP rank, and of every
  // TP rank when each routes its own. Each rank's values are then its tokens' shares.
  const double microbatch_tokens = double(t_count) * tp_share * cp.size();
  if (z) {
    const Tensor host = host_copy(lse);
    double sum = 0;
    for (int64_t t = 0; t < t_count; ++t) {
      const double v = host.data_ptr<float>()[t];
      sum += v * v;
    }
    r.z_loss = sum / microbatch_tokens;
    r.z_grad = float(2.0 * config.moe_z_loss_coeff / microbatch_tokens);
  }
  if (!aux) return r;

  // Tokens per (group, expert), summed over CP (and TP); the score sums of each group's runs.
  // Megatron counts the top k of the balancing scores over all experts, which are the chosen
  // ones unless groups or the expert bias steer the choice.
  const Tensor balanced = balancing_choice(logits, r.experts, expert_bias, config, tp, sharded);
  const int32_t* counted = balanced.data_ptr<int32_t>();
  const int64_t per_local_run = t_count / runs.count;
  Tensor counts = Tensor::zeros({groups, e_count}, DType::f32);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t run = runs.first + i / k / per_local_run;
    counts.data_ptr<float>()[run % groups * e_count + counted[i]] += 1;
  }
  for (comm::Communicator* group :
       {cp.active() ? cp.group : nullptr, sharded ? tp.group : nullptr}) {
    if (group == nullptr) continue;
    Tensor reduced = on(group->device(), counts);
    group->all_reduce(reduced)->wait();
    counts = host_copy(reduced);
  }
  const Tensor sums = host_copy(score_sums);
  const double tokens = microbatch_tokens / double(groups);
  const double unit = double(e_count) / (double(k) * tokens * tokens * double(groups));
  Tensor grad = Tensor::empty({runs.count, e_count}, DType::f32);
  for (int64_t run = 0; run < runs.count; ++run) {
    const int64_t group = (runs.first + run) % groups;
    for (int64_t e = 0; e < e_count; ++e) {
      const double c = counts.data_ptr<float>()[group * e_count + e];
      grad.data_ptr<float>()[run * e_count + e] = float(config.moe_aux_loss_coeff * unit * c);
      r.aux_loss += unit * c * sums.data_ptr<float>()[run * e_count + e];
    }
  }
  r.aux_grad = on(device, grad);
  return r;
}

std::string expert_bias_name(int64_t layer) {
  return "model.layers." + std::to_string(layer) + ".mlp.gate.e_score_correction_bias";
}

void move_expert_bias(Tensor bias, std::vector<int64_t>& tokens, float rate,
                      std::initializer_list<comm::Communicator*> groups) {
  const int64_t e_count = int64_t(tokens.size());
  Tensor counts = Tensor::empty({e_count}, DType::i64);
  std::copy(tokens.begin(), tokens.end(), counts.data_ptr<int64_t>());
  for (comm::Communicator* group : groups) {
    if (group == nullptr || group->size() == 1) continue;
    Tensor reduced = on(group->device(), counts);
    group->all_reduce(reduced)->wait();
    counts = host_copy(reduced);
  }
  // sign(total / E - count), in integers.
  const int64_t* c = counts.data_ptr<int64_t>();
  const int64_t total = std::accumulate(c, c + e_count, int64_t(0));
  Tensor moved = host_copy(bias).clone();
  float* b = moved.data_ptr<float>();
  for (int64_t e = 0; e < e_count; ++e) {
    const int64_t offset = total - e_count * c[e];
    b[e] += float(offset > 0) * rate - float(offset < 0) * rate;
  }
  bias.copy_from(moved);
  std::fill(tokens.begin(), tokens.end(), 0);
}

}  // namespace braid::model
