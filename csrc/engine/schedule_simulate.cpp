// The schedule simulator: static checks (shape of every action, every send meets a receive of
// the same tensor), then an event-driven run that checks data flow (a forward has its input, a
// backward its forward and output gradient, a send its tensor) and detects deadlock.

#include <algorithm>
#include <sstream>

#include "braid/engine/schedule.h"

namespace braid::engine {
namespace {

bool is_send(P2PKind k) { return k == P2PKind::send_activation || k == P2PKind::send_grad; }
bool is_activation(P2PKind k) {
  return k == P2PKind::send_activation || k == P2PKind::recv_activation;
}

// Where an op sits: rank, action index, op index.
struct OpRef {
  int rank = -1, action = -1, op = -1;
};

class Simulator {
 public:
  Simulator(const Schedule& s, const SimulationCosts& c) : s_(s), c_(c) {}

  SimulationResult run() {
    if (!check_shape() || !match()) return std::move(res_);
    execute();
    return std::move(res_);
  }

 private:
  std::string where(int rank, int action) const {
    std::ostringstream out;
    out << "rank " << rank << " action " << action << " ("
        << to_string(s_.ranks[rank][action], s_.virtual_stages) << ")";
    return out.str();
  }
  bool fail(const std::string& message) {
    if (res_.error.empty()) res_.error = message;
    return false;
  }
  int stage(int rank, int chunk) const { return s_.model_chunk(rank, chunk); }

  // Every action names a valid chunk / microbatch, and every op the rank that really holds
  // the neighbouring model chunk.
  bool check_shape() {
    const int p = s_.pp, v = s_.virtual_stages, m = s_.microbatches, last = p * v - 1;
    if (p < 1 || v < 1 || m < 1 || int(s_.ranks.size()) != p)
      return fail("schedule '" + s_.name + "' has " + std::to_string(s_.ranks.size()) +
                  " rank lists for pp " + std::to_string(p));
    for (int r = 0; r < p; ++r) {
      for (int i = 0; i < int(s_.ranks[r].size()); ++i) {
        const Action& a = s_.ranks[r][i];
        auto at = [&] { return where(r, i); };  // built only for an error: checks are hot
        if (a.kind != ActionKind::exchange) {
          if (a.chunk < 0 || a.chunk >= v || a.microbatch < 0 || a.microbatch >= m)
            return fail(at() + ": chunk or microbatch out of range");
          if (!a.ops.empty()) return fail(at() + ": a compute action carries p2p ops");
          continue;
        }
        if (a.ops.empty()) return fail(at() + ": empty exchange");
        for (const P2POp& op : a.ops) {
          if (op.chunk < 0 || op.chunk >= v || op.microbatch < 0 || op.microbatch >= m)
            return fail(at() + ": op chunk or microbatch out of range");
          const int st = stage(r, op.chunk);
          // Activations flow to stage + 1, gradients to stage - 1.
          const bool toward_next =
              (op.kind == P2PKind::send_activation || op.kind == P2PKind::recv_grad);
          const int other = toward_next ? st + 1 : st - 1;
          if (other < 0 || other > last)
            return fail(at() + ": " + to_string(op.kind) + " of model chunk " + std::to_string(st) +
                        " has no neighbour in that direction");
          if (op.peer != other % p)
            return fail(at() + ": " + to_string(op.kind) + " names peer " +
                        std::to_string(op.peer) + " but model chunk " + std::to_string(other) +
                        " lives on rank " + std::to_string(other % p));
        }
      }
    }
    return true;
  }

