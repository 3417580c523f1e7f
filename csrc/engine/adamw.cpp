#include "braid/engine/adamw.h"

#include <algorithm>
#include <cmath>
#include <span>

namespace braid::engine {
namespace {

// The last stage's copy of tied embeddings: its gradient equals the first stage's after
// finalize_grads, so it must not count twice in the norm.
bool is_tied_copy(const model::GPTModel& m, const model::ParamSpec& spec) {
  return spec.name == "model.embed_tokens.weight" && !m.chunk().embedding;
}

}  // namespace

void AdamWConfig::validate() const {
  BRAID_CONFIG_CHECK(std::isfinite(lr) && lr >= 0,
                     "AdamWConfig.lr (--lr) must be finite and >= 0, got ", lr);
  BRAID_CONFIG_CHECK(beta1 >= 0 && beta1 < 1,
                     "AdamWConfig.beta1 (--adam-beta1) must be in [0, 1), got ", beta1);
  BRAID_CONFIG_CHECK(beta2 >= 0 && beta2 < 1,
                     "AdamWConfig.beta2 (--adam-beta2) must be in [0, 1), got ", beta2);
  BRAID_CONFIG_CHECK(eps > 0 && std::isfinite(eps),
                     "AdamWConfig.eps (--adam-eps) must be finite and positive, got ", eps);
  BRAID_CONFIG_CHECK(weight_decay >= 0 && std::isfinite(weight_decay),
                     "AdamWConfig.weight_decay (--weight-decay) must be finite and >= 0, got ",
                     weight_decay);
  BRAID_CONFIG_CHECK(clip_grad >= 0 && std::isfinite(clip_grad),
                     "AdamWConfig.clip_grad (--clip-grad) must be finite and >= 0 (0: off), got ",
                     clip_grad);
}

AdamW::AdamW(model::GPTModel& model, AdamWConfig config)
    : AdamW({OptimizerChunk{&model, {ElementRange{0, model.layout().num_elements}}}}, config,
            model.tensor_parallel().active() ? model.tensor_parallel().group : nullptr) {
  const model::ExpertParallel& ep = model.expert_parallel();
  BRAID_CHECK(!ep.active() && !(ep.whole_experts && model.tensor_parallel().active()),
              "AdamW: this model holds only its EP rank's experts, or whole experts of its TP "
              "rank's tokens; optimize it through a ParallelModel (Trainer), whose norm counts "
              "them all and whose expert-data-parallel group sums their gradients");
}

AdamW::AdamW(std::vector<OptimizerChunk> chunks, AdamWConfig config, comm::Communicator* norm_group)
    : chunks_(std::move(chunks)), config_(config), norm_group_(norm_group) {
  config_.validate();
  BRAID_CHECK(!chunks_.empty(), "AdamW: no model chunks");
  device_ = chunks_.front().model->device();
  const bool f32_params = chunks_.front().model->flat_params().dtype() == DType::f32;
  int64_t total = 0;
  for (const OptimizerChunk& c : chunks_)
    for (const ElementRange& r : c.owned) total += r.size();
  Tensor exp_avg = Tensor::zeros({total}, DType::f32, device_);
  Tensor exp_avg_sq = Tensor::zeros({total}, DType::f32, device_);
  Tensor master = f32_params ? Tensor() : Tensor::empty({total}, DType::f32, device_);
  state_bytes_ = (f32_params ? 2 : 3) * total * int64_t(sizeof(float));

  int64_t at = 0;               // where the next segment starts in the compact state
  std::vector<bool> decoupled;  // groups_[i] is the embedding's or output layer's
  for (size_t c = 0; c < chunks_.size(); ++c) {
    model::GPTModel& m = *chunks_[c].model;
    const model::ParamLayout& layout = m.layout();
    const Tensor& flat = m.flat_params();
    BRAID_CHECK(chunks_[c].dense_copies >= 1 && chunks_[c].expert_copies >= 1, "AdamW: chunk ", c,
                " has ", chunks_[c].dense_copies, " dense and ", chunks_[c].expert_copies,
                " expert copies");
    for (const ElementRange& r : chunks_[c].owned) {
      BRAID_CHECK(r.begin >= 0 && r.end <= flat.numel() && r.begin <= r.end, "AdamW: owned range [",
                  r.begin, ", ", r.end, ") outside chunk ", c, "'s buffer of ", flat.numel());
      Segment seg{int(c), r, Tensor(), exp_avg.slice(at, {r.size()}),
                  exp_avg_sq.slice(at, {r.size()})};
      if (f32_params) {
        seg.master = flat.slice(r.begin, {r.size()});
      } else {
        seg.master = master.slice(at, {r.size()});
        ops::cast(seg.master, flat.slice(r.begin, {r.size()}));
      }
      const std::vector<model::Parameter>& params = m.parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        const model::Parameter& p = params[i];
        // The parameter's elements (its valid shape: vocabulary padding rows are never stepped)
        // within this range.
        const int64_t begin = std::max(r.begin, layout.offsets[i]);
        const int64_t end = std::min(r.end, layout.offsets[i] + p.value.numel());
        if (begin >= end) continue;
        const int64_t local = begin - r.begin, n = end - begin;
        groups_.push_back(ops::AdamWGroup{
            seg.master.slice(local, {n}), m.flat_grads().slice(begin, {n}),
            seg.exp_avg.slice(local, {n}), seg.exp_avg_sq.slice(local, {n}),
            weight_decay_of(p.spec), f32_params ? Tensor() : flat.slice(begin, {n})});
        decays_.push_back(decays(p.spec));
        decoupled.push_back(model::is_embedding_or_output(p.spec));
        if (!is_tied_copy(m, p.spec)) {
          const int copies = p.shard.replicas * (p.spec.expert >= 0 ? chunks_[c].expert_copies
                                                                    : chunks_[c].dense_copies);
          grads_by_copies_[copies].push_back(m.flat_grads().slice(begin, {n}));
          params_by_copies_[copies].push_back(seg.master.slice(local, {n}));
        }
      }
      segments_.push_back(std::move(seg));
      at += r.size();
    }
  }
  // The embedding's and output layer's groups last, so that each learning rate steps one span.
  std::vector<size_t> order(groups_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  const auto it =
      std::stable_partition(order.begin(), order.end(), [&](size_t i) { return !decoupled[i]; });
  decoupled_begin_ = size_t(it - order.begin());
  std::vector<ops::AdamWGroup> groups;
  std::vector<bool> decay_flags;
  for (size_t i : order) {
    groups.push_back(std::move(groups_[i]));
    decay_flags.push_back(decays_[i]);
  }
  groups_ = std::move(groups);
  decays_ = std::move(decay_flags);
}

const AdamW::Segment& AdamW::only_segment() const {
  BRAID_CHECK(segments_.size() == 1, "AdamW: the state has ", segments_.size(),
              " segments; use segments()");
  return segments_.front();
}

bool AdamW::decays(const model::ParamSpec& spec) const {
  return spec.weight_decay || (config_.decay_embeddings && model::is_embedding(spec));
}

float AdamW::weight_decay_of(const model::ParamSpec& spec) const {
  return decays(spec) ? config_.weight_decay : 0.0f;
}

void AdamW::set_weight_decay(float weight_decay) {
  BRAID_CHECK(std::isfinite(weight_decay) && weight_decay >= 0,
              "AdamW: weight decay must be >= 0, got ", weight_decay);
  config_.weight_decay = weight_decay;
  for (size_t i = 0; i < groups_.size(); ++i)
    if (decays_[i]) groups_[i].weight_decay = weight_decay;
}

float AdamW::grad_norm() const { return global_norm(grads_by_copies_); }

float AdamW::params_norm() const { return global_norm(params_by_copies_); }

int64_t AdamW::num_zeros_in_grads() const {
  // A shard that k ranks of the norm group hold counts 1/k on each, as in the norm. The
  // fractions travel as fixed point (2^-20 units) in an i64 sum; the total is whole.
  constexpr int kUnitBits = 20;
  int64_t units = 0;
  for (const auto& [copies, tensors] : grads_by_copies_) {
    Tensor count = Tensor::empty({1}, DType::i64, device_);
    ops::count_zeros(count, tensors);
    const int64_t zeros = count.to(Device::cpu()).data_ptr<int64_t>()[0];
    units += std::llround(std::ldexp(double(zeros), kUnitBits) / copies);
  }
  Tensor total = Tensor::empty({1}, DType::i64);
  total.data_ptr<int64_t>()[0] = units;
  if (norm_group_ != nullptr && norm_group_->size() > 1) {
    if (norm_group_->device().is_cuda()) total = total.to(norm_group_->device());
    norm_group_->all_reduce(total)->wait();
  }
  units = total.to(Device::cpu()).data_ptr<int64_t>()[0];
  return (units + (int64_t(1) << (kUnitBits - 1))) >> kUnitBits;
}

float AdamW::global_norm(const std::map<int, std::vector<Tensor>>& by_copies) const {
  // Every parameter counts once: a shard that k ranks of the norm group hold adds 1/k of its
  // squares on each.
  double local = 0;
  for (const auto& [copies, tensors] : by_copies) {
    Tensor sum = Tensor::empty({1}, DType::f32, device_);
    ops::sum_of_squares(sum, tensors);
    local += sum.item(0) / copies;
  }
  if (norm_group_ == nullptr || norm_group_->size() == 1) return float(std::sqrt(local));
  Tensor total = Tensor::empty({1}, DType::f32);
  total.data_ptr<float>()[0] = float(local);
  if (norm_group_->device().is_cuda()) total = total.to(norm_group_->device());
  norm_group_->all_reduce(total)->wait();
  return float(std::sqrt(total.item(0)));
}

void AdamW::step_with(float lr, float grad_scale, std::optional<float> decoupled_lr) {
  const float vocab_lr = decoupled_lr.value_or(lr);
  for (float value : {lr, vocab_lr})
    BRAID_CHECK(std::isfinite(value) && value >= 0, "AdamW: learning rate must be >= 0, got ",
                value);
  ops::AdamWHyper hyper;
  hyper.lr = lr;
  hyper.beta1 = config_.beta1;
  hyper.beta2 = config_.beta2;
  hyper.eps = config_.eps;
  hyper.step = step_ + 1;
  hyper.grad_scale = grad_scale;
  const std::span<const ops::AdamWGroup> all(groups_);
  if (vocab_lr == lr) {
    ops::adamw_step(all, hyper);
  } else {
    ops::adamw_step(all.first(decoupled_begin_), hyper);
    hyper.lr = vocab_lr;
    ops::adamw_step(all.subspan(decoupled_begin_), hyper);
  }
  ++step_;
}

void AdamW::set_step(int64_t steps) {
  BRAID_CHECK(steps >= 0, "AdamW: a step count must be >= 0, got ", steps);
  step_ = steps;
}

float AdamW::clip_and_step(float lr) {
  const float norm = grad_norm();
  BRAID_CHECK(std::isfinite(norm), "AdamW: the global gradient norm is ", norm, " at step ",
              step_ + 1, "; parameters were not updated");
  float scale = 1.0f;
  if (config_.clip_grad > 0) scale = std::min(1.0f, config_.clip_grad / (norm + 1e-6f));
  step_with(lr, scale);
  return norm;
}

}  // namespace braid::engine
