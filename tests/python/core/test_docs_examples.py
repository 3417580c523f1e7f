"""Every example in README.md and docs/*.md runs as written.

Each fenced block is classified by its language:
- ```python: executed; the python blocks of one file run in order in one namespace.
- ```sh / ```bash / ```console: executed with bash (a console block's `$ ` lines and their
  continuations; the rest is output). `python` is the interpreter running this test (a shim on
  PATH), PYTHONPATH is the package, mpirun may oversubscribe and run as root.
- no language, ```text, ```json: listings (output, file contents, data), not examples. A
  listing that starts with a `$ ` prompt is a console example missing its label: that fails.
Any other language fails: classify it here.

Each file's examples run in order in one fresh process (so braid.init_distributed() is an MPI
singleton per file) in a temporary directory that holds symlinks to the repository's top-level
entries: `pretrain_gpt.py`, `tools/...`, `.venv/bin/python` resolve, and what an example writes
in its working directory stays there (so no example may write into a repository folder such as
docs/: it would write through the symlink). Examples that cannot run here by nature are skipped only through SKIP below, each
with its reason and what covers it instead; an entry that matches no block fails the test.
"""

import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
DOCS = ["README.md"] + sorted(
    os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))

RUN_PYTHON = {"python"}
RUN_SHELL = {"sh", "bash", "shell", "console"}
LISTINGS = {"", "text", "json"}

