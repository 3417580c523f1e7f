"""pretrain_gpt.py with Megatron-LM's --rampup-batch-size, as real jobs: each iteration's global
batch, the samples consumed and the iteration count are Megatron's, and each step's learning
rate is Megatron's schedule at the samples of the updates before it; the 3D layout trains like
one process; a run stopped inside the ramp resumes on another layout as if it had not
stopped."""

import math
import os
import re
import shutil

import numpy as np
import pytest

from braid.data import BatchLayout

from pretrain_job import LAYOUT_3D, MODEL, jsonl, log_lines, losses, run

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")

# From 4 by 4 to --global-batch-size 16 over the first 100 of 320 samples, warming up over 48.
RAMP = ["--rampup-batch-size", "4", "4", "100", "--train-samples", "320",
        "--lr-warmup-samples", "48", "--lr-decay-style", "cosine", "--log-interval", "1"]
RAMPED = [x for x in MODEL if x not in ("--lr-warmup-iters", "3")] + RAMP


def megatron_steps(start=4, increment=4, ramp_samples=100, global_batch=16, train_samples=320):
    """[(global batch, consumed samples after it)] per iteration, as Megatron-LM counts them:
    RampupBatchsizeNumMicroBatchesCalculator.update before each iteration, and
    update_train_iters for how many there are."""
    per_increment = ramp_samples / ((global_batch - start) // increment)

    def batch_at(consumed):
        if consumed > ramp_samples:
            return global_batch
        return start + int(consumed / per_increment) * increment

    steps, consumed = [], 0
    while consumed <= ramp_samples and consumed <= train_samples:  # the ramp phase
        batch = batch_at(consumed)
        consumed += batch
        steps.append((batch, consumed))
    # The constant phase; a ramp step past train_samples comes back off here (-1).
    constant = (train_samples - consumed) // global_batch
    if constant < 0:
        return steps[:constant]
    for _ in range(constant):
        consumed += global_batch
        steps.append((global_batch, consumed))
    return steps


def test_iteration_counts_are_megatrons_wherever_the_run_ends():
    # --train-samples inside the ramp, at its end, past it, with a partial last batch: braid's
    # count (BatchLayout.steps_between) is update_train_iters', and the samples those
    # iterations read are the oracle's.
    layout = BatchLayout(2, 16, dp_size=2, rampup_batch_size=(4, 4, 100))
    for train_samples in range(4, 400):
        want = megatron_steps(train_samples=train_samples)
        assert layout.steps_between(0, train_samples) == len(want), train_samples
        assert layout.samples_after(len(want)) == (want[-1][1] if want else 0), train_samples


def megatron_lr(update_samples, lr=3e-3, min_lr=0.0, warmup=48, decay=320):
    """Megatron's OptimizerParamScheduler.get_lr (cosine) at a count of samples."""
    if update_samples <= warmup:
        return lr * update_samples / warmup
    ratio = (update_samples - warmup) / (decay - warmup)
    return min_lr + (lr - min_lr) * 0.5 * (math.cos(math.pi * ratio) + 1)


def logged_steps(stdout):
    """{iteration: (global batch size, consumed samples, learning rate, loss)} from the log."""
    out = {}
    for line in log_lines(stdout):
        it = int(re.search(r"iteration +(\d+)/", line).group(1))
        out[it] = (int(re.search(r"global batch size: +(\d+)", line).group(1)),
                   int(re.search(r"consumed samples: +(\d+)", line).group(1)),
                   float(re.search(r"learning rate: ([0-9.E+-]+)", line).group(1)),
                   float(re.search(r"lm loss: ([0-9.E+-]+)", line).group(1)))
    return out


def test_ramp_follows_megatron_and_3d_trains_like_one_process(tmp_path):
    want = megatron_steps()
    assert [b for b, _ in want[:17]] == [4] * 9 + [8] * 4 + [12] * 3 + [16]  # the oracle
    runs = {}
    for name, ranks, layout in (("one", 1, []), ("3d", 8, LAYOUT_3D)):
        tb = str(tmp_path / name)
        r = run(ranks, [*RAMPED, *layout, "--tensorboard-dir", tb], timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert (f"braid: ramping up the global batch size from 4 by 4 to 16 over 100 samples: "
                f"{len(want)} iterations for 320 samples") in r.stdout, r.stdout
        assert "braid: ramping up the global batch size from 12 to 16 at iteration 17" \
            in r.stdout, r.stdout
        steps = logged_steps(r.stdout)
        assert sorted(steps) == list(range(1, len(want) + 1)), r.stdout
        update_samples = 0
        for it, (batch, consumed) in enumerate(want, start=1):
            got_batch, got_consumed, got_lr, _ = steps[it]
            assert (got_batch, got_consumed) == (batch, consumed), f"iteration {it}"
            # The LR a step logs is the schedule's at the samples of its update and those
            # before (Megatron's: the rate after the step, which the next step trains at).
            update_samples += batch
            assert got_lr == pytest.approx(megatron_lr(update_samples), rel=1e-5, abs=1e-12), it
        records = jsonl(os.path.join(tb, "metrics.jsonl"))
        assert {r["step"]: r["batch-size"] for r in records if "batch-size" in r} == \
            {it: b for it, (b, _) in enumerate(want, start=1)}
        runs[name] = losses(records)
    one, three_d = runs["one"], runs["3d"]
    np.testing.assert_allclose([three_d[i] for i in sorted(one)], [one[i] for i in sorted(one)],
                               rtol=2e-4)


# The embedded addition problems through braid's DataLoader (the C++ one), rather than
# --mock-data's loader.
ADDITION = [x for x in RAMPED if x not in ("--mock-data", "--vocab-size", "300", "--seq-length",
                                           "32")] + ["--eval-iters", "0"]


def test_a_run_stopped_inside_the_ramp_resumes_on_another_layout(tmp_path):
    # Stopped after iteration 11 (batches of 8, 52 samples in) on 2 DP ranks, resumed in one
    # process: iterations 12 on - their batches, samples, learning rates and losses - are the
    # uninterrupted run's.
    straight = run(1, ADDITION, timeout=300)
    assert straight.returncode == 0, straight.stdout + straight.stderr
    ckpt = str(tmp_path / "ckpt")
    first = run(2, [*ADDITION, "--save", ckpt, "--exit-interval", "11"], timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "braid: exiting at iteration 11" in first.stdout, first.stdout
    resumed = run(1, [*ADDITION, "--load", ckpt], timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "braid: loaded iteration 11" in resumed.stdout and "(52 samples consumed" \
        in resumed.stdout, resumed.stdout
    want, got = logged_steps(straight.stdout), logged_steps(resumed.stdout)
    assert sorted(got) == list(range(12, len(megatron_steps()) + 1))
    for it in got:
        assert got[it][:2] == want[it][:2], it
        assert got[it][2] == pytest.approx(want[it][2], rel=1e-6), it
    np.testing.assert_allclose([got[it][3] for it in sorted(got)],
                               [want[it][3] for it in sorted(got)], rtol=2e-4)
