# braid::blas — OpenBLAS, the CPU GEMM. Found through pkg-config (Debian's libopenblas-dev),
# or, on machines without pkg-config data (a prefix unpacked from Debian's packages, see
# scripts/gpu_check.sh), from OPENBLAS_ROOT.
find_package(PkgConfig QUIET)
if(PkgConfig_FOUND AND NOT OPENBLAS_ROOT)
  pkg_check_modules(OPENBLAS QUIET IMPORTED_TARGET openblas)
endif()
if(OPENBLAS_FOUND)
  add_library(braid::blas ALIAS PkgConfig::OPENBLAS)
else()
  find_path(OPENBLAS_INCLUDE_DIR cblas.h
    HINTS ${OPENBLAS_ROOT}/usr/include/x86_64-linux-gnu/openblas-pthread ${OPENBLAS_ROOT}/include
    PATHS /usr/include/x86_64-linux-gnu/openblas-pthread /usr/include/openblas)
  find_library(OPENBLAS_LIBRARY NAMES openblas
    HINTS ${OPENBLAS_ROOT}/usr/lib/x86_64-linux-gnu/openblas-pthread ${OPENBLAS_ROOT}/lib
    PATHS /usr/lib/x86_64-linux-gnu/openblas-pthread)
  if(NOT OPENBLAS_INCLUDE_DIR OR NOT OPENBLAS_LIBRARY)
    message(FATAL_ERROR "OpenBLAS not found: install libopenblas-dev (scripts/bootstrap.sh does) "
                        "or set OPENBLAS_ROOT to a prefix holding include/cblas.h and lib/libopenblas.so")
  endif()
  add_library(braid_blas INTERFACE)
  target_include_directories(braid_blas SYSTEM INTERFACE ${OPENBLAS_INCLUDE_DIR})
  target_link_libraries(braid_blas INTERFACE ${OPENBLAS_LIBRARY})
  add_library(braid::blas ALIAS braid_blas)
endif()
