#pragma once
// Pipeline schedules as data, and the simulator that proves and times them.
//
// A Schedule is, for each pipeline rank, the ordered list of what that rank does:
//   forward(chunk, microbatch)   backward(chunk, microbatch)
//   exchange{ops}                sends/receives posted together and waited on together
//                                (Megatron's send_forward_recv_backward & co.)
// The model's layers form pp * v model chunks ("virtual stages"); chunk c of rank r is model
// chunk c * pp + r (Megatron's interleaving). With v == 1 that is just "rank r is stage r".
//
// Point-to-point matching rule (what the executor must keep): between one ordered pair of
// ranks (a -> b), the k-th send posted by a meets the k-th receive posted by b. Inside an
// exchange the ops are listed activations before gradients, sends before receives, and are
// posted in that order, so the rule holds for pp == 2 too, where one peer is both neighbours.
//
// simulate() checks a schedule (every send meets a receive of the same tensor, every forward
// has its input and every backward its output gradient, no deadlock) and times it with
// per-action costs. It never hangs: a schedule that cannot finish is reported with the ranks
// that are blocked and what they wait for.

#include <optional>
#include <string>
#include <vector>

namespace braid::engine {

enum class ActionKind { forward, backward, exchange };
enum class P2PKind { send_activation, recv_activation, send_grad, recv_grad };

const char* to_string(ActionKind kind);
const char* to_string(P2PKind kind);

// One send or receive of an exchange. `chunk` is this rank's chunk the tensor belongs to:
// the chunk that produced it (sends) or the chunk that will consume it (receives).
struct P2POp {
  P2PKind kind = P2PKind::send_activation;
  int microbatch = 0;
  int chunk = 0;
  int peer = 0;  // pipeline rank on the other end
  bool operator==(const P2POp&) const = default;
};

struct Action {
  ActionKind kind = ActionKind::forward;
  int microbatch = -1;     // forward/backward; -1 for an exchange
  int chunk = -1;          // forward/backward: this rank's model chunk (virtual stage)
  std::vector<P2POp> ops;  // exchange only, never empty
  bool operator==(const Action&) const = default;

  static Action forward_step(int chunk, int microbatch);
  static Action backward_step(int chunk, int microbatch);
};

struct Schedule {
  std::string name;  // "gpipe", "1f1b", "interleaved-1f1b", "forward-only"
  int pp = 1;
  int microbatches = 1;
  int virtual_stages = 1;
  std::vector<std::vector<Action>> ranks;  // ranks[r] = rank r's ordered action list
  bool forward_only = false;  // evaluation: forwards without activations kept, no backwards

