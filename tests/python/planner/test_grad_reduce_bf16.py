"""--grad-reduce-in-bf16 in the planner (Layout.grad_reduce_in_bf16: braid.planner's data-parallel
reduction and memory, planner_moe.grad_sync_s and grad_reduce_buffer) and tools/plan.py (the flag,
and a pretrain_gpt.py run's own flag after --)."""

import dataclasses
import json
import os
import sys

import pytest

from braid import planner, planner_moe

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(REPO, "tools"))
import plan  # noqa: E402

LLAMA2_7B = planner.PRESETS["llama2-7b"]
NET_BW = 25e9 / 8  # 25 Gb/s per GPU: a slow network, the DP reduction dominates the step
SLOW = planner.Cluster(planner.GPUS["h100-80g"], 8, 64, 450e9, NET_BW)
# Pure data parallelism over 8 nodes, the reduction after the backward (not overlapped)
DP64 = planner.Layout(1, 1, 64, 1, recompute="full", zero=True, overlap_grad_reduce=False)
BATCH = 128
CLUSTER = ["--gpu", "h100-80g", "--num-gpus", "64", "--nvlink-bw", "450GB/s", "--net-bw",
           "25Gb/s"]
DP64_FLAGS = ["--model", "llama2-7b", "--global-batch", str(BATCH), "--tp", "1", "--pp", "1",
              "--micro-batch-size", "1", "--recompute", "full", "--recompute-method", "uniform",
              "--recompute-num-layers", "1", "--zero", "true", "--no-overlap-grad-reduce"]
# The same run as pretrain_gpt.py's arguments (NullTokenizer's vocabulary is one larger)
DP64_TRAINING = [
    "--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
    "--ffn-hidden-size", "11008", "--swiglu", "--untie-embeddings-and-output-weights",
    "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
    "--seq-length", "4096", "--max-position-embeddings", "4096", "--tokenizer-type",
    "NullTokenizer", "--vocab-size", "31999", "--data-path", "data/x", "--micro-batch-size", "1",
    "--global-batch-size", str(BATCH), "--train-iters", "10", "--use-distributed-optimizer",
    "--recompute-granularity", "full", "--recompute-method", "uniform",
    "--recompute-num-layers", "1", "--bf16"]


def bf16(lay, on=True):
    return dataclasses.replace(lay, grad_reduce_in_bf16=on)


def llama2_7b_params():
    """Llama 2 7B's parameters, counted by hand: per layer q, k, v, o (32 KV heads) and SwiGLU's
    three matrices and two RMSNorms; the untied embedding and LM head; the final norm."""
    h, ffn, layers, vocab = 4096, 11008, 32, 32000
    return layers * (4 * h * h + 3 * h * ffn + 2 * h) + 2 * vocab * h + h


def reduce_scatter_s(nbytes, n=64):
    """NCCL's ring reduce-scatter across nodes: (n - 1)/n of the buffer at 90% of the NIC, and
    (n - 1) steps of 12 us."""
    return (n - 1) / n * nbytes / (0.9 * NET_BW) + (n - 1) * 12e-6


def test_the_rank_holds_the_whole_model_at_tp_1_pp_1():
    assert planner.stage_params(LLAMA2_7B, DP64) == [llama2_7b_params()]


def test_the_exposed_reduction_moves_half_the_bytes():
    f32, half = (planner.predict(LLAMA2_7B, SLOW, lay, BATCH) for lay in (DP64, bf16(DP64)))
    elements = llama2_7b_params()
    assert f32["exposed_dp_s"] == pytest.approx(reduce_scatter_s(4 * elements), rel=1e-12)
    assert half["exposed_dp_s"] == pytest.approx(reduce_scatter_s(2 * elements), rel=1e-12)
    latency = 63 * 12e-6  # the same steps, half the bytes: the bandwidth term halves
    assert half["exposed_dp_s"] - latency == pytest.approx((f32["exposed_dp_s"] - latency) / 2,
                                                           rel=1e-12)
    assert f32["exposed_dp_s"] > 10 * f32["pipeline_s"]  # DP-bound: 9.4 s against 0.9 s
    # Nothing else moves: the backward, the optimizer and ZeRO's bf16 parameter all-gather
    for key in ("pipeline_s", "optimizer_s", "bubble_fraction", "microbatches"):
        assert half[key] == f32[key]
    assert f32["step_time_s"] - half["step_time_s"] == pytest.approx(
        f32["exposed_dp_s"] - half["exposed_dp_s"], rel=1e-9)
    assert half["mfu"] > f32["mfu"]
    assert half["grad_reduce_in_bf16"] is True and "grad_reduce_in_bf16" not in f32


def test_the_all_reduce_moves_half_the_bytes_too():
    no_zero = dataclasses.replace(DP64, zero=False)  # 121 GB: timed, not proposed
    elements, n, bw, alpha = llama2_7b_params(), 64, 0.9 * NET_BW, 12e-6
    for lay, nbytes in ((no_zero, 4), (bf16(no_zero), 2)):
        r = planner.predict(LLAMA2_7B, SLOW, lay, BATCH, baseline=False)
        ring = 2 * (n - 1) / n * nbytes * elements / bw + 2 * (n - 1) * alpha
        tree = 2 * nbytes * elements / bw + 2 * 6 * alpha
        assert r["exposed_dp_s"] == pytest.approx(min(ring, tree), rel=1e-12)


