// dp_overlap_bench: data parallelism (dp = the job's size) with the gradient reduction
// overlapped with the backward or not, plain DDP and ZeRO-1: step time, and how much of the
// reduction the backward hides, from GradBuffer::reduce_spans().
//
//   OMP_NUM_THREADS=1 mpirun -np 2 build/benchmarks/dp_overlap_bench [--layers 4 --hidden 512
//       --heads 8 --seq 64 --micro-batch-size 1 --microbatches 2 --vocab 1024
//       --bucket-size 2000000 --steps 10 --warmup 2 --omp-threads 1]
// docs/performance.md reports --steps 20 --warmup 3 under nice -n -15.
//
// Four modes - {ddp, zero} x {overlap off, on} - each on a model of its own, built from the
// same seed and fed the same batches. Rounds alternate the modes (round r starts with mode
// r mod 4), so load from other processes falls on all of them alike. Each step replicates
// Trainer::train_step's order: barrier, zero_grad, start_grad_sync, forward + backward per
// microbatch, finish_grad_sync, grad norm, AdamW, start_param_gather (ZeRO: waited for
// inside the step; --overlap-param-gather is off, this benchmark is about the gradients).
//
// Definitions (per rank and step, then the mean of the ranks; step = the slowest rank's;
// every column is the median over the timed steps):
//   backward   the backward calls of the step, summed over microbatches;
//   exposed    last bucket's done_ns - the end of the last backward: the reduction the step
//              still waited for after its backward (finish_grad_sync's wait);
//   in flight  last done_ns - first posted_ns: how long reductions were outstanding;
//   hidden     1 - exposed(overlap on) / exposed(overlap off), same optimizer. With overlap
//              off every bucket is posted after the backward, so exposed(off) is the whole
//              reduction; "hidden" is the share of it that overlap removed from the step's
//              critical path (negative: overlap made the wait longer).
//   step on/off  median step time with overlap on / with it off (< 1: overlap helps).
// Then the reduction alone (the whole buffer, nothing else running) for reference. At the end
// every model must hold the same parameters as ddp/off (max |difference| is printed; the
// exit status is 1 beyond 1e-5), which is what the ctest smoke entry checks.

#include <omp.h>    // defines: omp_set_num_threads, omp_get_max_threads
#include <sched.h>  // defines: sched_getaffinity, CPU_ISSET

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "braid/comm/launch.h"          // defines: init_distributed, run_main
#include "braid/comm/parallel_state.h"  // defines: ParallelState (dp = world)
#include "braid/comm/progress.h"        // defines: ProgressThread (the reference reduction)
#include "braid/core/error.h"
#include "braid/engine/parallel_model.h"  // defines: ParallelModel, ParallelConfig, DDPConfig
#include "braid/engine/trainer.h"         // defines: Trainer (builds the AdamW of a layout)

using namespace braid;
using namespace braid::model;

namespace {

struct Options {
  int64_t layers = 4, hidden = 512, heads = 8, seq = 64, micro_batch = 1, vocab = 1024;
  int microbatches = 2, steps = 10, warmup = 2, omp_threads = 1;
  int64_t bucket_size = 2'000'000;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::printf(
          "dp_overlap_bench [--layers L] [--hidden H] [--heads A] [--seq S] "
          "[--micro-batch-size B] [--microbatches M] [--vocab V] [--bucket-size E] [--steps K] "
          "[--warmup W] [--omp-threads T]\n");
      std::exit(0);
    }
    if (i + 1 >= argc)
      throw ConfigError("dp_overlap_bench: " + a + " needs a value", __FILE__, __LINE__);
    const char* v = argv[++i];
    if (a == "--layers")
      o.layers = std::atoll(v);
    else if (a == "--hidden")
      o.hidden = std::atoll(v);
    else if (a == "--heads")
      o.heads = std::atoll(v);
    else if (a == "--seq")
      o.seq = std::atoll(v);
    else if (a == "--micro-batch-size")
      o.micro_batch = std::atoll(v);
    else if (a == "--microbatches")
      o.microbatches = std::atoi(v);
    else if (a == "--vocab")
      o.vocab = std::atoll(v);
    else if (a == "--bucket-size")
      o.bucket_size = std::atoll(v);
    else if (a == "--steps")
      o.steps = std::atoi(v);
    else if (a == "--warmup")
      o.warmup = std::atoi(v);
    else if (a == "--omp-threads")
      o.omp_threads = std::atoi(v);
    else
      throw ConfigError("dp_overlap_bench: unknown option " + a, __FILE__, __LINE__);
  }
  BRAID_CONFIG_CHECK(o.steps > 0 && o.warmup >= 0 && o.microbatches > 0 && o.bucket_size > 0,
                     "dp_overlap_bench: --steps, --microbatches, --bucket-size must be > 0");
  return o;
}

