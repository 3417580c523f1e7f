"""The demo as a real 3D-parallel MPI job (python -m braid.demo under mpirun, through the bindings:
init_distributed, ParallelState, ParallelModel, the layout Trainer, gather_into): 8 ranks with
tp 2, pp 2, dp 2 train a tiny model for a few dozen steps, only rank 0 prints, the loss falls;
a layout that does not fit the ranks is one error line and a non-zero exit, not a hang."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from mpi_job import mpi_env

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")


def run_demo(ranks: int, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = mpi_env()
    cmd = ["mpirun", "-np", str(ranks), "--oversubscribe", sys.executable, "-m", "braid.demo",
           *args]
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
        "--lr-warmup-iters", "4", "--eval-problems", "16", "--distributed-timeout-minutes", "1"]


def test_3d_demo_trains_and_only_rank0_prints(tmp_path):
    r = run_demo(8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                     "--sequence-parallel", "--use-distributed-optimizer", "--overlap-grad-reduce",
                     "--micro-batch-size", "4", "--global-batch-size", "16",
                     "--train-iters", "40", "--log-interval", "10",
                     "--data-cache-path", str(tmp_path), *TINY], timeout=150)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout.splitlines()
    assert sum(line.startswith("demo: accuracy=") for line in out) == 1, r.stdout
    assert sum(line.startswith("demo: GPT with") for line in out) == 1, r.stdout
    assert "tp=2 pp=2 dp=2" in r.stdout
    losses = [float(m.group(1)) for line in out if (m := re.search(r"\| loss ([0-9.]+) \|", line))]
    assert len(losses) == 4, r.stdout  # steps 10, 20, 30, 40, from rank 0 alone
    assert losses[-1] < losses[0] - 0.5, losses


def test_bad_layout_is_one_error_line(tmp_path):
    r = run_demo(8, ["--tensor-model-parallel-size", "3", "--train-iters", "5",
                     "--data-cache-path", str(tmp_path), *TINY], timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    errors = [line for line in (r.stdout + r.stderr).replace("braid: error:", "\nbraid: error:")
              .splitlines() if line.startswith("braid: error:")]
    # Every rank prints the same line, without its rank or the C++ source (mpirun may end some
    # before they do).
    assert len(errors) >= 1, r.stdout + r.stderr
    assert len(set(errors)) == 1 and "[rank" not in errors[0], errors
    assert "3" in errors[0] and "8" in errors[0], errors[0]
    assert "demo: accuracy=" not in r.stdout
