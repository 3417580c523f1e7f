// matmul through cuBLASLt, and bias_backward (a deterministic column sum).
//
// braid's matrices are row-major; cuBLAS's are column-major. A row-major [r, c] buffer read
// column-major is its transpose [c, r], so out = op(a) op(b) is computed as
// out^T = op(b)^T op(a)^T: cuBLAS's A is our b, its B is our a, its D is out seen as [N, M]
// with leading dimension N, and the bias (one value per column of out) is a per-row bias of
// D, which is what CUBLASLT_EPILOGUE_BIAS adds.
//
// Descriptors, layouts and the heuristic's algorithm are cached per shape, dtypes, flags and
// pointer alignment; the cuBLASLt handle is per device; the workspace is the stream's
// scratch buffer. f32 inputs compute in full f32 (no TF32: f32 is the reference path).

#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "kernels/cuda/column_reduce.cuh"
#include "kernels/cuda/cuda_ops.h"

namespace braid::ops::cuda {
namespace {

using detail::from_float;
using detail::to_float;

constexpr size_t kMaxWorkspace = size_t(32) << 20;  // what cuBLAS suggests for Hopper

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::f32:
      return CUDA_R_32F;
    case DType::bf16:
      return CUDA_R_16BF;
    case DType::f16:
      return CUDA_R_16F;
    default:
      BRAID_FAIL("matmul: no cuBLAS type for ", dtype_name(t));
  }
}

cublasLtHandle_t lt_handle(int device) {
  static std::mutex mutex;
  static auto* handles = new std::vector<cublasLtHandle_t>();
  std::lock_guard<std::mutex> lock(mutex);
  if (device >= int(handles->size())) handles->resize(size_t(device) + 1, nullptr);
  cublasLtHandle_t& h = (*handles)[size_t(device)];
  if (h == nullptr) CUBLAS_CHECK(cublasLtCreate(&h));  // the caller made `device` current
  return h;
}

// Largest power of two (at most 256) dividing the address.
uint32_t alignment_of(const void* p) {
  uint32_t a = 256;
  while (a > 1 && reinterpret_cast<uintptr_t>(p) % a != 0) a /= 2;
  return a;
}

struct PlanKey {
  int device;
  int64_t m, n, k;
  bool trans_a, trans_b, bias_epilogue;
  DType ab, out, bias;
  uint32_t align_a, align_b, align_out, align_bias;
  auto tie() const {
    return std::tie(device, m, n, k, trans_a, trans_b, bias_epilogue, ab, out, bias, align_a,
                    align_b, align_out, align_bias);
  }
  bool operator<(const PlanKey& o) const { return tie() < o.tie(); }
};

