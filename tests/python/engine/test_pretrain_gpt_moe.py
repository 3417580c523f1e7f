"""pretrain_gpt.py with Megatron's mixture-of-experts flags: the run trains alike in one process
and split over tensor (with sequence), pipeline, data and context parallelism, logs the
load-balancing loss, and its checkpoint resumes in another layout; the flags braid does not
implement are refused with the reason. DeepSeek-V3's router flags: test_pretrain_gpt_moe_router."""

import os
import sys

import pytest

from pretrain_job import (MODEL, REPO, assert_generate_decodes_greedily,
                          assert_moe_layouts_train_alike, balancing, run, run_layouts)

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
       "--moe-aux-loss-coeff", "0.01", "--moe-shared-expert-intermediate-size", "48",
       "--moe-shared-expert-gate", "--moe-layer-freq", "[1,1,0,1]"]


def test_experts_train_like_one_process_and_resume_in_another_layout(tmp_path):
    # Top-2 of 4 experts and a gated shared expert on layers 1, 2 and 4 (the third is dense),
    # with Megatron's aux_loss (Qwen2-MoE's block, Megatron's flags). One process trains 20
    # iterations; tp 2 x pp 2 x dp 2 (sequence parallel, distributed optimizer, overlapped
    # reduction) and tp 2 x cp 2 (sequence parallel) train the first 10 alike, with the same
    # load-balancing loss; the 3D run's checkpoint at 10 resumes in one process and gives the
    # one-process losses 11 to 20.
    sys.path.insert(0, os.path.join(REPO, "python"))
    import braid

    ckpt = str(tmp_path / "ckpt")
    runs, stdout = run_layouts(tmp_path, [*MODEL, *MOE], (
        ("one", 1, []),
        ("3d", 8, ["--exit-interval", "10", "--save", ckpt, "--tensor-model-parallel-size", "2",
                   "--pipeline-model-parallel-size", "2", "--sequence-parallel",
                   "--use-distributed-optimizer", "--overlap-grad-reduce"]),
        ("tp_cp", 4, ["--exit-interval", "10", "--tensor-model-parallel-size", "2",
                      "--context-parallel-size", "2", "--sequence-parallel"]),
        ("resumed", 1, ["--load", ckpt])))
    for out in stdout.values():
        assert "4 experts of 32 with top-2 routing) on" in out, out
        assert "| load_balancing_loss: " in out, out
    one_balance = balancing(runs["one"])
    assert sorted(one_balance) == list(range(1, 21))
    # Perfect balance gives 1; top-2 of 4 experts at most 2 (every token on the same two).
    assert all(0.9 < v < 2.0 for v in one_balance.values()), one_balance
    assert_moe_layouts_train_alike(runs, {"3d": range(1, 11), "tp_cp": range(1, 11),
                                          "resumed": range(11, 21)})
    c = braid.checkpoint_metadata(ckpt)["config"]
    assert (c["num_experts"], c["moe_router_topk"], c["moe_ffn_hidden_size"],
            c["moe_router_pre_softmax"], c["moe_shared_expert_intermediate_size"],
            c["moe_shared_expert_gate"], c["moe_layers"]) == (4, 2, 32, False, 48, True,
                                                              [1, 1, 0, 1])
    assert_generate_decodes_greedily(ckpt, c)
    # --use-checkpoint-args takes the experts back; a dense run cannot load the checkpoint.
    r = run(1, [*MODEL, "--use-checkpoint-args", "--load", ckpt,
                "--override-opt_param-scheduler", "--train-iters", "11",
                "--eval-iters", "0"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "braid: --num-experts 4 from the checkpoint" in r.stdout, r.stdout
    assert "braid: --moe-shared-expert-gate True from the checkpoint" in r.stdout, r.stdout
    r = run(1, [*MODEL, "--load", ckpt, "--override-opt_param-scheduler", "--train-iters", "11",
                "--eval-iters", "0"])
    assert r.returncode != 0
    assert "num_experts is 4 in the checkpoint and 0 in this run" in r.stdout + r.stderr


def test_the_aux_loss_coefficient_changes_training():
    # Without the load-balancing loss (coefficient 0, or --moe-router-load-balancing-type none)
    # the losses differ from those with it, and none logs no load_balancing_loss.
    runs = {}
    for name, flags in (("aux", MOE), ("none", [*MOE, "--moe-router-load-balancing-type", "none"])):
        r = run(1, [*MODEL, *flags, "--moe-aux-loss-coeff", "1.0", "--train-iters", "10",
                    "--eval-iters", "0", "--log-interval", "1"])
        assert r.returncode == 0, r.stdout + r.stderr
        runs[name] = r.stdout
    assert "load_balancing_loss" in runs["aux"] and "load_balancing_loss" not in runs["none"]
    final = {name: float(out.rsplit("final lm loss ", 1)[1].split()[0])
             for name, out in runs.items()}
    assert abs(final["aux"] / final["none"] - 1) > 1e-5, final


@pytest.mark.parametrize("args, message", [
    (["--moe-aux-loss-coeff", "0.1"], "--moe-aux-loss-coeff needs --num-experts"),
    (["--num-experts", "4", "--moe-router-topk", "5"], "is more than --num-experts 4"),
    (["--num-experts", "4", "--moe-router-load-balancing-type", "sinkhorn"],
     "--moe-router-load-balancing-type sinkhorn is not implemented"),
    (["--num-experts", "4", "--moe-layer-freq", "[1,0,1]"],
     "--moe-layer-freq gives 3 layers for --num-layers 4"),
    (["--num-experts", "4", "--moe-layer-freq", "[0,0,0,0]"], "gives no layer experts"),
    (["--num-experts", "2000"], "at most 1024 experts"),
    (["--num-experts", "4", "--moe-shared-expert-gate"],
     "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size"),
])
def test_unsupported_expert_flags_are_refused(args, message):
    r = run(1, [*MODEL, *args, "--train-iters", "1"], timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr, r.stderr