def test_the_overlapped_reduction_ends_earlier_by_half_its_wire_time():
    overlapped = dataclasses.replace(DP64, overlap_grad_reduce=True)
    f32, half = (planner.predict(LLAMA2_7B, SLOW, lay, BATCH)
                 for lay in (overlapped, bf16(overlapped)))
    # One model chunk: its buckets start at the same point of its last backward, and the
    # reduction outlasts that backward either way, so it ends (n-1)/n 2B / bw earlier
    saved = 63 / 64 * 2 * llama2_7b_params() / (0.9 * NET_BW)
    assert f32["exposed_dp_s"] - half["exposed_dp_s"] == pytest.approx(saved, rel=1e-9)
    assert half["exposed_dp_s"] > 0 and half["pipeline_s"] == f32["pipeline_s"]


def test_memory_keeps_a_bf16_staging_copy_of_every_gradient():
    f32, half = (planner.memory(LLAMA2_7B, SLOW, lay, 2) for lay in (DP64, bf16(DP64)))
    staging = 2 * llama2_7b_params() / planner.GB  # 13.5 GB, counted in "grads"
    assert half[0] - f32[0] == pytest.approx(staging, rel=1e-12)
    assert half[1]["grads"] - f32[1]["grads"] == pytest.approx(staging, rel=1e-12)
    assert {k: x for k, x in half[1].items() if k != "grads"} == \
        {k: x for k, x in f32[1].items() if k != "grads"}
    assert set(half[1]) == set(f32[1])  # no new part: the JSON's keys stay


def test_dp_1_changes_nothing():
    one_node = planner.Cluster(planner.GPUS["h100-80g"], 8, 8, 450e9, NET_BW)
    lay = planner.Layout(8, 1, 1, 1, recompute="selective", sequence_parallel=True, zero=True)
    f32, half = (planner.predict(LLAMA2_7B, one_node, x, 8) for x in (lay, bf16(lay)))
    assert half.pop("grad_reduce_in_bf16") is True
    assert half == f32  # no group to reduce over: no staging buffer, the same time
    assert planner_moe.grad_reduce_buffer(bf16(lay), 1e9, 0) == 0


def test_an_expert_group_of_one_rank_stages_nothing():
    mixtral = planner.PRESETS["mixtral-8x7b"]
    eight = planner.Cluster(planner.GPUS["h100-80g"], 8, 8, 450e9, NET_BW)
    for ep, experts_staged in ((8, False), (4, True)):  # expert-DP group: 8 / ep ranks
        lay = planner.Layout(1, 1, 8, 1, recompute="full", zero=True, ep=ep)
        params = planner.stage_params(mixtral, lay)[0]
        experts = planner_moe.chunk_experts(mixtral, lay, planner.stage_ranges(mixtral, lay))[0][0]
        staged = params if experts_staged else params - experts
        assert planner_moe.grad_reduce_buffer(bf16(lay), params, experts) == staged
        assert planner_moe.grad_reduce_buffer(lay, params, experts) == 0
        f32, half = (planner.memory(mixtral, eight, x, 8)[1] for x in (lay, bf16(lay)))
        assert half["grads"] - f32["grads"] == pytest.approx(2 * staged / planner.GB, rel=1e-12)


def test_plan_cli_fixes_it_on_and_never_tries_it_by_itself(capsys):
    rows = {}
    for on in (False, True):
        assert plan.main([*CLUSTER, *DP64_FLAGS, "--json",
                          *(["--grad-reduce-in-bf16"] if on else [])]) == 0
        rows[on] = json.loads(capsys.readouterr().out)
        assert len(rows[on]) == 1 and rows[on][0].get("grad_reduce_in_bf16", False) is on
        want = planner.predict(LLAMA2_7B, SLOW, bf16(DP64, on), BATCH)
        assert rows[on][0]["step_time_s"] == want["step_time_s"]
        assert rows[on][0]["memory_gb_per_gpu"] == want["memory_gb_per_gpu"]
    assert rows[True][0]["step_time_s"] < rows[False][0]["step_time_s"]
    assert plan.main([*CLUSTER, *DP64_FLAGS[:4], "--pp", "1", "--json"]) == 0  # a search
    assert not any("grad_reduce_in_bf16" in r for r in json.loads(capsys.readouterr().out))
    assert plan.main([*CLUSTER, *DP64_FLAGS, "--grad-reduce-in-bf16"]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith("; gradients reduced in bf16")


def test_plan_cli_reads_it_from_the_training_arguments(capsys):
    rows = {}
    for on in (False, True):
        run = [*DP64_TRAINING, *(["--grad-reduce-in-bf16"] if on else [])]
        assert plan.main([*CLUSTER, "--json", "--", *run]) == 0
        rows[on] = json.loads(capsys.readouterr().out)
        assert len(rows[on]) == 1 and rows[on][0].get("grad_reduce_in_bf16", False) is on
        lay = dataclasses.replace(DP64, overlap_param_gather=False)  # the run's: no overlap
        want = planner.predict(LLAMA2_7B, SLOW, bf16(lay, on), BATCH)
        assert rows[on][0]["step_time_s"] == want["step_time_s"]
        assert rows[on][0]["memory_parts_gb"] == want["memory_parts_gb"]
    # A numerics choice, not a layout: --search keeps the run's
    assert plan.main([*CLUSTER, "--json", "--search", "--", *DP64_TRAINING,
                      "--grad-reduce-in-bf16"]) == 0
    searched = json.loads(capsys.readouterr().out)
    assert len(searched) > 1 and all(r["grad_reduce_in_bf16"] for r in searched)
    with pytest.raises(SystemExit):  # the run's own flags after --
        plan.parse_args([*CLUSTER, "--grad-reduce-in-bf16", "--", *DP64_TRAINING])
    assert "with training arguments after --" in capsys.readouterr().err
