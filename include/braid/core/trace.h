#pragma once
// Trace: a per-rank span recorder that writes Chrome's Trace Event Format (JSON), the file
// Perfetto (ui.perfetto.dev) and chrome://tracing open. One complete event ("ph": "X") per
// span, ts/dur in µs since the trace's origin, pid = the rank, tid = the span's lane
// ("compute", "p2p", ...; named by metadata events). tools/plot_schedule.py merges the ranks'
// files into one timeline picture.
//
// Ranks align when they share an origin: take it right after a barrier (set_origin()), so
// every rank's zero is the same instant up to the barrier's skew.
//
// Lanes braid records: "step" (Trainer::train_step), "compute" (forward, backward, optimizer),
// "p2p" (the pipeline's postings and waits, with their microbatch), and "comm:<group>" - every
// wait for a collective or exchange (comm::Work::wait, ProgressThread::wait) made while a
// trace is current on the thread (Recording), on the lane of its group: "comm:tp", "comm:dp",
// "comm:pp", "comm:world", ... That is the time the thread was blocked on communication; the
// pipeline's "p2p" waits show the same waits again from the schedule's side.
//
// On a CUDA device (the constructor's `device`), a Scope synchronizes the device's default
// stream before it ends, and a communication wait before it begins, so that a span times the
// GPU work issued in it, not its launch, and a wait does not include compute still queued
// before the collective (Megatron's timers synchronize the same way). The host then no longer
// runs ahead of the GPU, so a traced step is slower than an untraced one.
//
// Not thread-safe: one Trace per rank, recorded from the thread that runs the schedule.

#include <chrono>
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "braid/core/dtype.h"

namespace braid {

struct TraceSpan {
  std::string name;      // "forward", "backward", "send", "recv", "exchange", "wait", ...
  std::string lane;      // "compute", "p2p", ...
  int64_t start_ns = 0;  // since the origin
  int64_t dur_ns = 0;
  int microbatch = -1;  // -1: none
  int chunk = -1;       // this rank's chunk (virtual stage); -1: none
  std::string detail;   // free text, e.g. an exchange's ops "[sA3>2 rG1<2]"

  int64_t end_ns() const { return start_ns + dur_ns; }
};

class Trace {
 public:
  using Clock = std::chrono::steady_clock;

  explicit Trace(int rank = 0, Device device = Device::cpu())
      : rank_(rank), device_(device), origin_(Clock::now()) {}

  // The trace this thread records communication waits on (null: none).
  static Trace* current();
  // Makes `trace` this thread's current trace for its lifetime (null: none), then restores the
  // one before.
  class Recording {
   public:
    explicit Recording(Trace* trace);
    ~Recording();
    Recording(const Recording&) = delete;
    Recording& operator=(const Recording&) = delete;

   private:
    Trace* previous_;
  };

  // Spans are timed from here on (earlier spans keep their numbers).
  void set_origin(Clock::time_point origin) { origin_ = origin; }
  void set_origin() { origin_ = Clock::now(); }
  int64_t now_ns() const {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - origin_).count();
  }

  // Records a span that began at start_ns (from now_ns()) and ends now.
  void end(std::string name, std::string lane, int64_t start_ns, int microbatch = -1,
           int chunk = -1, std::string detail = {});
  void add(TraceSpan span) { spans_.push_back(std::move(span)); }

  // RAII: records [construction, destruction) on a trace, or nothing when trace is null.
  class Scope {
   public:
    Scope(Trace* trace, const char* name, const char* lane, int microbatch = -1, int chunk = -1,
          std::string detail = {})
        : trace_(trace),
          name_(name),
          lane_(lane),
          microbatch_(microbatch),
          chunk_(chunk),
          detail_(std::move(detail)),
          start_ns_(trace ? trace->now_ns() : 0) {}
    ~Scope() {
      if (trace_ == nullptr) return;
      try {
        // A CUDA error here stays sticky: the next checked CUDA call reports it.
        if (std::uncaught_exceptions() == unwinding_) trace_->synchronize();
        trace_->end(name_, lane_, start_ns_, microbatch_, chunk_, std::move(detail_));
      } catch (...) {
      }
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    Trace* trace_;
    const char* name_;
    const char* lane_;
    int microbatch_, chunk_;
    std::string detail_;
    int64_t start_ns_;
    int unwinding_ = std::uncaught_exceptions();
  };

  int rank() const { return rank_; }
  const Device& device() const { return device_; }
  // Waits for the device's queued work (CUDA; nothing on the CPU).
  void synchronize() const;
  const std::vector<TraceSpan>& spans() const { return spans_; }
  void clear() { spans_.clear(); }

  // The Trace Event Format document: {"traceEvents": [...], "displayTimeUnit": "ms"}.
  std::string to_json() const;
  // Writes to_json() to path; Error when the file cannot be written.
  void write(const std::string& path) const;

 private:
  int rank_;
  Device device_;
  Clock::time_point origin_;
  std::vector<TraceSpan> spans_;
};

}  // namespace braid
