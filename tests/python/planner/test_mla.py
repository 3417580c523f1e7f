"""Multi-latent attention in the planner (braid.planner_mla; braid.planner, planner_inputs) and
tools/plan.py, and the deepseek-v3 / deepseek-v2-lite presets."""

import dataclasses
import os
import sys

import pytest

import braid
from braid import flops, planner, planner_mla

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(REPO, "tools"))
import plan  # noqa: E402

V3 = planner.PRESETS["deepseek-v3"]
LITE = planner.PRESETS["deepseek-v2-lite"]
H100 = planner.Cluster(planner.GPUS["h100-80g"], 8, 64, 450e9, 50e9)
CLUSTER = ["--gpu", "h100-80g", "--num-gpus", "16", "--nvlink-bw", "450GB/s", "--net-bw",
           "400Gb/s"]


def _braid_config(shape):
    """braid's TransformerConfig of a planner ModelShape with MLA and experts (RMSNorm, SwiGLU,
    RoPE, no biases, untied)."""
    cfg = braid.TransformerConfig.preset("llama3-8b")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                 "vocab_size", "qk_layernorm", "num_experts", "moe_router_topk",
                 "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                 "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                 "qk_pos_emb_head_dim", "v_head_dim"):
        setattr(cfg, name, getattr(shape, name))
    cfg.num_query_groups, cfg.tie_embeddings = 0, False
    cfg.max_position_embeddings, cfg.moe_layers = shape.seq_length, list(shape.moe_layers)
    return cfg


def test_deepseek_v3_attention_is_187m_parameters_a_layer_the_down_projections_whole():
    split, whole = planner_mla.params(V3)
    assert split + whole == 187_107_328
    # q_a_proj [1536, 7168], kv_a_proj_with_mqa [576, 7168] and the two latent norms
    assert whole == 1536 * 7168 + 576 * 7168 + 1536 + 512
    # a dense layer: attention, the input and post-attention norms, the MLP of 18432
    dense = 187_107_328 + 2 * 7168 + 3 * 7168 * 18432
    assert V3.layer_params(layer=0) == dense
    # Under TP each rank holds the down projections and latent norms whole, the rest its share.
    assert V3.layer_params(8, layer=0) == (dense - whole) / 8 + whole
    # No query latent (DeepSeek-V2-Lite): q_proj [16 x 192, 2048], one latent norm.
    assert planner_mla.params(LITE) == (16 * 192 * 2048 + 16 * 256 * 512 + 2048 * 16 * 128,
                                        576 * 2048 + 512)


def test_preset_totals_are_braids_count_and_the_published_ones():
    # braid's own parameter layout (csrc/model/parameters.cpp) counts the final norm too,
    # which the planner leaves out (as for every preset).
    for shape in (V3, LITE):
        assert shape.num_params() + shape.hidden_size == \
            _braid_config(shape).num_parameters()
    # DeepSeek-V3: 671B without the multi-token-prediction module (its expert biases, 58 x
    # 256 f32, are buffers, not parameters); V2-Lite: 15.7B.
    assert V3.num_params() == 671_026_397_184
    assert V3.num_params() == pytest.approx(671e9, rel=1e-4)
    assert LITE.num_params() == 15_706_482_176


def test_per_op_gemms_are_braid_flops_mla_count():
    # tp 1: the GEMMs on the curve plus the narrow RoPE-key GEMM are flops.attention_flops'
    # projections, per token.
    T = 4096
    for shape in (V3, LITE):
        projections, per_key = flops.attention_flops(shape)
        per_op = sum(c * 2 * m * n * k for c, m, n, k in planner_mla.gemms(shape, T, 1))
        assert per_op + planner_mla.rope_key_gemm(shape, T)[0] == T * projections
        # The attention kernel runs the values padded to D = 192: 4·n·D per key against the
        # model's 2·n·(Dn + Dr) + 2·n·Dv; equal when Dv = D.
        assert per_key == 2 * shape.num_attention_heads * (192 + 128)
        padded = dataclasses.replace(shape, v_head_dim=192)
        assert flops.attention_flops(padded)[1] == 4 * shape.num_attention_heads * 192
    # TP splits the up projections and o_proj by heads; the down projections run whole on every
    # rank, on every token (so 8 ranks compute them 8 times).
    one, eight = planner_mla.gemms(V3, T, 1), planner_mla.gemms(V3, T, 8)
    assert [eight[0], eight[2]] == [one[0], one[2]] == [(1, T, 1536, 7168), (1, T, 512, 7168)]
    for i in (1, 3, 4):
        assert 8 * eight[i][2] * eight[i][3] == one[i][2] * one[i][3]
    # The planner's MFU numerator is braid.flops' count.
    lay = planner.Layout(1, 1, 64, 1)
    layer = planner.layer_cost(V3, H100, lay, 5)
    one_layer = dataclasses.replace(V3, num_layers=1, vocab_size=0, moe_layers=(1,))
    assert layer.model_flops == flops.forward_flops_per_token(one_layer, 4096) * 4096


