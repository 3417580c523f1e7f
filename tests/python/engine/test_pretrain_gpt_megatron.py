"""pretrain_gpt.py with Megatron-LM's flags beyond the basics, as real jobs: uneven pipeline
stages and the recompute methods train like one process; tokenizer files size the vocabulary
and name the end of document; implementation-choice flags change nothing; each split's own
data path, the test evaluation, --skip-train; the LR and weight-decay schedules step by step;
checkpoints without optimizer or RNG state, --use-checkpoint-args, --exit-on-missing-checkpoint
and the --exit-cost budget across jobs."""

import json
import math
import os
import re
import shutil
import sys

import numpy as np
import pytest

from pretrain_job import (MODEL, LAYOUT_3D, REPO, assert_trains_alike, jsonl, log_lines,  # noqa: F401
                          losses, one_process, run, validation, write_documents)

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")


def test_exit_cost_stops_the_run_and_counts_over_its_jobs(tmp_path):
    # At 36000 per device-hour a device-second costs 10: --exit-cost 8 stops a long run after
    # about 0.8 s, saving; the checkpoint carries the 0.8+ device-seconds used, so a job resumed
    # under the same budget does not train, and one with more budget counts on from there.
    sys.path.insert(0, os.path.join(REPO, "python"))
    import braid

    ckpt = str(tmp_path / "ckpt")
    budget = [*MODEL, "--eval-iters", "0", "--gpu-hour-price", "36000", "--save", ckpt]
    first = run(1, [*budget, "--train-iters", "100000", "--exit-cost", "8"])
    assert first.returncode == 0, first.stdout + first.stderr
    stop = re.search(r"braid: exiting at iteration (\d+) \(--exit-cost 8.0\); checkpoint saved",
                     first.stdout)
    assert stop and 0 < int(stop.group(1)) < 100000, first.stdout
    # A run stopped by its budget still ends with what it trained and cost.
    assert re.search(rf"^braid: trained {stop.group(1)} iterations in .*; cost [0-9.]+ \(36000",
                     first.stdout, re.MULTILINE), first.stdout
    spent = braid.checkpoint_metadata(ckpt)["device_seconds"]
    assert spent >= 0.8  # the stop comes once the budget is reached, the save after it
    again = run(1, [*budget, "--train-iters", "100000", "--exit-cost", "8", "--load", ckpt])
    assert again.returncode == 0, again.stdout + again.stderr
    assert "braid: --exit-cost 8.0 is spent already" in again.stdout and "iteration " \
        not in again.stdout.split("loaded iteration")[-1], again.stdout
    assert braid.latest_iteration(ckpt) == int(stop.group(1))
    more = int(stop.group(1)) + 2
    last = run(1, [*budget, "--train-iters", str(more), "--exit-cost", "1e9", "--load", ckpt,
                   "--override-opt_param-scheduler"])  # its decay now ends at `more`
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
    # of 16 do not divide: its scheduler counts samples, and step s logs the rate after its
    # update, at s x 16 of them (the next step's).
    tb = str(tmp_path / "tb")
    r = run(1, [*[x for x in MODEL if x not in ("--lr-warmup-iters", "3")], "--train-samples",
                "200", "--lr-warmup-samples", "40", "--lr-decay-samples", "150", "--min-lr",
                "3e-4", "--lr-decay-style", "cosine", "--eval-iters", "0", "--tensorboard-dir",
                tb])
    assert r.returncode == 0, r.stdout + r.stderr
    lrs = {rec["step"]: rec["learning-rate"] for rec in jsonl(os.path.join(tb, "metrics.jsonl"))
           if "learning-rate" in rec}
    assert sorted(lrs) == list(range(1, 13))  # 200 // 16 iterations
    for step, lr in lrs.items():
        samples = step * 16
        if samples <= 40:
            want = 3e-3 * samples / 40
        elif samples > 150:
            want = 3e-4
        else:
            ratio = (samples - 40) / (150 - 40)
            want = 3e-4 + (3e-3 - 3e-4) * 0.5 * (math.cos(math.pi * ratio) + 1)
        assert lr == pytest.approx(want, rel=1e-5, abs=1e-12), step


