"""benchmarks/expert_parallel.py runs end to end at a tiny shape on 2 CPU ranks: both runs train,
the table has a row for each, and holding half the experts shows in the peak memory (no time is
asserted)."""

import os
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")


def test_expert_parallel_bench_compares_ep_with_data_parallelism():
    r = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "expert_parallel.py"),
                        "--num-layers", "2", "--hidden-size", "64", "--seq-length", "32",
                        "--train-iters", "4", "--repeats", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {int(m[0]): [float(v) for v in m[1:]] for m in
            re.findall(r"^ +(\d+) +([0-9.]+) +([0-9.]+) +([0-9.]+) +([0-9.]+)$", r.stdout, re.M)}
    assert sorted(rows) == [1, 2], r.stdout
    assert rows[1][3] == 0 and rows[2][3] > 0, r.stdout  # only ep 2 exchanges tokens
    time_ratio, memory_ratio = map(float, re.search(
        r"ep 2 / ep 1: time ([0-9.]+)x, peak memory ([0-9.]+)x", r.stdout).groups())
    assert memory_ratio < 1, r.stdout  # each rank holds 4 of the 8 experts
    assert time_ratio > 0
