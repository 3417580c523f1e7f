#include "braid/core/trace.h"

#include <cstdio>
#include <fstream>
#include <map>

#include "braid/core/error.h"
#include "braid/core/json.h"
#include "braid/core/stream.h"

namespace braid {
namespace {

thread_local Trace* current_trace = nullptr;

void append_escaped(std::string& out, const std::string& s) { out += json_quote(s); }

std::string micros(int64_t ns) {  // µs with ns precision: "12.345"
  char buf[32];
  std::snprintf(buf, sizeof buf, "%lld.%03lld", static_cast<long long>(ns / 1000),
                static_cast<long long>((ns < 0 ? -ns : ns) % 1000));
  return buf;
}

// The usual lanes get fixed thread ids so every rank's rows read in the same order.
int lane_id(std::map<std::string, int>& lanes, const std::string& lane) {
  static const std::map<std::string, int> fixed{{"compute", 0}, {"p2p", 1}, {"optimizer", 2}};
  auto it = lanes.find(lane);
  if (it != lanes.end()) return it->second;
  auto f = fixed.find(lane);
  int id = f != fixed.end() ? f->second : 3 + int(lanes.size());
  lanes[lane] = id;
  return id;
}

}  // namespace

Trace* Trace::current() { return current_trace; }

Trace::Recording::Recording(Trace* trace) : previous_(current_trace) { current_trace = trace; }

Trace::Recording::~Recording() { current_trace = previous_; }

void Trace::synchronize() const {
  if (device_.is_cuda()) braid::synchronize(device_);
}

void Trace::end(std::string name, std::string lane, int64_t start_ns, int microbatch, int chunk,
                std::string detail) {
  spans_.push_back({std::move(name), std::move(lane), start_ns, now_ns() - start_ns, microbatch,
                    chunk, std::move(detail)});
}

std::string Trace::to_json() const {
  const std::string pid = std::to_string(rank_);
  std::map<std::string, int> lanes;
  std::string events;
  for (const TraceSpan& s : spans_) {
    const int tid = lane_id(lanes, s.lane);
    events += events.empty() ? "\n" : ",\n";
    events += "{\"ph\":\"X\",\"name\":";
    append_escaped(events, s.name);
    events += ",\"cat\":";
    append_escaped(events, s.lane);
    events += ",\"pid\":" + pid + ",\"tid\":" + std::to_string(tid) +
              ",\"ts\":" + micros(s.start_ns) + ",\"dur\":" + micros(s.dur_ns) + ",\"args\":{";
    std::string args;
    if (s.microbatch >= 0) args += "\"microbatch\":" + std::to_string(s.microbatch);
    if (s.chunk >= 0)
      args += std::string(args.empty() ? "" : ",") + "\"chunk\":" + std::to_string(s.chunk);
    if (!s.detail.empty()) {
      args += std::string(args.empty() ? "" : ",") + "\"detail\":";
      append_escaped(args, s.detail);
    }
    events += args + "}}";
  }
  // Metadata: name the process "rank N" and each lane, so Perfetto labels the rows.
  std::string meta = "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":" + pid +
                     ",\"tid\":0,\"args\":{\"name\":\"rank " + pid + "\"}}";
  meta += ",\n{\"ph\":\"M\",\"name\":\"process_sort_index\",\"pid\":" + pid +
          ",\"tid\":0,\"args\":{\"sort_index\":" + pid + "}}";
  for (const auto& [lane, tid] : lanes) {
    meta += ",\n{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":" + pid +
            ",\"tid\":" + std::to_string(tid) + ",\"args\":{\"name\":";
    append_escaped(meta, lane);
    meta += "}}";
  }
  return "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n" + meta + (events.empty() ? "" : ",") +
         events + "\n]}\n";
}

void Trace::write(const std::string& path) const {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  BRAID_CHECK(out.good(), "trace: cannot open ", path, " for writing");
  out << to_json();
  out.close();
  BRAID_CHECK(!out.fail(), "trace: writing ", path, " failed");
}

}  // namespace braid
