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


def table(stdout: str) -> dict[str, list[float]]:
    """The benchmark's rows: label -> ms/iter, peak MB, dp wait, ep wait."""
    return {m[0]: [float(v) for v in m[1:]] for m in re.findall(
        r"^ +([a-z]+(?: [a-z]+)? \d+) +([0-9.]+) +([0-9.]+) +([0-9.]+) +([0-9.]+)$", stdout, re.M)}


def test_expert_parallel_bench_compares_ep_with_data_parallelism():
    r = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "expert_parallel.py"),
                        "--num-layers", "2", "--hidden-size", "64", "--seq-length", "32",
                        "--train-iters", "4", "--repeats", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = table(r.stdout)
    assert sorted(rows) == ["ep 1", "ep 2"], r.stdout
    assert rows["ep 1"][3] == 0 and rows["ep 2"][3] > 0, r.stdout  # only ep 2 exchanges tokens
    time_ratio, memory_ratio = map(float, re.search(
        r"ep 2 / ep 1: time ([0-9.]+)x, peak memory ([0-9.]+)x", r.stdout).groups())
    assert memory_ratio < 1, r.stdout  # each rank holds 4 of the 8 experts
    assert time_ratio > 0


def test_expert_parallel_bench_compares_whole_with_split_experts():
    r = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "expert_parallel.py"),
                        "--tp", "2", "--num-layers", "2", "--hidden-size", "64", "--seq-length",
                        "32", "--train-iters", "4", "--repeats", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = table(r.stdout)
    # Split: tp 2 with ep 1, no exchange. Whole: the TP pair is the EP group, 4 experts a rank.
    assert sorted(rows) == ["split ep 1", "whole ep 2"], r.stdout
    assert rows["split ep 1"][3] == 0 and rows["whole ep 2"][3] > 0, r.stdout
    time_ratio, memory_ratio = map(float, re.search(
        r"whole ep 2 / split ep 1: time ([0-9.]+)x, peak memory ([0-9.]+)x", r.stdout).groups())
    assert time_ratio > 0 and memory_ratio > 0, r.stdout



def run_tiny(*args):
    """benchmarks/expert_parallel.py at a tiny shape: its table's rows."""
    r = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "expert_parallel.py"),
                        *args, "--num-layers", "2", "--hidden-size", "64", "--seq-length", "32",
                        "--train-iters", "4", "--repeats", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return table(r.stdout), r.stdout


def test_expert_parallel_bench_on_four_ranks():
    """docs/performance.md's two 4-rank comparisons at a tiny shape."""
    rows, out = run_tiny("--ranks", "4", "--ep", "4", "--num-experts", "16")
    assert sorted(rows) == ["ep 1", "ep 4"], out
    assert rows["ep 1"][3] == 0 and rows["ep 4"][3] > 0, out
    assert rows["ep 4"][1] < rows["ep 1"][1], out  # 4 of the 16 experts a rank
    # Split experts over the TP pair with ep 2 over DP, against whole ones with ep 4 over TP x DP.
    rows, out = run_tiny("--ranks", "4", "--tp", "2", "--ep", "4")
    assert sorted(rows) == ["split ep 2", "whole ep 4"], out
    assert rows["split ep 2"][3] > 0 and rows["whole ep 4"][3] > 0, out
