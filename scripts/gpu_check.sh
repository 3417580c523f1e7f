#!/usr/bin/env bash
# scripts/gpu_check.sh OUTDIR — build braid with CUDA (sm_90) into build-gpu/, run the ctest
# entries labelled gpu on the GPU (BRAID_TEST_DEVICE=cuda; the NCCL tests as MPI jobs of one
# rank), then benchmarks/step_bench.py in bf16, comm_bench (NCCL, one rank: braid vs raw NCCL
# calls) and benchmarks/mfu.py (a Llama-style bf16 stack, MFU against 989 TFLOP/s) and one GPU's
# row of benchmarks/scaling.py (pretrain_gpt.py in bf16 with its step timers: the whole training
# script on the GPU), then the rest of the suite with the time left, all inside a time budget
# (default 540 s). Writes into OUTDIR:
#   summary.txt  GPU, toolchain, pass/fail counts, failed tests, the benchmarks' last lines
#   setup.log    unpacking .deps, the carried wheels, configure
#   build.log    the build;  ctest.log  the tests;  bench.log, comm_bench.log, mfu.log,
#                scaling.log  the benchmarks;  module.log  the module check (below)
# Exit status 0 only when the build, the module check, every test that ran and the benchmarks
# passed, and the gpu-labelled tests all ran (the rest may run out of time: CPU CI runs them).
#
# Right after the build, a module check imports braid._C and has it raise a C++ error whose
# message formats a number (AdamWConfig(beta2=1.5) -> ValueError). The first GPU run's module
# died there (std::ostream's number formatting, in _C.so only: the C++ test programs were
# fine); when it fails, the check writes module.log: the compiler's libstdc++, what _C.so
# defines of the C++ library, the same probe with the system's libstdc++ preloaded, and a
# ten-line shared library, built with the same compiler, that formats a number when Python
# loads it. scripts/gpu_recheck.sh runs a subset of this script.
#
# For a machine with one NVIDIA GPU, the CUDA toolkit, CMake, ninja and a Python with PyTorch,
# numpy and pybind11 — and no package registry, OpenBLAS, GoogleTest or DLPack headers.
# What it lacks travels in .deps/, made on a Debian 12 machine by scripts/pack_gpu_deps.sh.
# MPI (braid's comm layer needs it): the machine's own where it has an mpirun, else Debian's
# OpenMPI 4.1 from .deps, relocated with OPAL_PREFIX (needs glibc >= 2.36, as Debian 12's).
#
# Environment:
#   BRAID_GPU_PYTHON             the Python with PyTorch (default python3)
#   BRAID_GPU_CHECK_BUDGET       seconds for the whole check (default 540)
#   BRAID_GPU_CTEST_JOBS         tests run at once (default 6)
#   BRAID_GPU_CMAKE_ARGS         extra configure arguments
#   BRAID_GPU_CHECK_SIMULATE=1   rehearse on a machine without a GPU: the Python is .venv's,
#                                and the system's OpenBLAS, GoogleTest, DLPack and JSON are
#                                hidden from CMake, so that everything must come from .deps/.
#                                The CUDA tests then fail cleanly ("no CUDA device").
#   BRAID_GPU_CARRIED_MPI=1      use .deps' OpenMPI even where the machine has an mpirun
#                                (the default when simulating)
#   BRAID_GPU_BUILD_TARGETS      build only these targets (space-separated; default: all)
#   BRAID_GPU_CHECK_TESTS        run only the ctest entries matching this regex (ctest -R)
#   BRAID_GPU_CHECK_BENCH        which benchmarks run (default "step_bench comm_bench mfu
#                                scaling")
#   BRAID_GPU_COMM_BENCH_ARGS    comm_bench's sizes and rounds (default -b 64K -e 256M -f 4
#                                -n 20 -w 5 -r 3)
#   BRAID_GPU_MFU_ARGS           extra arguments of benchmarks/mfu.py (e.g. --num-layers 4)
#   BRAID_GPU_AFTER_BUILD_S      seconds kept from the build for what follows (default 240),
#   BRAID_GPU_STEP_BENCH_S, BRAID_GPU_COMM_BENCH_S, BRAID_GPU_MFU_S, BRAID_GPU_SCALING_S
#                                and kept from the tests for each benchmark (50, 30, 100, 30)
set -uo pipefail

