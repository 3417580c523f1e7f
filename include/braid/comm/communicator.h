#pragma once
// Communicator: the collectives and point-to-point calls every parallel dimension uses,
// with one implementation per transport (MPI for CPU tensors, NCCL for CUDA tensors).
//
// Every call is asynchronous and returns a Work. Tensors are treated as flat arrays of
// numel() elements; inputs and outputs of one call share a dtype and a device.
//
// Supported dtypes: f32, bf16, f16, i32, i64. How reductions accumulate:
//   MPI  (CPU):  f32, i32, i64 natively. bf16 and f16 are widened to f32, reduced in f32 by
//                MPI, and rounded back once: the result is the correctly rounded f32 sum.
//   NCCL (CUDA): every dtype natively; bf16/f16 partial sums are rounded to bf16/f16 at each
//                step of NCCL's ring or tree (error grows with the group size), as in PyTorch.
// `avg` is the sum divided by size() and is defined for floating dtypes only.
//
// In-place forms: all_reduce and broadcast work in place on one tensor. reduce_scatter is
// in place when `output` is this rank's slice of `input` (input.narrow(rank·n, n) seen flat);
// all_gather is in place when `input` is this rank's slice of `output`. Both forms are
// supported by both backends.
//
// Deadlines: Work::wait() uses the communicator's timeout (default 10 minutes,
// `--distributed-timeout-minutes`). A wait that passes its deadline does not return: it
// prints one line naming the collective, the group, its size, the byte count and the rank,
// and aborts the whole job (MPI_Abort; NCCL communicators are aborted first), so no process
// is left hanging.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "braid/core/stream.h"
#include "braid/core/tensor.h"
#include "braid/core/trace.h"

namespace braid::comm {

using Duration = std::chrono::milliseconds;
constexpr Duration kDefaultTimeout = std::chrono::minutes(10);

enum class ReduceOp : uint8_t { sum, avg, max, min };
const char* reduce_op_name(ReduceOp op);

// What a Work is doing, for deadline messages, traces and the instrumented communicator.
struct OpInfo {
  std::string name;   // "all_reduce", "reduce_scatter", "all_gather", "broadcast", "p2p", ...
  std::string group;  // the communicator's name, e.g. "world", "tp", "dp"
  int group_size = 0;
  int group_rank = 0;
  int global_rank = 0;
  size_t bytes = 0;         // the size of the larger buffer of the call (nccl-tests' "size")
  std::string str() const;  // "all_reduce on group tp (size 2, rank 1 of the job): 4096 bytes"
};

// The handle of one asynchronous operation.
class Work {
 public:
  virtual ~Work() = default;

  // True when the operation has finished on this rank: CPU outputs may be read, CUDA outputs
  // are complete on the device. Never blocks; throws braid::Error if the operation failed.
  virtual bool is_completed() = 0;

  // Blocks the calling thread until the operation has finished (CUDA: on the device, too).
  // If `timeout` passes first, the job is aborted (see the header comment); a transport
  // error throws braid::Error. Waiting twice is allowed and returns at once. The first wait
  // is a span on lane "comm:<group>" of the thread's current Trace, if any (core/trace.h).
  void wait(Duration timeout);
  void wait() { wait(default_timeout_); }

  const OpInfo& info() const { return info_; }

 protected:
  Work(OpInfo info, Duration default_timeout)
      : info_(std::move(info)), default_timeout_(default_timeout) {}
  // The backend's blocking wait (the contract of wait()).
  virtual void wait_for_completion(Duration timeout) = 0;
  OpInfo info_;
  Duration default_timeout_;

 private:
  std::atomic<bool> waited_{false};
};

using WorkPtr = std::shared_ptr<Work>;

// One side of a batched point-to-point exchange (see Communicator::p2p).
struct P2POp {
  enum class Kind : uint8_t { send, recv };
  Kind kind;
  Tensor tensor;
  int peer;  // rank in this communicator
  static P2POp send(Tensor t, int peer) { return {Kind::send, std::move(t), peer}; }
  static P2POp recv(Tensor t, int peer) { return {Kind::recv, std::move(t), peer}; }
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Device device() const = 0;  // where its tensors must live
  const std::string& name() const { return name_; }
  Duration timeout() const { return timeout_; }
  void set_timeout(Duration timeout);

  // `stream` orders CUDA work (NCCL enqueues on it); the MPI backend ignores it.
  virtual WorkPtr all_reduce(Tensor tensor, ReduceOp op = ReduceOp::sum, Stream stream = {}) = 0;
  virtual WorkPtr all_reduce(const Tensor& input, Tensor output, ReduceOp op = ReduceOp::sum,
                             Stream stream = {}) = 0;
  // input: size()·n elements; output: n elements, this rank's reduced slice.
  virtual WorkPtr reduce_scatter(const Tensor& input, Tensor output, ReduceOp op = ReduceOp::sum,
                                 Stream stream = {}) = 0;
  // input: n elements; output: size()·n elements, rank r's input at [r·n, (r+1)·n).
  virtual WorkPtr all_gather(const Tensor& input, Tensor output, Stream stream = {}) = 0;
  virtual WorkPtr broadcast(Tensor tensor, int root, Stream stream = {}) = 0;
  // Sends and receives posted together as one operation (NCCL: one group), so that
  // neighbours exchanging in both directions cannot deadlock.
  virtual WorkPtr p2p(std::span<const P2POp> ops, Stream stream = {}) = 0;
  WorkPtr send(const Tensor& tensor, int peer, Stream stream = {});
  WorkPtr recv(Tensor tensor, int peer, Stream stream = {});
  virtual WorkPtr barrier() = 0;

  // A sub-communicator of the ranks that pass the same `color`, ordered by `key` (then by
  // rank). Collective over this communicator. color < 0: this rank joins no group and gets
  // nullptr. The child inherits the timeout.
  virtual std::shared_ptr<Communicator> split(int color, int key, const std::string& name) = 0;

 protected:
  Communicator(std::string name, Duration timeout) : name_(std::move(name)), timeout_(timeout) {}
  // Checks shared by both backends; throw braid::Error naming the call and what was wrong.
  void check_tensor(const char* call, const Tensor& t) const;
  void check_reduce(const char* call, DType dtype, ReduceOp op) const;
  void check_same(const char* call, const Tensor& a, const Tensor& b) const;  // dtype, device
  void check_peer(const char* call, int peer) const;
  OpInfo make_info(const char* name, size_t bytes) const;

 private:
  std::string name_;
  Duration timeout_;
};

// Records a blocking wait for `info`'s operation on the thread's current Trace (core/trace.h),
// lane "comm:<group>", from construction to destruction; nothing when no trace is current.
// On CUDA the device's queued work is waited for first, so the span is the wait alone.
class WaitSpan {
 public:
  explicit WaitSpan(const OpInfo& info);
  ~WaitSpan();
  WaitSpan(const WaitSpan&) = delete;
  WaitSpan& operator=(const WaitSpan&) = delete;

 private:
  Trace* trace_;
  std::string name_, lane_, detail_;
  int64_t start_ns_ = 0;
};

// The one line printed when `info` passed its deadline `timeout`.
std::string deadline_message(const OpInfo& info, Duration timeout);

// Prints `message` as one line on stderr and ends the whole job with exit code `exit_code`
// (MPI_Abort on MPI_COMM_WORLD when MPI is up, else this process alone). Used when a deadline
// passes or one rank alone must stop (Ctrl-C on it: 130); callable from any thread.
[[noreturn]] void abort_job(const std::string& message, int exit_code = 1);

}  // namespace braid::comm
