// pipeline_bench: GPipe, 1F1B and interleaved 1F1B on real ranks (pp = the job's size), timed
// from per-rank traces (core/trace.h): step time, the measured pipeline bubble next to the
// formula and to simulate() fed with the measured costs, and the first stage's peak
// activation memory.
//
//   mpirun -np 4 --oversubscribe build/benchmarks/pipeline_bench [--layers 8 --hidden 256
//       --heads 4 --seq 128 --batch 1 --vocab 1024 --microbatches 8 --virtual 2 --steps 5
//       --warmup 1 --trace-dir DIR]
//
// Method, per schedule: after a barrier every rank takes its trace origin (so ranks share a
// zero up to the barrier's skew), runs PipelineExecutor::run, then finalize_grads and one
// AdamW step per chunk inside an "optimizer" span. The bubble is Narayanan et al.'s, as
// simulate() defines it: (p · makespan − Σ busy) / Σ busy, makespan = the last rank's end of
// run(), busy = each rank's forward + backward spans. The formula is (p − 1)/m, or
// (p − 1)/(v · m) interleaved. "sim" is simulate() with the mean measured forward and
// backward of one chunk; "sim/chunk" with each (rank, chunk)'s own means (the last stage's
// head and the first's embedding make those uneven). Memory: stage 0's host allocator peak
// during run() minus what it held before (parameters, gradients, optimizer state), i.e. the
// activations it keeps plus transient workspace and p2p buffers; "in flight" is simulate()'s
// most (chunk, microbatch) forwards stage 0 holds awaiting their backward.
//
// With more ranks than cores (4 ranks on 2 cores) the ranks share CPUs: a rank that waits
// still takes turns with the computing ones, so measured spans stretch and the measured
// bubble mixes pipeline idleness with CPU contention. --trace-dir writes the last step's
// traces as DIR/<schedule>_rank<r>.json (tools/plot_schedule.py draws them).

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "braid/comm/launch.h"          // defines: init_distributed, run_main
#include "braid/comm/parallel_state.h"  // defines: ParallelState (pp = world)
#include "braid/core/allocator.h"       // defines: memory_stats, reset_peak_memory
#include "braid/core/error.h"
#include "braid/core/trace.h"       // defines: Trace
#include "braid/engine/adamw.h"     // defines: AdamW
#include "braid/engine/pipeline.h"  // defines: PipelineExecutor
#include "braid/engine/schedule.h"  // defines: make_gpipe, make_1f1b, simulate

using namespace braid;
using namespace braid::model;

namespace {

struct Options {
  int64_t layers = 8, hidden = 256, heads = 4, seq = 128, batch = 1, vocab = 1024;
  int microbatches = 8, virtual_stages = 2, steps = 5, warmup = 1;
  std::string trace_dir;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::printf(
          "pipeline_bench [--layers L] [--hidden H] [--heads A] [--seq S] [--batch B] "
          "[--vocab V] [--microbatches M] [--virtual V] [--steps N] [--warmup N] "
          "[--trace-dir DIR]\n");
      std::exit(0);
    }
    if (i + 1 >= argc)
      throw ConfigError("pipeline_bench: " + a + " needs a value", __FILE__, __LINE__);
    const char* v = argv[++i];
    if (a == "--layers")
      o.layers = std::atoll(v);
    else if (a == "--hidden")
      o.hidden = std::atoll(v);
    else if (a == "--heads")
      o.heads = std::atoll(v);
    else if (a == "--seq")
      o.seq = std::atoll(v);
    else if (a == "--batch")
      o.batch = std::atoll(v);
    else if (a == "--vocab")
      o.vocab = std::atoll(v);
    else if (a == "--microbatches")
      o.microbatches = std::atoi(v);
    else if (a == "--virtual")
      o.virtual_stages = std::atoi(v);
    else if (a == "--steps")
      o.steps = std::atoi(v);
    else if (a == "--warmup")
      o.warmup = std::atoi(v);
    else if (a == "--trace-dir")
      o.trace_dir = v;
    else
      throw ConfigError("pipeline_bench: unknown option " + a, __FILE__, __LINE__);
  }
  return o;
}

TransformerConfig config_of(const Options& o) {
  TransformerConfig c = TransformerConfig::preset("gpt2-tiny");
  c.num_layers = o.layers;
  c.hidden_size = o.hidden;
  c.num_attention_heads = o.heads;
  c.ffn_hidden_size = 4 * o.hidden;
  c.vocab_size = o.vocab;
  c.max_position_embeddings = o.seq;
  return c;
}

