"""Megatron-LM's --multiple-validation-sets and --full-validation in pretrain_gpt.py, as real
jobs on small .bin/.idx datasets (braid.validation_sets, docs/data.md "Validation sets").

Every job trains alike (the same --train-data-path and seed), so a validation loss depends only
on the batches it reads: with --multiple-validation-sets each set's loss is the loss of a job
whose --valid-data-path is that prefix alone, under Megatron's `validation-{i}` line and tags,
and a resumed job continues each set where it stood; with --full-validation each evaluation
reads every full global batch of one epoch of the set, which is the loss of a job evaluating that
many batches once, at the same iteration; both together, and on a pipeline x data-parallel job
of 4 ranks, give the same losses. The flag combinations Megatron cannot run are refused with one
error line and code 2."""

import math
import os
import re
import shutil
import sys

import numpy as np
import pytest

from pretrain_job import REPO, jsonl, run, write_documents

sys.path.insert(0, os.path.join(REPO, "python"))

from braid.arguments import ArgumentError, parse_args  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")

SEQ, GBS = 32, 16
# name: (documents, tokens below, seed). Training reads tokens below 100, like set B: after a
# few steps at this LR B's loss is well below A's (the sets cannot be told apart otherwise).
DATASETS = {"train": (200, 100, 0), "A": (60, 1000, 1), "B": (40, 100, 2), "tiny": (6, 100, 3)}
EPOCH = {}  # name -> samples of one epoch (Megatron's: (tokens - 1) // seq_length)
COMMON = ["--device", "cpu", "--num-layers", "2", "--hidden-size", "32",
          "--num-attention-heads", "2", "--hidden-dropout", "0", "--attention-dropout", "0",
          "--vocab-size", "1000",
          "--seq-length", str(SEQ),
          "--micro-batch-size", "4", "--global-batch-size", str(GBS), "--lr", "1e-2",
          "--lr-warmup-iters", "1", "--lr-decay-iters", "4", "--log-interval", "2",
          "--eval-interval", "2", "--eval-iters", "2"]
PP_DP = ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
         "--overlap-grad-reduce"]
LINE = re.compile(r"^ validation(-\d)? loss at iteration (\d+)( on test set)? \| lm loss value: "
                  r"([0-9.E+-]+) \| lm loss PPL: ([0-9.E+-]+) \| $", re.MULTILINE)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("validation_sets")
    out = {"tmp": tmp}
    for name, (documents, high, seed) in DATASETS.items():
        out[name] = str(tmp / name)
        EPOCH[name] = (write_documents(out[name], documents, high, seed) - 1) // SEQ
    # Both sets end with a partial global batch, which --full-validation leaves out.
    assert EPOCH["A"] % GBS and EPOCH["B"] % GBS and EPOCH["tiny"] < GBS, EPOCH
    return out


