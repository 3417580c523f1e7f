// Causal GQA attention through cuDNN's graph API (the C++ frontend's sdpa / sdpa_backward).
// Host code only; kept apart from the kernels because the frontend headers are heavy.
//
// braid's q/k/v/out are [B, S, H, D] contiguous; cuDNN wants [B, H, S, D] dims, which we
// give with strides {S*H*D, D, H*D, 1} (no copies). GQA: K and V simply have fewer heads.
// The stats output is cuDNN's natural-log LSE of the scaled scores ([B, H, S, 1] f32),
// which is braid's lse, so it is written in place. A sliding window (keys i - W .. i for query
// i) is cuDNN's diagonal band with left bound W + 1: it keeps the columns with
// column + left_bound > row (cudnn_frontend's sliding_window_mask). Built graphs are cached per
// (device, B, Hq, Hkv, S, D, window, dtype); an unsupported configuration is cached as such.

#include <cudnn_frontend.h>

#include <cmath>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "braid/core/log.h"
#include "kernels/cuda/attention_cudnn.h"
#include "kernels/cuda/common.cuh"

namespace braid::ops::cuda::detail {
namespace {

namespace fe = cudnn_frontend;

enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

struct Shape4 {
  int64_t b, hq, hkv, s, d;
  int64_t window;  // -1: none
  std::vector<int64_t> q_dims() const { return {b, hq, s, d}; }
  std::vector<int64_t> q_strides() const { return {s * hq * d, d, hq * d, 1}; }
  std::vector<int64_t> kv_dims() const { return {b, hkv, s, d}; }
  std::vector<int64_t> kv_strides() const { return {s * hkv * d, d, hkv * d, 1}; }
  std::vector<int64_t> stats_dims() const { return {b, hq, s, 1}; }
  std::vector<int64_t> stats_strides() const { return {hq * s, s, 1, 1}; }
};

struct GraphKey {
  int device;
  bool backward;
  int64_t b, hq, hkv, s, d, window;
  DType dtype;
  bool operator<(const GraphKey& o) const {
    return std::tie(device, backward, b, hq, hkv, s, d, window, dtype) <
           std::tie(o.device, o.backward, o.b, o.hq, o.hkv, o.s, o.d, o.window, o.dtype);
  }
};

struct CachedGraph {
  std::shared_ptr<fe::graph::Graph> graph;  // null: cuDNN does not support the key
  int64_t workspace = 0;
  bool failed = false;  // an execution failed: use braid's kernel from then on (under h.mutex)
};

// One cuDNN handle per device, with a mutex: the handle's stream is set before each
// execution.
struct DeviceHandle {
  cudnnHandle_t handle = nullptr;
  std::mutex mutex;
};

DeviceHandle& device_handle(int device) {
  static std::mutex mutex;
  static auto* handles = new std::map<int, std::unique_ptr<DeviceHandle>>();  // process-long
  std::lock_guard<std::mutex> lock(mutex);
  auto& h = (*handles)[device];
  if (!h) {
    auto created = std::make_unique<DeviceHandle>();
    CUDNN_CHECK(cudnnCreate(&created->handle));  // the caller made `device` current
    h = std::move(created);
  }
  return *h;
}

bool disabled_by_environment() {
  static const bool disabled = [] {
    const char* env = std::getenv("BRAID_CUDNN_ATTENTION");
    return env != nullptr && std::string(env) == "0";
  }();
  return disabled;
}

std::shared_ptr<fe::graph::Graph> new_graph(DType dtype) {
  auto graph = std::make_shared<fe::graph::Graph>();
  graph->set_io_data_type(dtype == DType::bf16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return graph;
}

std::shared_ptr<fe::graph::Tensor_attributes> input(fe::graph::Graph& graph, const char* name,
                                                    int64_t uid, std::vector<int64_t> dims,
                                                    std::vector<int64_t> strides) {
  return graph.tensor(fe::graph::Tensor_attributes()
                          .set_name(name)
                          .set_uid(uid)
                          .set_dim(std::move(dims))
                          .set_stride(std::move(strides)));
}

float attention_scale(int64_t d) { return 1.0f / std::sqrt(float(d)); }

// Builds the forward graph; `reason` says why when it returns null.
std::shared_ptr<fe::graph::Graph> build_forward(const Shape4& m, DType dtype, cudnnHandle_t handle,
                                                std::string& reason) {
  auto graph = new_graph(dtype);
  auto q = input(*graph, "Q", kQ, m.q_dims(), m.q_strides());
  auto k = input(*graph, "K", kK, m.kv_dims(), m.kv_strides());
  auto v = input(*graph, "V", kV, m.kv_dims(), m.kv_strides());
  auto options = fe::graph::SDPA_attributes()
                     .set_name("braid_attention")
                     .set_generate_stats(true)
                     .set_causal_mask(true)
                     .set_attn_scale(attention_scale(m.d));
  if (m.window >= 0) options.set_diagonal_band_left_bound(int(m.window + 1));
  auto [o, stats] = graph->sdpa(q, k, v, options);
  o->set_output(true).set_uid(kO).set_dim(m.q_dims()).set_stride(m.q_strides());
  stats->set_output(true)
      .set_uid(kStats)
      .set_data_type(fe::DataType_t::FLOAT)
      .set_dim(m.stats_dims())
      .set_stride(m.stats_strides());
  fe::error_t status = graph->build(handle, {fe::HeurMode_t::A});
  if (status.is_bad()) {
    reason = status.get_message();
    return nullptr;
  }
  return graph;
}

std::shared_ptr<fe::graph::Graph> build_backward(const Shape4& m, DType dtype, cudnnHandle_t handle,
                                                 bool deterministic, std::string& reason) {
  auto graph = new_graph(dtype);
  auto q = input(*graph, "Q", kQ, m.q_dims(), m.q_strides());
  auto k = input(*graph, "K", kK, m.kv_dims(), m.kv_strides());
  auto v = input(*graph, "V", kV, m.kv_dims(), m.kv_strides());
  auto o = input(*graph, "O", kO, m.q_dims(), m.q_strides());
  auto d_o = input(*graph, "dO", kDO, m.q_dims(), m.q_strides());
  auto stats = input(*graph, "Stats", kStats, m.stats_dims(), m.stats_strides());
  stats->set_data_type(fe::DataType_t::FLOAT);
  auto options = fe::graph::SDPA_backward_attributes()
                     .set_name("braid_attention_backward")
                     .set_causal_mask(true)
                     .set_attn_scale(attention_scale(m.d))
                     .set_deterministic_algorithm(deterministic);
  if (m.window >= 0) options.set_diagonal_band_left_bound(int(m.window + 1));
  auto [dq, dk, dv] = graph->sdpa_backward(q, k, v, o, d_o, stats, options);
  dq->set_output(true).set_uid(kDQ).set_dim(m.q_dims()).set_stride(m.q_strides());
  dk->set_output(true).set_uid(kDK).set_dim(m.kv_dims()).set_stride(m.kv_strides());
  dv->set_output(true).set_uid(kDV).set_dim(m.kv_dims()).set_stride(m.kv_strides());
  fe::error_t status = graph->build(handle, {fe::HeurMode_t::A});
  if (status.is_bad()) {
    reason = status.get_message();
    return nullptr;
  }
  return graph;
}

// The cached graph for `key`, built on first use (under the device handle's lock).
CachedGraph& cached_graph(const GraphKey& key, DeviceHandle& h) {
  static std::mutex mutex;
  static auto* graphs = new std::map<GraphKey, CachedGraph>();  // process-long
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = graphs->find(key);
    if (it != graphs->end()) return it->second;
  }
  const Shape4 m{key.b, key.hq, key.hkv, key.s, key.d, key.window};
  CachedGraph built;
  std::string reason;
  std::unique_lock<std::mutex> handle_lock(h.mutex);  // building uses the handle
  try {
    if (!key.backward) {
      built.graph = build_forward(m, key.dtype, h.handle, reason);
    } else {
      // Deterministic first (bit-exact reruns); cuDNN's atomics-based kernel otherwise.
      built.graph = build_backward(m, key.dtype, h.handle, true, reason);
      if (!built.graph) {
        std::string second;
        built.graph = build_backward(m, key.dtype, h.handle, false, second);
        if (built.graph) {
          log::warn("attention_backward: cuDNN has no deterministic SDPA backward for B=", m.b,
                    " Hq=", m.hq, " Hkv=", m.hkv, " S=", m.s, " D=", m.d, " window=", m.window,
                    " (", reason, "); using its non-deterministic one");
        }
      }
    }
  } catch (const std::exception& e) {  // the frontend throws on a few malformed inputs
    built.graph = nullptr;
    reason = e.what();
  }
  handle_lock.unlock();
  if (built.graph) {
    CUDNN_CHECK(built.graph->get_workspace_size(built.workspace));
  } else {
    log::info(key.backward ? "attention_backward" : "attention_forward",
              ": cuDNN SDPA does not support B=", m.b, " Hq=", m.hq, " Hkv=", m.hkv, " S=", m.s,
              " D=", m.d, " window=", m.window, " ", dtype_name(key.dtype), " (", reason,
              "); using braid's kernel");
  }
  std::lock_guard<std::mutex> lock(mutex);
  return graphs->emplace(key, std::move(built)).first->second;
}

// cuDNN's SDPA takes bf16/f16 with D a multiple of 8 (16-byte rows) up to 256, and assumes
// 16-byte aligned pointers.
bool eligible(const Tensor& q, std::initializer_list<const Tensor*> tensors) {
  if (disabled_by_environment()) return false;
  if (q.dtype() != DType::bf16 && q.dtype() != DType::f16) return false;
  const int64_t d = q.size(3);
  if (d == 0 || d % 8 != 0 || d > 256) return false;
  if (q.numel() == 0) return false;  // e.g. Hq = 0 in a backward: nothing for cuDNN to build
  for (const Tensor* t : tensors)
    if (!aligned16(t->data())) return false;
  return true;
}

// Runs the graph; false (nothing queued) when cuDNN refuses to execute it, which is then
// remembered so that later calls go straight to braid's kernel.
bool execute(CachedGraph& cached, DeviceHandle& h, const Device& device, cudaStream_t stream,
             std::unordered_map<int64_t, void*>& pack, const char* op) {
  void* workspace =
      cached.workspace > 0 ? stream_scratch(device, stream, size_t(cached.workspace)) : nullptr;
  std::lock_guard<std::mutex> lock(h.mutex);
  if (cached.failed) return false;
  CUDNN_CHECK(cudnnSetStream(h.handle, stream));
  fe::error_t status = cached.graph->execute(h.handle, pack, workspace);
  if (status.is_good()) return true;
  (void)cudaGetLastError();  // a failed launch; a sticky fault resurfaces at the next check
  cached.failed = true;
  log::warn(op, ": cuDNN SDPA failed to execute (", status.get_message(),
            "); using braid's kernel");
  return false;
}

}  // namespace

bool cudnn_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                             const Tensor& v, int64_t window, cudaStream_t stream) {
  if (!eligible(q, {&out, &lse, &q, &k, &v})) return false;
  const int device = q.device().index;
  DeviceHandle& h = device_handle(device);
  GraphKey key{device,    false,     q.size(0), q.size(2), k.size(2),
               q.size(1), q.size(3), window,    q.dtype()};
  CachedGraph& cached = cached_graph(key, h);
  if (!cached.graph) return false;
  std::unordered_map<int64_t, void*> pack = {
      {kQ, q.data()}, {kK, k.data()}, {kV, v.data()}, {kO, out.data()}, {kStats, lse.data()}};
  return execute(cached, h, q.device(), stream, pack, "attention_forward");
}

bool cudnn_attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                              const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, int64_t window,
                              cudaStream_t stream) {
  if (!eligible(q, {&dq, &dk, &dv, &dout, &q, &k, &v, &out, &lse})) return false;
  const int device = q.device().index;
  DeviceHandle& h = device_handle(device);
  GraphKey key{device,    true,      q.size(0), q.size(2), k.size(2),
               q.size(1), q.size(3), window,    q.dtype()};
  CachedGraph& cached = cached_graph(key, h);
  if (!cached.graph) return false;
  std::unordered_map<int64_t, void*> pack = {
      {kQ, q.data()},   {kK, k.data()},     {kV, v.data()},
      {kO, out.data()}, {kDO, dout.data()}, {kStats, lse.data()},
      {kDQ, dq.data()}, {kDK, dk.data()},   {kDV, dv.data()}};
  return execute(cached, h, q.device(), stream, pack, "attention_backward");
}

}  // namespace braid::ops::cuda::detail
