#include "engine/checkpoint_index.h"

#include <cstdio>

#include "braid/engine/schedule.h"
#include "braid/model/expert_parallel.h"
#include "braid/model/moe.h"
#include "engine/checkpoint_config.h"

namespace braid::engine {

using nlohmann::json;

SavedLayout layout_of(const ParallelModel& model) {
  SavedLayout l;
  if (const comm::ParallelState* s = model.state()) {
    l.tp = s->grid().tp();
    l.pp = s->grid().pp();
    l.dp = s->grid().dp();
    l.cp = s->grid().cp();
    l.ep = s->grid().ep();
  } else {
    l.tp = model.chunk(0).tensor_parallel().size();
    l.ep = model.chunk(0).expert_parallel().size();
  }
  l.whole_experts = model.chunk(0).expert_parallel().whole_experts && l.tp > 1;
  l.virtual_stages = model.num_chunks();
  l.first_stage_layers = model.parallel().first_stage_layers;
  l.last_stage_layers = model.parallel().last_stage_layers;
  l.model_chunk_layers = model.parallel().model_chunk_layers;
  l.distributed_optimizer = model.parallel().ddp.use_distributed_optimizer;
  return l;
}

std::string file_name(int tp_rank, int pp_rank, int ep_rank, int ep) {
  char name[64];
  if (ep > 1) {
    std::snprintf(name, sizeof(name), "mp_rank_%02d_%03d_%03d.safetensors", tp_rank, pp_rank,
                  ep_rank);
  } else {
    std::snprintf(name, sizeof(name), "mp_rank_%02d_%03d.safetensors", tp_rank, pp_rank);
  }
  return name;
}

std::vector<Slice> stored_slices(const model::ParamLayout& layout) {
  std::vector<Slice> out;
  for (size_t i = 0; i < layout.specs.size(); ++i) {
    const model::ParamSpec& spec = layout.specs[i];
    const model::ParamShard& shard = layout.shards[i];
    if (spec.name == "model.embed_tokens.weight" && !layout.chunk.embedding) continue;
    if (layout.tp_rank % shard.replicas != 0) continue;
    const Shape valid = shard.valid_shape();
    if (valid.numel() == 0) continue;
    const int dim = shard.replicas == layout.tp_size && layout.tp_size > 1 ? -1 : spec.tp_dim;
    out.push_back(Slice{i, dim, dim >= 0 ? shard.start : 0, dim >= 0 ? valid[dim] : spec.shape[0]});
  }
  return out;
}

json checkpoint_metadata(Trainer& trainer, const LoopState& loop, const SaveOptions& options) {
  const ParallelModel& model = trainer.model();
  const SavedLayout saved = layout_of(model);
  const model::TransformerConfig& config = model.config();
  json tensors = json::object();
  const bool bf16 = config.params_dtype != DType::f32;
  const auto layers =
      stage_layers(int(config.num_layers), saved.pp, saved.virtual_stages, saved.first_stage_layers,
                   saved.last_stage_layers, saved.model_chunk_layers);
  for (int p = 0; p < saved.pp; ++p) {
    for (int c = 0; c < saved.virtual_stages; ++c) {
      const model::ModelChunk held = pipeline_chunk(layers, p, c);
      // The expert biases (replicated, f32) in TP rank 0's file.
      for (int64_t l = held.first_layer; l < model::held_layers_end(held, config); ++l) {
        if (!config.moe_router_enable_expert_bias || !config.is_moe_layer(l)) continue;
        json& entry = tensors[model::expert_bias_name(l)];
        entry["shape"] = std::vector<int64_t>{config.num_experts};
        entry["split_dim"] = -1;
        entry["shards"].push_back(json{
            {"file", file_name(0, p, 0, saved.ep)}, {"start", 0}, {"length", config.num_experts}});
      }
      // Who writes what (CheckpointSaver::save): TP rank t's dense shards the rank of DP and CP
      // rank 0 - EP rank 0, or with whole experts EP rank t % ep -; EP rank e's experts (their
      // TP shards, or whole) its expert-DP rank 0 - with whole experts TP rank e % tp.
      model::ModelChunk whole = held;
      whole.whole_experts = saved.whole_experts;
      for (int t = 0; t < saved.tp; ++t) {
        const int dense_ep_rank = saved.whole_experts ? t % saved.ep : 0;
        for (int e = 0; e < saved.ep; ++e) {
          const model::ParamLayout layout = model::parameter_layout(
              config, t, saved.tp, model::holding_experts(whole, e, saved.ep, config.num_experts));
          for (const Slice& s : stored_slices(layout)) {
            const model::ParamSpec& spec = layout.specs[s.param];
            if (spec.expert < 0 && e != dense_ep_rank) continue;
            if (spec.expert >= 0 && saved.whole_experts && t != e % saved.tp) continue;
            std::vector<std::string> keys{spec.name};
            if (options.save_optim) {
              keys.push_back("optimizer.exp_avg." + spec.name);
              keys.push_back("optimizer.exp_avg_sq." + spec.name);
              if (bf16) keys.push_back("optimizer.master." + spec.name);
            }
            for (const std::string& key : keys) {
              json& entry = tensors[key];
              entry["shape"] = std::vector<int64_t>(spec.shape.begin(), spec.shape.end());
              entry["split_dim"] = s.tp_dim;
              entry["shards"].push_back(json{{"file", file_name(t, p, e, saved.ep)},
                                             {"start", s.start},
                                             {"length", s.length}});
            }
          }
        }
      }
    }
  }
  json saved_layout{{"tensor_model_parallel_size", saved.tp},
                    {"pipeline_model_parallel_size", saved.pp},
                    {"data_parallel_size", saved.dp},
                    {"context_parallel_size", saved.cp},
                    {"expert_model_parallel_size", saved.ep},
                    {"expert_tensor_parallel_size", saved.whole_experts ? 1 : saved.tp},
                    {"virtual_pipeline_stages", saved.virtual_stages},
                    {"use_distributed_optimizer", saved.distributed_optimizer}};
  if (saved.first_stage_layers)
    saved_layout["decoder_first_pipeline_num_layers"] = *saved.first_stage_layers;
  if (saved.last_stage_layers)
    saved_layout["decoder_last_pipeline_num_layers"] = *saved.last_stage_layers;
  if (!saved.model_chunk_layers.empty())
    saved_layout["model_chunk_layers"] = saved.model_chunk_layers;
  const LossScaler::State scaler = trainer.loss_scaler().state();
  const LRSchedule& lr = trainer.schedule();
  json meta{{"format", "braid-checkpoint"},
            {"format_version", format_version(config)},
            {"iteration", trainer.iteration()},
            {"config", config_json(config)},
            {"layout", saved_layout},
            {"trainer",
             {{"iteration", trainer.iteration()},
              {"skipped_iterations", trainer.skipped_iterations()},
              {"update_samples", trainer.update_samples()},
              {"global_batch_size", trainer.config().global_batch_size},
              {"optimizer_steps", trainer.optimizer().step()}}},
            {"lr_schedule",
             {{"lr", lr.lr},
              {"min_lr", lr.min_lr},
              {"warmup_iters", lr.warmup_iters},
              {"decay_iters", lr.decay_iters},
              {"style", to_string(lr.style)},
              {"warmup_init", lr.warmup_init},
              {"wsd_decay_iters", lr.wsd_decay_iters},
              {"wsd_style", to_string(lr.wsd_style)},
              {"lr_now", lr.lr_at(trainer.schedule_iterations())}}},
            {"loss_scaler",
             {{"scale", scaler.scale},
              {"growth_tracker", scaler.growth_tracker},
              {"hysteresis_tracker", scaler.hysteresis_tracker}}},
            {"consumed_samples",
             loop.consumed_samples >= 0 ? loop.consumed_samples : trainer.consumed_samples()},
            {"device_seconds", loop.device_seconds},
            {"skipped_train_samples", loop.skipped_train_samples},
            {"optimizer", options.save_optim},
            {"tensors", tensors}};
  if (loop.consumed_valid_samples >= 0)
    meta["consumed_valid_samples"] = loop.consumed_valid_samples;
  // The weight decay's schedule (Megatron saves it with the learning rate's): constant is
  // --weight-decay throughout.
  const std::optional<WeightDecaySchedule>& wd = trainer.config().weight_decay_schedule;
  const float decay = trainer.config().optimizer.weight_decay;
  meta["lr_schedule"]["weight_decay"] =
      wd ? json{{"start", wd->start},
                {"end", wd->end},
                {"incr_iters", wd->incr_iters},
                {"style", to_string(wd->style)}}
         : json{{"start", decay}, {"end", decay}, {"style", "constant"}};
  if (lr.decoupled_lr) {
    meta["lr_schedule"]["decoupled_lr"] = *lr.decoupled_lr;
    meta["lr_schedule"]["decoupled_min_lr"] = lr.decoupled_min_lr.value_or(lr.min_lr);
  }
  // Adam's constants (what convert_megatron.py export writes into Megatron's param groups).
  const AdamWConfig& adam = trainer.config().optimizer;
  meta["adam"] = {{"beta1", adam.beta1}, {"beta2", adam.beta2}, {"eps", adam.eps}};
  if (options.save_rng) {
    meta["rng"] = {{"seed", model.chunk(0).seed()}};
  }
  return meta;
}

}  // namespace braid::engine
