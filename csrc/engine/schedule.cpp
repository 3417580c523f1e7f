// Pipeline schedules as data: GPipe, 1F1B and interleaved 1F1B in Megatron-LM's orders, the
// layer split, and the compact text form. The simulator is in schedule_simulate.cpp.

#include "braid/engine/schedule.h"

#include <algorithm>
#include <sstream>

#include "braid/core/error.h"

namespace braid::engine {

const char* to_string(ActionKind kind) {
  switch (kind) {
    case ActionKind::forward:
      return "forward";
    case ActionKind::backward:
      return "backward";
    case ActionKind::exchange:
      return "exchange";
  }
  return "?";
}

const char* to_string(P2PKind kind) {
  switch (kind) {
    case P2PKind::send_activation:
      return "send_activation";
    case P2PKind::recv_activation:
      return "recv_activation";
    case P2PKind::send_grad:
      return "send_grad";
    case P2PKind::recv_grad:
      return "recv_grad";
  }
  return "?";
}

Action Action::forward_step(int chunk, int microbatch) {
  return Action{ActionKind::forward, microbatch, chunk, {}};
}

Action Action::backward_step(int chunk, int microbatch) {
  return Action{ActionKind::backward, microbatch, chunk, {}};
}

namespace {

void check_common(int pp, int microbatches) {
  BRAID_CONFIG_CHECK(pp >= 1, "--pipeline-model-parallel-size must be >= 1, got ", pp);
  BRAID_CONFIG_CHECK(microbatches >= 1,
                     "the number of microbatches (--global-batch-size / (--micro-batch-size x "
                     "data-parallel size)) must be >= 1, got ",
                     microbatches);
}

// Builds one rank's list. Exchanges collect ops and are emitted only when non-empty; ops are
// kept in P2PKind order (activations before gradients, sends before receives) so that the
// per-peer FIFO matching holds even when both neighbours are the same rank (pp == 2).
class RankBuilder {
 public:
  RankBuilder(int pp, int rank) : pp_(pp), rank_(rank) {}

  void forward(int chunk, int mb) { actions_.push_back(Action::forward_step(chunk, mb)); }
  void backward(int chunk, int mb) { actions_.push_back(Action::backward_step(chunk, mb)); }

  // Ops of the exchange being assembled; flush() emits it.
  void send_activation(int chunk, int mb) {
    ops_.push_back({P2PKind::send_activation, mb, chunk, next()});
  }
  void recv_activation(int chunk, int mb) {
    ops_.push_back({P2PKind::recv_activation, mb, chunk, prev()});
  }
  void send_grad(int chunk, int mb) { ops_.push_back({P2PKind::send_grad, mb, chunk, prev()}); }
  void recv_grad(int chunk, int mb) { ops_.push_back({P2PKind::recv_grad, mb, chunk, next()}); }
  void flush() {
    if (ops_.empty()) return;
    std::stable_sort(ops_.begin(), ops_.end(),
                     [](const P2POp& a, const P2POp& b) { return a.kind < b.kind; });
    actions_.push_back(Action{ActionKind::exchange, -1, -1, std::move(ops_)});
    ops_.clear();
  }
  std::vector<Action> take() {
    flush();
    return std::move(actions_);
  }

  // One microbatch of a stage without interleaving, each exchange on its own (Megatron's
  // recv_forward, forward, send_forward and recv_backward, backward, send_backward).
  void forward_alone(int mb) {
    if (rank_ != 0) recv_activation(0, mb);
    flush();
    forward(0, mb);
    if (rank_ != pp_ - 1) send_activation(0, mb);
    flush();
  }
  void backward_alone(int mb) {
    if (rank_ != pp_ - 1) recv_grad(0, mb);
    flush();
    backward(0, mb);
    if (rank_ != 0) send_grad(0, mb);
    flush();
  }

