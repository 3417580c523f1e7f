"""pretrain_gpt.py with --expert-tensor-parallel-size 1 (Megatron's MoE parallel folding): each
tensor-parallel rank routes its own sequence-parallel tokens through whole experts, and the
expert-parallel groups span the TP ranks too. It trains like one process, alone and inside
pipeline and data parallelism with ZeRO, and its checkpoints resume in other layouts."""

import os
import sys

import pytest

from pretrain_job import (MODEL, REPO, assert_generate_decodes_greedily,
                          assert_moe_layouts_train_alike, run, run_layouts)
from test_pretrain_gpt_expert_parallel import EXPERTS

WHOLE = ["--tensor-model-parallel-size", "2", "--sequence-parallel",
         "--expert-tensor-parallel-size", "1"]


def test_whole_experts_train_like_one_process_and_resume_in_other_layouts(tmp_path):
    sys.path.insert(0, os.path.join(REPO, "python"))
    import braid

    whole_ckpt, one_ckpt = str(tmp_path / "whole_ckpt"), str(tmp_path / "one_ckpt")
    runs, stdout = run_layouts(tmp_path, [*MODEL, *EXPERTS], (
        ("one", 1, ["--save", one_ckpt, "--save-interval", "10"]),
        # The TP pair is the EP group: each rank holds 4 whole experts; every layer recomputed.
        ("tp2_ep2", 2, ["--exit-interval", "10", *WHOLE, "--expert-model-parallel-size", "2",
                        "--recompute-granularity", "full", "--recompute-method", "uniform",
                        "--recompute-num-layers", "1"]),
        # EP 4 over tp 2 x dp 2 (expert DP 1), ZeRO and overlapped reduction; saved.
        ("tp2_dp2_ep4", 4, ["--exit-interval", "10", *WHOLE, "--expert-model-parallel-size", "4",
                            "--use-distributed-optimizer", "--overlap-grad-reduce",
                            "--save", whole_ckpt]),
        # EP 1: every rank holds every expert whole; their gradients sum over tp x dp. Selective
        # recomputation dispatches the experts' input again in the backward.
        ("tp2_pp2_ep1", 4, ["--exit-interval", "10", *WHOLE, "--pipeline-model-parallel-size",
                            "2", "--use-distributed-optimizer", "--recompute-granularity",
                            "selective"]),
        # The whole-experts checkpoint in one process, the one-process checkpoint under them.
        ("whole_to_one", 1, ["--load", whole_ckpt]),
        ("one_to_whole", 4, ["--load", one_ckpt, "--ckpt-step", "10", *WHOLE,
                             "--expert-model-parallel-size", "2"])),
        timeout=300)
    assert_moe_layouts_train_alike(runs, {"tp2_ep2": range(1, 11), "tp2_dp2_ep4": range(1, 11),
                                          "tp2_pp2_ep1": range(1, 11),
                                          "whole_to_one": range(11, 21),
                                          "one_to_whole": range(11, 21)})
    assert ": tp=2 pp=1 dp=2 ep=4 etp=1" in stdout["tp2_dp2_ep4"], stdout["tp2_dp2_ep4"]
    # The stage's four ranks write: TP rank t's dense shards in EP rank t's file, every EP rank
    # its two whole experts.
    files = sorted(os.listdir(os.path.join(whole_ckpt, "iter_0000010")))
    assert [f for f in files if f.endswith(".safetensors")] == [
        "mp_rank_00_000_000.safetensors", "mp_rank_00_000_002.safetensors",
        "mp_rank_01_000_001.safetensors", "mp_rank_01_000_003.safetensors"], files
    meta = braid.checkpoint_metadata(whole_ckpt)
    assert meta["layout"]["expert_tensor_parallel_size"] == 1, meta["layout"]
    assert_generate_decodes_greedily(whole_ckpt, meta["config"])


@pytest.mark.parametrize("ranks, args, message", [
    (2, ["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"],
     "--expert-tensor-parallel-size 1 with --tensor-model-parallel-size 2 needs "
     "--sequence-parallel"),
    (2, [*WHOLE, "--expert-model-parallel-size", "4", "--num-experts", "8"],
     "--expert-model-parallel-size 4 does not divide the 2 tensor x data x context-parallel "
     "ranks"),
    (4, ["--tensor-model-parallel-size", "4", "--sequence-parallel",
         "--expert-tensor-parallel-size", "2"],
     "--expert-tensor-parallel-size 2: braid splits experts over the TP group "
     "(--tensor-model-parallel-size 4) or keeps them whole (1)"),
    (2, [*WHOLE, "--micro-batch-size", "3", "--global-batch-size", "6",
         "--moe-router-load-balancing-type", "seq_aux_loss"],
     "each of the 2 TP ranks' token shards must hold whole sequences"),
])
def test_bad_whole_expert_layouts_are_refused(ranks, args, message):
    r = run(ranks, [*MODEL, *EXPERTS, *args, "--train-iters", "1"], timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr, r.stderr