def test_warmup_stable_decay_schedule(tmp_path):
    # Megatron's --lr-decay-style WSD: warm up from --lr-warmup-init, hold the peak, anneal over
    # the last --lr-wsd-decay-iters (here cosine) down to --min-lr. Step s logs the rate after
    # its update (Megatron's), step s + 1's.
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
        it = step
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
    r = run(1, [*null, "--train-iters", "6", "--load", ckpt, "--override-opt_param-scheduler",
                "--use-checkpoint-args"])
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
    assert re.findall(r"validation loss at iteration 0 on validation set \|", r.stdout) and \
        not log_lines(r.stdout), r.stdout
    assert not any("train" in f for f in os.listdir(tmp_path / "cache")), \
        os.listdir(tmp_path / "cache")


def test_exit_on_missing_checkpoint(tmp_path):
    r = run(1, [*MODEL, "--train-iters", "4", "--load", str(tmp_path / "none"),
                "--exit-on-missing-checkpoint"])
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"braid: error: --exit-on-missing-checkpoint: no checkpoint in {tmp_path / 'none'}" \
        in r.stderr
    assert not log_lines(r.stdout), r.stdout  # no iteration ran


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


@pytest.mark.parametrize("ranks, layout, split", [
    # Megatron's layout string: the first stage the embedding alone, the second all 4 layers
    # and the loss; pp 2 x dp 2 with ZeRO and overlapped reductions.
    (4, ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "E|t*4L",
         "--use-distributed-optimizer", "--overlap-grad-reduce"], "0 | 4"),
    # Interleaved: v 2 from the layout's 4 stages; rank 0 holds chunks "E" and "t", rank 1
    # "ttt" and "L" (the loss alone).
    (2, ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout",
         "E|t*3|t,|L"], "1 | 3"),
    # The embedding and the loss counted as layers: (4 + 2) / 3 = 2 a stage, 1 | 2 | 1.
    (3, ["--pipeline-model-parallel-size", "3", "--account-for-embedding-in-pipeline-split",
         "--account-for-loss-in-pipeline-split"], "1 | 2 | 1"),
])
def test_pipeline_layouts_train_like_one_process(ranks, layout, split, one_process, tmp_path):
    tb = str(tmp_path / "tb")
    r = run(ranks, [*MODEL, *layout, "--train-iters", "20", "--tensorboard-dir", tb])
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"layers per stage {split}" in r.stdout, r.stdout
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


TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


