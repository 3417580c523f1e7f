// Where a step's time went (Trainer::set_trace, StepStats' breakdown): every communication wait
// of a traced step lands on its group's lane ("comm:tp", "comm:pp", "comm:dp", ...), inside the
// step, and the breakdown adds those spans up by group - in every layout of 4 ranks (and the
// one-process trainer on 1). A group of one never waits. A rank that starts its step late shows
// up as the others' wait on the group that needed it.

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "braid/comm/launch.h"
#include "braid/comm/parallel_state.h"
#include "braid/core/trace.h"
#include "braid/engine/trainer.h"
#include "dp/parallel_test_models.h"
#include "tp/tp_test_util.h"

using namespace braid;
using namespace braid::engine;

namespace {

constexpr int64_t kGlobalRows = 8;

struct Layout {
  int tp, pp, dp;
};

struct Job {
  std::shared_ptr<comm::MpiCommunicator> world = comm::init_distributed().world;
  comm::ParallelState state;
  ParallelModel model;
  Trainer trainer;
  tp_testing::Batch batch;

  explicit Job(Layout l)
      : state(world, {.tp = l.tp, .pp = l.pp, .dp = l.dp}),
        model(parallel_testing::gpt2(), Device::cpu(), 7, state, overlapped()),
        trainer(model, parallel_testing::trainer_config(10)),
        batch(tp_testing::batch(kGlobalRows / l.dp, parallel_testing::kSeq,
                                parallel_testing::gpt2().vocab_size,
                                3 + uint64_t(state.dp_rank()))) {}