std::vector<Tensor> tokens(const Options& o, int microbatch, bool targets) {
  Tensor t = Tensor::empty({o.batch, o.seq}, DType::i32);
  uint64_t x = 0x9E3779B97F4A7C15ull * uint64_t(microbatch + 1);
  for (int64_t i = 0; i < o.batch * o.seq; ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    t.data_ptr<int32_t>()[i] =
        targets && i % o.seq == o.seq - 1 ? -1 : int32_t(x % uint64_t(o.vocab));
  }
  return {t};
}

// What one rank reports per step, gathered on every rank.
enum Field {
  run_end,
  step_end,
  forward_ns,
  backward_ns,
  forwards,
  backwards,
  activation_peak,
  num_fields
};

struct Row {
  std::string name;
  double step_ms = 0, bubble = 0, formula = 0, sim = 0, sim_chunk = 0;
  double forward_ms = 0, backward_ms = 0;
  int64_t stage0_peak = 0;
  int in_flight = 0;
};

Row bench(const Options& o, const engine::Schedule& schedule, comm::MpiCommunicator& world,
          comm::ParallelState& state) {
  const TransformerConfig config = config_of(o);
  const int p = schedule.pp, v = schedule.virtual_stages, m = schedule.microbatches;
  const int stage = state.pp_rank();
  const auto layers = engine::stage_layers(int(config.num_layers), p, v);
  std::vector<std::unique_ptr<GPTModel>> chunks;
  std::vector<std::unique_ptr<engine::AdamW>> optimizers;
  std::vector<GPTModel*> pointers;
  for (int c = 0; c < v; ++c) {
    const int model_chunk = schedule.model_chunk(stage, c);
    const engine::LayerRange range = layers[size_t(stage)][size_t(c)];
    chunks.push_back(
        std::make_unique<GPTModel>(config, Device::cpu(), 1234, TensorParallel{&state.tp(), false},
                                   ModelChunk{range.begin, range.end, model_chunk == 0,
                                              model_chunk == schedule.num_model_chunks() - 1}));
    chunks.back()->set_embedding_group(state.embedding());
    // clip_grad 0: each chunk's norm would be local to the chunk, not the model's.
    optimizers.push_back(std::make_unique<engine::AdamW>(
        *chunks.back(), engine::AdamWConfig{.lr = 1e-4f, .clip_grad = 0.0f}));
    pointers.push_back(chunks.back().get());
  }
  std::vector<Tensor> ids, targets;
  for (int i = 0; i < m; ++i) {
    ids.push_back(tokens(o, i, false)[0]);
    targets.push_back(tokens(o, i, true)[0]);
  }
  engine::PipelineExecutor executor(schedule, pointers, state.pp());
  Trace trace(world.rank());
  executor.set_trace(&trace);

  Row row;
  row.name = schedule.name + (v > 1 ? " v=" + std::to_string(v) : "");
  std::vector<double> f_chunk(size_t(p * v), 0), b_chunk(size_t(p * v), 0);  // summed ns
  double f_sum = 0, b_sum = 0, f_n = 0, b_n = 0;
  for (int step = 0; step < o.warmup + o.steps; ++step) {
    const bool timed = step >= o.warmup;
    for (auto& c : chunks) c->zero_grad();
    const int64_t held = memory_stats(Device::cpu()).current_bytes;
    reset_peak_memory(Device::cpu());
    trace.clear();
    world.barrier()->wait();
    trace.set_origin();
    executor.run(ids, targets, std::vector<float>(size_t(m), 1.0f / float(m)));
    const int64_t peak = memory_stats(Device::cpu()).peak_bytes - held;
    const int64_t end_of_run = trace.now_ns();
    {
      Trace::Scope span(&trace, "optimizer", "compute");
      for (auto& c : chunks) c->finalize_grads();
      for (auto& opt : optimizers) opt->clip_and_step();
    }
    std::vector<int64_t> mine(num_fields, 0);
    mine[run_end] = end_of_run;
    mine[step_end] = trace.now_ns();
    mine[activation_peak] = peak;
    std::vector<int64_t> by_chunk_f(size_t(v), 0), by_chunk_b(size_t(v), 0);
    for (const TraceSpan& s : trace.spans()) {
      if (s.name == "forward")
        mine[forward_ns] += s.dur_ns, ++mine[forwards], by_chunk_f[size_t(s.chunk)] += s.dur_ns;
      if (s.name == "backward")
        mine[backward_ns] += s.dur_ns, ++mine[backwards], by_chunk_b[size_t(s.chunk)] += s.dur_ns;
    }
    for (int c = 0; c < v; ++c)
      mine.push_back(by_chunk_f[size_t(c)]), mine.push_back(by_chunk_b[size_t(c)]);
    const int64_t width = int64_t(mine.size());
    Tensor local = Tensor::empty({width}, DType::i64), all = Tensor::empty({width * p}, DType::i64);
    std::copy(mine.begin(), mine.end(), local.data_ptr<int64_t>());
    world.all_gather(local, all)->wait();
    if (!o.trace_dir.empty() && step == o.warmup + o.steps - 1) {
      std::filesystem::create_directories(o.trace_dir);
      trace.write(o.trace_dir + "/" + schedule.name + "_rank" + std::to_string(world.rank()) +
                  ".json");
    }
    if (!timed) continue;
    const int64_t* g = all.data_ptr<int64_t>();
    int64_t makespan = 0, step_ns = 0;
    double busy = 0;
    for (int r = 0; r < p; ++r) {
      const int64_t* f = g + r * width;
      makespan = std::max(makespan, f[run_end]);
      step_ns = std::max(step_ns, f[step_end]);
      busy += double(f[forward_ns] + f[backward_ns]);
      f_sum += double(f[forward_ns]), b_sum += double(f[backward_ns]);
      f_n += double(f[forwards]), b_n += double(f[backwards]);
      for (int c = 0; c < v; ++c) {
        f_chunk[size_t(r * v + c)] += double(f[num_fields + 2 * c]);
        b_chunk[size_t(r * v + c)] += double(f[num_fields + 2 * c + 1]);
      }
    }
    row.step_ms += double(step_ns) / 1e6 / o.steps;
    row.bubble += (double(p) * double(makespan) - busy) / busy / o.steps;
    row.stage0_peak = std::max(row.stage0_peak, g[activation_peak]);  // rank 0 is stage 0
  }
  row.forward_ms = f_sum / f_n / 1e6;
  row.backward_ms = b_sum / b_n / 1e6;
  row.formula = double(p - 1) / double(v * m);
  const engine::SimulationResult uniform =
      engine::simulate(schedule, row.forward_ms, row.backward_ms);
  BRAID_CHECK(uniform.ok(), "pipeline_bench: ", uniform.error);
  row.sim = uniform.bubble_fraction;
  row.in_flight = uniform.max_in_flight[0];
  engine::SimulationCosts costs;
  costs.forward_by_chunk.assign(size_t(p), std::vector<double>(size_t(v)));
  costs.backward_by_chunk = costs.forward_by_chunk;
  const double per_chunk_runs = double(m) * o.steps;
  for (int r = 0; r < p; ++r)
    for (int c = 0; c < v; ++c) {
      costs.forward_by_chunk[size_t(r)][size_t(c)] =
          f_chunk[size_t(r * v + c)] / per_chunk_runs / 1e6;
      costs.backward_by_chunk[size_t(r)][size_t(c)] =
          b_chunk[size_t(r * v + c)] / per_chunk_runs / 1e6;
    }
  const engine::SimulationResult by_chunk = engine::simulate(schedule, costs);
  BRAID_CHECK(by_chunk.ok(), "pipeline_bench: ", by_chunk.error);
  row.sim_chunk = by_chunk.bubble_fraction;
  world.barrier()->wait();
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  return comm::run_main([&] {
    const Options o = parse(argc, argv);
    auto dist = comm::init_distributed();
    comm::MpiCommunicator& world = *dist.world;
    const int p = world.size();
    BRAID_CONFIG_CHECK(p > 1, "pipeline_bench: run it with at least 2 ranks (pp = ranks)");
    comm::ParallelState state(dist.world, {.pp = p});
    const bool root = world.rank() == 0;
    if (root)
      std::printf(
          "# pipeline_bench: pp %d, %lld layers, hidden %lld, seq %lld, batch %lld, vocab %lld, "
          "%d microbatches, %d timed steps (+%d warmup), f32 on CPU\n",
          p, (long long)o.layers, (long long)o.hidden, (long long)o.seq, (long long)o.batch,
          (long long)o.vocab, o.microbatches, o.steps, o.warmup);
    std::vector<engine::Schedule> schedules{engine::make_gpipe(p, o.microbatches),
                                            engine::make_1f1b(p, o.microbatches)};
    if (o.virtual_stages > 1)
      schedules.push_back(engine::make_interleaved_1f1b(p, o.microbatches, o.virtual_stages));
    std::vector<Row> rows;
    for (const engine::Schedule& s : schedules) rows.push_back(bench(o, s, world, state));
    if (root) {
      std::printf("%-22s %9s %8s %8s %8s %8s %9s %9s %10s %9s\n", "schedule", "step_ms", "fwd_ms",
                  "bwd_ms", "bubble", "formula", "sim", "sim/chunk", "stage0_MiB", "in_flight");
      for (const Row& r : rows)
        std::printf("%-22s %9.1f %8.2f %8.2f %8.3f %8.3f %9.3f %9.3f %10.1f %9d\n", r.name.c_str(),
                    r.step_ms, r.forward_ms, r.backward_ms, r.bubble, r.formula, r.sim, r.sim_chunk,
                    double(r.stage0_peak) / (1 << 20), r.in_flight);
    }
    return 0;
  });
}
