"""pretrain_gpt.py with --expert-model-parallel-size: experts split over groups of data-parallel
(and context-parallel) ranks, tokens exchanged all-to-all, train like one process that holds
every expert - alone, inside tp x pp x dp with ZeRO and overlapped reduction, and across context
parallelism - and their checkpoints resume under another expert-parallel size."""

import os
import re
import sys

import pytest

from pretrain_job import (MODEL, REPO, assert_generate_decodes_greedily,
                          assert_moe_layouts_train_alike, run, run_layouts)
from test_pretrain_gpt_moe import MOE

# Eight experts (two per rank at ep 4), the DeepSeek-V3 router's expert bias besides the aux
# loss of MOE, so that the bias update's token counts cross the EP ranks too.
EXPERTS = [*MOE, "--num-experts", "8", "--moe-router-score-function", "sigmoid",
           "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01",
           "--moe-z-loss-coeff", "0.001"]


def test_expert_parallel_layouts_train_like_one_process_and_resume_across_sizes(tmp_path):
    sys.path.insert(0, os.path.join(REPO, "python"))
    import braid

    ep_ckpt, one_ckpt = str(tmp_path / "ep_ckpt"), str(tmp_path / "one_ckpt")
    runs, stdout = run_layouts(tmp_path, [*MODEL, *EXPERTS], (
        ("one", 1, ["--save", one_ckpt, "--save-interval", "10"]),
        # dp 2, ep 2 inside tp 2 x pp 2 (SP, ZeRO: expert shards over expert-DP = 1).
        ("3d_ep2", 8, ["--exit-interval", "10", "--save", ep_ckpt, "--tensor-model-parallel-size",
                       "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel",
                       "--use-distributed-optimizer", "--overlap-grad-reduce",
                       "--expert-model-parallel-size", "2"]),
        # dp 4, ep 2: expert gradients reduced over expert-DP groups of 2; buckets of their own.
        ("dp4_ep2", 4, ["--exit-interval", "10", "--expert-model-parallel-size", "2",
                        "--use-distributed-optimizer", "--overlap-grad-reduce",
                        "--ddp-bucket-size", "2000", "--timing-log-level", "2"]),
        # Interleaved pipeline stages around EP 2 (each stage's EP pair exchanges per chunk).
        ("vpp_ep2", 4, ["--exit-interval", "10", "--pipeline-model-parallel-size", "2",
                        "--num-layers-per-virtual-pipeline-stage", "1",
                        "--expert-model-parallel-size", "2", "--use-distributed-optimizer"]),
        # An EP group across the context-parallel pair and the data-parallel ranks.
        ("cp2_ep4", 4, ["--exit-interval", "10", "--context-parallel-size", "2",
                        "--expert-model-parallel-size", "4"]),
        # The ep 2 checkpoint in one process, the one-process checkpoint under ep 4.
        ("ep2_to_one", 1, ["--load", ep_ckpt]),
        ("one_to_ep4", 4, ["--load", one_ckpt, "--ckpt-step", "10",
                           "--expert-model-parallel-size", "4", "--use-distributed-optimizer"])),
        timeout=300)
    assert_moe_layouts_train_alike(runs, {"3d_ep2": range(1, 11), "dp4_ep2": range(1, 11),
                                          "vpp_ep2": range(1, 11), "cp2_ep4": range(1, 11),
                                          "ep2_to_one": range(11, 21),
                                          "one_to_ep4": range(11, 21)})
    assert ": tp=2 pp=2 dp=2 ep=2" in stdout["3d_ep2"], stdout["3d_ep2"]
    # The token exchanges are timed as the step's expert-parallel wait.
    waits = re.findall(r"    ep-comm-wait \.+: \(([0-9.]+), ([0-9.]+)\)", stdout["dp4_ep2"])
    assert len(waits) == 2 and all(float(lo) > 0 for lo, _ in waits), stdout["dp4_ep2"]
    # The ep 2 save: Megatron's expert-parallel file names, every expert stored once.
    files = sorted(os.listdir(os.path.join(ep_ckpt, "iter_0000010")))
    assert [f for f in files if f.endswith(".safetensors")] == [
        f"mp_rank_{t:02d}_{p:03d}_{e:03d}.safetensors" for t in range(2) for p in range(2)
        for e in range(2)], files
    meta = braid.checkpoint_metadata(ep_ckpt)
    assert_generate_decodes_greedily(ep_ckpt, meta["config"])


@pytest.mark.parametrize("ranks, args, message", [
    (2, ["--num-experts", "3", "--expert-model-parallel-size", "2"],
     "--expert-model-parallel-size 2 does not divide --num-experts 3"),
    (2, ["--num-experts", "4", "--expert-model-parallel-size", "4"],
     "--expert-model-parallel-size 4 does not divide the 2 data-parallel x context-parallel "
     "ranks"),
    (1, ["--expert-model-parallel-size", "2"], "--expert-model-parallel-size needs --num-experts"),
    (2, ["--num-experts", "4", "--expert-model-parallel-size", "2",
         "--expert-tensor-parallel-size", "2"], "--expert-tensor-parallel-size 2: braid splits"),
])
def test_bad_expert_parallel_layouts_are_refused(ranks, args, message):
    r = run(ranks, [*MODEL, *args, "--train-iters", "1"], timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr, r.stderr