  int num_model_chunks() const { return pp * virtual_stages; }
  int model_chunk(int rank, int chunk) const { return chunk * pp + rank; }
};

// All forwards, then all backwards (microbatch order), one exchange per tensor.
Schedule make_gpipe(int pp, int microbatches);
// Megatron's forward_backward_pipelining_without_interleaving: rank r runs
// min(pp - r - 1, m) warmup forwards, then one-forward-one-backward, then the cooldown.
Schedule make_1f1b(int pp, int microbatches);
// Megatron's forward_backward_pipelining_with_interleaving (microbatch group size pp):
// warmup 2 (pp - r - 1) + (v - 1) pp forwards (all when that reaches v m), forwards walk
// chunks in groups of pp microbatches, backwards walk them in reverse chunk order.
// v == 1 returns make_1f1b. Rules (ConfigError): v > 1 needs pp > 1 and m % pp == 0.
Schedule make_interleaved_1f1b(int pp, int microbatches, int virtual_stages);

// Evaluation (Megatron's forward_only=True): the forwards of the schedule Megatron would run,
// without backwards - GPipe's forward half for v == 1, the interleaved schedule's all-warmup
// order for v > 1 (same rules) - and forward_only set, so chunks keep no activations and run
// without dropout.
Schedule make_forward_only(int pp, int microbatches, int virtual_stages = 1);

// Warmup forwards of rank `rank` under the interleaved schedule (capped at v * m); the
// number of (chunk, microbatch) activations it holds at most is this + 1 (capped likewise).
int interleaved_warmup_steps(int pp, int microbatches, int virtual_stages, int rank);

// "F3" / "B3" (v == 1) or "F3c1" (v > 1); an exchange reads "[sA3>2 rG1<2]":
// s/r send/recv, A/G activation/gradient, microbatch, c<chunk> when v > 1, >peer / <peer.
std::string to_string(const Action& action, int virtual_stages = 1);
// One rank's list on one line; without exchanges when with_exchanges is false.
std::string format_rank(const Schedule& schedule, int rank, bool with_exchanges = true);

// ---- layer split ----------------------------------------------------------------------------

struct LayerRange {
  int begin = 0;  // [begin, end) in the model's global layer numbering
  int end = 0;
  int size() const { return end - begin; }
  bool operator==(const LayerRange&) const = default;
};

// result[rank][chunk]: the layers of model chunk chunk * pp + rank. Megatron's rule: without
// first/last overrides every chunk gets num_layers / (pp v); with
// --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers the first / last
// rank holds that many (split evenly over its v chunks) and the remaining layers are split
// evenly over the other ranks. model_chunk_layers, when not empty, gives every model chunk's
// count instead (pp · v entries in model-chunk order, summing to num_layers; Megatron's
// --pipeline-model-parallel-layout and --account-for-embedding/loss-in-pipeline-split): the
// first chunk (the embeddings) and the last (the head) may hold none, the others at least one.
// Model chunk k covers the layers right after model chunk k - 1. ConfigError naming the Megatron
// arguments when the layers do not divide.
std::vector<std::vector<LayerRange>> stage_layers(int num_layers, int pp, int virtual_stages,
                                                  std::optional<int> first_stage_layers = {},
                                                  std::optional<int> last_stage_layers = {},
                                                  const std::vector<int>& model_chunk_layers = {});

// ---- simulation -----------------------------------------------------------------------------

// How an exchange completes. rendezvous (NCCL-like, the default and the stricter): every op
// completes once its peer op has been posted, and the exchange when all its ops have.
// eager (buffered sends): sends complete at once; receives when the matching send is posted.
enum class P2PSemantics { rendezvous, eager };

struct SimulationCosts {
  double forward = 1.0;   // per forward of one chunk
  double backward = 2.0;  // per backward of one chunk
  double p2p = 0.0;       // per matched send/recv pair, added after both sides are posted
  // Optional per (rank, chunk) overrides, e.g. from stage_layers (the planner's case):
  // forward_by_chunk[rank][chunk]; empty means use `forward`.
  std::vector<std::vector<double>> forward_by_chunk;
  std::vector<std::vector<double>> backward_by_chunk;
  P2PSemantics semantics = P2PSemantics::rendezvous;
};

struct SimulationResult {
  std::string error;               // empty when the schedule is valid and finishes
  std::vector<int> blocked_ranks;  // on deadlock: the ranks that cannot proceed
  double makespan = 0.0;           // time at which the last rank finishes
  std::vector<double> busy;        // per rank: forward + backward time
  std::vector<double> finish;      // per rank: time its last action completes
  std::vector<int> max_in_flight;  // per rank: most (chunk, microbatch) forwards awaiting backward
  // Narayanan et al. 2021: bubble time / ideal time = (pp * makespan - sum busy) / sum busy.
  // For GPipe and 1F1B with t_f, t_b per microbatch this is (pp - 1) / m.
  double bubble_fraction = 0.0;
  // The share of device time idle: (pp * makespan - sum busy) / (pp * makespan).
  double idle_fraction = 0.0;
  // start[r][i], end[r][i]: when rank r's action i began and completed (an exchange begins
  // when it is posted).
  std::vector<std::vector<double>> start, end;
  // last_backward_start[r][c], last_backward_end[r][c]: when rank r's last backward of chunk c
  // began and ended - the chunk's gradients are complete then (-1: it has no backward, as in a
  // forward-only schedule). The planner times the DP reduction of each chunk from these.
  std::vector<std::vector<double>> last_backward_start, last_backward_end;

  bool ok() const { return error.empty(); }
};

SimulationResult simulate(const Schedule& schedule, const SimulationCosts& costs);
SimulationResult simulate(const Schedule& schedule, double forward_cost = 1.0,
                          double backward_cost = 2.0, double p2p_cost = 0.0);

}  // namespace braid::engine
