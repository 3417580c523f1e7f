// Distributed checkpoints (save_checkpoint, load_checkpoint, latest_iteration, CheckpointSaver)
// and Megatron's exit conditions (ExitConditions). Every call that may touch the disk or a
// collective releases the GIL.
//
// Signals: ExitConditions installs C handlers for SIGTERM and SIGUSR1 with sigaction. CPython
// installs a handler of its own only for SIGINT (and ignores SIGPIPE/SIGXFSZ), so these stay
// in place unless Python code calls signal.signal(SIGTERM or SIGUSR1, ...) while an
// ExitConditions is alive - which would replace them.

#include <pybind11/stl.h>

#include <memory>
#include <optional>

#include "bindings.h"
#include "braid/engine/checkpoint.h"
#include "braid/engine/exit_conditions.h"
#include "braid/engine/parallel_model.h"
#include "braid/engine/trainer.h"

namespace braid::python {
namespace {

engine::SaveOptions save_options(bool save_optim, bool save_rng) {
  engine::SaveOptions options;
  options.save_optim = save_optim;
  options.save_rng = save_rng;
  return options;
}

}  // namespace

void bind_checkpoint(py::module_& m) {
  using namespace engine;

  m.def("latest_iteration", &latest_iteration, py::arg("dir"),
        "The iteration dir/latest_checkpointed_iteration.txt names; -1 when there is no "
        "checkpoint yet.");
  m.def("iteration_directory", &iteration_directory, py::arg("dir"), py::arg("iteration"),
        "dir/iter_0000100 for iteration 100: where that iteration's checkpoint lives.");
  m.def(
      "save_checkpoint",
      [](const std::string& dir, Trainer& trainer, std::optional<int64_t> consumed_samples,
         bool save_optim, bool save_rng, double device_seconds, int64_t skipped_train_samples,
         int64_t consumed_valid_samples) {
        py::gil_scoped_release release;
        return save_checkpoint(
            dir, trainer,
            LoopState{consumed_samples.value_or(trainer.consumed_samples()), device_seconds,
                      skipped_train_samples, consumed_valid_samples},
            save_options(save_optim, save_rng));
      },
      py::arg("dir"), py::arg("trainer"), py::arg("consumed_samples") = py::none(),
      py::arg("save_optim") = true, py::arg("save_rng") = true, py::arg("device_seconds") = 0.0,
      py::arg("skipped_train_samples") = 0, py::arg("consumed_valid_samples") = -1,
      "Collective over the model's world (every rank, the same arguments): saves the trainer at "
      "its current iteration into dir/iter_<7-digit iteration> (atomically) and returns that "
      "directory. "
      "consumed_samples: the data loader's position over all DP ranks (None: the trainer's "
      "count, Trainer.consumed_samples); device_seconds: the "
      "device time the run has used so far; skipped_train_samples: the samples of the batches "
      "--iterations-to-skip dropped so far; consumed_valid_samples: the validation data's "
      "position (-1: not counted, not saved). All in metadata.json; checkpoint_metadata reads "
      "them back.");
  m.def(
      "load_checkpoint",
      [](const std::string& dir, Trainer& trainer, bool load_optim, bool load_rng, bool finetune,
         int64_t iteration) {
        LoadOptions options;
        options.load_optim = load_optim;
        options.load_rng = load_rng;
        options.finetune = finetune;
        options.iteration = iteration;
        py::gil_scoped_release release;
        return load_checkpoint(dir, trainer, options).consumed_samples;
      },
      py::arg("dir"), py::arg("trainer"), py::arg("load_optim") = true, py::arg("load_rng") = true,
      py::arg("finetune") = false, py::arg("iteration") = -1,
      "Collective. Loads the latest (or `iteration`'s) checkpoint of dir into the trainer, under "
      "any layout - parameters, and unless told otherwise optimizer state, iteration counters, "
      "loss scale and RNG - and returns the consumed samples it saved (0 with finetune). "
      "ValueError naming the file and tensor for anything that does not fit.");

  m.def(
      "load_parameters",
      [](const std::string& dir, ParallelModel& model, int64_t iteration) {
        py::gil_scoped_release release;
        load_parameters(dir, model, iteration);
      },
      py::arg("dir"), py::arg("model"), py::arg("iteration") = -1,
      "Collective. Loads only the parameters of the latest (or `iteration`'s) checkpoint of dir "
      "into a ParallelModel, saved under any layout: no optimizer state is allocated or read.");
  m.def(
      "load_parameters",
      [](const std::string& dir, model::GPTModel& model, int64_t iteration) {
        py::gil_scoped_release release;
        ParallelModel one_process(model);
        load_parameters(dir, one_process, iteration);
      },
      py::arg("dir"), py::arg("model"), py::arg("iteration") = -1,
      "The same into a one-process GPTModel (the whole model, e.g. for generation).");

  py::class_<CheckpointSaver>(
      m, "CheckpointSaver",
      "Saves into one directory, synchronously or (async_save, --async-save) in the background: "
      "save() gathers the state and returns while a thread writes the files; the save becomes "
      "the latest when poll() (once per iteration, on every rank: collective) sees every rank's "
      "files written, or at wait(). Call wait() before exiting: a saver dropped with a save in "
      "flight commits nothing.")
      .def(py::init<std::string, bool>(), py::arg("dir"), py::arg("async_save") = false)
      .def(
          "save",
          [](CheckpointSaver& s, Trainer& trainer, std::optional<int64_t> consumed_samples,
             bool save_optim, bool save_rng, double device_seconds, int64_t skipped_train_samples,
             int64_t consumed_valid_samples) {
            py::gil_scoped_release release;
            return s.save(trainer,
                          LoopState{consumed_samples.value_or(trainer.consumed_samples()),
                                    device_seconds, skipped_train_samples, consumed_valid_samples},
                          save_options(save_optim, save_rng));
          },
          py::arg("trainer"), py::arg("consumed_samples") = py::none(),
          py::arg("save_optim") = true, py::arg("save_rng") = true, py::arg("device_seconds") = 0.0,
          py::arg("skipped_train_samples") = 0, py::arg("consumed_valid_samples") = -1,
          py::keep_alive<1, 2>(),
          "Collective. Starts (async) or does a save of the trainer's current iteration; returns "
          "its directory.")
      .def(
          "poll",
          [](CheckpointSaver& s, const ParallelModel& model) {
            py::gil_scoped_release release;
            return s.poll(model);
          },
          py::arg("model"), "Collective. True when it committed a save just now.")
      .def(
          "poll",
          [](CheckpointSaver& s, Trainer& trainer) {
            py::gil_scoped_release release;
            return s.poll(trainer.model());
          },
          py::arg("trainer"))
      .def(
          "wait",
          [](CheckpointSaver& s, const ParallelModel& model) {
            py::gil_scoped_release release;
            s.wait(model);
          },
          py::arg("model"), "Collective. Commits the save in flight, if any.")
      .def(
          "wait",
          [](CheckpointSaver& s, Trainer& trainer) {
            py::gil_scoped_release release;
            s.wait(trainer.model());
          },
          py::arg("trainer"))
      .def_property_readonly("in_flight", &CheckpointSaver::in_flight)
      .def_property_readonly("last_committed", &CheckpointSaver::last_committed,
                             "The iteration of the last committed save; -1: none yet.")
      .def_property_readonly("last_blocked_seconds", &CheckpointSaver::last_blocked_seconds,
                             "How long the last save() kept the caller.");

  py::class_<ExitConditions>(
      m, "ExitConditions",
      "Megatron's clean exits: on SIGTERM or SIGUSR1 (when signals), every exit_interval "
      "iterations, or exit_duration_minutes after construction. check() after each iteration "
      "is collective, so every rank stops after the same iteration. The signal handlers are C "
      "handlers (they only record the signal), installed by the constructor and restored when "
      "the object is destroyed (del it); one instance with signals at a time. Python's "
      "signal module leaves SIGTERM and SIGUSR1 alone unless you call signal.signal on them.")
      .def(py::init([](int64_t exit_interval, double exit_duration_minutes, bool signals) {
             ExitConfig config;
             config.exit_interval = exit_interval;
             config.exit_duration_minutes = exit_duration_minutes;
             config.signals = signals;
             return std::make_unique<ExitConditions>(config);
           }),
           py::arg("exit_interval") = 0, py::arg("exit_duration_minutes") = 0.0,
           py::arg("signals") = true)
      .def(
          "check",
          [](ExitConditions& e, const ParallelModel& model, int64_t iteration) {
            py::gil_scoped_release release;
            return e.check(model, iteration);
          },
          py::arg("model"), py::arg("iteration"),
          "After `iteration` completed: why to stop (\"SIGTERM\", \"SIGUSR1\", "
          "\"--exit-interval\", \"--exit-duration-in-mins\") or \"\" to go on. Collective over "
          "the model's world. model: a ParallelModel or a Trainer.")
      .def(
          "check",
          [](ExitConditions& e, Trainer& trainer, int64_t iteration) {
            py::gil_scoped_release release;
            return e.check(trainer.model(), iteration);
          },
          py::arg("trainer"), py::arg("iteration"));
}

}  // namespace braid::python