@pytest.mark.parametrize("flags, ranks, layout, config, present, absent, refusal", [
    (["--add-qkv-bias"], 8, LAYOUT_3D, {"add_qkv_bias": True},
     ("self_attn.q_proj.bias", [64]), "self_attn.o_proj.bias",
     "add_qkv_bias is true in the checkpoint and false in this run"),
    # Qwen3-0.6B's attention: heads twice hidden / heads wide, so q is 128 wide on hidden 64.
    (["--qk-layernorm", "--kv-channels", "32"], 8, LAYOUT_3D,
     {"qk_layernorm": True, "kv_channels": 32}, ("self_attn.q_proj.weight", [128, 64]),
     "self_attn.q_proj.bias",
     "kv_channels (the head width) is 32 in the checkpoint and 16 in this run"),
    (["--qk-layernorm"], 4, TP2_PP2, {"qk_layernorm": True, "kv_channels": 16},
     ("self_attn.q_norm.weight", [16]), "self_attn.q_proj.bias",
     "qk_layernorm is true in the checkpoint and false in this run"),
    # StableLM's RoPE on a part of each head (here half: 8 of 16 channels).
    (["--rotary-percent", "0.5"], 4, TP2_PP2, {"rotary_percent": 0.5},
     ("self_attn.q_proj.weight", [64, 64]), "self_attn.q_norm.weight",
     "rotary_percent is 0.5 in the checkpoint and 1 in this run"),
    # Norm weights that hold gamma - 1 (--apply-layernorm-1p).
    (["--apply-layernorm-1p"], 8, LAYOUT_3D, {"zero_centered_gamma": True},
     ("input_layernorm.weight", [64]), "self_attn.q_norm.weight",
     "zero_centered_gamma is true in the checkpoint and false in this run"),
    # Nemotron-4's MLP: squared ReLU, ungated (in place of MODEL's --swiglu).
    (["--squared-relu"], 4, TP2_PP2, {"activation": "squared_relu"},
     ("mlp.up_proj.weight", [256, 64]), "mlp.gate_proj.weight",
     # (without biases Megatron's GELU is the exact one)
     'activation is "squared_relu" in the checkpoint and "gelu_exact" in this run'),
])
def test_qwen_attention_flags_train_like_one_process_and_are_part_of_the_model(
        flags, ranks, layout, config, present, absent, refusal, tmp_path):
    # Megatron's --add-qkv-bias (Qwen2: biases on q, k and v beside --disable-bias-linear, split
    # over TP with their weights), --qk-layernorm (Qwen3: a norm on each query and key head,
    # its weights replicated over TP and their gradients summed there, with sequence
    # parallelism or without), --kv-channels (heads wider than hidden / heads), --rotary-percent,
    # --apply-layernorm-1p and --squared-relu: the TP 2 run trains like one process; a
    # checkpoint of it is a different model from one without.
    model = [x for x in MODEL if x != "--swiglu" or "--squared-relu" not in flags]
    runs = {}
    for name, n, lay in (("one", 1, []), ("tp", ranks, layout)):
        tb = str(tmp_path / name)
        save = ["--save", str(tmp_path / "ckpt")] if name == "tp" else []
        r = run(n, [*model, *lay, *save, *flags, "--train-iters", "10", "--eval-iters", "0",
                    "--tensorboard-dir", tb])
        assert r.returncode == 0, r.stdout + r.stderr
        runs[name] = losses(jsonl(os.path.join(tb, "metrics.jsonl")))
    assert sorted(runs["one"]) == list(range(1, 11))
    np.testing.assert_allclose([runs["tp"][i] for i in range(1, 11)],
                               [runs["one"][i] for i in range(1, 11)], rtol=2e-4)
    sys.path.insert(0, os.path.join(REPO, "python"))
    import braid

    meta = braid.checkpoint_metadata(str(tmp_path / "ckpt"))
    assert {key: meta["config"][key] for key in config} == config
    assert meta["tensors"][f"model.layers.0.{present[0]}"]["shape"] == present[1]
    assert f"model.layers.0.{absent}" not in meta["tensors"]
    r = run(1, [*model, "--train-iters", "12", "--eval-iters", "0", "--load",
                str(tmp_path / "ckpt")])
    assert r.returncode == 2 and f"a different model - {refusal}" in r.stderr, \
        r.stdout + r.stderr


def test_checkpoints_from_before_kv_channels_load(tmp_path):
    # Their config has no kv_channels: the head width was hidden / heads, which the same-model
    # check and --use-checkpoint-args take it to be.
    ckpt = tmp_path / "ckpt"
    r = run(1, [*MODEL, "--train-iters", "4", "--lr-decay-iters", "8", "--eval-iters", "0",
                "--save", str(ckpt)])
    assert r.returncode == 0, r.stdout + r.stderr
    meta_path = ckpt / "iter_0000004" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    assert meta["config"].pop("kv_channels") == 16
    meta_path.write_text(json.dumps(meta))
    for extra in ([], ["--use-checkpoint-args"]):
        r = run(1, [*MODEL, *extra, "--load", str(ckpt), "--override-opt_param-scheduler",
                    "--train-iters", "5", "--eval-iters",
                    "0"])
        assert r.returncode == 0, r.stdout + r.stderr
        assert "iteration        5/" in r.stdout, r.stdout
    r = run(1, [*MODEL, "--kv-channels", "32", "--load", str(ckpt),
                "--override-opt_param-scheduler", "--train-iters", "5"])
    assert r.returncode == 2 and "a different model - kv_channels (the head width) is 16 in the " \
        "checkpoint and 32 in this run" in r.stderr, r.stdout + r.stderr


