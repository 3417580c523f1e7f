"""Mixture of experts in the model FLOPs (braid.flops), the planner (braid.planner,
braid.planner_moe) and tools/plan.py."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

import braid
from braid import flops, planner, planner_moe

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
PLAN = os.path.join(REPO, "tools", "plan.py")

MIXTRAL = planner.PRESETS["mixtral-8x7b"]
# The dense model with Mixtral's per-token FLOPs but for the router: one MLP of k x 14336.
DENSE = dataclasses.replace(MIXTRAL, num_experts=0, moe_ffn_hidden_size=0,
                            ffn_hidden_size=2 * 14336)
H100 = planner.Cluster(planner.GPUS["h100-80g"], 8, 64, 450e9, 50e9)


def _plan(*args):
    return subprocess.run([sys.executable, PLAN, *args], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=os.path.join(REPO, "python")))


def test_flops_count_the_routed_experts_and_the_router():
    # llama-tiny (2 layers, hidden 64, 4 heads of 16, 2 KV heads, vocab 256) with 4 experts of
    # 96, top 2, and gpt2-tiny (4 KV heads, GELU: two matrices) likewise. Per token and layer:
    # QKV 2·64·(64 + 2·kv), the output projection 2·64·64, attention 4·64·s, the k experts'
    # MLPs 2·m·64·96 each, the router 2·64·4; the LM head 2·64·256 once.
    s = 32
    for preset, kv, m in (("llama-tiny", 32, 3), ("gpt2-tiny", 64, 2)):
        cfg = braid.TransformerConfig.preset(preset)
        cfg.num_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size = 4, 2, 96
        layer = 2 * 64 * (64 + 2 * kv) + 2 * 64 * 64 + 4 * 64 * s + 2 * (2 * m * 64 * 96) \
            + 2 * 64 * 4
        want = 2 * layer + 2 * 64 * 256
        assert flops.forward_flops_per_token(cfg, s) == want, preset
        assert flops.flops_per_iteration(cfg, s, 3) == 3 * want * s * 3
        # moe_ffn_hidden_size 0: the experts are ffn_hidden_size wide
        cfg.moe_ffn_hidden_size = 0
        assert flops.forward_flops_per_token(cfg, s) == want + 2 * 2 * 2 * m * 64 * (
            cfg.ffn_hidden_size - 96)
    # The experts' term is Megatron's (training.py, num_floating_point_operations): per token
    # and MoE layer 3 · 2 · h · (F · k · m) for forward and backward.
    shape = dataclasses.replace(MIXTRAL, vocab_size=0)
    no_router = flops.forward_flops_per_token(shape, 4096) - 32 * 2 * 4096 * 8
    attention = 32 * (2 * 4096 * (4096 + 2 * 1024) + 2 * 4096 * 4096 + 4 * 4096 * 4096)
    assert 3 * (no_router - attention) == 32 * 3 * 2 * 4096 * (14336 * 2 * 3)
    # A ModelShape and a TransformerConfig of the same model count alike.
    cfg = braid.TransformerConfig.preset("llama-tiny")
    cfg.num_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size = 4, 2, 96
    tiny = planner.ModelShape(2, 64, 4, 2, 192, 256, s, num_experts=4, moe_ffn_hidden_size=96)
    assert flops.forward_flops_per_token(tiny, s) == flops.forward_flops_per_token(cfg, s)


def test_parameters_are_every_experts_and_braids_count():
    # Mixtral 8x7B: 46,702,792,704 parameters (Mistral's release), braid's TransformerConfig
    # counts the same, and the planner's preset but for the final norm.
    cfg = braid.TransformerConfig.preset("llama3-8b")
    cfg.vocab_size, cfg.ffn_hidden_size = 32000, 14336
    cfg.num_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size = 8, 2, 14336
    assert cfg.num_parameters() == 46_702_792_704
    assert MIXTRAL.num_params() + 4096 == cfg.num_parameters()
    # 12.9B active: each token's two experts, not eight.
    active = MIXTRAL.num_params() - 32 * 6 * 3 * 4096 * 14336
    assert active == pytest.approx(12.88e9, rel=1e-3)
    # A GELU model: each expert's fc1 and fc2 biases and the router's (megatron-core's), as
    # GPTModel builds them (+ the final norm's weight and bias and GPT-2's learned positions).
    gcfg = braid.TransformerConfig.preset("gpt2-tiny")
    gcfg.num_experts, gcfg.moe_router_topk, gcfg.moe_ffn_hidden_size = 4, 2, 96
    shape = planner.ModelShape(2, 64, 4, 4, 256, 256, 128, "gelu", True, num_experts=4,
                               moe_ffn_hidden_size=96)
    built = braid.GPTModel(gcfg, device="cpu", seed=1).num_parameters()
    assert shape.num_params() + 2 * 64 + 128 * 64 == built
    # Per TP rank: the experts split, the router whole.
    layer = MIXTRAL.layer_params()
    assert MIXTRAL.layer_params(8) == pytest.approx((layer - 8 * 4096) / 8 + 8 * 4096)


def test_an_moe_model_holds_more_than_its_dense_equivalent_and_computes_as_much():
    # Mixtral against DENSE (ffn 2 x 14336): the same FLOPs per token but the router's, and
    # the same activation function bytes; four times the MLP's parameters (8 experts of F
    # against one of 2F), and the dispatch's activations on top.
    router = 32 * 2 * 4096 * 8
    assert flops.forward_flops_per_token(MIXTRAL, 4096) - \
        flops.forward_flops_per_token(DENSE, 4096) == router
    lay = planner.Layout(4, 2, 8, 4, 4, "selective", True, True)
    moe, dense = (planner.predict(x, H100, lay, 256, baseline=False) for x in (MIXTRAL, DENSE))
    # params (bf16) of the fullest rank, by hand: 16 layers of attention (QKV, output) and
    # norms, the MLP (MoE: 8 x 3 x 4096 x 14336 / tp + the router whole; dense: 3 x 4096 x 28672
    # / tp), and the embedding (first stage) or the LM head and the final norm (last).
    attn = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 2 * 4096
    ends = (32000 * 4096 / 4, 32000 * 4096 / 4 + 4096)
    moe_p = [16 * ((attn + 8 * 3 * 4096 * 14336) / 4 + 8 * 4096) + end for end in ends]
    dense_p = [16 * (attn + 3 * 4096 * 28672) / 4 + end for end in ends]
    for r, by_hand in ((moe, moe_p), (dense, dense_p)):
        p = r["memory_parts_gb"]["params"]
        assert p in [pytest.approx(2 * x / 1e9, rel=1e-12) for x in by_hand]
        assert r["memory_parts_gb"]["grads"] == pytest.approx(2 * p)
    assert moe["memory_gb_per_gpu"] > 1.8 * dense["memory_gb_per_gpu"]
    # Activations per token of a layer, over the dense layer's: the k rows' expert_in and
    # expert_out [N, H] (none) or expert_out (selective), whole on every TP rank, the f32
    # logits [T, E] and the routing (20 bytes a choice); full keeps the input alone.
    T = 4 * 4096
    extra = {"none": 2 * (2 * 4096 + 2 * 4096) + 4 * 8 + 20 * 2,
             "selective": 2 * 2 * 4096 + 4 * 8 + 20 * 2, "full": 0}
    for rec, per_token in extra.items():
        assert planner.layer_activation_bytes(MIXTRAL, lay, rec) - \
            planner.layer_activation_bytes(DENSE, lay, rec) == pytest.approx(per_token * T)
    # Model FLOPs (MFU) count the active experts only: the same work per step but the router.
    moe_flops, dense_flops = (r["mfu"] * r["step_time_s"] for r in (moe, dense))
    assert moe_flops / dense_flops - 1 == pytest.approx(
        router / flops.forward_flops_per_token(DENSE, 4096), rel=1e-6)


def test_step_time_is_close_to_the_dense_equivalent_where_the_gemms_are_as_wide():
    # At TP 4 and micro batch 4 (T = 16384 tokens) each expert's GEMMs get T·k/E = 4096 rows,
    # no fewer than the dense GEMMs' smallest dimension (4096 = h, and 3584 = F/tp for fc2):
    # the planner's efficiency curve runs both at the same rate on the same FLOPs. A layer's
    # forward + backward may then differ only by what the experts add: the router (its input
    # read at HBM speed), the gather and combine of the k rows (about 7 [T, H] bf16 tensors
    # moved forward, twice that backward, and a gather again under selective), 2E GEMM launches
    # instead of 2, the host's routing and the [T, k] f32 all-reduce: 9% of this layer. 10%
    # bounds it; counting all 8 experts' FLOPs, or dropping the k, would be off by 40% or more.
    lay = planner.Layout(4, 2, 8, 4, 4, "selective", True, True)
    moe, dense = (planner.layer_cost(x, H100, lay) for x in (MIXTRAL, DENSE))
    ratio = (moe.forward + moe.backward) / (dense.forward + dense.backward)
    assert 1.0 < ratio < 1.10
    # The step adds what four times the MLP's parameters cost on the DP links and in the
    # optimizer (the ZeRO all-gather of 11.7 GB of bf16 parameters per rank is not all hidden
    # behind the first forward): within 20%.
    step = [planner.predict(x, H100, lay, 256, baseline=False)["step_time_s"]
            for x in (MIXTRAL, DENSE)]
    assert 1.0 < step[0] / step[1] < 1.20
    # Thin experts: at micro batch 1 and TP 8 each expert gets 1024 rows, a quarter of the dense
    # GEMMs' 4096, and the curve (e_max · n / (n + 2048)) runs them at half the rate: the same
    # FLOPs take about twice as long.
    thin = planner.Layout(8, 2, 4, 1, 4, "selective", True, True)
    assert planner_moe.mlp_gemms(MIXTRAL, 4096, 8) == [(8, 1024, 3584, 4096),
                                                       (8, 1024, 4096, 1792)]
    moe, dense = (planner.layer_cost(x, H100, thin) for x in (MIXTRAL, DENSE))
    assert (moe.forward + moe.backward) / (dense.forward + dense.backward) > 1.4


def test_mixtral_on_64_h100s_finds_a_layout():
    results, _ = planner.search(MIXTRAL, H100, 256)
    assert results
    best = results[0]
    assert best["memory_gb_per_gpu"] <= 80 and 0.2 < best["mfu"] < 0.6
    # Every proposal splits the experts' 14336 over its TP size, and fits.
    assert all(14336 % r["tp"] == 0 and r["memory_gb_per_gpu"] <= 80 for r in results)
    # Without pipelining, ZeRO or expert parallelism every rank holds 46.7B / tp parameters
    # with their gradients and Adam state (18 bytes each): 105 GB at TP 8 - never proposed.
    assert not any(r["pp"] == 1 and not r["zero"] and r["ep"] == 1 for r in results)
    # Expert parallelism is searched (tests/python/planner/test_expert_parallel.py): the best
    # layout splits the experts over 8 ranks, which leaves room for TP 1 - each rank's expert
    # then runs on the rows of 8 ranks' tokens - and is faster than any that keeps them all.
    assert best["ep"] == 8 and best["tp"] == 1
    assert best["step_time_s"] < 0.85 * min(r["step_time_s"] for r in results if r["ep"] == 1)
    with pytest.raises(planner.DoesNotFit):
        planner.predict(MIXTRAL, H100, planner.Layout(8, 1, 8, 1, recompute="full",
                                                      sequence_parallel=True), 256)


def test_when_the_experts_do_not_fit_the_plan_says_why():
    # 8 A100 80GB: Mixtral's 46.7B parameters need 105 GB of state per GPU however they are
    # split, 97% of it the experts'; the dense model with the same per-token FLOPs (12.9B) fits.
    small = planner.Cluster(planner.GPUS["a100-80g"], 8, 8, 300e9, 25e9)
    assert planner.search(MIXTRAL, small, 64)[0] == []
    assert planner.search(DENSE, small, 64)[0]
    why = planner.why_nothing_fits(MIXTRAL, small, 64, {})
    assert "no layout fits in 80 GB" in why and "105.1 GB per GPU" in why
    assert "the 8 experts of each layer are 97% of them" in why
    assert "experts" not in planner.why_nothing_fits(
        DENSE, planner.Cluster(planner.GPUS["a100-40g"], 8, 1, 300e9, 25e9), 64, {})
    out = _plan("--model", "mixtral-8x7b", "--gpu", "a100-80g", "--num-gpus", "8",
                "--nvlink-bw", "300GB/s", "--net-bw", "200Gb/s", "--global-batch", "64")
    assert out.returncode == 1 and "97% of them" in out.stderr


CLUSTER = ["--gpu", "h100-80g", "--num-gpus", "64", "--nvlink-bw", "450GB/s", "--net-bw",
           "400Gb/s"]
LAYOUT = ["--tp", "4", "--pp", "2", "--micro-batch-size", "4", "--virtual-stages", "4",
          "--recompute", "selective", "--sequence-parallel", "true", "--zero", "true",
          "--expert-model-parallel-size", "1"]
SHAPE = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
         "--num-query-groups", "8", "--ffn-hidden-size", "14336", "--vocab-size", "32000",
         "--seq-length", "4096"]
TRAINING = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
            "--group-query-attention", "--num-query-groups", "8", "--ffn-hidden-size", "14336",
            "--num-experts", "8", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
            "--swiglu", "--untie-embeddings-and-output-weights", "--normalization", "RMSNorm",
            "--position-embedding-type", "rope", "--disable-bias-linear", "--seq-length", "4096",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "31999",
            "--data-path", "/not/here", "--micro-batch-size", "4", "--global-batch-size", "256",
            "--train-iters", "100", "--tensor-model-parallel-size", "4",
            "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
            "4", "--sequence-parallel", "--use-distributed-optimizer", "--overlap-grad-reduce",
            "--overlap-param-gather", "--recompute-granularity", "selective", "--bf16"]


def test_plan_cli_takes_the_experts_as_pretrain_gpt_does():
    lay = planner.Layout(4, 2, 8, 4, 4, "selective", True, True)
    want = planner.predict(MIXTRAL, H100, lay, 256)
    preset = _plan(*CLUSTER, *LAYOUT, "--model", "mixtral-8x7b", "--global-batch", "256",
                   "--json")
    flags = _plan(*CLUSTER, *LAYOUT, *SHAPE, "--num-experts", "8", "--moe-router-topk", "2",
                  "--global-batch", "256", "--json")
    run = _plan(*CLUSTER, "--json", "--", *TRAINING)
    for out in (preset, flags, run):
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)[0]["step_time_s"] == pytest.approx(want["step_time_s"],
                                                                         rel=1e-12)
    # A preset's experts can be changed: top 1 halves the routed MLP work.
    out = _plan(*CLUSTER, *LAYOUT, "--model", "mixtral-8x7b", "--moe-router-topk", "1",
                "--global-batch", "256", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)[0]["step_time_s"] < 0.8 * want["step_time_s"]
    # Refused as pretrain_gpt.py refuses them (braid.moe_args), here and after --.
    refusals = [
        (["--model", "mixtral-8x7b", "--expert-model-parallel-size", "3"],
         "--expert-model-parallel-size 3 does not divide --num-experts 8"),
        ([*SHAPE, "--moe-ffn-hidden-size", "4096"], "--moe-ffn-hidden-size needs --num-experts"),
        ([*SHAPE, "--num-experts", "2", "--moe-router-topk", "4"],
         "--moe-router-topk 4 is more than --num-experts 2"),
        ([*SHAPE, "--num-experts", "8", "--moe-ffn-hidden-size", "1001", "--tp", "2"],
         "--moe-ffn-hidden-size 1001 is not divisible by --tp 2"),
    ]
    for args, message in refusals:
        out = _plan(*CLUSTER, "--global-batch", "256", *args)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)
    out = _plan(*CLUSTER, "--", *TRAINING, "--expert-model-parallel-size", "16")
    assert out.returncode == 2 and "--expert-model-parallel-size 16 does not divide" in out.stderr
    out = _plan(*CLUSTER, "--num-experts", "8", "--", *TRAINING)
    assert out.returncode == 2 and "--num-experts: with training arguments after --" in out.stderr


# ---- a shared expert (moe_shared_expert_intermediate_size, moe_shared_expert_gate) ----------

def _tiny_with_a_gated_shared_expert(preset):
    cfg = braid.TransformerConfig.preset(preset)
    cfg.num_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size = 4, 2, 96
    cfg.moe_shared_expert_intermediate_size, cfg.moe_shared_expert_gate = 160, True
    return cfg


def test_parameters_and_flops_count_the_shared_expert_and_its_gate():
    # llama-tiny (2 layers, hidden 64, 4 heads, 2 KV heads of 16, vocab 256, untied) with 4
    # experts of 96, top 2, and a gated shared expert of 160. Per layer: attention
    # 64·(64 + 2·32) + 64·64, the two norms 2·64, the experts 4·3·64·96, the router 4·64, the
    # shared expert 3·64·160 and its gate [1, 64]; the embedding and the LM head 2·256·64, the
    # final norm 64 (which ModelShape leaves out, as for Mixtral above).
    cfg = _tiny_with_a_gated_shared_expert("llama-tiny")
    layer = 64 * (64 + 2 * 32) + 64 * 64 + 2 * 64 + 4 * 3 * 64 * 96 + 4 * 64 + 3 * 64 * 160 + 64
    assert cfg.num_parameters() == 2 * layer + 2 * 256 * 64 + 64 == 267_200
    shape = planner.ModelShape(2, 64, 4, 2, 192, 256, 32, num_experts=4, moe_ffn_hidden_size=96,
                               moe_shared_expert_intermediate_size=160,
                               moe_shared_expert_gate=True)
    assert shape.num_params() + 64 == cfg.num_parameters()
    # Per TP rank the shared expert is split like the experts, the router and the gate whole.
    assert shape.layer_params(4) == pytest.approx((layer - 4 * 64 - 64) / 4 + 4 * 64 + 64)
    # Without the gate: 64 fewer a layer.
    ungated = dataclasses.replace(shape, moe_shared_expert_gate=False)
    assert shape.num_params() - ungated.num_params() == 2 * 64
    # GELU: the shared expert's fc1 and fc2 biases too, as GPTModel builds them (+ the final
    # norm's weight and bias and GPT-2's learned positions).
    gcfg = _tiny_with_a_gated_shared_expert("gpt2-tiny")
    gshape = dataclasses.replace(shape, kv_heads=4, ffn_hidden_size=256, seq_length=128,
                                 activation="gelu", tied_embeddings=True)
    built = braid.GPTModel(gcfg, device="cpu", seed=1).num_parameters()
    assert gshape.num_params() + 2 * 64 + 128 * 64 == built == gcfg.num_parameters()
    # FLOPs per token and layer: the k routed experts, the router, the shared expert as a dense
    # MLP of 160 on every token (2·m·64·160) and its gate (2·64).
    s = 32
    for preset, kv, m in (("llama-tiny", 32, 3), ("gpt2-tiny", 64, 2)):
        cfg = _tiny_with_a_gated_shared_expert(preset)
        layer = 2 * 64 * (64 + 2 * kv) + 2 * 64 * 64 + 4 * 64 * s + 2 * (2 * m * 64 * 96) \
            + 2 * 64 * 4 + 2 * m * 64 * 160 + 2 * 64
        assert flops.forward_flops_per_token(cfg, s) == 2 * layer + 2 * 64 * 256, preset
    assert flops.forward_flops_per_token(shape, s) == flops.forward_flops_per_token(
        _tiny_with_a_gated_shared_expert("llama-tiny"), s)


# Mixtral with a shared expert as wide as one of its experts, gated (Qwen2-MoE's kind), and
# the dense model DENSE widened by the same MLP.
SHARED = dataclasses.replace(MIXTRAL, moe_shared_expert_intermediate_size=14336,
                             moe_shared_expert_gate=True)
WIDE = dataclasses.replace(DENSE, ffn_hidden_size=3 * 14336)


def test_a_shared_expert_keeps_its_activations_and_holds_its_parameters():
    # Per token of a layer at TP 4 (its hidden 14336 split, 3584 a rank), over Mixtral's:
    # none shared_fc1_out [T, 2·3584] and shared_act_out [T, 3584], selective shared_fc1_out
    # alone (the activation is recomputed); with the gate also shared_out [T, 4096] (the rank's
    # partial output, whole tokens under SP too) and the f32 logit [T, 1]; full nothing.
    lay = planner.Layout(4, 2, 8, 4, 4, "selective", True, True)
    T = 4 * 4096
    gate = 2 * 4096 + 4
    extra = {"none": 2 * 2 * 3584 + 2 * 3584, "selective": 2 * 2 * 3584, "full": 0}
    ungated = dataclasses.replace(SHARED, moe_shared_expert_gate=False)
    for rec, per_token in extra.items():
        base = planner.layer_activation_bytes(MIXTRAL, lay, rec)
        assert planner.layer_activation_bytes(ungated, lay, rec) - base == \
            pytest.approx(per_token * T)
        assert planner.layer_activation_bytes(SHARED, lay, rec) - base == \
            pytest.approx((per_token + (gate if rec != "full" else 0)) * T)
    # bf16 parameters of the fullest rank: 16 layers of the shared expert (3·4096·14336 / 4)
    # and its gate (4096, whole) more than Mixtral's.
    with_shared, without = (planner.predict(x, H100, lay, 256, baseline=False)
                            for x in (SHARED, MIXTRAL))
    assert with_shared["memory_parts_gb"]["params"] - without["memory_parts_gb"]["params"] == \
        pytest.approx(2 * 16 * (3 * 4096 * 14336 / 4 + 4096) / 1e9, rel=1e-9)
    # Every TP size the search proposes splits the shared expert's hidden size.
    with pytest.raises(ValueError, match="shared expert 1001"):
        planner.check_layout(dataclasses.replace(SHARED, moe_shared_expert_intermediate_size=1001),
                             H100, lay, 256)


def test_a_shared_expert_costs_about_a_dense_mlp_of_its_size():
    # Against the same growth of a dense model (DENSE's MLP widened from 2 x 14336 to
    # 3 x 14336): the same FLOPs and parameters. Here (TP 4, micro batch 4: T = 16384 rows,
    # the dense GEMMs' smallest dimension 4096) the shared expert's own GEMMs cost a little
    # more than widening: fc2's depth is S/t = 3584 < 4096, which the efficiency curve runs
    # 5% slower (a third of the FLOPs: +1.5%), 4 more launches a pass, and its output is added
    # to the experts' ([T, H] read twice and written: +2%) - 4% in all, so 1.0 to 1.08. The
    # gate adds its [T, H] x [H, 1] GEMM at HBM speed, the output's scaling and its
    # gradient (about 12 [T, H] bf16 tensors moved over forward and backward) and the [T, 1]
    # all-reduce: 11% in all, so below 1.15. Counting the shared expert once per routed
    # choice (k = 2) would double it; leaving out its backward would make it a third.
    lay = planner.Layout(4, 2, 8, 4, 4, "selective", True, True)
    ungated = dataclasses.replace(SHARED, moe_shared_expert_gate=False)

    def layer(x):
        c = planner.layer_cost(x, H100, lay)
        return c.forward + c.backward

    dense_mlp = layer(WIDE) - layer(DENSE)
    assert 1.0 < (layer(ungated) - layer(MIXTRAL)) / dense_mlp < 1.08
    assert 1.0 < (layer(SHARED) - layer(MIXTRAL)) / dense_mlp < 1.15
    # The step: the layers' time, and the shared expert's parameters on the DP links and in the
    # optimizer, as the widened dense MLP's - the same bounds.
    step = {x: planner.predict(x, H100, lay, 256, baseline=False)["step_time_s"]
            for x in (SHARED, ungated, MIXTRAL, WIDE, DENSE)}
    assert step[SHARED] > step[ungated] > step[MIXTRAL]
    dense_mlp = step[WIDE] - step[DENSE]
    assert 1.0 < (step[ungated] - step[MIXTRAL]) / dense_mlp < 1.08
    assert 1.0 < (step[SHARED] - step[MIXTRAL]) / dense_mlp < 1.15


def test_plan_cli_takes_the_shared_expert_as_pretrain_gpt_does():
    # On H200s (141 GB): Mixtral's layout above with the shared expert's state on top.
    cluster = ["--gpu", "h200", *CLUSTER[2:]]
    h200 = dataclasses.replace(H100, gpu=planner.GPUS["h200"])
    lay = planner.Layout(4, 2, 8, 4, 4, "selective", True, True)
    shared = dataclasses.replace(SHARED, moe_shared_expert_intermediate_size=8192)
    want = planner.predict(shared, h200, lay, 256)
    flags = ["--moe-shared-expert-intermediate-size", "8192", "--moe-shared-expert-gate"]
    preset = _plan(*cluster, *LAYOUT, "--model", "mixtral-8x7b", *flags, "--global-batch",
                   "256", "--json")
    shape = _plan(*cluster, *LAYOUT, *SHAPE, "--num-experts", "8", *flags, "--global-batch",
                  "256", "--json")
    run = _plan(*cluster, "--json", "--", *TRAINING, *flags)
    for out in (preset, shape, run):
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)[0]["step_time_s"] == pytest.approx(want["step_time_s"],
                                                                         rel=1e-12)
    # Refused as pretrain_gpt.py refuses them (braid.moe_args), here and after --.
    refusals = [
        ([*SHAPE, "--num-experts", "8", "--moe-shared-expert-gate"],
         "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size"),
        ([*SHAPE, "--moe-shared-expert-intermediate-size", "4096"],
         "--moe-shared-expert-intermediate-size needs --num-experts"),
        ([*SHAPE, "--num-experts", "8", "--moe-shared-expert-intermediate-size", "1001", "--tp",
          "2"], "--moe-shared-expert-intermediate-size 1001 is not divisible by --tp 2"),
    ]
    for args, message in refusals:
        out = _plan(*cluster, "--global-batch", "256", *args)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)
    out = _plan(*cluster, "--", *TRAINING, "--moe-shared-expert-gate")
    assert out.returncode == 2 and \
        "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size" in out.stderr
    out = _plan(*cluster, "--moe-shared-expert-gate", "--", *TRAINING, *flags)
    assert out.returncode == 2 and \
        "--moe-shared-expert-gate: with training arguments after --" in out.stderr


# ---- dense layers among the expert ones (moe_layers, Megatron's --moe-layer-freq) -----------

def _tiny_with_a_dense_first_layer(preset):
    cfg = _tiny_with_a_gated_shared_expert(preset)
    cfg.num_layers, cfg.moe_layers = 3, [0, 1, 1]
    return cfg


def test_a_dense_layer_holds_and_computes_the_dense_mlp():
    # llama-tiny of 3 layers, the first dense (its MLP of ffn 192; no router, experts or shared
    # expert), the others as above: 4 experts of 96, top 2, a gated shared expert of 160.
    cfg = _tiny_with_a_dense_first_layer("llama-tiny")
    attention = 64 * (64 + 2 * 32) + 64 * 64 + 2 * 64  # QKV, output, the two norms
    dense = attention + 3 * 64 * 192
    experts = attention + 4 * 3 * 64 * 96 + 4 * 64 + 3 * 64 * 160 + 64
    assert cfg.num_parameters() == dense + 2 * experts + 2 * 256 * 64 + 64 == 316_480
    shape = planner.ModelShape(3, 64, 4, 2, 192, 256, 32, num_experts=4, moe_ffn_hidden_size=96,
                               moe_shared_expert_intermediate_size=160,
                               moe_shared_expert_gate=True, moe_layers=(0, 1, 1))
    assert shape.num_params() + 64 == cfg.num_parameters()
    assert [shape.has_experts(i) for i in range(3)] == [False, True, True]
    assert shape.expert_layers == 2
    # Per layer and TP rank: a dense layer all split, an expert layer's router and gate whole;
    # None: the layers' mean.
    assert shape.layer_params(4, 0) == pytest.approx(dense / 4)
    assert shape.layer_params(4, 2) == pytest.approx((experts - 4 * 64 - 64) / 4 + 4 * 64 + 64)
    assert shape.layer_params() == pytest.approx((dense + 2 * experts) / 3)
    assert shape.layers_params(0, 2, 4) == pytest.approx(shape.layer_params(4, 0) +
                                                         shape.layer_params(4, 1))
    # GELU: the dense MLP's biases (ffn 256) too, as GPTModel builds it (+ the final norm's
    # weight and bias and GPT-2's learned positions).
    gcfg = _tiny_with_a_dense_first_layer("gpt2-tiny")
    gshape = dataclasses.replace(shape, kv_heads=4, ffn_hidden_size=256, seq_length=128,
                                 activation="gelu", tied_embeddings=True)
    built = braid.GPTModel(gcfg, device="cpu", seed=1).num_parameters()
    assert gshape.num_params() + 2 * 64 + 128 * 64 == built == gcfg.num_parameters()
    # FLOPs per token: the dense layer's MLP 2·m·64·ffn, the expert layers' k routed experts,
    # router, shared expert and gate; from a TransformerConfig and a ModelShape alike.
    s = 32
    for preset, kv, m, ffn in (("llama-tiny", 32, 3, 192), ("gpt2-tiny", 64, 2, 256)):
        attention = 2 * 64 * (64 + 2 * kv) + 2 * 64 * 64 + 4 * 64 * s
        dense = attention + 2 * m * 64 * ffn
        experts = attention + 2 * (2 * m * 64 * 96) + 2 * 64 * 4 + 2 * m * 64 * 160 + 2 * 64
        cfg = _tiny_with_a_dense_first_layer(preset)
        assert flops.forward_flops_per_token(cfg, s) == dense + 2 * experts + 2 * 64 * 256
    assert flops.forward_flops_per_token(shape, s) == flops.forward_flops_per_token(
        _tiny_with_a_dense_first_layer("llama-tiny"), s)


# DeepSeek's pattern on Mixtral's shape: the first layer dense (ffn 14336), 31 expert layers.
FIRST_DENSE = dataclasses.replace(MIXTRAL, moe_layers=(0,) + (1,) * 31)


def test_a_dense_first_layer_holds_and_takes_less_than_an_expert_one():
    # TP 8, no pipeline: every rank holds every layer. The dense layer holds one MLP of 14336
    # where the expert layer holds 8 and the router: 7 x 3 x 4096 x 14336 / 8 + 8 x 4096 fewer
    # parameters a rank, with their f32 gradients and (ZeRO over dp 8) Adam state; it keeps
    # the dense MLP's activations, not the k rows' and the routing's.
    lay = planner.Layout(8, 1, 8, 1, 1, "selective", True, True)
    moe, first = (planner.predict(x, H100, lay, 256) for x in (MIXTRAL, FIRST_DENSE))
    fewer = 7 * 3 * 4096 * 14336 / 8 + 8 * 4096
    parts = {k: moe["memory_parts_gb"][k] - first["memory_parts_gb"][k]
             for k in ("params", "grads", "optimizer", "activations")}
    assert parts["params"] == pytest.approx(2 * fewer / 1e9, rel=1e-9)
    assert parts["grads"] == pytest.approx(4 * fewer / 1e9, rel=1e-9)
    assert parts["optimizer"] == pytest.approx(12 * fewer / 8 / 1e9, rel=1e-9)
    assert parts["activations"] * 1e9 == pytest.approx(
        planner.layer_activation_bytes(MIXTRAL, lay) -
        planner.layer_activation_bytes(FIRST_DENSE, lay, layer=0), rel=1e-9)
    assert first["memory_gb_per_gpu"] < moe["memory_gb_per_gpu"]
    # Its MLP is one dense MLP of 14336 where an expert layer's tokens each go through two:
    # faster, and counted as such (model FLOPs: 2 x 3 x 4096 x 14336 + the router's 2 x 4096
    # x 8 fewer a token).
    assert first["step_time_s"] < moe["step_time_s"]
    dense, expert = (planner.layer_cost(FIRST_DENSE, H100, lay, i) for i in (0, 1))
    assert dense.forward + dense.backward < 0.8 * (expert.forward + expert.backward)
    assert expert == planner.layer_cost(MIXTRAL, H100, lay)
    mean = planner.layer_cost(FIRST_DENSE, H100, lay)  # None: the layers' mean
    for f in ("forward", "backward", "model_flops"):
        assert getattr(mean, f) == pytest.approx((getattr(dense, f) + 31 * getattr(expert, f))
                                                 / 32, rel=1e-12)
    assert planner.layer_activation_bytes(FIRST_DENSE, lay) == pytest.approx(
        (planner.layer_activation_bytes(FIRST_DENSE, lay, layer=0) +
         31 * planner.layer_activation_bytes(MIXTRAL, lay)) / 32, rel=1e-12)
    work = {k: r["mfu"] * r["step_time_s"] * 64 * 989e12 for k, r in (("moe", moe),
                                                                       ("first", first))}
    assert work["moe"] - work["first"] == pytest.approx(
        3 * (2 * 3 * 4096 * 14336 + 2 * 4096 * 8) * 256 * 4096, rel=1e-9)
    # The pipelined layout of the docs (TP 4, PP 2, v 4): less too.
    lay = planner.Layout(4, 2, 8, 4, 4, "selective", True, True)
    moe, first = (planner.predict(x, H100, lay, 256) for x in (MIXTRAL, FIRST_DENSE))
    assert first["memory_gb_per_gpu"] < moe["memory_gb_per_gpu"]
    assert first["step_time_s"] < moe["step_time_s"]


# Half the layers with experts: the first 16, or every other one.
FIRST_HALF = dataclasses.replace(MIXTRAL, moe_layers=(1,) * 16 + (0,) * 16)
ALTERNATING = dataclasses.replace(MIXTRAL, moe_layers=(1, 0) * 16)


def test_stages_of_more_expert_layers_hold_and_take_more():
    # PP 2: with the experts in the first half, stage 0 holds all 16 expert layers and stage 1
    # none; alternating, 8 each. The same parameters and model FLOPs; the first stage holds 8
    # expert layers' worth more (each (8 experts - 1 dense MLP) x 3 x 4096 x 14336 / tp + the
    # router) and takes longer, and the simulated step waits for it.
    lay = planner.Layout(4, 2, 8, 4, 1, "selective", True, True)
    assert FIRST_HALF.num_params() == ALTERNATING.num_params()
    half, alt = (planner.stage_params(x, lay) for x in (FIRST_HALF, ALTERNATING))
    assert half[0] - alt[0] == pytest.approx(8 * (7 * 3 * 4096 * 14336 / 4 + 8 * 4096))
    assert sum(half) == pytest.approx(sum(alt))
    uneven, even = (planner.predict(x, H100, lay, 256) for x in (FIRST_HALF, ALTERNATING))
    assert uneven["memory_gb_per_gpu"] > 1.3 * even["memory_gb_per_gpu"]
    assert uneven["step_time_s"] > 1.1 * even["step_time_s"]
    assert uneven["mfu"] * uneven["step_time_s"] == pytest.approx(
        even["mfu"] * even["step_time_s"], rel=1e-12)
    # Full recomputation reruns each layer's forward at its kind's cost (HFU: the layers'
    # forward once more, whatever their order).
    full = planner.Layout(4, 2, 8, 1, 1, "full", True, True)
    uneven, even = (planner.predict(x, H100, full, 256) for x in (FIRST_HALF, ALTERNATING))
    layers_only = flops.forward_flops_per_token(dataclasses.replace(FIRST_HALF, vocab_size=0),
                                                4096)
    whole = flops.forward_flops_per_token(FIRST_HALF, 4096)
    for r in (uneven, even):
        assert r["hfu"] / r["mfu"] - 1 == pytest.approx(layers_only / (3 * whole), rel=1e-9)
    assert uneven["step_time_s"] > 1.2 * even["step_time_s"]


def test_chunks_of_different_kinds_are_kept_as_the_schedule_keeps_them():
    # Interleaved (pp 2, v 2, 4 microbatches), rank 0 runs F0c0 F1c0 F0c1 F1c1 F2c0 B0c1 F3c0
    # B1c1 ...: with chunk 0 keeping a and chunk 1 b bytes a microbatch, it holds 3a + 2b after
    # F2c0, 4a + b after F3c0.
    schedule = braid._C.make_interleaved_1f1b(2, 4, 2)
    assert planner.peak_kept(schedule, 0, [2.0, 1.0]) == 4 * 2 + 1
    assert planner.peak_kept(schedule, 0, [1.0, 2.0]) == 3 * 1 + 2 * 2
    assert planner.peak_kept(schedule, 0, [1.0, 1.0]) == planner.in_flight(
        planner.Layout(4, 2, 8, 4, 2), 4)[0]
    # FIRST_HALF at pp 2, v 2: rank 0's chunks are layers 0-7 (experts) and 16-23 (dense),
    # as many parameters as ALTERNATING's, but its expert chunk is the one it keeps more of.
    lay = planner.Layout(4, 2, 8, 4, 2, "selective", True, True)
    a, b = (8 * planner.layer_activation_bytes(FIRST_HALF, lay, layer=i) for i in (0, 16))
    assert a > b
    total, parts = planner.memory(FIRST_HALF, H100, lay, 4)
    assert parts["activations"] == pytest.approx((4 * a + b) / 1e9, rel=1e-12)
    assert planner.stage_params(FIRST_HALF, lay) == planner.stage_params(ALTERNATING, lay)
    assert total > planner.memory(ALTERNATING, H100, lay, 4)[0]
    # A chunk's layers each keep their own kind's; full recomputation's rerun holds the
    # chunk's (block) recomputed layers' inputs and its heaviest layer's whole set at once.
    blk = planner.Layout(4, 2, 8, 4, 1, "full", True, True, recompute_method="block",
                         recompute_num_layers=1)
    kept, transient = planner.chunk_activation_bytes(ALTERNATING, blk, 4, 0)
    inp = planner.layer_activation_bytes(ALTERNATING, blk, "full", 0)
    expert, dense = (planner.layer_activation_bytes(ALTERNATING, blk, "none", i) for i in (0, 1))
    assert kept == pytest.approx(inp + expert + 2 * dense) and transient == expert
    uni = dataclasses.replace(blk, recompute_method="uniform", recompute_num_layers=2)
    assert planner.chunk_activation_bytes(ALTERNATING, uni, 4, 0) == pytest.approx(
        (2 * inp, expert + dense))


def test_plan_cli_takes_the_moe_layer_freq_as_pretrain_gpt_does():
    lay = planner.Layout(4, 2, 8, 4, 4, "selective", True, True)
    want = planner.predict(FIRST_DENSE, H100, lay, 256)
    freq = ["--moe-layer-freq", "[0]+[1]*31"]
    preset = _plan(*CLUSTER, *LAYOUT, "--model", "mixtral-8x7b", *freq, "--global-batch", "256",
                   "--json")
    flags = _plan(*CLUSTER, *LAYOUT, *SHAPE, "--num-experts", "8", *freq, "--global-batch",
                  "256", "--json")
    run = _plan(*CLUSTER, "--json", "--", *TRAINING, *freq)
    for out in (preset, flags, run):
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)[0]["step_time_s"] == pytest.approx(want["step_time_s"],
                                                                         rel=1e-12)
    # An integer N: layers 0, N, 2N, ... (0-based, Megatron's rule).
    want = planner.predict(ALTERNATING, H100, lay, 256)
    for out in (_plan(*CLUSTER, *LAYOUT, "--model", "mixtral-8x7b", "--moe-layer-freq", "2",
                      "--global-batch", "256", "--json"),
                _plan(*CLUSTER, "--json", "--", *TRAINING, "--moe-layer-freq", "2")):
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)[0]["step_time_s"] == pytest.approx(want["step_time_s"],
                                                                         rel=1e-12)
    # Refused as pretrain_gpt.py refuses them (braid.moe_args), here and after --.
    refusals = [
        ([*SHAPE, "--moe-layer-freq", "2"], "--moe-layer-freq needs --num-experts"),
        (["--model", "mixtral-8x7b", "--moe-layer-freq", "[0]+[1]*30"],
         "--moe-layer-freq gives 31 layers for --num-layers 32"),
        (["--model", "mixtral-8x7b", "--moe-layer-freq", "[0]*32"], "gives no layer experts"),
        (["--model", "mixtral-8x7b", "--moe-layer-freq", "[2]*32"],
         "must give a list of 0s and 1s"),
    ]
    for args, message in refusals:
        out = _plan(*CLUSTER, "--global-batch", "256", *args)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)
    out = _plan(*CLUSTER, "--", *TRAINING, "--moe-layer-freq", "[0]+[1]*30")
    assert out.returncode == 2 and "gives 31 layers for --num-layers 32" in out.stderr
    out = _plan(*CLUSTER, *freq, "--", *TRAINING)
    assert out.returncode == 2 and "--moe-layer-freq: with training arguments after --" in \
        out.stderr
