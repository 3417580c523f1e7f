#!/usr/bin/env bash
# scripts/gpu_recheck.sh OUTDIR — the short GPU run after the first one's failures: the same
# setup as scripts/gpu_check.sh (it runs that script, .deps carried), but it builds only what
# the checks need and runs only:
#   - the module check (braid._C raises a C++ error whose message formats a number);
#   - the Python tests that died in the first run, and test_torch_interop (died the same way);
#   - comm_nccl_test_np1 (all-reduce / reduce-scatter avg in a world of one, split, the
#     parent's state after a split, the deadline probe) and test_kernels (cuDNN bf16 attention
#     in a C++ program);
#   - step_bench.py in bf16 (cuDNN attention from Python), comm_bench on 1-16 MiB, and mfu.py
#     with 4 layers.
# About 200 s on an H200 with 16 cores (build ~100 s of it). Any variable of gpu_check.sh
# overrides these defaults.
set -euo pipefail

[ $# -eq 1 ] || { echo "usage: scripts/gpu_recheck.sh OUTDIR" >&2; exit 2; }
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

python_tests='py_core_test_dlpack|py_core_test_torch_interop|py_data_test_gpt_demo_data|py_data_test_gpt_data|py_data_test_indexed_dataset|py_engine_test_adamw_vs_torch|py_model_test_model_inputs'
export BRAID_GPU_CHECK_TESTS=${BRAID_GPU_CHECK_TESTS:-"^(${python_tests}|comm_nccl_test_np1|test_kernels)\$"}
export BRAID_GPU_BUILD_TARGETS=${BRAID_GPU_BUILD_TARGETS:-"_C comm_nccl_test test_nccl_deadline_probe test_kernels comm_bench"}
export BRAID_GPU_CHECK_BENCH=${BRAID_GPU_CHECK_BENCH:-"step_bench comm_bench mfu"}
export BRAID_GPU_COMM_BENCH_ARGS=${BRAID_GPU_COMM_BENCH_ARGS:-"-b 1M -e 16M -f 4 -n 10 -w 3 -r 2"}
export BRAID_GPU_MFU_ARGS=${BRAID_GPU_MFU_ARGS:-"--num-layers 4 --steps 3 --warmup 1"}
export BRAID_GPU_CHECK_BUDGET=${BRAID_GPU_CHECK_BUDGET:-270}
export BRAID_GPU_AFTER_BUILD_S=${BRAID_GPU_AFTER_BUILD_S:-120}
export BRAID_GPU_STEP_BENCH_S=${BRAID_GPU_STEP_BENCH_S:-25}
export BRAID_GPU_COMM_BENCH_S=${BRAID_GPU_COMM_BENCH_S:-15}
export BRAID_GPU_MFU_S=${BRAID_GPU_MFU_S:-45}
exec "$repo/scripts/gpu_check.sh" "$1"
