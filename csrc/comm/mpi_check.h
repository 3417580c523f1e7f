#pragma once
// MPI_CHECK: every MPI call that can fail (communicators return errors: MPI_ERRORS_RETURN).

#include <mpi.h>

#include <string>

#include "braid/core/error.h"

namespace braid::comm::detail {
inline std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return "error " + std::to_string(code);
  return std::string(text, size_t(length));
}
}  // namespace braid::comm::detail

#define MPI_CHECK(call)                                                                     \
  do {                                                                                      \
    int braid_mpi_status_ = (call);                                                         \
    if (braid_mpi_status_ != MPI_SUCCESS) [[unlikely]]                                      \
      BRAID_FAIL("MPI error (", ::braid::comm::detail::mpi_error_string(braid_mpi_status_), \
                 ") in ", #call);                                                           \
  } while (0)
