#!/usr/bin/env bash
# scripts/pack_gpu_deps.sh — prepares .deps/, what scripts/gpu_check.sh needs on a GPU machine
# that has the CUDA toolkit, CMake, ninja and a Python with PyTorch, but no package registry,
# no OpenBLAS, no GoogleTest, no DLPack or JSON headers. Run it here (Debian 12, apt + PyPI).
#
#   .deps/root.tar.xz  a prefix unpacked from Debian's packages (dpkg -x) — OpenBLAS (pthread)
#                      with libgfortran5/libquadmath0, GoogleTest, DLPack, nlohmann-json, and
#                      OpenMPI 4.1 (runtime, mpirun/orted, mpicc, headers) with the libraries
#                      it needs that a minimal image lacks (libevent, hwloc, PMIx, munge, UCX,
#                      libfabric, verbs, rdmacm, libnl, numa, psm, libatomic) —
#                      plus cuDNN's header-only C++ frontend (include/ of the pinned
#                      nvidia-cudnn-frontend wheel) under opt/cudnn_frontend/include.
#                      Static archives and docs are dropped; xz takes it to ~13 MiB.
#   .deps/wheels/      the pinned Python packages of requirements*.txt that the GPU machine's
#                      own environment may lack or hold in another version, for CPython 3.12
#                      manylinux x86_64: everything pinned except torch and numpy (the
#                      machine's own, built for its CUDA), plus pytest's and transformers'
#                      companions at the versions of this machine's .venv.
#   .deps/MANIFEST     what is in it.
#
# .deps/ is git-ignored; it travels to the GPU machine as a carried path. It must stay under
# 60 MiB (the whole tree travels with a 64 MiB limit), which this script checks.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
deps=$repo/.deps
limit_mib=60
debs=(libopenblas0-pthread libopenblas-pthread-dev libopenblas-dev libgfortran5 libquadmath0
      libgtest-dev libdlpack-dev nlohmann-json3-dev
      openmpi-bin openmpi-common libopenmpi3 libopenmpi-dev
      libevent-core-2.1-7 libevent-pthreads-2.1-7 libhwloc15 libpmix2 libmunge2 libucx0 libfabric1
      libibverbs1 librdmacm1 libnl-3-200 libnl-route-3-200 libnuma1 libpsm2-2 libpsm-infinipath1
      libatomic1)
# Not carried: libc6, libgcc-s1, libstdc++6, zlib1g, libudev1 (in every base image); hwloc's
# plugins (X11/OpenCL/PCI discovery, optional); OpenMPI's Fortran/Java compilers.
# Pinned in requirements*.txt but not carried: the GPU machine's own builds match its CUDA;
# wandb (a 20 MiB wheel with its Go core, and a dozen dependencies) logs nothing GPU-specific:
# its test (tests/python/engine/test_pretrain_gpt_wandb.py) skips where it is missing.
not_carried='^(torch|numpy|wandb)$'
# Needed next to the pins (requirements pin only the top of each tree); versions from .venv.
companions=(pluggy iniconfig tokenizers)
gpu_python=3.12
platforms=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
           manylinux1_x86_64)

say() { printf 'pack_gpu_deps: %s\n' "$*"; }
fail() { printf 'pack_gpu_deps: error: %s\n' "$*" >&2; exit 1; }

[ -x "$repo/.venv/bin/python" ] || fail ".venv missing: run scripts/bootstrap.sh --no-build first"
py=$repo/.venv/bin/python
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/debs" "$work/root" "$work/wheels" "$work/frontend"

# ---- Debian packages ----------------------------------------------------------------------
if ! apt-cache show "${debs[0]}" >/dev/null 2>&1; then
  say "apt-get update (no package lists yet)"
  apt-get update -q >/dev/null
