#include "braid/comm/communicator.h"

#include <mpi.h>

#include <cstdio>
#include <cstdlib>

namespace braid::comm {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return "sum";
    case ReduceOp::avg:
      return "avg";
    case ReduceOp::max:
      return "max";
    case ReduceOp::min:
      return "min";
  }
  return "?";
}

std::string OpInfo::str() const {
  return detail::concat(name, " on group '", group, "' (size ", group_size, ", group rank ",
                        group_rank, ", global rank ", global_rank, "), ", bytes, " bytes");
}

void Work::wait(Duration timeout) {
  if (waited_.exchange(true)) return wait_for_completion(timeout);  // recorded the first time
  WaitSpan span(info_);
  wait_for_completion(timeout);
}

WaitSpan::WaitSpan(const OpInfo& info) : trace_(Trace::current()) {
  if (trace_ == nullptr) return;
  name_ = info.name;
  lane_ = "comm:" + info.group;
  detail_ = std::to_string(info.bytes) + " bytes";
  trace_->synchronize();  // CUDA: compute queued before the collective is not the wait
  start_ns_ = trace_->now_ns();
}

WaitSpan::~WaitSpan() {
  if (trace_ == nullptr) return;
  try {
    trace_->end(std::move(name_), std::move(lane_), start_ns_, -1, -1, std::move(detail_));
  } catch (...) {  // a span lost to a failed allocation is not worth ending the job over
  }
}

void Communicator::set_timeout(Duration timeout) {
  BRAID_CONFIG_CHECK(timeout.count() > 0, "communicator '", name_,
                     "': the timeout must be positive, got ", timeout.count(), " ms");
  timeout_ = timeout;
}

void Communicator::check_tensor(const char* call, const Tensor& t) const {
  BRAID_CHECK(t.defined(), name_, ".", call, ": undefined tensor");
  BRAID_CHECK(t.device() == device(), name_, ".", call, ": tensor on ", t.device().str(),
              ", this communicator works on ", device().str());
}

void Communicator::check_reduce(const char* call, DType dtype, ReduceOp op) const {
  BRAID_CHECK(dtype != DType::u8, name_, ".", call,
              ": reductions support f32, bf16, f16, i32 and i64, not u8");
  BRAID_CHECK(op != ReduceOp::avg || is_floating(dtype), name_, ".", call,
              ": avg is defined for floating dtypes only, got ", dtype_name(dtype));
}

void Communicator::check_same(const char* call, const Tensor& a, const Tensor& b) const {
  check_tensor(call, a);
  check_tensor(call, b);
  BRAID_CHECK(a.dtype() == b.dtype(), name_, ".", call, ": input is ", dtype_name(a.dtype()),
              ", output is ", dtype_name(b.dtype()));
}

void Communicator::check_peer(const char* call, int peer) const {
  BRAID_CHECK(peer >= 0 && peer < size(), name_, ".", call, ": peer ", peer,
              " is not a rank of this group of size ", size());
}

OpInfo Communicator::make_info(const char* name, size_t bytes) const {
  return OpInfo{name, name_, size(), rank(), error_rank() >= 0 ? error_rank() : rank(), bytes};
}

WorkPtr Communicator::send(const Tensor& tensor, int peer, Stream stream) {
  P2POp op = P2POp::send(tensor, peer);
  return p2p({&op, 1}, stream);
}

WorkPtr Communicator::recv(Tensor tensor, int peer, Stream stream) {
  P2POp op = P2POp::recv(std::move(tensor), peer);
  return p2p({&op, 1}, stream);
}

std::string deadline_message(const OpInfo& info, Duration timeout) {
  char minutes[32];
  std::snprintf(minutes, sizeof(minutes), "%.2f", double(timeout.count()) / 60000.0);
  return detail::concat("braid: error: ", info.str(), ", did not complete within ", minutes,
                        " min (--distributed-timeout-minutes): a peer rank died, skipped this "
                        "call or is stuck; aborting the job");
}

void abort_job(const std::string& message, int exit_code) {
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::_Exit(exit_code);  // no job to end, or MPI_Abort returned
}

}  // namespace braid::comm