  // Per ordered pair (a -> b): the k-th send of a meets the k-th receive of b, which must be
  // the same tensor (kind, microbatch, the neighbouring model chunk).
  bool match() {
    const int p = s_.pp;
    std::vector<std::vector<OpRef>> sends(p * p), recvs(p * p);
    for (int r = 0; r < p; ++r)
      for (int i = 0; i < int(s_.ranks[r].size()); ++i)
        for (int j = 0; j < int(s_.ranks[r][i].ops.size()); ++j) {
          const P2POp& op = s_.ranks[r][i].ops[j];
          if (is_send(op.kind))
            sends[r * p + op.peer].push_back({r, i, j});
          else
            recvs[op.peer * p + r].push_back({r, i, j});
        }
    partner_.assign(p, {});
    for (int r = 0; r < p; ++r) {
      partner_[r].resize(s_.ranks[r].size());
      for (size_t i = 0; i < s_.ranks[r].size(); ++i)
        partner_[r][i].resize(s_.ranks[r][i].ops.size());
    }
    for (int a = 0; a < p; ++a)
      for (int b = 0; b < p; ++b) {
        const auto& snd = sends[a * p + b];
        const auto& rcv = recvs[a * p + b];
        const size_t n = std::min(snd.size(), rcv.size());
        for (size_t k = 0; k < n; ++k) {
          const P2POp& so = op(snd[k]);
          const P2POp& ro = op(rcv[k]);
          const int s_stage = stage(a, so.chunk), r_stage = stage(b, ro.chunk);
          const bool same_kind = is_activation(so.kind) == is_activation(ro.kind);
          const int expect = is_activation(so.kind) ? s_stage + 1 : s_stage - 1;
          if (!same_kind || so.microbatch != ro.microbatch || r_stage != expect)
            return fail("mismatched p2p: send #" + std::to_string(k) + " from rank " +
                        std::to_string(a) + " to rank " + std::to_string(b) + " at " +
                        where(snd[k].rank, snd[k].action) + " meets " +
                        where(rcv[k].rank, rcv[k].action));
          partner_[snd[k].rank][snd[k].action][snd[k].op] = rcv[k];
          partner_[rcv[k].rank][rcv[k].action][rcv[k].op] = snd[k];
        }
        if (snd.size() != rcv.size()) {
          const bool extra_send = snd.size() > rcv.size();
          const OpRef& x = extra_send ? snd[n] : rcv[n];
          return fail(std::string("unmatched ") + (extra_send ? "send" : "receive") + " at " +
                      where(x.rank, x.action) + ": rank " + std::to_string(a) + " posts " +
                      std::to_string(snd.size()) + " sends to rank " + std::to_string(b) +
                      ", which posts " + std::to_string(rcv.size()) + " receives from it");
        }
      }
    return true;
  }

  const P2POp& op(const OpRef& ref) const { return s_.ranks[ref.rank][ref.action].ops[ref.op]; }

  double compute_cost(int rank, const Action& a) const {
    const bool fwd = a.kind == ActionKind::forward;
    const auto& table = fwd ? c_.forward_by_chunk : c_.backward_by_chunk;
    if (!table.empty()) return table.at(rank).at(a.chunk);
    return fwd ? c_.forward : c_.backward;
  }

