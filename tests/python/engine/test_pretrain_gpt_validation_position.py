"""The validation data's position across a resume, as Megatron keeps it: the checkpoint holds
the samples the evaluations have read (consumed_valid_samples), and the resumed job validates on
from there even when it evaluates at another --eval-interval. Jobs of one process on mock data:
a run evaluating every 2 iterations to 8; one that stops at 6 and one resumed from it every 4
iterations, whose evaluation at 8 is the uninterrupted run's fourth (position 3 x --eval-iters
batches) and not the second that 6 // 4 evaluations before it would give. The evaluation at the
end of a run that stops between two counts as Megatron's extra one: not in the position. A checkpoint without the count
(an older braid's) falls back to that derivation, which the last job shows differs."""

import json
import os
import shutil
import sys

import pytest

from pretrain_job import MODEL, REPO, jsonl, run, validation

sys.path.insert(0, os.path.join(REPO, "python"))

import braid  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")

GBS, EVAL_ITERS = 16, 2  # MODEL's --global-batch-size and --eval-iters
COMMON = [*MODEL, "--lr-decay-iters", "8"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("valid_position")

    def job(name, args):
        r = run(1, [*COMMON, "--metrics-jsonl", str(tmp / f"{name}.jsonl"), *args])
        assert r.returncode == 0, r.stdout + r.stderr
        return validation(jsonl(str(tmp / f"{name}.jsonl")))

    out = {"tmp": tmp}
    out["full"] = job("full", ["--train-iters", "8", "--eval-interval", "2"])
    out["part"] = job("part", ["--train-iters", "6", "--eval-interval", "2", "--save",
                               str(tmp / "ckpt"), "--save-interval", "6"])
    out["meta"] = braid.checkpoint_metadata(str(tmp / "ckpt"))
    # Ending between two evaluations: the end-of-run one is Megatron's extra, uncounted one.
    out["odd"] = job("odd", ["--train-iters", "5", "--eval-interval", "2", "--save",
                             str(tmp / "odd")])
    out["odd_meta"] = braid.checkpoint_metadata(str(tmp / "odd"))
    shutil.copytree(tmp / "ckpt", tmp / "old")
    out["resumed"] = job("resumed", ["--train-iters", "8", "--eval-interval", "4", "--load",
                                     str(tmp / "ckpt")])
    # As an older braid saved it: no consumed_valid_samples.
    meta_path = os.path.join(braid.iteration_directory(str(tmp / "old"), 6), "metadata.json")
    with open(meta_path) as f:
        meta = json.load(f)
    del meta["consumed_valid_samples"]
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    out["derived"] = job("derived", ["--train-iters", "8", "--eval-interval", "4", "--load",
                                     str(tmp / "old")])
    return out


def test_the_checkpoint_holds_the_samples_the_evaluations_read(runs):
    assert sorted(runs["part"]) == [2, 4, 6]
    assert runs["meta"]["consumed_valid_samples"] == 3 * EVAL_ITERS * GBS
    assert sorted(runs["odd"]) == [2, 4, 5]
    assert runs["odd_meta"]["consumed_valid_samples"] == 2 * EVAL_ITERS * GBS


def test_a_resume_at_another_interval_validates_from_the_saved_position(runs):
    full, resumed = runs["full"], runs["resumed"]
    assert sorted(full) == [2, 4, 6, 8] and sorted(resumed) == [8]
    assert resumed[8] == full[8]


def test_without_the_count_the_position_follows_from_the_iteration(runs):
    # 6 // 4 = 1 evaluation before: the batches of the uninterrupted run's second evaluation,
    # on the model of iteration 8 - another loss than the saved position's.
    assert sorted(runs["derived"]) == [8]
    assert runs["derived"][8] != runs["full"][8]
