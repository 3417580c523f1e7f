// Tracing a pipeline run (core/trace.h): a 2-stage 1F1B run with a Trace writes Chrome
// trace JSON that parses back, holds every forward/backward of the schedule exactly once with
// its microbatch and chunk, never overlaps two compute spans, and orders them as the schedule.

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <variant>

#include "braid/comm/launch.h"
#include "braid/comm/parallel_state.h"
#include "braid/core/trace.h"
#include "braid/engine/pipeline.h"
#include "tp/tp_test_util.h"

using namespace braid;
using namespace braid::model;

namespace {

// A small JSON reader (objects, arrays, strings, numbers, true/false/null): enough to read a
// trace back without trusting the writer's own code.
struct Json {
  std::variant<std::nullptr_t, bool, double, std::string, std::vector<Json>,
               std::map<std::string, Json>>
      v;
  const Json& operator[](const std::string& k) const {
    return std::get<std::map<std::string, Json>>(v).at(k);
  }
  bool has(const std::string& k) const {
    const auto* o = std::get_if<std::map<std::string, Json>>(&v);
    return o && o->count(k);
  }
  const std::vector<Json>& array() const { return std::get<std::vector<Json>>(v); }
  double number() const { return std::get<double>(v); }
  const std::string& str() const { return std::get<std::string>(v); }
};

class JsonParser {
 public:
  explicit JsonParser(std::string text) : s_(std::move(text)) {}
  Json parse() {
    Json j = value();
    ws();
    if (i_ != s_.size()) throw std::runtime_error("json: trailing characters");
    return j;
  }

 private:
  void ws() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
  }
  char peek() {
    ws();
    if (i_ >= s_.size()) throw std::runtime_error("json: unexpected end");
    return s_[i_];
  }
  void expect(char c) {
    if (peek() != c) throw std::runtime_error(std::string("json: expected ") + c);
    ++i_;
  }
  std::string string() {
    expect('"');
    std::string out;
    while (s_.at(i_) != '"') {
      char c = s_[i_++];
      if (c == '\\') {
        c = s_.at(i_++);
        if (c == 'n')
          c = '\n';
        else if (c == 't')
          c = '\t';
        else if (c == 'u') {
          c = char(std::stoi(s_.substr(i_, 4), nullptr, 16));
          i_ += 4;
        }
      }
      out += c;
    }
    ++i_;
    return out;
  }
  Json value() {
    const char c = peek();
    if (c == '{') {
      ++i_;
      std::map<std::string, Json> o;
      if (peek() == '}') return ++i_, Json{o};
      for (;;) {
        std::string k = string();
        expect(':');
        o[k] = value();
        if (peek() == ',') {
          ++i_;
          continue;
        }
        expect('}');
        return Json{o};
      }
    }
    if (c == '[') {
      ++i_;
      std::vector<Json> a;
      if (peek() == ']') return ++i_, Json{a};
      for (;;) {
        a.push_back(value());
        if (peek() == ',') {
          ++i_;
          continue;
        }
        expect(']');
        return Json{a};
      }
    }
    if (c == '"') return Json{string()};
    for (const char* word : {"true", "false", "null"}) {
      if (s_.compare(i_, std::strlen(word), word) == 0) {
        i_ += std::strlen(word);
        if (word[0] == 'n') return Json{nullptr};
        return Json{word[0] == 't'};
      }
    }
    size_t used = 0;
    const double d = std::stod(s_.substr(i_), &used);
    i_ += used;
    return Json{d};
  }
  std::string s_;
  size_t i_ = 0;
};

TransformerConfig tiny() {
  TransformerConfig c = TransformerConfig::preset("gpt2-tiny");
  c.num_layers = 4;
  c.hidden_size = 32;
  c.ffn_hidden_size = 64;
  c.vocab_size = 96;
  c.make_vocab_size_divisible_by = 32;
  c.max_position_embeddings = 16;
  return c;
}

struct Span {
  std::string name;
  int microbatch, chunk;
  double ts, dur;
};