# (file, text the block contains) -> (why it cannot run here, what covers it instead)
SKIP = {
    ("README.md", "make demo "): (
        "make demo trains 2000 steps on 8 ranks (~6 min); make test runs the whole suite",
        "tests/python/engine/test_parallel_demo.py; make test is ctest itself"),
    ("README.md", "bash scripts/gpu_check.sh"): (
        "needs the GPU machine (pack_gpu_deps.sh only prepares it)",
        "scripts/gpu_check.sh, run on the GPU machine"),
    ("docs/building.md", "pip install ."): (
        "builds and installs the whole package (minutes)",
        "tests/python/core/test_pip_install.py"),
    ("docs/convert_hf.md", "convert_hf.py import"): (
        "needs a Hugging Face model directory (./Llama-tiny) and transformers",
        "tests/python/ckpt/test_convert_hf.py"),
    ("docs/convert_megatron.md", "convert_megatron.py import"): (
        "needs a Megatron-LM checkpoint directory (./megatron_ckpt) and PyTorch",
        "tests/python/ckpt/test_convert_megatron.py (megatron-core's own saves and loads)"),
    ("docs/data.md", "--tokenizer-model tokenizer.model"): (
        "placeholder corpus and SentencePiece model",
        "tests/python/data/test_sentencepiece_tiktoken.py, "
        "tests/python/engine/test_megatron_launch_scripts.py"),
    ("docs/demo.md", "mpirun -np 8 --oversubscribe python -m braid.demo \\\n"): (
        "the full 3D demo, 2000 steps on 8 ranks (~6 min)",
        "tests/python/engine/test_parallel_demo.py"),
    ("docs/demo.md", "--input corpus.jsonl"): (
        "needs a corpus and a tokenizer.json of one's own",
        "tests/python/data/test_preprocess_data.py, tests/python/data/test_gpt_demo_data.py"),
    ("docs/formats.md", "--tokenizer-model path/to/tokenizer.json"): (
        "placeholder corpus and tokenizer paths",
        "tests/python/data/test_preprocess_data.py"),
    ("docs/formats.md", "data_idx_fuzzer"): (
        "builds a libFuzzer target with clang and fuzzes for an hour",
        "ctest's data_idx_fuzz (5 s from the seeds)"),
    ("docs/generate.md", "demo-cpu1-ckpt"): (
        "needs the checkpoint make demo-cpu1 saves (a minute of training)",
        "tests/python/model/test_generate_tool.py"),
    ("docs/launching.md", "mpirun -np 8 --bind-to none build/benchmarks/comm_bench"): (
        "a benchmark: timed collectives up to 128 MiB on 8 ranks",
        "none: a timing run, not a check (the collectives: tests/cpp/comm)"),
    ("docs/launching.md", "cat > hosts"): (
        "multi-node: mpirun --hostfile over two machines",
        "none here: needs two nodes"),
    ("docs/launching.md", "srun -N 2"): (
        "multi-node under Slurm (srun over two GPU nodes)",
        "none here: needs a Slurm allocation of two nodes"),
    ("docs/launching.md", "--target braid-topo"): (
        "a build with -DBRAID_IBVERBS=ON and RDMA devices",
        "the braid-topo build in gpu_check.sh"),
    ("docs/metrics.md", "tensorboard --logdir"): (
        "starts the TensorBoard server, which runs until stopped",
        "tests/python/core/test_metrics.py (event files read back by tensorboard)"),
    ("docs/parallel.md", "braid::comm::init_distributed()"): (
        "a C++ fragment (no main)",
        "tests/cpp/engine (ParallelModel against the one-process model)"),
    ("docs/performance.md", "benchmarks/step_bench.py"): (
        "a benchmark (minutes of timed steps)", "none: a timing run, not a check"),
    ("docs/performance.md", "benchmarks/data_loader_bench.py"): (
        "a benchmark (timed loading)", "none: a timing run, not a check"),
    ("docs/performance.md", "build/benchmarks/comm_bench -b 8 -e 128M"): (
        "a benchmark: timed collectives up to 128 MiB", "none: a timing run, not a check"),
    ("docs/performance.md", "--target dp_overlap_bench"): (
        "builds and runs a benchmark", "none: a timing run, not a check"),
    ("docs/performance.md", "benchmarks/scaling.py --json"): (
        "a benchmark (12 timed training jobs of 1 to 4 ranks)",
        "tests/python/planner/test_scaling.py (the same script on 1 and 2 ranks)"),
    ("docs/performance.md", "expert_parallel.py                 # 2 ranks"): (
        "a benchmark (8 timed training jobs of 2 and 4 ranks)",
        "tests/python/engine/test_expert_parallel_bench.py (the same runs at a tiny shape)"),
    ("docs/performance.md", "expert_parallel.py --tp 2 --repeats 3"): (
        "a benchmark (12 timed training jobs of 2 and 4 ranks)",
        "tests/python/engine/test_expert_parallel_bench.py (the same runs at a tiny shape)"),
    ("docs/performance.md", "checkpoint_bench --repeats"): (
        "a benchmark (timed saves and loads)", "none: a timing run, not a check"),
    ("docs/pipeline.md", "build/benchmarks/pipeline_bench --trace-dir"): (
        "a benchmark (three schedules timed on 4 ranks) that redraws docs/pipeline_1f1b.png",
        "tests/cpp/engine (the schedules and their traces)"),
}

FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^\s`]*)")


def blocks(path):
    """[(line of the opening fence, language, text)] of the fenced blocks of path."""
    lines = open(os.path.join(ROOT, path), encoding="utf-8").read().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m.group(1)), m.group(2), m.group(3).lower()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        assert j < len(lines), f"{path}:{i + 1}: unclosed fence"
        body = [line[indent:] if line[:indent].isspace() else line for line in lines[i + 1:j]]
        out.append((i + 1, lang, "\n".join(body) + "\n"))
        i = j + 1
    return out


def console_commands(text):
    """The commands of a console block: `$ ` lines and their `\\` continuations."""
    cmds, continuing = [], False
    for line in text.splitlines():
        if continuing:
            cmds[-1] += "\n" + line
        elif line.startswith("$ "):
            cmds.append(line[2:])
        else:
            continue
        continuing = line.endswith("\\")
    return "\n".join(cmds) + "\n"


def skip_entry(path, text):
    hits = [k for k in SKIP if k[0] == path and k[1] in text]
    assert len(hits) <= 1, f"{path}: several SKIP entries match one block: {hits}"
    return hits[0] if hits else None


def plan(path):
    """The examples of path in order: [(id, kind, code)], kind 'python' or 'shell'."""
    steps = []
    for line, lang, text in blocks(path):
        where = f"{path}:{line}"
        assert not (lang in LISTINGS and text.startswith("$ ")), (
            f"{where}: a listing that starts with a `$ ` prompt: label it ```console")
        if skip_entry(path, text):
            continue
        if lang in RUN_PYTHON:
            steps.append((where, "python", "\n" * line + text))  # tracebacks: file lines
        elif lang in RUN_SHELL:
            steps.append((where, "shell", console_commands(text) if lang == "console" else text))
        elif lang not in LISTINGS:
            raise AssertionError(f"{where}: ```{lang} is neither run nor a listing: classify it "
                                 "in test_docs_examples.py (or add a SKIP entry)")
    return steps


