"""Multi-latent attention in the planner (braid.planner_mla; braid.planner, planner_inputs) and
tools/plan.py, the deepseek-v3 / deepseek-v2-lite presets, and selective recomputation of its up
projections (--recompute-modules mla_up_proj)."""

import dataclasses
import json
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
# DeepSeek-V2-Lite as plan.py's flags, and as a pretrain_gpt.py run's arguments (NullTokenizer's
# vocabulary is one larger than --vocab-size)
LITE_FLAGS = ["--num-layers", "27", "--hidden-size", "2048", "--num-attention-heads", "16",
              "--ffn-hidden-size", "10944", "--vocab-size", "102400", "--seq-length", "4096",
              "--num-experts", "64", "--moe-router-topk", "6", "--moe-ffn-hidden-size", "1408",
              "--moe-shared-expert-intermediate-size", "2816", "--moe-layer-freq", "[0]+[1]*26"]
LITE_TRAINING = [
    *LITE_FLAGS[:LITE_FLAGS.index("--vocab-size") + 1], "102399",
    *LITE_FLAGS[LITE_FLAGS.index("--vocab-size") + 2:], "--swiglu",
    "--untie-embeddings-and-output-weights", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--disable-bias-linear", "--max-position-embeddings",
    "4096", "--tokenizer-type", "NullTokenizer", "--data-path", "data/x", "--micro-batch-size",
    "1", "--global-batch-size", "64", "--train-iters", "10", "--multi-latent-attention",
    "--rope-type", "rope", "--kv-lora-rank", "512", "--qk-layernorm", "--bf16"]


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
    flags = LITE_FLAGS
    a = plan.parse_args([*CLUSTER, *flags, "--multi-latent-attention", "--kv-lora-rank", "512",
                         "--qk-layernorm", "--global-batch", "64"])
    assert a.model_shape == LITE
    a = plan.parse_args([*CLUSTER, "--", *LITE_TRAINING])
    assert a.model_shape == LITE
    for bad, says in ((["--q-lora-rank", "64"], "--q-lora-rank needs --multi-latent-attention"),
                      (["--multi-latent-attention", "--num-query-groups", "4"], "kv heads 4"),
                      (["--multi-latent-attention", "--activation", "gelu"], "no linear biases"),
                      (["--multi-latent-attention", "--kv-channels", "64"], "--kv-channels")):
        with pytest.raises(SystemExit):
            plan.parse_args([*CLUSTER, *flags, *bad, "--global-batch", "64"])
        assert says in capsys.readouterr().err


# ---- selective recomputation of the up projections (--recompute-modules mla_up_proj) -------

H100_2048 = planner.Cluster(planner.GPUS["h100-80g"], 8, 2048, 450e9, 400e9 / 8)
H100_16 = dataclasses.replace(H100, num_gpus=16)


def _up(lay):
    return dataclasses.replace(lay, recompute_mla_up_proj=True)


