"""Whole experts in the planner (--expert-tensor-parallel-size 1, Megatron's MoE parallel folding;
braid.planner_moe, braid.planner, planner_inputs) and tools/plan.py: each TP rank routes its own
T / tp tokens through E / ep whole experts, ep dividing tp x dp x cp."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from braid import planner, planner_moe
from test_expert_parallel import TRAINING as SPLIT_TRAINING

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
PLAN = os.path.join(REPO, "tools", "plan.py")

MIXTRAL = planner.PRESETS["mixtral-8x7b"]  # 32 layers, h 4096, 8 experts of 14336, top 2
LITE = planner.PRESETS["deepseek-v2-lite"]  # 64 experts of 1408, top 6, a shared expert of 2816
V3 = planner.PRESETS["deepseek-v3"]
H100 = planner.Cluster(planner.GPUS["h100-80g"], 8, 64, 450e9, 50e9)
CLUSTER = ["--gpu", "h100-80g", "--num-gpus", "64", "--nvlink-bw", "450GB/s", "--net-bw",
           "50GB/s"]
H, F, E, K = 4096, 14336, 8, 2
EXPERT = 3 * H * F  # one routed expert (SwiGLU: gate, up, down)


def _plan(*args):
    return subprocess.run([sys.executable, PLAN, *args], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=os.path.join(REPO, "python")))


def _whole(r) -> bool:
    return r["expert_tensor_parallel_size"] == 1 and r["tp"] > 1


def test_a_rank_holds_e_over_ep_whole_experts():
    # TP 4, no pipeline, 16 DP ranks, EP 8 over the 64 TP x DP ranks: one whole expert of each
    # layer a rank, against a quarter of one (8 / 8 experts / 4) with the experts split.
    attention = H * (H + 2 * 1024) + H * H + 2 * H
    dense = 32 * (attention / 4 + E * H) + 2 * 32000 * H / 4 + H
    experts = 32 * E // 8 * EXPERT
    for zero in (True, False):
        lay = planner.Layout(4, 1, 16, 1, 1, "selective", True, zero, ep=8, etp=1)
        _, parts = planner.memory(MIXTRAL, H100, lay, 16)
        assert parts["params"] == pytest.approx(2 * (dense + experts) / 1e9, rel=1e-12)
        assert parts["grads"] == pytest.approx(4 * (dense + experts) / 1e9, rel=1e-12)
        # ZeRO: the dense state over the 16 DP ranks, the experts' over the 4 x 16 / 8 ranks
        # that hold the same experts - per rank as much as with the experts split (1/4 of an
        # expert over their 16 / 8 = 2 ranks).
        want = dense / 16 + experts / (4 * 16 // 8) if zero else dense + experts
        assert parts["optimizer"] == pytest.approx(12 * want / 1e9, rel=1e-12)
        split = planner.memory(MIXTRAL, H100, dataclasses.replace(lay, etp=0), 16)[1]
        assert parts["params"] - split["params"] == pytest.approx(
            2 * (experts - experts / 4) / 1e9, rel=1e-9)
        if zero:
            assert parts["optimizer"] == pytest.approx(split["optimizer"], rel=1e-12)
    assert MIXTRAL.experts_params(0, 32, 4, 8, True) == experts
    assert MIXTRAL.layers_params(0, 32, 4, 8, True) == pytest.approx(
        32 * (attention / 4 + E * H) + experts)
    # The gradients: dense over dp x cp, the experts' over tp x dp x cp / ep (etp 1 at any ep).
    lay = planner.Layout(4, 1, 16, 1, 1, "none", True, True, ep=8, etp=1)
    assert planner_moe.data_groups(lay, 3e9, 2e9) == [(1e9, 16), (2e9, 8)]
    assert planner_moe.data_groups(dataclasses.replace(lay, ep=1), 3e9, 2e9) == \
        [(1e9, 16), (2e9, 64)]


def test_a_rank_keeps_its_own_rows_of_the_whole_experts():
    # Nothing recomputed: fc1_out and act_out of T / t x k rows F wide are the split rows' share;
    # expert_in, expert_out, the logits and the routing (EP's orders too) are a rank's own T / t
    # tokens' instead of all T's.
    T = 4096
    for t in (2, 4):
        lay = planner.Layout(t, 1, 64 // t, 1, 1, "none", True, True, ep=8, etp=1)
        split = planner.layer_activation_bytes(MIXTRAL, dataclasses.replace(lay, etp=0))
        assert split - planner.layer_activation_bytes(MIXTRAL, lay) == pytest.approx(
            T * (1 - 1 / t) * (4 * H * K + 4 * E + 28 * K), rel=1e-12)


def test_whole_experts_run_the_same_flops_in_wider_gemms():
    # TP 4, EP 8, micro batch 1: one whole expert on the 1024 tokens x k x 8 ranks / 8 experts
    # of a rank's group, against 1/4 of it on 4096 x 2 rows.
    whole = planner_moe.mlp_gemms(MIXTRAL, 4096, 4, 8, True)
    split = planner_moe.mlp_gemms(MIXTRAL, 4096, 4, 8)
    assert whole == [(1, 2048, 2 * F, H), (1, 2048, H, F)]
    assert split == [(1, 8192, 2 * F / 4, H), (1, 8192, H, F / 4)]

    def flops(gemms):
        return sum(c * m * n * k for c, m, n, k in gemms)

    assert flops(whole) == flops(split)
    lay = planner.Layout(4, 2, 8, 1, 1, "none", True, True, ep=8, etp=1)
    assert planner.layer_cost(MIXTRAL, H100, lay).model_flops == \
        planner.layer_cost(MIXTRAL, H100, dataclasses.replace(lay, etp=0)).model_flops
    # DeepSeek-V2-Lite's shared expert stays split over TP on all T tokens.
    assert planner_moe.mlp_gemms(LITE, 4096, 4, 8, True)[2:] == \
        planner_moe.mlp_gemms(LITE, 4096, 4, 8)[2:] == [(1, 4096, 2 * 2816 / 4, 2048),
                                                       (1, 4096, 2048, 2816 / 4)]


def test_no_mlp_tp_collectives_and_a_tp_times_smaller_exchange(monkeypatch):
    T = 4096
    split = planner.Layout(2, 2, 16, 1, 8, "none", True, True, ep=8)
    whole = dataclasses.replace(split, etp=1)
    # SP's all-gathers and reduce-scatters of [T, H]: the attention's alone, forward and
    # backward, without a shared expert; a shared expert keeps the MLP's (split over TP).
    assert planner_moe.sp_collectives(MIXTRAL, split) == (4, 6)
    assert planner_moe.sp_collectives(MIXTRAL, whole) == (2, 3)
    assert planner_moe.sp_collectives(LITE, whole) == (4, 6)
    # No [T, k] all-reduce of the probabilities' gradient: a whole-experts rank routes like a
    # TP-1 rank with its own T / 2 tokens.
    assert planner_moe.backward_all_reduces(MIXTRAL, T, True) == []
    assert planner_moe.backward_all_reduces(MIXTRAL, T) == [4 * T * K]
    alone = planner.Layout(1, 2, 32, 1, 8, "none", False, True, ep=8)
    assert planner_moe.routing_s(MIXTRAL, H100, whole, T) == \
        planner_moe.routing_s(MIXTRAL, H100, alone, T / 2)
    # Each rank exchanges its own T / 2 x k rows - half the split ranks' - and its EP group is 8
    # consecutive ranks, one node, where the split one spans 16 (two nodes).
    sent = []
    real = planner_moe.all_to_all_s
    monkeypatch.setattr(planner_moe, "all_to_all_s",
                        lambda c, lay, n: sent.append(n) or real(c, lay, n))
    planner_moe.exchange_s(MIXTRAL, H100, split, T)
    planner_moe.exchange_s(MIXTRAL, H100, whole, T)
    assert sent == [2 * H * K * T, 2 * H * K * T / 2]
    monkeypatch.undo()
    rows = 2 * H * K * T / 2
    assert planner_moe.all_to_all_s(H100, whole, rows) == pytest.approx(
        7 / 8 * rows / (450e9 * 0.8) + 7 * 5e-6)
    assert sum(planner_moe.exchange_s(MIXTRAL, H100, whole, T)) < \
        sum(planner_moe.exchange_s(MIXTRAL, H100, split, T)) / 4
    r, s = (planner.predict(MIXTRAL, H100, lay, 256) for lay in (whole, split))
    assert r["expert_tensor_parallel_size"] == 1 and s["expert_tensor_parallel_size"] == 2
    assert r["expert_exchange_s"] < s["expert_exchange_s"] / 4
    assert r["step_time_s"] < s["step_time_s"]


def test_ep_up_to_tp_dp_cp_with_whole_experts_only():
    # DeepSeek-V2-Lite on 16 H100s at TP 4, no pipeline: 4 DP ranks. EP 16 = tp x dp splits the
    # 64 experts over the whole stage with whole experts; split ones allow ep up to dp x cp.
    small = dataclasses.replace(H100, num_gpus=16)
    lay = planner.Layout(4, 1, 4, 1, 1, "selective", True, True, ep=16, etp=1)
    assert planner.check_layout(LITE, small, lay, 64) == 16
    with pytest.raises(ValueError, match="--expert-model-parallel-size 16 does not divide the 4 "
                                         "data-parallel x context-parallel ranks"):
        planner.check_layout(LITE, small, dataclasses.replace(lay, etp=0), 64)
    with pytest.raises(ValueError, match="--expert-tensor-parallel-size 1 with --tensor-model-"
                                         "parallel-size 4 needs --sequence-parallel"):
        planner.check_layout(LITE, small, dataclasses.replace(lay, sequence_parallel=False), 64)
    with pytest.raises(ValueError, match="--expert-model-parallel-size 32 does not divide the 16 "
                                         "tensor x data x context-parallel ranks"):
        planner.check_layout(LITE, small, dataclasses.replace(lay, ep=32), 64)
    with pytest.raises(ValueError, match="--expert-tensor-parallel-size 2: braid splits"):
        planner.check_layout(LITE, small, dataclasses.replace(lay, etp=2), 64)
    # The search: ep 16 proposed with whole experts alone, every ep dividing tp x dp.
    fixed = {"tp": 4, "pp": 1, "micro_batch_size": 1}
    rows, _ = planner.search(LITE, small, 64, dict(fixed, ep=16))
    assert rows and all(_whole(r) for r in rows)
    rows, _ = planner.search(LITE, small, 64, fixed)
    assert {r["ep"] for r in rows if _whole(r)} == {2, 4, 8, 16}
    assert {r["ep"] for r in rows if not _whole(r)} == {1, 2, 4}
    # (at ep 1 every rank would hold the 26 layers' 64 experts whole: 14.4B parameters, whose
    # bf16 weights and f32 gradients alone are 86 GB)
    one = dataclasses.replace(lay, ep=1, recompute="full")
    assert LITE.experts_params(0, 27, 4, 1, True) == 26 * 64 * 3 * 2048 * 1408
    assert planner.memory(LITE, small, one, 16)[0] > 86
    assert all(r["sequence_parallel"] for r in rows if _whole(r))
    assert planner.search(LITE, small, 64, dict(fixed, ep=16, etp=4))[0] == []
    rows, _ = planner.search(LITE, small, 64, dict(fixed, sequence_parallel=False))
    assert rows and not any(_whole(r) for r in rows)
    # A dense model is planned as before: no whole experts to search.
    dense = planner.PRESETS["llama2-7b"]
    rows, _ = planner.search(dense, small, 64, fixed)
    assert rows and {r["expert_tensor_parallel_size"] for r in rows} == {4}


def test_plan_cli_takes_and_refuses_expert_tp():
    out = _plan(*CLUSTER, "--model", "mixtral-8x7b", "--global-batch", "256", "--tp", "4",
                "--expert-tensor-parallel-size", "3")
    assert out.returncode == 2
    assert "--expert-tensor-parallel-size 3: braid splits experts over the TP group (--tp 4) " \
        "or keeps them whole (1)" in out.stderr
    out = _plan(*CLUSTER, "--model", "mixtral-8x7b", "--global-batch", "256", "--tp", "4",
                "--expert-tensor-parallel-size", "1", "--sequence-parallel", "false")
    assert out.returncode == 2 and "needs --sequence-parallel" in out.stderr
    # EP 8 over TP 4 x DP 4: refused with the experts split, planned with them whole.
    layout = ["--model", "mixtral-8x7b", "--global-batch", "256", "--tp", "4", "--pp", "4",
              "--micro-batch-size", "1", "--expert-model-parallel-size", "8"]
    out = _plan(*CLUSTER, *layout)
    assert out.returncode == 2 and "--expert-tensor-parallel-size 1, whole experts" in out.stderr
    out = _plan(*CLUSTER, *layout, "--expert-tensor-parallel-size", "1", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert rows and all(r["ep"] == 8 and _whole(r) for r in rows)
    out = _plan(*CLUSTER, *layout, "--expert-tensor-parallel-size", "1", "--top", "1")
    head, row = out.stdout.splitlines()[1:3]
    assert head.split()[:6] == ["tp", "cp", "pp", "dp", "ep", "mbs"]
    assert row.split()[:6] == ["4", "1", "4", "4", "8:etp1", "1"]
    # A size above 1 is the TP size: it fixes --tp.
    out = _plan(*CLUSTER, "--model", "mixtral-8x7b", "--global-batch", "256",
                "--expert-tensor-parallel-size", "2", "--pp", "2", "--json")
    assert out.returncode == 0, out.stderr
    assert {(r["tp"], r["expert_tensor_parallel_size"]) for r in json.loads(out.stdout)} == \
        {(2, 2)}


# test_expert_parallel.py's pretrain_gpt.py run of Mixtral 8x7B (TP 4, PP 2, v 4), over EP 8
TRAINING = [*SPLIT_TRAINING, "--expert-model-parallel-size", "8"]


def test_plan_cli_plans_a_runs_own_expert_tp():
    lay = planner.Layout(4, 2, 8, 4, 4, "selective", True, True, ep=8, etp=1)
    for args, etp in ((["--expert-tensor-parallel-size", "1"], 1), ([], 4)):
        out = _plan(*CLUSTER, "--json", "--", *TRAINING, *args)
        assert out.returncode == 0, out.stderr
        rows = json.loads(out.stdout)
        assert len(rows) == 1 and rows[0]["expert_tensor_parallel_size"] == etp
        want = planner.predict(MIXTRAL, H100, dataclasses.replace(lay, etp=etp), 256)
        assert rows[0]["step_time_s"] == pytest.approx(want["step_time_s"], rel=1e-12)
    out = _plan(*CLUSTER, "--expert-tensor-parallel-size", "1", "--", *TRAINING)
    assert out.returncode == 2 and "with training arguments after --" in out.stderr


def test_deepseek_v3_on_2048_h100s_is_fastest_with_whole_experts():
    # docs/planner.md's run (4096 sequences of 4096 tokens) at PP 16, micro batch 1, v 1: the
    # best split-experts layout is the one the docs give without whole experts (TP 1, EP 8,
    # full recomputation); whole experts at TP 2 and EP 16 - each of two nodes' 16 ranks holding
    # 16 whole experts of a layer - leave room for selective recomputation and double the
    # microbatches a replica, and are faster.
    cluster = planner.Cluster(planner.GPUS["h100-80g"], 8, 2048, 450e9, 400e9 / 8)
    rows, _ = planner.search(V3, cluster, 4096, {"pp": 16, "micro_batch_size": 1,
                                                 "virtual_stages": 1})
    best = rows[0]
    split = next(r for r in rows if not _whole(r))
    assert _whole(best) and (best["tp"], best["ep"], best["recompute"]) == (2, 16, "selective")
    assert (split["tp"], split["ep"], split["recompute"]) == (1, 8, "full")
    assert best["step_time_s"] < split["step_time_s"]
    assert best["bubble_fraction"] < split["bubble_fraction"]
