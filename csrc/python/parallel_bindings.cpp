// The job and its layout: init_distributed, ParallelLayout/ParallelState, ParallelConfig/DDPConfig
// and ParallelModel. MPI is brought up by the first init_distributed (or ParallelState) and
// finalised by comm's atexit hook when the interpreter exits.

#include <pybind11/stl.h>

#include <cstring>

#include "bindings.h"
#include "braid/comm/communicator.h"
#include "braid/comm/launch.h"
#include "braid/comm/parallel_state.h"
#include "braid/engine/grad_buffer.h"
#include "braid/engine/parallel_model.h"

namespace braid::python {
namespace {

// The world, initialised once. A later call keeps the timeout the first one set (init_distributed
// itself resets it to its argument on every call).
comm::Distributed distributed() {
  return comm::init_distributed(comm::MpiCommunicator::world()->timeout());
}

}  // namespace

void bind_parallel(py::module_& m) {
  using engine::DDPConfig;
  using engine::ParallelConfig;
  using engine::ParallelModel;

  py::class_<comm::LaunchInfo>(m, "Distributed",
                               "This process's place in the job (init_distributed's result).")
      .def_readonly("launcher", &comm::LaunchInfo::launcher)
      .def_readonly("rank", &comm::LaunchInfo::rank)
      .def_readonly("world_size", &comm::LaunchInfo::world_size)
      .def_readonly("local_rank", &comm::LaunchInfo::local_rank)
      .def_readonly("local_world_size", &comm::LaunchInfo::local_world_size)
      .def("__repr__", [](const comm::LaunchInfo& l) {
        return "Distributed(launcher=" + l.launcher + ", rank=" + std::to_string(l.rank) +
               ", world_size=" + std::to_string(l.world_size) + ")";
      });
  m.def(
      "init_distributed",
      [](double timeout_minutes) {
        const comm::Duration timeout = comm::timeout_from_minutes(timeout_minutes);
        py::gil_scoped_release release;
        return comm::init_distributed(timeout).launch;
      },
      py::arg("timeout_minutes") = 10.0,
      "Brings MPI up (once; later calls return the same job and set the collectives' timeout, "
      "--distributed-timeout-minutes) and returns this process's rank and world size. MPI is "
      "finalised when the interpreter exits.");
  m.def(
      "abort",
      [](const std::string& message, int exit_code) {
        py::gil_scoped_release release;
        comm::abort_job(message, exit_code);
      },
      py::arg("message"), py::arg("exit_code") = 1,
      "Prints message as one line and ends the whole job (MPI_Abort) with exit_code, so that "
      "an error on one rank cannot leave the others waiting in a collective.");

  py::class_<comm::ParallelLayout>(m, "ParallelLayout")
      .def(py::init([](int tp, int pp, int dp, int cp, int ep, int etp) {
             return comm::ParallelLayout{tp, pp, dp, cp, ep, etp};
           }),
           py::arg("tp") = 1, py::arg("pp") = 1, py::arg("dp") = 0, py::arg("cp") = 1,
           py::arg("ep") = 1, py::arg("etp") = 0,
           "Tensor-, pipeline-, data-, context-, expert- and expert-tensor-parallel sizes; dp 0: "
           "world size / (tp · cp · pp); etp 0 or tp: experts split over TP, ep dividing dp · cp; "
           "etp 1: whole experts, ep dividing tp · dp · cp.")
      .def_readwrite("tp", &comm::ParallelLayout::tp)
      .def_readwrite("pp", &comm::ParallelLayout::pp)
      .def_readwrite("dp", &comm::ParallelLayout::dp)
      .def_readwrite("cp", &comm::ParallelLayout::cp)
      .def_readwrite("ep", &comm::ParallelLayout::ep)
      .def_readwrite("etp", &comm::ParallelLayout::etp);

  py::class_<comm::ParallelState>(
      m, "ParallelState",
      "The (tp, cp, dp, pp) rank grid and its communicators over the MPI world (Megatron's "
      "order: TP fastest, then CP, then DP, then PP), with expert parallelism splitting the "
      "DP × CP ranks (with etp 1 the TP × DP × CP ranks; ep consecutive ones per EP group). "
      "Collective over the world; a layout that "
      "does not fit the world is a ValueError on every rank, before any communication.")
      .def(py::init([](const comm::ParallelLayout& layout) {
             py::gil_scoped_release release;
             return std::make_unique<comm::ParallelState>(distributed().world, layout);
           }),
           py::arg("layout"))
      .def(py::init([](int tp, int pp, int dp, int cp, int ep, int etp) {
             py::gil_scoped_release release;
             return std::make_unique<comm::ParallelState>(
                 distributed().world, comm::ParallelLayout{tp, pp, dp, cp, ep, etp});
           }),
           py::arg("tp") = 1, py::arg("pp") = 1, py::arg("dp") = 0, py::arg("cp") = 1,
           py::arg("ep") = 1, py::arg("etp") = 0)
      .def_property_readonly("rank", &comm::ParallelState::rank)
      .def_property_readonly("world_size",
                             [](const comm::ParallelState& s) { return s.grid().world_size(); })
      .def_property_readonly("tp", [](const comm::ParallelState& s) { return s.grid().tp(); })
      .def_property_readonly("pp", [](const comm::ParallelState& s) { return s.grid().pp(); })
      .def_property_readonly("dp", [](const comm::ParallelState& s) { return s.grid().dp(); })
      .def_property_readonly("cp", [](const comm::ParallelState& s) { return s.grid().cp(); })
      .def_property_readonly("ep", [](const comm::ParallelState& s) { return s.grid().ep(); })
      .def_property_readonly("expert_dp",
                             [](const comm::ParallelState& s) { return s.grid().expert_dp(); })
      .def_property_readonly(
          "etp",
          [](const comm::ParallelState& s) { return s.grid().whole_experts() ? 1 : s.grid().tp(); })
      .def_property_readonly("cp_rank", &comm::ParallelState::cp_rank)
      .def_property_readonly("tp_rank", &comm::ParallelState::tp_rank)
      .def_property_readonly("pp_rank", &comm::ParallelState::pp_rank)
      .def_property_readonly("dp_rank", &comm::ParallelState::dp_rank)
      .def_property_readonly("ep_rank", &comm::ParallelState::ep_rank)
      .def_property_readonly("expert_dp_rank", &comm::ParallelState::expert_dp_rank)
      .def_property_readonly("is_first_stage", &comm::ParallelState::is_first_stage)
      .def_property_readonly("is_last_stage", &comm::ParallelState::is_last_stage)
      .def("barrier",
           [](const comm::ParallelState& s) {
             py::gil_scoped_release release;
             s.world().barrier()->wait();
           })
      .def(
          "all_gather",
          [](const comm::ParallelState& s, const std::vector<double>& values) {
            // Gathered as their 64-bit patterns: no arithmetic, so every value arrives exact.
            const int64_t n = int64_t(values.size()), ranks = s.grid().world_size();
            Tensor mine = Tensor::empty({n}, DType::i64);
            std::memcpy(mine.data(), values.data(), values.size() * sizeof(double));
            Tensor all = Tensor::empty({ranks * n}, DType::i64, s.world().device());
            {
              py::gil_scoped_release release;
              s.world().all_gather(mine.to(s.world().device()), all)->wait();
            }
            const Tensor host = all.to(Device::cpu());
            std::vector<std::vector<double>> out(static_cast<size_t>(ranks),
                                                 std::vector<double>(static_cast<size_t>(n)));
            for (int64_t r = 0; r < ranks; ++r)
              std::memcpy(out[size_t(r)].data(), host.data_ptr<int64_t>() + r * n,
                          size_t(n) * sizeof(double));
            return out;
          },
          py::arg("values"),
          "Every rank's list of floats, by global rank, on every rank (collective: each rank "
          "gives the same number of values).");

  py::class_<DDPConfig>(m, "DDPConfig", "Data-parallel gradient buffers (Megatron's DDP options).")
      .def(
          py::init([](int64_t bucket_size, bool overlap_grad_reduce, bool use_distributed_optimizer,
                      bool overlap_param_gather, bool grad_reduce_in_bf16) {
            DDPConfig c;
            c.bucket_size = bucket_size;
            c.overlap_grad_reduce = overlap_grad_reduce;
            c.use_distributed_optimizer = use_distributed_optimizer;
            c.overlap_param_gather = overlap_param_gather;
            c.grad_reduce_in_bf16 = grad_reduce_in_bf16;
            c.validate();
            return c;
          }),
          py::arg("bucket_size") = 0, py::arg("overlap_grad_reduce") = false,
          py::arg("use_distributed_optimizer") = false, py::arg("overlap_param_gather") = false,
          py::arg("grad_reduce_in_bf16") = false,
          "bucket_size in elements (0: Megatron's default); use_distributed_optimizer: ZeRO-1; "
          "overlap_param_gather needs it; grad_reduce_in_bf16: reduce bf16 copies of the "
          "buckets.")
      .def_readwrite("bucket_size", &DDPConfig::bucket_size)
      .def_readwrite("overlap_grad_reduce", &DDPConfig::overlap_grad_reduce)
      .def_readwrite("use_distributed_optimizer", &DDPConfig::use_distributed_optimizer)
      .def_readwrite("overlap_param_gather", &DDPConfig::overlap_param_gather)
      .def_readwrite("grad_reduce_in_bf16", &DDPConfig::grad_reduce_in_bf16);

  py::class_<ParallelConfig>(m, "ParallelConfig")
      .def(py::init([](bool sequence_parallel, int virtual_stages, const DDPConfig& ddp,
                       std::optional<int> first_stage_layers, std::optional<int> last_stage_layers,
                       std::vector<int> model_chunk_layers) {
             return ParallelConfig{
                 sequence_parallel,  virtual_stages,    ddp,
                 first_stage_layers, last_stage_layers, std::move(model_chunk_layers)};
           }),
           py::arg("sequence_parallel") = false, py::arg("virtual_stages") = 1,
           py::arg("ddp") = DDPConfig{}, py::arg("first_stage_layers") = py::none(),
           py::arg("last_stage_layers") = py::none(),
           py::arg("model_chunk_layers") = std::vector<int>{},
           "virtual_stages: model chunks per pipeline rank (interleaved 1F1B when > 1); "
           "first_stage_layers / last_stage_layers: uneven pipeline stages (Megatron's "
           "--decoder-first/last-pipeline-num-layers), the other ranks split the rest evenly; "
           "model_chunk_layers: every model chunk's layers instead (a pipeline layout, in "
           "model-chunk order).")
      .def_readwrite("sequence_parallel", &ParallelConfig::sequence_parallel)
      .def_readwrite("virtual_stages", &ParallelConfig::virtual_stages)
      .def_readwrite("ddp", &ParallelConfig::ddp)
      .def_readwrite("first_stage_layers", &ParallelConfig::first_stage_layers)
      .def_readwrite("last_stage_layers", &ParallelConfig::last_stage_layers)
      .def_readwrite("model_chunk_layers", &ParallelConfig::model_chunk_layers);

  py::class_<ParallelModel>(m, "ParallelModel",
                            "This rank's share of a GPT model under a (tp, pp, dp) layout: its "
                            "model chunks and their data-parallel gradient buffers.")
      .def(py::init([](const model::TransformerConfig& config, const std::string& device,
                       uint64_t seed, const comm::ParallelState& state,
                       const ParallelConfig& parallel) {
             const Device d = device_from_name(device);
             py::gil_scoped_release release;
             return std::make_unique<ParallelModel>(config, d, seed, state, parallel);
           }),
           py::arg("config"), py::arg("device") = "cpu", py::arg("seed") = 1234, py::arg("state"),
           py::arg("parallel") = ParallelConfig{}, py::keep_alive<1, 5>(),
           "Collective over state's world; every rank holds exactly its slice of the weights the "
           "one-process GPTModel(config, device, seed) would have.")
      .def_property_readonly("config", [](const ParallelModel& p) { return p.config(); })
      .def_property_readonly("device", [](const ParallelModel& p) { return p.device().str(); })
      .def_property_readonly("parallel", [](const ParallelModel& p) { return p.parallel(); })
      .def_property_readonly("num_chunks", &ParallelModel::num_chunks)
      .def_property_readonly("is_last_stage", &ParallelModel::is_last_stage)
      .def("chunk", &ParallelModel::chunk, py::arg("index"),
           py::return_value_policy::reference_internal)
      .def(
          "num_parameters",
          [](const ParallelModel& p) {
            int64_t n = 0;
            for (model::GPTModel* c : p.chunks()) n += c->num_parameters();
            return n;
          },
          "Parameters held by this rank (its TP shard of its stages).")
      .def(
          "set_document_masking",
          [](ParallelModel& p, int32_t eod, bool reset_attention_mask, bool reset_position_ids) {
            for (model::GPTModel* c : p.chunks()) {
              c->set_document_masking(eod, reset_attention_mask, reset_position_ids);
            }
          },
          py::arg("eod"), py::arg("reset_attention_mask"), py::arg("reset_position_ids"),
          "GPTModel.set_document_masking on every chunk this rank holds.")
      .def(
          "gather_into",
          [](ParallelModel& p, model::GPTModel& whole) {
            py::gil_scoped_release release;
            p.gather_into(whole);
          },
          py::arg("whole"),
          "Every parameter's global value into `whole`, a one-process GPTModel of the same "
          "config. Collective over the world.");
}

}  // namespace braid::python