def test_mla_up_proj_keeps_k_pe_in_place_of_q_k_and_v():
    # tests/cpp/model/test_recompute.cpp's bytes: 3·T·(n/t)·D·2 less a layer, the rotated k_pe
    # T·Dr·2 more (every token's: gathered under SP), dense and expert layers alike.
    T = 2 * 4096
    for shape in (V3, LITE):
        n, d, dr = shape.num_attention_heads, shape.head_dim, shape.qk_pos_emb_head_dim
        for t, sp in ((1, False), (2, False), (2, True), (8, True)):
            lay = planner.Layout(t, 1, 64 // t, 2, recompute="selective", sequence_parallel=sp)
            for layer in (0, 5):
                plain = planner.layer_activation_bytes(shape, lay, layer=layer)
                up = planner.layer_activation_bytes(shape, _up(lay), layer=layer)
                assert plain - up == pytest.approx(3 * T * (n // t) * d * 2 - T * dr * 2,
                                                   rel=1e-12)
    # DeepSeek-V3: 73,728 values a token and layer less, for k_pe's 64 (docs/memory.md)
    assert planner_mla.up_saved_bytes(V3) == 2 * (3 * 128 * 192 - 64)
    # PP 1: every layer's drop once, in the rank's activations
    lay = planner.Layout(2, 1, 8, 1, 1, "selective", True, True, ep=8)
    parts = [planner.memory(LITE, H100_16, x, 4)[1]["activations"] for x in (lay, _up(lay))]
    assert (parts[0] - parts[1]) * planner.GB == pytest.approx(27 * 4096 * (3 * 2 * 8 * 192 - 128),
                                                               rel=1e-12)


def test_mla_up_proj_needs_mla_and_selective():
    llama = planner.PRESETS["llama2-70b"]
    with pytest.raises(ValueError, match="mla_up_proj needs --multi-latent-attention"):
        planner.check_layout(llama, H100, _up(planner.Layout(8, 4, 2, 1, 2, "selective")), 64)
    for rec in ("none", "full"):
        with pytest.raises(ValueError, match=f"needs recompute selective, not {rec}"):
            planner.check_layout(LITE, H100, _up(planner.Layout(2, 1, 32, 1, recompute=rec,
                                                                ep=8)), 64)
    # Under none and full the flag's bytes and seconds are not counted (were it let through).
    for rec in ("none", "full"):
        lay = planner.Layout(2, 1, 32, 1, recompute=rec, sequence_parallel=True)
        assert planner.layer_activation_bytes(V3, _up(lay), layer=5) == \
            planner.layer_activation_bytes(V3, lay, layer=5)
        assert planner.layer_cost(V3, H100, _up(lay), 5) == planner.layer_cost(V3, H100, lay, 5)


def test_mla_up_proj_reruns_the_up_projections_in_the_backward():
    T, gpu = 4096, H100.gpu
    for shape, t, sp in ((V3, 1, False), (V3, 2, True), (LITE, 2, False), (LITE, 2, True)):
        lay = planner.Layout(t, 1, 64 // t, 1, recompute="selective", sequence_parallel=sp)
        plain, up = (planner.layer_cost(shape, H100, x, 5) for x in (lay, _up(lay)))
        n, q_in = shape.num_attention_heads // t, shape.q_lora_rank or shape.hidden_size
        # q_b_proj (or q_proj on the normed input) and kv_b_proj forward, on every token
        gemms = planner._gemm_time(gpu, T, n * 192, q_in) + \
            planner._gemm_time(gpu, T, n * 256, 512)
        # RoPE on the queries' 64 channels, the keys' assembly, the values' (zeros and copy)
        nbytes = n * (4 * 64 + (4 * 128 + 2 * 64) + (2 * 192 + 4 * 128)) + 2 * 64
        seconds = gemms + planner._bytes_time(gpu, nbytes * T, 5)
        if sp and not shape.q_lora_rank:  # q_proj's input gathered again
            seconds += planner._ring(2 * T * 2048, t, *planner._link(H100, t), "all_gather")
        assert (up.forward, up.model_flops) == (plain.forward, plain.model_flops)
        assert up.backward - plain.backward == pytest.approx(seconds, rel=1e-12)
        assert up.rerun_flops == 2 * T * n * (192 * q_in + 256 * 512)
        assert plain.rerun_flops == 0.0
    # Without a query latent under SP the all-gather is the difference from no SP at t 2.
    no_sp, sp = (planner_mla.up_recompute_s(LITE, H100, _up(planner.Layout(
        2, 1, 32, 1, recompute="selective", sequence_parallel=x)), T) for x in (False, True))
    assert sp - no_sp == pytest.approx(
        planner._ring(2 * T * 2048, 2, *planner._link(H100, 2), "all_gather"), rel=1e-12)


def test_hfu_counts_the_rerun_and_mfu_does_not():
    lay = planner.Layout(2, 1, 8, 1, 1, "selective", True, True, ep=8)
    for depths in (0, 1):  # an MTP depth's layer reruns them too
        shape = dataclasses.replace(LITE, mtp_num_layers=depths)
        plain, up = (planner.predict(shape, H100_16, x, 32) for x in (lay, _up(lay)))
        assert up["step_time_s"] > plain["step_time_s"]
        assert up["memory_gb_per_gpu"] < plain["memory_gb_per_gpu"]
        peak = H100.gpu.peak_tflops * 1e12 * 16
        model = [r["mfu"] * r["step_time_s"] * peak for r in (plain, up)]
        assert model[1] == pytest.approx(model[0], rel=1e-12)
        assert plain["hfu"] == plain["mfu"]
        rerun = (up["hfu"] - up["mfu"]) * up["step_time_s"] * peak
        per_token = 2 * 16 * (192 * 2048 + 256 * 512)  # q_proj, kv_b_proj: every head
        assert rerun == pytest.approx((27 + depths) * 32 * 4096 * per_token, rel=1e-9)


def test_search_picks_mla_up_proj_where_selective_does_not_fit():
    # docs/planner.md's DeepSeek-V3 run at TP 2, PP 16 (3 | 4 ... | 2), EP 16 whole experts:
    # selective needs 80.8 GB on the second rank (4 layers, 15 microbatches in flight), 18.1 GB
    # less with the up projections recomputed, which is then the fastest that fits.
    fixed = dict(tp=2, pp=16, micro_batch_size=1, virtual_stages=1, sequence_parallel=True,
                 zero=True, ep=16, etp=1, first_stage_layers=3, last_stage_layers=2)
    rows, _ = planner.search(V3, H100_2048, 4096, fixed)
    best = rows[0]
    assert best.get("recompute_mla_up_proj") and best["recompute"] == "selective"
    assert not any(r["recompute"] in ("none", "selective") and not r.get("recompute_mla_up_proj")
                   for r in rows)
    lay = planner.Layout(2, 16, 64, 1, 1, "selective", True, True, first_stage_layers=3,
                         last_stage_layers=2, ep=16, etp=1)
    plain = planner.memory(V3, H100_2048, lay, 64)[0]
    assert plain > 80 >= best["memory_gb_per_gpu"]
    drop = 4 * 15 * 4096 * (3 * 2 * 64 * 192 - 2 * 64) / planner.GB
    assert plain - best["memory_gb_per_gpu"] == pytest.approx(drop, rel=1e-12)
    assert all(r["step_time_s"] > best["step_time_s"] for r in rows[1:])  # full, block
    # A fixed selective is plain, as pretrain_gpt.py's: nothing fits; asked for, the best.
    assert planner.search(V3, H100_2048, 4096, dict(fixed, recompute="selective"))[0] == []
    asked, _ = planner.search(V3, H100_2048, 4096, dict(fixed, recompute="selective",
                                                         recompute_mla_up_proj=True))
    assert asked == [best]
    # Where both fit (2 | 4 ... | 3: 77.3 GB) plain selective is faster, and first.
    rows, _ = planner.search(V3, H100_2048, 4096, dict(fixed, first_stage_layers=2,
                                                       last_stage_layers=3))
    assert [r.get("recompute_mla_up_proj", False) for r in rows[:2]] == [False, True]
    assert rows[0]["recompute"] == rows[1]["recompute"] == "selective"
    assert rows[0]["memory_gb_per_gpu"] > rows[1]["memory_gb_per_gpu"]


def test_search_adds_mla_up_proj_rows_only_for_mla_and_keeps_the_others():
    fixed = dict(tp=2, pp=1, micro_batch_size=1, virtual_stages=1)
    both, _ = planner.search(LITE, H100_16, 32, fixed)
    plain, _ = planner.search(LITE, H100_16, 32, dict(fixed, recompute_mla_up_proj=False))
    up = [r for r in both if r.get("recompute_mla_up_proj")]
    assert up and all(r["recompute"] == "selective" for r in up)
    assert [r for r in both if not r.get("recompute_mla_up_proj")] == plain
    llama = planner.PRESETS["llama2-70b"]
    rows, _ = planner.search(llama, H100, 64, dict(tp=8, pp=4, micro_batch_size=1))
    assert rows and {r["recompute"] for r in rows} >= {"selective"}
    assert not any("recompute_mla_up_proj" in r for r in rows)


def test_plan_cli_takes_recompute_modules_mla_up_proj(capsys):
    v3 = [*CLUSTER, "--model", "deepseek-v3", "--global-batch", "64"]
    a = plan.parse_args([*v3, "--recompute", "selective", "--recompute-modules", "mla_up_proj"])
    assert a.recompute_mla_up_proj is True
    for given in ([], ["--recompute", "selective"],
                  ["--recompute", "selective", "--recompute-modules", "core_attn", "layernorm"]):
        assert plan.parse_args([*v3, *given]).recompute_mla_up_proj is None
    for bad, says in (
            (["--recompute-modules", "mla_up_proj"],
             "--recompute-modules needs --recompute selective"),
            (["--recompute", "full", "--recompute-modules", "mla_up_proj"],
             "--recompute-modules needs --recompute selective"),
            (["--recompute", "selective", "--recompute-modules", "mlp"],
             "--recompute-modules mlp: braid's selective recomputation"),
            (["--model", "llama3-8b", "--recompute", "selective", "--recompute-modules",
              "mla_up_proj"], "--recompute-modules mla_up_proj needs --multi-latent-attention")):
        with pytest.raises(SystemExit):
            plan.parse_args([*v3, *bad])
        assert says in capsys.readouterr().err
    assert plan.recompute(dict(recompute="selective", recompute_mla_up_proj=True)) == \
        "selective+up"
    fixed = ["--model", "deepseek-v2-lite", "--global-batch", "32", "--tp", "2", "--pp", "1",
             "--micro-batch-size", "1", "--virtual-stages", "1", "--sequence-parallel", "true",
             "--zero", "true", "--expert-model-parallel-size", "8", "--expert-tensor-parallel-size",
             "2", "--recompute", "selective"]
    assert plan.main([*CLUSTER, *fixed, "--recompute-modules", "mla_up_proj"]) == 0
    rows = capsys.readouterr().out.splitlines()[2:]
    assert len(rows) == 1 and rows[0].split()[8] == "selective+up"
    assert plan.main([*CLUSTER, *fixed]) == 0
    assert capsys.readouterr().out.splitlines()[2].split()[8] == "selective"
    # nothing fits: the smallest layout is said with it
    assert plan.main([*v3, "--tp", "8", "--pp", "2", "--recompute", "selective",
                      "--recompute-modules", "mla_up_proj"]) == 1
    assert "recompute selective+up ZeRO" in capsys.readouterr().err


def test_plan_cli_reads_recompute_modules_from_the_training_arguments(capsys):
    run = [*LITE_TRAINING, "--tensor-model-parallel-size", "2", "--sequence-parallel",
           "--expert-model-parallel-size", "8", "--recompute-granularity", "selective"]
    out = {}
    for up in (False, True):
        modules = ["--recompute-modules", "mla_up_proj"] if up else []
        a = plan.parse_args([*CLUSTER, "--", *run, *modules])
        assert a.recompute_mla_up_proj is (True if up else None)
        assert plan.main([*CLUSTER, "--json", "--", *run, *modules]) == 0
        rows = json.loads(capsys.readouterr().out)
        assert len(rows) == 1 and rows[0].get("recompute_mla_up_proj", False) is up
        out[up] = rows[0]
    drop = 27 * 4096 * (3 * 2 * 8 * 192 - 128) / planner.GB  # pp 1: one microbatch kept
    acts = [out[x]["memory_parts_gb"]["activations"] for x in (False, True)]
    assert acts[0] - acts[1] == pytest.approx(drop, rel=1e-12)
    assert out[True]["step_time_s"] > out[False]["step_time_s"]
    with pytest.raises(SystemExit):  # the layout after -- is the run's own
        plan.parse_args([*CLUSTER, "--recompute-modules", "mla_up_proj", "--", *run])
    assert "with training arguments after --" in capsys.readouterr().err
