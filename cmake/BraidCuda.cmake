# braid::cudnn, braid::nccl (from the CUDA toolkit's folders, or CUDNN_ROOT / NCCL_ROOT),
# and braid::cudnn_frontend (header-only; from the nvidia-cudnn-frontend wheel of the
# project's Python, or CUDNN_FRONTEND_INCLUDE_DIR).
find_path(CUDNN_INCLUDE_DIR cudnn.h HINTS ${CUDNN_ROOT}/include ${CUDAToolkit_INCLUDE_DIRS})
find_library(CUDNN_LIBRARY cudnn HINTS ${CUDNN_ROOT}/lib ${CUDNN_ROOT}/lib64 ${CUDAToolkit_LIBRARY_DIR})
find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${NCCL_ROOT}/include ${CUDAToolkit_INCLUDE_DIRS})
find_library(NCCL_LIBRARY nccl HINTS ${NCCL_ROOT}/lib ${NCCL_ROOT}/lib64 ${CUDAToolkit_LIBRARY_DIR})
foreach(var CUDNN_INCLUDE_DIR CUDNN_LIBRARY NCCL_INCLUDE_DIR NCCL_LIBRARY)
  if(NOT ${var})
    message(FATAL_ERROR "BRAID_CUDA=ON but ${var} was not found (set CUDNN_ROOT / NCCL_ROOT, "
                        "or configure with -DBRAID_CUDA=OFF)")
  endif()
endforeach()
add_library(braid_cudnn INTERFACE)
target_include_directories(braid_cudnn SYSTEM INTERFACE ${CUDNN_INCLUDE_DIR})
target_link_libraries(braid_cudnn INTERFACE ${CUDNN_LIBRARY})
add_library(braid::cudnn ALIAS braid_cudnn)
add_library(braid_nccl INTERFACE)
target_include_directories(braid_nccl SYSTEM INTERFACE ${NCCL_INCLUDE_DIR})
target_link_libraries(braid_nccl INTERFACE ${NCCL_LIBRARY})
add_library(braid::nccl ALIAS braid_nccl)

if(NOT CUDNN_FRONTEND_INCLUDE_DIR AND BRAID_PYTHON_EXECUTABLE)
  execute_process(
    COMMAND ${BRAID_PYTHON_EXECUTABLE} -c "import sysconfig; print(sysconfig.get_paths()['purelib'] + '/include')"
    OUTPUT_VARIABLE _purelib_include OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
endif()
find_path(CUDNN_FRONTEND_INCLUDE_DIR cudnn_frontend.h HINTS ${_purelib_include})
if(NOT CUDNN_FRONTEND_INCLUDE_DIR)
  message(FATAL_ERROR "cudnn_frontend.h not found: pip install nvidia-cudnn-frontend into "
                      "BRAID_PYTHON_EXECUTABLE's environment (scripts/bootstrap.sh does), or set "
                      "CUDNN_FRONTEND_INCLUDE_DIR")
endif()
add_library(braid_cudnn_frontend INTERFACE)
target_include_directories(braid_cudnn_frontend SYSTEM INTERFACE ${CUDNN_FRONTEND_INCLUDE_DIR})
add_library(braid::cudnn_frontend ALIAS braid_cudnn_frontend)
message(STATUS "braid: CUDA ${CUDAToolkit_VERSION}, archs ${CMAKE_CUDA_ARCHITECTURES}, cuDNN frontend ${CUDNN_FRONTEND_INCLUDE_DIR}")
