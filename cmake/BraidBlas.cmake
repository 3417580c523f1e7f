# braid::blas — OpenBLAS, the CPU GEMM: its headers here, the library loaded at run time
# (csrc/kernels/cpu/openblas.cpp dlopens it, first the file found here, BRAID_OPENBLAS_LIBRARY,
# so that it can choose OpenBLAS's kernels for the CPU before OpenBLAS does). Found through
# pkg-config (Debian's libopenblas-dev), or, on machines without pkg-config data (a prefix
# unpacked from Debian's packages, see scripts/gpu_check.sh), from OPENBLAS_ROOT.
find_package(PkgConfig QUIET)
if(PkgConfig_FOUND AND NOT OPENBLAS_ROOT)
  pkg_check_modules(OPENBLAS QUIET openblas)
endif()
if(OPENBLAS_FOUND)
  set(OPENBLAS_INCLUDE_DIR ${OPENBLAS_INCLUDE_DIRS})
  list(GET OPENBLAS_LINK_LIBRARIES 0 OPENBLAS_LIBRARY)
else()
  find_path(OPENBLAS_INCLUDE_DIR cblas.h
    HINTS ${OPENBLAS_ROOT}/usr/include/x86_64-linux-gnu/openblas-pthread ${OPENBLAS_ROOT}/include
    PATHS /usr/include/x86_64-linux-gnu/openblas-pthread /usr/include/openblas)
  find_library(OPENBLAS_LIBRARY NAMES openblas
    HINTS ${OPENBLAS_ROOT}/usr/lib/x86_64-linux-gnu/openblas-pthread ${OPENBLAS_ROOT}/lib
    PATHS /usr/lib/x86_64-linux-gnu/openblas-pthread)
endif()
if(NOT OPENBLAS_INCLUDE_DIR OR NOT OPENBLAS_LIBRARY)
  message(FATAL_ERROR "OpenBLAS not found: install libopenblas-dev (scripts/bootstrap.sh does) "
                      "or set OPENBLAS_ROOT to a prefix holding include/cblas.h and lib/libopenblas.so")
endif()
set(BRAID_OPENBLAS_LIBRARY ${OPENBLAS_LIBRARY} CACHE INTERNAL "the OpenBLAS braid loads first")
add_library(braid_blas INTERFACE)
target_include_directories(braid_blas SYSTEM INTERFACE ${OPENBLAS_INCLUDE_DIR})
target_link_libraries(braid_blas INTERFACE ${CMAKE_DL_LIBS})
add_library(braid::blas ALIAS braid_blas)
