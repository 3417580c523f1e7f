// NcclCommunicator: non-blocking NCCL communicators, collectives on the caller's stream, Works
// that poll a CUDA event and the communicator's asynchronous state against a deadline.
//
// NCCL's non-blocking contract: any call may return ncclInProgress; the operation is issued
// (enqueued on the stream, or the communicator ready) only once ncclCommGetAsyncError stops
// answering ncclInProgress. Until then nothing else may be issued on that communicator, so
// every call settles its communicator before returning (under the communicator's mutex).
// A call's ncclSuccess is not proof of that: ncclCommSplit (2.28) returns ncclSuccess while the
// split still runs on NCCL's thread, the parent still answers ncclInProgress and the child
// handle is written only when it is done. So the communicator's state is always queried.

#include "braid/comm/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "braid/core/cuda_check.h"
#include "braid/core/error.h"

namespace braid::comm {

namespace {

using Clock = std::chrono::steady_clock;

static_assert(sizeof(ncclUniqueId) == NCCL_UNIQUE_ID_BYTES);
static_assert(NCCL_UNIQUE_ID_BYTES % sizeof(int32_t) == 0);

// Makes `device` current for a scope and restores the caller's device; never throws (it is
// used on destruction paths too; a failing cudaSetDevice shows up in the next checked call).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) {
      changed_ = cudaSetDevice(device) == cudaSuccess;
    }
  }
  ~DeviceGuard() {
    if (changed_ && previous_ >= 0) (void)cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
  bool changed_ = false;
};

// Polling: yield for the first millisecond, so that short operations are seen complete at once
// (cudaStreamSynchronize spins too), then sleep 1/32 of the time waited so far (at most 1 ms):
// a long operation is seen complete at most ~3% late, and a stuck one costs little CPU.
class Backoff {
 public:
  void pause() {
    const auto waited = Clock::now() - start_;
    if (waited < std::chrono::milliseconds(1)) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(
        std::min<Clock::duration>(waited / 32, std::chrono::milliseconds(1)));
  }

 private:
  Clock::time_point start_ = Clock::now();
};

Clock::time_point deadline_after(Duration timeout) {
  // A timeout so large that now + timeout overflows means "no deadline".
  if (timeout >= std::chrono::duration_cast<Duration>(Clock::time_point::max() - Clock::now())) {
    return Clock::time_point::max();
  }
  return Clock::now() + timeout;
}

std::string nccl_error(ncclResult_t result, ncclComm_t comm) {
  std::string message = std::string("NCCL error ") + ncclGetErrorString(result);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && last[0] != '\0') message += std::string(" (") + last + ")";
  return message;
}

ncclDataType_t nccl_dtype(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return ncclFloat32;
    case DType::bf16:
      return ncclBfloat16;
    case DType::f16:
      return ncclFloat16;
    case DType::i32:
      return ncclInt32;
    case DType::i64:
      return ncclInt64;
    case DType::u8:
      break;
  }
  BRAID_FAIL("NCCL backend does not support dtype ", dtype_name(dtype));
}

// In a group of one, avg is sum (a copy): NCCL runs a group of one's avg (a pre-multiplied
// sum) with its own one-rank kernel (ncclLaunchOneRank), which never writes the last
// n mod blocks elements when n / blocks is a whole number of 16-byte packs (seen with
// n = 2^20 + 3 in NCCL 2.28: the last 3 elements were left as they were).
ncclRedOp_t nccl_op(ReduceOp op, int group_size) {
  switch (op) {
    case ReduceOp::sum:
      return ncclSum;
    case ReduceOp::avg:
      return group_size == 1 ? ncclSum : ncclAvg;
    case ReduceOp::max:
      return ncclMax;
    case ReduceOp::min:
      return ncclMin;
  }
  BRAID_FAIL("NCCL backend: unknown reduce op ", int(op));
}

cudaStream_t cuda_stream(Stream stream) { return static_cast<cudaStream_t>(stream.handle); }

}  // namespace

// ---- the shared state ----------------------------------------------------------------------

