#pragma once
// CUDA_CHECK / CUBLAS_CHECK / CUDNN_CHECK / NCCL_CHECK: one check per library, each
// reporting the failing statement, the library's own error string, file and line. CUDA's
// sticky launch error is cleared (cudaGetLastError) once it has been reported.
// Include only from CUDA translation units.

#include <cuda_runtime.h>

#include "braid/core/error.h"

#define CUDA_CHECK(call)                                                                 \
  do {                                                                                   \
    cudaError_t braid_status_ = (call);                                                  \
    if (braid_status_ != cudaSuccess) [[unlikely]] {                                     \
      (void)cudaGetLastError();                                                          \
      BRAID_FAIL("CUDA error ", cudaGetErrorName(braid_status_), " (",                   \
                 cudaGetErrorString(braid_status_), ") in ", #call);                     \
    }                                                                                    \
  } while (0)

// After a kernel launch: reports a bad configuration or an earlier asynchronous fault.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())
