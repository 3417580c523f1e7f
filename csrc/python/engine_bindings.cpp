// AdamW, the LR schedule, loss scaling and the Trainer (one process or any layout).

#include <pybind11/stl.h>

#include <optional>

#include "bindings.h"
#include "braid/engine/adamw.h"
#include "braid/engine/loss_scaler.h"
#include "braid/engine/lr_schedule.h"
#include "braid/engine/parallel_model.h"
#include "braid/engine/trainer.h"

namespace braid::python {
namespace {

// Trainer::train_step or Trainer::evaluate on a batch given as any DLPack/numpy token array,
// the GIL released while it runs.
template <typename Method>
auto on_batch(Method method) {
  return [method](engine::Trainer& t, py::handle ids, py::handle targets, int num_microbatches) {
    Tensor i = token_tensor(ids, "ids"), tg = token_tensor(targets, "targets");
    py::gil_scoped_release release;
    return (t.*method)(i, tg, num_microbatches);
  };
}

}  // namespace

void bind_engine(py::module_& m) {
  using namespace engine;
  py::class_<AdamWConfig>(m, "AdamWConfig")
      .def(py::init([](float lr, float beta1, float beta2, float eps, float weight_decay,
                       float clip_grad, bool decay_embeddings) {
             AdamWConfig c;
             c.lr = lr;
             c.beta1 = beta1;
             c.beta2 = beta2;
             c.eps = eps;
             c.weight_decay = weight_decay;
             c.clip_grad = clip_grad;
             c.decay_embeddings = decay_embeddings;
             c.validate();
             return c;
           }),
           py::arg("lr") = 1e-3f, py::arg("beta1") = 0.9f, py::arg("beta2") = 0.999f,
           py::arg("eps") = 1e-8f, py::arg("weight_decay") = 0.01f, py::arg("clip_grad") = 1.0f,
           py::arg("decay_embeddings") = false,
           "AdamW settings; weight decay skips norms and biases always, embeddings unless "
           "decay_embeddings. clip_grad 0 turns clipping off.")
      .def_readwrite("lr", &AdamWConfig::lr)
      .def_readwrite("beta1", &AdamWConfig::beta1)
      .def_readwrite("beta2", &AdamWConfig::beta2)
      .def_readwrite("eps", &AdamWConfig::eps)
      .def_readwrite("weight_decay", &AdamWConfig::weight_decay)
      .def_readwrite("clip_grad", &AdamWConfig::clip_grad)
      .def_readwrite("decay_embeddings", &AdamWConfig::decay_embeddings);

  py::class_<LRSchedule>(m, "LRSchedule")
      .def(py::init([](float lr, float min_lr, double warmup_iters, double decay_iters,
                       const std::string& style, float warmup_init, double wsd_decay_iters,
                       const std::string& wsd_style, double iterations_per_sample,
                       std::optional<float> decoupled_lr, std::optional<float> decoupled_min_lr) {
             LRSchedule s;
             s.lr = lr;
             s.min_lr = min_lr;
             s.warmup_iters = warmup_iters;
             s.decay_iters = decay_iters;
             s.style = lr_decay_style_from_string(style);
             s.warmup_init = warmup_init;
             s.wsd_decay_iters = wsd_decay_iters;
             s.wsd_style = wsd_decay_style_from_string(wsd_style);
             s.iterations_per_sample = iterations_per_sample;
             s.decoupled_lr = decoupled_lr;
             s.decoupled_min_lr = decoupled_min_lr;
             s.validate();
             return s;
           }),
           py::arg("lr"), py::arg("min_lr") = 0.0f, py::arg("warmup_iters") = 0,
           py::arg("decay_iters") = 0, py::arg("style") = "cosine", py::arg("warmup_init") = 0.0f,
           py::arg("wsd_decay_iters") = 0, py::arg("wsd_style") = "exponential",
           py::arg("iterations_per_sample") = 1.0, py::arg("decoupled_lr") = py::none(),
           py::arg("decoupled_min_lr") = py::none(),
           "Megatron's schedule (engine/lr_schedule.h): style constant, linear, cosine, "
           "inverse-square-root or WSD (wsd_style exponential, linear, cosine, minus_sqrt over "
           "the last wsd_decay_iters); warmup from warmup_init; iterations may be fractional. "
           "decoupled_lr / decoupled_min_lr: the embedding's and output layer's peak and floor.")
      .def("lr_at", &LRSchedule::lr_at, py::arg("iteration"))
      .def("decoupled_lr_at", &LRSchedule::decoupled_lr_at, py::arg("iteration"));

  py::class_<LossScaleConfig>(m, "LossScaleConfig",
                              "Megatron's loss scaling: none (0), constant, or dynamic.")
      .def(py::init([](float loss_scale, bool dynamic, float initial_loss_scale,
                       float min_loss_scale, int loss_scale_window, int hysteresis) {
             LossScaleConfig c;
             c.loss_scale = loss_scale;
             c.dynamic = dynamic;
             c.initial_loss_scale = initial_loss_scale;
             c.min_loss_scale = min_loss_scale;
             c.loss_scale_window = loss_scale_window;
             c.hysteresis = hysteresis;
             c.validate();
             return c;
           }),
           py::arg("loss_scale") = 0.0f, py::arg("dynamic") = false,
           py::arg("initial_loss_scale") = 4294967296.0f, py::arg("min_loss_scale") = 1.0f,
           py::arg("loss_scale_window") = 1000, py::arg("hysteresis") = 2)
      .def_readwrite("loss_scale", &LossScaleConfig::loss_scale)
      .def_readwrite("dynamic", &LossScaleConfig::dynamic)
      .def_readwrite("initial_loss_scale", &LossScaleConfig::initial_loss_scale)
      .def_readwrite("min_loss_scale", &LossScaleConfig::min_loss_scale)
      .def_readwrite("loss_scale_window", &LossScaleConfig::loss_scale_window)
      .def_readwrite("hysteresis", &LossScaleConfig::hysteresis);

  py::class_<WeightDecaySchedule>(m, "WeightDecaySchedule",
                                  "Megatron's --start-weight-decay / --end-weight-decay over "
                                  "incr_iters, --weight-decay-incr-style linear or cosine.")
      .def(py::init([](float start, float end, double incr_iters, const std::string& style) {
             WeightDecaySchedule s{start, end, incr_iters, wd_incr_style_from_string(style)};
             s.validate();
             return s;
           }),
           py::arg("start"), py::arg("end"), py::arg("incr_iters"), py::arg("style") = "linear")
      .def("weight_decay_at", &WeightDecaySchedule::weight_decay_at, py::arg("iteration"));

  py::class_<TrainerConfig>(m, "TrainerConfig")
      .def(py::init([](const AdamWConfig& optimizer, const LRSchedule& schedule,
                       const LossScaleConfig& loss_scale, const std::string& pipeline_schedule,
                       std::optional<WeightDecaySchedule> weight_decay_schedule,
                       int64_t global_batch_size, bool log_num_zeros_in_grad) {
             return TrainerConfig{
                 optimizer,         schedule,          weight_decay_schedule, loss_scale,
                 pipeline_schedule, global_batch_size, log_num_zeros_in_grad};
           }),
           py::arg("optimizer"), py::arg("schedule"), py::arg("loss_scale") = LossScaleConfig{},
           py::arg("pipeline_schedule") = "1f1b", py::arg("weight_decay_schedule") = py::none(),
           py::arg("global_batch_size") = 0, py::arg("log_num_zeros_in_grad") = false,
           "pipeline_schedule: \"1f1b\" (interleaved with virtual stages) or \"gpipe\", when pp > "
           "1. weight_decay_schedule: each step's weight decay (None: the optimizer's). "
           "global_batch_size: the schedules' iteration in samples, so that smaller (ramped-up) "
           "batches advance them less, as in Megatron (0: one iteration per update). "
           "log_num_zeros_in_grad: StepStats.num_zeros_in_grads every step.")
      .def_readwrite("optimizer", &TrainerConfig::optimizer)
      .def_readwrite("schedule", &TrainerConfig::schedule)
      .def_readwrite("loss_scale", &TrainerConfig::loss_scale)
      .def_readwrite("pipeline_schedule", &TrainerConfig::pipeline_schedule);

  py::class_<StepStats>(m, "StepStats")
      .def_readonly("loss", &StepStats::loss)
      .def_readonly("grad_norm", &StepStats::grad_norm)
      .def_readonly("lr", &StepStats::lr)
      .def_readonly("decoupled_lr", &StepStats::decoupled_lr)
      .def_readonly("num_zeros_in_grads", &StepStats::num_zeros_in_grads)
      .def_readonly("loss_scale", &StepStats::loss_scale)
      .def_readonly("skipped", &StepStats::skipped)
      .def_readonly("tokens", &StepStats::tokens)
      .def_readonly("seconds", &StepStats::seconds)
      .def_readonly("tokens_per_second", &StepStats::tokens_per_second)
      .def_readonly("peak_memory_bytes", &StepStats::peak_memory_bytes)
      .def_readonly("load_balancing_loss", &StepStats::load_balancing_loss)
      .def_readonly("z_loss", &StepStats::z_loss)
      .def_readonly("layer_load_balancing_loss", &StepStats::layer_load_balancing_loss)
      .def_readonly("layer_z_loss", &StepStats::layer_z_loss)
      .def_readonly("mtp_losses", &StepStats::mtp_losses)
      .def_readonly("compute_seconds", &StepStats::compute_seconds)
      .def_readonly("pipeline_wait_seconds", &StepStats::pipeline_wait_seconds)
      .def_readonly("tp_wait_seconds", &StepStats::tp_wait_seconds)
      .def_readonly("ep_wait_seconds", &StepStats::ep_wait_seconds)
      .def_readonly("dp_wait_seconds", &StepStats::dp_wait_seconds)
      .def_readonly("other_wait_seconds", &StepStats::other_wait_seconds);

  py::class_<Trace>(
      m, "Trace",
      "A rank's timeline of spans, written as Chrome's Trace Event Format (open it in "
      "Perfetto; tools/plot_schedule.py draws the ranks' files). Give it to "
      "Trainer.set_trace to record the steps.")
      .def(py::init([](int rank, const std::string& device) {
             return std::make_unique<Trace>(rank, device_from_name(device));
           }),
           py::arg("rank") = 0, py::arg("device") = "cpu",
           "rank: the process row; device: on cuda spans synchronize the device before ending.")
      .def("set_origin", py::overload_cast<>(&Trace::set_origin),
           "Time spans from now (call right after a barrier to align the ranks).")
      .def("clear", &Trace::clear)
      .def("write", &Trace::write, py::arg("path"))
      .def("__len__", [](const Trace& t) { return t.spans().size(); })
      .def_property_readonly(
          "spans",
          [](const Trace& t) {
            py::list out;
            for (const TraceSpan& s : t.spans())
              out.append(py::dict(py::arg("name") = s.name, py::arg("lane") = s.lane,
                                  py::arg("start_ns") = s.start_ns, py::arg("dur_ns") = s.dur_ns,
                                  py::arg("microbatch") = s.microbatch, py::arg("chunk") = s.chunk,
                                  py::arg("detail") = s.detail));
            return out;
          },
          "The spans as dicts: name, lane, start_ns, dur_ns, microbatch, chunk, detail.");

  py::class_<AdamW>(m, "AdamW",
                    "AdamW over a model's flat buffers, for hand-written loops: "
                    "forward/backward yourself, then step().")
      .def(py::init<model::GPTModel&, AdamWConfig>(), py::arg("model"), py::arg("config"),
           py::keep_alive<1, 2>())
      .def(
          "step",
          [](AdamW& a, std::optional<float> lr) {
            py::gil_scoped_release release;
            return lr ? a.clip_and_step(*lr) : a.clip_and_step();
          },
          py::arg("lr") = py::none(),
          "Clips to config.clip_grad and takes one step; returns the gradient norm before "
          "clipping.")
      .def("grad_norm", &AdamW::grad_norm)
      .def_property_readonly("steps", &AdamW::step);

  py::class_<Trainer>(m, "Trainer",
                      "One training step: microbatches (the pipeline schedule when pp > 1), the "
                      "data-parallel gradient reduction, clipping, loss scaling, AdamW, LR "
                      "schedule. Trainer(model, optimizer, schedule) for a one-process GPTModel; "
                      "Trainer(parallel_model, trainer_config) for any layout.")
      .def(py::init<model::GPTModel&, AdamWConfig, LRSchedule>(), py::arg("model"),
           py::arg("optimizer"), py::arg("schedule"), py::keep_alive<1, 2>())
      .def(py::init([](ParallelModel& model, const TrainerConfig& config) {
             py::gil_scoped_release release;
             return std::make_unique<Trainer>(model, config);
           }),
           py::arg("model"), py::arg("config"), py::keep_alive<1, 2>())
      .def("train_step", on_batch(&Trainer::train_step), py::arg("ids"), py::arg("targets"),
           py::arg("num_microbatches") = 1,
           "ids, targets [B, S]: this DP rank's share of the global batch (the same on every TP "
           "and PP rank of it), B split into num_microbatches. The loss is the global batch's. "
           "The global batch is samples consumed_samples on in Megatron's sampler's order (as "
           "DataLoader gives them): their indices key the dropout masks.")
      .def("evaluate", on_batch(&Trainer::evaluate), py::arg("ids"), py::arg("targets"),
           py::arg("num_microbatches") = 1,
           "The global batch's loss without training on it (validation): forwards only, no "
           "dropout, nothing changes. Collective, like train_step.")
      .def_property_readonly("iteration", &Trainer::iteration,
                             "Steps attempted (skipped ones included); a loaded checkpoint's.")
      .def_property_readonly(
          "model", [](Trainer& t) -> ParallelModel& { return t.model(); },
          py::return_value_policy::reference_internal,
          "The ParallelModel it trains (for the one-process constructor, its internal "
          "one-rank wrapper of the GPTModel).")
      .def("pass_iteration", &Trainer::pass_iteration, py::arg("samples"),
           "Counts an iteration that trains on nothing (--iterations-to-skip): its batch of "
           "`samples` (over all DP ranks) is read and dropped; the iteration and "
           "consumed_samples advance; parameters, optimizer state, the schedules' position and "
           "the skipped count stay. Not collective.")
      .def_property_readonly("skipped_iterations", &Trainer::skipped_iterations)
      .def_property_readonly("update_samples", &Trainer::update_samples,
                             "Samples (over all DP ranks) of the updates taken.")
      .def_property_readonly("consumed_samples", &Trainer::consumed_samples,
                             "Samples (over all DP ranks) of every step so far, skipped and "
                             "passed ones too, from a loaded checkpoint's: the next step's first "
                             "sample, the key of its dropout masks.")
      .def_property_readonly("schedule_iterations", &Trainer::schedule_iterations,
                             "Where the LR schedule stands: updates, each counted as its share "
                             "of a full global batch.")
      .def(
          "params_norm",
          [](Trainer& t) {
            py::gil_scoped_release release;
            return t.optimizer().params_norm();
          },
          "The global L2 norm of the model's parameters (f32 master weights), every element "
          "counted once across TP, PP and DP (Megatron's --log-params-norm). Collective: every "
          "rank calls it.")
      .def("set_trace", &Trainer::set_trace, py::arg("trace"), py::keep_alive<1, 2>(),
           "Record every train_step on trace (None: stop): spans per step, and the step's "
           "breakdown in StepStats (compute, pipeline wait, tp/dp/other communication waits).");
}

}  // namespace braid::python
