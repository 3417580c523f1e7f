#!/usr/bin/env bash
# scripts/bootstrap.sh — everything a fresh Debian 12 machine needs to build and test braid,
# then the build itself. Idempotent: on a ready machine it only checks and rebuilds what changed.
#
#   1. Debian packages (apt-get, only when dpkg-query says one is missing).
#   2. The Python environment: a venv outside the clone, keyed by the interpreter and the
#      requirements files, at $BRAID_CACHE/venv-<key>; `.venv` in the repo links to it.
#   3. Configure (Ninja, ccache; CUDA where nvcc is found) and build into build/.
#
# Usage: scripts/bootstrap.sh [--quiet] [--no-build] [--no-python]
#   --quiet      print only the stage lines; tool output goes to a log, shown on failure
#   --no-build   stop after the Python environment
#   --no-python  skip the venv and configure without BRAID_PYTHON_EXECUTABLE (sanitizer builds)
# Environment:
#   BRAID_CACHE       caches outside the clone (default ~/.cache/braid: venvs, ccache, logs)
#   BRAID_BUILD_DIR   build directory, relative to the repo (default build)
#   BRAID_CMAKE_ARGS  extra configure arguments, e.g. "-DBRAID_CUDA=OFF"
#   BRAID_JOBS        parallel build jobs (default: nproc)
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export HOME=${HOME:-$(getent passwd "$(id -u)" | cut -d: -f6)}
cache=${BRAID_CACHE:-$HOME/.cache/braid}
build_dir=${BRAID_BUILD_DIR:-build}
jobs=${BRAID_JOBS:-$(nproc)}
quiet=0 do_build=1 do_python=1
for arg in "$@"; do
  case $arg in
    -q|--quiet) quiet=1 ;;
    --no-build) do_build=0 ;;
    --no-python) do_python=0 ;;
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "bootstrap: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
  esac
done

mkdir -p "$cache/logs"
log="$cache/logs/bootstrap-$(printf '%s' "$repo" | sha256sum | cut -c1-8).log"
: >"$log"
t0=$SECONDS
stage() { printf 'bootstrap: [%4ss] %s\n' "$((SECONDS - t0))" "$*"; }
fail() { printf 'bootstrap: error: %s\n' "$*" >&2; exit 1; }
# run CMD...: in quiet mode its output goes to the log, and the log's tail is shown if it fails.
run() {
  if [ "$quiet" = 1 ]; then
    if ! "$@" >>"$log" 2>&1; then
      echo "bootstrap: failed: $*" >&2
      tail -n 60 "$log" >&2
      echo "bootstrap: full log: $log" >&2
      exit 1
    fi
  else
    "$@"
  fi
}

# ---- 1. Debian packages ------------------------------------------------------------------
# clang + libclang-rt-dev (libFuzzer, only "recommended" by clang): the .idx fuzz target.
packages=(build-essential cmake ninja-build ccache pkg-config libopenblas-dev libopenmpi-dev
          openmpi-bin libgtest-dev libdlpack-dev nlohmann-json3-dev libibverbs-dev
          clang libclang-rt-dev)
if ! command -v python3 >/dev/null; then
  packages+=(python3 python3-venv python3-dev)
else
  # Debian's own python3 splits venv/ensurepip and the C headers into packages; pyenv's has them.
  python3 -c 'import venv, ensurepip' 2>/dev/null || packages+=(python3-venv)
  python3 -c 'import os, sysconfig; assert os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))' \
    2>/dev/null || packages+=(python3-dev)
fi
# dpkg-query exits 1 when a package was never installed: that is an answer, not a failure.
installed=" $({ dpkg-query -W -f='${db:Status-Abbrev} ${Package}\n' "${packages[@]}" 2>/dev/null || true; } |
              awk '$1 == "ii" { printf "%s ", $2 }')"
