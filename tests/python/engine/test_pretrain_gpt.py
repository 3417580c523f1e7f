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
from pretrain_job import (LAYOUT_3D, MODEL, REPO, assert_trains_alike, jsonl, log_lines,  # noqa: F401
                          losses, one_process, run, validation)

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")


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
    # Validation at iteration 10 and 20 and, after the last save, Megatron's "on validation
    # set" (the next batches), every value finite.
    vals = re.findall(r"validation loss at iteration (\d+(?: on validation set)?) \| "
                      r"lm loss value: ([0-9.E+-]+)", out)
    assert [i for i, _ in vals] == ["10", "20", "20 on validation set"], out
    assert all(math.isfinite(float(v)) for _, v in vals)
    # The cost: 8 devices x 2.5 per hour; the final line names it.
    final = [line for line in out.splitlines() if line.startswith("braid: trained 20 iterations")]
    assert len(final) == 1 and "2.5 per device-hour x 8 devices" in final[0], out


TIMERS = ["step", "compute", "pipeline-wait", "comm-wait", "tp-comm-wait", "dp-comm-wait",
          "ep-comm-wait", "other-comm-wait"]


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
    assert [e.step for e in acc.Scalars("lm loss validation")] == [10, 20, 20]  # Megatron's


def test_plot_metrics_draws_the_run(runs, tmp_path):
    out = tmp_path / "plots"
    r = subprocess.run([sys.executable, os.path.join(REPO, "tools", "plot_metrics.py"),
                        runs["full_tb"], "--out", str(out)], env=mpi_env(), capture_output=True,
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


def test_skip_train_evaluates_a_checkpoint(runs, tmp_path):
    # Megatron's --skip-train: load, evaluate, exit - on another layout than the one that saved.
    r = run(2, [*MODEL, "--pipeline-model-parallel-size", "2", "--train-iters", "20", "--load",
                runs["ckpt"], "--skip-train"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "braid: loaded iteration 10" in r.stdout and not log_lines(r.stdout), r.stdout
    vals = re.findall(r"validation loss at iteration (\d+) on validation set \| lm loss value: "
                      r"([0-9.E+-]+)", r.stdout)
    assert [int(i) for i, _ in vals] == [10] and math.isfinite(float(vals[0][1])), r.stdout
    assert "braid: trained" not in r.stdout


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


def test_bf16_on_the_cpu_trains_in_float32_and_says_so(one_process, tmp_path):
    # A GPU job's script debugs on a CPU unchanged: --bf16 there is the float32 run, bit for bit.
    tb = str(tmp_path / "tb")
    r = run(1, [*MODEL, "--bf16", "--train-iters", "20", "--tensorboard-dir", tb,
                "--log-params-norm"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "braid: --bf16 on the CPU: braid's CPU kernels compute in float32, so this run's " \
           "parameters and activations are float32" in r.stdout, r.stdout
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
    assert len(vals) == 3 and max(vals[1:]) < vals[0] < 6, r.stdout  # 15, 30, the final one

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
                       env=mpi_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["--fp16"], "--fp16 is not supported by braid: braid has no float16 kernels"),
    (["--recompute-method", "block"],
     "--recompute-method block needs --recompute-granularity full"),
    (["--recompute-granularity", "full", "--recompute-num-layers", "2"],
     "--recompute-num-layers needs --recompute-method uniform or block"),
    (["--num-experts", "8", "--expert-model-parallel-size", "8"],
     "--expert-model-parallel-size 8 does not divide the 4 data-parallel x context-parallel"),
    (["--vocab-file", "vocab.json"], "--vocab-file needs --tokenizer-type"),
    (["--use-checkpoint-args"], "--use-checkpoint-args needs --load DIR"),
    (["--rotary-percent", "0.5"], "--rotary-percent needs --position-embedding-type rope"),
    (["--swiglu", "--squared-relu"], "--swiglu and --squared-relu are two activations; give one"),
    (["--position-embedding-type", "rope", "--rotary-percent", "1.5"],
     "--rotary-percent must be in (0, 1], got 1.5"),
    (["--position-embedding-type", "rope", "--rotary-percent", "0.01"],
     "--rotary-percent 0.01 turns int(32 x 0.01) = 0 channels of each head"),
    (["--position-embedding-type", "rope", "--kv-channels", "31"],
     "--rotary-percent 1.0 turns int(31 x 1.0) = 31 channels of each head; RoPE turns pairs"),
    (["--skip-train", "--eval-iters", "0"], "--skip-train evaluates: it needs --eval-iters > 0"),
    (["--eod-mask-loss"], "--eod-mask-loss needs --tokenizer-type (it names the end-of-document"),
    (["--no-save-optim"], "--no-save-optim needs --save DIR"),
    (["--train-samples", "64", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "2"],
     "--lr-wsd-decay-iters is for --train-iters; with --train-samples give "
     "--lr-wsd-decay-samples"),
    (["--exit-on-missing-checkpoint"], "--exit-on-missing-checkpoint needs --load DIR"),
    # A flag with no effect still takes only Megatron's values: a typo is not waved through.
    (["--ckpt-format", "torch-dist"], "argument --ckpt-format: invalid choice: 'torch-dist'"),
    (["--rope-scaling-factor", "32"], "--rope-scaling-factor needs --use-rope-scaling"),
    (["--use-rope-scaling"], "--use-rope-scaling needs --position-embedding-type rope"),
    (["--train-iters", "10", "--rampup-batch-size", "16", "16", "100"],
     "--rampup-batch-size needs --train-samples"),
    (["--train-samples", "1000", "--micro-batch-size", "4", "--global-batch-size", "128",
      "--rampup-batch-size", "8", "8", "100"],
     "--rampup-batch-size: every batch of the ramp (8, 16, ...) must be a multiple of "
     "--micro-batch-size x data-parallel size (4 x 4); the start is not"),
    (["--train-samples", "1000", "--micro-batch-size", "4", "--global-batch-size", "128",
      "--rampup-batch-size", "16", "48", "100"],
     "--rampup-batch-size: the ramp from 16 by 48 does not reach the global batch size 128"),
    (["--train-samples", "1000", "--num-layers", "4", "--pipeline-model-parallel-size", "2",
      "--num-virtual-stages-per-pipeline-rank", "2", "--micro-batch-size", "2",
      "--global-batch-size", "16", "--rampup-batch-size", "4", "4", "100"],
     "--rampup-batch-size: the ramp's global batch 4 makes 1 microbatch, and the interleaved "
     "schedule needs a multiple of --pipeline-model-parallel-size 2 at every step"),
    (["--start-weight-decay", "0.1"], "--start-weight-decay: give --weight-decay-incr-style "
     "linear or cosine"),
    (["--weight-decay-incr-style", "cosine", "--end-weight-decay", "0.1"],
     "--weight-decay-incr-style cosine needs --start-weight-decay and --end-weight-decay"),
    (["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    (["--hierarchical-context-parallel-sizes", "2", "2"],
     "--hierarchical-context-parallel-sizes 2 2: their product must be --context-parallel-size "
     "1, as Megatron asserts"),
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
    (["--num-layers", "4", "--pipeline-model-parallel-size", "2",
      "--pipeline-model-parallel-layout", "Ett|tx|L"], "'Ett|tx|L': unexpected 'x'"),
    (["--num-layers", "4", "--pipeline-model-parallel-size", "2",
      "--pipeline-model-parallel-layout", "Ett|t|L"], "has 3 stages, not a multiple of "
     "--pipeline-model-parallel-size 2"),
    (["--num-layers", "4", "--pipeline-model-parallel-size", "2",
      "--pipeline-model-parallel-layout", "Ett|ttt|t|L"], "places 6 transformer layers (t); "
     "--num-layers is 4"),
    (["--num-layers", "4", "--pipeline-model-parallel-size", "2",
      "--pipeline-model-parallel-layout", "tE|tttL"], "the embedding (E) must come first"),
    (["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--position-embedding-type",
      "rope", "--mtp-num-layers", "1", "--pipeline-model-parallel-layout", "Ett|tt|m|L"],
     "braid runs the MTP depths (m) in the last stage"),
    (["--num-layers", "4", "--pipeline-model-parallel-size", "2",
      "--pipeline-model-parallel-layout", "Ett|ttL", "--decoder-last-pipeline-num-layers", "1"],
     "--pipeline-model-parallel-layout excludes --decoder-first-pipeline-num-layers"),
    (["--num-layers", "4", "--pipeline-model-parallel-size", "4",
      "--account-for-embedding-in-pipeline-split"],
     "--num-layers 4 + 1 (the embedding) = 5 is not divisible by the 4 model chunks"),
    (["--num-layers", "6", "--pipeline-model-parallel-size", "2",
      "--account-for-loss-in-pipeline-split", "--pipeline-model-parallel-layout", "Ettt|tttL"],
     "no --account-for-embedding/loss-in-pipeline-split"),
    (["--recompute-granularity", "selective", "--recompute-modules", "core_attn",
      "mla_up_proj"], "--recompute-modules mla_up_proj needs --multi-latent-attention"),
    (["--recompute-granularity", "selective", "--recompute-modules", "mlp", "moe"],
     "--recompute-modules mlp moe: braid's selective recomputation"),
    (["--recompute-modules", "core_attn"],
     "--recompute-modules needs --recompute-granularity selective"),
    (["--no-position-embedding"], "--no-position-embedding with --position-embedding-type "
     "learned_absolute: a model without positions (NoPE)"),
    (["--attention-dropout", "1"], "--attention-dropout must be < 1, got 1.0"),
    (["--window-attn-skip-freq", "2"], "--window-attn-skip-freq needs --window-size"),
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
        documented = set(re.findall(r"^\| `(--[a-z0-9_-]+)` \|", f.read(), re.MULTILINE))
    flags = {a.option_strings[0] for a in build_parser()._actions
             if a.option_strings and a.dest != "help"}
    assert flags - documented == set(), "arguments missing from docs/arguments.md"
    assert set(UNSUPPORTED) - documented == set(), "refused arguments missing from the docs"
    assert documented - flags - set(UNSUPPORTED) == set(), "docs list arguments braid lacks"