  // Event-driven run. Each rank advances until it reaches an exchange whose peers have not
  // all posted; when a full sweep advances nobody, the remaining ranks are deadlocked.
  void execute() {
    const int p = s_.pp, v = s_.virtual_stages, m = s_.microbatches, last = p * v - 1;
    auto idx = [&](int chunk, int mb) { return chunk * m + mb; };
    std::vector<size_t> pc(p, 0);  // next action per rank
    std::vector<double> clock(p, 0.0);
    std::vector<std::vector<double>> posted(p);  // post time per action, -1 if not yet
    // Data state per rank, indexed by chunk * m + mb.
    std::vector<std::vector<char>> fwd_done(p, std::vector<char>(v * m, 0));
    std::vector<std::vector<char>> bwd_done = fwd_done, have_act = fwd_done, have_grad = fwd_done;
    std::vector<int> in_flight(p, 0);
    res_.busy.assign(p, 0.0);
    res_.finish.assign(p, 0.0);
    res_.max_in_flight.assign(p, 0);
    res_.start.resize(p);
    res_.end.resize(p);
    res_.last_backward_start.assign(p, std::vector<double>(v, -1.0));
    res_.last_backward_end.assign(p, std::vector<double>(v, -1.0));
    for (int r = 0; r < p; ++r) {
      posted[r].assign(s_.ranks[r].size(), -1.0);
      res_.start[r].assign(s_.ranks[r].size(), 0.0);
      res_.end[r].assign(s_.ranks[r].size(), 0.0);
    }

    bool progress = true;
    while (progress) {
      progress = false;
      for (int r = 0; r < p; ++r) {
        const auto& list = s_.ranks[r];
        while (pc[r] < list.size()) {
          const size_t i = pc[r];
          const Action& a = list[i];
          if (a.kind != ActionKind::exchange) {
            const int k = idx(a.chunk, a.microbatch);
            const int st = stage(r, a.chunk);
            if (a.kind == ActionKind::forward) {
              if (fwd_done[r][k]) return (void)fail(where(r, i) + ": forward runs twice");
              if (st > 0 && !have_act[r][k])
                return (void)fail(where(r, i) + ": forward before its input activation arrived");
              fwd_done[r][k] = 1;
              res_.max_in_flight[r] = std::max(res_.max_in_flight[r], ++in_flight[r]);
            } else {
              if (!fwd_done[r][k]) return (void)fail(where(r, i) + ": backward before forward");
              if (bwd_done[r][k]) return (void)fail(where(r, i) + ": backward runs twice");
              if (st < last && !have_grad[r][k])
                return (void)fail(where(r, i) + ": backward before its output gradient arrived");
              bwd_done[r][k] = 1;
              --in_flight[r];
            }
            const double cost = compute_cost(r, a);
            res_.start[r][i] = clock[r];
            clock[r] += cost;
            res_.end[r][i] = clock[r];
            res_.busy[r] += cost;
            if (a.kind == ActionKind::backward) {
              res_.last_backward_start[r][a.chunk] = res_.start[r][i];
              res_.last_backward_end[r][a.chunk] = clock[r];
            }
            ++pc[r];
            progress = true;
            continue;
          }
          if (posted[r][i] < 0) {  // post: the tensors to send must exist now
            for (const P2POp& o : a.ops) {
              const int k = idx(o.chunk, o.microbatch);
              if (o.kind == P2PKind::send_activation && !fwd_done[r][k])
                return (void)fail(where(r, i) + ": sends an activation not yet computed");
              if (o.kind == P2PKind::send_grad && !bwd_done[r][k])
                return (void)fail(where(r, i) + ": sends a gradient not yet computed");
            }
            posted[r][i] = clock[r];
            res_.start[r][i] = clock[r];
            progress = true;
          }
          // Complete when every op's peer has posted (eager: every receive's peer).
          double done = clock[r];
          bool ready = true;
          for (size_t j = 0; j < a.ops.size() && ready; ++j) {
            const OpRef& peer = partner_[r][i][j];
            const bool wait = c_.semantics == P2PSemantics::rendezvous || !is_send(a.ops[j].kind);
            if (!wait) continue;
            const double peer_post = posted[peer.rank][peer.action];
            if (peer_post < 0)
              ready = false;
            else
              done = std::max(done, std::max(clock[r], peer_post) + c_.p2p);
          }
          if (!ready) break;
          for (const P2POp& o : a.ops) {
            const int k = idx(o.chunk, o.microbatch);
            if (o.kind == P2PKind::recv_activation) have_act[r][k] = 1;
            if (o.kind == P2PKind::recv_grad) have_grad[r][k] = 1;
          }
          clock[r] = done;
          res_.end[r][i] = done;
          ++pc[r];
          progress = true;
        }
      }
    }

    std::ostringstream blocked;
    for (int r = 0; r < p; ++r) {
      if (pc[r] == s_.ranks[r].size()) continue;
      res_.blocked_ranks.push_back(r);
      blocked << "\n  " << where(r, int(pc[r])) << " waits for";
      const Action& a = s_.ranks[r][pc[r]];
      for (size_t j = 0; j < a.ops.size(); ++j) {
        const OpRef& peer = partner_[r][pc[r]][j];
        if (posted[peer.rank][peer.action] < 0) blocked << ' ' << where(peer.rank, peer.action);
      }
    }
    if (!res_.blocked_ranks.empty()) {
      fail("deadlock: " + std::to_string(res_.blocked_ranks.size()) + " ranks blocked" +
           blocked.str());
      return;
    }
    for (int r = 0; r < p; ++r)
      for (int k = 0; k < v * m; ++k)
        if (!fwd_done[r][k] || (!s_.forward_only && !bwd_done[r][k]))
          return (void)fail("rank " + std::to_string(r) + " never runs " +
                            (fwd_done[r][k] ? "backward" : "forward") + " of chunk " +
                            std::to_string(k / m) + " microbatch " + std::to_string(k % m));

    res_.finish = clock;
    res_.makespan = *std::max_element(clock.begin(), clock.end());
    double busy = 0.0;
    for (double b : res_.busy) busy += b;
    const double device_time = res_.makespan * p;
    res_.bubble_fraction = busy > 0 ? (device_time - busy) / busy : 0.0;
    res_.idle_fraction = device_time > 0 ? (device_time - busy) / device_time : 0.0;
  }

  const Schedule& s_;
  const SimulationCosts& c_;
  SimulationResult res_;
  std::vector<std::vector<std::vector<OpRef>>> partner_;  // [rank][action][op] -> peer op
};

}  // namespace

SimulationResult simulate(const Schedule& schedule, const SimulationCosts& costs) {
  return Simulator(schedule, costs).run();
}

SimulationResult simulate(const Schedule& schedule, double forward_cost, double backward_cost,
                          double p2p_cost) {
  SimulationCosts costs;
  costs.forward = forward_cost;
  costs.backward = backward_cost;
  costs.p2p = p2p_cost;
  return simulate(schedule, costs);
}

}  // namespace braid::engine
