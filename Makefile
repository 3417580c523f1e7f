# braid — the commands a person types. Each target goes through scripts/bootstrap.sh, which
# installs only what is missing and builds incrementally, so every target works on a fresh
# clone of a Debian 12 machine and takes seconds on a ready one.
#
#   make demo       train a small GPT on the CPU as a 3D-parallel job (8 ranks: tp 2, pp 2,
#                   dp 2), print `demo: accuracy=… time=…s`, then sample completions from its
#                   checkpoint with tools/generate.py
#   make demo-cpu1  the same model in one process
#   make test       build, then every C++ and Python test through ctest, two at a time
#                   (CTEST_JOBS=1 one at a time; CTEST_ARGS="-L core" a layer's)
#   make sanitize   the C++ tests under AddressSanitizer + UndefinedBehaviorSanitizer
#   make build      configure and build build/
#   make clean      remove the build folders and the built extension
#   make distclean  clean, plus the .venv link and .deps/ (the venvs and ccache stay in ~/.cache/braid)

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := build
.PHONY: build demo demo-cpu1 test sanitize clean distclean

NPROC := $(shell nproc)
PYTHON := .venv/bin/python
# CI (CI=true) shows the whole build; elsewhere only bootstrap's stage lines, and the log's
# tail when something fails.
BOOTSTRAP := bash scripts/bootstrap.sh $(if $(CI),,--quiet)
CTEST_ARGS ?=
# Two tests at a time. One alone keeps about 1.1 of 2 cores busy (interpreters starting, mpirun,
# ranks waiting on each other); two keep both, and a whole run takes ~20 min instead of ~27.
# An MPI job of n ranks counts as n (its PROCESSORS), so the C++ MPI tests run alone.
CTEST_JOBS ?= 2
CTEST := ctest --output-on-failure --no-tests=error -j $(CTEST_JOBS) $(CTEST_ARGS)

# CPU threads. braid's OpenMP threads split each GEMM and call OpenBLAS single-threaded
# (csrc/kernels/cpu/gemm.cpp), so OpenBLAS gets no pool of its own and the demo gets every core
# through OpenMP. Each ctest entry sets its own (cmake/BraidTesting.cmake).
export OMP_NUM_THREADS ?= $(NPROC)
export OPENBLAS_NUM_THREADS ?= 1
# mpirun in tests: as root in CI and on these machines, and up to 8 ranks on 2 cores.
ifeq ($(shell id -u),0)
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
endif
export OMPI_MCA_rmaps_base_oversubscribe ?= 1

build:
	@bash scripts/bootstrap.sh

# The demo as Megatron would run it: 8 ranks (oversubscribed on small machines), tensor and
# pipeline parallel 2 each, so data parallel 2, with sequence parallelism, the distributed
# optimizer and overlapped gradient reduction and parameter gather. One OpenMP thread per
# rank, idle threads asleep: 8 ranks share the cores. 4 layers (2 per stage), 2,000 steps of 96.
DEMO_RANKS ?= 8
DEMO_ARGS ?= --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
  --sequence-parallel --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather \
  --num-layers 4 --micro-batch-size 24 --global-batch-size 96 --train-iters 2000 --log-interval 200
# Both save the trained model (the demo's --save) and then sample a few completions from that
# checkpoint with tools/generate.py (one process, KV cache; docs/generate.md).
demo:
	@$(BOOTSTRAP)
	@ckpt=$${BRAID_CACHE:-$$HOME/.cache/braid}/demo-ckpt; \
	 PYTHONPATH=$(CURDIR)/python OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive \
	 mpirun -np $(DEMO_RANKS) --oversubscribe -x PYTHONPATH -x OMP_NUM_THREADS -x OMP_WAIT_POLICY \
	 -x OPENBLAS_NUM_THREADS $(PYTHON) -m braid.demo $(DEMO_ARGS) --save "$$ckpt"; \
	 echo "demo: sampled from $$ckpt (tools/generate.py --temperature 0.7 --top-k 3):"; \
	 PYTHONPATH=$(CURDIR)/python $(PYTHON) tools/generate.py --load "$$ckpt" --temperature 0.7 \
	 --top-k 3 --seed 1 --max-new-tokens 5 --prompt 123+456= 905+095= 318+682= 777+111=

demo-cpu1:
	@$(BOOTSTRAP)
	@ckpt=$${BRAID_CACHE:-$$HOME/.cache/braid}/demo-cpu1-ckpt; \
	 PYTHONPATH=$(CURDIR)/python $(PYTHON) -m braid.demo --save "$$ckpt"; \
	 echo "demo: sampled from $$ckpt (tools/generate.py --temperature 0.7 --top-k 3):"; \
	 PYTHONPATH=$(CURDIR)/python $(PYTHON) tools/generate.py --load "$$ckpt" --temperature 0.7 \
	 --top-k 3 --seed 1 --max-new-tokens 5 --prompt 123+456= 905+095= 318+682= 777+111=

test:
	@$(BOOTSTRAP)
	@$(CTEST) --test-dir build

# The sanitizers: CPU only, no Python (the interpreter and torch are not ASan-built).
# LSan: scripts/lsan.supp names third-party runtimes' once-per-process allocations.
SANITIZE_CMAKE_ARGS := -DBRAID_SANITIZE=ON -DBRAID_CUDA=OFF -DBRAID_PYTHON=OFF \
  -DBRAID_BENCHMARKS=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo
sanitize:
	@BRAID_BUILD_DIR=build-sanitize BRAID_CMAKE_ARGS="$(SANITIZE_CMAKE_ARGS)" $(BOOTSTRAP) --no-python
	@ASAN_OPTIONS=detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1 \
	 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	 LSAN_OPTIONS=suppressions=$(CURDIR)/scripts/lsan.supp:print_suppressions=0 \
	 $(CTEST) --test-dir build-sanitize

clean:
	rm -rf build build-sanitize build-gpu python/braid/_C*.so

distclean: clean
	rm -rf .deps
	[ ! -L .venv ] || rm -f .venv
