# braid_add_test(NAME <name> LABEL <layer> SOURCES <files...> [LINK <targets...>])
#   A GoogleTest executable registered as one ctest entry labelled with its layer
#   (core, kernels, model, comm, tp, pp, dp, data, ckpt, cli, planner). LINK: the braid
#   libraries it needs (default: all of braid; a lower layer's tests name only that layer).
# braid_add_pytest(NAME <name> LABEL <layer> FILE <tests/python/test_x.py> [TIMEOUT s])
#   A pytest file run by the project's Python with PYTHONPATH=python.
find_package(GTest REQUIRED)
include(GoogleTest)

function(braid_add_test)
  cmake_parse_arguments(T "" "NAME;LABEL;TIMEOUT" "SOURCES;LINK" ${ARGN})
  if(NOT T_LINK)
    set(T_LINK braid)
  endif()
  add_executable(${T_NAME} ${T_SOURCES})
  target_link_libraries(${T_NAME} PRIVATE ${T_LINK} GTest::gtest GTest::gtest_main)
  target_include_directories(${T_NAME} PRIVATE ${PROJECT_SOURCE_DIR}/tests/cpp)
  target_compile_options(${T_NAME} PRIVATE -Wall -Wextra -Werror)
  add_test(NAME ${T_NAME} COMMAND ${T_NAME})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 600)
  endif()
  set_tests_properties(${T_NAME} PROPERTIES LABELS ${T_LABEL} TIMEOUT ${T_TIMEOUT}
    ENVIRONMENT "OMP_NUM_THREADS=2;OMP_WAIT_POLICY=passive;OPENBLAS_NUM_THREADS=1")
endfunction()

function(braid_add_pytest)
  cmake_parse_arguments(T "" "NAME;LABEL;FILE;TIMEOUT" "" ${ARGN})
  if(NOT BRAID_PYTHON)
    return()
  endif()
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 900)
  endif()
  add_test(NAME ${T_NAME}
    COMMAND ${Python_EXECUTABLE} -m pytest -q -p no:cacheprovider ${PROJECT_SOURCE_DIR}/${T_FILE}
    WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  # PYTHONPATH is prepended to, not replaced: scripts/gpu_check.sh puts carried wheels there.
  set_tests_properties(${T_NAME} PROPERTIES LABELS ${T_LABEL} TIMEOUT ${T_TIMEOUT}
    ENVIRONMENT "OMP_NUM_THREADS=2;OMP_WAIT_POLICY=passive;OPENBLAS_NUM_THREADS=1"
    ENVIRONMENT_MODIFICATION "PYTHONPATH=path_list_prepend:${PROJECT_SOURCE_DIR}/python")
endfunction()

# braid_add_mpi_test(NAME <name> LABEL <layer> SOURCES <files...> RANKS <n...>
#                    [ARGS <args...>] [TIMEOUT s] [MAIN] [LINK <targets...>])
#   One executable, run as a real MPI job for each rank count: ctest entries <name>_np<n>,
#   `mpirun -np <n> --oversubscribe <exe> <args>`, one OpenMP/OpenBLAS thread per rank so
#   oversubscribed jobs do not thrash. With MAIN the sources bring their own main();
#   otherwise tests/cpp/mpi_test_main.cpp runs the GoogleTest cases on every rank.
# The environment of every MPI job in the suite. Under the sanitizers, LeakSanitizer is off for
# them: OpenMPI keeps its runtime's allocations to the end and its libraries unwind without
# frame pointers, so leak reports could not be attributed or suppressed. ASan and UBSan stay
# on; braid's own code is leak-checked by the single-process tests.
set(BRAID_MPI_TEST_ENV "OMP_NUM_THREADS=1;OMP_WAIT_POLICY=passive;OPENBLAS_NUM_THREADS=1;OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1")
if(BRAID_SANITIZE)
  list(APPEND BRAID_MPI_TEST_ENV
       "ASAN_OPTIONS=detect_leaks=0:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1")
endif()

function(braid_add_mpi_test)
  cmake_parse_arguments(T "MAIN" "NAME;LABEL;TIMEOUT" "SOURCES;RANKS;ARGS;LINK" ${ARGN})
  if(NOT T_LINK)
    set(T_LINK braid)
  endif()
  add_executable(${T_NAME} ${T_SOURCES})
  target_link_libraries(${T_NAME} PRIVATE ${T_LINK} GTest::gtest)
  if(NOT T_MAIN)
    target_sources(${T_NAME} PRIVATE ${PROJECT_SOURCE_DIR}/tests/cpp/mpi_test_main.cpp)
  endif()
  target_include_directories(${T_NAME} PRIVATE ${PROJECT_SOURCE_DIR}/tests/cpp)
  target_compile_options(${T_NAME} PRIVATE -Wall -Wextra -Werror)
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 600)
  endif()
  foreach(n ${T_RANKS})
    add_test(NAME ${T_NAME}_np${n}
      COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${n} --oversubscribe
              ${MPIEXEC_PREFLAGS} $<TARGET_FILE:${T_NAME}> ${T_ARGS})
    set_tests_properties(${T_NAME}_np${n} PROPERTIES LABELS ${T_LABEL} TIMEOUT ${T_TIMEOUT}
      PROCESSORS ${n}
      ENVIRONMENT "${BRAID_MPI_TEST_ENV}")
  endforeach()
endfunction()
