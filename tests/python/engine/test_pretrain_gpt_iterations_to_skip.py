"""Megatron's --iterations-to-skip in pretrain_gpt.py, as real jobs: N drops the batch of the
step logged as N + 1 (Megatron counts the iterations completed before it). The dropped
iteration reads its batch (consumed samples advance) and trains nothing: the checkpoints on
either side hold the same parameters and the same schedule position, its LR is the next step's,
it logs, evaluates, saves and exits nothing, and the end of the run still saves. A run skipping
iterations before and after its resume point equals the uninterrupted one bit for bit; a
pipeline x data-parallel job with ZeRO, async saves, timers and a profile window over a dropped
iteration trains alike; a bad value ends the job with one error line and code 2. The twin run
that skips nothing (its values lie past --train-iters) shows each check can fail."""

import json
import os
import re
import shutil
import sys

import numpy as np
import pytest

from pretrain_job import MODEL, REPO, jsonl, log_lines, losses, run, validation

sys.path.insert(0, os.path.join(REPO, "python"))
sys.path.insert(0, os.path.join(REPO, "tools"))

import braid  # noqa: E402
from braid.arguments import ArgumentError, parse_args  # noqa: E402
from safetensors_numpy import read_safetensors  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")

GBS = 16  # MODEL's --global-batch-size
# Drops iterations 3 (the last of the 3-iteration job) and 5 (after its resume point). The
# decay length is fixed so that the 3-iteration job's schedule is the 6-iteration one's.
SKIP = ["--iterations-to-skip", "2", "4"]
# With dropout: a dropped batch's samples pass, and the next step's masks are its own samples'
# (the resumed job's come from the checkpoint's data position).
COMMON = [*MODEL, "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "1",
          "--lr-decay-iters", "6", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
PP_DP = ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
         "--overlap-grad-reduce"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("skip")
    out = {"tmp": tmp}

    def job(name, ranks, args):
        r = run(ranks, [*COMMON, "--metrics-jsonl", str(tmp / f"{name}.jsonl"), *args])
        assert r.returncode == 0, r.stdout + r.stderr
        out[name] = r.stdout
        out[f"{name}_metrics"] = jsonl(str(tmp / f"{name}.jsonl"))

    save_every = ["--save-interval", "1"]
    job("full", 1, [*SKIP, "--train-iters", "6", "--save", str(tmp / "full"), *save_every])
    job("part", 1, [*SKIP, "--train-iters", "3", "--save", str(tmp / "part"), *save_every])
    job("resumed", 1, [*SKIP, "--train-iters", "6", "--load", str(tmp / "part"), "--save",
                       str(tmp / "part"), *save_every])
    # Values past --train-iters: accepted, and nothing is skipped (as in Megatron).
    job("twin", 1, ["--iterations-to-skip", "6", "100", "--train-iters", "6"])
    # Iteration 5 is a multiple of --exit-interval and dropped: no exit check there.
    job("pp_dp", 4, [*SKIP, *PP_DP, "--train-iters", "6", "--save", str(tmp / "pp_dp"),
                     *save_every, "--async-save", "--exit-interval", "5",
                     "--timing-log-level", "1", "--tensorboard-dir", str(tmp / "tb"),
                     "--profile", "--profile-step-start", "3", "--profile-step-end", "6"])
    return out


def iterations(stdout):
    return [int(re.search(r"iteration +(\d+)/", line).group(1)) for line in log_lines(stdout)]


def tensors(ckpt, iteration):
    found, _ = read_safetensors(os.path.join(ckpt, f"iter_{iteration:07d}",
                                             "mp_rank_00_000.safetensors"))
    return {name: np.array(t.array) for name, t in found.items()}


def test_a_dropped_iteration_logs_one_line_and_trains_nothing(runs):
    full, twin = runs["full"], runs["twin"]
    assert iterations(full) == [1, 2, 4, 6], full
    assert iterations(twin) == [1, 2, 3, 4, 5, 6], twin
    for it, n in ((3, 2), (5, 4)):
        assert f"braid: iteration {it}: its batch of {GBS} samples dropped " \
               f"(--iterations-to-skip {n})" in full, full
    assert "dropped" not in twin
    assert "braid: --iterations-to-skip dropped the batches of 2 iterations in this job; 32 " \
           "samples not trained on in the run" in full, full
    assert "braid: trained 4 iterations" in full and "braid: trained 6 iterations" in twin
    # Consumed samples count the dropped batches; the loss-scale skips do not.
    lines = {it: line for it, line in zip(iterations(full), log_lines(full))}
    for it, consumed, dropped in ((2, 32, 0), (4, 64, GBS), (6, 96, 2 * GBS)):
        assert f"consumed samples: {consumed:12d}" in lines[it], lines[it]
        # Megatron's field, once samples were dropped
        assert (f"| skipped samples: {dropped:12d} |" in lines[it]) == (dropped > 0), lines[it]
        assert "number of skipped iterations:   0" in lines[it], lines[it]
    metrics = runs["full_metrics"]
    assert {r["step"]: r["skipped-train-samples"] for r in metrics
            if "skipped-train-samples" in r} == {4: GBS, 6: 2 * GBS}
    # No evaluation at the dropped iteration 3 (a multiple of --eval-interval); the end's.
    assert sorted(validation(metrics)) == [6]
    assert sorted(validation(runs["twin_metrics"])) == [3, 6]


def test_the_schedule_does_not_advance_and_later_steps_differ(runs):
    full, twin = runs["full_metrics"], runs["twin_metrics"]
    lr = [{r["step"]: r["learning-rate"] for r in m if "learning-rate" in r} for m in (full, twin)]
    # The LR of the step after a dropped one is the one the twin's next update had.
    assert lr[0] == {1: lr[1][1], 2: lr[1][2], 4: lr[1][3], 6: lr[1][4]}
    # Warmup, then linear decay: each step's rate differs from the one before.
    assert all(lr[1][step] != lr[1][step + 1] for step in range(1, 6)), lr[1]
    got, want = losses(full), losses(twin)
    assert got[1] == want[1] and got[2] == want[2]
    assert got[4] != want[4] and got[6] != want[6]


def test_checkpoints_around_a_dropped_iteration(runs):
    part, full = str(runs["tmp"] / "part"), str(runs["tmp"] / "full")
    # Megatron saves nothing at a dropped iteration, even at --save-interval; the end of the
    # run saves (iteration 3, the last of the part job, was dropped).
    assert sorted(d for d in os.listdir(full) if d.startswith("iter_")) == \
        ["iter_0000001", "iter_0000002", "iter_0000004", "iter_0000006"]
    assert sorted(d for d in os.listdir(part) if d.startswith("iter_")) == \
        ["iter_0000001", "iter_0000002", "iter_0000003", "iter_0000004", "iter_0000006"]
    meta = {it: braid.checkpoint_metadata(part, it) for it in (2, 3, 4)}
    assert meta[3]["consumed_samples"] - meta[2]["consumed_samples"] == GBS
    assert meta[3]["trainer"]["iteration"] == 3 and meta[2]["trainer"]["iteration"] == 2
    for key in ("update_samples", "optimizer_steps", "skipped_iterations"):
        assert meta[3]["trainer"][key] == meta[2]["trainer"][key], key
    assert meta[3]["trainer"]["update_samples"] == 2 * GBS
    assert meta[4]["trainer"]["update_samples"] == 3 * GBS
    assert meta[3]["lr_schedule"] == meta[2]["lr_schedule"]
    assert meta[3]["rng"] == meta[2]["rng"]
    # Megatron's skipped_train_samples, kept over the run's jobs
    assert [meta[it]["skipped_train_samples"] for it in (2, 3, 4)] == [0, GBS, GBS]
    two, three, four = (tensors(part, it) for it in (2, 3, 4))
    assert sorted(two) == sorted(three) == sorted(four)
    assert any(name.startswith("optimizer.") for name in two)
    for name in two:  # parameters and optimizer state, bit for bit
        assert np.array_equal(two[name], three[name]), name
    params = [name for name in three if name.startswith("model.")]
    assert len(params) > 10
    changed = [name for name in params if not np.array_equal(three[name], four[name])]
    assert changed == params
    # The resumed job's iteration 4 is the uninterrupted job's.
    full_four = tensors(full, 4)
    for name in four:
        assert np.array_equal(four[name], full_four[name]), name


def test_resumed_run_equals_the_uninterrupted_one(runs):
    assert "braid: loaded iteration 3" in runs["resumed"], runs["resumed"]
    assert iterations(runs["part"]) == [1, 2] and iterations(runs["resumed"]) == [4, 6]
    assert "braid: iteration 5: its batch of 16 samples dropped" in runs["resumed"]
    want = losses(runs["full_metrics"])
    assert losses(runs["part_metrics"]) == {1: want[1], 2: want[2]}
    assert losses(runs["resumed_metrics"]) == {4: want[4], 6: want[6]}
    # The validation position leaves out the evaluation the dropped iteration 3 did not run.
    assert validation(runs["resumed_metrics"]) == validation(runs["full_metrics"])
    # The skipped samples count on from the checkpoint's (the dropped iteration 3 of the first
    # job, then 5): the log field and metric as the uninterrupted run's.
    def skipped(name):
        return {r["step"]: r["skipped-train-samples"] for r in runs[f"{name}_metrics"]
                if "skipped-train-samples" in r}
    assert skipped("resumed") == {4: GBS, 6: 2 * GBS} == {k: v for k, v in skipped("full").items()
                                                          if k > 3}
    assert f"| skipped samples: {2 * GBS:12d} |" in log_lines(runs["resumed"])[-1]
    assert "dropped the batches of 1 iteration in this job; 32 samples not trained on in the " \
        "run" in runs["resumed"], runs["resumed"]


def test_pipeline_and_data_parallel_drop_the_same_iterations(runs):
    out, tmp = runs["pp_dp"], runs["tmp"]
    assert "pp=2 dp=2" in out and iterations(out) == [1, 2, 4, 6], out
    assert "exiting" not in out
    got, want = losses(runs["pp_dp_metrics"]), losses(runs["full_metrics"])
    assert sorted(got) == [1, 2, 4, 6]
    np.testing.assert_allclose([got[i] for i in sorted(got)], [want[i] for i in sorted(got)],
                               rtol=2e-4)
    assert sorted(d for d in os.listdir(tmp / "pp_dp") if d.startswith("iter_")) == \
        ["iter_0000001", "iter_0000002", "iter_0000004", "iter_0000006"]
    meta = braid.checkpoint_metadata(str(tmp / "pp_dp"), 6)
    assert meta["consumed_samples"] == 6 * GBS and meta["trainer"]["update_samples"] == 4 * GBS
    # The profile window [3, 6) holds one trained iteration, 4; it ends at the dropped 5.
    assert "braid: rank 0 traced iterations 3 to 5:" in out, out
    with open(tmp / "tb" / "traces" / "rank0.json") as f:
        events = json.load(f)["traceEvents"]
    assert len([e for e in events if e.get("ph") == "X" and e["cat"] == "step"]) == 1
    assert out.count("time across ranks (ms):") == 4  # the timers of each log line


@pytest.mark.parametrize("value, message", [
    ("-1", "argument --iterations-to-skip: must be >= 0, got -1"),
    ("3.5", "argument --iterations-to-skip: invalid non-negative int value: '3.5'")])
def test_a_bad_value_ends_the_job_with_one_line(value, message):
    r = run(1, [*COMMON, "--train-iters", "6", "--iterations-to-skip", "2", value], timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines()[-1] == f"braid: error: {message}", r.stderr


def test_arguments():
    base = ["--mock-data", "--vocab-size", "300", "--seq-length", "32", "--train-iters", "6"]
    assert parse_args(base, 1).iterations_to_skip == []
    assert parse_args([*base, "--iterations-to-skip", "0", "5", "5", "99"], 1) \
        .iterations_to_skip == [0, 5, 5, 99]
    with pytest.raises(ArgumentError, match="expected at least one argument"):
        parse_args([*base, "--iterations-to-skip"], 1)
