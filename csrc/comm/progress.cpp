#include "braid/comm/progress.h"

#include <algorithm>

#include "braid/core/error.h"

namespace braid::comm {

ProgressThread::ProgressThread() : thread_([this] { run(); }) {}

ProgressThread::~ProgressThread() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void ProgressThread::watch(const WorkPtr& work, Duration timeout) {
  BRAID_CHECK(work != nullptr, "ProgressThread::watch: no work");
  {
    std::lock_guard<std::mutex> lock(mutex_);
    entries_.push_back(
        Entry{work, std::chrono::steady_clock::now() + timeout, timeout, false, nullptr});
  }
  wake_.notify_all();
}

void ProgressThread::wait(const WorkPtr& work) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto find = [&] {
    return std::find_if(entries_.begin(), entries_.end(),
                        [&](const Entry& e) { return e.work == work; });
  };
  BRAID_CHECK(find() != entries_.end(), "ProgressThread::wait: ", work->info().str(),
              " is not watched (or was waited for already)");
  lock.unlock();
  const WaitSpan span(work->info());
  lock.lock();
  done_.wait(lock, [&] { return find()->done; });
  const auto it = find();
  const std::exception_ptr error = it->error;
  entries_.erase(it);
  if (error) std::rethrow_exception(error);
}

void ProgressThread::run() {
  // Polls every 50 µs while something is pending: each poll lets MPI advance the collectives'
  // rounds; sleeping between polls leaves the cores to the compute threads.
  constexpr auto kPollInterval = std::chrono::microseconds(50);
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    wake_.wait(lock, [&] {
      return stop_ ||
             std::any_of(entries_.begin(), entries_.end(), [](const Entry& e) { return !e.done; });
    });
    if (stop_) return;
    bool completed = false;
    for (Entry& e : entries_) {
      if (e.done) continue;
      try {
        e.done = e.work->is_completed();
      } catch (...) {
        e.error = std::current_exception();
        e.done = true;
      }
      if (e.done) {
        completed = true;
      } else if (std::chrono::steady_clock::now() > e.deadline) {
        abort_job(deadline_message(e.work->info(), e.timeout));
      }
    }
    if (completed) done_.notify_all();
    lock.unlock();
    std::this_thread::sleep_for(kPollInterval);
    lock.lock();
  }
}

}  // namespace braid::comm
