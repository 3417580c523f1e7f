#pragma once
// ProgressThread: drives posted Works to completion from a background thread.
//
// MPI's non-blocking collectives move only while some thread is inside MPI, so a bucket
// all-reduce posted during the backward would otherwise sit idle until the main thread next
// waits. A watched Work is polled (Work::is_completed) by this thread alone until it
// completes; the caller then blocks in wait() on a condition variable, never in MPI. Each
// Work keeps its communicator's deadline: past it the job aborts with the usual one-line
// message (deadline_message), from this thread. NCCL Works complete on the GPU without help;
// watching them is harmless.
//
// Needs MPI_THREAD_MULTIPLE (init_distributed asks for it). One thread per ProgressThread.

#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>

#include "braid/comm/communicator.h"

namespace braid::comm {

class ProgressThread {
 public:
  ProgressThread();
  ~ProgressThread();  // waits for nothing: call wait() on what matters first
  ProgressThread(const ProgressThread&) = delete;
  ProgressThread& operator=(const ProgressThread&) = delete;

  // Hands `work` to the thread. The caller must not call `work`'s methods until wait(work)
  // has returned. `timeout` is its deadline, counted from now.
  void watch(const WorkPtr& work, Duration timeout);
  // Blocks until `work` (watched) has completed; rethrows the Error its completion raised.
  // Recorded like Work::wait on the thread's current Trace (comm::WaitSpan).
  void wait(const WorkPtr& work);

 private:
  struct Entry {
    WorkPtr work;
    std::chrono::steady_clock::time_point deadline;
    Duration timeout;
    bool done = false;
    std::exception_ptr error;
  };
  void run();

  std::mutex mutex_;
  std::condition_variable wake_;  // new work, or stop
  std::condition_variable done_;  // some work completed
  std::deque<Entry> entries_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace braid::comm
