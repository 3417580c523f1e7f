"""Multi-token prediction in the planner (braid.planner_mtp; braid.planner, planner_inputs,
planner_moe) and tools/plan.py --mtp-num-layers: the depths on the last stage - their time,
parameters, embedding copy and activations - and every plan without them as before."""

import dataclasses
import os
import sys

import pytest

import braid
from braid import flops, planner, planner_moe, planner_mtp
from braid.megatron_flags import UNSUPPORTED

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_mla import CLUSTER, V3, _braid_config, plan  # noqa: E402

GB = planner.GB
# A 16-layer Llama-style model (hidden 2048, 16 heads, 8 KV heads, SwiGLU 5632, vocabulary
# 32000, 2048-token sequences) on 8 H100s, and with one MTP depth.
BASE = planner.ModelShape(16, 2048, 16, 8, 5632, 32000, 2048)
MTP = dataclasses.replace(BASE, mtp_num_layers=1)
H100 = planner.Cluster(planner.GPUS["h100-80g"], 8, 8, 450e9, 50e9)


def _layout(tp=2, pp=4, sp=True, **changes):
    return planner.Layout(tp, pp, 8 // (tp * pp), 1, 1, "none", sp, False, **changes)


# Predictions of the code before multi-token prediction (tools/plan.py --json searches of these
# presets), to the bit: a plan without it must not move.
BEFORE = [
    ("gpt2-1.5b", 16, 64, dict(tp=1, pp=2, dp=8, micro_batch_size=4, virtual_stages=8,
                               zero=True), dict(step_time_s=0.1635564654876336,
                                                mfu=0.2601454848446106,
                                                memory_gb_per_gpu=20.830121152,
                                                optimizer_s=0.00868932372663347)),
    ("deepseek-v2-lite", 16, 64, dict(tp=1, pp=2, dp=8, micro_batch_size=1, zero=True, ep=8,
                                      first_stage_layers=14, last_stage_layers=13),
     dict(step_time_s=1.227805684205387, mfu=0.24428580649493048,
          memory_gb_per_gpu=43.373726208, expert_exchange_s=0.1604165744504146)),
    ("llama3-8b", 32, 128, dict(tp=1, pp=2, dp=8, cp=2, micro_batch_size=2, virtual_stages=2,
                                recompute="full", recompute_method="block", zero=True),
     dict(step_time_s=4.005713593393543, hfu=0.4978871859937026,
          memory_gb_per_gpu=72.55075430400001, optimizer_s=0.043514231723845095)),
]


@pytest.mark.parametrize("preset, gpus, batch, layout, want", BEFORE, ids=[b[0] for b in BEFORE])
def test_plans_without_mtp_are_unchanged(preset, gpus, batch, layout, want):
    cluster = dataclasses.replace(H100, num_gpus=gpus, net_bw=400e9 / 8)
    r = planner.predict(planner.PRESETS[preset], cluster, planner.Layout(**layout), batch)
    assert {k: r[k] for k in want} == want


def test_a_depth_is_a_layer_of_the_last_kind_eh_proj_and_three_norms():
    h = BASE.hidden_size
    assert planner_mtp.depth_params(BASE) == BASE.layer_params(layer=15) + 2 * h * h + 3 * h
    assert MTP.num_params() - BASE.num_params() == planner_mtp.depth_params(BASE)
    # DeepSeek-V3's depth is an expert layer (its last layer's kind): 11.6B parameters, 14B with
    # the embedding and the head it shares (DeepSeek's count of its MTP module).
    v3 = dataclasses.replace(V3, mtp_num_layers=1)
    assert v3.num_params() - V3.num_params() == 11_610_067_968
    assert planner_mtp.depth_params(V3) == V3.layer_params(layer=60) + 2 * 7168 ** 2 + 3 * 7168
    with pytest.raises(ValueError, match="mtp_num_layers -1"):
        dataclasses.replace(BASE, mtp_num_layers=-1)


@pytest.mark.skipif(not hasattr(braid.TransformerConfig(), "mtp_num_layers"),
                    reason="needs a braid._C built with TransformerConfig.mtp_num_layers")
def test_deepseek_v3_with_a_depth_is_braids_count():
    cfg = _braid_config(V3)
    cfg.mtp_num_layers = 1
    v3 = dataclasses.replace(V3, mtp_num_layers=1)
    assert v3.num_params() + v3.hidden_size == cfg.num_parameters()  # braid's has the final norm


def test_the_last_stage_holds_the_depths_and_under_pp_an_embedding_copy():
    emb = BASE.vocab_size * BASE.hidden_size
    # PP 1: one embedding, which the depths look up too.
    one = _layout(tp=2, pp=1)
    assert planner.stage_params(MTP, one)[0] - planner.stage_params(BASE, one)[0] == \
        planner_mtp.depth_params(BASE, 2)
    # PP 4, untied: the last stage holds its own copy of the embedding, the others nothing new.
    four = _layout()
    before, after = planner.stage_params(BASE, four), planner.stage_params(MTP, four)
    assert after[:3] == before[:3]
    assert after[3] - before[3] == planner_mtp.depth_params(BASE, 2) + emb / 2
    # Tied: the last stage has the copy already (the output weight).
    tied = dataclasses.replace(BASE, tied_embeddings=True)
    assert planner.stage_params(dataclasses.replace(tied, mtp_num_layers=2), four)[3] - \
        planner.stage_params(tied, four)[3] == 2 * planner_mtp.depth_params(BASE, 2)


def test_the_depths_experts_are_the_last_layers_kind_and_split_by_ep():
    moe = dataclasses.replace(BASE, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=1408,
                              moe_layers=(0,) * 15 + (1,))
    lay = _layout(tp=2, pp=2, sp=True, ep=2)
    ranges = planner.stage_ranges(moe, lay)
    with_mtp = dataclasses.replace(moe, mtp_num_layers=1)
    extra = planner_moe.chunk_experts(with_mtp, lay, ranges)[-1][-1] - \
        planner_moe.chunk_experts(moe, lay, ranges)[-1][-1]
    assert extra == 8 * 3 * 2048 * 1408 / 2 / 2  # 8 experts over TP 2, EP 2
    dense_last = dataclasses.replace(with_mtp, moe_layers=(1,) + (0,) * 15)
    assert planner_mtp.experts(dense_last, lay) == 0


def test_a_depth_costs_its_layer_eh_proj_and_head_on_the_last_chunk():
    lay = _layout()
    layer, head = planner.layer_cost(MTP, H100, lay, 15), planner.head_cost(MTP, H100, lay)
    c = planner_mtp.cost(MTP, H100, lay, layer, head)
    two = planner_mtp.cost(dataclasses.replace(MTP, mtp_num_layers=2), H100, lay, layer, head)
    assert two.forward == pytest.approx(2 * c.forward) and two.backward == pytest.approx(
        2 * c.backward)
    # Under SP: eh_proj on the rank's 1024 tokens; the lookup's [2048, H] written and read,
    # three norms and two copies of 4H bytes a token of the 1024; the lookup's reduce-scatter
    # of [2048, H] bf16 forward, its all-gather backward.
    gpu, link = H100.gpu, planner._link(H100, 2)
    eh_proj = planner._gemm_time(gpu, 1024, 2048, 4096)
    nbytes = 4 * 2048 * 2048 + 5 * 4 * 2048 * 1024
    assert c.forward == pytest.approx(
        layer.forward + head[0] + eh_proj + planner._bytes_time(gpu, nbytes, 6) +
        planner._ring(2 * 2048 * 2048, 2, *link, "reduce_scatter"), rel=1e-12)
    assert c.backward == pytest.approx(
        layer.backward + head[1] + 2 * eh_proj +
        planner._bytes_time(gpu, 2 * nbytes + 6 * 2048 * 1024, 7) +
        planner._ring(2 * 2048 * 2048, 2, *link, "all_gather"), rel=1e-12)
    # eh_proj's f32 gradient [2048, 4096] summed over TP once a step, under SP only
    assert c.grad_sync == planner._ring(4 * 2 * 2048 ** 2, 2, *planner._link(H100, 2),
                                        "all_reduce")
    assert planner_mtp.cost(MTP, H100, _layout(sp=False), layer, head).grad_sync == 0
    assert planner_mtp.cost(BASE, H100, lay, layer, head) == planner_mtp.DepthsCost()


def test_mtp_lengthens_the_last_stage_and_a_lighter_last_stage_pays_it_back():
    even, light = _layout(), _layout(first_stage_layers=5, last_stage_layers=3)  # 5|4|4|3
    step = {(m.mtp_num_layers, lay.last_stage_layers): planner.predict(m, H100, lay, 16)
            for m in (BASE, MTP) for lay in (even, light)}
    c = planner_mtp.cost(MTP, H100, even, planner.layer_cost(MTP, H100, even, 15),
                         planner.head_cost(MTP, H100, even))
    # Evenly split, the last stage is the slowest: each of the 16 microbatches waits on its depth.
    assert step[1, None]["step_time_s"] - step[0, None]["step_time_s"] >= \
        16 * (c.forward + c.backward)
    # A lighter last stage hides part of it, and gains more than without MTP.
    assert step[1, 3]["step_time_s"] < step[1, None]["step_time_s"]
    assert step[1, None]["step_time_s"] - step[1, 3]["step_time_s"] > \
        step[0, None]["step_time_s"] - step[0, 3]["step_time_s"]
    # The MFU counts the depth's FLOPs: a layer, eh_proj and the logits a token, 3x forward.
    r = step[1, 3]
    counted = r["model_tflops_per_gpu"] * 1e12 * r["step_time_s"] * 8
    assert counted == pytest.approx(flops.flops_per_iteration(MTP, 2048, 16), rel=1e-12)
    layer = flops.forward_flops_per_token(dataclasses.replace(BASE, num_layers=1, vocab_size=0),
                                          2048)
    assert counted - flops.flops_per_iteration(BASE, 2048, 16) == pytest.approx(
        3 * 16 * 2048 * (layer + 2 * 2 * 2048 ** 2 + 2 * 2048 * 32000), rel=1e-12)


def test_memory_of_one_stage_gains_the_depths_state_and_activations():
    lay = _layout(tp=2, pp=1)  # one stage: no embedding copy; no ZeRO
    (_, base), (_, mtp) = planner.memory(BASE, H100, lay, 4), planner.memory(MTP, H100, lay, 4)
    held = planner_mtp.depth_params(BASE, 2)
    for part, each in (("params", 2), ("grads", 4), ("optimizer", 12)):
        assert mtp[part] - base[part] == pytest.approx(each * held / GB, rel=1e-9)
    # Kept: the layer's, per token of the rank's 1024 embedding, eh_proj's input [2H], the
    # layer's and the depth's outputs (10H bytes) and 3 norms' f32 statistics; the depth's
    # bf16 logits [2048, 16000] and the f32 max and sum of each token; h_0 (2H + 4 a token).
    layer = planner.layer_activation_bytes(BASE, lay, None, 15)
    want = layer + 1024 * (10 * 2048 + 12) + 2048 * (2 * 16000 + 8) + 1024 * (2 * 2048 + 4)
    assert mtp["activations"] - base["activations"] == pytest.approx(want / GB, rel=1e-9)
    # Full recomputation: the layer keeps its input, and holds its forward again in backward.
    full = dataclasses.replace(lay, recompute="full")
    kept, transient = planner_mtp.kept(MTP, full, (0.0, 0.0))
    assert kept == planner.layer_activation_bytes(BASE, full, "full", 15) + want - layer
    assert transient == planner.layer_activation_bytes(BASE, full, "none", 15)


def test_pp_gives_the_embedding_copy_its_gradient_sum_pp1_none():
    # Without ZeRO the optimizer updates the fullest rank's parameters: under PP 2 (untied) the
    # last, with the depth and the copy, which also sums its embedding gradient with the first
    # stage's (the network: a rank's PP peer is the next node).
    cluster = dataclasses.replace(H100, num_gpus=16)
    lay = planner.Layout(8, 2, 1, 1, 1, "none", True, False)
    t = planner.predict(BASE, cluster, lay, 8), planner.predict(MTP, cluster, lay, 8)
    held = [max(planner.stage_params(m, lay)) for m in (BASE, MTP)]
    opt = [planner._bytes_time(H100.gpu, planner.OPTIMIZER_BYTES_PER_PARAM * n, 4)
           for n in held]
    sync = planner._ring(4 * 32000 * 2048 / 8, 2, *planner._link(cluster, 16), "all_reduce")
    assert t[0]["optimizer_s"] == opt[0]
    assert t[1]["optimizer_s"] == pytest.approx(opt[1] + sync, rel=1e-12)
    one = planner.Layout(8, 1, 1, 1, 1, "none", True, False)
    held = max(planner.stage_params(MTP, one))
    assert planner.predict(MTP, H100, one, 8)["optimizer_s"] == \
        planner._bytes_time(H100.gpu, planner.OPTIMIZER_BYTES_PER_PARAM * held, 4)


def test_full_recomputation_reruns_the_depths_layer_in_hfu():
    lay = dataclasses.replace(_layout(), recompute="full", recompute_method="block",
                              recompute_num_layers=1)
    r = [planner.predict(m, H100, lay, 16) for m in (BASE, MTP)]
    peak = H100.gpu.peak_tflops * 1e12 * 8
    rerun = [(x["hfu"] - x["mfu"]) * x["step_time_s"] * peak for x in r]
    layer = planner.layer_cost(MTP, H100, lay, 15).model_flops
    assert rerun[1] - rerun[0] == pytest.approx(layer * 2 * 16, rel=1e-9)  # t x microbatches


def test_plan_cli_takes_mtp_num_layers(capsys):
    a = plan.parse_args([*CLUSTER, "--model", "deepseek-v3", "--global-batch", "64",
                         "--mtp-num-layers", "1"])
    assert a.model_shape == dataclasses.replace(V3, mtp_num_layers=1)
    flags = ["--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "16",
             "--num-query-groups", "8", "--ffn-hidden-size", "5632", "--vocab-size", "32000",
             "--seq-length", "2048"]
    a = plan.parse_args([*CLUSTER, *flags, "--global-batch", "16", "--mtp-num-layers", "1"])
    assert a.model_shape == MTP
    for bad in ([*flags, "--global-batch", "16", "--mtp-num-layers", "0"],
                # the model after -- is the run's own
                ["--mtp-num-layers", "1", "--", *flags, "--global-batch-size", "16"]):
        with pytest.raises(SystemExit):
            plan.parse_args([*CLUSTER, *bad])
        assert "--mtp-num-layers" in capsys.readouterr().err
    assert plan.main([*CLUSTER, *flags, "--global-batch", "16", "--mtp-num-layers", "1",
                      "--tp", "2", "--pp", "4", "--micro-batch-size", "1", "--virtual-stages",
                      "1", "--recompute", "none", "--zero", "false", "--top", "1"]) == 0
    assert capsys.readouterr().out.startswith(f"{MTP.num_params() / 1e9:.1f}B parameters")


@pytest.mark.skipif("--mtp-num-layers" in UNSUPPORTED,
                    reason="pretrain_gpt.py's arguments do not take --mtp-num-layers yet")
def test_plan_cli_reads_mtp_num_layers_from_the_training_arguments():
    training = ["--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "16",
                "--group-query-attention", "--num-query-groups", "8", "--ffn-hidden-size",
                "5632", "--vocab-size", "31999", "--seq-length", "2048", "--swiglu",
                "--untie-embeddings-and-output-weights", "--normalization", "RMSNorm",
                "--position-embedding-type", "rope", "--disable-bias-linear",
                "--tokenizer-type", "NullTokenizer", "--data-path", "data/x",
                "--micro-batch-size", "1", "--global-batch-size", "16", "--train-iters", "10",
                "--bf16", "--mtp-num-layers", "1"]
    a = plan.parse_args([*CLUSTER, "--", *training])
    assert a.model_shape == dataclasses.replace(MTP, kv_channels=128)  # pretrain_gpt's default