struct NcclCommunicator::State {
  State(int device, std::string name) : device(device), name(std::move(name)) {}
  ~State();
  State(const State&) = delete;
  State& operator=(const State&) = delete;

  // Everything below that touches `comm` holds `mutex`: NCCL calls on one communicator must
  // not overlap, and an abort must not free the handle under another thread's query.
  std::mutex mutex;
  ncclComm_t comm = nullptr;
  bool aborted = false;
  const int device;
  const std::string name;
  Duration finalize_timeout = kDefaultTimeout;
  cudaStream_t barrier_stream = nullptr;  // made on the first barrier
  int32_t* barrier_word = nullptr;

  void check_usable_locked(const OpInfo& info) const {
    BRAID_CHECK(!aborted && comm != nullptr, info.str(), ": the NCCL communicator of group ", name,
                " was aborted after an earlier error or timeout");
  }

  // Waits until `comm`'s state is no longer ncclInProgress (`result` is what the call that
  // started it returned). An error aborts the communicator and throws; the deadline aborts
  // the communicator and ends the job.
  void settle_locked(ncclResult_t result, const OpInfo& info, Clock::time_point deadline,
                     Duration timeout) {
    ncclComm_t target = comm;
    settle_locked(target, result, info, deadline, timeout);
  }
  void settle_locked(ncclComm_t target, ncclResult_t result, const OpInfo& info,
                     Clock::time_point deadline, Duration timeout) {
    if (result != ncclSuccess && result != ncclInProgress) {
      // A call that fails up front (a bad argument) leaves the communicator usable; one whose
      // failure reached the communicator's state does not.
      std::string message = info.str() + ": " + nccl_error(result, target);
      ncclResult_t state = ncclSuccess;
      if (target != nullptr && (ncclCommGetAsyncError(target, &state) != ncclSuccess ||
                                (state != ncclSuccess && state != ncclInProgress))) {
        abort_locked(target);
      }
      BRAID_FAIL(message);
    }
    Backoff backoff;
    for (;;) {  // a query even after ncclSuccess (see the top of the file)
      ncclResult_t query = ncclCommGetAsyncError(target, &result);
      if (query != ncclSuccess) result = query;
      if (result != ncclInProgress) break;
      if (Clock::now() >= deadline) deadline_passed_locked(info, timeout, target);
      backoff.pause();
    }
    if (result != ncclSuccess) {
      std::string message = info.str() + ": " + nccl_error(result, target);
      abort_locked(target);
      BRAID_FAIL(message);
    }
  }

  // Checks the communicator's asynchronous state (errors raised while an operation runs);
  // an error aborts the communicator and throws.
  void check_async_locked(const OpInfo& info) {
    check_usable_locked(info);
    ncclResult_t state = ncclSuccess;
    ncclResult_t query = ncclCommGetAsyncError(comm, &state);
    if (query != ncclSuccess) state = query;
    if (state != ncclSuccess && state != ncclInProgress) {
      std::string message = info.str() + ": " + nccl_error(state, comm);
      abort_locked(comm);
      BRAID_FAIL(message);
    }
  }

  void abort_locked(ncclComm_t target) noexcept {
    if (target == nullptr) return;
    DeviceGuard guard(device);
    (void)ncclCommAbort(target);
    if (target == comm) {
      comm = nullptr;
      aborted = true;
    }
  }

  // The deadline passed: abort NCCL (so that no kernel keeps spinning on the device), then
  // end the job with one line naming the operation. ncclCommAbort itself has been seen to hang
  // when a peer is gone; a watchdog ends the job regardless after 30 s.
  [[noreturn]] void deadline_passed_locked(const OpInfo& info, Duration timeout,
                                           ncclComm_t target) {
    const std::string message = deadline_message(info, timeout);
    try {
      std::thread([message] {
        std::this_thread::sleep_for(std::chrono::seconds(30));
        abort_job(message + " (ncclCommAbort did not return within 30 s)");
      }).detach();
    } catch (...) {
      abort_job(message);  // no thread for the watchdog: skip the abort rather than risk a hang
    }
    abort_locked(target);
    abort_job(message);
  }
};