# Runs in a fresh interpreter: the examples of one file, in order, stopping at the first failure.
DRIVER = r"""
import json, os, subprocess, sys, traceback
steps, env, timeout = json.load(sys.stdin)
namespace = {"__name__": "__main__"}
for where, kind, code in steps:
    print(f"=== {where} ({kind})", flush=True)
    if kind == "python":
        try:
            exec(compile(code, where.rsplit(":", 1)[0], "exec"), namespace)
        except BaseException:
            traceback.print_exc()
            print(f"FAILED {where}", flush=True)
            sys.exit(1)
    else:
        try:
            r = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", code], env=env,
                               timeout=timeout, stdout=sys.stdout, stderr=subprocess.STDOUT)
        except subprocess.TimeoutExpired:
            print(f"FAILED {where}: still running after {timeout} s", flush=True)
            sys.exit(1)
        if r.returncode != 0:
            print(f"FAILED {where}: exit status {r.returncode}", flush=True)
            sys.exit(1)
    sys.stdout.flush()
"""


def shell_env(bindir):
    env = dict(os.environ)
    env.update({
        "PATH": bindir + os.pathsep + env.get("PATH", ""),
        "PYTHONPATH": os.pathsep.join(
            p for p in [os.path.join(ROOT, "python"), env.get("PYTHONPATH")] if p),
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_rmaps_base_oversubscribe": "1",
        "OMP_NUM_THREADS": "1",
    })
    return env


def workdir(tmp):
    """tmp/work: symlinks to the repository's top-level entries; tmp/bin: the `python` shim."""
    work, bindir = os.path.join(tmp, "work"), os.path.join(tmp, "bin")
    os.makedirs(work)
    os.makedirs(bindir)
    for name in os.listdir(ROOT):
        if name != ".git":
            os.symlink(os.path.join(ROOT, name), os.path.join(work, name))
    shim = os.path.join(bindir, "python")
    with open(shim, "w") as f:
        f.write(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    os.chmod(shim, 0o755)
    return work, bindir


def test_every_block_is_classified_and_skips_are_live():
    matched = set()
    for path in DOCS:
        plan(path)
        for _, _, text in blocks(path):
            hit = skip_entry(path, text)
            if hit:
                matched.add(hit)
    stale = [k for k in SKIP if k not in matched]
    assert not stale, f"SKIP entries that match no block (remove them): {stale}"


@pytest.mark.parametrize("path", DOCS)
def test_examples_run(path):
    steps = plan(path)
    if not steps:
        pytest.skip(f"{path}: no runnable examples")
    with tempfile.TemporaryDirectory(prefix="braid-docs-") as tmp:
        work, bindir = workdir(tmp)
        env = shell_env(bindir)
        r = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps([steps, env, 240]),
                           text=True, cwd=work, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=600)
    if r.returncode != 0:
        failed = [line for line in r.stdout.splitlines() if line.startswith("FAILED ")]
        first = failed[-1] if failed else f"FAILED {path}: exit status {r.returncode}"
        pytest.fail(f"{first}\n{r.stdout[-6000:]}", pytrace=False)