TransformerConfig config_of(const Options& o) {
  TransformerConfig c = TransformerConfig::preset("gpt2-tiny");
  c.num_layers = o.layers;
  c.hidden_size = o.hidden;
  c.num_attention_heads = o.heads;
  c.num_query_groups = o.heads;
  c.ffn_hidden_size = 4 * o.hidden;
  c.vocab_size = o.vocab;
  c.max_position_embeddings = o.seq;
  return c;
}

// Microbatch m of step s on DP rank d: [B, S] ids or targets (no ignored targets).
Tensor tokens(const Options& o, int step, int dp_rank, int m, bool targets) {
  Tensor t = Tensor::empty({o.micro_batch, o.seq}, DType::i32);
  uint64_t x = 0x9E3779B97F4A7C15ull * uint64_t(1 + m + 131 * dp_rank + 7919 * step);
  if (targets) x ^= 0xD1B54A32D192ED03ull;
  for (int64_t i = 0; i < t.numel(); ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    t.data_ptr<int32_t>()[i] = int32_t(x % uint64_t(o.vocab));
  }
  return t;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int64_t now_ns() {  // the clock GradBuffer's spans use
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Mode {
  std::string name;
  bool zero = false, overlap = false;
  std::unique_ptr<engine::ParallelModel> model;
  std::unique_ptr<engine::Trainer> trainer;  // for its AdamW only; the step is ours
  // Per timed step, over ranks.
  std::vector<double> step_ms, forward_ms, backward_ms, exposed_ms, in_flight_ms;
  int posted_in_backward = 0;  // buckets, last step, rank 0
};

// What one rank reports per step.
enum Field { step_ns, forward_ns, backward_ns, exposed_ns, in_flight_ns, in_backward, num_fields };

std::vector<int64_t> run_step(const Options& o, Mode& mode, int step, int dp_rank, int dp,
                              comm::Communicator& world) {
  engine::ParallelModel& pm = *mode.model;
  GPTModel& model = pm.chunk(0);
  engine::AdamW& adamw = mode.trainer->optimizer();
  const int m_count = o.microbatches;
  std::vector<Tensor> ids, targets;
  for (int m = 0; m < m_count; ++m) {
    ids.push_back(tokens(o, step, dp_rank, m, false));
    targets.push_back(tokens(o, step, dp_rank, m, true));
  }
  // Token mean over the global batch: every target counts (none ignored).
  const float scale = 1.0f / float(m_count * dp);

  world.barrier()->wait();
  const int64_t start = now_ns();
  pm.zero_grad();
  pm.start_grad_sync(m_count);
  int64_t fwd = 0, bwd = 0;
  for (int m = 0; m < m_count; ++m) {
    const int64_t t0 = now_ns();
    model.forward(ids[size_t(m)], targets[size_t(m)], m);
    const int64_t t1 = now_ns();
    model.backward(m, scale);
    const int64_t t2 = now_ns();
    fwd += t1 - t0, bwd += t2 - t1;
  }
  const int64_t backward_end = now_ns();
  pm.finish_grad_sync();
  const float norm = adamw.grad_norm();
  const float clip = adamw.config().clip_grad;
  const float coeff = clip > 0 ? std::min(1.0f, clip / (norm + 1e-6f)) : 1.0f;
  adamw.step_with(adamw.config().lr, coeff);
  pm.start_param_gather();
  const int64_t end = now_ns();

  std::vector<int64_t> f(num_fields, 0);
  f[step_ns] = end - start;
  f[forward_ns] = fwd;
  f[backward_ns] = bwd;
  const auto& spans = pm.grad_buffer(0).reduce_spans();
  BRAID_CHECK(!spans.empty(), "dp_overlap_bench: no reduction spans (dp = 1?)");
  int64_t first_posted = spans.front().posted_ns, last_done = spans.front().done_ns;
  for (const engine::GradBuffer::Span& s : spans) {
    first_posted = std::min(first_posted, s.posted_ns);
    last_done = std::max(last_done, s.done_ns);
    f[in_backward] += s.during_backward;
  }
  f[exposed_ns] = std::max<int64_t>(0, last_done - backward_end);
  f[in_flight_ns] = last_done - first_posted;
  return f;
}

// The reduction alone, for reference: the whole gradient buffer (`elements` f32) all-reduced
// or reduce-scattered with nothing else running, waited for on the main thread (Work::wait,
// which polls MPI itself) or through a ProgressThread as GradBuffer does. Median ms of
// `repeats`, the four variants alternating.
std::vector<double> reduction_alone(comm::Communicator& world, int64_t elements, int repeats) {
  Tensor buffer = Tensor::zeros({elements}, DType::f32);
  Tensor shard = Tensor::zeros({elements / world.size()}, DType::f32);
  comm::ProgressThread progress;
  std::vector<std::vector<double>> ms(4);
  for (int r = 0; r < repeats; ++r) {
    for (int v = 0; v < 4; ++v) {
      world.barrier()->wait();
      const int64_t start = now_ns();
      comm::WorkPtr work = v % 2 == 0 ? world.all_reduce(buffer, comm::ReduceOp::sum)
                                      : world.reduce_scatter(buffer, shard, comm::ReduceOp::sum);
      if (v < 2) {
        work->wait();
      } else {
        progress.watch(work, world.timeout());
        progress.wait(work);
      }
      ms[size_t(v)].push_back(double(now_ns() - start) / 1e6);
    }
  }
  std::vector<double> out;
  for (auto& m : ms) out.push_back(median(m));
  return out;
}

std::string cpus_of_this_process() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return "?";
  std::string s;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) {
      if (!s.empty()) s += ',';
      s += std::to_string(c);
    }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  return comm::run_main([&] {
    const Options o = parse(argc, argv);
    omp_set_num_threads(o.omp_threads);
    auto dist = comm::init_distributed();
    comm::MpiCommunicator& world = *dist.world;
    const int dp = world.size();
    BRAID_CONFIG_CHECK(dp > 1, "dp_overlap_bench: run it with at least 2 ranks (dp = ranks)");
    comm::ParallelState state(dist.world, {.dp = dp});
    const bool root = world.rank() == 0;
    const TransformerConfig config = config_of(o);

    std::vector<Mode> modes;
    for (bool zero : {false, true})
      for (bool overlap : {false, true}) {
        Mode& mode = modes.emplace_back();
        mode.name = std::string(zero ? "zero" : "ddp") + " overlap " + (overlap ? "on" : "off");
        mode.zero = zero, mode.overlap = overlap;
      }
    for (Mode& mode : modes) {
      engine::ParallelConfig parallel;
      parallel.ddp.bucket_size = o.bucket_size;
      parallel.ddp.overlap_grad_reduce = mode.overlap;
      parallel.ddp.use_distributed_optimizer = mode.zero;
      mode.model =
          std::make_unique<engine::ParallelModel>(config, Device::cpu(), 1234, state, parallel);
      engine::TrainerConfig tc;
      tc.optimizer.lr = 1e-4f;
      tc.optimizer.clip_grad = 0.0f;  // no clipping: every mode's update is then bit-identical
      tc.schedule.lr = 1e-4f;         // unused: the step passes AdamW its lr
      tc.schedule.decay_iters = 1;
      mode.trainer = std::make_unique<engine::Trainer>(*mode.model, tc);
    }
    const int64_t params = modes[0].model->chunk(0).flat_params().numel();
    const size_t buckets_bucketed = modes[1].model->grad_buffer(0).buckets().size();
    const std::string cpus = cpus_of_this_process();
    if (root) {
      const char* omp_env = std::getenv("OMP_NUM_THREADS");
      std::printf(
          "# dp_overlap_bench: dp %d, %lld layers, hidden %lld, heads %lld, seq %lld, "
          "micro-batch %lld, %d microbatches, vocab %lld: %.2f M parameters (%.1f MiB of f32 "
          "gradients)\n"
          "# buckets: %zu with overlap (--bucket-size %lld elements), 1 without; %d timed steps "
          "(+%d warmup) per mode, modes alternating; f32 on CPU\n"
          "# rank 0: %d OpenMP thread(s) (OMP_NUM_THREADS=%s), CPUs {%s}\n",
          dp, (long long)o.layers, (long long)o.hidden, (long long)o.heads, (long long)o.seq,
          (long long)o.micro_batch, o.microbatches, (long long)o.vocab, double(params) / 1e6,
          double(params) * 4 / (1 << 20), buckets_bucketed, (long long)o.bucket_size, o.steps,
          o.warmup, omp_get_max_threads(), omp_env ? omp_env : "unset", cpus.c_str());
    }

    const int n = int(modes.size());
    for (int round = 0; round < o.warmup + o.steps; ++round) {
      for (int k = 0; k < n; ++k) {
        Mode& mode = modes[size_t((round + k) % n)];
        const std::vector<int64_t> mine = run_step(o, mode, round, state.dp_rank(), dp, world);
        Tensor local = Tensor::empty({num_fields}, DType::i64);
        Tensor all = Tensor::empty({int64_t(num_fields) * dp}, DType::i64);
        std::copy(mine.begin(), mine.end(), local.data_ptr<int64_t>());
        world.all_gather(local, all)->wait();
        if (round < o.warmup) continue;
        const int64_t* g = all.data_ptr<int64_t>();
        double step = 0, sums[num_fields] = {};
        for (int r = 0; r < dp; ++r) {
          step = std::max(step, double(g[r * num_fields + step_ns]));
          for (int f = 0; f < num_fields; ++f) sums[f] += double(g[r * num_fields + f]) / dp;
        }
        mode.step_ms.push_back(step / 1e6);
        mode.forward_ms.push_back(sums[forward_ns] / 1e6);
        mode.backward_ms.push_back(sums[backward_ns] / 1e6);
        mode.exposed_ms.push_back(sums[exposed_ns] / 1e6);
        mode.in_flight_ms.push_back(sums[in_flight_ns] / 1e6);
        mode.posted_in_backward = int(g[in_backward]);
      }
    }

    // Every mode ran the same steps on the same data: the parameters must agree.
    double max_diff = 0;
    const Tensor reference = modes[0].model->chunk(0).flat_params();
    for (int k = 1; k < n; ++k) {
      const Tensor p = modes[size_t(k)].model->chunk(0).flat_params();
      for (int64_t i = 0; i < params; ++i)
        max_diff = std::max<double>(
            max_diff, std::fabs(p.data_ptr<float>()[i] - reference.data_ptr<float>()[i]));
    }
    Tensor d = Tensor::empty({1}, DType::f32);
    d.data_ptr<float>()[0] = float(max_diff);
    world.all_reduce(d, comm::ReduceOp::max)->wait();
    max_diff = d.data_ptr<float>()[0];

    const std::vector<double> alone =
        reduction_alone(world, modes[0].model->chunk(0).flat_grads().numel(), 5);

    if (root) {
      std::printf("#\n# %-16s %7s %6s %8s %8s %8s %10s %9s %8s %11s\n", "mode", "buckets", "in_bwd",
                  "step_ms", "fwd_ms", "bwd_ms", "exposed_ms", "flight_ms", "hidden_%",
                  "step_on/off");
      for (int k = 0; k < n; ++k) {
        const Mode& mode = modes[size_t(k)];
        const Mode& off = modes[size_t(k & ~1)];  // the same optimizer, overlap off
        const double exposed = median(mode.exposed_ms), step = median(mode.step_ms);
        char hidden[32] = "-", ratio[32] = "-";
        if (mode.overlap) {
          std::snprintf(hidden, sizeof(hidden), "%.1f",
                        100 * (1 - exposed / median(off.exposed_ms)));
          std::snprintf(ratio, sizeof(ratio), "%.3f", step / median(off.step_ms));
        }
        std::printf("  %-16s %7zu %6d %8.1f %8.1f %8.1f %10.1f %9.1f %8s %11s\n", mode.name.c_str(),
                    mode.model->grad_buffer(0).buckets().size(), mode.posted_in_backward, step,
                    median(mode.forward_ms), median(mode.backward_ms), exposed,
                    median(mode.in_flight_ms), hidden, ratio);
      }
      std::printf(
          "# the reduction alone (whole gradient buffer, nothing else running, median of 5): "
          "all_reduce %.1f ms waited by Work::wait, %.1f ms through a ProgressThread; "
          "reduce_scatter %.1f / %.1f ms\n",
          alone[0], alone[2], alone[1], alone[3]);
      std::printf("# parameters after %d steps, max |mode - ddp overlap off| = %.3g (%s)\n",
                  o.warmup + o.steps, max_diff, max_diff <= 1e-5 ? "ok" : "WRONG");
    }
    return max_diff <= 1e-5 ? 0 : 1;
  });
}
