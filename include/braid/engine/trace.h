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
// Not thread-safe: one Trace per rank, recorded from the thread that runs the schedule.

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace braid::engine {

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

  explicit Trace(int rank = 0) : rank_(rank), origin_(Clock::now()) {}

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
      if (trace_) trace_->end(name_, lane_, start_ns_, microbatch_, chunk_, std::move(detail_));
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
  };

  int rank() const { return rank_; }
  const std::vector<TraceSpan>& spans() const { return spans_; }
  void clear() { spans_.clear(); }

  // The Trace Event Format document: {"traceEvents": [...], "displayTimeUnit": "ms"}.
  std::string to_json() const;
  // Writes to_json() to path; Error when the file cannot be written.
  void write(const std::string& path) const;

 private:
  int rank_;
  Clock::time_point origin_;
  std::vector<TraceSpan> spans_;
};

}  // namespace braid::engine