[ $# -eq 1 ] || { echo "usage: scripts/gpu_check.sh OUTDIR" >&2; exit 2; }
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$1" && out=$(cd "$1" && pwd)
simulate=${BRAID_GPU_CHECK_SIMULATE:-0}
carried_mpi=${BRAID_GPU_CARRIED_MPI:-$simulate}
budget=${BRAID_GPU_CHECK_BUDGET:-540}
ctest_jobs=${BRAID_GPU_CTEST_JOBS:-6}
read -r -a build_targets <<<"${BRAID_GPU_BUILD_TARGETS:-}"
test_regex=${BRAID_GPU_CHECK_TESTS:-}
benches=" ${BRAID_GPU_CHECK_BENCH:-step_bench comm_bench mfu scaling} "
read -r -a comm_bench_args <<<"${BRAID_GPU_COMM_BENCH_ARGS:--b 64K -e 256M -f 4 -n 20 -w 5 -r 3}"
read -r -a mfu_args <<<"${BRAID_GPU_MFU_ARGS:-}"
build=$repo/build-gpu
deps_root=$build/deps-root
site=$build/site
summary=$out/summary.txt
t0=$SECONDS
cd "$repo"

left() { echo $((budget - (SECONDS - t0))); }
say() { printf 'gpu_check: [%3ss] %s\n' "$((SECONDS - t0))" "$*" | tee -a "$out/setup.log"; }
note() { printf '%s\n' "$*" >>"$summary"; }
finish() {  # finish STATUS: closing lines of the summary, then exit
  note "total: $((SECONDS - t0)) s of a $budget s budget"
  note "result: $([ "$1" = 0 ] && echo PASS || echo FAIL)"
  cat "$summary"
  exit "$1"
}
: >"$summary"
: >"$out/setup.log"

if [ "$simulate" = 1 ]; then
  py=${BRAID_GPU_PYTHON:-$repo/.venv/bin/python}
else
  py=${BRAID_GPU_PYTHON:-python3}
fi
py=$("$py" -c 'import sys; print(sys.executable)') || { note "no Python '$py'"; finish 1; }

# ---- the machine ---------------------------------------------------------------------------
gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null |
      head -n 1)
nvcc=$(command -v nvcc || true)
if [ -z "$nvcc" ] && [ -x /usr/local/cuda/bin/nvcc ]; then nvcc=/usr/local/cuda/bin/nvcc; fi
note "braid gpu_check $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo '(no git)')$([ "$simulate" = 1 ] && echo ' (SIMULATED: no GPU expected)')"
note "gpu: ${gpu:-none (nvidia-smi found no GPU)}"
note "nvcc: $([ -n "$nvcc" ] && "$nvcc" --version | grep -o 'release [0-9.]*' || echo 'not found')"
note "cmake: $(cmake --version | head -n 1)"
note "python: $py ($("$py" -c 'import sys; print(sys.version.split()[0])'))"
note "torch: $("$py" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' 2>&1 | tail -n 1)"
mpirun=$(command -v mpirun || true)
note "mpi: $([ -n "$mpirun" ] && "$mpirun" --version 2>/dev/null | head -n 1 || echo 'mpirun not found')"
[ -n "$mpirun" ] || carried_mpi=1
note "glibc: $(ldd --version 2>/dev/null | head -n 1 | grep -o '[0-9.]*$')"
[ -n "$nvcc" ] || { note "error: nvcc not found (PATH, /usr/local/cuda/bin)"; finish 1; }
[ -f .deps/root.tar.xz ] || {
  note "error: .deps/root.tar.xz missing: run scripts/pack_gpu_deps.sh where apt and PyPI work, and carry .deps"
  finish 1
}