// One cached GEMM: descriptors in cuBLAS's column-major terms, and the chosen algorithm.
// `mutex` guards the bias pointer, which is set on the shared descriptor before each launch.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;
  bool found = false;                             // the heuristic returned an algorithm
  cublasStatus_t status = CUBLAS_STATUS_SUCCESS;  // the heuristic's answer when it did not
  std::mutex mutex;

  ~Plan() {
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

// Builds the plan for `key`; `found` is false when cuBLASLt has no algorithm for it (e.g. a
// bias dtype the epilogue does not take), so that the caller can fall back or report it.
std::unique_ptr<Plan> make_plan(const PlanKey& key, cublasLtHandle_t handle, const void* bias) {
  auto plan = std::make_unique<Plan>();
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t op_a = key.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLAS A is our b
  cublasOperation_t op_b = key.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLAS B is our a
  CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  if (key.bias_epilogue) {
    cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                &epilogue, sizeof(epilogue)));
    if (key.bias != key.out) {  // the default bias type is D's
      int32_t bias_type = int32_t(cuda_type(key.bias));
      CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                  &bias_type, sizeof(bias_type)));
    }
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                &bias, sizeof(bias)));
  }
  // cuBLAS A = b: [K, N] column-major (b row-major [N, K]) if trans_b, else [N, K] (b [K, N]).
  const uint64_t a_rows = key.trans_b ? key.k : key.n, a_cols = key.trans_b ? key.n : key.k;
  // cuBLAS B = a: [M, K] column-major (a row-major [K, M]) if trans_a, else [K, M] (a [M, K]).
  const uint64_t b_rows = key.trans_a ? key.m : key.k, b_cols = key.trans_a ? key.k : key.m;
  CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&plan->a, cuda_type(key.ab), a_rows, a_cols, int64_t(a_rows)));
  CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&plan->b, cuda_type(key.ab), b_rows, b_cols, int64_t(b_rows)));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->d, cuda_type(key.out), uint64_t(key.n),
                                          uint64_t(key.m), key.n));

  cublasLtMatmulPreference_t pref = nullptr;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  auto set_pref = [&](cublasLtMatmulPreferenceAttributes_t attr, const auto& value) {
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)));
  };
  uint64_t max_workspace = kMaxWorkspace;
  set_pref(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, max_workspace);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_b);  // cuBLAS A is our b
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_a);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_out);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_out);
  cublasLtMatmulHeuristicResult_t result{};
  int returned = 0;
  cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      handle, plan->desc, plan->a, plan->b, plan->d, plan->d, pref, 1, &result, &returned);
  cublasLtMatmulPreferenceDestroy(pref);
  if (status == CUBLAS_STATUS_SUCCESS && returned > 0 && result.state == CUBLAS_STATUS_SUCCESS) {
    plan->algo = result.algo;
    plan->workspace = result.workspaceSize;
    plan->found = true;
  } else {
    plan->status = status != CUBLAS_STATUS_SUCCESS ? status : CUBLAS_STATUS_NOT_SUPPORTED;
  }
  return plan;
}

// Plans are kept for the process, up to kMaxPlans: the experts' GEMMs take as many rows as
// their routing gives them, so their shapes are unbounded; past the cap the cache starts
// again (a plan in use stays alive with its caller).
constexpr size_t kMaxPlans = 4096;

std::shared_ptr<Plan> cached_plan(const PlanKey& key, cublasLtHandle_t handle, const void* bias) {
  static std::mutex mutex;
  static auto* plans = new std::map<PlanKey, std::shared_ptr<Plan>>();
  std::lock_guard<std::mutex> lock(mutex);
  auto it = plans->find(key);
  if (it == plans->end()) {
    if (plans->size() >= kMaxPlans) plans->clear();
    it = plans->emplace(key, make_plan(key, handle, bias)).first;
  }
  return it->second;
}

// out[r, c] += bias[c] (the epilogue's fallback) over [rows, n].
template <typename TOut, typename TBias>
__global__ void add_bias_kernel(TOut* __restrict__ out, const TBias* __restrict__ bias,
                                int64_t rows, int64_t n) {
  const int64_t total = rows * n, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    out[i] = from_float<TOut>(to_float(out[i]) + to_float(bias[i % n]));
  }
}

void add_bias(const Tensor& out, const Tensor& bias, int64_t m, int64_t n, cudaStream_t s) {
  constexpr int kThreads = 256;
  unsigned blocks = detail::grid_for(m * n, kThreads, out.device().index);
  detail::dispatch_activation(out.dtype(), "matmul", [&](auto out_tag) {
    using TOut = typename decltype(out_tag)::type;
    detail::dispatch_activation(bias.dtype(), "matmul", [&](auto bias_tag) {
      using TBias = typename decltype(bias_tag)::type;
      add_bias_kernel<<<blocks, kThreads, 0, s>>>(static_cast<TOut*>(out.data()),
                                                  static_cast<const TBias*>(bias.data()), m, n);
      CUDA_CHECK_LAUNCH();
    });
  });
}

// dbias += column sums of dout
template <typename T>
struct BiasGrad {
  const T* dout;
  int64_t n;
  __device__ void operator()(int64_t r, int64_t c, float (&v)[1]) const {
    v[0] = to_float(dout[r * n + c]);
  }
};

}  // namespace