def test_rope_scaling_is_part_of_the_model(tmp_path):
    # Megatron's --use-rope-scaling --rope-scaling-factor 32 (Llama 3.2's) reaches the model:
    # the checkpoint's config records the rule, and --use-checkpoint-args takes it back. (What
    # the scaling computes is checked against HF's LlamaForCausalLM: test_hf_oracle.py.)
    sys.path.insert(0, os.path.join(REPO, "python"))
    import braid

    ckpt = str(tmp_path / "ckpt")
    r = run(1, [*MODEL, "--use-rope-scaling", "--rope-scaling-factor", "32", "--train-iters",
                "4", "--eval-iters", "0", "--save", ckpt])
    assert r.returncode == 0, r.stdout + r.stderr
    c = braid.checkpoint_metadata(ckpt)["config"]
    assert (c["rope_scaling_factor"], c["rope_low_freq_factor"], c["rope_high_freq_factor"],
            c["rope_original_max_position_embeddings"]) == (32.0, 1.0, 4.0, 8192)
    r = run(1, [*MODEL, "--use-checkpoint-args", "--load", ckpt,
                "--override-opt_param-scheduler", "--train-iters", "5",
                "--eval-iters", "0"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "braid: --use-rope-scaling True from the checkpoint" in r.stdout, r.stdout
    assert "braid: --rope-scaling-factor 32.0 from the checkpoint" in r.stdout, r.stdout
    # Loaded without it, the run goes on (a context extension may change RoPE on purpose) and
    # says what differs.
    r = run(1, [*MODEL, "--load", ckpt, "--override-opt_param-scheduler", "--train-iters", "6",
                "--eval-iters", "0"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "braid: warning: the checkpoint's model has rope_scaling_factor 32.0, this run's 0.0 " \
        "(--use-rope-scaling --rope-scaling-factor)" in r.stdout, r.stdout


def test_linear_position_interpolation_is_part_of_the_model(tmp_path):
    # Megatron's --rotary-seq-len-interpolation-factor 4 reaches the model and its checkpoint
    # (format 5: older braids would turn RoPE by whole positions and must refuse it), and
    # --use-checkpoint-args takes it back. (What it computes: HF's rope_type linear,
    # test_hf_oracle.py.)
    sys.path.insert(0, os.path.join(REPO, "python"))
    import braid

    ckpt = str(tmp_path / "ckpt")
    r = run(1, [*MODEL, "--rotary-seq-len-interpolation-factor", "4", "--train-iters", "4",
                "--eval-iters", "0", "--save", ckpt])
    assert r.returncode == 0, r.stdout + r.stderr
    meta = braid.checkpoint_metadata(ckpt)
    assert (meta["config"]["rope_linear_factor"], meta["format_version"]) == (4.0, 5)
    assert ", RoPE positions interpolated by 1/4" in r.stdout, r.stdout
    r = run(1, [*MODEL, "--use-checkpoint-args", "--load", ckpt,
                "--override-opt_param-scheduler", "--train-iters", "5", "--eval-iters", "0"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "braid: --rotary-seq-len-interpolation-factor 4 from the checkpoint" in r.stdout, \
        r.stdout


def test_interleaved_rope_trains_like_one_process_and_is_part_of_the_model(tmp_path):
    # Megatron's --rotary-interleaved (GPT-J's pairs) trains alike under tp 2 x cp 2 (each
    # chunk's positions) and otherwise than rotate_half's pairs; the checkpoint is format 6
    # (older braids would pair the channels as rotate_half and must refuse it) and
    # --use-checkpoint-args takes it back. (What it computes: megatron-core's logits,
    # test_convert_megatron.py's llama-interleaved.)
    sys.path.insert(0, os.path.join(REPO, "python"))
    import braid

    ckpt = str(tmp_path / "ckpt")
    runs = {}
    for name, n, flags in (
            ("one", 1, ["--rotary-interleaved"]),
            ("tp_cp", 4, ["--rotary-interleaved", "--tensor-model-parallel-size", "2",
                          "--context-parallel-size", "2", "--save", ckpt]),
            ("rotate_half", 1, [])):
        tb = str(tmp_path / name)
        r = run(n, [*MODEL, *flags, "--train-iters", "8", "--eval-iters", "0",
                    "--tensorboard-dir", tb])
        assert r.returncode == 0, r.stdout + r.stderr
        assert ("interleaved RoPE pairs) on" in r.stdout) == (name != "rotate_half"), r.stdout
        runs[name] = [losses(jsonl(os.path.join(tb, "metrics.jsonl")))[i] for i in range(1, 9)]
    layouts = np.abs(np.array(runs["tp_cp"]) / runs["one"] - 1).max()
    pairs = np.abs(np.array(runs["one"]) / runs["rotate_half"] - 1).max()
    print(f"interleaved RoPE: tp2 x cp2 vs one process {layouts:.1e}, vs rotate_half {pairs:.1e}")
    assert layouts < 1e-6 and pairs > 2e-5, runs
    meta = braid.checkpoint_metadata(ckpt)
    assert (meta["config"]["rotary_interleaved"], meta["format_version"]) == (True, 6)
    r = run(1, [*MODEL, "--use-checkpoint-args", "--load", ckpt,
                "--override-opt_param-scheduler", "--train-iters", "7", "--eval-iters", "0"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "braid: --rotary-interleaved True from the checkpoint" in r.stdout, r.stdout
    # Loaded without it: another model (its channels pair otherwise), refused.
    r = run(1, [*MODEL, "--load", ckpt, "--override-opt_param-scheduler", "--train-iters", "7",
                "--eval-iters", "0"])
    assert r.returncode == 2, r.stdout + r.stderr
    assert "a different model - rotary_interleaved (--rotary-interleaved) is true in the " \
        "checkpoint and false in this run" in r.stderr, r.stderr
    for flags, message in (
            (["--position-embedding-type", "learned_absolute"],
             "--rotary-interleaved needs --position-embedding-type rope"),):
        r = run(1, [*MODEL, "--rotary-interleaved", *flags, "--train-iters", "1"])
        assert r.returncode == 2 and f"braid: error: {message}" in r.stdout + r.stderr, \
            r.stdout + r.stderr


def test_sliding_window_trains_like_one_process_and_is_part_of_the_model(one_process, tmp_path):
    # Megatron's --window-size 7,0 --window-attn-skip-freq 2: layers 1 and 3 (of 4) attend to
    # the last 8 of the 32 positions, 2 and 4 to all. Under tp 2 x cp 2 with sequence
    # parallelism (a query's window reaches into the chunk before its own) the run trains
    # like one process; its losses are not the windowless model's; the checkpoint records the
    # window, --use-checkpoint-args takes it back, and a run without it is told.
    sys.path.insert(0, os.path.join(REPO, "python"))
    import braid

    window = ["--window-size", "7,0", "--window-attn-skip-freq", "2"]
    ckpt = str(tmp_path / "ckpt")
    runs = {}
    for name, n, lay in (("one", 1, []), ("tp_cp", 4, [
            "--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
            "--sequence-parallel"])):
        tb = str(tmp_path / name)
        save = ["--save", ckpt] if n > 1 else []
        r = run(n, [*MODEL, *lay, *window, *save, "--train-iters", "10", "--eval-iters", "0",
                    "--tensorboard-dir", tb])
        assert r.returncode == 0, r.stdout + r.stderr
        assert "4 heads / 2 kv, a sliding window of 7 on 2 layers) on" in r.stdout, r.stdout
        runs[name] = [losses(jsonl(os.path.join(tb, "metrics.jsonl")))[i] for i in range(1, 11)]
    # (They agree to 1e-7; the windowless model's losses are 1e-4 to 8e-4 away.)
    np.testing.assert_allclose(runs["tp_cp"], runs["one"], rtol=1e-5)
    # The first iterations (the warmup: the same learning rates) of the windowless model.
    windowless = [losses(one_process)[i] for i in (1, 2, 3)]
    assert np.abs(np.array(runs["one"][:3]) / windowless - 1).min() > 5e-5, \
        (runs["one"], windowless)
    c = braid.checkpoint_metadata(ckpt)["config"]
    assert (c["window_size"], c["window_layers"]) == (7, [1, 0, 1, 0])
    r = run(1, [*MODEL, "--use-checkpoint-args", "--load", ckpt,
                "--override-opt_param-scheduler", "--train-iters", "11",
                "--eval-iters", "0"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "braid: --window-size 7 from the checkpoint" in r.stdout, r.stdout
    assert "braid: --window-attn-skip-freq [1, 0, 1, 0] from the checkpoint" in r.stdout
    r = run(1, [*MODEL, "--load", ckpt, "--override-opt_param-scheduler", "--train-iters", "11",
                "--eval-iters", "0"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "braid: warning: the checkpoint's model has window_size 7, this run's -1 " \
        "(--window-size)" in r.stdout, r.stdout


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
    # What a Megatron launch script passes to pick kernels and backends, or to ask for metrics
    # braid always writes: accepted, each named in the log with why it changes nothing, and the
    # run trains exactly as without them. (--log-world-size-to-tensorboard adds its metric.)
    flags = ["--use-mcore-models", "--transformer-impl", "transformer_engine", "--use-flash-attn",
             "--attention-backend", "auto", "--no-gradient-accumulation-fusion",
             "--distributed-backend", "nccl", "--calculate-per-token-loss", "--num-workers", "2",
             "--apply-query-key-layer-scaling", "--cp-comm-type", "p2p", "a2a",
             "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files",
             "--tp-comm-overlap", "--use-precision-aware-optimizer", "--exp-avg-dtype", "fp32",
             "--ckpt-format", "torch_dist", "--log-validation-ppl-to-tensorboard",
             "--log-batch-size-to-tensorboard", "--tensorboard-queue-size", "5",
             "--log-world-size-to-tensorboard"]
    tb = str(tmp_path / "tb")
    r = run(1, [*MODEL, *flags, "--train-iters", "20", "--tensorboard-dir", tb])
    assert r.returncode == 0, r.stdout + r.stderr
    notes = re.findall(r"^braid: (--[a-z-]+(?: \S+)*?) has no effect: ", r.stdout, re.M)
    assert notes == ["--use-mcore-models", "--transformer-impl transformer_engine",
                     "--use-flash-attn", "--attention-backend auto",
                     "--cp-comm-type p2p a2a",  # Megatron's: one value, or one per layer
                     "--calculate-per-token-loss",
                     "--distributed-backend nccl", "--num-workers 2",
                     "--log-validation-ppl-to-tensorboard", "--log-batch-size-to-tensorboard",
                     "--tensorboard-queue-size 5", "--no-gradient-accumulation-fusion",
                     "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files",
                     "--tp-comm-overlap", "--use-precision-aware-optimizer",
                     "--ckpt-format torch_dist", "--apply-query-key-layer-scaling"], \
        r.stdout
    records = jsonl(os.path.join(tb, "metrics.jsonl"))
    assert losses(records) == losses(one_process)
    # What those metric flags ask for is there: Megatron's tags, every recorded step.
    assert {r["step"]: r["batch-size"] for r in records if "batch-size" in r} == \
        {step: 16 for step in range(1, 21)}
    assert {r["step"]: r["world-size"] for r in records if "world-size" in r} == \
        {step: 1 for step in range(1, 21)}
    ppl = {r["step"]: r["lm loss validation ppl"] for r in records
           if "lm loss validation ppl" in r}
    assert ppl.keys() == validation(records).keys() == {10, 20}
    for step, value in ppl.items():
        assert value == pytest.approx(math.exp(validation(records)[step]), rel=1e-12)


def test_each_splits_own_data_path_and_the_test_evaluation(tmp_path):
    # Megatron's --train/valid/test-data-path: each split's datasets used whole. Training on
    # --train-data-path A is training on --data-path A --split 100,0,0 (the same samples); the
    # valid and test losses come from their own files, the test loss once, at the end.
    prefixes = {}
    for name, high, seed in (("train", 1000, 0), ("valid", 1000, 1), ("test", 50, 2)):
        prefixes[name] = str(tmp_path / f"{name}_text_document")
        write_documents(prefixes[name], 200, high, seed)
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
    from braid.training_data import Data

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


def test_mock_data_trains_and_evaluates_the_valid_and_test_splits(tmp_path):
    # Megatron's mock data (tests/python/data/test_mock_data.py): learnable documents, and the
    # valid and test splits Megatron evaluates.
    tb = str(tmp_path / "tb")
    r = run(1, [*MODEL, "--tokenizer-type", "NullTokenizer", "--train-iters", "10",
                "--tensorboard-dir", tb])
    assert r.returncode == 0, r.stdout + r.stderr
    records = jsonl(os.path.join(tb, "metrics.jsonl"))
    assert any("lm loss validation" in rec for rec in records), records
    assert any("lm loss test" in rec for rec in records), records
    losses = [rec["lm loss"] for rec in records if "lm loss" in rec]
    assert losses[-1] < losses[0]  # Megatron's mock documents are learnable sequences
