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
    # A GELU model: each expert's fc1 and fc2 biases, the router without one, as GPTModel
    # builds them (+ the final norm's weight and bias and GPT-2's learned positions).
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
    # Without pipelining or ZeRO every rank holds 46.7B / tp parameters with their gradients
    # and Adam state (18 bytes each): 105 GB at TP 8 - never proposed.
    assert not any(r["pp"] == 1 and not r["zero"] for r in results)
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
    assert "no expert parallelism" in why
    assert "experts" not in planner.why_nothing_fits(
        DENSE, planner.Cluster(planner.GPUS["a100-40g"], 8, 1, 300e9, 25e9), 64, {})
    out = _plan("--model", "mixtral-8x7b", "--gpu", "a100-80g", "--num-gpus", "8",
                "--nvlink-bw", "300GB/s", "--net-bw", "200Gb/s", "--global-batch", "64")
    assert out.returncode == 1 and "97% of them" in out.stderr


CLUSTER = ["--gpu", "h100-80g", "--num-gpus", "64", "--nvlink-bw", "450GB/s", "--net-bw",
           "400Gb/s"]
LAYOUT = ["--tp", "4", "--pp", "2", "--micro-batch-size", "4", "--virtual-stages", "4",
          "--recompute", "selective", "--sequence-parallel", "true", "--zero", "true"]
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
        (["--model", "mixtral-8x7b", "--expert-model-parallel-size", "8"],
         "--expert-model-parallel-size 8: expert parallelism is not implemented"),
        ([*SHAPE, "--moe-ffn-hidden-size", "4096"], "--moe-ffn-hidden-size needs --num-experts"),
        ([*SHAPE, "--num-experts", "2", "--moe-router-topk", "4"],
         "--moe-router-topk 4 is more than --num-experts 2"),
        ([*SHAPE, "--num-experts", "8", "--moe-ffn-hidden-size", "1001", "--tp", "2"],
         "--moe-ffn-hidden-size 1001 is not divisible by --tensor-model-parallel-size 2"),
    ]
    for args, message in refusals:
        out = _plan(*CLUSTER, "--global-batch", "256", *args)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)
    out = _plan(*CLUSTER, "--", *TRAINING, "--expert-model-parallel-size", "2")
    assert out.returncode == 2 and "expert parallelism is not implemented" in out.stderr
    out = _plan(*CLUSTER, "--num-experts", "8", "--", *TRAINING)
    assert out.returncode == 2 and "--num-experts: with training arguments after --" in out.stderr
