#include "braid/comm/mpi_communicator.h"

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "braid/core/log.h"
#include "comm/mpi_check.h"

namespace braid::comm {
namespace {

using Clock = std::chrono::steady_clock;

// One MPI operation: its requests, the buffers they use, and what runs once they complete
// (16-bit results narrowed from their f32 staging, avg's division, in-place copies).
class MpiWork final : public Work {
 public:
  MpiWork(OpInfo info, Duration default_timeout) : Work(std::move(info), default_timeout) {}

  std::vector<MPI_Request> requests;
  std::function<void()> finish;
  std::vector<Tensor> buffers;  // kept alive until the requests complete

  bool is_completed() override {
    std::lock_guard lock(mutex_);
    return test_locked();
  }

  void wait_for_completion(Duration timeout) override {
    const Clock::time_point start = Clock::now();
    const Clock::time_point deadline = start + timeout;
    // MPI progresses inside MPI calls, so the waiting thread polls. Spin briefly for latency,
    // then yield, then sleep, so that oversubscribed ranks leave the cores to their peers.
    while (true) {
      {
        std::lock_guard lock(mutex_);
        if (test_locked()) return;
      }
      const Clock::time_point now = Clock::now();
      if (now >= deadline) abort_job(deadline_message(info(), timeout));
      const auto waited = now - start;
      if (waited < std::chrono::microseconds(50)) continue;
      if (waited < std::chrono::milliseconds(10)) {
        std::this_thread::yield();
      } else if (waited < std::chrono::seconds(1)) {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
  }

 private:
  bool test_locked() {
    if (done_) return true;
    int flag = 1;
    if (!requests.empty()) {
      MPI_CHECK(MPI_Testall(int(requests.size()), requests.data(), &flag, MPI_STATUSES_IGNORE));
    }
    if (!flag) return false;
    if (finish) finish();
    finish = nullptr;
    buffers.clear();
    done_ = true;
    return true;
  }

  std::mutex mutex_;
  bool done_ = false;
};

bool is_16bit_float(DType t) { return t == DType::bf16 || t == DType::f16; }

int mpi_count(const std::string& call, int64_t count) {
  BRAID_CHECK(count <= INT_MAX, call, ": ", count,
              " elements exceed MPI's int count limit; split the tensor");
  return int(count);
}

MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::max:
      return MPI_MAX;
    case ReduceOp::min:
      return MPI_MIN;
    case ReduceOp::sum:
    case ReduceOp::avg:
      return MPI_SUM;
  }
  return MPI_SUM;
}

// 16-bit floats travel through f32 staging buffers: reduced in f32, rounded once.
Tensor widened(const Tensor& t) {
  Tensor out = Tensor::empty({t.numel()}, DType::f32);
  const uint16_t* src = t.data_ptr<uint16_t>();
  float* dst = out.data_ptr<float>();
  const int64_t n = t.numel();
  if (t.dtype() == DType::bf16) {
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_float(src[i]);
  }
  return out;
}

void narrow_into(const Tensor& f32, const Tensor& out) {
  const float* src = f32.data_ptr<float>();
  uint16_t* dst = out.data_ptr<uint16_t>();
  const int64_t n = out.numel();
  if (out.dtype() == DType::bf16) {
    for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = float_to_f16(src[i]);
  }
}

void divide(const Tensor& f32, int by) {
  float* p = f32.data_ptr<float>();
  const float d = float(by);
  for (int64_t i = 0, n = f32.numel(); i < n; ++i) p[i] /= d;
}

const std::byte* bytes_of(const Tensor& t) { return static_cast<const std::byte*>(t.data()); }

bool overlaps(const Tensor& a, const Tensor& b) {
  if (a.storage() != b.storage() || a.nbytes() == 0 || b.nbytes() == 0) return false;
  return bytes_of(a) < bytes_of(b) + b.nbytes() && bytes_of(b) < bytes_of(a) + a.nbytes();
}

// True when `part` is exactly slot `index` of `whole` (the in-place forms); an error when
// the two overlap in any other way.
bool is_slot(const char* call, const Tensor& part, const Tensor& whole, int index) {
  if (!overlaps(part, whole)) return false;
  BRAID_CHECK(bytes_of(part) == bytes_of(whole) + size_t(index) * part.nbytes(), call,
              ": the buffers overlap, but the smaller one is not this rank's slice of the "
              "larger one (the in-place form)");
  return true;
}

std::once_flag g_init_once;

void finalize_mpi() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

}  // namespace

MpiCommunicator::MpiCommunicator(MPI_Comm comm, std::string name, Duration timeout, bool owned)
    : Communicator(std::move(name), timeout), comm_(comm), owned_(owned) {
  MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  MPI_CHECK(MPI_Comm_size(comm_, &size_));
}

MpiCommunicator::~MpiCommunicator() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (owned_ && !finalized && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

std::shared_ptr<MpiCommunicator> MpiCommunicator::world() {
  static std::shared_ptr<MpiCommunicator> world;
  std::call_once(g_init_once, [] {
    int initialized = 0;
    MPI_CHECK(MPI_Initialized(&initialized));
    if (!initialized) {
      int provided = 0;
      MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided));
      std::atexit(finalize_mpi);
      if (provided < MPI_THREAD_MULTIPLE) {
        log::warn("MPI provides thread level ", provided,
                  " (not MPI_THREAD_MULTIPLE): call braid's MPI communicators from one thread");
      }
    }
    MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
    world.reset(new MpiCommunicator(MPI_COMM_WORLD, "world", kDefaultTimeout, false));
    set_error_rank(world->rank());
  });
  return world;
}