void check_trace(const engine::Schedule& schedule) {
  SCOPED_TRACE(schedule.name);
  std::shared_ptr<comm::MpiCommunicator> world = comm::init_distributed().world;
  comm::ParallelState state(world, {.pp = world->size()});
  const int stage = state.pp_rank(), m = schedule.microbatches;
  const TransformerConfig config = tiny();
  const auto layers =
      engine::stage_layers(int(config.num_layers), schedule.pp, schedule.virtual_stages);
  std::vector<std::unique_ptr<GPTModel>> chunks;
  std::vector<GPTModel*> pointers;
  for (int c = 0; c < schedule.virtual_stages; ++c) {
    const int model_chunk = schedule.model_chunk(stage, c);
    const engine::LayerRange range = layers[size_t(stage)][size_t(c)];
    chunks.push_back(
        std::make_unique<GPTModel>(config, Device::cpu(), 7, TensorParallel{&state.tp(), false},
                                   ModelChunk{range.begin, range.end, model_chunk == 0,
                                              model_chunk == schedule.num_model_chunks() - 1}));
    chunks.back()->set_embedding_group(state.embedding());
    pointers.push_back(chunks.back().get());
  }
  std::vector<Tensor> ids, targets;
  for (int i = 0; i < m; ++i) {
    const tp_testing::Batch b = tp_testing::batch(1, 8, config.vocab_size, 10 + i);
    ids.push_back(b.ids);
    targets.push_back(b.targets);
  }

  Trace trace(world->rank());
  world->barrier()->wait();
  trace.set_origin();
  engine::PipelineExecutor executor(schedule, pointers, state.pp());
  executor.set_trace(&trace);
  executor.run(ids, targets, std::vector<float>(size_t(m), 1.0f / m));

  const auto path = std::filesystem::temp_directory_path() /
                    ("braid_trace_test_" + std::to_string(::getpid()) + "_rank" +
                     std::to_string(world->rank()) + "_" + schedule.name + ".json");
  trace.write(path.string());
  std::stringstream text;
  text << std::ifstream(path).rdbuf();
  std::filesystem::remove(path);
  const Json doc = JsonParser(text.str()).parse();

  std::vector<Span> compute;
  int waits = 0, postings = 0, comm_waits = 0;
  for (const Json& e : doc["traceEvents"].array()) {
    ASSERT_TRUE(e.has("ph") && e.has("pid") && e.has("name"));
    EXPECT_EQ(int(e["pid"].number()), world->rank());
    if (e["ph"].str() != "X") continue;
    const std::string name = e["name"].str();
    const Json& args = e["args"];
    const int mb = args.has("microbatch") ? int(args["microbatch"].number()) : -1;
    const int chunk = args.has("chunk") ? int(args["chunk"].number()) : -1;
    EXPECT_GE(e["dur"].number(), 0.0);
    if (e["cat"].str() == "compute") {
      EXPECT_TRUE(name == "forward" || name == "backward") << name;
      compute.push_back({name, mb, chunk, e["ts"].number(), e["dur"].number()});
    } else if (e["cat"].str().starts_with("comm:")) {
      // The communicator's view of the same waits (the trace is current during run()).
      EXPECT_EQ(e["cat"].str(), "comm:pp");
      EXPECT_TRUE(name == "p2p" || name == "send" || name == "recv") << name;
      ++comm_waits;
    } else {
      EXPECT_EQ(e["cat"].str(), "p2p");
      if (name == "wait") {
        ++waits;
      } else {
        ++postings;
        EXPECT_TRUE(name == "send" || name == "recv" || name == "exchange") << name;
      }
    }
  }

  // The schedule's forwards and backwards, in its order: each exactly once.
  std::vector<Span> want;
  int exchanges = 0;
  for (const engine::Action& a : schedule.ranks[size_t(stage)]) {
    if (a.kind == engine::ActionKind::exchange)
      ++exchanges;
    else
      want.push_back({a.kind == engine::ActionKind::forward ? "forward" : "backward", a.microbatch,
                      a.chunk, 0, 0});
  }
  EXPECT_EQ(waits, exchanges);
  EXPECT_EQ(comm_waits, exchanges);
  EXPECT_EQ(postings, exchanges);
  ASSERT_EQ(compute.size(), want.size());
  std::sort(compute.begin(), compute.end(), [](auto& a, auto& b) { return a.ts < b.ts; });
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(compute[i].name, want[i].name) << "compute span " << i;
    EXPECT_EQ(compute[i].microbatch, want[i].microbatch) << "compute span " << i;
    EXPECT_EQ(compute[i].chunk, want[i].chunk) << "compute span " << i;
    // The file keeps ns as µs with 3 decimals; allow rounding.
    if (i > 0) {
      EXPECT_LE(compute[i - 1].ts + compute[i - 1].dur, compute[i].ts + 2e-3) << i;
    }
  }
  world->barrier()->wait();
}

TEST(PipelineTrace, OneF1BSpansMatchTheSchedule) {
  const int ranks = comm::init_distributed().world->size();
  if (ranks == 1) GTEST_SKIP() << "needs at least 2 ranks";
  check_trace(engine::make_1f1b(ranks, 4));
}

TEST(PipelineTrace, InterleavedSpansMatchTheSchedule) {
  const int ranks = comm::init_distributed().world->size();
  if (ranks == 1) GTEST_SKIP() << "needs at least 2 ranks";
  check_trace(engine::make_interleaved_1f1b(ranks, 4, 2));
}

TEST(PipelineTrace, NoTraceRecordsNothingAndEmptyTraceIsValidJson) {
  Trace trace(3);
  { Trace::Scope none(nullptr, "forward", "compute", 0, 0); }
  EXPECT_TRUE(trace.spans().empty());
  const Json empty = JsonParser(trace.to_json()).parse();
  for (const Json& e : empty["traceEvents"].array()) EXPECT_EQ(e["ph"].str(), "M");
  { Trace::Scope s(&trace, "opt\"imizer", "optimizer", -1, -1, "a\\b\n"); }
  const Json one = JsonParser(trace.to_json()).parse();
  int spans = 0;
  for (const Json& e : one["traceEvents"].array()) {
    if (e["ph"].str() != "X") continue;
    ++spans;
    EXPECT_EQ(e["name"].str(), "opt\"imizer");
    EXPECT_EQ(e["args"]["detail"].str(), "a\\b\n");
    EXPECT_FALSE(e["args"].has("microbatch"));
    EXPECT_EQ(int(e["tid"].number()), 2);
  }
  EXPECT_EQ(spans, 1);
}

}  // namespace
