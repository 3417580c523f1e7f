"""pretrain_gpt.py's --save-retain-interval as real jobs (1 and 2 ranks, with and without
--async-save): which iter_* directories remain, and the run resumes from the latest; what a job
killed while deleting leaves (never a tracker naming a missing or partial checkpoint); links and
later checkpoints left alone; the argument's rules. And --log-world-size-to-tensorboard's
metric, from the same audit of Megatron launch scripts."""

import os
import re
import shutil
import subprocess
import sys
import threading
import time

import pytest

from mpi_job import mpi_env
from pretrain_job import MODEL, REPO, jsonl, run

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")

sys.path.insert(0, os.path.join(REPO, "python"))

TRAIN = [*MODEL, "--eval-iters", "0"]


def iterations(ckpt) -> list[int]:
    """The iterations of the iter_<7 digits> directories in `ckpt`, sorted."""
    return sorted(int(n[5:]) for n in os.listdir(ckpt) if re.fullmatch(r"iter_\d+", n))


def deleted(stdout: str) -> list[int]:
    """The iterations the job's retention lines say it deleted, in order."""
    names = re.findall(r"^braid: --save-retain-interval \d+: deleting (.+?) of ", stdout, re.M)
    return [int(n[5:]) for line in names for n in line.split(", ")]


class TrackerWatch:
    """While a job runs, checks again and again that the directory the tracker names exists:
    a violation is a tracker read twice naming the same iteration around a look that found its
    directory missing (retention deleting the latest, or deleting before the commit)."""

    def __init__(self, ckpt):
        self.ckpt, self.violations, self.looks = ckpt, [], 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch)

    def _tracker(self):
        try:
            with open(os.path.join(self.ckpt, "latest_checkpointed_iteration.txt")) as f:
                return int(f.read())
        except (OSError, ValueError):
            return None

    def _watch(self):
        while not self.stop.is_set():
            n = self._tracker()
            time.sleep(0.001)
            if n is None:
                continue
            self.looks += 1
            if not os.path.isdir(os.path.join(self.ckpt, f"iter_{n:07d}")) and \
                    self._tracker() == n:
                self.violations.append(n)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def whole(ckpt, iteration) -> bool:
    """The checkpoint's directory holds what the save wrote (1 rank: metadata and one file)."""
    names = set(os.listdir(os.path.join(ckpt, f"iter_{iteration:07d}")))
    return names == {"metadata.json", "mp_rank_00_000.safetensors"}


@pytest.mark.parametrize("ranks,async_save", [(1, False), (1, True), (2, False), (2, True)],
                         ids=["1rank", "1rank-async", "2ranks", "2ranks-async"])