# ---- .deps: the prefix and the wheels ----------------------------------------------------------
say "unpack .deps/root.tar.xz"
rm -rf "$deps_root" "$site"
mkdir -p "$deps_root" "$site"
# Python's tarfile, not tar: a minimal image may lack the xz program.
"$py" - .deps/root.tar.xz "$deps_root" <<'EOF' || { note "error: cannot unpack .deps/root.tar.xz"; finish 1; }
import sys, tarfile
with tarfile.open(sys.argv[1]) as tar:
    tar.extractall(sys.argv[2], **({"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}))
EOF

# A carried wheel is installed only where the machine's own version differs from the pin.
mapfile -t wheels < <("$py" - .deps/wheels 2>>"$out/setup.log" <<'EOF'
import importlib.metadata as md, pathlib, sys
for whl in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    name, version = whl.name.split("-")[:2]
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = "none"
    print(f"{name} {have} -> {version}", file=sys.stderr)
    if have != version:
        print(whl)
EOF
)
if [ ${#wheels[@]} -gt 0 ]; then
  say "install ${#wheels[@]} carried wheels into build-gpu/site"
  if ! "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
       "${wheels[@]}" >>"$out/setup.log" 2>&1; then
    note "error: installing the carried wheels failed (setup.log)"; finish 1
  fi
fi
note "carried wheels installed: ${#wheels[@]} ($(for w in "${wheels[@]}"; do basename "$w" | cut -d- -f1-2; done | paste -sd' '))"
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
# Tests use what requirements-test.txt installs, no plugins the machine happens to have.
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1

# OpenBLAS at link and run time; Debian's libgfortran only where the machine has none.
libdir=$deps_root/usr/lib/x86_64-linux-gnu
ld_path=$libdir/openblas-pthread
if ! ldconfig -p 2>/dev/null | grep -q 'libgfortran\.so\.5 '; then ld_path+=:$libdir; fi

# cuDNN and NCCL: the toolkit's or the system's when CMake finds them there, else those of
# the pip wheels beside PyTorch (nvidia-cudnn-*, nvidia-nccl-*), which ship only libX.so.N.
cuda_home=$(dirname "$(dirname "$(readlink -f "$nvcc")")")
purelib=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
lib_args=()
locate() {  # locate VAR HEADER LIB: sets VAR_INCLUDE_DIR / VAR_LIBRARY from the wheels if needed
  local var=$1 header=$2 lib=$3 d inc so
  for d in "$cuda_home/include" "$cuda_home/targets/x86_64-linux/include" /usr/include \
           /usr/include/x86_64-linux-gnu; do
    [ -e "$d/$header" ] && return 0
  done
  inc=$(find "$purelib/nvidia" -path "*/include/$header" 2>/dev/null | head -n 1)
  so=$(find "$purelib/nvidia" -regex ".*/$lib\.so\(\.[0-9]+\)*" 2>/dev/null | sort | head -n 1)
  if [ -n "$inc" ] && [ -n "$so" ]; then
    lib_args+=("-D${var}_INCLUDE_DIR=$(dirname "$inc")" "-D${var}_LIBRARY=$so")
    ld_path+=:$(dirname "$so")
    say "$header from $(dirname "$inc"), $(basename "$so")"
  fi
}
locate CUDNN cudnn.h libcudnn
locate NCCL nccl.h libnccl

# MPI: the carried OpenMPI (Debian's layout under deps-root/usr) where the machine has none.
# OPAL_PREFIX relocates its libdir, plugins, help files and mpicc's wrapper data; its
# sysconfdir (/etc/openmpi) and PMIx's plugin path are absolute, hence the two variables.
# Its libraries come through build-gpu/deps-mpi-lib: OpenMPI's own always, the others
# (libevent, hwloc, UCX, ...) only where the machine has none of that name.
mpi_args=()
if [ "$carried_mpi" = 1 ]; then
  mpi_root=$deps_root/usr
  [ -x "$mpi_root/bin/orterun" ] || {
    note "error: no mpirun here and no OpenMPI in .deps/root.tar.xz: rerun scripts/pack_gpu_deps.sh"
    finish 1
  }
  mpi_lib=$build/deps-mpi-lib
  rm -rf "$mpi_lib" && mkdir -p "$mpi_lib"
  have=$(ldconfig -p 2>/dev/null | awk '{print $1}')
  for so in "$libdir"/lib*.so.* "$deps_root"/lib/x86_64-linux-gnu/lib*.so.*; do
    [ -e "$so" ] || continue
    name=${so##*/}
    case $name in
      libmpi*|libopen-pal.*|libopen-rte.*|libmca_common_*|liboshmem.*|libompitrace.*|libpmix.*) ;;
      *) grep -qxF "$name" <<<"$have" && continue ;;
    esac
    ln -sfn "$so" "$mpi_lib/$name"
  done
  ld_path+=:$mpi_lib
  export OPAL_PREFIX=$mpi_root
  export OMPI_MCA_mca_base_param_files=$deps_root/etc/openmpi/openmpi-mca-params.conf
  export PMIX_MCA_mca_base_component_path=$libdir/pmix2/lib/pmix
  export PATH=$mpi_root/bin:$PATH
  mpirun=$mpi_root/bin/orterun
  mpi_args=(-DMPI_C_COMPILER="$mpi_root/bin/mpicc" -DMPIEXEC_EXECUTABLE="$mpirun")
  say "OpenMPI from .deps (OPAL_PREFIX=$mpi_root; $(ls "$mpi_lib" | wc -l) libraries linked)"
fi
export LD_LIBRARY_PATH=$ld_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if [ "$carried_mpi" = 1 ]; then
  note "mpi used: carried ($("$mpirun" --version 2>&1 | head -n 1), OPAL_PREFIX=$OPAL_PREFIX)"
else
  note "mpi used: the machine's ($mpirun)"
fi

# ---- configure ----------------------------------------------------------------------------------
args=(-G Ninja -S "$repo" -B "$build" -DCMAKE_BUILD_TYPE=Release
      -DBRAID_CUDA=ON -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES=90
      -DBRAID_PYTHON=ON -DBRAID_PYTHON_EXECUTABLE="$py" -DBRAID_TESTS=ON -DBRAID_BENCHMARKS=ON
      -DOPENBLAS_ROOT="$deps_root"
      -DGTest_DIR="$libdir/cmake/GTest"
      -DCMAKE_PREFIX_PATH="$deps_root/usr"
      -DDLPACK_INCLUDE_DIR="$deps_root/usr/include"
      -DCUDNN_FRONTEND_INCLUDE_DIR="$deps_root/opt/cudnn_frontend/include"
      "${lib_args[@]}" "${mpi_args[@]}")
if command -v ccache >/dev/null; then
  for lang in C CXX CUDA; do
    args+=("-DCMAKE_${lang}_COMPILER_LAUNCHER=env;CCACHE_DIR=$HOME/.cache/braid/ccache;CCACHE_BASEDIR=$repo;ccache")
  done
fi
if [ "$simulate" = 1 ]; then
  # Hide what Debian installed here, so that only .deps/ can satisfy these searches.
  args+=("-DCMAKE_IGNORE_PATH=/usr/include;/usr/include/x86_64-linux-gnu/openblas-pthread;/usr/lib/x86_64-linux-gnu/openblas-pthread;/usr/lib/x86_64-linux-gnu/cmake/GTest;/usr/lib/x86_64-linux-gnu/cmake/dlpack;/usr/share/cmake/nlohmann_json")
fi
# shellcheck disable=SC2206  # word splitting of the user's extra arguments is intended
[ -n "${BRAID_GPU_CMAKE_ARGS:-}" ] && args+=(${BRAID_GPU_CMAKE_ARGS})
say "configure build-gpu/ (sm_90)"
rm -f "$build/CMakeCache.txt"
if ! cmake "${args[@]}" >>"$out/setup.log" 2>&1; then
  note "configure: FAILED (setup.log)"
  tail -n 25 "$out/setup.log" | sed 's/^/  | /' >>"$summary"
  finish 1
fi
for var in BRAID_OPENBLAS_LIBRARY GTest_DIR DLPACK_INCLUDE_DIR CUDNN_FRONTEND_INCLUDE_DIR CUDNN_LIBRARY NCCL_LIBRARY \
           MPI_C_COMPILER MPI_mpi_LIBRARY MPIEXEC_EXECUTABLE; do
  note "  $var = $(sed -n "s/^$var:[A-Z]*=//p" "$build/CMakeCache.txt")"
done

# ---- build --------------------------------------------------------------------------------------
# The build may take what the tests and the benchmarks leave over (4 minutes by default).
build_s=$(( $(left) - ${BRAID_GPU_AFTER_BUILD_S:-240} ))
[ "$build_s" -ge 60 ] || { note "error: only $(left) s left before the build"; finish 1; }
say "build (-j$(nproc), $build_s s at most${build_targets[0]:+; targets ${build_targets[*]}})"
tb=$SECONDS
timeout "$build_s" cmake --build "$build" -j "$(nproc)" ${build_targets[0]:+--target "${build_targets[@]}"} \
  >"$out/build.log" 2>&1
rc=$?
if [ $rc -ne 0 ]; then
  note "build: FAILED (rc $rc$([ $rc = 124 ] && echo ', out of time'), build.log) after $((SECONDS - tb)) s"
  sed -n '/^FAILED: /,$p' "$out/build.log" | grep -v '^\[[0-9]*/[0-9]*\] ' | head -n 30 |
    sed 's/^/  | /' >>"$summary"
  finish 1
fi
note "build: ok in $((SECONDS - tb)) s${build_targets[0]:+ (targets: ${build_targets[*]})}"
status=0

# ---- the Python module: a C++ error that formats a number must reach Python as ValueError ----
module_probe='import braid
try:
    braid.AdamWConfig(beta2=1.5)
except ValueError as e:
    print("module check: ValueError:", str(e).splitlines()[0][:100])'
module_so=$(ls "$repo"/python/braid/_C.*.so 2>/dev/null | head -n 1)
cxx=$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$build/CMakeCache.txt")
note "c++: $cxx ($("$cxx" --version | head -n 1)); its libstdc++.so: $("$cxx" -print-file-name=libstdc++.so)"
module_check() {  # module_check [ENV=VALUE...]: runs the probe; 0 when it printed the ValueError
  env "$@" PYTHONPATH="$repo/python:$PYTHONPATH" timeout 60 "$py" -c "$module_probe" 2>&1 |
    tail -n 3 | tee -a "$out/module.log" | grep -q '^module check: ValueError'
}
if [ -z "$module_so" ]; then
  note "module check: skipped (no python/braid/_C.*.so built)"
elif PYTHONPATH="$repo/python:$PYTHONPATH" timeout 60 "$py" -c "$module_probe" >"$out/module.log" 2>&1 &&
     grep -q '^module check: ValueError' "$out/module.log"; then
  note "$(grep '^module check:' "$out/module.log")"
else
  status=1
  note "module check: FAILED: braid._C cannot raise a formatted error (module.log):"
  tail -n 4 "$out/module.log" | sed 's/^/  | /' >>"$summary"
  {
    echo "== the compiler and its C++ library"
    echo "CMAKE_CXX_COMPILER=$cxx -> $(readlink -f "$cxx")"
    "$cxx" -v 2>&1 | tail -n 2
    for f in libstdc++.so libstdc++.so.6 libstdc++.a libgcc_s.so; do
      p=$("$cxx" -print-file-name=$f); echo "$f: $p -> $(readlink -f "$p" 2>/dev/null)"
      [ -f "$p" ] && file -L "$p" | grep -q text && sed 's/^/    /' "$p"
    done
    "$cxx" -dumpspecs 2>/dev/null | grep -n -i -E 'static-libstdc|static-libgcc|lstdc' | head -n 10
    echo "system libstdc++: $(ldconfig -p | grep 'libstdc++.so.6 ' | head -n 2 | paste -sd' ')"
    echo "/usr/bin/g++: $( [ -x /usr/bin/g++ ] && /usr/bin/g++ --version | head -n 1 || echo none)"
    echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-} LD_PRELOAD=${LD_PRELOAD:-}"
    echo "== $module_so"
    readelf -d "$module_so" | grep -E 'NEEDED|RPATH|RUNPATH'
    ldd "$module_so" | grep -E 'stdc|gcc_s|not found'
    # _M_insert<long> and num_put<char>::id (a GNU-unique symbol, shared across libraries)
    # are the system libstdc++'s; defined here, they come with a second, static copy of it.
    echo "the C++ library's own code it defines (only a statically linked libstdc++ brings these):"
    nm -D --defined-only -C "$module_so" |
      grep -E 'locale::classic\(\)|ios_base::Init::Init\(\)|ostream::_M_insert<long>|num_put<char, .*::id$' |
      head -n 8
    echo "== the probe with the system's libstdc++ preloaded"
  } >>"$out/module.log" 2>&1
  sys_stdcxx=$(ldconfig -p | sed -n 's/^.*libstdc++\.so\.6 (libc6,x86-64) => //p' | head -n 1)
  if [ -n "$sys_stdcxx" ] && module_check LD_PRELOAD="$sys_stdcxx"; then
    note "  with LD_PRELOAD=$sys_stdcxx: ValueError (the module works with that libstdc++ loaded first)"
  else
    note "  with LD_PRELOAD=${sys_stdcxx:-(no system libstdc++)}: still failing"
  fi
  # The same in ten lines, without braid: a shared library from this compiler formats a number.
  toy=$build/stdcxx_probe
  mkdir -p "$toy"
  printf '%s\n' '#include <sstream>' '#include <string>' \
    'extern "C" const char* format_number(long v) {' \
    '  static std::string s; std::ostringstream o; o << "n=" << v << " x=" << 1.5; s = o.str();' \
    '  return s.c_str(); }' >"$toy/probe.cpp"
  toy_py="import ctypes, sys
lib = ctypes.CDLL(sys.argv[1]); lib.format_number.restype = ctypes.c_char_p
print('toy:', lib.format_number(42).decode())
import numpy
print('toy after numpy:', lib.format_number(43).decode())"
  if "$cxx" -O2 -fPIC -shared "$toy/probe.cpp" -o "$toy/probe.so" >>"$out/module.log" 2>&1; then
    if timeout 30 "$py" -c "$toy_py" "$toy/probe.so" >>"$out/module.log" 2>&1; then
      note "  a shared library from the same compiler formats numbers under Python: ok (braid-specific)"
    else
      note "  a shared library from the same compiler ALSO crashes formatting a number under Python: the toolchain"
    fi
    nm -D --defined-only -C "$toy/probe.so" | grep -c ' std::' | sed 's/^/toy .so defines std:: symbols: /' >>"$out/module.log"
  fi
  # The candidate fix: _C relinked so that nothing it takes from a static archive (braid's
  # layers, and the C++ library where the compiler links that statically) is exported or
  # interposed. Only the module is relinked (seconds). Where that passes, the rest of this
  # run uses the relinked module, and the summary says so; the status stays failed.
  say "module check failed: relink _C with -Wl,--exclude-libs,ALL"
  echo "== relink with -Wl,--exclude-libs,ALL" >>"$out/module.log"
  if cmake -S "$repo" -B "$build" -DCMAKE_MODULE_LINKER_FLAGS="-Wl,--exclude-libs,ALL" \
       >>"$out/module.log" 2>&1 &&
     timeout 120 cmake --build "$build" --target _C -j "$(nproc)" >>"$out/module.log" 2>&1 &&
     module_check; then
    note "  relinked with -Wl,--exclude-libs,ALL: ValueError; the rest of this run uses that module"
  else
    note "  relinked with -Wl,--exclude-libs,ALL: still failing"
  fi
  nm -D --defined-only -C "$module_so" | grep -c ' std::' | sed 's/^/after the relink, std:: symbols it defines: /' >>"$out/module.log"
fi

# ---- tests --------------------------------------------------------------------------------------
# Two passes: first the entries labelled gpu (their cases run on the GPU: kernels, model, the
# trainer, NCCL, torch interop), before the benchmarks, which keep their share; then, with what
# is left, the rest, which run on CPU ranks here too and which CPU CI runs anyway. In ctest's
# order the Python files come first, most of them CPU work, so one pass over the whole suite
# could spend the budget before test_kernels started.
comm_bench_s=${BRAID_GPU_COMM_BENCH_S:-30}  # comm_bench's share of what the tests leave
mfu_s=${BRAID_GPU_MFU_S:-100}               # mfu.py's: two probes and the timed run
step_bench_s=${BRAID_GPU_STEP_BENCH_S:-50}
scaling_s=${BRAID_GPU_SCALING_S:-30}         # scaling.py's one-GPU row
[[ $benches == *" scaling "* ]] || scaling_s=0
[[ $benches == *" comm_bench "* ]] || comm_bench_s=0
[[ $benches == *" mfu "* ]] || mfu_s=0
[[ $benches == *" step_bench "* ]] || step_bench_s=0
: >"$out/ctest.log"
tests_failed=0
tests_run() {  # tests_run WHAT SECONDS CTEST_ARGS...: one pass, appended to ctest.log; sets
  local what=$1 secs=$2 log=$out/ctest-$1.log rc passed names  # tests_failed
  shift 2
  say "ctest $* -j$ctest_jobs with BRAID_TEST_DEVICE=cuda ($secs s at most${test_regex:+; -R $test_regex})"
  local t=$SECONDS
  BRAID_TEST_DEVICE=cuda timeout "$secs" \
    ctest --test-dir "$build" --output-on-failure -j "$ctest_jobs" ${test_regex:+-R "$test_regex"} \
    "$@" >"$log" 2>&1
  rc=$?
  passed=$(grep -cE '^ *[0-9]+/[0-9]+ Test +#[0-9]+: .* Passed' "$log")
  names=$(grep -E '^ *[0-9]+/[0-9]+ Test +#[0-9]+: ' "$log" | grep -v ' Passed' |
          sed -E 's/^.*Test +#[0-9]+: ([^ ]+) .*$/\1/' | paste -sd' ')
  tests_failed=$(grep -E '^ *[0-9]+/[0-9]+ Test +#[0-9]+: ' "$log" | grep -vc ' Passed')
  note "tests ($what): $passed passed, $tests_failed failed$([ $rc = 124 ] && echo ', stopped at the time budget') in $((SECONDS - t)) s"
  [ -n "$names" ] && note "  failed: $names"
  grep -E 'tests passed, [0-9]+ tests failed|No tests were found' "$log" | sed 's/^/  ctest: /' >>"$summary"
  { echo "==== ctest $* ($what)"; cat "$log"; } >>"$out/ctest.log" && rm -f "$log"
  return $rc
}
test_s=$(( $(left) - step_bench_s - comm_bench_s - mfu_s - scaling_s ))  # the benchmarks' share
[ "$test_s" -ge 30 ] || test_s=30
tests_run gpu "$test_s" -L gpu || status=1

# ---- benchmark ----------------------------------------------------------------------------------
if [[ $benches != *" step_bench "* ]]; then
  :
elif [ -f benchmarks/step_bench.py ]; then
  bench_s=$(( $(left) - comm_bench_s - mfu_s - scaling_s ))
  [ "$bench_s" -ge 30 ] || bench_s=30
  say "benchmarks/step_bench.py --device cuda --dtype bf16 ($bench_s s at most)"
  PYTHONPATH=$repo/python:$PYTHONPATH PYTHONUNBUFFERED=1 timeout "$bench_s" \
    "$py" benchmarks/step_bench.py --device cuda --dtype bf16 >"$out/bench.log" 2>&1
  bench_rc=$?
  note "benchmark: $([ $bench_rc = 0 ] && echo ok || echo "FAILED (rc $bench_rc)"); its last lines:"
  tail -n 15 "$out/bench.log" | sed 's/^/  | /' >>"$summary"
  [ $bench_rc -eq 0 ] || status=1
else
  note "benchmark: benchmarks/step_bench.py not in this tree"
fi

# comm_bench: NCCL through braid vs the raw NCCL calls, one rank (a GPU to itself: the
# per-call cost of braid's layer, not the network). A world of one needs no mpirun.
if [[ $benches != *" comm_bench "* ]]; then
  :
elif [ -x "$build/benchmarks/comm_bench" ]; then
  cb_s=$(( $(left) - mfu_s - scaling_s ))
  [ "$cb_s" -ge 20 ] || cb_s=20
  say "comm_bench --transport nccl ${comm_bench_args[*]} ($cb_s s at most)"
  timeout "$cb_s" "$build/benchmarks/comm_bench" --transport nccl "${comm_bench_args[@]}" \
    --distributed-timeout-minutes 1 >"$out/comm_bench.log" 2>&1
  cb_rc=$?
  note "comm_bench: $([ $cb_rc = 0 ] && echo ok || echo "FAILED (rc $cb_rc)"); overheads:"
  { grep -E '^# .*(overhead|skipped|NCCL)' "$out/comm_bench.log" || tail -n 5 "$out/comm_bench.log"; } |
    sed 's/^/  | /' >>"$summary"
  [ $cb_rc -eq 0 ] || status=1
else
  note "comm_bench: not built"
  status=1
fi

# mfu.py: MFU of a Llama-style bf16 stack with as many layers as the GPU holds.
if [[ $benches == *" mfu "* ]]; then
  mfu_left=$(( $(left) - scaling_s ))
  [ "$mfu_left" -ge 30 ] || mfu_left=30
  say "benchmarks/mfu.py ${mfu_args[*]} ($mfu_left s at most)"
  PYTHONPATH=$repo/python:$PYTHONPATH PYTHONUNBUFFERED=1 timeout "$mfu_left" \
    "$py" benchmarks/mfu.py "${mfu_args[@]}" >"$out/mfu.log" 2>&1
  mfu_rc=$?
  note "mfu: $([ $mfu_rc = 0 ] && echo ok || echo "FAILED (rc $mfu_rc)"); its last lines:"
  tail -n 6 "$out/mfu.log" | sed 's/^/  | /' >>"$summary"
  [ $mfu_rc -eq 0 ] || status=1
fi
# scaling.py's baseline row on the GPU: pretrain_gpt.py --device cuda --bf16 with the step
# timers (every span synchronizes the GPU), a tiny model - a check that the training script and
# its tracing run on CUDA, not a figure.
if [[ $benches == *" scaling "* ]]; then
  sc_left=$(left)
  [ "$sc_left" -ge 20 ] || sc_left=20
  say "benchmarks/scaling.py --device cuda --ranks 1 ($sc_left s at most)"
  PYTHONPATH=$repo/python:$PYTHONPATH PYTHONUNBUFFERED=1 timeout "$sc_left" \
    "$py" benchmarks/scaling.py --device cuda --ranks 1 --train-iters 8 >"$out/scaling.log" 2>&1
  sc_rc=$?
  note "scaling: $([ $sc_rc = 0 ] && echo ok || echo "FAILED (rc $sc_rc)"); its last lines:"
  tail -n 5 "$out/scaling.log" | sed 's/^/  | /' >>"$summary"
  [ $sc_rc -eq 0 ] || status=1
fi

# The rest of the suite with what is left: it passes in CPU CI, so running out of time here is
# said, not failed; a test that fails is a failure.
rest_s=$(left)
if [ "$rest_s" -ge 30 ]; then
  tests_run rest "$rest_s" -LE gpu
  rc=$?
  if [ $rc -ne 0 ] && { [ $rc -ne 124 ] || [ "$tests_failed" -gt 0 ]; }; then status=1; fi
else
  note "tests (rest): not run, $rest_s s left (the entries not labelled gpu; CPU CI runs them)"
fi
finish $status