@pytest.fixture(scope="module")
def runs(paths):
    tmp, out = paths["tmp"], {}
    train = ["--train-data-path", paths["train"], "--data-cache-path", str(tmp / "cache")]

    def job(name, args, ranks=1):
        r = run(ranks, [*COMMON, *train, "--train-iters", "4", *args,
                        "--metrics-jsonl", str(tmp / f"{name}.jsonl")])
        assert r.returncode == 0, r.stdout + r.stderr
        out[name] = (r.stdout, jsonl(str(tmp / f"{name}.jsonl")))

    a, b = paths["A"], paths["B"]
    multi = ["--valid-data-path", a, b, "--multiple-validation-sets"]
    job("multi", multi)
    job("A", ["--valid-data-path", a])
    job("B", ["--valid-data-path", b])
    ckpt = str(tmp / "ckpt")
    # The same --train-iters (which size the validation sets), ending at iteration 2.
    job("part", [*multi, "--save", ckpt, "--save-interval", "2", "--exit-interval", "2"])
    job("resumed", [*multi, "--load", ckpt, "--save", ckpt, "--save-interval", "2"])
    once = ["--eval-interval", "100"]  # the end's evaluation alone: one epoch suffices
    test = ["--test-data-path", b, "--eval-iters", "1"]
    job("full_A", ["--valid-data-path", a, "--full-validation", *test])
    job("full_A_0", ["--valid-data-path", a, "--full-validation", "--test-data-path", b,
                     "--eval-iters", "0"])
    job("K_A", ["--valid-data-path", a, "--eval-iters", str(EPOCH["A"] // GBS), *once])
    job("K_B", ["--valid-data-path", b, "--eval-iters", str(EPOCH["B"] // GBS), *once])
    both = [*multi, "--full-validation", *test]
    job("both", both)
    job("pp_dp", [*both, *PP_DP], ranks=4)
    return out


def evaluations(stdout):
    """{(suffix, iteration, test): (loss, ppl)} of Megatron's evaluation lines."""
    return {(m[0], int(m[1]), bool(m[2])): (float(m[3]), float(m[4]))
            for m in LINE.findall(stdout)}


def metric(records, tag):
    """{step: value}; at a step evaluated twice (the last iteration, then Megatron's final
    "on validation set"), the first."""
    out = {}
    for r in records:
        if tag in r:
            out.setdefault(r["step"], r[tag])
    return out


def test_each_set_has_its_own_loss_line_and_tags(runs):
    stdout, records = runs["multi"]
    lines = evaluations(stdout)
    assert sorted(lines) == [("-0", 2, False), ("-0", 4, False), ("-1", 2, False),
                             ("-1", 4, False)], stdout
    assert " validation loss at" not in stdout  # no blended, unsuffixed loss
    # After the last save, Megatron's final evaluation of each set (on its next batches).
    assert all(f" validation-{i} loss at iteration 4 on validation set | " in stdout
               for i in (0, 1)), stdout
    tags = {tag for r in records for tag in r if "validation" in tag}
    assert tags == {"lm loss validation-0", "lm loss validation-0 ppl",
                    "lm loss validation-1", "lm loss validation-1 ppl"}
    for i in (0, 1):
        loss, ppl = (metric(records, f"lm loss validation-{i}{p}") for p in ("", " ppl"))
        assert sorted(loss) == sorted(ppl) == [2, 4]
        for it in (2, 4):
            assert ppl[it] == pytest.approx(math.exp(loss[it]), rel=1e-12)
            assert lines[(f"-{i}", it, False)] == (pytest.approx(loss[it], rel=1e-6),
                                                   pytest.approx(ppl[it], rel=1e-6))
    # The runs' notes name each set and what an evaluation reads.
    assert re.search(r"^braid: lm loss validation-0: \S+/A \(\d+ samples\): 2 global batches of "
                     r"16 per evaluation$", stdout, re.MULTILINE), stdout
    assert "Megatron-LM refuses this while training" in stdout


def test_each_set_is_the_loss_of_that_prefix_alone(runs):
    multi = runs["multi"][1]
    for i, alone in ((0, "A"), (1, "B")):
        want = metric(runs[alone][1], "lm loss validation")
        got = metric(multi, f"lm loss validation-{i}")
        assert sorted(want) == sorted(got) == [2, 4]
        for it in (2, 4):
            assert got[it] == pytest.approx(want[it], rel=1e-6, abs=0), (i, it)
    # The two sets are told apart: B, like the training data, is learnt; A is not.
    got = [metric(multi, f"lm loss validation-{i}")[4] for i in (0, 1)]
    assert got[0] - got[1] > 0.05, got


def test_a_resumed_job_continues_each_set_where_it_stood(runs):
    # The evaluation at iteration 4 reads each set's global batches 2 and 3: the resumed job's
    # too, though its loaders start at iteration 2 (batches 0 and 1 give another loss).
    multi, part, resumed = (runs[n][1] for n in ("multi", "part", "resumed"))
    for i in (0, 1):
        tag = f"lm loss validation-{i}"
        assert metric(part, tag) == {2: pytest.approx(metric(multi, tag)[2], rel=1e-6)}
        assert metric(resumed, tag) == {4: pytest.approx(metric(multi, tag)[4], rel=1e-6)}


def test_full_validation_reads_every_full_global_batch_of_an_epoch(runs, paths):
    stdout, records = runs["full_A"]
    k, rest = divmod(EPOCH["A"], GBS)
    assert f"braid: lm loss validation: {paths['A']} ({EPOCH['A']} samples): all {k} full " \
           f"global batches of {GBS} per evaluation (the last {rest} samples are not " \
           f"evaluated)" in stdout, stdout
    full = metric(records, "lm loss validation")
    assert sorted(full) == [2, 4]
    # A job evaluating the first K global batches once, at iteration 4, on the same epoch.
    once = metric(runs["K_A"][1], "lm loss validation")
    assert sorted(once) == [4]
    assert full[4] == pytest.approx(once[4], rel=1e-6, abs=0)
    # The end's test evaluation is --eval-iters batches of the test split, one unsuffixed line.
    lines = evaluations(stdout)
    assert sorted(lines) == [("", 2, False), ("", 4, False), ("", 4, True)], stdout
    assert sorted(metric(records, "lm loss test")) == [4]
    # It validates whatever --eval-iters says; --eval-iters 0 leaves no test evaluation.
    stdout, records = runs["full_A_0"]
    assert metric(records, "lm loss validation") == {
        it: pytest.approx(full[it], rel=1e-6, abs=0) for it in (2, 4)}
    assert sorted(evaluations(stdout)) == [("", 2, False), ("", 4, False)], stdout


def test_both_flags_together(runs):
    both, full_a, k_b = (runs[n][1] for n in ("both", "full_A", "K_B"))
    stdout = runs["both"][0]
    for i, name in ((0, "A"), (1, "B")):
        k, rest = divmod(EPOCH[name], GBS)
        assert re.search(rf"^braid: lm loss validation-{i}: \S+/{name} \({EPOCH[name]} samples\)"
                         rf": all {k} full global batches of {GBS} per evaluation \(the last "
                         rf"{rest} samples are not evaluated\)$", stdout, re.MULTILINE), stdout
    got = metric(both, "lm loss validation-0")
    want = metric(full_a, "lm loss validation")
    assert sorted(got) == sorted(want) == [2, 4]
    for it in (2, 4):
        assert got[it] == pytest.approx(want[it], rel=1e-6, abs=0)
    got = metric(both, "lm loss validation-1")
    assert sorted(got) == [2, 4]
    assert got[4] == pytest.approx(metric(k_b, "lm loss validation")[4], rel=1e-6, abs=0)
    assert sorted(evaluations(stdout)) == [("", 4, True), ("-0", 2, False), ("-0", 4, False),
                                           ("-1", 2, False), ("-1", 4, False)], stdout
    assert metric(both, "lm loss test") == {4: pytest.approx(metric(full_a, "lm loss test")[4],
                                                             rel=1e-6)}


def test_a_pipeline_by_data_parallel_job_gives_the_one_process_losses(runs):
    stdout, records = runs["pp_dp"]
    assert "tp=1 pp=2 dp=2" in stdout, stdout
    one = runs["both"][1]
    for tag in ("lm loss", "lm loss validation-0", "lm loss validation-1", "lm loss test"):
        got, want = metric(records, tag), metric(one, tag)
        assert sorted(got) == sorted(want) and got, tag
        np.testing.assert_allclose([got[i] for i in sorted(got)],
                                   [want[i] for i in sorted(want)], rtol=2e-4, err_msg=tag)


def refused(argv):
    with pytest.raises(ArgumentError) as e:
        parse_args(argv, 1)
    return str(e.value)


def test_refused_combinations(paths):
    a, b, train = paths["A"], paths["B"], paths["train"]
    plain = [*COMMON, "--train-data-path", train]
    # The sets are --valid-data-path's prefixes: none without it.
    for data in (["--data-path", a, b], ["--mock-data"]):
        args = [*COMMON, *data, "--multiple-validation-sets"]
        assert "--multiple-validation-sets evaluates each prefix of --valid-data-path as its own " \
               "set: give --valid-data-path" in refused(args)
    # Megatron's help: "This argument requires that no weights are included in the list".
    message = refused([*plain, "--valid-data-path", "0.5", a, "0.5", b,
                       "--multiple-validation-sets"])
    assert f"--multiple-validation-sets: --valid-data-path 0.5 {a} 0.5 {b} has weights" in message
    # A weighted blend's size is a number of samples: no epoch to read.
    message = refused([*plain, "--valid-data-path", "0.5", a, "0.5", b, "--full-validation"])
    assert message.startswith("--full-validation reads one epoch of each validation dataset; "
                              f"--valid-data-path 0.5 {a} 0.5 {b} is a weighted blend")
    message = refused([*COMMON, "--data-path", "0.5", a, "0.5", b, "--full-validation"])
    assert f"--data-path 0.5 {a} 0.5 {b} is a weighted blend" in message
    assert "--eval-iters > 0 (or --full-validation)" in refused(
        [*plain, "--valid-data-path", a, "--skip-train", "--eval-iters", "0"])
    # What megatron-core builds: accepted.
    for extra in (["--valid-data-path", "1", a, "--full-validation"],
                  ["--valid-data-path", a, b, "--full-validation"],
                  ["--valid-data-path", a, b, "--full-validation", "--multiple-validation-sets"],
                  ["--data-path", a, b, "--full-validation"],
                  ["--valid-data-path", a, "--skip-train", "--eval-iters", "0",
                   "--full-validation"]):
        args = parse_args([*(COMMON if extra[0] == "--data-path" else plain), *extra], 1)
        assert args.validates


def test_errors_end_every_rank_with_one_line_and_code_2(paths):
    r = run(2, [*COMMON, "--train-data-path", paths["train"], "--multiple-validation-sets",
                "--train-iters", "2"])
    assert r.returncode == 2, r.stdout + r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("braid: error:")]
    assert len(errors) == 2 and len(set(errors)) == 1, r.stderr
    assert "give --valid-data-path" in errors[0]
    # Found from the datasets, after MPI is up: a set holding less than one global batch.
    r = run(2, [*COMMON, "--train-data-path", paths["train"], "--valid-data-path",
                paths["tiny"], "--full-validation", "--train-iters", "2",
                "--data-cache-path", str(paths["tmp"] / "cache")])
    assert r.returncode == 2, r.stdout + r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("braid: error:")]
    assert errors == [f"braid: error: --full-validation: the validation set {paths['tiny']} "
                      f"holds {EPOCH['tiny']} samples, less than one global batch ({GBS}): "
                      "nothing to evaluate"] * 2, r.stderr