missing=()
for p in "${packages[@]}"; do [[ $installed == *" $p "* ]] || missing+=("$p"); done
if [ ${#missing[@]} -eq 0 ]; then
  stage "system packages: all ${#packages[@]} present"
else
  stage "system packages: installing ${missing[*]}"
  sudo=()
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null || fail "not root and no sudo: install ${missing[*]} by hand"
    sudo=(sudo)
  fi
  export DEBIAN_FRONTEND=noninteractive
  run "${sudo[@]}" apt-get update -q
  run "${sudo[@]}" apt-get install -y -q --no-install-recommends -o DPkg::Lock::Timeout=600 "${missing[@]}"
fi

# ---- 2. Python environment ---------------------------------------------------------------
pip_version=26.3   # recent enough for the pinned wheels' metadata; the venv's own pip may not be
if [ "$do_python" = 1 ]; then
  py=$(python3 -c 'import sys; print(sys.executable)') || fail "python3 does not run"
  key=$( { python3 -c 'import sys; print(sys.version, sys.base_prefix)'
           cd "$repo" && cat requirements.txt requirements-build.txt requirements-test.txt \
             requirements-megatron-pre014.txt; } |
         sha256sum | cut -c1-16)
  venv="$cache/venv-$key"
  stamp="$venv/.braid-installed"
  if [ -f "$stamp" ] && "$venv/bin/python" -c '' 2>/dev/null; then
    stage "python: reusing $venv"
  else
    # One installer per venv: a second bootstrap (another checkout, a concurrent `make test`)
    # waits here and then finds the stamp.
    exec 9>"$venv.lock"
    flock 9
    if [ -f "$stamp" ] && "$venv/bin/python" -c '' 2>/dev/null; then
      stage "python: reusing $venv"
    else
      stage "python: creating $venv ($($py --version 2>&1); first run downloads torch, a few minutes)"
      rm -rf "$venv"
      run "$py" -m venv "$venv"
      # pip's HTTP cache (kept in ~/.cache/pip) serves a re-created venv where the index sends
      # cache headers; otherwise pip downloads again.
      export PIP_CACHE_DIR=$HOME/.cache/pip PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
      run "$venv/bin/python" -m pip install -q "pip==$pip_version"
      run "$venv/bin/python" -m pip install -q \
        -r "$repo/requirements-build.txt" -r "$repo/requirements-test.txt"
      run "$venv/bin/python" -m pip install -q --no-deps --target "$venv/megatron-core-pre014" \
        -r "$repo/requirements-megatron-pre014.txt"
      date -u +%FT%TZ >"$stamp"
    fi
    exec 9>&-
  fi
  if [ -e "$repo/.venv" ] && [ ! -L "$repo/.venv" ]; then
    fail "$repo/.venv is a real directory, not the link bootstrap manages: move it away"
  fi
  [ "$(readlink "$repo/.venv" 2>/dev/null)" = "$venv" ] || ln -sfn "$venv" "$repo/.venv"
fi

# ---- 3. Configure and build --------------------------------------------------------------
[ "$do_build" = 1 ] || { stage "done (no build)"; exit 0; }

nvcc=$(command -v nvcc || true)
if [ -z "$nvcc" ] && [ -x /usr/local/cuda/bin/nvcc ]; then nvcc=/usr/local/cuda/bin/nvcc; fi
ccache_env="CCACHE_DIR=$cache/ccache;CCACHE_BASEDIR=$repo"
args=(-G Ninja -S "$repo" -B "$repo/$build_dir")
if command -v ccache >/dev/null; then
  # Launched through env so that a plain `cmake --build`/`ninja` later uses the same cache;
  # CCACHE_BASEDIR makes fresh clones in other folders hit it too.
  langs=(C CXX)
  [ -n "$nvcc" ] && langs+=(CUDA)
  for lang in "${langs[@]}"; do args+=("-DCMAKE_${lang}_COMPILER_LAUNCHER=env;$ccache_env;ccache"); done
fi
[ -n "$nvcc" ] && args+=("-DCMAKE_CUDA_COMPILER=$nvcc")
[ "$do_python" = 1 ] && args+=("-DBRAID_PYTHON_EXECUTABLE=$repo/.venv/bin/python")
# shellcheck disable=SC2206  # word splitting of the user's extra arguments is intended
[ -n "${BRAID_CMAKE_ARGS:-}" ] && args+=(${BRAID_CMAKE_ARGS})

# Configure only when the arguments (or the venv behind .venv) changed; otherwise ninja
# re-runs CMake by itself when a CMakeLists.txt or a globbed folder changes.
# One build at a time per build folder (ninja has no lock of its own).
exec 8>"$cache/logs/build-$(printf '%s' "$repo/$build_dir" | sha256sum | cut -c1-8).lock"
flock 8
signature=$(printf '%s\n' "${args[@]}" "${venv:-}")
sig_file="$repo/$build_dir/.bootstrap-configure"
if [ ! -f "$repo/$build_dir/CMakeCache.txt" ] || [ "$(cat "$sig_file" 2>/dev/null)" != "$signature" ]; then
  stage "configure $build_dir/ (CUDA compiler: ${nvcc:-none})"
  rm -f "$repo/$build_dir/CMakeCache.txt" "$sig_file"
  run cmake "${args[@]}"
  printf '%s' "$signature" >"$sig_file"
fi
stage "build $build_dir/ (-j$jobs)"
run cmake --build "$repo/$build_dir" -j "$jobs"
stage "done"
