"""Dropout masks follow the samples, as real pretrain_gpt.py jobs: with hidden and attention
dropout on (Megatron's defaults are 0.1 each), a job trains like one process whatever its
data-parallel size and micro-batch size, and a checkpoint saved under data parallelism resumes in
one process with another micro-batch size where that process would be."""

import os
import shutil

import numpy as np
import pytest

from pretrain_job import MODEL, jsonl, losses, run, run_layouts

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")

DROPPED = [*MODEL, "--hidden-dropout", "0.2", "--attention-dropout", "0.3"]
LAYOUTS = [("one", 1, []),
           ("dp2_mbs1", 2, ["--micro-batch-size", "1"]),
           ("dp2_tp2_sp_mbs4", 4, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                   "--micro-batch-size", "4"]),
           ("off", 1, ["--hidden-dropout", "0", "--attention-dropout", "0"])]
STEPS = list(range(1, 21))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_layouts(tmp_path_factory.mktemp("dropout_samples"), DROPPED, LAYOUTS,
                       timeout=300)[0]


@pytest.mark.parametrize("layout", ["dp2_mbs1", "dp2_tp2_sp_mbs4"])
def test_data_parallel_and_micro_batch_sizes_train_like_one_process(runs, layout):
    want, got = losses(runs["one"]), losses(runs[layout])
    assert sorted(want) == sorted(got) == STEPS
    np.testing.assert_allclose([got[i] for i in STEPS], [want[i] for i in STEPS], rtol=1e-5,
                               err_msg=layout)


def test_the_dropout_is_applied(runs):
    dropped, off = losses(runs["one"]), losses(runs["off"])
    drift = np.mean([abs(dropped[i] - off[i]) / off[i] for i in range(11, 21)])
    assert drift > 1e-3, (drift, dropped, off)


def test_a_data_parallel_checkpoint_resumes_in_one_process(runs, tmp_path):
    # The checkpoint's data position is the masks' position: the resumed process draws, for
    # each sample, the masks the uninterrupted one drew.
    ckpt, tb = str(tmp_path / "ckpt"), str(tmp_path / "tb")
    r = run(2, [*DROPPED, "--micro-batch-size", "1", "--train-iters", "20", "--eval-iters", "0",
                "--exit-interval", "10", "--save", ckpt, "--save-interval", "10"])
    assert r.returncode == 0, r.stdout + r.stderr
    r = run(1, [*DROPPED, "--micro-batch-size", "4", "--train-iters", "20", "--eval-iters", "0",
                "--load", ckpt, "--tensorboard-dir", tb])
    assert r.returncode == 0, r.stdout + r.stderr
    got, want = losses(jsonl(os.path.join(tb, "metrics.jsonl"))), losses(runs["one"])
    assert sorted(got) == list(range(11, 21))
    np.testing.assert_allclose([got[i] for i in range(11, 21)], [want[i] for i in range(11, 21)],
                               rtol=1e-5)
