"""pretrain_gpt.py's dropout (--hidden-dropout and --attention-dropout, Megatron's flags and
defaults, 0.1 each), as real jobs: every mask is a function of the run-wide sample and position
(and for the probabilities the head), so tensor (with sequence parallelism), context, pipeline
and data parallel jobs of any micro-batch size train exactly like one process with it; runs
saved under tp 2 and under dp 2 resume in one process, with another micro-batch size, where that
process would be; and the dropout is really applied (the losses differ from no dropout)."""

import os
import shutil

import numpy as np
import pytest

from pretrain_job import MODEL, jsonl, losses, run, run_layouts

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")

DROPPED = [*MODEL, "--hidden-dropout", "0.2", "--attention-dropout", "0.3"]
LAYOUTS = [("one", 1, []),
           ("tp2_sp", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
           ("cp2", 2, ["--context-parallel-size", "2"]),
           ("pp2", 2, ["--pipeline-model-parallel-size", "2"]),
           ("dp2_mbs1", 2, ["--micro-batch-size", "1"]),
           ("dp2_tp2_sp_mbs4", 4, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                   "--micro-batch-size", "4"]),
           ("off", 1, ["--hidden-dropout", "0", "--attention-dropout", "0"])]
STEPS = list(range(1, 21))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_layouts(tmp_path_factory.mktemp("dropout"), DROPPED, LAYOUTS, timeout=300)[0]


def test_default_is_megatrons():
    from braid.arguments import parse_args
    a = parse_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
                    "--mock-data", "--vocab-size", "100", "--seq-length", "16",
                    "--micro-batch-size", "1", "--train-iters", "1"], 1)
    assert (a.hidden_dropout, a.attention_dropout) == (0.1, 0.1)


@pytest.mark.parametrize("layout", ["tp2_sp", "cp2", "pp2", "dp2_mbs1", "dp2_tp2_sp_mbs4"])
def test_layouts_train_like_one_process(runs, layout):
    want, got = losses(runs["one"]), losses(runs[layout])
    assert sorted(want) == sorted(got) == STEPS
    np.testing.assert_allclose([got[i] for i in STEPS], [want[i] for i in STEPS], rtol=1e-5,
                               err_msg=layout)


def test_the_dropout_is_applied(runs):
    dropped, off = losses(runs["one"]), losses(runs["off"])
    assert all(dropped[i] != off[i] for i in range(1, 21)), (dropped, off)
    # By the end the runs have drifted apart.
    drift = np.mean([abs(dropped[i] - off[i]) / off[i] for i in range(11, 21)])
    assert drift > 1e-3, (drift, dropped, off)


@pytest.mark.parametrize("saved", [["--tensor-model-parallel-size", "2"],
                                   ["--micro-batch-size", "1"]], ids=["tp2", "dp2_mbs1"])
def test_a_parallel_checkpoint_resumes_in_one_process(runs, tmp_path, saved):
    # The masks follow the samples: the checkpoint's data position puts the resumed process
    # where the uninterrupted one drew them, whatever its micro-batch size.
    ckpt, tb = str(tmp_path / "ckpt"), str(tmp_path / "tb")
    r = run(2, [*DROPPED, *saved, "--train-iters", "20", "--eval-iters", "0",
                "--exit-interval", "10", "--save", ckpt, "--save-interval", "10"])
    assert r.returncode == 0, r.stdout + r.stderr
    r = run(1, [*DROPPED, "--micro-batch-size", "4", "--train-iters", "20", "--eval-iters", "0",
                "--load", ckpt, "--tensorboard-dir", tb])
    assert r.returncode == 0, r.stdout + r.stderr
    got, want = losses(jsonl(os.path.join(tb, "metrics.jsonl"))), losses(runs["one"])
    assert sorted(got) == list(range(11, 21))
    np.testing.assert_allclose([got[i] for i in range(11, 21)], [want[i] for i in range(11, 21)],
                               rtol=1e-5)


@pytest.mark.parametrize("device, flags, noted", [
    ("cuda", [], True), ("cuda", ["--attention-dropout", "0"], False), ("cpu", [], False)])
def test_a_gpu_run_with_attention_dropout_says_that_cudnn_is_not_used(device, flags, noted):
    from braid.arguments import parse_args
    from braid.training import megatron_difference_notes
    a = parse_args(["--device", device, "--num-layers", "2", "--hidden-size", "32",
                    "--num-attention-heads", "2", "--mock-data", "--vocab-size", "100",
                    "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "1",
                    *flags], 1)
    said = [n for n in megatron_difference_notes(a) if n.startswith("braid: --attention-dropout")]
    assert said == ([] if not noted else [
        "braid: --attention-dropout 0.1 on a GPU: attention runs braid's own kernels, whose mask "
        "every layout draws alike, not cuDNN's (Megatron's default is 0.1; --attention-dropout 0, "
        "as Llama-style scripts give, keeps cuDNN's)"])
