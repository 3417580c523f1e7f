#include "braid/engine/parallel_model.h"

#include <cstring>
#include <numeric>
#include <sstream>

#include "braid/comm/mpi_communicator.h"
#include "braid/core/log.h"
#include "braid/engine/schedule.h"
#include "braid/kernels/ops.h"

namespace braid::engine {
namespace {

// Whether the model's experts are whole on each rank (expert TP 1 under TP; a dense model has
// none, and keeps the plain layout whatever --expert-tensor-parallel-size says).
bool whole_experts(const model::TransformerConfig& config, const comm::RankGrid& grid) {
  return grid.whole_experts() && config.num_experts > 0;
}

// What gradient buckets split into: the DP × CP ranks, and when experts have a group of their
// own, its ranks too (the expert-DP size differs from dp · cp with whole experts).
int bucket_unit(const model::TransformerConfig& config, const comm::RankGrid& grid) {
  const int dp = grid.dp() * grid.cp();
  return grid.ep() > 1 || whole_experts(config, grid) ? std::lcm(dp, grid.expert_dp()) : dp;
}

// The gradient buckets of chunk `c` of a rank that holds `held` (its experts included) as TP rank
// `tp_rank`: over dp × cp, kept apart by kind under expert parallelism.
std::vector<Bucket> chunk_buckets(const model::TransformerConfig& config,
                                  const comm::RankGrid& grid, const ParallelConfig& parallel,
                                  int tp_rank, const model::ModelChunk& held, int c) {
  const int dp = bucket_unit(config, grid);
  const DDPConfig& ddp = parallel.ddp;
  const model::ParamLayout layout = model::parameter_layout(config, tp_rank, grid.tp(), held);
  // Tied embeddings (or MTP's lookup table) on two stages, sharded by ZeRO: a bucket of their own
  // on both (see grad_buffer.h), so the embedding group's sum after the reduce-scatter matches
  // rows.
  const bool separate_embedding = ddp.use_distributed_optimizer && grid.pp() > 1 &&
                                  config.head_uses_embedding() && (held.embedding || held.head);
  return make_buckets(layout, dp, ddp.bucket_elements(dp), ddp.overlap_grad_reduce && c == 0,
                      separate_embedding, grid.ep() > 1 || whole_experts(config, grid));
}

}  // namespace

void ParallelConfig::validate(const model::TransformerConfig& config,
                              const comm::RankGrid& grid) const {
  config.validate();
  ddp.validate();
  model::check_tensor_parallel(config, grid.tp());
  BRAID_CONFIG_CHECK(virtual_stages >= 1, "virtual pipeline stages must be >= 1, got ",
                     virtual_stages);
  BRAID_CONFIG_CHECK(virtual_stages == 1 || grid.pp() > 1,
                     "virtual pipeline stages (interleaving) need --pipeline-model-parallel-size "
                     "> 1, got ",
                     grid.pp());
  layers(int(config.num_layers), grid.pp());  // ConfigError unless the layers split
  model::check_expert_parallel(config, grid.ep());
}

std::vector<std::vector<LayerRange>> ParallelConfig::layers(int num_layers, int pp) const {
  return stage_layers(num_layers, pp, virtual_stages, first_stage_layers, last_stage_layers,
                      model_chunk_layers);
}

model::ModelChunk pipeline_chunk(const std::vector<std::vector<LayerRange>>& layers, int pp_rank,
                                 int chunk) {
  const int pp = int(layers.size()), virtual_stages = int(layers.front().size());
  const LayerRange range = layers.at(size_t(pp_rank)).at(size_t(chunk));
  const int model_chunk = chunk * pp + pp_rank;
  return {range.begin, range.end, model_chunk == 0, model_chunk == pp * virtual_stages - 1};
}

ParallelModel::ParallelModel(const model::TransformerConfig& config, Device device, uint64_t seed,
                             const comm::ParallelState& state, const ParallelConfig& parallel)
    : state_(&state), parallel_(parallel) {
  const comm::RankGrid& grid = state.grid();
  parallel_.validate(config, grid);
  // Gradients are summed (and the distributed optimizer shards) over DP × CP; experts' over
  // the expert-DP group (part of it, or with whole experts of the stage's TP × DP × CP).
  const int pp = grid.pp(), v = parallel_.virtual_stages, dp = grid.dp() * grid.cp();
  const model::TensorParallel tp{&state.tp(), parallel_.sequence_parallel};
  const model::ContextParallel cp{&state.cp()};
  const model::ExpertParallel ep{grid.ep() > 1 ? &state.ep() : nullptr,
                                 whole_experts(config, grid)};
  // MPI moves non-blocking collectives only inside MPI calls: a thread polls them, where MPI
  // allows threads (else the reductions progress when finish_grad_sync waits for them).
  if ((dp > 1 || (ep.whole_experts && grid.expert_dp() > 1)) && device.is_cpu()) {
    if (comm::MpiCommunicator::thread_multiple()) {
      progress_ = std::make_unique<comm::ProgressThread>();
    } else if (state.rank() == 0) {
      log::warn("MPI lacks MPI_THREAD_MULTIPLE: data-parallel reductions will not overlap");
    }
  }
  const auto layers = parallel_.layers(int(config.num_layers), pp);
  for (int c = 0; c < v; ++c) {
    // Under EP: this rank's experts, aligned for buckets that hold them alone.
    model::ModelChunk held =
        ep.holding(pipeline_chunk(layers, state.pp_rank(), c), config.num_experts);
    if (ep.active() || ep.whole_experts) held.expert_alignment = bucket_unit(config, grid);
    std::vector<Bucket> buckets = chunk_buckets(config, grid, parallel_, state.tp_rank(), held, c);
    owned_.push_back(std::make_unique<model::GPTModel>(config, device, seed, tp, held,
                                                       buffer_elements(buckets), cp, ep));
    chunks_.push_back(owned_.back().get());
    chunks_.back()->set_embedding_group(state.embedding());
    buffers_.push_back(std::make_unique<GradBuffer>(*chunks_.back(), &state.dp_cp(),
                                                    &state.expert_dp(), parallel_.ddp,
                                                    std::move(buckets), progress_.get()));
  }
}

ParallelModel::ParallelModel(model::GPTModel& model) : chunks_{&model} {
  const model::ExpertParallel& ep = model.expert_parallel();
  BRAID_CHECK(!ep.active() && !(ep.whole_experts && model.tensor_parallel().active()),
              "ParallelModel: a model with expert parallelism or whole experts needs a "
              "ParallelState, whose expert-data-parallel group sums the experts' gradients");
  const model::ParamLayout& layout = model.layout();
  buffers_.push_back(std::make_unique<GradBuffer>(
      model, nullptr, nullptr, parallel_.ddp,
      make_buckets(layout, 1, layout.num_elements + 1, false, false), nullptr));
}

ParallelModel::~ParallelModel() {
  buffers_.clear();  // before the progress thread and the models they point into
}

void ParallelModel::zero_grad() {
  for (model::GPTModel* m : chunks_) m->zero_grad();
}

void ParallelModel::start_grad_sync(int microbatches) {
  for (auto& b : buffers_) b->start_grad_sync(microbatches);
}

void ParallelModel::finish_grad_sync() {
  for (auto& b : buffers_) b->finish_grad_sync();
  for (model::GPTModel* m : chunks_) m->finalize_grads();
}

void ParallelModel::start_param_gather() {
  for (auto& b : buffers_) b->start_param_gather();
}

void ParallelModel::finish_param_gather() {
  for (auto& b : buffers_) b->finish_param_gather();
}

void ParallelModel::gather_into(model::GPTModel& whole) {
  finish_param_gather();
  const model::ParamLayout& target = whole.layout();
  BRAID_CHECK(target.tp_size == 1 && whole.chunk().embedding && whole.chunk().head &&
                  whole.chunk().first_layer == 0 &&
                  whole.chunk().end_layer == int(whole.config().num_layers),
              "ParallelModel::gather_into: the target must be a whole one-process model");
  std::unordered_map<std::string, size_t> index;
  for (size_t j = 0; j < target.specs.size(); ++j) index.emplace(target.specs[j].name, j);
  // Each element is written by exactly one rank (DP and CP rank 0 - for an expert's, expert-DP
  // rank 0 of the EP rank holding it -, the first TP rank of those holding a shard, the first
  // stage for tied embeddings) into the whole model's layout; a sum over the world then gives
  // every rank every value (adding zeros is exact).
  Tensor global = Tensor::zeros({target.num_elements}, DType::f32);
  float* out = global.data_ptr<float>();
  // Which of the target's parameters some rank wrote, and (last) whether a rank found one that
  // differs from the target's: summed over the world before any value is, so that every rank
  // refuses a target of another config (each rank sees only its stage's parameters).
  const size_t n = target.specs.size();
  Tensor written = Tensor::zeros({int64_t(n + 1)}, DType::f32);
  std::string problem;
  const bool writes_dense = state_ == nullptr || (state_->dp_rank() == 0 && state_->cp_rank() == 0);
  const bool writes_experts = state_ == nullptr || state_->expert_dp_rank() == 0;
  for (model::GPTModel* m : chunks_) {
    const model::ParamLayout& layout = m->layout();
    for (size_t i = 0; i < layout.specs.size(); ++i) {
      const model::ParamSpec& spec = layout.specs[i];
      const model::ParamShard& shard = layout.shards[i];
      if (spec.name == "model.embed_tokens.weight" && !m->chunk().embedding) continue;
      auto it = index.find(spec.name);
      if (it == index.end() || target.specs[it->second].shape != spec.shape) {
        std::ostringstream what;
        what << spec.name << " is " << spec.shape << " in this model and ";
        if (it == index.end())
          what << "absent from the target";
        else
          what << target.specs[it->second].shape << " in the target";
        if (problem.empty()) problem = what.str();
        continue;
      }
      written.data_ptr<float>()[it->second] = 1.0f;
      if (!(spec.expert >= 0 ? writes_experts : writes_dense)) continue;
      if (layout.tp_rank % shard.replicas != 0) continue;
      Tensor value = Tensor::empty(m->parameters()[i].value.shape(), DType::f32);
      ops::cast(value, m->parameters()[i].value.to(Device::cpu()));
      const float* in = value.data_ptr<float>();
      float* dst = out + target.offsets[it->second];
      const Shape valid = shard.valid_shape();
      const int64_t rows = valid[0], cols = valid.dim() > 1 ? valid[1] : 1;
      const int64_t global_cols = spec.shape.dim() > 1 ? spec.shape[1] : 1;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t row = spec.tp_dim == 0 ? shard.start + r : r;
        const int64_t col = spec.tp_dim == 1 ? shard.start : 0;
        std::memcpy(dst + row * global_cols + col, in + r * cols, size_t(cols) * sizeof(float));
      }
    }
  }
  written.data_ptr<float>()[n] = problem.empty() ? 0.0f : 1.0f;
  const bool many = state_ != nullptr && state_->world().size() > 1;
  auto sum_over_world = [&](Tensor& t) {
    Tensor on_device = t.to(state_->world().device());
    state_->world().all_reduce(on_device)->wait();
    t = on_device.to(Device::cpu());
  };
  if (many) sum_over_world(written);
  const float* seen = written.data_ptr<float>();
  BRAID_CONFIG_CHECK(problem.empty(),
                     "ParallelModel::gather_into: the target is another model: ", problem);
  BRAID_CONFIG_CHECK(seen[n] == 0.0f,
                     "ParallelModel::gather_into: the target is another model "
                     "(another rank found a parameter that differs)");
  for (size_t j = 0; j < n; ++j) {
    BRAID_CONFIG_CHECK(seen[j] > 0.0f, "ParallelModel::gather_into: the target is another model: ",
                       target.specs[j].name, " is ", target.specs[j].shape,
                       " in the target and absent from this model");
  }
  if (many) sum_over_world(global);
  ops::cast(whole.flat_params().slice(0, {target.num_elements}), global.to(whole.device()));
}

}  // namespace braid::engine
