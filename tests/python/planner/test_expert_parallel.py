"""Expert parallelism in the planner (braid.planner, braid.planner_moe) and tools/plan.py: E / ep
experts a rank, the all-to-all of the routed rows, the experts' gradients over dp x cp / ep."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from braid import planner, planner_moe
from braid.arguments import parse_args

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
PLAN = os.path.join(REPO, "tools", "plan.py")

MIXTRAL = planner.PRESETS["mixtral-8x7b"]  # 32 layers, h 4096, 8 experts of 14336, top 2
H100 = planner.Cluster(planner.GPUS["h100-80g"], 8, 64, 450e9, 50e9)
CLUSTER = ["--gpu", "h100-80g", "--num-gpus", "64", "--nvlink-bw", "450GB/s", "--net-bw",
           "50GB/s"]
H, F, E, K = 4096, 14336, 8, 2
EXPERTS = E * 3 * H * F  # one layer's routed experts (SwiGLU: gate, up, down)


def _plan(*args):
    return subprocess.run([sys.executable, PLAN, *args], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=os.path.join(REPO, "python")))


def test_a_rank_holds_its_share_of_the_experts_as_the_arithmetic_says():
    # TP 2, no pipeline, 32 DP ranks: every rank holds 32 layers of attention, norms and router
    # and the embedding and LM head, and of each layer's experts E / ep, split over TP.
    attention = H * (H + 2 * 1024) + H * H + 2 * H
    dense = 32 * (attention / 2 + E * H) + 2 * 32000 * H / 2 + H
    for zero in (True, False):
        mem = {}
        for ep in (1, 2, 4, 8):
            lay = planner.Layout(2, 1, 32, 1, 1, "selective", True, zero, ep=ep)
            held = dense + 32 * EXPERTS / 2 / ep
            _, parts = planner.memory(MIXTRAL, H100, lay, 8)
            assert parts["params"] == pytest.approx(2 * held / 1e9, rel=1e-12)
            assert parts["grads"] == pytest.approx(4 * held / 1e9, rel=1e-12)
            # ZeRO: the dense state over the 32 DP ranks, the experts' over the 32 / ep ranks
            # holding the same experts - the same 1/32 of them whatever ep; without, all held.
            want = dense / 32 + 32 * EXPERTS / 2 / ep / (32 // ep) if zero else held
            assert parts["optimizer"] == pytest.approx(12 * want / 1e9, rel=1e-12)
            mem[ep] = parts
        # Activations: EP keeps the dispatch's two i32 orders of the k rows of each token more.
        T = 4096
        for ep in (2, 4, 8):
            lay = planner.Layout(2, 1, 32, 1, 1, "selective", True, zero, ep=ep)
            assert planner.layer_activation_bytes(MIXTRAL, lay) - planner.layer_activation_bytes(
                MIXTRAL, dataclasses.replace(lay, ep=1)) == pytest.approx(8 * K * T)
        totals = [sum(mem[ep].values()) for ep in (1, 2, 4, 8)]
        assert totals == sorted(totals, reverse=True)
        # bf16 parameters and f32 gradients of 7/8 of the experts fewer at ep 8: 6 bytes each.
        saved = 6 * 32 * EXPERTS / 2 * 7 / 8 + (0 if zero else 12 * 32 * EXPERTS / 2 * 7 / 8)
        assert totals[0] - totals[-1] == pytest.approx(saved / 1e9 - 32 * 8 * K * T * 1 / 1e9,
                                                       rel=1e-9)
    # The parameter count of one rank's chunk as ModelShape gives it.
    assert MIXTRAL.layers_params(0, 32, 2, 8) == pytest.approx(
        MIXTRAL.layers_params(0, 32, 2) - 32 * EXPERTS / 2 * 7 / 8)
    assert MIXTRAL.experts_params(0, 32, 2, 8) == pytest.approx(32 * EXPERTS / 16)


def test_the_experts_gradients_are_reduced_over_their_own_group():
    # dp x cp = 32 ranks: dense gradients over 32, the experts' over 32 / ep (none at ep 32).
    lay = planner.Layout(2, 1, 32, 1, 1, "none", True, True)
    P, X = 3e9, 2e9
    bw, alpha = planner._link(H100, 64)
    ring = [planner._ring(4 * n, g, bw, alpha, "reduce_scatter") for n, g in
            ((P, 32), (P - X, 32), (X, 4), (X, 32))]
    assert planner_moe.data_sync_s(H100, lay, 4, P, X, "reduce_scatter") == ring[0]
    assert planner_moe.data_sync_s(H100, dataclasses.replace(lay, ep=8), 4, P, X,
                                   "reduce_scatter") == pytest.approx(ring[1] + ring[2])
    assert planner_moe.data_sync_s(H100, dataclasses.replace(lay, ep=32), 4, P, X,
                                   "reduce_scatter") == pytest.approx(ring[1])
    assert planner_moe.sharded(dataclasses.replace(lay, ep=8), P, X) == pytest.approx(
        (P - X) / 32 + X / 4)


def test_the_experts_gemms_see_the_rows_of_the_whole_ep_group():
    # ep 8: one expert a rank, on the rows of 8 ranks' tokens (T·k·ep / E) - 8x as wide as each
    # of 8 experts' at ep 1, the same FLOPs.
    assert planner_moe.mlp_gemms(MIXTRAL, 4096, 8, 8) == [(1, 8192, 3584, 4096),
                                                          (1, 8192, 4096, 1792)]
    assert planner_moe.mlp_gemms(MIXTRAL, 4096, 8, 2) == [(4, 2048, 3584, 4096),
                                                          (4, 2048, 4096, 1792)]


def test_the_all_to_all_is_nothing_at_ep_1_and_grows_when_the_group_crosses_nodes():
    T = 4096  # micro batch 1
    rows_bytes = 2 * H * K * T  # [N, H] bf16, every TP rank its own
    one = planner.Layout(1, 2, 32, 1, 8, "none", False, True)
    assert planner_moe.exchange_s(MIXTRAL, H100, one, T) == (0.0, 0.0)
    cost = planner.layer_cost(MIXTRAL, H100, one)
    assert (cost.exchange_forward, cost.exchange_backward) == (0.0, 0.0)
    assert planner.predict(MIXTRAL, H100, one, 256, baseline=False)["expert_exchange_s"] == 0.0

    # ep 8 at tp 1: 8 consecutive ranks, one node: NVLink, 7/8 of the rows sent, 7 steps.
    inside = dataclasses.replace(one, ep=8)
    a2a = 7 / 8 * rows_bytes / (450e9 * 0.8) + 7 * 5e-6
    assert planner_moe.all_to_all_s(H100, inside, rows_bytes) == pytest.approx(a2a)
    # At tp 2 the same group spans 16 ranks, two nodes: each rank's 4 peers off its node get
    # 4/8 of the rows over the network while its 3 on it get 3/8 over NVLink.
    across = planner.Layout(2, 2, 16, 1, 8, "none", True, True, ep=8)
    far = max(3 / 8 * rows_bytes / (450e9 * 0.8), 4 / 8 * rows_bytes / (50e9 * 0.9)) + 7 * 12e-6
    assert planner_moe.all_to_all_s(H100, across, rows_bytes) == pytest.approx(far)
    assert far > 4 * a2a
    # A layer: forward the counts' all-gather and the host's plan, then 2 all-to-alls each with
    # its permutation (a gather of the N rows); backward 2, under selective recomputation 3.
    permute = planner._bytes_time(H100.gpu, (4 * H + 4) * K * T, 1)
    counts = planner._ring(8 * E * 8, 8, 450e9 * 0.8, 5e-6, "all_gather")
    plan = counts + planner_moe.EP_PLAN_HOST_S + planner_moe.ROUTING_HOST_S_PER_CHOICE * K * T
    fwd, bwd = planner_moe.exchange_s(MIXTRAL, H100, inside, T)
    assert fwd == pytest.approx(plan + 2 * (a2a + permute))
    assert bwd == pytest.approx(2 * (a2a + permute))
    selective = dataclasses.replace(inside, recompute="selective")
    assert planner_moe.exchange_s(MIXTRAL, H100, selective, T)[1] == pytest.approx(1.5 * bwd)
    cost = planner.layer_cost(MIXTRAL, H100, inside)
    assert (cost.exchange_forward, cost.exchange_backward) == (fwd, bwd)
    assert cost.forward > fwd and cost.backward > bwd  # inside the layer's time: not overlapped
    # A step: each of a stage's 16 layers, for each of its 8 microbatches; full recomputation
    # redoes the forward's exchange.
    r = planner.predict(MIXTRAL, H100, inside, 256)
    assert r["ep"] == 8 and r["expert_exchange_s"] == pytest.approx(8 * 16 * (fwd + bwd))
    full = dataclasses.replace(inside, recompute="full")
    ffwd, fbwd = planner_moe.exchange_s(MIXTRAL, H100, full, T)
    assert planner.predict(MIXTRAL, H100, full, 256, baseline=False)["expert_exchange_s"] == \
        pytest.approx(8 * 16 * (2 * ffwd + fbwd))
    # Across nodes the layer's exchange is over 3x as long; the step (16 microbatches of 16
    # layers) has all of it.
    wide = sum(planner_moe.exchange_s(MIXTRAL, H100, across, T))
    assert wide > 3 * (fwd + bwd)
    assert planner.predict(MIXTRAL, H100, across, 256, baseline=False)["expert_exchange_s"] == \
        pytest.approx(16 * 16 * wide)
    # The scaling baseline keeps the layout's ep: a node holds 2 of its replicas, the baseline
    # the 8 of one EP group (32 GPUs; ZeRO shards the experts' state less there).
    assert planner.predict(MIXTRAL, H100, across, 256)["scaling_efficiency"] == \
        pytest.approx(1.0, abs=0.01)


def test_ep_is_searched_for_a_model_with_experts_only():
    dense = planner.PRESETS["llama2-7b"]
    small = dataclasses.replace(H100, num_gpus=16)
    rows, _ = planner.search(dense, small, 64, {"micro_batch_size": 1, "recompute": "none"})
    assert rows and {r["ep"] for r in rows} == {1}
    # tp 4, pp 4: 4 DP ranks (cp 1 and 2 fit too): the divisors of 8 that divide dp x cp - the
    # experts split over TP (etp 4; whole ones, etp 1, are test_whole_experts.py's).
    some = {"tp": 4, "pp": 4, "micro_batch_size": 1, "virtual_stages": 8, "zero": True, "etp": 4}
    rows, _ = planner.search(MIXTRAL, H100, 256, some)
    assert {r["ep"] for r in rows} == {1, 2, 4}
    assert all(E % r["ep"] == 0 and r["dp"] * r["cp"] % r["ep"] == 0 for r in rows)
    fixed, _ = planner.search(MIXTRAL, H100, 256, dict(some, ep=2))
    assert fixed and {r["ep"] for r in fixed} == {2}
    with pytest.raises(ValueError, match="--expert-model-parallel-size 3 does not divide "
                                         "--num-experts 8"):
        planner.check_layout(MIXTRAL, H100, planner.Layout(2, 2, 16, 1, ep=3), 256)
    with pytest.raises(ValueError, match="does not divide the 4 data-parallel x context-parallel"):
        planner.check_layout(MIXTRAL, H100, planner.Layout(8, 2, 4, 1, ep=8), 256)
    with pytest.raises(ValueError, match="needs --num-experts"):
        planner.check_layout(dense, small, planner.Layout(1, 1, 16, 1, ep=2), 64)


def test_an_ep_layout_is_proposed_where_the_experts_fit_only_with_it():
    # Pure data parallelism (tp 1, pp 1) on 64 H100s: every rank would hold all 46.7B
    # parameters (280 GB of bf16 weights and f32 gradients) - only ep 8 (5.6B of experts) fits.
    fixed = {"tp": 1, "pp": 1, "micro_batch_size": 1}
    rows, rejected = planner.search(MIXTRAL, H100, 256, dict(fixed, ep=1))
    assert rows == [] and "out of memory" in rejected
    why = planner.why_nothing_fits(MIXTRAL, H100, 256, dict(fixed, ep=1))
    assert "expert parallelism could split them over up to 8 ranks" in why
    rows, _ = planner.search(MIXTRAL, H100, 256, fixed)
    assert rows and {r["ep"] for r in rows} == {8}
    assert all(r["memory_gb_per_gpu"] <= 80 for r in rows)
    out = _plan(*CLUSTER, "--model", "mixtral-8x7b", "--global-batch", "256", "--tp", "1",
                "--pp", "1", "--micro-batch-size", "1", "--json")
    assert out.returncode == 0, out.stderr
    best = json.loads(out.stdout)[0]
    assert best["ep"] == 8 and best["step_time_s"] == pytest.approx(rows[0]["step_time_s"])
    out = _plan(*CLUSTER, "--model", "mixtral-8x7b", "--global-batch", "256", "--tp", "1",
                "--pp", "1", "--micro-batch-size", "1", "--expert-model-parallel-size", "1")
    assert out.returncode == 1 and "--expert-model-parallel-size" in out.stderr


TRAINING = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
            "--group-query-attention", "--num-query-groups", "8", "--ffn-hidden-size", "14336",
            "--num-experts", "8", "--moe-router-topk", "2", "--swiglu",
            "--untie-embeddings-and-output-weights", "--normalization", "RMSNorm",
            "--position-embedding-type", "rope", "--disable-bias-linear", "--seq-length", "4096",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "31999",
            "--data-path", "/not/here", "--micro-batch-size", "4", "--global-batch-size", "256",
            "--train-iters", "100", "--tensor-model-parallel-size", "4",
            "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
            "4", "--sequence-parallel", "--use-distributed-optimizer", "--overlap-grad-reduce",
            "--overlap-param-gather", "--recompute-granularity", "selective", "--bf16"]


def _refusal(*args, gpus=64):
    """pretrain_gpt.py's verdict (braid.arguments, braid.moe_args) on TRAINING with `args`."""
    with pytest.raises(ValueError) as e:
        parse_args([*TRAINING, *args, "--device", "cuda"], gpus, check_files=False)
    return str(e.value)


