"""pretrain_gpt.py with --context-parallel-size, as real jobs: context parallelism with tensor,
sequence and pipeline parallelism, ZeRO and data parallelism trains like one process; a
checkpoint written under cp 2 resumes in one process exactly where that process would be; bad
layouts are refused before any collective."""

import os
import shutil

import numpy as np
import pytest

from pretrain_job import MODEL, assert_trains_alike, jsonl, losses, one_process, run  # noqa: F401

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")

CP2 = ["--context-parallel-size", "2"]


@pytest.mark.parametrize("ranks, layout, printed", [
    # tp 2 x cp 2 x pp 2 with sequence parallelism; ZeRO shards over the dp x cp group of 2.
    (8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--sequence-parallel", "--use-distributed-optimizer", "--overlap-grad-reduce", *CP2],
     "tp=2 cp=2 pp=2 dp=1"),
    # cp 2 x dp 2: each data-parallel rank's samples split over its CP pair.
    (4, [*CP2, "--use-distributed-optimizer", "--overlap-grad-reduce"], "tp=1 cp=2 pp=1 dp=2"),
])
def test_context_parallel_trains_like_one_process(ranks, layout, printed, one_process, tmp_path):
    tb = str(tmp_path / "tb")
    r = run(ranks, [*MODEL, *layout, "--train-iters", "20", "--tensorboard-dir", tb])
    assert r.returncode == 0, r.stdout + r.stderr
    assert printed in r.stdout, r.stdout
    assert_trains_alike(jsonl(os.path.join(tb, "metrics.jsonl")), one_process)


def test_a_context_parallel_checkpoint_resumes_in_one_process(one_process, tmp_path):
    # 10 iterations under cp 2 x dp 2 with ZeRO, saved; the next 10 in one process give the
    # one-process run's losses (the optimizer state gathered over the dp x cp group).
    ckpt, tb = str(tmp_path / "ckpt"), str(tmp_path / "tb")
    r = run(4, [*MODEL, *CP2, "--use-distributed-optimizer", "--train-iters", "20",
                "--exit-interval", "10", "--save", ckpt, "--save-interval", "10"])
    assert r.returncode == 0, r.stdout + r.stderr
    r = run(1, [*MODEL, "--train-iters", "20", "--load", ckpt, "--tensorboard-dir", tb])
    assert r.returncode == 0, r.stdout + r.stderr
    got, want = losses(jsonl(os.path.join(tb, "metrics.jsonl"))), losses(one_process)
    assert sorted(got) == list(range(11, 21))
    np.testing.assert_allclose([got[i] for i in range(11, 21)], [want[i] for i in range(11, 21)],
                               rtol=2e-4)


def test_an_odd_sequence_length_needs_no_context_parallelism(tmp_path):
    # Only context parallelism splits each sequence into 2 x cp chunks (Megatron asks it only
    # then): without it --seq-length 31 trains, and under tp 2 (no sequence parallelism) alike.
    odd = [*MODEL, "--seq-length", "31", "--train-iters", "5"]
    got = {}
    for ranks in (1, 2):
        tb = str(tmp_path / f"tb{ranks}")
        r = run(ranks, [*odd, "--tensor-model-parallel-size", str(ranks), "--tensorboard-dir", tb])
        assert r.returncode == 0, r.stdout + r.stderr
        got[ranks] = losses(jsonl(os.path.join(tb, "metrics.jsonl")))
    assert sorted(got[1]) == [1, 2, 3, 4, 5] and got[2] == pytest.approx(got[1], rel=1e-4)


@pytest.mark.parametrize("ranks, flags, message", [
    (4, [*CP2, "--seq-length", "30"],
     "--context-parallel-size 2: --seq-length 30 is not divisible by 2 x 2"),
    (2, ["--context-parallel-size", "4"],
     "the job's 2 processes are not divisible by --tensor-model-parallel-size 1 x "
     "--context-parallel-size 4 x --pipeline-model-parallel-size 1"),
])
def test_bad_context_parallel_layouts_are_refused(ranks, flags, message, tmp_path):
    r = run(ranks, [*MODEL, *flags, "--train-iters", "2"])
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr, r.stderr