fi
say "apt-get download ${debs[*]}"
(cd "$work/debs" && apt-get download -q -o APT::Sandbox::User=root "${debs[@]}" >/dev/null)
for f in "$work"/debs/*.deb; do dpkg -x "$f" "$work/root"; done
rm -rf "$work/root/usr/share/doc" "$work/root/usr/share/man" "$work/root/usr/share/lintian"
# Only libopenblas.so is linked (cmake/BraidBlas.cmake); its static archive alone is 56 MiB.
find "$work/root" \( -name 'libopenblas*.a' -o -name 'libblas.*' -o -name 'liblapack.*' \) -delete
# What Debian's alternatives would link (dpkg -x runs no maintainer scripts). OpenMPI is
# relocated on the GPU machine with OPAL_PREFIX=<root>/usr (scripts/gpu_check.sh).
ln -sfn orterun "$work/root/usr/bin/mpirun"
ln -sfn orterun "$work/root/usr/bin/mpiexec"
ln -sfn opal_wrapper "$work/root/usr/bin/mpicc"
ln -sfn ../libpsm1/libpsm_infinipath.so.1.16 \
  "$work/root/usr/lib/x86_64-linux-gnu/libpsm_infinipath.so.1"

# ---- wheels -------------------------------------------------------------------------------
pins=()
while read -r line; do
  line=${line%%#*}; line=${line// /}
  [[ $line == *==* ]] || continue
  name=${line%%==*}
  [[ $name =~ $not_carried ]] && continue
  pins+=("$line")
done < <(cat "$repo/requirements.txt" "$repo/requirements-build.txt" "$repo/requirements-test.txt")
for c in "${companions[@]}"; do
  v=$("$py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$c") ||
    fail "$c is not in .venv: run scripts/bootstrap.sh"
  pins+=("$c==$v")
done
platform_args=()
for p in "${platforms[@]}"; do platform_args+=(--platform "$p"); done
say "pip download (CPython $gpu_python): ${pins[*]}"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$gpu_python" \
  --implementation cp "${platform_args[@]}" -d "$work/wheels" "${pins[@]}"

# cuDNN's frontend is header-only for braid: take include/ from its wheel, leave the rest.
frontend=$(ls "$work"/wheels/nvidia_cudnn_frontend-*.whl 2>/dev/null | head -n 1)
if [ -n "$frontend" ]; then
  "$py" -m zipfile -e "$frontend" "$work/frontend"
  mkdir -p "$work/root/opt/cudnn_frontend"
  cp -r "$work/frontend/include" "$work/root/opt/cudnn_frontend/include"
  rm -f "$frontend"
fi

# ---- .deps ----------------------------------------------------------------------------------
say "compress the prefix (xz)"
tar -C "$work/root" -cf - . | xz -T0 -6 >"$work/root.tar.xz"
rm -rf "$deps"
mkdir -p "$deps/wheels"
mv "$work/root.tar.xz" "$deps/root.tar.xz"
mv "$work"/wheels/*.whl "$deps/wheels/"
{
  echo "# .deps/ for scripts/gpu_check.sh, made $(date -u +%FT%TZ) by scripts/pack_gpu_deps.sh"
  echo "# Debian packages in root.tar.xz:"
  for f in "$work"/debs/*.deb; do dpkg-deb -W --showformat='${Package} ${Version}\n' "$f"; done
  echo "# cuDNN frontend headers: root.tar.xz:opt/cudnn_frontend/include"
  echo "# wheels/:"
  (cd "$deps/wheels" && ls)
} >"$deps/MANIFEST"

size_kib=$(du -sk "$deps" | cut -f1)
say "$(du -sh "$deps/root.tar.xz" | cut -f1) prefix + $(du -sh "$deps/wheels" | cut -f1) wheels = $((size_kib / 1024)) MiB in .deps/"
[ "$size_kib" -le $((limit_mib * 1024)) ] || fail ".deps is over $limit_mib MiB"
# The tree travels with it: its tracked files too must fit under the 64 MiB.
tree_kib=$(( $(git -C "$repo" ls-files -z | (cd "$repo" && xargs -0 du -cb 2>/dev/null) | tail -n 1 | cut -f1) / 1024 ))
say "with the tracked tree ($((tree_kib / 1024)) MiB): $(( (size_kib + tree_kib) / 1024 )) MiB of the 64 MiB a device call carries"
[ $((size_kib + tree_kib)) -le $((64 * 1024 - 1024)) ] ||
  fail ".deps and the tracked tree are $(( (size_kib + tree_kib) / 1024 )) MiB, over the 63 MiB kept for a device call"