def test_plan_cli_takes_and_refuses_ep_as_pretrain_gpt_does():
    # The run's own --expert-model-parallel-size is planned (tp 4, pp 2: dp 8 on 64 GPUs).
    out = _plan(*CLUSTER, "--json", "--", *TRAINING, "--expert-model-parallel-size", "2")
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)[0]
    want = planner.predict(MIXTRAL, H100, planner.Layout(4, 2, 8, 4, 4, "selective", True, True,
                                                         ep=2), 256)
    assert row["ep"] == 2 and row["step_time_s"] == pytest.approx(want["step_time_s"], rel=1e-12)
    # Refused with braid.moe_args' words, here and after --.
    not_e = "--expert-model-parallel-size 3 does not divide --num-experts 8: each " \
        "expert-parallel rank holds an equal share of the experts"
    not_dp = "--expert-model-parallel-size 8 does not divide the 4 data-parallel x " \
        "context-parallel ranks: expert parallelism splits them into groups of 8"
    assert not_e in _refusal("--expert-model-parallel-size", "3")
    assert not_dp in _refusal("--expert-model-parallel-size", "8", gpus=32)
    for args, message in (
            (["--model", "mixtral-8x7b", "--expert-model-parallel-size", "3"], not_e),
            (["--model", "mixtral-8x7b", "--tp", "4", "--pp", "4",
              "--expert-model-parallel-size", "8"], not_dp),
            (["--model", "llama2-7b", "--expert-model-parallel-size", "2"],
             "--expert-model-parallel-size needs --num-experts")):
        out = _plan(*CLUSTER, "--global-batch", "256", *args)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)
    out = _plan(*CLUSTER, "--", *TRAINING, "--expert-model-parallel-size", "3")
    assert out.returncode == 2 and not_e in out.stderr
    out = _plan(*CLUSTER, "--expert-model-parallel-size", "2", "--", *TRAINING)
    assert out.returncode == 2 and "with training arguments after --" in out.stderr
    # The table has an ep column.
    out = _plan(*CLUSTER, "--model", "mixtral-8x7b", "--global-batch", "256", "--tp", "1",
                "--pp", "1", "--micro-batch-size", "1", "--top", "1")
    assert out.returncode == 0, out.stderr
    head, row = out.stdout.splitlines()[1:3]
    assert head.split()[:6] == ["tp", "cp", "pp", "dp", "ep", "mbs"]
    assert row.split()[:6] == ["1", "1", "1", "64", "8", "1"]
