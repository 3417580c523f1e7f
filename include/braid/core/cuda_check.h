#pragma once
// CUDA_CHECK / CUBLAS_CHECK / CUDNN_CHECK / NCCL_CHECK: one check per library, each
// reporting the failing statement, the library's own error string, file and line. CUDA's
// sticky launch error is cleared (cudaGetLastError) once it has been reported.
// Include only from CUDA translation units. A library's macro is defined when its header is
// reachable (cublasLt.h, cudnn.h, nccl.h), so core, which links none of them, still builds.

#include <cuda_runtime.h>

#include <string>

#include "braid/core/error.h"

#define CUDA_CHECK(call)                                               \
  do {                                                                 \
    cudaError_t braid_status_ = (call);                                \
    if (braid_status_ != cudaSuccess) [[unlikely]] {                   \
      (void)cudaGetLastError();                                        \
      BRAID_FAIL("CUDA error ", cudaGetErrorName(braid_status_), " (", \
                 cudaGetErrorString(braid_status_), ") in ", #call);   \
    }                                                                  \
  } while (0)

// After a kernel launch: reports a bad configuration or an earlier asynchronous fault.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

// ---- cuBLAS / cuBLASLt (they share cublasStatus_t)
#if __has_include(<cublasLt.h>)
#include <cublasLt.h>

#define CUBLAS_CHECK(call)                                                    \
  do {                                                                        \
    cublasStatus_t braid_status_ = (call);                                    \
    if (braid_status_ != CUBLAS_STATUS_SUCCESS) [[unlikely]] {                \
      BRAID_FAIL("cuBLAS error ", cublasLtGetStatusName(braid_status_), " (", \
                 cublasLtGetStatusString(braid_status_), ") in ", #call);     \
    }                                                                         \
  } while (0)
#endif

// ---- cuDNN: a backend cudnnStatus_t, or the C++ frontend's cudnn_frontend::error_t
#if __has_include(<cudnn.h>)
#include <cudnn.h>

namespace braid::detail {
// Empty when `status` is a success, else what cuDNN says about the failure.
inline std::string cudnn_failure(cudnnStatus_t status) {
  if (status == CUDNN_STATUS_SUCCESS) return {};
  std::string message = cudnnGetErrorString(status);
#if CUDNN_MAJOR >= 9
  char last[512] = {0};
  cudnnGetLastErrorString(last, sizeof(last));
  if (last[0] != '\0') message += std::string(": ") + last;
#endif
  return message;
}
// cudnn_frontend::error_t (is_good(), get_code(), get_message()); a template so that this
// header does not pull in the frontend.
template <typename FrontendError>
std::string cudnn_failure(FrontendError status) {
  if (status.is_good()) return {};
  std::string message = status.get_message();
  return "frontend error code " + std::to_string(int(status.get_code())) +
         (message.empty() ? std::string() : ": " + message);
}
}  // namespace braid::detail

#define CUDNN_CHECK(call)                                                \
  do {                                                                   \
    std::string braid_failure_ = ::braid::detail::cudnn_failure((call)); \
    if (!braid_failure_.empty()) [[unlikely]] {                          \
      BRAID_FAIL("cuDNN error ", braid_failure_, " in ", #call);         \
    }                                                                    \
  } while (0)
#endif

// ---- NCCL. ncclInProgress is not a failure: a non-blocking communicator's call returns it
// while the operation is being set up; its outcome is polled with ncclCommGetAsyncError.
#if __has_include(<nccl.h>)
#include <nccl.h>

#define NCCL_CHECK(call)                                                                        \
  do {                                                                                          \
    ncclResult_t braid_status_ = (call);                                                        \
    if (braid_status_ != ncclSuccess && braid_status_ != ncclInProgress) [[unlikely]] {         \
      const char* braid_last_ = ncclGetLastError(nullptr);                                      \
      BRAID_FAIL("NCCL error ", ncclGetErrorString(braid_status_),                              \
                 (braid_last_ != nullptr && braid_last_[0] != '\0' ? " (" : ""),                \
                 (braid_last_ != nullptr ? braid_last_ : ""),                                   \
                 (braid_last_ != nullptr && braid_last_[0] != '\0' ? ")" : ""), " in ", #call); \
    }                                                                                           \
  } while (0)
#endif