bool MpiCommunicator::thread_multiple() {
  int initialized = 0, provided = 0;
  MPI_CHECK(MPI_Initialized(&initialized));
  if (initialized) MPI_CHECK(MPI_Query_thread(&provided));
  return initialized && provided == MPI_THREAD_MULTIPLE;
}

MPI_Datatype MpiCommunicator::datatype(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return MPI_FLOAT;
    case DType::bf16:
    case DType::f16:
      return MPI_UINT16_T;
    case DType::i32:
      return MPI_INT32_T;
    case DType::i64:
      return MPI_INT64_T;
    case DType::u8:
      return MPI_UINT8_T;
  }
  BRAID_FAIL("no MPI datatype for dtype ", int(dtype));
}

WorkPtr MpiCommunicator::all_reduce(Tensor tensor, ReduceOp op, Stream stream) {
  return all_reduce(tensor, tensor, op, stream);
}

WorkPtr MpiCommunicator::all_reduce(const Tensor& input, Tensor output, ReduceOp op, Stream) {
  check_same("all_reduce", input, output);
  check_reduce("all_reduce", input.dtype(), op);
  BRAID_CHECK(input.numel() == output.numel(), name(), ".all_reduce: input has ", input.numel(),
              " elements, output ", output.numel());
  BRAID_CHECK(input.data() == output.data() || !overlaps(input, output), name(),
              ".all_reduce: input and output overlap without being the same buffer");
  const int count = mpi_count(name() + ".all_reduce", input.numel());
  auto work = std::make_shared<MpiWork>(make_info("all_reduce", input.nbytes()), timeout());
  MPI_Request request;
  const int n = size();
  if (is_16bit_float(input.dtype())) {
    Tensor staging = widened(input);
    MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, staging.data(), count, MPI_FLOAT, mpi_op(op), comm_,
                             &request));
    work->finish = [staging, output, op, n] {
      if (op == ReduceOp::avg) divide(staging, n);
      narrow_into(staging, output);
    };
    work->buffers = {staging, output};
  } else {
    const void* send = input.data() == output.data() ? MPI_IN_PLACE : input.data();
    MPI_CHECK(MPI_Iallreduce(send, output.data(), count, datatype(input.dtype()), mpi_op(op), comm_,
                             &request));
    if (op == ReduceOp::avg) work->finish = [output, n] { divide(output, n); };
    work->buffers = {input, output};
  }
  work->requests.push_back(request);
  return work;
}

WorkPtr MpiCommunicator::reduce_scatter(const Tensor& input, Tensor output, ReduceOp op, Stream) {
  check_same("reduce_scatter", input, output);
  check_reduce("reduce_scatter", input.dtype(), op);
  BRAID_CHECK(input.numel() == output.numel() * size(), name(), ".reduce_scatter: input has ",
              input.numel(), " elements, expected size() × output = ", size(), " × ",
              output.numel());
  const bool in_place = is_slot("reduce_scatter", output, input, rank());
  const int count = mpi_count(name() + ".reduce_scatter", output.numel());
  auto work = std::make_shared<MpiWork>(make_info("reduce_scatter", input.nbytes()), timeout());
  MPI_Request request;
  const int n = size();
  if (is_16bit_float(input.dtype())) {
    Tensor staging_in = widened(input);
    Tensor staging_out = Tensor::empty({output.numel()}, DType::f32);
    MPI_CHECK(MPI_Ireduce_scatter_block(staging_in.data(), staging_out.data(), count, MPI_FLOAT,
                                        mpi_op(op), comm_, &request));
    work->finish = [staging_out, output, op, n] {
      if (op == ReduceOp::avg) divide(staging_out, n);
      narrow_into(staging_out, output);
    };
    work->buffers = {staging_in, staging_out, output};
  } else {
    // MPI's in-place form leaves the result at the front of the buffer, not at this rank's
    // slice; receive into a scratch buffer and copy instead.
    Tensor receive = in_place ? Tensor::empty(output.shape(), output.dtype()) : output;
    MPI_CHECK(MPI_Ireduce_scatter_block(input.data(), receive.data(), count,
                                        datatype(input.dtype()), mpi_op(op), comm_, &request));
    work->finish = [receive, output, op, n, in_place] {
      if (op == ReduceOp::avg) divide(receive, n);
      if (in_place) std::memcpy(output.data(), receive.data(), output.nbytes());
    };
    work->buffers = {input, receive, output};
  }
  work->requests.push_back(request);
  return work;
}