def test_retention_keeps_multiples_and_the_latest_and_resumes(tmp_path, ranks, async_save):
    # Saved every 5 iterations and at the end (27), multiples of 10 retained: 10, 20 and the
    # latest remain, whether the saves commit at once or in the background. The resumed job
    # loads 27 and, once its own saves commit, drops it (not a multiple of 10) for 30 and 33.
    import braid

    ckpt = str(tmp_path / "ckpt")
    flags = ["--save", ckpt, "--save-interval", "5", "--save-retain-interval", "10",
             *(["--async-save"] if async_save else [])]
    with TrackerWatch(ckpt) as watch:
        r = run(ranks, [*TRAIN, *flags, "--train-iters", "27"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert watch.looks > 0 and not watch.violations, watch.violations
    assert iterations(ckpt) == [10, 20, 27], os.listdir(ckpt)
    assert braid.latest_iteration(ckpt) == 27
    assert sorted(deleted(r.stdout)) == [5, 15, 25], r.stdout  # each once, by rank 0
    assert not [n for n in os.listdir(ckpt) if ".deleting-" in n or ".tmp-" in n]
    # Megatron's lines, once each (rank 0): the save started, and (async: later) committed.
    for n in (5, 10, 15, 20, 25, 27):
        for line in (f"saving checkpoint at iteration {n:7d} to {ckpt}",
                     f"  successfully saved checkpoint from iteration {n:7d} to {ckpt}\n"):
            assert r.stdout.count(line) == 1, (line, r.stdout)

    r = run(ranks, [*TRAIN, *flags, "--load", ckpt, "--train-iters", "33",
                    "--override-opt_param-scheduler"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "braid: loaded iteration 27" in r.stdout, r.stdout
    assert iterations(ckpt) == [10, 20, 30, 33], os.listdir(ckpt)
    assert braid.latest_iteration(ckpt) == 33
    assert braid.checkpoint_metadata(ckpt)["iteration"] == 33
    assert deleted(r.stdout) == [27], r.stdout


def test_a_job_killed_while_deleting_leaves_whole_checkpoints(tmp_path):
    # Checkpoints of 2, 4, ..., 12 (a run without retention). Retention after 12 with N = 4,
    # in a process killed by its deleting thread once the first file is gone: every directory
    # still named iter_<n> is whole, the tracker names one of them, and the run resumes; its
    # next commit removes the half-deleted leftovers too (and keeps 12, a multiple of 4).
    import braid

    ckpt = str(tmp_path / "ckpt")
    common = [*TRAIN, "--save", ckpt, "--save-interval", "2"]
    r = run(1, [*common, "--train-iters", "12"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert iterations(ckpt) == [2, 4, 6, 8, 10, 12]
    killed = subprocess.run([sys.executable, "-c", f"""
import os, shutil
from braid.checkpoint_flags import Retention
def dies_midway(path):  # removes one file, then the process is killed
    os.remove(os.path.join(path, sorted(os.listdir(path))[0]))
    os._exit(9)
shutil.rmtree = dies_midway
retention = Retention({ckpt!r}, 4, print)
retention.committed(12)
retention.close()
"""], env=mpi_env(), capture_output=True, text=True, timeout=60)
    assert killed.returncode == 9, killed.stdout + killed.stderr
    assert iterations(ckpt) == [4, 8, 12], os.listdir(ckpt)
    assert all(whole(ckpt, n) for n in (4, 8, 12))
    leftovers = [n for n in os.listdir(ckpt) if ".deleting-" in n]
    assert len(leftovers) == 3, os.listdir(ckpt)
    assert braid.latest_iteration(ckpt) == 12

    r = run(1, [*common, "--save-retain-interval", "4", "--load", ckpt, "--train-iters", "14",
                "--override-opt_param-scheduler"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "braid: loaded iteration 12" in r.stdout, r.stdout
    assert sorted(os.listdir(ckpt)) == [".braid-save.lock", "iter_0000004", "iter_0000008",
                                        "iter_0000012", "iter_0000014",
                                        "latest_checkpointed_iteration.txt"]
    assert braid.latest_iteration(ckpt) == 14


def test_links_files_and_later_checkpoints_stay(tmp_path):
    # What retention does not judge: a symbolic link (a checkpoint pinned elsewhere, as
    # Megatron skips links), a file, a later iteration than the one saved (from a run that went
    # further). An earlier directory not a multiple of N goes even if this run never made it.
    # (A --save directory of iterations without a tracker is refused: the run continues one.)
    ckpt = tmp_path / "ckpt"
    pinned = tmp_path / "pinned"
    r = run(1, [*TRAIN, "--save", str(ckpt), "--exit-interval", "5", "--train-iters", "12"])
    assert r.returncode == 0, r.stdout + r.stderr
    for d in (ckpt / "iter_0000004", ckpt / "iter_0000101", pinned):
        d.mkdir(parents=True)
        (d / "metadata.json").write_text("{}")
    (ckpt / "iter_0000003").symlink_to(pinned)
    (ckpt / "iter_0000007").write_text("not a directory")
    r = run(1, [*TRAIN, "--load", str(ckpt), "--save", str(ckpt), "--save-interval", "5",
                "--save-retain-interval", "10", "--train-iters", "12"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(os.listdir(ckpt)) == [
        ".braid-save.lock", "iter_0000003", "iter_0000007", "iter_0000010", "iter_0000012",
        "iter_0000101", "latest_checkpointed_iteration.txt"]
    assert (pinned / "metadata.json").exists()
    assert deleted(r.stdout) == [4, 5], r.stdout


@pytest.mark.parametrize("flags,message", [
    (["--save-retain-interval", "10"], "--save-retain-interval needs --save DIR"),
    (["--save-retain-interval", "10", "--save", "ckpt"],
     r"--save-retain-interval needs --save-interval \(it keeps every Nth"),
    (["--save-retain-interval", "15", "--save-interval", "10", "--save", "ckpt"],
     "--save-retain-interval 15 is not a multiple of --save-interval 10"),
    (["--save-retain-interval", "0", "--save-interval", "10", "--save", "ckpt"],
     "--save-retain-interval: must be > 0, got 0"),
])
def test_retention_arguments(flags, message):
    from braid.arguments import ArgumentError, parse_args

    base = ["--vocab-size", "300", "--mock-data", "--seq-length", "32"]
    with pytest.raises(ArgumentError, match=message):
        parse_args([*base, *flags], 1)
    a = parse_args([*base, "--save", "ckpt", "--save-interval", "5", "--save-retain-interval",
                    "20"], 1)
    assert (a.save_interval, a.save_retain_interval) == (5, 20)


def test_log_world_size_to_tensorboard_writes_the_job_size(tmp_path):
    # Megatron's world-size tag, on every recorded iteration (--tensorboard-log-interval 2), in
    # both metrics files; without the flag it is not written.
    from braid.metrics import read_metrics

    tb = str(tmp_path / "tb")
    r = run(2, [*TRAIN, "--train-iters", "6", "--tensorboard-dir", tb,
                "--tensorboard-log-interval", "2", "--log-world-size-to-tensorboard"])
    assert r.returncode == 0, r.stdout + r.stderr
    records = jsonl(os.path.join(tb, "metrics.jsonl"))
    assert [(rec["step"], rec["world-size"]) for rec in records if "world-size" in rec] == [
        (2, 2), (4, 2), (6, 2)]
    assert read_metrics(tb)["world-size"] == [(2, 2.0), (4, 2.0), (6, 2.0)]
    plain = str(tmp_path / "plain.jsonl")
    r = run(1, [*TRAIN, "--train-iters", "4", "--metrics-jsonl", plain])
    assert r.returncode == 0, r.stdout + r.stderr
    assert not [rec for rec in jsonl(plain) if "world-size" in rec]
