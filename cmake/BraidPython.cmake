# braid._C, the pybind11 extension. Built into python/braid/ so that PYTHONPATH=python
# imports the package from the source tree.
if(BRAID_PYTHON_EXECUTABLE)
  set(Python_EXECUTABLE ${BRAID_PYTHON_EXECUTABLE})
  execute_process(COMMAND ${BRAID_PYTHON_EXECUTABLE} -m pybind11 --cmakedir
    OUTPUT_VARIABLE _pybind11_dir OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(_pybind11_dir)
    set(pybind11_DIR ${_pybind11_dir})
  endif()
endif()
find_package(Python 3.9 REQUIRED COMPONENTS Interpreter Development.Module)
set(PYBIND11_FINDPYTHON ON)
find_package(pybind11 CONFIG REQUIRED)
# DLPack's header: Debian's libdlpack-dev, or .deps/ on machines without it (scripts/gpu_check.sh).
find_path(DLPACK_INCLUDE_DIR dlpack/dlpack.h HINTS ${PROJECT_SOURCE_DIR}/.deps/root/usr/include)
if(NOT DLPACK_INCLUDE_DIR)
  message(FATAL_ERROR "dlpack/dlpack.h not found: install libdlpack-dev (scripts/bootstrap.sh does) "
                      "or set DLPACK_INCLUDE_DIR")
endif()
file(GLOB BRAID_PYTHON_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/csrc/python/*.cpp)
pybind11_add_module(_C ${BRAID_PYTHON_SOURCES})
target_link_libraries(_C PRIVATE braid)
target_include_directories(_C SYSTEM PRIVATE ${DLPACK_INCLUDE_DIR})
target_compile_options(_C PRIVATE -Wall -Wextra -Werror)
# Symbols of the static archives linked in stay inside the module. A toolchain that links part
# of libstdc++ statically (seen on the H200 machine's GCC 13) would otherwise export its copy
# of the stream internals, which then mixes with the process's shared libstdc++ (numpy, torch,
# cuDNN load it): formatting any number crashed.
target_link_options(_C PRIVATE -Wl,--exclude-libs,ALL)
if(SKBUILD)
  # `pip install .` (scikit-build-core, pyproject.toml): _C stays in the build folder, is
  # installed into the wheel's braid/, and keeps the run paths of the libraries it links that
  # lie outside the system's folders (CUDA, cuDNN, NCCL); python/braid/ is left alone.
  set_target_properties(_C PROPERTIES INSTALL_RPATH_USE_LINK_PATH TRUE)
  install(TARGETS _C LIBRARY DESTINATION braid COMPONENT python)
else()
  set_target_properties(_C PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${PROJECT_SOURCE_DIR}/python/braid)
endif()