WorkPtr MpiCommunicator::all_gather(const Tensor& input, Tensor output, Stream) {
  check_same("all_gather", input, output);
  BRAID_CHECK(output.numel() == input.numel() * size(), name(), ".all_gather: output has ",
              output.numel(), " elements, expected size() × input = ", size(), " × ",
              input.numel());
  const bool in_place = is_slot("all_gather", input, output, rank());
  const int count = mpi_count(name() + ".all_gather", input.numel());
  auto work = std::make_shared<MpiWork>(make_info("all_gather", output.nbytes()), timeout());
  MPI_Request request;
  const MPI_Datatype type = datatype(input.dtype());
  if (in_place) {
    MPI_CHECK(MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, output.data(), count, type, comm_,
                             &request));
  } else {
    MPI_CHECK(
        MPI_Iallgather(input.data(), count, type, output.data(), count, type, comm_, &request));
  }
  work->buffers = {input, output};
  work->requests.push_back(request);
  return work;
}

WorkPtr MpiCommunicator::broadcast(Tensor tensor, int root, Stream) {
  check_tensor("broadcast", tensor);
  check_peer("broadcast", root);
  const int count = mpi_count(name() + ".broadcast", tensor.numel());
  auto work = std::make_shared<MpiWork>(make_info("broadcast", tensor.nbytes()), timeout());
  MPI_Request request;
  MPI_CHECK(MPI_Ibcast(tensor.data(), count, datatype(tensor.dtype()), root, comm_, &request));
  work->buffers = {tensor};
  work->requests.push_back(request);
  return work;
}

WorkPtr MpiCommunicator::p2p(std::span<const P2POp> ops, Stream) {
  size_t bytes = 0;
  for (const P2POp& op : ops) {
    const char* call = op.kind == P2POp::Kind::send ? "send" : "recv";
    check_tensor(call, op.tensor);
    check_peer(call, op.peer);
    bytes += op.tensor.nbytes();
  }
  const char* label =
      ops.size() == 1 ? (ops[0].kind == P2POp::Kind::send ? "send" : "recv") : "p2p";
  auto work = std::make_shared<MpiWork>(make_info(label, bytes), timeout());
  // One tag: MPI keeps messages between two ranks of one communicator in posting order, and
  // the callers (pipeline schedules) post matching sends and receives in the same order.
  constexpr int kTag = 0;
  for (const P2POp& op : ops) {
    const int count = mpi_count(name() + "." + label, op.tensor.numel());
    const MPI_Datatype type = datatype(op.tensor.dtype());
    MPI_Request request;
    if (op.kind == P2POp::Kind::send) {
      MPI_CHECK(MPI_Isend(op.tensor.data(), count, type, op.peer, kTag, comm_, &request));
    } else {
      MPI_CHECK(MPI_Irecv(op.tensor.data(), count, type, op.peer, kTag, comm_, &request));
    }
    work->requests.push_back(request);
    work->buffers.push_back(op.tensor);
  }
  return work;
}

WorkPtr MpiCommunicator::barrier() {
  auto work = std::make_shared<MpiWork>(make_info("barrier", 0), timeout());
  MPI_Request request;
  MPI_CHECK(MPI_Ibarrier(comm_, &request));
  work->requests.push_back(request);
  return work;
}

std::shared_ptr<Communicator> MpiCommunicator::split(int color, int key, const std::string& child) {
  // MPI_Comm_split blocks without a deadline; first make sure every rank has arrived, with
  // one.
  auto arrived = std::make_shared<MpiWork>(make_info("split", 0), timeout());
  MPI_Request request;
  MPI_CHECK(MPI_Ibarrier(comm_, &request));
  arrived->requests.push_back(request);
  arrived->wait();
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_CHECK(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &comm));
  if (comm == MPI_COMM_NULL) return nullptr;
  return std::shared_ptr<MpiCommunicator>(new MpiCommunicator(comm, child, timeout(), true));
}

}  // namespace braid::comm