NcclCommunicator::State::~State() {
  DeviceGuard guard(device);
  if (comm != nullptr && !aborted) {
    // Finalize flushes outstanding work and waits for the peers' side; a peer that is gone
    // would keep it in progress forever, so after the timeout the communicator is aborted.
    ncclResult_t result = ncclCommFinalize(comm);
    const Clock::time_point deadline = deadline_after(finalize_timeout);
    Backoff backoff;
    while (result == ncclInProgress && Clock::now() < deadline) {
      if (ncclCommGetAsyncError(comm, &result) != ncclSuccess) result = ncclInternalError;
      if (result == ncclInProgress) backoff.pause();
    }
    if (result == ncclSuccess) {
      (void)ncclCommDestroy(comm);
    } else {
      (void)ncclCommAbort(comm);
    }
  } else if (comm != nullptr) {
    (void)ncclCommAbort(comm);
  }
  comm = nullptr;
  if (barrier_word != nullptr) (void)cudaFree(barrier_word);
  if (barrier_stream != nullptr) (void)cudaStreamDestroy(barrier_stream);
}

// ---- Work ----------------------------------------------------------------------------------

namespace {

class NcclWork final : public Work {
 public:
  NcclWork(OpInfo info, Duration default_timeout, std::shared_ptr<NcclCommunicator::State> state,
           cudaEvent_t event, std::vector<Tensor> keep)
      : Work(std::move(info), default_timeout),
        state_(std::move(state)),
        event_(event),
        keep_(std::move(keep)) {}

  ~NcclWork() override {
    DeviceGuard guard(state_->device);
    (void)cudaEventDestroy(event_);  // deferred by CUDA until the event has passed
  }

  bool is_completed() override {
    if (done_.load(std::memory_order_acquire)) return true;
    {
      std::lock_guard lock(state_->mutex);
      state_->check_async_locked(info_);
    }
    DeviceGuard guard(state_->device);
    const cudaError_t status = cudaEventQuery(event_);
    if (status == cudaErrorNotReady) {
      (void)cudaGetLastError();  // not an error; keep it from looking like a sticky one
      return false;
    }
    if (status != cudaSuccess) {
      (void)cudaGetLastError();
      BRAID_FAIL(info_.str(), ": CUDA error ", cudaGetErrorName(status), " (",
                 cudaGetErrorString(status), ") while waiting for it");
    }
    done_.store(true, std::memory_order_release);
    return true;
  }

  void wait_for_completion(Duration timeout) override {
    if (done_.load(std::memory_order_acquire)) return;
    const Clock::time_point deadline = deadline_after(timeout);
    Backoff backoff;
    while (!is_completed()) {
      if (Clock::now() >= deadline) {
        std::lock_guard lock(state_->mutex);
        state_->deadline_passed_locked(info_, timeout, state_->comm);
      }
      backoff.pause();
    }
  }

