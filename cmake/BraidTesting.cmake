# braid_add_test(NAME <name> LABEL <layer> [gpu] SOURCES <files...> [LINK <targets...>])
#   A GoogleTest executable registered as one ctest entry labelled with its layer
#   (core, kernels, model, comm, tp, pp, dp, data, ckpt, cli, planner), and with `gpu` where
#   its cases run on the GPU under BRAID_TEST_DEVICE=cuda (scripts/gpu_check.sh runs those
#   first). LINK: the braid libraries it needs (default: all of braid; a lower layer's tests
#   name only that layer).
# braid_add_pytest(NAME <name> LABEL <layer> [gpu] FILE <tests/python/test_x.py> [TIMEOUT s])
#   A pytest file run by the project's Python with PYTHONPATH=python.
find_package(GTest REQUIRED)
include(GoogleTest)

function(braid_add_test)
  cmake_parse_arguments(T "" "NAME;TIMEOUT" "LABEL;SOURCES;LINK" ${ARGN})
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
  set_tests_properties(${T_NAME} PROPERTIES LABELS "${T_LABEL}" TIMEOUT ${T_TIMEOUT}
    ENVIRONMENT "OMP_NUM_THREADS=2;OMP_WAIT_POLICY=passive;OPENBLAS_NUM_THREADS=1")
endfunction()

function(braid_add_pytest)
  cmake_parse_arguments(T "" "NAME;FILE;TIMEOUT" "LABEL" ${ARGN})
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
  set_tests_properties(${T_NAME} PROPERTIES LABELS "${T_LABEL}" TIMEOUT ${T_TIMEOUT}
    ENVIRONMENT "OMP_NUM_THREADS=2;OMP_WAIT_POLICY=passive;OPENBLAS_NUM_THREADS=1"
    ENVIRONMENT_MODIFICATION "PYTHONPATH=path_list_prepend:${PROJECT_SOURCE_DIR}/python")
endfunction()

# braid_add_mpi_test(NAME <name> LABEL <layer> [gpu] SOURCES <files...> RANKS <n...>
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
  cmake_parse_arguments(T "MAIN" "NAME;TIMEOUT" "LABEL;SOURCES;RANKS;ARGS;LINK" ${ARGN})
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
    set_tests_properties(${T_NAME}_np${n} PROPERTIES LABELS "${T_LABEL}" TIMEOUT ${T_TIMEOUT}
      PROCESSORS ${n}
      ENVIRONMENT "${BRAID_MPI_TEST_ENV}")
  endforeach()
endfunction()

# braid_add_fuzz_test(NAME <name> LABEL <layer> TARGET <fuzzer> SOURCES <files...>
#                     DICT <file> CORPUS <dir> [DEPENDS <headers...>] [INCLUDES <dirs...>])
#   A libFuzzer target (executable <fuzzer>, build target <name>er) built with clang whatever the project's compiler is (libFuzzer needs
#   it), -fsanitize=fuzzer,address,undefined, and a ctest entry running it 5 s from the seed
#   CORPUS (new inputs go to a corpus folder in the build tree; the seeds stay read-only).
#   Skipped, with a message, where clang or libFuzzer is missing.
find_program(BRAID_FUZZ_CXX NAMES clang++ clang++-19 clang++-18 clang++-17 clang++-16 clang++-15
             clang++-14 DOC "clang++ with libFuzzer, for the fuzz targets")
set(BRAID_FUZZ_FLAGS -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined
    -fno-sanitize-recover=all)
function(braid_fuzz_available out)
  if(DEFINED CACHE{BRAID_FUZZ_OK})
    set(${out} ${BRAID_FUZZ_OK} PARENT_SCOPE)
    return()
  endif()
  set(ok FALSE)
  if(BRAID_FUZZ_CXX)
    set(probe ${CMAKE_BINARY_DIR}/fuzz_probe)
    file(WRITE ${probe}.cpp "#include <cstddef>\n#include <cstdint>\nextern \"C\" int "
         "LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return 0; }\n")
    execute_process(COMMAND ${BRAID_FUZZ_CXX} ${BRAID_FUZZ_FLAGS} ${probe}.cpp -o ${probe}
                    RESULT_VARIABLE rc OUTPUT_QUIET ERROR_QUIET)
    if(rc EQUAL 0)
      set(ok TRUE)
    endif()
  endif()
  set(BRAID_FUZZ_OK ${ok} CACHE INTERNAL "clang++ builds libFuzzer targets")
  set(${out} ${ok} PARENT_SCOPE)
endfunction()

function(braid_add_fuzz_test)
  cmake_parse_arguments(F "" "NAME;LABEL;TARGET;DICT;CORPUS" "SOURCES;DEPENDS;INCLUDES" ${ARGN})
  braid_fuzz_available(ok)
  if(NOT ok)
    message(STATUS "${F_NAME}: not registered (no clang++ with libFuzzer; on Debian: apt-get "
                   "install clang libclang-rt-dev)")
    return()
  endif()
  set(includes -I${PROJECT_SOURCE_DIR}/include -I${PROJECT_SOURCE_DIR}/csrc)
  foreach(dir ${F_INCLUDES})
    list(APPEND includes -I${dir})
  endforeach()
  set(exe ${CMAKE_CURRENT_BINARY_DIR}/${F_TARGET})
  add_custom_command(OUTPUT ${exe}
    COMMAND ${BRAID_FUZZ_CXX} ${BRAID_FUZZ_FLAGS} ${includes} ${F_SOURCES} -o ${exe}
    DEPENDS ${F_SOURCES} ${F_DEPENDS}
    COMMENT "Building the fuzz target ${F_TARGET} with ${BRAID_FUZZ_CXX}" VERBATIM)
  add_custom_target(${F_NAME}er ALL DEPENDS ${exe})
  file(MAKE_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR}/${F_TARGET}_corpus)
  add_test(NAME ${F_NAME}
    COMMAND ${exe} -max_total_time=5 -timeout=10 -rss_limit_mb=2048 -dict=${F_DICT}
            -print_final_stats=0 ${CMAKE_CURRENT_BINARY_DIR}/${F_TARGET}_corpus ${F_CORPUS})
  set_tests_properties(${F_NAME} PROPERTIES LABELS ${F_LABEL} TIMEOUT 120)
endfunction()
