"""pretrain_gpt.py end to end, as real MPI jobs: a 3D layout (tp 2, pp 2, dp 2, sequence
parallel, ZeRO) trains, validates, writes TensorBoard files that tensorboard's own reader loads,
saves, and resumed from its checkpoint continues exactly (losses and validation loss, read from
the JSONL metrics at full precision); the same model trains alike in one process; --data-path
reads the valid split; bad or unsupported arguments end every rank with one error line."""

import json
import math
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from mpi_job import mpi_env

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
SCRIPT = os.path.join(REPO, "pretrain_gpt.py")

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")

# On the CPU ranks even where a GPU is visible (BRAID_TEST_DEVICE=cuda): 8 ranks cannot share
# one GPU under NCCL.
MODEL = ["--device", "cpu", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--group-query-attention", "--num-query-groups", "2", "--swiglu",
         "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--hidden-dropout", "0",
         "--mock-data", "--vocab-size", "300", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "16", "--lr", "3e-3",
         "--lr-warmup-iters", "3", "--distributed-timeout-minutes", "1", "--log-interval", "5",
         "--eval-interval", "10", "--eval-iters", "2"]
LAYOUT_3D = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
             "--sequence-parallel", "--use-distributed-optimizer", "--overlap-grad-reduce"]


env = mpi_env


