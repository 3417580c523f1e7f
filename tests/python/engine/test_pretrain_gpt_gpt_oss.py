"""pretrain_gpt.py with GPT-OSS's Megatron flags (the quick GEGLU with its offset and clamp,
learnable attention sinks, a sliding window on every other layer, YaRN with an unrounded
correction range, experts behind a router with a bias, biases everywhere): tensor x context
parallelism and pipeline x data x expert parallelism train like one process, a checkpoint resumes
under --use-checkpoint-args exactly where the one process is, tools/generate.py decodes it over
its KV cache, the sinks change what the model computes, and a bad pair of flags is refused before
any collective. The flags' parsing: test_gpt_oss_args.py."""

import os
import shutil
import sys

import numpy as np
import pytest

from pretrain_job import (REPO, assert_generate_decodes_greedily, assert_moe_layouts_train_alike,
                          jsonl, losses, run, run_layouts)

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")

# The GPT-OSS script's model flags at the engine tests' sizes: 4 layers of 64, heads of 24 (the
# queries 96 wide, wider than the hidden size as GPT-OSS's 64 x 64 over 2880), a window of 7 on
# every other layer (its 127 would cover these 32-token sequences), 4 experts of 32, top 2.
GPT_OSS = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
           "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "24",
           "--quick-geglu", "--glu-linear-offset", "1.0", "--activation-func-clamp-value", "7.0",
           "--softmax-type", "learnable", "--window-size", "7,0", "--window-attn-skip-freq", "2",
           "--position-embedding-type", "yarn", "--rotary-base", "150000", "--rotary-percent",
           "1.0", "--rotary-scaling-factor", "32.0", "--yarn-original-max-position-embeddings",
           "4096", "--yarn-beta-fast", "32.0", "--yarn-beta-slow", "1.0", "--mscale", "1.0",
           "--mscale-all-dim", "0.0", "--no-yarn-correction-range-round-to-int",
           "--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2",
           "--moe-router-score-function", "softmax", "--moe-router-load-balancing-type",
           "aux_loss", "--moe-router-dtype", "fp32", "--untie-embeddings-and-output-weights",
           "--normalization", "RMSNorm"]
# What a run needs besides the model (a resumed one takes the model from the checkpoint), the
# router loss's coefficient included: training's, not the model's. GPT-OSS's is 0; 0.01 here puts
# the loss in the metrics, the routing's check.
TRAINING = ["--device", "cpu", "--moe-aux-loss-coeff", "0.01", "--hidden-dropout", "0",
            "--attention-dropout", "0.0", "--mock-data", "--vocab-size", "300", "--seq-length",
            "32", "--micro-batch-size", "2", "--global-batch-size", "16", "--lr", "3e-3",
            "--lr-warmup-iters", "3", "--distributed-timeout-minutes", "1", "--log-interval", "5"]


def test_gpt_oss_layouts_train_like_one_process_and_resume(tmp_path):
    sys.path.insert(0, os.path.join(REPO, "python"))
    import braid

    ckpt = str(tmp_path / "ckpt")
    runs, stdout = run_layouts(tmp_path, [*GPT_OSS, *TRAINING], (
        ("one", 1, ["--save", ckpt, "--save-interval", "10"]),
        # tp 2 x cp 2, sequence parallel: the sinks split by heads, each CP rank's chunks
        # windowed against the gathered keys.
        ("tp2_cp2", 4, ["--exit-interval", "10", "--tensor-model-parallel-size", "2",
                        "--sequence-parallel", "--context-parallel-size", "2"])), timeout=300)
    # The one-process checkpoint at 10 continues under pp 2 x dp 2 with ep 2 and ZeRO, its model
    # from the checkpoint alone (--use-checkpoint-args): the one-process losses 11 to 20.
    tb = str(tmp_path / "resumed")
    r = run(4, [*TRAINING, "--load", ckpt, "--ckpt-step", "10", "--use-checkpoint-args",
                "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                "--use-distributed-optimizer", "--train-iters", "20", "--eval-iters", "0",
                "--tensorboard-dir", tb], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    runs["resumed"] = jsonl(os.path.join(tb, "metrics.jsonl"))
    assert_moe_layouts_train_alike(runs, {"tp2_cp2": range(1, 11), "resumed": range(11, 21)})
    for words in ("learnable attention sinks", "correction range not rounded",
                  "quick GEGLU MLP (up + 1, clamped at 7)", "4 experts of 32 with top-2"):
        assert words in stdout["one"] and words in r.stdout, words
    for line in ("--quick-geglu True", "--softmax-type learnable", "--glu-linear-offset 1.0",
                 "--activation-func-clamp-value 7.0", "--yarn-correction-range-round-to-int "
                 "False", "--rope-type yarn"):
        assert f"braid: {line} from the checkpoint" in r.stdout, (line, r.stdout)
    assert "ep=2" in r.stdout and "pp=2 dp=2" in r.stdout, r.stdout

    meta = braid.checkpoint_metadata(ckpt)
    c = meta["config"]
    assert meta["format_version"] == 7, meta["format_version"]
    assert (c["activation"], c["softmax_type"], c["glu_linear_offset"], c["activation_clamp"],
            c["rope_yarn_truncate"], c["rope_yarn_factor"], c["add_bias_linear"]) == (
        "quick_geglu", "learnable", 1.0, 7.0, False, 32.0, True)
    # Each layer's sinks (split by heads) and router bias (replicated), and their Adam moments.
    tensors = meta["tensors"]
    for layer in range(4):
        for name, split in ((f"model.layers.{layer}.self_attn.sinks", 0),
                            (f"model.layers.{layer}.mlp.gate.bias", -1)):
            assert (tensors[name]["shape"], tensors[name]["split_dim"]) == ([4], split), name
            assert f"optimizer.exp_avg.{name}" in tensors, name
    assert_generate_decodes_greedily(ckpt, c)


def test_the_sinks_change_the_losses_and_bad_flags_stop_every_rank(tmp_path):
    # The same run with the vanilla softmax: other losses from the first step on (the sinks
    # take a share of every row's probability), ten times the layouts' 1e-5 and more.
    got = {}
    for softmax in ("learnable", "vanilla"):
        tb = str(tmp_path / softmax)
        args = [*GPT_OSS, *TRAINING, "--softmax-type", softmax, "--train-iters", "4",
                "--eval-iters", "0", "--tensorboard-dir", tb]
        r = run(1, args, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        got[softmax] = losses(jsonl(os.path.join(tb, "metrics.jsonl")))
    assert sorted(got["learnable"]) == sorted(got["vanilla"]) == [1, 2, 3, 4]
    learnable = np.array([got["learnable"][i] for i in range(1, 5)])
    vanilla = np.array([got["vanilla"][i] for i in range(1, 5)])
    assert np.all(np.abs(learnable - vanilla) > 1e-4 * np.abs(vanilla)), (learnable, vanilla)
    # Found by every rank from the arguments alone, before MPI is up.
    r = run(2, [*GPT_OSS, *TRAINING, "--swiglu", "--train-iters", "2"], timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "braid: error: --quick-geglu and --swiglu are two activations; give one" in r.stderr