 private:
  std::shared_ptr<NcclCommunicator::State> state_;
  cudaEvent_t event_;
  std::vector<Tensor> keep_;  // the operation's tensors, alive as long as the Work
  std::atomic<bool> done_{false};
};

// Issues `call(comm)` on `stream`, settles the communicator, records the Work's event after
// the operation.
template <typename Call>
WorkPtr issue(const std::shared_ptr<NcclCommunicator::State>& state, OpInfo info, Duration timeout,
              cudaStream_t stream, std::vector<Tensor> keep, Call&& call) {
  DeviceGuard guard(state->device);
  cudaEvent_t event = nullptr;
  CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  try {
    {
      std::lock_guard lock(state->mutex);
      state->check_usable_locked(info);
      const ncclResult_t result = call(state->comm);
      state->settle_locked(result, info, deadline_after(timeout), timeout);
    }
    CUDA_CHECK(cudaEventRecord(event, stream));
  } catch (...) {
    (void)cudaEventDestroy(event);
    throw;
  }
  return std::make_shared<NcclWork>(std::move(info), timeout, state, event, std::move(keep));
}

std::shared_ptr<NcclCommunicator::State> init_state(const ncclUniqueId& id, int rank, int size,
                                                    int cuda_device, const std::string& name,
                                                    Duration timeout) {
  int devices = 0;
  CUDA_CHECK(cudaGetDeviceCount(&devices));
  BRAID_CHECK(cuda_device >= 0 && cuda_device < devices, "NCCL communicator ", name,
              ": CUDA device ", cuda_device, " does not exist (", devices, " visible)");
  BRAID_CHECK(size >= 1 && rank >= 0 && rank < size, "NCCL communicator ", name, ": rank ", rank,
              " of ", size);
  DeviceGuard guard(cuda_device);
  auto state = std::make_shared<NcclCommunicator::State>(cuda_device, name);
  state->finalize_timeout = timeout;
  OpInfo info;
  info.name = "nccl_init";
  info.group = name;
  info.group_size = size;
  info.group_rank = rank;
  info.global_rank = error_rank() >= 0 ? error_rank() : rank;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  config.commName = state->name.c_str();
  std::lock_guard lock(state->mutex);
  const ncclResult_t result = ncclCommInitRankConfig(&state->comm, size, id, rank, &config);
  state->settle_locked(result, info, deadline_after(timeout), timeout);
  return state;
}

}  // namespace

// ---- creation ------------------------------------------------------------------------------

NcclCommunicator::NcclCommunicator(std::shared_ptr<State> state, std::string name, Duration timeout)
    : Communicator(std::move(name), timeout), state_(std::move(state)) {
  cuda_device_ = state_->device;
  std::lock_guard lock(state_->mutex);
  NCCL_CHECK(ncclCommUserRank(state_->comm, &rank_));
  NCCL_CHECK(ncclCommCount(state_->comm, &size_));
}

NcclCommunicator::~NcclCommunicator() {
  std::lock_guard lock(state_->mutex);
  state_->finalize_timeout = timeout();
}

std::string NcclCommunicator::unique_id() {
  ncclUniqueId id;
  NCCL_CHECK(ncclGetUniqueId(&id));
  return std::string(id.internal, sizeof(id.internal));
}

std::shared_ptr<NcclCommunicator> NcclCommunicator::create(const std::string& unique_id, int rank,
                                                           int size, int cuda_device,
                                                           const std::string& name,
                                                           Duration timeout) {
  BRAID_CHECK(unique_id.size() == sizeof(ncclUniqueId), "NCCL communicator ", name,
              ": a unique id has ", sizeof(ncclUniqueId), " bytes, got ", unique_id.size());
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  auto state = init_state(id, rank, size, cuda_device, name, timeout);
  return std::shared_ptr<NcclCommunicator>(new NcclCommunicator(std::move(state), name, timeout));
}

std::shared_ptr<NcclCommunicator> NcclCommunicator::create(Communicator& bootstrap,
                                                           int cuda_device) {
  return create(bootstrap, cuda_device, bootstrap.name(), bootstrap.timeout());
}

std::shared_ptr<NcclCommunicator> NcclCommunicator::create(Communicator& bootstrap, int cuda_device,
                                                           const std::string& name,
                                                           Duration timeout) {
  BRAID_CHECK(bootstrap.device().is_cpu(), "NcclCommunicator::create: the bootstrap of group ",
              name, " must be a CPU communicator, not one on ", bootstrap.device().str());
  // The id travels as i32 words: the dtypes every backend supports.
  Tensor words = Tensor::zeros({int64_t(sizeof(ncclUniqueId) / sizeof(int32_t))}, DType::i32);
  if (bootstrap.rank() == 0) {
    const std::string id = unique_id();
    std::memcpy(words.data(), id.data(), id.size());
  }
  bootstrap.broadcast(words, 0)->wait();
  const std::string id(static_cast<const char*>(words.data()), sizeof(ncclUniqueId));
  return create(id, bootstrap.rank(), bootstrap.size(), cuda_device, name, timeout);
}

ncclComm* NcclCommunicator::handle() const {
  std::lock_guard lock(state_->mutex);
  return state_->comm;
}

