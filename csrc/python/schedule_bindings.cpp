// Pipeline schedules as data and their simulator (include/braid/engine/schedule.h), for the
// cluster planner (python/braid/planner.py) and for tests. No logic of its own.

#include <pybind11/operators.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "braid/engine/schedule.h"

namespace braid::python {

void bind_schedule(py::module_& m) {
  using namespace braid::engine;
  py::enum_<P2PSemantics>(m, "P2PSemantics")
      .value("rendezvous", P2PSemantics::rendezvous)
      .value("eager", P2PSemantics::eager);

  py::enum_<ActionKind>(m, "ActionKind")
      .value("forward", ActionKind::forward)
      .value("backward", ActionKind::backward)
      .value("exchange", ActionKind::exchange);
  py::enum_<P2PKind>(m, "P2PKind")
      .value("send_activation", P2PKind::send_activation)
      .value("recv_activation", P2PKind::recv_activation)
      .value("send_grad", P2PKind::send_grad)
      .value("recv_grad", P2PKind::recv_grad);
  py::class_<P2POp>(m, "P2POp")
      .def(py::init([](P2PKind kind, int microbatch, int chunk, int peer) {
             return P2POp{kind, microbatch, chunk, peer};
           }),
           py::arg("kind"), py::arg("microbatch"), py::arg("chunk"), py::arg("peer"))
      .def_readwrite("kind", &P2POp::kind)
      .def_readwrite("microbatch", &P2POp::microbatch)
      .def_readwrite("chunk", &P2POp::chunk)
      .def_readwrite("peer", &P2POp::peer)
      .def(py::self == py::self);
  py::class_<Action>(m, "Action")
      .def_static("forward", &Action::forward_step, py::arg("chunk"), py::arg("microbatch"))
      .def_static("backward", &Action::backward_step, py::arg("chunk"), py::arg("microbatch"))
      .def_static(
          "exchange",
          [](std::vector<P2POp> ops) {
            Action a;
            a.kind = ActionKind::exchange;
            a.ops = std::move(ops);
            return a;
          },
          py::arg("ops"))
      .def_readonly("kind", &Action::kind)
      .def_readonly("microbatch", &Action::microbatch)
      .def_readonly("chunk", &Action::chunk)
      .def_readonly("ops", &Action::ops)
      .def(py::self == py::self)
      .def("__repr__", [](const Action& a) { return to_string(a, 2); });

  py::class_<Schedule>(m, "Schedule",
                       "A pipeline schedule: for each pipeline rank, its ordered actions.")
      .def_readonly("name", &Schedule::name)
      .def_readonly("pp", &Schedule::pp)
      .def_readonly("microbatches", &Schedule::microbatches)
      .def_readonly("virtual_stages", &Schedule::virtual_stages)
      .def_readonly("forward_only", &Schedule::forward_only)
      .def_property_readonly("num_model_chunks", &Schedule::num_model_chunks)
      .def_readwrite("ranks", &Schedule::ranks,
                     "ranks[r]: rank r's ordered actions (a copy; assign a new list to edit)")
      .def(
          "format_rank",
          [](const Schedule& s, int rank, bool with_exchanges) {
            BRAID_CONFIG_CHECK(rank >= 0 && rank < s.pp, "rank ", rank, " outside [0, ", s.pp, ")");
            return format_rank(s, rank, with_exchanges);
          },
          py::arg("rank"), py::arg("with_exchanges") = true)
      .def("__repr__", [](const Schedule& s) {
        return "Schedule(" + s.name + ", pp=" + std::to_string(s.pp) +
               ", microbatches=" + std::to_string(s.microbatches) +
               ", virtual_stages=" + std::to_string(s.virtual_stages) + ")";
      });

  m.def("make_gpipe", &make_gpipe, py::arg("pp"), py::arg("microbatches"));
  m.def("make_1f1b", &make_1f1b, py::arg("pp"), py::arg("microbatches"));
  m.def("make_interleaved_1f1b", &make_interleaved_1f1b, py::arg("pp"), py::arg("microbatches"),
        py::arg("virtual_stages"));
  m.def("make_forward_only", &make_forward_only, py::arg("pp"), py::arg("microbatches"),
        py::arg("virtual_stages") = 1);
  m.def("interleaved_warmup_steps", &interleaved_warmup_steps, py::arg("pp"),
        py::arg("microbatches"), py::arg("virtual_stages"), py::arg("rank"));
  m.def(
      "stage_layers",
      [](int num_layers, int pp, int virtual_stages, std::optional<int> first,
         std::optional<int> last, const std::vector<int>& model_chunk_layers) {
        std::vector<std::vector<std::pair<int, int>>> out;
        for (const auto& rank :
             stage_layers(num_layers, pp, virtual_stages, first, last, model_chunk_layers)) {
          auto& row = out.emplace_back();
          for (const LayerRange& r : rank) row.emplace_back(r.begin, r.end);
        }
        return out;
      },
      py::arg("num_layers"), py::arg("pp"), py::arg("virtual_stages") = 1,
      py::arg("first_stage_layers") = py::none(), py::arg("last_stage_layers") = py::none(),
      py::arg("model_chunk_layers") = std::vector<int>{},
      "result[rank][chunk] = (begin, end): the layers of model chunk chunk * pp + rank; "
      "model_chunk_layers: every model chunk's count (a pipeline layout).");

  py::class_<SimulationResult>(m, "SimulationResult")
      .def_readonly("error", &SimulationResult::error)
      .def_readonly("blocked_ranks", &SimulationResult::blocked_ranks)
      .def_readonly("makespan", &SimulationResult::makespan)
      .def_readonly("busy", &SimulationResult::busy)
      .def_readonly("finish", &SimulationResult::finish)
      .def_readonly("max_in_flight", &SimulationResult::max_in_flight)
      .def_readonly("bubble_fraction", &SimulationResult::bubble_fraction)
      .def_readonly("idle_fraction", &SimulationResult::idle_fraction)
      .def_readonly("start", &SimulationResult::start)
      .def_readonly("end", &SimulationResult::end)
      .def_readonly("last_backward_start", &SimulationResult::last_backward_start)
      .def_readonly("last_backward_end", &SimulationResult::last_backward_end)
      .def_property_readonly("ok", &SimulationResult::ok);

  m.def(
      "simulate",
      [](const Schedule& s, double forward, double backward, double p2p,
         std::vector<std::vector<double>> forward_by_chunk,
         std::vector<std::vector<double>> backward_by_chunk, P2PSemantics semantics) {
        for (const auto* table : {&forward_by_chunk, &backward_by_chunk})
          if (!table->empty()) {
            BRAID_CONFIG_CHECK(int(table->size()) == s.pp, "per-chunk costs need one row per ",
                               "pipeline rank (", s.pp, "), got ", table->size());
            for (const auto& row : *table)
              BRAID_CONFIG_CHECK(int(row.size()) == s.virtual_stages, "per-chunk costs need ",
                                 s.virtual_stages, " chunks per rank, got ", row.size());
          }
        SimulationCosts costs;
        costs.forward = forward;
        costs.backward = backward;
        costs.p2p = p2p;
        costs.forward_by_chunk = std::move(forward_by_chunk);
        costs.backward_by_chunk = std::move(backward_by_chunk);
        costs.semantics = semantics;
        py::gil_scoped_release release;
        return simulate(s, costs);
      },
      py::arg("schedule"), py::arg("forward") = 1.0, py::arg("backward") = 2.0,
      py::arg("p2p") = 0.0, py::arg("forward_by_chunk") = std::vector<std::vector<double>>{},
      py::arg("backward_by_chunk") = std::vector<std::vector<double>>{},
      py::arg("semantics") = P2PSemantics::rendezvous,
      "Checks and times a schedule (SimulationCosts as keywords; *_by_chunk[rank][chunk] "
      "override forward/backward). A schedule that cannot finish returns a result whose "
      "error names the blocked ranks; it never raises for that.");
}

}  // namespace braid::python