def test_gathered_latents_are_kept_on_every_token_under_sp():
    tokens = 4096
    # per token: the two latents before and after their norms (bf16) and the norms' f32 rstd
    kept = 2 * (1536 + 512) * 2 + 2 * 4
    assert planner_mla.kept_bytes(V3, "none") == planner_mla.kept_bytes(V3, "selective") == kept
    assert planner_mla.kept_bytes(V3, "full") == 0
    assert planner_mla.kept_bytes(LITE, "none") == 2 * 512 * 2 + 4
    # TP without SP: every rank keeps them all; with SP the norms' inputs and statistics are the
    # rank's tokens', the gathered latents every token's.
    assert planner_mla.kept_bytes(V3, "none", 8) == kept
    assert planner_mla.kept_bytes(V3, "none", 8, True) == 2 * 2048 / 8 + 2 * 2048 + 2 * 4 / 8
    for rec in ("none", "selective", "full"):
        act = {t: planner.layer_activation_bytes(
            V3, planner.Layout(t, 1, 64 // t, 1, recompute=rec, sequence_parallel=t > 1),
            layer=0) for t in (1, 8)}
        # A dense layer under TP 8 + SP: everything a rank keeps is 1/8 of it but the gathered
        # latents.
        gathered = 0 if rec == "full" else 2 * (1536 + 512) * tokens
        assert 8 * act[8] - act[1] == pytest.approx(7 * gathered, rel=1e-12)
    # q, k, v and attn_out are n heads of D = 192 (the values padded), lse f32 per head.
    none = planner.layer_activation_bytes(V3, planner.Layout(1, 1, 64, 1), layer=0)
    attention = 4 * 2 * 128 * 192 + 4 * 128
    rest = (2 * 7168 + 8 + 2 * 7168) * 2 + 2 * 2 * 18432 + 2 * 18432
    assert none == (attention + rest + kept) * tokens


def test_tp_adds_three_backward_all_reduces_of_the_latents_and_the_rope_key():
    T = 4096
    assert planner_mla.backward_all_reduces(V3, T) == [2 * T * 1536, 2 * T * 512, 2 * T * 64]
    assert planner_mla.backward_all_reduces(LITE, T) == [2 * T * 512, 2 * T * 64]
    for shape in (V3, LITE):
        one = planner_mla.extra_s(shape, H100, planner.Layout(1, 1, 64, 1), T)
        eight = planner_mla.extra_s(shape, H100, planner.Layout(8, 1, 8, 1), T)
        assert eight[0] == one[0]  # nothing added forward
        bw, alpha = planner._link(H100, 8)
        rings = sum(planner._ring(b, 8, bw, alpha, "all_reduce")
                    for b in planner_mla.backward_all_reduces(shape, T))
        assert eight[1] - one[1] == pytest.approx(rings, rel=1e-12)
    assert planner_mla.extra_s(planner.PRESETS["llama3-8b"], H100, planner.Layout(8, 1, 8, 1),
                               T) == (0.0, 0.0)


def test_sp_gathers_the_latents_in_place_of_the_hidden_state():
    T = 4096
    bw, alpha = planner._link(H100, 8)
    hidden = planner._ring(2 * T * 7168, 8, bw, alpha, "all_gather")
    for shape, width, replaced in ((V3, 1536 + 512 + 64, 1), (LITE, 512 + 64, 0)):
        plain = planner_mla.extra_s(shape, H100, planner.Layout(8, 1, 8, 1), T)
        sp = planner_mla.extra_s(shape, H100, planner.Layout(8, 1, 8, 1, sequence_parallel=True),
                                 T)
        gather = planner._ring(2 * T * width, 8, bw, alpha, "all_gather")
        scatter = planner._ring(2 * T * width, 8, bw, alpha, "reduce_scatter")
        # No all-reduces; the narrow RoPE-key GEMM on T / 8 tokens; 6 packing copies.
        narrow = planner_mla.extra_s(shape, H100, planner.Layout(1, 1, 64, 1), T / 8)
        kernels = 6 * planner.KERNEL_LATENCY_S
        assert sp[0] == pytest.approx(narrow[0] + kernels + gather - replaced * hidden, rel=1e-12)
        assert sp[1] == pytest.approx(narrow[1] + 2 * kernels + scatter - 2 * replaced * hidden,
                                      rel=1e-12)
        if replaced:  # with a query latent the hidden state's collectives go
            assert sp[0] < plain[0] and sp[1] < plain[1]
    # The down projections run on the rank's tokens.
    down = planner_mla.gemms(V3, T, 8, sp=True)
    assert [down[0], down[2]] == [(1, T / 8, 1536, 7168), (1, T / 8, 512, 7168)]


def test_plans_without_mla_are_unchanged():
    # Pinned from the planner before multi-latent attention, to the last bit.
    cases = [
        ("llama2-70b", planner.Layout(8, 4, 2, 1, 2, "selective", True, True), 64,
         5.347636620866569, 40.45816832),
        ("mixtral-8x7b", planner.Layout(1, 2, 32, 1, 8, "none", False, True, ep=8), 256,
         2.78689760646222, 70.454208512),
        ("gpt3-175b", planner.Layout(8, 8, 1, 1, 1, "full", True, False), 64,
         9.757119728663925, 55.046998016),
    ]
    for name, lay, batch, step, mem in cases:
        r = planner.predict(planner.PRESETS[name], H100, lay, batch)
        assert (r["step_time_s"], r["memory_gb_per_gpu"]) == (step, mem), name
    # qk_layernorm without MLA is still q_norm and k_norm (Qwen3's)
    qwen = dataclasses.replace(planner.PRESETS["llama3-8b"], qk_layernorm=True)
    assert qwen.num_params() == 8030265344
    for rec, step, mem in (("none", 1.3291602193144625, 21.346190848),
                           ("selective", 1.3448234234219258, 17.710777856)):
        r = planner.predict(qwen, H100, planner.Layout(4, 2, 8, 1, 1, rec, True, True), 64)
        assert (r["step_time_s"], r["memory_gb_per_gpu"]) == (step, mem)


def test_deepseek_v3_fits_80gb_h100s_only_with_expert_parallelism():
    cluster = planner.Cluster(planner.GPUS["h100-80g"], 8, 2048, 450e9, 50e9)
    fixed = dict(tp=1, pp=16, micro_batch_size=1, virtual_stages=1, zero=True,
                 recompute="full", recompute_method="uniform", recompute_num_layers=1)
    results, _ = planner.search(V3, cluster, 4096, fixed)
    assert results and all(r["ep"] > 1 for r in results)
    best = results[0]
    assert best["memory_gb_per_gpu"] <= 80 and best["ep"] == 8
    assert best["stage_layers"][0] + best["stage_layers"][-1] == 5  # 61 = 14 x 4 + 5
    assert planner.search(V3, cluster, 4096, dict(fixed, ep=1))[0] == []
    why = planner.why_nothing_fits(V3, cluster, 4096, dict(fixed, ep=1))
    assert "expert parallelism could split them over up to 128 ranks" in why


def test_plan_cli_presets_flags_and_training_arguments_agree(capsys):
    a = plan.parse_args([*CLUSTER, "--model", "deepseek-v3", "--global-batch", "64"])
    assert a.model_shape == V3
    a = plan.parse_args([*CLUSTER, "--model", "deepseek-v2-lite", "--global-batch", "64"])
    assert a.model_shape == LITE
    # a flag overrides the preset's rank, the preset's others stay
    a = plan.parse_args([*CLUSTER, "--model", "deepseek-v2-lite", "--q-lora-rank", "768",
                         "--global-batch", "64"])
    assert a.model_shape == dataclasses.replace(LITE, q_lora_rank=768)
    flags = ["--num-layers", "27", "--hidden-size", "2048", "--num-attention-heads", "16",
             "--ffn-hidden-size", "10944", "--vocab-size", "102400", "--seq-length", "4096",
             "--num-experts", "64", "--moe-router-topk", "6", "--moe-ffn-hidden-size", "1408",
             "--moe-shared-expert-intermediate-size", "2816", "--moe-layer-freq", "[0]+[1]*26"]
    a = plan.parse_args([*CLUSTER, *flags, "--multi-latent-attention", "--kv-lora-rank", "512",
                         "--qk-layernorm", "--global-batch", "64"])
    assert a.model_shape == LITE
    training = ["--swiglu", "--untie-embeddings-and-output-weights", "--normalization",
                "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
                "--max-position-embeddings", "4096", "--tokenizer-type", "NullTokenizer",
                "--data-path", "data/x", "--micro-batch-size", "1", "--global-batch-size", "64",
                "--train-iters", "10", "--multi-latent-attention", "--rope-type", "rope",
                "--kv-lora-rank", "512", "--qk-layernorm", "--bf16"]
    vocab = flags.index("--vocab-size") + 1  # NullTokenizer's vocabulary is one larger
    a = plan.parse_args([*CLUSTER, "--", *flags[:vocab], "102399", *flags[vocab + 1:],
                         *training])
    assert a.model_shape == LITE
    for bad, says in ((["--q-lora-rank", "64"], "--q-lora-rank needs --multi-latent-attention"),
                      (["--multi-latent-attention", "--num-query-groups", "4"], "kv heads 4"),
                      (["--multi-latent-attention", "--activation", "gelu"], "no linear biases"),
                      (["--multi-latent-attention", "--kv-channels", "64"], "--kv-channels")):
        with pytest.raises(SystemExit):
            plan.parse_args([*CLUSTER, *flags, *bad, "--global-batch", "64"])
        assert says in capsys.readouterr().err