// ---- collectives ---------------------------------------------------------------------------

WorkPtr NcclCommunicator::all_reduce(Tensor tensor, ReduceOp op, Stream stream) {
  return all_reduce(tensor, tensor, op, stream);
}

WorkPtr NcclCommunicator::all_reduce(const Tensor& input, Tensor output, ReduceOp op,
                                     Stream stream) {
  check_same("all_reduce", input, output);
  check_reduce("all_reduce", input.dtype(), op);
  BRAID_CHECK(input.numel() == output.numel(), "all_reduce on group ", name(), ": input has ",
              input.numel(), " elements, output ", output.numel());
  const ncclDataType_t dtype = nccl_dtype(input.dtype());
  const ncclRedOp_t redop = nccl_op(op, size());
  const void* send = input.data();
  void* recv = output.data();
  const size_t count = size_t(input.numel());
  return issue(state_, make_info("all_reduce", input.nbytes()), timeout(), cuda_stream(stream),
               {input, output}, [&](ncclComm_t comm) {
                 if (count == 0) return ncclSuccess;  // NCCL: nothing to do, as in MPI
                 return ncclAllReduce(send, recv, count, dtype, redop, comm, cuda_stream(stream));
               });
}

WorkPtr NcclCommunicator::reduce_scatter(const Tensor& input, Tensor output, ReduceOp op,
                                         Stream stream) {
  check_same("reduce_scatter", input, output);
  check_reduce("reduce_scatter", input.dtype(), op);
  BRAID_CHECK(input.numel() == output.numel() * size(), "reduce_scatter on group ", name(),
              ": input has ", input.numel(), " elements, expected size ", size(), " × output ",
              output.numel());
  const ncclDataType_t dtype = nccl_dtype(input.dtype());
  const ncclRedOp_t redop = nccl_op(op, size());
  const void* send = input.data();
  void* recv = output.data();
  const size_t count = size_t(output.numel());
  return issue(state_, make_info("reduce_scatter", input.nbytes()), timeout(), cuda_stream(stream),
               {input, output}, [&](ncclComm_t comm) {
                 if (count == 0) return ncclSuccess;
                 return ncclReduceScatter(send, recv, count, dtype, redop, comm,
                                          cuda_stream(stream));
               });
}

WorkPtr NcclCommunicator::all_gather(const Tensor& input, Tensor output, Stream stream) {
  check_same("all_gather", input, output);
  BRAID_CHECK(output.numel() == input.numel() * size(), "all_gather on group ", name(),
              ": output has ", output.numel(), " elements, expected size ", size(), " × input ",
              input.numel());
  const ncclDataType_t dtype = nccl_dtype(input.dtype());
  const void* send = input.data();
  void* recv = output.data();
  const size_t count = size_t(input.numel());
  return issue(state_, make_info("all_gather", output.nbytes()), timeout(), cuda_stream(stream),
               {input, output}, [&](ncclComm_t comm) {
                 if (count == 0) return ncclSuccess;
                 return ncclAllGather(send, recv, count, dtype, comm, cuda_stream(stream));
               });
}

WorkPtr NcclCommunicator::broadcast(Tensor tensor, int root, Stream stream) {
  check_tensor("broadcast", tensor);
  check_peer("broadcast", root);
  const ncclDataType_t dtype = nccl_dtype(tensor.dtype());
  void* buffer = tensor.data();
  const size_t count = size_t(tensor.numel());
  return issue(state_, make_info("broadcast", tensor.nbytes()), timeout(), cuda_stream(stream),
               {tensor}, [&](ncclComm_t comm) {
                 if (count == 0) return ncclSuccess;
                 return ncclBroadcast(buffer, buffer, count, dtype, root, comm,
                                      cuda_stream(stream));
               });
}