  static ParallelConfig overlapped() {
    ParallelConfig p;
    p.ddp.overlap_grad_reduce = true;
    p.ddp.bucket_size = 4000;
    return p;
  }
  int microbatches() const { return int(batch.ids.size(0)); }
  StepStats step() { return trainer.train_step(batch.ids, batch.targets, microbatches()); }
};

double seconds_on(const std::vector<TraceSpan>& spans, const std::string& lane) {
  double s = 0;
  for (const TraceSpan& span : spans) s += span.lane == lane ? double(span.dur_ns) * 1e-9 : 0.0;
  return s;
}

int count(const std::vector<TraceSpan>& spans, const std::string& lane,
          const std::string& name = "") {
  int n = 0;
  for (const TraceSpan& s : spans) n += s.lane == lane && (name.empty() || s.name == name);
  return n;
}

void check_layout(Layout l) {
  SCOPED_TRACE("tp " + std::to_string(l.tp) + " pp " + std::to_string(l.pp) + " dp " +
               std::to_string(l.dp));
  Job job(l);
  Trace trace(job.world->rank());
  job.trainer.set_trace(&trace);
  for (int s = 0; s < 2; ++s) {
    trace.clear();
    const StepStats stats = job.step();
    const std::vector<TraceSpan>& spans = trace.spans();

    // One step span; every other span inside it.
    ASSERT_EQ(count(spans, "step"), 1);
    const TraceSpan& step = *std::find_if(spans.begin(), spans.end(),
                                          [](const TraceSpan& x) { return x.lane == "step"; });
    std::map<std::string, int> comm_lanes;
    for (const TraceSpan& x : spans) {
      EXPECT_GE(x.dur_ns, 0);
      EXPECT_GE(x.start_ns, step.start_ns) << x.name << " on " << x.lane;
      EXPECT_LE(x.end_ns(), step.end_ns()) << x.name << " on " << x.lane;
      if (x.lane.starts_with("comm:")) ++comm_lanes[x.lane];
    }

    // The groups of more than one rank are waited on; a group of one never is.
    EXPECT_EQ(comm_lanes.count("comm:tp"), size_t(l.tp > 1));
    EXPECT_EQ(comm_lanes.count("comm:pp"), size_t(l.pp > 1));
    EXPECT_EQ(comm_lanes.count("comm:dp"), size_t(l.dp > 1));
    EXPECT_EQ(stats.tp_wait_seconds > 0, l.tp > 1);
    EXPECT_EQ(stats.pipeline_wait_seconds > 0, l.pp > 1);
    EXPECT_EQ(stats.dp_wait_seconds > 0, l.dp > 1);

    // The breakdown is the spans added up by group; compute is the rest of the step.
    EXPECT_DOUBLE_EQ(stats.tp_wait_seconds, seconds_on(spans, "comm:tp"));
    EXPECT_DOUBLE_EQ(stats.pipeline_wait_seconds, seconds_on(spans, "comm:pp"));
    EXPECT_DOUBLE_EQ(stats.dp_wait_seconds, seconds_on(spans, "comm:dp"));
    double other = 0;
    for (const auto& [lane, n] : comm_lanes)
      if (lane != "comm:tp" && lane != "comm:pp" && lane != "comm:dp")
        other += seconds_on(spans, lane);
    EXPECT_DOUBLE_EQ(stats.other_wait_seconds, other);
    EXPECT_GT(stats.compute_seconds, 0);
    // The thread waits for one thing at a time: the waits never overlap, and fit in the step.
    std::vector<TraceSpan> waits;
    for (const TraceSpan& x : spans)
      if (x.lane.starts_with("comm:")) waits.push_back(x);
    std::sort(waits.begin(), waits.end(),
              [](const TraceSpan& a, const TraceSpan& b) { return a.start_ns < b.start_ns; });
    for (size_t i = 1; i < waits.size(); ++i)
      EXPECT_GE(waits[i].start_ns, waits[i - 1].end_ns())
          << waits[i - 1].name << " on " << waits[i - 1].lane << " overlaps " << waits[i].name
          << " on " << waits[i].lane;

    // Compute spans: every forward and backward of the schedule, and one optimizer step.
    const int chunks = job.model.num_chunks();
    EXPECT_EQ(count(spans, "compute", "forward"), job.microbatches() * chunks);
    EXPECT_EQ(count(spans, "compute", "backward"), job.microbatches() * chunks);
    EXPECT_EQ(count(spans, "compute", "optimizer"), 1);
    if (l.pp > 1) {
      // Each of the schedule's exchanges is waited for once: the pipeline's view ("p2p" lane)
      // and the communicator's ("comm:pp") agree.
      int exchanges = 0;
      const Schedule schedule = make_1f1b(l.pp, job.microbatches());
      for (const Action& a : schedule.ranks[size_t(job.state.pp_rank())])
        exchanges += a.kind == ActionKind::exchange;
      EXPECT_EQ(count(spans, "p2p", "wait"), exchanges);
      EXPECT_EQ(count(spans, "comm:pp"), exchanges);
    }
  }

  // Untraced: nothing recorded, no breakdown.
  job.trainer.set_trace(nullptr);
  trace.clear();
  const StepStats stats = job.step();
  EXPECT_EQ(trace.spans().size(), 0u);
  EXPECT_EQ(stats.compute_seconds, 0);
  EXPECT_EQ(stats.tp_wait_seconds + stats.pipeline_wait_seconds + stats.dp_wait_seconds +
                stats.other_wait_seconds,
            0);
  job.world->barrier()->wait();
}

int world_size() { return comm::init_distributed().world->size(); }

// A Work waited for twice is one wait on the trace; with no current trace, none.
TEST(StepBreakdown, AWaitIsRecordedOnceAndOnlyWhileATraceIsCurrent) {
  std::shared_ptr<comm::MpiCommunicator> world = comm::init_distributed().world;
  Trace trace(world->rank());
  Tensor x = Tensor::zeros({4}, DType::f32);
  {
    const Trace::Recording recording(&trace);
    comm::WorkPtr work = world->all_reduce(x);
    work->wait();
    work->wait();
  }
  world->all_reduce(x)->wait();
  ASSERT_EQ(trace.spans().size(), 1u);
  EXPECT_EQ(trace.spans()[0].lane, "comm:world");
  EXPECT_EQ(trace.spans()[0].name, "all_reduce");
  EXPECT_EQ(trace.spans()[0].detail, "16 bytes");
  EXPECT_EQ(Trace::current(), nullptr);
}

TEST(StepBreakdown, EveryWaitOnItsGroupsLane) {
  if (world_size() == 1) return check_layout({1, 1, 1});
  ASSERT_EQ(world_size(), 4) << "run on 1 or 4 ranks";
  for (Layout l : {Layout{2, 2, 1}, Layout{1, 2, 2}, Layout{2, 1, 2}, Layout{1, 1, 4},
                   Layout{4, 1, 1}, Layout{1, 4, 1}})
    check_layout(l);
}

// The last rank starts its step 300 ms late; the first rank's step blocks on the group that
// needs the late one first (data parallelism: the step's token count over dp; pipeline: the
// activations of its first microbatch coming back as gradients), and it says so.
TEST(StepBreakdown, ALateRankIsTheOthersWait) {
  if (world_size() == 1) GTEST_SKIP() << "needs 4 ranks";
  for (Layout l : {Layout{1, 1, 4}, Layout{1, 4, 1}}) {
    SCOPED_TRACE("pp " + std::to_string(l.pp) + " dp " + std::to_string(l.dp));
    Job job(l);
    Trace trace(job.world->rank());
    job.trainer.set_trace(&trace);
    job.step();  // warm
    job.world->barrier()->wait();
    if (job.world->rank() == 3) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    const StepStats stats = job.step();
    if (job.world->rank() == 0) {
      EXPECT_GE(l.dp > 1 ? stats.dp_wait_seconds : stats.pipeline_wait_seconds, 0.2);
      EXPECT_LT(stats.compute_seconds, stats.seconds - 0.2);
    }
    job.world->barrier()->wait();
  }
}

}  // namespace