 private:
  int next() const { return (rank_ + 1) % pp_; }
  int prev() const { return (rank_ + pp_ - 1) % pp_; }
  int pp_, rank_;
  std::vector<Action> actions_;
  std::vector<P2POp> ops_;
};

}  // namespace

Schedule make_gpipe(int pp, int microbatches) {
  check_common(pp, microbatches);
  Schedule s{"gpipe", pp, microbatches, 1, {}};
  for (int r = 0; r < pp; ++r) {
    RankBuilder b(pp, r);
    for (int i = 0; i < microbatches; ++i) {
      b.forward_alone(i);
    }
    for (int i = 0; i < microbatches; ++i) {
      b.backward_alone(i);
    }
    s.ranks.push_back(b.take());
  }
  return s;
}

Schedule make_1f1b(int pp, int microbatches) {
  check_common(pp, microbatches);
  Schedule s{"1f1b", pp, microbatches, 1, {}};
  for (int r = 0; r < pp; ++r) {
    const bool first = r == 0, last = r == pp - 1;
    const int warmup = std::min(pp - r - 1, microbatches);
    const int remaining = microbatches - warmup;
    RankBuilder b(pp, r);
    // Warmup: recv_forward, forward, send_forward.
    for (int i = 0; i < warmup; ++i) {
      b.forward_alone(i);
    }
    if (remaining > 0 && !first) b.recv_activation(0, warmup);
    b.flush();
    // Steady state: forward, send_forward_recv_backward, backward,
    // send_backward_recv_forward (send_backward alone after the last forward).
    for (int i = 0; i < remaining; ++i) {
      const int f = warmup + i;
      b.forward(0, f);
      if (!last) {
        b.send_activation(0, f);
        b.recv_grad(0, i);
      }
      b.flush();
      b.backward(0, i);
      if (!first) {
        b.send_grad(0, i);
        if (i != remaining - 1) b.recv_activation(0, f + 1);
      }
      b.flush();
    }
    // Cooldown: recv_backward, backward, send_backward.
    for (int i = remaining; i < microbatches; ++i) {
      b.backward_alone(i);
    }
    s.ranks.push_back(b.take());
  }
  return s;
}

int interleaved_warmup_steps(int pp, int microbatches, int virtual_stages, int rank) {
  const int total = microbatches * virtual_stages;
  if (virtual_stages == 1) return std::min(pp - rank - 1, microbatches);
  return std::min(total, (pp - rank - 1) * 2 + (virtual_stages - 1) * pp);
}

namespace {

// The interleaved schedule's lookup tables, indexed by "virtual microbatch" k in [0, v m):
// forwards take microbatches in groups of pp, walking chunks 0..v-1 within each group.
struct InterleavedTables {
  int pp, v, total;
  int chunk(int k, bool forward) const {
    const int c = (k % (pp * v)) / pp;
    return forward ? c : v - 1 - c;
  }
  int microbatch(int k) const { return (k / (pp * v)) * pp + k % pp; }
};

}  // namespace

namespace {

// The interleaved schedule; forward_only: every forward is a warmup step and no backward runs.
Schedule build_interleaved(int pp, int microbatches, int virtual_stages, bool forward_only) {
  check_common(pp, microbatches);
  BRAID_CONFIG_CHECK(virtual_stages >= 1,
                     "--num-virtual-stages-per-pipeline-rank must be >= 1, got ", virtual_stages);
  BRAID_CONFIG_CHECK(pp > 1, "--num-virtual-stages-per-pipeline-rank (", virtual_stages,
                     ") > 1 needs --pipeline-model-parallel-size > 1 (the interleaved schedule "
                     "interleaves pipeline ranks), got ",
                     pp);
  BRAID_CONFIG_CHECK(
      microbatches % pp == 0, "number of microbatches (", microbatches,
      ") is not divisible by --pipeline-model-parallel-size (", pp,
      ") when using the interleaved schedule (--num-virtual-stages-per-pipeline-rank ",
      virtual_stages, ")");

  const int v = virtual_stages;
  const InterleavedTables t{pp, v, microbatches * v};
  Schedule s{forward_only ? "forward-only" : "interleaved-1f1b", pp, microbatches, v, {}};
  s.forward_only = forward_only;
  for (int r = 0; r < pp; ++r) {
    const bool first_rank = r == 0, last_rank = r == pp - 1;
    auto is_first_stage = [&](int chunk) { return first_rank && chunk == 0; };
    auto is_last_stage = [&](int chunk) { return last_rank && chunk == v - 1; };
    // Whether the exchange after virtual microbatch k receives (forward: an activation from
    // the previous rank; backward: a gradient from the next rank), and for which chunk. The
    // leading rank (rank 0 forward, rank pp-1 backward) runs pp - 1 steps ahead of the rank
    // that feeds it across the wrap-around.
    auto recv_plan = [&](int k, bool forward) -> std::pair<bool, int> {
      const bool leading = forward ? first_rank : last_rank;
      if (!leading) return {true, t.chunk((k + 1) % t.total, forward)};
      if (k < pp - 1) return {false, t.chunk(k + 1, forward)};
      const int fed_from = t.chunk(k - (pp - 1), forward);
      if (fed_from == (forward ? v - 1 : 0)) return {false, fed_from};
      return {true, forward ? fed_from + 1 : fed_from - 1};
    };
    // Received tensors are consumed per chunk in microbatch order.
    std::vector<int> acts_received(v, 0), grads_received(v, 0);
    RankBuilder b(pp, r);
    auto recv_act = [&](int chunk) { b.recv_activation(chunk, acts_received[chunk]++); };
    auto recv_grad = [&](int chunk) { b.recv_grad(chunk, grads_received[chunk]++); };

    const int warmup = forward_only ? t.total : interleaved_warmup_steps(pp, microbatches, v, r);
    const bool all_warmup = warmup == t.total;
    const int remaining = t.total - warmup;

    if (!first_rank) recv_act(0);
    b.flush();
    for (int k = 0; k < warmup; ++k) {
      const int c = t.chunk(k, true), mb = t.microbatch(k);
      b.forward(c, mb);
      if (!is_last_stage(c)) b.send_activation(c, mb);
      auto [recv_prev, next_chunk] = recv_plan(k, true);
      if (k == t.total - 1) recv_prev = false;
      if (recv_prev) recv_act(next_chunk);
      // The last warmup exchange also fetches the first output gradient.
      if (k == warmup - 1 && !all_warmup && !last_rank) recv_grad(v - 1);
      b.flush();
    }
    for (int k = 0; k < remaining; ++k) {
      const int fk = k + warmup;
      const int fc = t.chunk(fk, true), fmb = t.microbatch(fk);
      const int bc = t.chunk(k, false), bmb = t.microbatch(k);
      b.forward(fc, fmb);
      b.backward(bc, bmb);
      if (!is_last_stage(fc)) b.send_activation(fc, fmb);
      if (!is_first_stage(bc)) b.send_grad(bc, bmb);
      auto [recv_prev, next_fc] = recv_plan(fk, true);
      const auto [recv_next, next_bc] = recv_plan(k, false);
      if (k == remaining - 1) recv_prev = false;
      if (recv_prev) recv_act(next_fc);
      if (recv_next) recv_grad(next_bc);
      b.flush();
    }
    if (forward_only) {
      s.ranks.push_back(b.take());
      continue;
    }
    if (all_warmup && !last_rank) recv_grad(v - 1);
    b.flush();
    for (int k = remaining; k < t.total; ++k) {
      const int c = t.chunk(k, false), mb = t.microbatch(k);
      b.backward(c, mb);
      if (!is_first_stage(c)) b.send_grad(c, mb);
      auto [recv_next, next_chunk] = recv_plan(k, false);
      if (k == t.total - 1) recv_next = false;
      if (recv_next) recv_grad(next_chunk);
      b.flush();
    }
    s.ranks.push_back(b.take());
  }
  return s;
}

}  // namespace

Schedule make_interleaved_1f1b(int pp, int microbatches, int virtual_stages) {
  if (virtual_stages == 1) {
    check_common(pp, microbatches);
    return make_1f1b(pp, microbatches);
  }
  return build_interleaved(pp, microbatches, virtual_stages, false);
}

Schedule make_forward_only(int pp, int microbatches, int virtual_stages) {
  if (virtual_stages != 1) return build_interleaved(pp, microbatches, virtual_stages, true);
  check_common(pp, microbatches);
  Schedule s{"forward-only", pp, microbatches, 1, {}};
  s.forward_only = true;
  for (int r = 0; r < pp; ++r) {
    RankBuilder b(pp, r);
    for (int i = 0; i < microbatches; ++i) b.forward_alone(i);
    s.ranks.push_back(b.take());
  }
  return s;
}

// ---- text form ------------------------------------------------------------------------------

std::string to_string(const Action& action, int virtual_stages) {
  std::ostringstream out;
  auto chunk = [&](int c) {
    if (virtual_stages > 1) out << 'c' << c;
  };
  switch (action.kind) {
    case ActionKind::forward:
    case ActionKind::backward:
      out << (action.kind == ActionKind::forward ? 'F' : 'B') << action.microbatch;
      chunk(action.chunk);
      break;
    case ActionKind::exchange:
      out << '[';
      for (size_t i = 0; i < action.ops.size(); ++i) {
        const P2POp& op = action.ops[i];
        const bool send = op.kind == P2PKind::send_activation || op.kind == P2PKind::send_grad;
        const bool act = op.kind == P2PKind::send_activation || op.kind == P2PKind::recv_activation;
        out << (i ? " " : "") << (send ? 's' : 'r') << (act ? 'A' : 'G') << op.microbatch;
        chunk(op.chunk);
        out << (send ? '>' : '<') << op.peer;
      }
      out << ']';
      break;
  }
  return out.str();
}

std::string format_rank(const Schedule& schedule, int rank, bool with_exchanges) {
  std::string line;
  for (const Action& a : schedule.ranks.at(rank)) {
    if (!with_exchanges && a.kind == ActionKind::exchange) continue;
    if (!line.empty()) line += ' ';
    line += to_string(a, schedule.virtual_stages);
  }
  return line;
}

// ---- layer split ----------------------------------------------------------------------------

namespace {

// The layers of model chunk k = c · pp + r, chunk by chunk in model-chunk order.
std::vector<std::vector<LayerRange>> ranges_of(int pp, int v, const std::vector<int>& counts) {
  std::vector<std::vector<LayerRange>> out(size_t(pp),
                                           std::vector<LayerRange>(size_t(v), LayerRange{}));
  int next = 0;
  for (int k = 0; k < pp * v; ++k) {
    out[size_t(k % pp)][size_t(k / pp)] = {next, next + counts[size_t(k)]};
    next += counts[size_t(k)];
  }
  return out;
}

std::vector<std::vector<LayerRange>> explicit_stage_layers(int num_layers, int pp, int v,
                                                           bool first_or_last,
                                                           const std::vector<int>& counts) {
  BRAID_CONFIG_CHECK(!first_or_last,
                     "a pipeline layout of every stage's layers (--pipeline-model-parallel-layout, "
                     "--account-for-embedding/loss-in-pipeline-split) excludes "
                     "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers");
  BRAID_CONFIG_CHECK(int(counts.size()) == pp * v, "the pipeline layout has ", counts.size(),
                     " stages; --pipeline-model-parallel-size (", pp,
                     ") × virtual stages per rank (", v, ") is ", pp * v);
  int total = 0;
  for (size_t k = 0; k < counts.size(); ++k) {
    const bool end = k == 0 || k + 1 == counts.size();
    BRAID_CONFIG_CHECK(counts[k] >= (end ? 0 : 1), "pipeline layout: stage ", k, " holds ",
                       counts[k], " layers; every stage but the first (the embeddings) and the ",
                       "last (the loss) needs at least one");
    total += counts[k];
  }
  BRAID_CONFIG_CHECK(total == num_layers, "the pipeline layout places ", total,
                     " layers; --num-layers is ", num_layers);
  return ranges_of(pp, v, counts);
}

}  // namespace

std::vector<std::vector<LayerRange>> stage_layers(int num_layers, int pp, int virtual_stages,
                                                  std::optional<int> first_stage_layers,
                                                  std::optional<int> last_stage_layers,
                                                  const std::vector<int>& model_chunk_layers) {
  const int v = virtual_stages;
  BRAID_CONFIG_CHECK(pp >= 1, "--pipeline-model-parallel-size must be >= 1, got ", pp);
  BRAID_CONFIG_CHECK(v >= 1, "--num-virtual-stages-per-pipeline-rank must be >= 1, got ", v);
  BRAID_CONFIG_CHECK(num_layers >= 1, "--num-layers must be >= 1, got ", num_layers);
  BRAID_CONFIG_CHECK(v == 1 || pp > 1, "--num-virtual-stages-per-pipeline-rank (", v,
                     ") > 1 needs --pipeline-model-parallel-size > 1, got ", pp);
  if (!model_chunk_layers.empty())
    return explicit_stage_layers(num_layers, pp, v, first_stage_layers || last_stage_layers,
                                 model_chunk_layers);
  const bool uneven = first_stage_layers.has_value() || last_stage_layers.has_value();
  BRAID_CONFIG_CHECK(!uneven || pp > 1,
                     "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers "
                     "need --pipeline-model-parallel-size > 1, got ",
                     pp);

  // Layers held by each rank (over all its chunks).
  std::vector<int> rank_layers(pp, 0);
  if (!uneven) {
    BRAID_CONFIG_CHECK(num_layers % pp == 0, "--num-layers (", num_layers,
                       ") must be divisible by --pipeline-model-parallel-size (", pp,
                       "); or set --decoder-first-pipeline-num-layers / "
                       "--decoder-last-pipeline-num-layers");
    std::fill(rank_layers.begin(), rank_layers.end(), num_layers / pp);
  } else {
    int remaining = num_layers, middle = pp;
    for (auto [value, name] :
         {std::pair{first_stage_layers, "--decoder-first-pipeline-num-layers"},
          std::pair{last_stage_layers, "--decoder-last-pipeline-num-layers"}}) {
      if (!value) continue;
      BRAID_CONFIG_CHECK(*value >= 1, name, " must be >= 1, got ", *value);
      remaining -= *value;
      --middle;
    }
    BRAID_CONFIG_CHECK(remaining >= 0,
                       "--decoder-first-pipeline-num-layers + "
                       "--decoder-last-pipeline-num-layers exceed --num-layers (",
                       num_layers, ")");
    if (middle == 0) {
      BRAID_CONFIG_CHECK(remaining == 0, "with --pipeline-model-parallel-size ", pp,
                         " the first and last stages are all stages: "
                         "--decoder-first-pipeline-num-layers + --decoder-last-pipeline-num-layers "
                         "must equal --num-layers (",
                         num_layers, "), ", remaining, " layers are left over");
    } else {
      BRAID_CONFIG_CHECK(
          remaining % middle == 0 && remaining / middle >= 1, "--num-layers (", num_layers,
          ") minus --decoder-first-pipeline-num-layers and "
          "--decoder-last-pipeline-num-layers leaves ",
          remaining, " layers, which must split evenly (at least one each) over the other ", middle,
          " pipeline stages");
    }
    const int per_middle = middle ? remaining / middle : 0;
    std::fill(rank_layers.begin(), rank_layers.end(), per_middle);
    if (first_stage_layers) rank_layers.front() = *first_stage_layers;
    if (last_stage_layers) rank_layers.back() = *last_stage_layers;
  }

  // Every rank's layers split evenly over its v chunks.
  for (int r = 0; r < pp; ++r) {
    if (rank_layers[r] % v == 0 && rank_layers[r] >= v) continue;
    if (uneven && r == 0 && first_stage_layers)
      BRAID_CONFIG_CHECK(false, "--decoder-first-pipeline-num-layers (", rank_layers[r],
                         ") must be divisible by --num-virtual-stages-per-pipeline-rank (", v, ")");
    if (uneven && r == pp - 1 && last_stage_layers)
      BRAID_CONFIG_CHECK(false, "--decoder-last-pipeline-num-layers (", rank_layers[r],
                         ") must be divisible by --num-virtual-stages-per-pipeline-rank (", v, ")");
    BRAID_CONFIG_CHECK(false, "the layers per pipeline stage (", rank_layers[r],
                       ") must be divisible by --num-virtual-stages-per-pipeline-rank (", v,
                       ") (--num-layers ", num_layers, ", --pipeline-model-parallel-size ", pp,
                       ")");
  }

  std::vector<int> counts(size_t(pp * v));
  for (int k = 0; k < pp * v; ++k) counts[size_t(k)] = rank_layers[size_t(k % pp)] / v;
  return ranges_of(pp, v, counts);
}

}  // namespace braid::engine
