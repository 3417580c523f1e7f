#pragma once
// Tensor-parallel tests: moving parameters between the global (unsharded) layout and one TP
// rank's shard, and a communicator that records every call it forwards.

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "braid/comm/communicator.h"
#include "braid/model/gpt_model.h"

namespace braid::tp_testing {

using model::GPTModel;
using model::ParamShard;
using model::ParamSpec;

// Element `j` of this rank's shard (padding rows included) -> its global flat index, or -1
// for vocabulary padding.
inline int64_t global_index(const ParamSpec& spec, const ParamShard& shard, int64_t j) {
  const int64_t local_cols = shard.shape.numel() / shard.shape[0];
  const int64_t row = j / local_cols, col = j % local_cols;
  if (spec.tp_dim == 1) return row * spec.shape[1] + shard.start + col;
  const int64_t global_row = (spec.tp_dim == 0 ? shard.start : 0) + row;
  if (global_row >= spec.shape[0]) return -1;
  return global_row * local_cols + col;
}

// Writes the shard of every parameter from a global f32 vector per parameter.
inline void set_from_global(GPTModel& m, const std::vector<std::vector<float>>& global) {
  const auto& layout = m.layout();
  Tensor host = m.flat_params().to(Device::cpu());
  for (size_t i = 0; i < layout.specs.size(); ++i) {
    float* local = host.data_ptr<float>() + layout.offsets[i];
    for (int64_t j = 0; j < layout.shards[i].shape.numel(); ++j) {
      const int64_t g = global_index(layout.specs[i], layout.shards[i], j);
      if (g >= 0) local[j] = global[i][size_t(g)];
    }
  }
  const_cast<Tensor&>(m.flat_params()).copy_from(host);
}

// The global values of parameter i of `flat` (the model's f32 params or grads), gathered over
// `tp`. Shards held by several ranks (replicated kv heads) must agree; the test checks that
// separately through the replicated comparison.
inline std::vector<float> gather_global(const GPTModel& m, size_t i, const Tensor& flat,
                                        comm::Communicator* tp) {
  const auto& layout = m.layout();
  const ParamSpec& spec = layout.specs[i];
  const ParamShard& shard = layout.shards[i];
  const int64_t n = shard.shape.numel();
  Tensor local = flat.slice(layout.offsets[i], {n});
  const int ranks = tp != nullptr ? tp->size() : 1;
  Tensor all = local.clone();
  if (ranks > 1) {
    all = Tensor::empty({n * ranks}, DType::f32);
    tp->all_gather(local, all)->wait();
  }
  std::vector<float> global(size_t(spec.shape.numel()), 0.0f);
  for (int r = 0; r < ranks; ++r) {
    ParamShard theirs = shard;  // rank r's shard: same shape, its own start
    if (spec.tp_dim >= 0 && ranks > 1) {
      const int64_t width = shard.shape[spec.tp_dim];
      theirs.start = shard.replicas > 1 ? (r / shard.replicas) * width : r * width;
    }
    for (int64_t j = 0; j < n; ++j) {
      const int64_t g = global_index(spec, theirs, j);
      if (g >= 0) global[size_t(g)] = all.data_ptr<float>()[int64_t(r) * n + j];
    }
  }
  return global;
}

struct Batch {
  Tensor ids, targets;
};

inline Batch batch(int64_t b, int64_t s, int64_t vocab, uint64_t seed) {
  Batch out{Tensor::empty({b, s}, DType::i32), Tensor::empty({b, s}, DType::i32)};
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  auto next = [&] {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    return int32_t(x % uint64_t(vocab));
  };
  for (int64_t i = 0; i < b * s; ++i) out.ids.data_ptr<int32_t>()[i] = next();
  for (int64_t i = 0; i < b * s; ++i)
    out.targets.data_ptr<int32_t>()[i] = (i % s == s - 1) ? -1 : out.ids.data_ptr<int32_t>()[i + 1];
  return out;
}

// Non-trivial norms and biases (init makes them 1 and 0), the same global values everywhere.
inline std::vector<std::vector<float>> perturbed(const GPTModel& reference) {
  std::vector<std::vector<float>> global;
  const auto& layout = reference.layout();
  const Tensor flat = reference.flat_params();
  for (size_t i = 0; i < layout.specs.size(); ++i) {
    const int64_t n = layout.specs[i].shape.numel();
    const float* v = flat.data_ptr<float>() + layout.offsets[i];
    std::vector<float> g(v, v + n);
    const std::string& name = layout.specs[i].name;
    if (name.ends_with(".bias") || name.find("norm.weight") != std::string::npos) {
      for (int64_t j = 0; j < n; ++j) g[size_t(j)] += 0.2f * std::sin(float(j + 7 * i));
    }
    global.push_back(std::move(g));
  }
  return global;
}

// Worst |a - b| - rtol |b| over the elements, for a readable failure.
inline double excess(const std::vector<float>& a, const std::vector<float>& b, double atol,
                     double rtol) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, std::abs(double(a[i]) - double(b[i])) - atol - rtol * std::abs(b[i]));
  return worst;
}

// Forwards every call to `inner` and records the collectives: name and bytes (OpInfo's).
class CountingCommunicator : public comm::Communicator {
 public:
  struct Call {
    std::string name;
    size_t bytes;
    bool operator==(const Call&) const = default;
  };
  explicit CountingCommunicator(std::shared_ptr<comm::Communicator> inner)
      : Communicator(inner->name(), inner->timeout()), inner_(std::move(inner)) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  Device device() const override { return inner_->device(); }

  comm::WorkPtr all_reduce(Tensor t, comm::ReduceOp op, Stream s) override {
    return record(inner_->all_reduce(t, op, s));
  }
  comm::WorkPtr all_reduce(const Tensor& in, Tensor out, comm::ReduceOp op, Stream s) override {
    return record(inner_->all_reduce(in, out, op, s));
  }
  comm::WorkPtr reduce_scatter(const Tensor& in, Tensor out, comm::ReduceOp op, Stream s) override {
    return record(inner_->reduce_scatter(in, out, op, s));
  }
  comm::WorkPtr all_gather(const Tensor& in, Tensor out, Stream s) override {
    return record(inner_->all_gather(in, out, s));
  }
  comm::WorkPtr broadcast(Tensor t, int root, Stream s) override {
    return record(inner_->broadcast(t, root, s));
  }
  comm::WorkPtr p2p(std::span<const comm::P2POp> ops, Stream s) override {
    return record(inner_->p2p(ops, s));
  }
  comm::WorkPtr barrier() override { return record(inner_->barrier()); }
  std::shared_ptr<comm::Communicator> split(int color, int key, const std::string& name) override {
    return inner_->split(color, key, name);
  }

  std::vector<Call> calls;

 private:
  comm::WorkPtr record(comm::WorkPtr work) {
    calls.push_back({work->info().name, work->info().bytes});
    return work;
  }
  std::shared_ptr<comm::Communicator> inner_;
};

}  // namespace braid::tp_testing
