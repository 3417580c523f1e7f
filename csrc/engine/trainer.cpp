#include "braid/engine/trainer.h"

#include <chrono>
#include <cmath>
#include <cstring>

#include "braid/core/log.h"
#include "braid/core/stream.h"

namespace braid::engine {
namespace {

// Expert parallelism (or whole experts) without ZeRO: the model-parallel group holds only its EP
// rank's experts (or every TP rank whole ones), so the norm is summed over the world, where each
// dense element has dp·cp copies and each expert's expert-DP copies. (With ZeRO the world owns
// every element once: dense shards once per dp·cp group, expert shards once per expert-DP group,
// each EP rank other experts.)
bool norm_over_replicas(const ParallelModel& model) {
  const comm::ParallelState* state = model.state();
  return state != nullptr &&
         (state->grid().ep() > 1 || model.chunk(0).expert_parallel().whole_experts) &&
         !model.parallel().ddp.use_distributed_optimizer;
}

std::vector<OptimizerChunk> optimizer_chunks(const ParallelModel& model) {
  std::vector<OptimizerChunk> chunks;
  for (int c = 0; c < model.num_chunks(); ++c) {
    OptimizerChunk chunk{&model.chunk(c), model.grad_buffer(c).owned_ranges()};
    if (norm_over_replicas(model)) {
      const comm::RankGrid& grid = model.state()->grid();
      chunk.dense_copies = grid.dp() * grid.cp();
      chunk.expert_copies = grid.expert_dp();
    }
    chunks.push_back(std::move(chunk));
  }
  return chunks;
}

// The group over which every parameter element is owned exactly once (AdamW's norm_group), or
// the world with copies (above).
comm::Communicator* norm_group(const ParallelModel& model) {
  const comm::ParallelState* state = model.state();
  if (state == nullptr) {
    const model::TensorParallel& tp = model.chunk(0).tensor_parallel();
    return tp.active() ? tp.group : nullptr;
  }
  return model.parallel().ddp.use_distributed_optimizer || norm_over_replicas(model)
             ? &state->world()
             : &state->model_parallel();
}

// Sums `values` over `group` (nullptr: as they are), through the group's device.
template <typename T>
void all_reduce_host(comm::Communicator* group, std::vector<T>& values, DType dtype) {
  if (group == nullptr || group->size() == 1) return;
  Tensor t = Tensor::empty({int64_t(values.size())}, dtype);
  std::memcpy(t.data(), values.data(), values.size() * sizeof(T));
  Tensor on_device = t.to(group->device());
  group->all_reduce(on_device)->wait();
  t = on_device.to(Device::cpu());
  std::memcpy(values.data(), t.data(), values.size() * sizeof(T));
}

int64_t count_targets(const Tensor& targets) {
  const Tensor host = targets.device().is_cpu() ? targets : targets.to(Device::cpu());
  const int32_t* p = host.data_ptr<int32_t>();
  int64_t n = 0;
  for (int64_t i = 0; i < host.numel(); ++i) n += p[i] >= 0;
  return n;
}

// Fills stats' breakdown from the spans a step recorded ([first, end) of trace's spans).
void add_breakdown(const Trace& trace, size_t first, StepStats& stats) {
  const std::vector<TraceSpan>& spans = trace.spans();
  for (size_t i = first; i < spans.size(); ++i) {
    const TraceSpan& s = spans[i];
    if (s.lane.rfind("comm:", 0) != 0) continue;
    // "tp" and "tp_kv" (the GQA key/value heads' group) are tensor parallelism; "dp_cp" is
    // data parallelism's gradient group under context parallelism, "expert_dp" the experts'
    // under expert parallelism, whose "ep" waits are the token exchanges; "cp" waits count
    // with the others.
    const std::string group = s.lane.substr(5);
    const double seconds = double(s.dur_ns) * 1e-9;
    const bool dp = group == "dp" || group == "dp_cp" || group == "expert_dp";
    (group == "pp"             ? stats.pipeline_wait_seconds
     : group.starts_with("tp") ? stats.tp_wait_seconds
     : dp                      ? stats.dp_wait_seconds
     : group == "ep"           ? stats.ep_wait_seconds
                               : stats.other_wait_seconds) += seconds;
  }
  stats.compute_seconds = stats.seconds - stats.pipeline_wait_seconds - stats.tp_wait_seconds -
                          stats.dp_wait_seconds - stats.ep_wait_seconds - stats.other_wait_seconds;
}

}  // namespace

Trainer::Trainer(model::GPTModel& model, AdamWConfig optimizer, LRSchedule schedule)
    : owned_(std::make_unique<ParallelModel>(model)),
      model_(*owned_),
      config_{optimizer, schedule, {}, {}, "1f1b", 0},
      optimizer_(std::make_unique<AdamW>(optimizer_chunks(model_), optimizer, norm_group(model_))),
      scaler_(config_.loss_scale) {
  config_.schedule.validate();
}

Trainer::Trainer(ParallelModel& model, TrainerConfig config)
    : model_(model),
      config_(std::move(config)),
      optimizer_(
          std::make_unique<AdamW>(optimizer_chunks(model_), config_.optimizer, norm_group(model_))),
      scaler_(config_.loss_scale) {
  config_.schedule.validate();
  if (config_.weight_decay_schedule) config_.weight_decay_schedule->validate();
  BRAID_CONFIG_CHECK(config_.pipeline_schedule == "1f1b" || config_.pipeline_schedule == "gpipe",
                     "pipeline schedule must be 1f1b or gpipe, got '", config_.pipeline_schedule,
                     "'");
  BRAID_CONFIG_CHECK(config_.pipeline_schedule == "1f1b" || model_.num_chunks() == 1,
                     "virtual pipeline stages need the 1f1b (interleaved) schedule");
  BRAID_CONFIG_CHECK(config_.global_batch_size >= 0, "global_batch_size must not be negative, got ",
                     config_.global_batch_size);
}

Trainer::~Trainer() = default;

void Trainer::set_iterations(int64_t iteration, int64_t skipped, int64_t update_samples,
                             int64_t consumed_samples) {
  BRAID_CHECK(iteration >= 0 && skipped >= 0 && skipped <= iteration && update_samples >= 0 &&
                  consumed_samples >= 0,
              "Trainer: bad iteration counters ", iteration, " (", skipped, " skipped, ",
              update_samples, " samples updated, ", consumed_samples, " consumed)");
  consumed_samples_ = consumed_samples;
  iteration_ = iteration;
  skipped_ = skipped;
  update_samples_ = update_samples;
}

void Trainer::pass_iteration(int64_t samples) {
  BRAID_CHECK(config_.global_batch_size > 0,
              "Trainer::pass_iteration needs TrainerConfig.global_batch_size (schedules that "
              "count samples), else the schedules would count the passed iteration as an update");
  BRAID_CHECK(samples > 0, "Trainer::pass_iteration: the passed batch has ", samples,
              " samples; it needs at least one");
  ++iteration_;
  consumed_samples_ += samples;
}

double Trainer::schedule_iterations() const {
  // Exact for full batches: k * b / b is k in doubles.
  return config_.global_batch_size > 0 ? double(update_samples_) / double(config_.global_batch_size)
                                       : double(iteration_ - skipped_);
}

void Trainer::set_trace(Trace* trace) {
  trace_ = trace;
  if (executor_) executor_->set_trace(trace);
}

PipelineExecutor& Trainer::executor(int microbatches, bool forward_only) {
  std::unique_ptr<PipelineExecutor>& slot = forward_only ? eval_executor_ : executor_;
  if (slot == nullptr || slot->schedule().microbatches != microbatches) {
    const comm::ParallelState& state = *model_.state();
    const int pp = state.grid().pp(), v = model_.num_chunks();
    Schedule schedule = forward_only ? make_forward_only(pp, microbatches, v)
                        : v > 1      ? make_interleaved_1f1b(pp, microbatches, v)
                        : config_.pipeline_schedule == "gpipe" ? make_gpipe(pp, microbatches)
                                                               : make_1f1b(pp, microbatches);
    slot = std::make_unique<PipelineExecutor>(std::move(schedule), model_.chunks(), state.pp());
    if (!forward_only) slot->set_trace(trace_);
  }
  return *slot;
}

float Trainer::run_microbatches(const Microbatches& batch, bool forward_only) {
  const comm::ParallelState* state = model_.state();
  if (state != nullptr && state->grid().pp() > 1)
    return executor(int(batch.ids.size()), forward_only)
        .run(batch.ids, batch.targets, batch.scales, batch.first_samples);
  model::GPTModel& m = model_.chunk(0);
  double loss = 0;
  Trace* trace = forward_only ? nullptr : trace_;
  for (size_t i = 0; i < batch.ids.size(); ++i) {
    float microbatch_loss = 0;
    {
      Trace::Scope span(trace, "forward", "compute", int(i), 0);
      m.forward_stage(batch.ids[i], batch.targets[i], Tensor(), int(i), &microbatch_loss,
                      !forward_only, forward_only ? -1 : batch.first_samples[i]);
    }
    loss += double(batch.scales[i]) * microbatch_loss;
    if (!forward_only) {
      Trace::Scope span(trace, "backward", "compute", int(i), 0);
      m.backward(int(i), batch.scales[i]);
    }
  }
  return float(loss);
}

Trainer::Microbatches Trainer::split(const Tensor& ids, const Tensor& targets, int num_microbatches,
                                     float loss_scale, const char* what) const {
  BRAID_CONFIG_CHECK(ids.dim() == 2 && targets.shape() == ids.shape(), "Trainer::", what,
                     ": ids and targets must both be [B, S], got ", ids.shape(), " and ",
                     targets.shape());
  BRAID_CONFIG_CHECK(num_microbatches > 0 && ids.size(0) % num_microbatches == 0, "Trainer::", what,
                     ": batch size ", ids.size(0),
                     " is not divisible by num_microbatches = ", num_microbatches);
  // Microbatches, and each one's share of the global batch's tokens.
  Microbatches batch;
  const int64_t rows = ids.size(0) / num_microbatches;
  const model::GPTModel& m = model_.chunk(0);
  model::check_sequence_shards(m.config(), rows, m.tensor_parallel(),
                               m.expert_parallel().whole_experts, m.context_parallel());
  // Microbatch m of DP rank d holds the global batch's rows (m·dp + d)·rows on (Megatron's
  // sampler; data::BatchLayout::sample): their run-wide indices key the dropout masks.
  const comm::ParallelState* state = model_.state();
  const int64_t dp = state != nullptr ? state->grid().dp() : 1;
  const int64_t dp_rank = state != nullptr ? state->dp_rank() : 0;
  std::vector<int64_t> counts;
  int64_t local = 0;
  for (int m = 0; m < num_microbatches; ++m) {
    batch.first_samples.push_back(consumed_samples_ + (m * dp + dp_rank) * rows);
    batch.ids.push_back(ids.narrow(m * rows, rows));
    batch.targets.push_back(targets.narrow(m * rows, rows));
    counts.push_back(count_targets(batch.targets.back()));
    local += counts.back();
  }
  std::vector<int64_t> total{local};
  all_reduce_host(state != nullptr ? &state->dp() : nullptr, total, DType::i64);
  batch.tokens = total[0];
  for (int64_t count : counts)
    batch.scales.push_back(total[0] > 0 ? loss_scale * float(double(count) / double(total[0]))
                                        : 0.0f);
  return batch;
}

float Trainer::global_loss(float local_loss) const {
  // This DP rank's part of the global mean sits on its last stage's TP and CP ranks.
  const comm::ParallelState* state = model_.state();
  const bool counts = state == nullptr || (state->tp_rank() == 0 && state->cp_rank() == 0);
  std::vector<float> loss{model_.is_last_stage() && counts ? local_loss : 0.0f};
  all_reduce_host(state != nullptr ? &state->world() : nullptr, loss, DType::f32);
  return loss[0];
}

void Trainer::moe_losses(int num_microbatches, StepStats& stats) const {
  const model::TransformerConfig& c = model_.config();
  if (c.num_experts == 0 || (c.moe_aux_loss_coeff == 0 && c.moe_z_loss_coeff == 0)) return;
  // Each rank holds its stages' layers for its DP replica's microbatches (its share of their
  // tokens under CP); every TP rank holds the same values, or its tokens' share when it routes
  // its own. Per layer: [balancing, z].
  const auto layers = size_t(c.num_layers + c.mtp_num_layers);
  std::vector<float> sums(2 * layers, 0.0f);
  for (model::GPTModel* chunk : model_.chunks()) {
    for (const auto& [layer, l] : chunk->take_moe_losses()) {
      sums[2 * size_t(layer)] = float(l.load_balancing);
      sums[2 * size_t(layer) + 1] = float(l.z);
    }
  }
  const comm::ParallelState* state = model_.state();
  all_reduce_host(state != nullptr ? &state->world() : nullptr, sums, DType::f32);
  const int tp = model_.chunk(0).expert_parallel().whole_experts
                     ? 1
                     : model_.chunk(0).tensor_parallel().size();
  const int dp = state != nullptr ? state->grid().dp() : 1;
  const double replicas = double(tp) * dp * num_microbatches;
  stats.layer_load_balancing_loss.assign(layers, 0.0);
  stats.layer_z_loss.assign(layers, 0.0);
  for (size_t l = 0; l < layers; ++l) {
    stats.layer_load_balancing_loss[l] = sums[2 * l] / replicas;
    stats.layer_z_loss[l] = sums[2 * l + 1] / replicas;
    stats.load_balancing_loss += stats.layer_load_balancing_loss[l];
    stats.z_loss += stats.layer_z_loss[l];
  }
  stats.load_balancing_loss /= double(c.num_moe_layers());
  stats.z_loss /= double(c.num_moe_layers());
}

void Trainer::mtp_losses(StepStats& stats) const {
  const int64_t depths = model_.config().mtp_num_layers;
  if (depths == 0) return;
  // The last stage's TP and CP ranks each hold the whole microbatches' sums: one of them counts.
  const comm::ParallelState* state = model_.state();
  const bool counts = state == nullptr || (state->tp_rank() == 0 && state->cp_rank() == 0);
  std::vector<float> sums(2 * size_t(depths), 0.0f);
  for (model::GPTModel* chunk : model_.chunks()) {
    const std::vector<model::GPTModel::MtpLoss> losses = chunk->take_mtp_losses();
    for (size_t k = 0; k < losses.size() && counts; ++k) {
      sums[2 * k] += float(losses[k].sum);
      sums[2 * k + 1] += float(losses[k].count);
    }
  }
  all_reduce_host(state != nullptr ? &state->world() : nullptr, sums, DType::f32);
  for (size_t k = 0; k < size_t(depths); ++k)
    stats.mtp_losses.push_back(sums[2 * k + 1] > 0 ? double(sums[2 * k]) / sums[2 * k + 1] : 0.0);
}

float Trainer::evaluate(const Tensor& ids, const Tensor& targets, int num_microbatches) {
  const Microbatches batch = split(ids, targets, num_microbatches, 1.0f, "evaluate");
  return global_loss(run_microbatches(batch, /*forward_only=*/true));
}

StepStats Trainer::train_step(const Tensor& ids, const Tensor& targets, int num_microbatches) {
  const Device device = model_.device();
  const comm::ParallelState* state = model_.state();
  // --overlap-param-gather: the previous step's gathers are still in flight; the forward waits
  // for each bucket just before it reads it (GradBuffer's param-use hook).
  synchronize(device);
  reset_peak_memory(device);
  const Trace::Recording recording(trace_ != nullptr ? trace_ : Trace::current());
  const size_t first_span = trace_ != nullptr ? trace_->spans().size() : 0;
  const int64_t start_ns = trace_ != nullptr ? trace_->now_ns() : 0;
  const auto start = std::chrono::steady_clock::now();
  const float loss_scale = scaler_.scale();
  const Microbatches batch = split(ids, targets, num_microbatches, loss_scale, "train_step");

  model_.zero_grad();
  model_.start_grad_sync(num_microbatches);
  const float local_loss = run_microbatches(batch, /*forward_only=*/false);
  model_.finish_grad_sync();

  StepStats stats;
  stats.tokens = batch.tokens;
  stats.loss_scale = loss_scale;
  stats.loss = global_loss(local_loss) / loss_scale;
  moe_losses(num_microbatches, stats);
  mtp_losses(stats);
  if (model_.config().moe_router_enable_expert_bias) {
    comm::Communicator* group = state != nullptr ? &state->dp_cp() : nullptr;
    for (model::GPTModel* chunk : model_.chunks()) chunk->update_expert_bias(group);
  }
  stats.grad_norm = optimizer_->grad_norm() / loss_scale;
  if (config_.log_num_zeros_in_grad) stats.num_zeros_in_grads = optimizer_->num_zeros_in_grads();
  // The schedule counts updates (skipped steps take none), not the optimizer's own step count,
  // which restarts with its state (--no-load-optim).
  stats.lr = config_.schedule.lr_at(schedule_iterations());
  stats.decoupled_lr = config_.schedule.decoupled_lr_at(schedule_iterations());
  if (config_.weight_decay_schedule)
    optimizer_->set_weight_decay(
        config_.weight_decay_schedule->weight_decay_at(schedule_iterations()));

  const bool non_finite = !std::isfinite(stats.loss) || !std::isfinite(stats.grad_norm);
  stats.skipped = scaler_.update(non_finite);
  if (stats.skipped) {
    ++skipped_;
    if (state == nullptr || state->rank() == 0) {
      log::warn("iteration ", iteration_ + 1, ": ",
                !std::isfinite(stats.loss) ? "the loss" : "the gradient norm", " is ",
                !std::isfinite(stats.loss) ? stats.loss : stats.grad_norm, "; step skipped (",
                skipped_, " so far)",
                scaler_.dynamic() ? "; loss scale now " + std::to_string(scaler_.scale()) : "");
    }
  } else {
    float coeff = 1.0f;
    if (config_.optimizer.clip_grad > 0)
      coeff = std::min(1.0f, config_.optimizer.clip_grad / (stats.grad_norm + 1e-6f));
    Trace::Scope span(trace_, "optimizer", "compute");
    optimizer_->step_with(stats.lr, coeff / loss_scale, stats.decoupled_lr);
    model_.start_param_gather();
    update_samples_ += ids.size(0) * (state != nullptr ? state->grid().dp() : 1);
  }
  ++iteration_;
  consumed_samples_ += ids.size(0) * (state != nullptr ? state->grid().dp() : 1);

  synchronize(device);
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (trace_ != nullptr) {
    trace_->end("step", "step", start_ns);
    add_breakdown(*trace_, first_span, stats);
  }
  const int64_t dp = state != nullptr ? state->grid().dp() : 1;
  stats.tokens_per_second = stats.seconds > 0 ? double(ids.numel()) * dp / stats.seconds : 0.0;
  stats.peak_memory_bytes = memory_stats(device).peak_bytes;
  return stats;
}

}  // namespace braid::engine