void matmul(Tensor out, const Tensor& a, const Tensor& b, const Tensor& bias, bool trans_a,
            bool trans_b, float alpha, bool accumulate, Stream stream) {
  detail::DeviceGuard guard(out.device());
  cudaStream_t s = detail::cuda_stream(stream);
  const int64_t n = out.size(-1), m = out.numel() / n;
  const int64_t a_cols = a.size(-1), a_rows = a_cols == 0 ? 0 : a.numel() / a_cols;
  const int64_t k = trans_a ? a_rows : a_cols;
  BRAID_CHECK(a.dtype() == b.dtype(), "matmul: a is ", dtype_name(a.dtype()), " but b is ",
              dtype_name(b.dtype()));
  BRAID_CHECK(a.dtype() != DType::f32 || out.dtype() == DType::f32,
              "matmul: f32 inputs need an f32 out, got ", dtype_name(out.dtype()));
  if (k == 0) {  // an empty sum: out = (accumulate ? out : 0) + bias
    if (!accumulate) CUDA_CHECK(cudaMemsetAsync(out.data(), 0, out.nbytes(), s));
    if (bias.defined()) add_bias(out, bias, m, n, s);
    return;
  }

  const int device = out.device().index;
  cublasLtHandle_t handle = lt_handle(device);
  PlanKey key{device,
              m,
              n,
              k,
              trans_a,
              trans_b,
              bias.defined(),
              a.dtype(),
              out.dtype(),
              bias.defined() ? bias.dtype() : out.dtype(),
              alignment_of(a.data()),
              alignment_of(b.data()),
              alignment_of(out.data()),
              bias.defined() ? alignment_of(bias.data()) : 256u};
  std::shared_ptr<Plan> plan = cached_plan(key, handle, bias.defined() ? bias.data() : nullptr);
  bool separate_bias = false;
  if (!plan->found && key.bias_epilogue) {  // no algorithm with the bias epilogue
    key.bias_epilogue = false;
    key.bias = out.dtype();
    key.align_bias = 256;
    plan = cached_plan(key, handle, nullptr);
    separate_bias = true;
  }
  BRAID_CHECK(plan->found, "matmul: cuBLASLt has no algorithm for [", m, ", ", k, "] x [", k, ", ",
              n, "] (", dtype_name(a.dtype()), " -> ", dtype_name(out.dtype()),
              trans_a ? ", a^T" : "", trans_b ? ", b^T" : "",
              "): ", cublasLtGetStatusString(plan->status));

  void* workspace =
      plan->workspace > 0 ? detail::stream_scratch(out.device(), s, plan->workspace) : nullptr;
  const float beta = accumulate ? 1.0f : 0.0f;
  {
    std::lock_guard<std::mutex> lock(plan->mutex);
    if (key.bias_epilogue) {
      const void* bias_ptr = bias.data();
      CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                  &bias_ptr, sizeof(bias_ptr)));
    }
    CUBLAS_CHECK(cublasLtMatmul(handle, plan->desc, &alpha, b.data(), plan->a, a.data(), plan->b,
                                &beta, out.data(), plan->d, out.data(), plan->d, &plan->algo,
                                workspace, plan->workspace, s));
  }
  if (separate_bias) add_bias(out, bias, m, n, s);
}

void bias_backward(Tensor dbias, const Tensor& dout, Stream stream) {
  detail::DeviceGuard guard(dout.device());
  const int64_t n = dout.size(-1), rows = dout.numel() / n;
  cudaStream_t s = detail::cuda_stream(stream);
  detail::dispatch_activation(dout.dtype(), "bias_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    detail::column_sums_add<1>({{dbias.data_ptr<float>()}}, rows, n,
                               BiasGrad<T>{static_cast<const T*>(dout.data()), n}, dout.device(),
                               s);
  });
}

}  // namespace braid::ops::cuda