def run(ranks: int, args: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    cmd = [sys.executable, SCRIPT, *args]
    if ranks > 1:
        cmd = ["mpirun", "-np", str(ranks), "--oversubscribe", *cmd]
    return subprocess.run(cmd, env=env(), cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["lm loss"] for r in records if "lm loss" in r}


def validation(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["lm loss validation"] for r in records if "lm loss validation" in r}


def log_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if re.search(r"\] iteration +\d+/", line)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pretrain")
    full_tb, part_tb, resumed_tb = (str(tmp / n) for n in ("full_tb", "part_tb", "resumed_tb"))
    ckpt = str(tmp / "ckpt")
    # The full run also times its steps (--timing-log-level 2): the resumed run, untraced,
    # must still match it bit for bit.
    full = run(8, [*MODEL, *LAYOUT_3D, "--train-iters", "20", "--tensorboard-dir", full_tb,
                   "--gpu-hour-price", "2.5", "--timing-log-level", "2",
                   "--log-timers-to-tensorboard", "--log-params-norm"])
    assert full.returncode == 0, full.stdout + full.stderr
    part = run(8, [*MODEL, *LAYOUT_3D, "--train-iters", "20", "--save", ckpt, "--save-interval",
                   "10", "--exit-interval", "10", "--tensorboard-dir", part_tb])
    assert part.returncode == 0, part.stdout + part.stderr
    resumed = run(8, [*MODEL, *LAYOUT_3D, "--train-iters", "20", "--load", ckpt,
                      "--tensorboard-dir", resumed_tb])
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    return dict(full=full, part=part, resumed=resumed, full_tb=full_tb, part_tb=part_tb,
                resumed_tb=resumed_tb, ckpt=ckpt)


def test_3d_run_logs_megatron_lines_and_validates(runs):
    out = runs["full"].stdout
    lines = log_lines(out)
    assert len(lines) == 4, out  # iterations 5, 10, 15, 20 from rank 0 alone
    for field in ("consumed samples:", "elapsed time per iteration (ms):", "learning rate:",
                  "global batch size:    16", "lm loss:", "loss scale:", "grad norm:",
                  "number of skipped iterations:", "number of nan iterations:",
                  "tokens per second:", "throughput per device (TFLOP/s):", "MFU:",
                  "peak memory (MB):", "cost:"):
        assert all(field in line for line in lines), (field, lines[0])
    assert "iteration       20/      20 | consumed samples:          320" in lines[-1]
    assert "tp=2 pp=2 dp=2" in out
    # Validation at iteration 10 and at the end, every value finite.
    vals = re.findall(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)", out)
    assert [int(i) for i, _ in vals] == [10, 20], out
    assert all(math.isfinite(float(v)) for _, v in vals)
    # The cost: 8 devices x 2.5 per hour; the final line names it.
    final = [line for line in out.splitlines() if line.startswith("braid: trained 20 iterations")]
    assert len(final) == 1 and "2.5 per device-hour x 8 devices" in final[0], out


TIMERS = ["step", "compute", "pipeline-wait", "comm-wait", "tp-comm-wait", "dp-comm-wait",
          "other-comm-wait"]


def test_timers_say_where_the_step_time_went(runs):
    out = runs["full"].stdout
    blocks = re.findall(r"\(min, max\) time across ranks \(ms\):\n((?:    .*\n)+)", out)
    assert len(blocks) == 4, out  # one per log line
    for block in blocks:
        timers = {m[0]: (float(m[1]), float(m[2]))
                  for m in re.findall(r"    (\S+) \.+: \(([0-9.]+), ([0-9.]+)\)", block)}
        assert list(timers) == TIMERS, block
        assert all(lo <= hi for lo, hi in timers.values()), block
    records = [r for r in jsonl(os.path.join(runs["full_tb"], "metrics.jsonl"))
               if "step-time" in r]
    assert [r["step"] for r in records] == [5, 10, 15, 20]
    for r in records:
        # tp 2, pp 2, dp 2: every rank waits on each group at some point of every step.
        for name in ("pipeline-wait", "tp-comm-wait", "dp-comm-wait", "other-comm-wait"):
            assert r[f"{name}-time"] > 0, (name, r)
        assert 0 < r["compute-time-mean"] < r["step-time-mean"]
    # Untraced runs print no timers.
    assert "time across ranks" not in runs["part"].stdout


def test_tensorboard_files_load_in_tensorboard(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(runs["full_tb"])
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("lm loss", "learning-rate", "grad-norm", "loss-scale", "throughput", "mfu",
                "tokens-per-sec", "lm loss validation", "cost"):
        assert tag in tags, tags
    loss = acc.Scalars("lm loss")
    assert [e.step for e in loss] == list(range(1, 21))
    records = jsonl(os.path.join(runs["full_tb"], "metrics.jsonl"))
    # The event file and the JSONL file hold the same values (event files store float32).
    for event in loss:
        assert event.value == pytest.approx(losses(records)[event.step], rel=1e-6)
    assert [e.step for e in acc.Scalars("lm loss validation")] == [10, 20]


def test_plot_metrics_draws_the_run(runs, tmp_path):
    out = tmp_path / "plots"
    r = subprocess.run([sys.executable, os.path.join(REPO, "tools", "plot_metrics.py"),
                        runs["full_tb"], "--out", str(out)], env=env(), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("lm_loss.png", "learning-rate.png", "throughput.png", "lm_loss_validation.png"):
        png = out / name
        assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_resume_continues_exactly(runs):
    full = jsonl(os.path.join(runs["full_tb"], "metrics.jsonl"))
    part = jsonl(os.path.join(runs["part_tb"], "metrics.jsonl"))
    resumed = jsonl(os.path.join(runs["resumed_tb"], "metrics.jsonl"))
    assert "braid: exiting at iteration 10 (--exit-interval)" in runs["part"].stdout
    assert "braid: loaded iteration 10" in runs["resumed"].stdout, runs["resumed"].stdout
    assert sorted(losses(part)) == list(range(1, 11))
    assert sorted(losses(resumed)) == list(range(11, 21))
    want = losses(full)
    assert losses(part) == {i: want[i] for i in range(1, 11)}
    assert losses(resumed) == {i: want[i] for i in range(11, 21)}
    # Validation resumes at the position Megatron's formula gives: the same batches.
    assert validation(resumed) == {20: validation(full)[20]}
    assert validation(part) == {10: validation(full)[10]}


def test_use_checkpoint_args_takes_the_model_from_the_checkpoint(runs, tmp_path):
    # Megatron's --use-checkpoint-args: the model's shape comes from the checkpoint, so the
    # resumed run names none of MODEL's model flags and continues exactly like the full run.
    model_flags = {"--num-layers": 1, "--hidden-size": 1, "--num-attention-heads": 1,
                   "--group-query-attention": 0, "--num-query-groups": 1, "--swiglu": 0,
                   "--normalization": 1, "--position-embedding-type": 1,
                   "--untie-embeddings-and-output-weights": 0, "--disable-bias-linear": 0,
                   "--vocab-size": 1}
    rest, skip = [], 0
    for arg in MODEL:
        if skip:
            skip -= 1
        elif arg in model_flags:
            skip = model_flags[arg]
        else:
            rest.append(arg)
    tb = str(tmp_path / "tb")
    r = run(8, [*rest, *LAYOUT_3D, "--train-iters", "20", "--load", runs["ckpt"],
                "--use-checkpoint-args", "--tensorboard-dir", tb])
    assert r.returncode == 0, r.stdout + r.stderr
    # Only the values that change are noted: --num-layers is 4 on both sides.
    assert not re.search(r"^braid: --num-layers \S+ from the checkpoint", r.stdout, re.M)
    for note in ("--hidden-size 64 from the checkpoint (the command line: 128)",
                 "--swiglu True from the checkpoint (the command line: False)",
                 "--vocab-size 300 from the checkpoint (the command line: None)"):
        assert f"braid: {note}" in r.stdout, r.stdout
    want = losses(jsonl(os.path.join(runs["full_tb"], "metrics.jsonl")))
    assert losses(jsonl(os.path.join(tb, "metrics.jsonl"))) == {i: want[i] for i in range(11, 21)}


def test_exit_cost_stops_the_run_and_counts_over_its_jobs(tmp_path):
    # At 3600 per device-hour a device-second costs 1: --exit-cost 8 stops a long run after
    # about 8 s, saving; the checkpoint carries the 8+ device-seconds used, so a job resumed
    # under the same budget does not train, and one with more budget counts on from there.
    sys.path.insert(0, os.path.join(REPO, "python"))
    import braid

    ckpt = str(tmp_path / "ckpt")
    budget = [*MODEL, "--eval-iters", "0", "--gpu-hour-price", "3600", "--save", ckpt]
    first = run(1, [*budget, "--train-iters", "100000", "--exit-cost", "8"])
    assert first.returncode == 0, first.stdout + first.stderr
    stop = re.search(r"braid: exiting at iteration (\d+) \(--exit-cost 8.0\); checkpoint saved",
                     first.stdout)
    assert stop and 0 < int(stop.group(1)) < 100000, first.stdout
    spent = braid.checkpoint_metadata(ckpt)["device_seconds"]
    assert spent >= 8.0  # the stop comes once the budget is reached, the save after it
    again = run(1, [*budget, "--train-iters", "100000", "--exit-cost", "8", "--load", ckpt])
    assert again.returncode == 0, again.stdout + again.stderr
    assert "braid: --exit-cost 8.0 is spent already" in again.stdout and "iteration " \
        not in again.stdout.split("loaded iteration")[-1], again.stdout
    assert braid.latest_iteration(ckpt) == int(stop.group(1))
    more = int(stop.group(1)) + 2
    last = run(1, [*budget, "--train-iters", str(more), "--exit-cost", "1e9", "--load", ckpt])
    assert last.returncode == 0, last.stdout + last.stderr
    assert "device-hours of the run's earlier jobs" in last.stdout, last.stdout
    assert braid.latest_iteration(ckpt) == more
    assert braid.checkpoint_metadata(ckpt)["device_seconds"] > spent


def test_no_save_optim_and_rng(tmp_path):
    # Megatron's --no-save-optim / --no-save-rng: parameters only; loading such a checkpoint
    # to resume asks for --no-load-optim (or --finetune), and then trains on from it.
    sys.path.insert(0, os.path.join(REPO, "python"))
    import braid

    ckpt = str(tmp_path / "ckpt")
    r = run(1, [*MODEL, "--train-iters", "4", "--eval-iters", "0", "--save", ckpt,
                "--no-save-optim", "--no-save-rng"])
    assert r.returncode == 0, r.stdout + r.stderr
    meta = braid.checkpoint_metadata(ckpt)
    assert meta["optimizer"] is False and "rng" not in meta
    assert meta["tensors"] and not any(k.startswith("optimizer.") for k in meta["tensors"])
    again = [*MODEL, "--train-iters", "6", "--eval-iters", "0", "--load", ckpt]
    r = run(1, again)
    assert r.returncode == 2 and "saved without optimizer state; load with --no-load-optim" \
        in r.stderr, r.stdout + r.stderr
    r = run(1, [*again, "--no-load-optim", "--no-load-rng"])
    assert r.returncode == 0 and "braid: loaded iteration 4" in r.stdout, r.stdout + r.stderr


def test_sample_based_learning_rate_schedule(tmp_path):
    # Megatron's --train-samples with --lr-warmup-samples / --lr-decay-samples that global batches
    # of 16 do not divide: its scheduler counts samples, and step s runs at (s - 1) x 16 of them.
    tb = str(tmp_path / "tb")
    r = run(1, [*[x for x in MODEL if x not in ("--lr-warmup-iters", "3")], "--train-samples",
                "200", "--lr-warmup-samples", "40", "--lr-decay-samples", "150", "--min-lr",
                "3e-4", "--eval-iters", "0", "--tensorboard-dir", tb])
    assert r.returncode == 0, r.stdout + r.stderr
    lrs = {rec["step"]: rec["learning-rate"] for rec in jsonl(os.path.join(tb, "metrics.jsonl"))
           if "learning-rate" in rec}
    assert sorted(lrs) == list(range(1, 13))  # 200 // 16 iterations
    for step, lr in lrs.items():
        samples = (step - 1) * 16
        if samples <= 40:
            want = 3e-3 * samples / 40
        elif samples > 150:
            want = 3e-4
        else:
            ratio = (samples - 40) / (150 - 40)
            want = 3e-4 + (3e-3 - 3e-4) * 0.5 * (math.cos(math.pi * ratio) + 1)
        assert lr == pytest.approx(want, rel=1e-5, abs=1e-12), step


def test_skip_train_evaluates_a_checkpoint(runs, tmp_path):
    # Megatron's --skip-train: load, evaluate, exit - on another layout than the one that saved.
    r = run(2, [*MODEL, "--pipeline-model-parallel-size", "2", "--train-iters", "20", "--load",
                runs["ckpt"], "--skip-train"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "braid: loaded iteration 10" in r.stdout and not log_lines(r.stdout), r.stdout
    vals = re.findall(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)",
                      r.stdout)
    assert [int(i) for i, _ in vals] == [10] and math.isfinite(float(vals[0][1])), r.stdout
    assert "braid: trained" not in r.stdout


def test_warmup_stable_decay_schedule(tmp_path):
    # Megatron's --lr-decay-style WSD: warm up from --lr-warmup-init, hold the peak, anneal over
    # the last --lr-wsd-decay-iters (here cosine) down to --min-lr. Step s runs at s - 1.
    tb = str(tmp_path / "tb")
    args = [x for x in MODEL if x not in ("--lr-warmup-iters", "3")]
    r = run(1, [*args, "--train-iters", "12", "--lr-warmup-iters", "2", "--lr-warmup-init",
                "1e-4", "--lr-decay-style", "WSD", "--lr-wsd-decay-style", "cosine",
                "--lr-wsd-decay-iters", "4", "--min-lr", "3e-4", "--eval-iters", "0",
                "--tensorboard-dir", tb])
    assert r.returncode == 0, r.stdout + r.stderr
    lrs = {rec["step"]: rec["learning-rate"] for rec in jsonl(os.path.join(tb, "metrics.jsonl"))
           if "learning-rate" in rec}
    for step, lr in lrs.items():
        it = step - 1
        if it <= 2:
            want = 1e-4 + (3e-3 - 1e-4) * it / 2
        elif it <= 12 - 4:
            want = 3e-3
        else:
            q = (it - 8) / 4
            want = 3e-4 + (3e-3 - 3e-4) * 0.5 * (math.cos(math.pi * q) + 1)
        assert lr == pytest.approx(want, rel=1e-5), step


def test_weight_decay_schedule(tmp_path):
    # Megatron's --start/--end-weight-decay: a schedule from 0.1 to 0.1 is --weight-decay 0.1,
    # bit for bit; one from 0 rising is --weight-decay 0 for the first step only.
    def train(name, *flags):
        r = run(1, [*MODEL, "--train-iters", "8", "--eval-iters", "0", "--metrics-jsonl",
                    str(tmp_path / f"{name}.jsonl"), *flags])
        assert r.returncode == 0, r.stdout + r.stderr
        return losses(jsonl(str(tmp_path / f"{name}.jsonl")))

    flat = train("flat", "--weight-decay-incr-style", "linear", "--start-weight-decay", "0.1",
                 "--end-weight-decay", "0.1")
    assert flat == train("constant", "--weight-decay", "0.1")
    rising = train("rising", "--weight-decay-incr-style", "linear", "--start-weight-decay", "0",
                   "--end-weight-decay", "0.9")
    none = train("none", "--weight-decay", "0")
    assert [rising[s] for s in (1, 2)] == [none[s] for s in (1, 2)]  # step 1 decays by 0
    assert all(rising[s] != none[s] for s in range(3, 9))


def test_use_checkpoint_args_keeps_the_checkpoints_vocabulary(tmp_path):
    # A NullTokenizer run saves N + 1 (Megatron's EOD); resumed with --use-checkpoint-args and
    # the same tokenizer flags it loads that vocabulary, not N + 2.
    ckpt = str(tmp_path / "ckpt")
    null = [*[x for x in MODEL if x not in ("--vocab-size", "300")], "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "300", "--eval-iters", "0"]
    r = run(1, [*null, "--train-iters", "4", "--save", ckpt])
    assert r.returncode == 0, r.stdout + r.stderr
    r = run(1, [*null, "--train-iters", "6", "--load", ckpt, "--use-checkpoint-args"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "braid: loaded iteration 4" in r.stdout
    assert re.search(r"^  vocab_size \.+ 301$", r.stdout, re.M), r.stdout


def test_skip_train_with_a_validation_path_alone(tmp_path):
    # Evaluating only: a --valid-data-path without training data (megatron-core's blend per
    # split allows it); no training index is built.
    sys.path.insert(0, os.path.join(REPO, "python"))
    from braid.data import IndexedDatasetWriter

    prefix = str(tmp_path / "valid_text_document")
    rng = np.random.default_rng(3)
    with IndexedDatasetWriter(prefix, "u16") as w:
        for _ in range(100):
            w.add_document(rng.integers(0, 1000, size=40, dtype=np.int32))
    r = run(1, ["--device", "cpu", "--num-layers", "2", "--hidden-size", "32",
                "--num-attention-heads", "2", "--vocab-size", "1000", "--seq-length", "32",
                "--micro-batch-size", "4", "--eval-iters", "2", "--valid-data-path", prefix,
                "--skip-train", "--data-cache-path", str(tmp_path / "cache")])
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.findall(r"validation loss at iteration 0 \|", r.stdout) and \
        not log_lines(r.stdout), r.stdout
    assert not any("train" in f for f in os.listdir(tmp_path / "cache")), \
        os.listdir(tmp_path / "cache")


def test_exit_on_missing_checkpoint(tmp_path):
    r = run(1, [*MODEL, "--train-iters", "4", "--load", str(tmp_path / "none"),
                "--exit-on-missing-checkpoint"])
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"braid: error: --exit-on-missing-checkpoint: no checkpoint in {tmp_path / 'none'}" \
        in r.stderr
    assert "iteration" not in r.stdout


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The same 20 iterations in one process: every layout must train alike."""
    tb = str(tmp_path_factory.mktemp("one_process") / "tb")
    r = run(1, [*MODEL, "--train-iters", "20", "--tensorboard-dir", tb, "--log-params-norm"])
    assert r.returncode == 0, r.stdout + r.stderr
    return jsonl(os.path.join(tb, "metrics.jsonl"))


def assert_trains_alike(records, one_process):
    one, got = losses(one_process), losses(records)
    assert sorted(one) == sorted(got) == list(range(1, 21))
    np.testing.assert_allclose([got[i] for i in range(1, 21)], [one[i] for i in range(1, 21)],
                               rtol=2e-4)
    one_valid, got_valid = validation(one_process), validation(records)
    assert one_valid.keys() == got_valid.keys() == {10, 20}
    for step in one_valid:
        assert got_valid[step] == pytest.approx(one_valid[step], rel=2e-4)


def test_one_process_trains_like_the_3d_layout(runs, one_process):
    three_d = jsonl(os.path.join(runs["full_tb"], "metrics.jsonl"))
    assert_trains_alike(three_d, one_process)
    # --log-params-norm: every parameter once over tp 2 x pp 2 x dp 2 with ZeRO, as in one
    # process; in the log line and the metrics of every iteration.
    norms = [{r["step"]: r["params-norm"] for r in run if "params-norm" in r}
             for run in (three_d, one_process)]
    assert sorted(norms[0]) == sorted(norms[1]) == list(range(1, 21))
    for step in norms[0]:
        assert norms[0][step] == pytest.approx(norms[1][step], rel=1e-5), step
    lines = log_lines(runs["full"].stdout)
    assert all(re.search(r"\| grad norm: [0-9.]+ \| params norm: [0-9.]+ \|", line)
               for line in lines), lines[0]


def test_uneven_pipeline_stages_train_like_one_process(one_process, tmp_path):
    # Megatron's --decoder-last-pipeline-num-layers: the stage with the LM head holds 1 of the
    # 4 layers, the first 3; under pp 2 x dp 2 with ZeRO and overlapped reductions.
    tb = str(tmp_path / "tb")
    r = run(4, [*MODEL, "--pipeline-model-parallel-size", "2", "--decoder-last-pipeline-num-layers",
                "1", "--use-distributed-optimizer", "--overlap-grad-reduce", "--train-iters",
                "20", "--tensorboard-dir", tb])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tp=1 pp=2 dp=2, layers per stage 3 | 1" in r.stdout, r.stdout
    assert_trains_alike(jsonl(os.path.join(tb, "metrics.jsonl")), one_process)


@pytest.mark.parametrize("ranks, layout, method", [
    (2, ["--pipeline-model-parallel-size", "2"], ["uniform", "2"]),
    (4, LAYOUT_3D, ["block", "1"]),
])
def test_megatron_recompute_methods_train_like_one_process(ranks, layout, method, one_process,
                                                           tmp_path):
    # Megatron's full recomputation flags: uniform groups of the chunk's 2 layers (one input
    # kept per chunk), or block (the first layer of each chunk recomputed, the other not).
    tb = str(tmp_path / "tb")
    r = run(ranks, [*MODEL, *layout, "--recompute-granularity", "full", "--recompute-method",
                    method[0], "--recompute-num-layers", method[1], "--train-iters", "20",
                    "--tensorboard-dir", tb])
    assert r.returncode == 0, r.stdout + r.stderr
    assert_trains_alike(jsonl(os.path.join(tb, "metrics.jsonl")), one_process)


def test_megatron_tokenizer_flags_size_the_vocabulary(tmp_path):
    # A Megatron launch script's tokenizer flags, unchanged: GPT-2's vocab.json and merges.txt,
    # or a tokenizer.json (with added tokens), give the vocabulary; NullTokenizer adds its EOD.
    vocab = {f"t{i}": i for i in range(300)}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    (tmp_path / "tokenizer.json").write_text(json.dumps({
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"},
        "added_tokens": [{"id": 300, "content": "<eos>", "special": True}]}))
    model = [a for a in MODEL if a not in ("--vocab-size", "300")]
    for flags, size in [
            (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tmp_path / "vocab.json"),
              "--merge-file", str(tmp_path / "merges.txt")], 300),
            (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path)], 301),
            (["--tokenizer-type", "NullTokenizer", "--vocab-size", "300"], 301)]:
        r = run(1, [*model, *flags, "--train-iters", "4", "--eval-iters", "0"])
        assert r.returncode == 0, r.stdout + r.stderr
        assert re.search(rf"^  vocab_size \.+ {size}$", r.stdout, re.M), (flags, r.stdout)


def test_megatron_implementation_flags_change_nothing(one_process, tmp_path):
    # What a Megatron launch script passes to pick kernels and backends: accepted, each named
    # in the log with why it changes nothing, and the run trains exactly as without them.
    flags = ["--use-mcore-models", "--transformer-impl", "transformer_engine", "--use-flash-attn",
             "--attention-backend", "auto", "--no-gradient-accumulation-fusion",
             "--distributed-backend", "nccl", "--calculate-per-token-loss", "--num-workers", "2"]
    tb = str(tmp_path / "tb")
    r = run(1, [*MODEL, *flags, "--train-iters", "20", "--tensorboard-dir", tb])
    assert r.returncode == 0, r.stdout + r.stderr
    notes = re.findall(r"^braid: (--[a-z-]+(?: \S+)?) has no effect: ", r.stdout, re.M)
    assert notes == ["--use-mcore-models", "--transformer-impl transformer_engine",
                     "--use-flash-attn", "--attention-backend auto", "--calculate-per-token-loss",
                     "--distributed-backend nccl", "--num-workers 2",
                     "--no-gradient-accumulation-fusion"], r.stdout
    assert losses(jsonl(os.path.join(tb, "metrics.jsonl"))) == losses(one_process)


def test_addition_data_by_default_and_the_valid_split_of_data_path(tmp_path):
    r = run(2, ["--device", "cpu", "--num-layers", "2", "--hidden-size", "32",
                "--num-attention-heads", "2", "--micro-batch-size", "8", "--train-iters", "30", "--log-interval", "10",
                "--eval-interval", "15", "--eval-iters", "2", "--data-cache-path",
                str(tmp_path / "cache"), "--progress-bar", "on"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tp=1 pp=1 dp=2" in r.stdout
    # The bar redraws one line (carriage returns, read here as newlines) and ends at 100%.
    assert re.search(r"^\[=+\] 100% 30/30 \| [0-9.]+ it/s \| ETA 0:00:00", r.stdout, re.M), r.stdout
    vals = [float(v) for v in re.findall(r"lm loss value: ([0-9.E+-]+)", r.stdout)]
    assert len(vals) == 2 and vals[1] < vals[0] < 6, r.stdout

    # A Megatron dataset of random documents; the 969,30,1 split gives it a valid part.
    sys.path.insert(0, os.path.join(REPO, "python"))
    from braid.data import IndexedDatasetWriter

    prefix = str(tmp_path / "docs_text_document")
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, "u16") as w:
        for _ in range(400):
            w.add_document(rng.integers(0, 1000, size=int(rng.integers(20, 80)), dtype=np.int32))
    r = run(2, ["--device", "cpu", "--num-layers", "2", "--hidden-size", "32",
                "--num-attention-heads", "2", "--data-path", prefix, "--split", "90,10,0", "--vocab-size", "1000",
                "--seq-length", "32", "--micro-batch-size", "4", "--train-iters", "12",
                "--log-interval", "6", "--eval-interval", "6", "--eval-iters", "3"])
    assert r.returncode == 0, r.stdout + r.stderr
    vals = re.findall(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)",
                      r.stdout)
    assert [int(i) for i, _ in vals] == [6, 12], r.stdout
    assert all(0 < float(v) < 10 for _, v in vals)


def test_each_splits_own_data_path_and_the_test_evaluation(tmp_path):
    # Megatron's --train/valid/test-data-path: each split's datasets used whole. Training on
    # --train-data-path A is training on --data-path A --split 100,0,0 (the same samples); the
    # valid and test losses come from their own files, the test loss once, at the end.
    sys.path.insert(0, os.path.join(REPO, "python"))
    from braid.data import IndexedDatasetWriter

    prefixes = {}
    for name, high, seed in (("train", 1000, 0), ("valid", 1000, 1), ("test", 50, 2)):
        prefixes[name] = str(tmp_path / f"{name}_text_document")
        rng = np.random.default_rng(seed)
        with IndexedDatasetWriter(prefixes[name], "u16") as w:
            for _ in range(200):
                w.add_document(rng.integers(0, high, size=int(rng.integers(20, 80)),
                                            dtype=np.int32))
    common = ["--device", "cpu", "--num-layers", "2", "--hidden-size", "32",
              "--num-attention-heads", "2", "--vocab-size", "1000", "--seq-length", "32",
              "--micro-batch-size", "4", "--train-iters", "12", "--log-interval", "6",
              "--eval-interval", "6", "--eval-iters", "2"]
    per_split = run(2, [*common, "--train-data-path", prefixes["train"], "--valid-data-path",
                        prefixes["valid"], "--test-data-path", "1", prefixes["test"],
                        "--metrics-jsonl", str(tmp_path / "per_split.jsonl")])
    assert per_split.returncode == 0, per_split.stdout + per_split.stderr
    out = per_split.stdout
    assert re.findall(r"validation loss at iteration (\d+) \|", out) == ["6", "12"], out
    test = re.findall(r"validation loss at iteration 12 on test set \| lm loss value: "
                      r"([0-9.E+-]+)", out)
    assert len(test) == 1, out
    # The test documents use 50 of the 1000 tokens: a different loss from validation's.
    records = jsonl(str(tmp_path / "per_split.jsonl"))
    assert [r["lm loss test"] for r in records if "lm loss test" in r] == [
        pytest.approx(float(test[0]), rel=1e-6)]
    assert float(test[0]) != pytest.approx(validation(records)[12], rel=1e-3)
    whole = run(2, [*common, "--data-path", prefixes["train"], "--split", "100,0,0",
                    "--metrics-jsonl", str(tmp_path / "whole.jsonl")])
    assert whole.returncode == 0, whole.stdout + whole.stderr
    assert losses(jsonl(str(tmp_path / "whole.jsonl"))) == losses(records)
    assert "on test set" not in whole.stdout and "no test evaluation" not in whole.stdout
    # --data-path's test split is evaluated too when it has documents, and said when not.
    r = run(2, [*common, "--data-path", prefixes["train"], "--split", "80,10,10"])
    assert r.returncode == 0 and "validation loss at iteration 12 on test set" in r.stdout, \
        r.stdout + r.stderr
    r = run(2, [*common, "--data-path", prefixes["train"]])  # 969,30,1 of 200 documents
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"braid: no test evaluation: --split 969,30,1 leaves no test documents of " \
           f"{prefixes['train']}" in r.stdout


def test_eod_mask_loss(tmp_path):
    # Megatron's --eod-mask-loss: no loss where the *input* token is the end of document (the
    # guess at the next document's first token). NullTokenizer --vocab-size 1000: EOD is 1000.
    sys.path.insert(0, os.path.join(REPO, "python"))
    from braid.data import IndexedDatasetWriter
    from braid.training import Data

    prefix = str(tmp_path / "docs_text_document")
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, "u16") as w:
        for _ in range(200):  # short documents, each ending with EOD: many EOD inputs
            doc = rng.integers(0, 1000, size=int(rng.integers(3, 12)), dtype=np.int32)
            w.add_document(np.append(doc, 1000).astype(np.int32))
    common = ["--device", "cpu", "--num-layers", "2", "--hidden-size", "32",
              "--num-attention-heads", "2", "--data-path", prefix, "--split", "100,0,0",
              "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--seq-length", "32",
              "--micro-batch-size", "4", "--train-iters", "6", "--log-interval", "1",
              "--eval-iters", "0"]
    masked, plain = (run(1, [*common, *extra, "--metrics-jsonl", str(tmp_path / f"{n}.jsonl")])
                     for n, extra in (("masked", ["--eod-mask-loss"]), ("plain", [])))
    for r in (masked, plain):
        assert r.returncode == 0, r.stdout + r.stderr
    first = [losses(jsonl(str(tmp_path / f"{n}.jsonl")))[1] for n in ("masked", "plain")]
    assert first[0] != pytest.approx(first[1], rel=1e-4)  # other targets count
    # Which ones: the positions whose input is EOD, whatever their label.
    data = object.__new__(Data)
    data.answer_only, data.eod_mask = False, 1000

    class Batch:
        tokens = np.array([[5, 1000, 7, 1000]], dtype=np.int32)
        labels = np.array([[1000, 7, 1000, 3]], dtype=np.int32)

    np.testing.assert_array_equal(data.targets(Batch()), [[1000, -1, 1000, -1]])


def test_profile_writes_each_ranks_trace_of_the_window(tmp_path):
    tb = str(tmp_path / "tb")
    r = run(4, [*MODEL, *LAYOUT_3D, "--train-iters", "6", "--eval-iters", "0", "--profile",
                "--profile-step-start", "3", "--profile-step-end", "5", "--profile-ranks",
                "0", "3", "--tensorboard-dir", tb])
    assert r.returncode == 0, r.stdout + r.stderr
    traces = sorted(os.listdir(os.path.join(tb, "traces")))
    assert traces == ["rank0.json", "rank3.json"]  # the --profile-ranks only
    steps = {}
    for name in traces:
        with open(os.path.join(tb, "traces", name)) as f:
            events = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
        step_spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["cat"] == "step")
        assert len(step_spans) == 2, name  # iterations 3 and 4
        steps[name] = step_spans
        lanes = {e["cat"] for e in events}
        # tp 2, pp 2, dp 1 on 4 ranks: 2 microbatches of 2 per step (global batch 16 / dp 1
        # / micro batch 2 = 8; see MODEL), forward and backward each.
        assert {"step", "compute", "p2p", "comm:tp", "comm:pp"} <= lanes, lanes
        forwards = [e for e in events if e["cat"] == "compute" and e["name"] == "forward"]
        assert len(forwards) == 2 * 8, name
        assert all(0 <= e["ts"] for e in events)
    # One time axis: the two ranks' iterations overlap in time.
    for (a0, a1), (b0, b1) in zip(steps["rank0.json"], steps["rank3.json"]):
        assert a0 < b1 and b0 < a1
    assert "braid: rank 0 traced iterations 3 to 4:" in r.stdout
    out = tmp_path / "timeline.png"
    p = subprocess.run([sys.executable, os.path.join(REPO, "tools", "plot_schedule.py"),
                        *(os.path.join(tb, "traces", n) for n in traces), "-o", str(out)],
                       env=env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["--fp16"], "--fp16 is not supported by braid: braid has no float16 kernels"),
    (["--recompute-method", "block"],
     "--recompute-method block needs --recompute-granularity full"),
    (["--recompute-granularity", "full", "--recompute-num-layers", "2"],
     "--recompute-num-layers needs --recompute-method uniform or block"),
    (["--context-parallel-size", "2"], "--context-parallel-size is not supported by braid"),
    (["--vocab-file", "vocab.json"], "--vocab-file needs --tokenizer-type"),
    (["--use-checkpoint-args"], "--use-checkpoint-args needs --load DIR"),
    (["--kv-channels", "64"], "--kv-channels 64: braid's head dimension is --hidden-size / "
     "--num-attention-heads = 32"),
    (["--skip-train", "--eval-iters", "0"], "--skip-train evaluates: it needs --eval-iters > 0"),
    (["--eod-mask-loss"], "--eod-mask-loss needs --tokenizer-type (it names the end-of-document"),
    (["--no-save-optim"], "--no-save-optim needs --save DIR"),
    (["--train-samples", "64", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "2"],
     "--lr-wsd-decay-iters is for --train-iters; with --train-samples give "
     "--lr-wsd-decay-samples"),
    (["--exit-on-missing-checkpoint"], "--exit-on-missing-checkpoint needs --load DIR"),
    (["--start-weight-decay", "0.1"], "--start-weight-decay: give --weight-decay-incr-style "
     "linear or cosine"),
    (["--weight-decay-incr-style", "cosine", "--end-weight-decay", "0.1"],
     "--weight-decay-incr-style cosine needs --start-weight-decay and --end-weight-decay"),
    (["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    (["--train-samples", "64", "--lr-decay-iters", "10"],
     "--lr-decay-iters is for --train-iters; with --train-samples give --lr-decay-samples"),
    (["--lr-warmup-samples", "10"],
     "--lr-warmup-samples is for --train-samples; with --train-iters give --lr-warmup-iters"),
    (["--data-path", "A", "--train-data-path", "B"],
     "give --data-path (with --split) or --train-data-path"),
    (["--valid-data-path", "B"], "--valid-data-path / --test-data-path need --train-data-path"),
    (["--data-path", "0.5", "/nonexistent/a", "0.5", "/nonexistent/b", "--vocab-size", "100",
      "--seq-length", "32"], "--data-path: no /nonexistent/a.bin or /nonexistent/a.idx"),
    (["--data-path", "0", "/nonexistent/a"], "--data-path 0 /nonexistent/a: "),
    (["--train-iters", "2", "--lr-warmup-iters", "3"],
     "--lr-warmup-iters 3 must be less than --lr-decay-iters 2"),
    (["--tokenizer-type", "GPT2BPETokenizer", "--mock-data", "--seq-length", "32",
      "--vocab-file", "vocab.json"], "--tokenizer-type GPT2BPETokenizer needs --merge-file"),
    (["--tokenizer-type", "NullTokenizer", "--vocab-size", "300"],
     "the embedded addition data has its own byte vocabulary"),
    (["--no-such-flag", "3"], "--no-such-flag is not a braid argument"),
    (["--tensor-model-parallel-size", "3"],
     "processes are not divisible by --tensor-model-parallel-size 3"),
    (["--num-attention-heads", "3", "--hidden-size", "96", "--tensor-model-parallel-size", "2"],
     "--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2"),
    (["--global-batch-size", "6", "--micro-batch-size", "4"],
     "--global-batch-size 6 is not divisible by --micro-batch-size 4 x data-parallel size 4"),
    (["--micro-batch-size", "0"], "argument --micro-batch-size: must be > 0, got 0"),
    (["--lr", "fast"], "argument --lr: invalid positive float value: 'fast'"),
    (["--bf16", "--device", "cpu"], "--bf16 needs a CUDA device"),
    (["--num-layers", "6", "--pipeline-model-parallel-size", "4"],
     "--num-layers 6 is not divisible by --pipeline-model-parallel-size 4 (uneven stages: "
     "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers)"),
    (["--num-layers", "8", "--pipeline-model-parallel-size", "4",
      "--decoder-last-pipeline-num-layers", "3"],
     "--num-layers (8) minus --decoder-first-pipeline-num-layers and "
     "--decoder-last-pipeline-num-layers leaves 5 layers, which must split evenly"),
    (["--num-layers", "8", "--pipeline-model-parallel-size", "2",
      "--decoder-first-pipeline-num-layers", "9"], "exceed --num-layers (8)"),
    (["--num-layers", "8", "--decoder-first-pipeline-num-layers", "4"],
     "need --pipeline-model-parallel-size > 1, got 1"),
    (["--attention-dropout", "0.1"], "--attention-dropout must be 0"),
    (["--mock-data", "--seq-length", "32"], "--mock-data needs --vocab-size"),
    (["--save-interval", "5"], "--save-interval needs --save DIR"),
    (["--profile"], "--profile needs --tensorboard-dir"),
    (["--profile", "--tensorboard-dir", "/tmp/x", "--profile-ranks", "0", "4"],
     "--profile-ranks 4: the job has ranks 0 to 3"),
    (["--profile", "--tensorboard-dir", "/tmp/x", "--profile-step-start", "5",
      "--profile-step-end", "5"], "--profile-step-start 5 must be before --profile-step-end 5"),
])
def test_bad_arguments_end_every_rank_with_one_line(args, message):
    r = run(4, args, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr  # mpirun passes the ranks' code on
    errors = [line for line in (r.stdout + r.stderr).replace("braid: error:", "\nbraid: error:")
              .splitlines() if line.startswith("braid: error:")]
    # Every rank prints the same line (mpirun may end the others before they do).
    assert len(errors) >= 1 and len(set(errors)) == 1, r.stdout + r.stderr
    assert message in errors[0], errors[0]
    assert "iteration" not in r.stdout


def test_docs_list_every_argument():
    sys.path.insert(0, os.path.join(REPO, "python"))
    from braid.arguments import UNSUPPORTED, build_parser

    with open(os.path.join(REPO, "docs", "arguments.md"), encoding="utf-8") as f:
        documented = set(re.findall(r"^\| `(--[a-z0-9-]+)` \|", f.read(), re.MULTILINE))
    flags = {a.option_strings[0] for a in build_parser()._actions
             if a.option_strings and a.dest != "help"}
    assert flags - documented == set(), "arguments missing from docs/arguments.md"
    assert set(UNSUPPORTED) - documented == set(), "refused arguments missing from the docs"
    assert documented - flags - set(UNSUPPORTED) == set(), "docs list arguments braid lacks"
