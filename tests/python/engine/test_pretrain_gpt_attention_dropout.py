"""pretrain_gpt.py --attention-dropout (Megatron's flag and default, 0.1), as real jobs: the
probabilities' mask is a function of the sequence, head and positions alone, so tensor
(with sequence parallelism), context and pipeline parallelism train exactly like one process
with it; a run saved under tp 2 resumes in one process where that process would be; and the
dropout is really applied (the losses differ from --attention-dropout 0)."""

import os
import shutil

import numpy as np
import pytest

from pretrain_job import MODEL, jsonl, losses, run, run_layouts

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")

# Hidden dropout stays 0 (MODEL's): context parallelism draws other hidden masks than one process.
DROPPED = [*MODEL, "--attention-dropout", "0.3"]
LAYOUTS = [("one", 1, []),
           ("tp2_sp", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
           ("cp2", 2, ["--context-parallel-size", "2"]),
           ("pp2", 2, ["--pipeline-model-parallel-size", "2"]),
           ("off", 1, ["--attention-dropout", "0"])]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_layouts(tmp_path_factory.mktemp("attention_dropout"), DROPPED, LAYOUTS)[0]


def test_default_is_megatrons():
    from braid.arguments import parse_args
    assert parse_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
                       "--mock-data", "--vocab-size", "100", "--seq-length", "16",
                       "--micro-batch-size", "1", "--train-iters", "1"], 1).attention_dropout == 0.1


@pytest.mark.parametrize("layout", ["tp2_sp", "cp2", "pp2"])
def test_layouts_train_like_one_process(runs, layout):
    want, got = losses(runs["one"]), losses(runs[layout])
    assert sorted(want) == sorted(got) == list(range(1, 21))
    np.testing.assert_allclose([got[i] for i in range(1, 21)], [want[i] for i in range(1, 21)],
                               rtol=1e-5, err_msg=layout)


def test_the_dropout_is_applied(runs):
    dropped, off = losses(runs["one"]), losses(runs["off"])
    assert all(dropped[i] != off[i] for i in range(1, 21)), (dropped, off)
    # Near the initialisation the probabilities are close to uniform and the dropout changes
    # little; by the end the runs have drifted apart.
    drift = np.mean([abs(dropped[i] - off[i]) / off[i] for i in range(11, 21)])
    assert drift > 1e-3, (drift, dropped, off)


def test_a_tensor_parallel_checkpoint_resumes_in_one_process(runs, tmp_path):
    # The masks follow the samples: the checkpoint's data position puts the resumed process
    # where the uninterrupted one drew them.
    ckpt, tb = str(tmp_path / "ckpt"), str(tmp_path / "tb")
    r = run(2, [*DROPPED, "--tensor-model-parallel-size", "2", "--train-iters", "20",
                "--eval-iters", "0", "--exit-interval", "10", "--save", ckpt,
                "--save-interval", "10"])
    assert r.returncode == 0, r.stdout + r.stderr
    r = run(1, [*DROPPED, "--train-iters", "20", "--eval-iters", "0", "--load", ckpt,
                "--tensorboard-dir", tb])
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