WorkPtr NcclCommunicator::p2p(std::span<const P2POp> ops, Stream stream) {
  size_t bytes = 0;
  std::vector<Tensor> keep;
  keep.reserve(ops.size());
  for (const P2POp& op : ops) {
    check_tensor("p2p", op.tensor);
    check_peer("p2p", op.peer);
    (void)nccl_dtype(op.tensor.dtype());
    bytes += op.tensor.nbytes();
    keep.push_back(op.tensor);
  }
  const char* what = ops.size() == 1 ? (ops[0].kind == P2POp::Kind::send ? "send" : "recv") : "p2p";
  return issue(
      state_, make_info(what, bytes), timeout(), cuda_stream(stream), std::move(keep),
      [&](ncclComm_t comm) {
        if (ops.empty()) return ncclSuccess;
        // The group must be closed whatever happens inside it; its first failure wins.
        ncclResult_t result = ncclGroupStart();
        if (result != ncclSuccess) return result;
        for (const P2POp& op : ops) {
          const size_t count = size_t(op.tensor.numel());
          const ncclDataType_t dtype = nccl_dtype(op.tensor.dtype());
          const ncclResult_t r =
              op.kind == P2POp::Kind::send
                  ? ncclSend(op.tensor.data(), count, dtype, op.peer, comm, cuda_stream(stream))
                  : ncclRecv(op.tensor.data(), count, dtype, op.peer, comm, cuda_stream(stream));
          if (r != ncclSuccess && r != ncclInProgress) {
            result = r;
            break;
          }
        }
        const ncclResult_t end = ncclGroupEnd();
        return result != ncclSuccess ? result : end;
      });
}

WorkPtr NcclCommunicator::barrier() {
  cudaStream_t stream = nullptr;
  int32_t* word = nullptr;
  {
    DeviceGuard guard(state_->device);
    std::lock_guard lock(state_->mutex);
    if (state_->barrier_stream == nullptr) {
      CUDA_CHECK(cudaStreamCreateWithFlags(&state_->barrier_stream, cudaStreamNonBlocking));
      CUDA_CHECK(cudaMalloc(&state_->barrier_word, sizeof(int32_t)));
      CUDA_CHECK(cudaMemsetAsync(state_->barrier_word, 0, sizeof(int32_t), state_->barrier_stream));
    }
    stream = state_->barrier_stream;
    word = state_->barrier_word;
  }
  return issue(state_, make_info("barrier", sizeof(int32_t)), timeout(), stream, {},
               [&](ncclComm_t comm) {
                 return ncclAllReduce(word, word, 1, ncclInt32, ncclSum, comm, stream);
               });
}

std::shared_ptr<Communicator> NcclCommunicator::split(int color, int key, const std::string& name) {
  OpInfo info = make_info("split", 0);
  DeviceGuard guard(state_->device);
  auto child = std::make_shared<State>(state_->device, name);
  child->finalize_timeout = timeout();
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  config.commName = child->name.c_str();
  const Clock::time_point deadline = deadline_after(timeout());
  {
    std::lock_guard lock(state_->mutex);
    state_->check_usable_locked(info);
    ncclComm_t parent = state_->comm;
    const ncclResult_t result =
        ncclCommSplit(parent, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &child->comm, &config);
    if (result != ncclSuccess && result != ncclInProgress) {
      // Failed up front (NCCL has reset the child handle): throws, aborting the parent only
      // if its state shows the failure.
      state_->settle_locked(parent, result, info, deadline, timeout());
    }
    // The parent first: it is busy until the split has been agreed, and only then does NCCL
    // write the child's handle (whatever the call returned). Then the child, until it is ready.
    try {
      state_->settle_locked(parent, ncclInProgress, info, deadline, timeout());
    } catch (...) {
      // The split failed on the parent: a child handle NCCL already wrote is half-built, so
      // abort it here rather than let ~State wait out a finalize on it.
      std::lock_guard child_lock(child->mutex);
      child->abort_locked(child->comm);
      throw;
    }
    std::lock_guard child_lock(child->mutex);
    if (child->comm != nullptr) child->settle_locked(ncclInProgress, info, deadline, timeout());
  }
  if (child->comm == nullptr) return nullptr;
  return std::shared_ptr<NcclCommunicator>(new NcclCommunicator(std::move(child), name, timeout()));
}

}  // namespace braid::comm
