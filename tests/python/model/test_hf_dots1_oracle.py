"""braid's DeepSeek-V3-style routing against Hugging Face transformers (CPU, f32) with identical
weights: logits, loss and every parameter gradient of Dots1ForCausalLM (Qwen3's attention, the
first layer dense, then 8 experts in 4 groups: sigmoid scores, the top 4 of scores +
e_score_correction_bias among the best 2 groups, weights renormalised and scaled by
routed_scaling_factor 2.5, plus an ungated shared expert) and Glm4MoeForCausalLM (the same MoE on
attention with q, k, v biases, RoPE on half of each head and optional q/k norms). With 2 experts
per group, the top 4 of 2 groups is both experts of each: a variant with 16 experts (4 per group)
makes the choice within the groups matter too.

braid: moe_router_score_function sigmoid, moe_router_enable_expert_bias (expert_biases() holds
HF's e_score_correction_bias), moe_router_num_groups / group_topk, moe_router_topk_scaling_factor,
moe_shared_expert_intermediate_size without a gate, moe_layers [0, 1, 1].

Both sides must choose the same experts: the tests check on HF's router logits that no token's
group choice and no token's expert choice is near a tie, that every expert of every layer is
chosen (so every expert's gradient is compared), and that the bias and the groups each change some
token's choice (so that a router ignoring either fails). Tolerances as test_hf_moe_oracle.py's.
"""

import math

import numpy as np
import pytest
import torch
import transformers

import braid
from hf_oracle import (batch, check_deepseek_routing, compare_logits_loss_and_gradients,
                       deepseek_grads, deepseek_routers, eager_model, load_deepseek_into_braid)

LOGITS_RTOL = 1e-5
GRAD_RTOL = 1e-4
MARGIN = 1e-3  # the least gap between a token's last chosen and first unchosen group or expert
TOPK, GROUPS, TOPK_GROUP, FFN, SCALE = 4, 4, 2, 32, 2.5
LAYERS, HIDDEN, HEADS, KV_HEADS, VOCAB = 3, 64, 4, 2, 97

# (transformers' class, its config fields beyond the shared ones, braid's fields beyond them,
# seed: one whose routing of batch(97) has no near tie)
KINDS = {
    "dots1": (transformers.Dots1ForCausalLM, transformers.Dots1Config, {}, {"qk_layernorm": True},
              0),
    "dots1-16-experts": (transformers.Dots1ForCausalLM, transformers.Dots1Config,
                         {"n_routed_experts": 16}, {"qk_layernorm": True, "num_experts": 16}, 1),
    # a window of 5 keys on the middle layer (layer_types; braid's window_size is one less)
    "dots1-window": (transformers.Dots1ForCausalLM, transformers.Dots1Config, {
        "sliding_window": 5, "layer_types": ["full_attention", "sliding_attention",
                                             "full_attention"]},
        {"qk_layernorm": True, "window_size": 4, "window_layers": [0, 1, 0]}, 0),
    # GLM-4.5's attention: q, k, v biases (no o_proj bias), RoPE on the first half of each head
    "glm4_moe": (transformers.Glm4MoeForCausalLM, transformers.Glm4MoeConfig, {
        "attention_bias": True, "use_qk_norm": False},
        {"add_qkv_bias": True, "rotary_percent": 0.5}, 0),
    "glm4_moe-qk-norm": (transformers.Glm4MoeForCausalLM, transformers.Glm4MoeConfig, {
        "attention_bias": True, "use_qk_norm": True},
        {"add_qkv_bias": True, "qk_layernorm": True, "rotary_percent": 0.5}, 0),
}


def sigmoid_moe_pair(kind, bias_std=0.1, **fields):
    """An HF model of `kind` (first layer dense, intermediate_size 4 x hidden; the others
    8 (or 16) experts of FFN, n_shared_experts 1) with wide router weights and a random
    e_score_correction_bias, and braid's copy of it. `fields`: more braid config."""
    model_class, config_class, hf_fields, braid_fields, seed = KINDS[kind]
    torch.manual_seed(seed)
    hf_fields = {"n_routed_experts": 8, **hf_fields}
    hf_cfg = config_class(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
        moe_intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS, max_position_embeddings=64,
        num_experts_per_tok=TOPK, n_group=GROUPS,
        topk_group=TOPK_GROUP, n_shared_experts=1, first_k_dense_replace=1,
        norm_topk_prob=True, routed_scaling_factor=SCALE, rms_norm_eps=1e-6,
        tie_word_embeddings=False, **hf_fields)
    hf = deepseek_routers(eager_model(model_class, hf_cfg, biases=True), bias_std)
    cfg = braid.TransformerConfig.preset("llama-tiny")
    cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads = LAYERS, HIDDEN, HEADS
    cfg.num_query_groups, cfg.ffn_hidden_size = KV_HEADS, 4 * HIDDEN
    cfg.vocab_size, cfg.max_position_embeddings = VOCAB, 64
    cfg.norm_eps, cfg.rope_theta, cfg.tie_embeddings = 1e-6, 10000.0, False
    cfg.num_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size = 8, TOPK, FFN
    cfg.moe_router_score_function, cfg.moe_router_enable_expert_bias = "sigmoid", True
    cfg.moe_router_num_groups, cfg.moe_router_group_topk = GROUPS, TOPK_GROUP
    cfg.moe_router_topk_scaling_factor = SCALE
    cfg.moe_shared_expert_intermediate_size, cfg.moe_layers = FFN, [0, 1, 1]
    for name, value in {**braid_fields, **fields}.items():
        setattr(cfg, name, value)
    model = braid.GPTModel(cfg, device="cpu", seed=1)
    load_deepseek_into_braid(model, hf)
    assert sorted(model.expert_biases()) == [f"model.layers.{i}.mlp.gate.e_score_correction_bias"
                                             for i in (1, 2)]
    return hf, model


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_logits_loss_and_gradients(kind):
    hf, model = sigmoid_moe_pair(kind)
    ids, targets = batch(VOCAB)
    out = hf(torch.from_numpy(ids), labels=torch.from_numpy(ids), output_router_logits=True)
    expert_gaps = check_deepseek_routing(hf, out.router_logits, MARGIN)
    assert list(expert_gaps) == [1, 2]
    for gap in expert_gaps.values():
        # 2 experts per group: the top 4 of 2 groups is all of them (no choice within)
        assert math.isfinite(gap) == (hf.config.n_routed_experts // GROUPS * TOPK_GROUP > TOPK)
    err, grad_err, got = compare_logits_loss_and_gradients(model, hf, out, ids, targets,
                                                           deepseek_grads, LOGITS_RTOL, GRAD_RTOL)
    for name in ("model.layers.1.mlp.gate.weight", "model.layers.0.mlp.down_proj.weight",
                 "model.layers.2.mlp.shared_expert.up_proj.weight",
                 "model.layers.2.mlp.experts.7.up_proj.weight"):
        assert np.abs(got[name]).max() > 0, name
    print(f"{kind}: logits {err:.1e}, gradients {grad_err:.1e} (max relative error)")


@pytest.mark.parametrize("what,fields", [
    ("the bias", {}), ("the groups", {"moe_router_num_groups": 0, "moe_router_group_topk": 0}),
    ("the scaling", {"moe_router_topk_scaling_factor": 1.0})])
def test_each_routing_feature_changes_the_logits(what, fields):
    # braid without one of them computes other logits, far beyond the tolerance above: the
    # comparison with transformers checks each.
    ids, _ = batch(VOCAB)
    _, model = sigmoid_moe_pair("dots1")
    _, other = sigmoid_moe_pair("dots1", **fields)
    if what == "the bias":
        for b in other.expert_biases().values():
            b.copy_(np.zeros(8, dtype=np.float32))
    a, b = np.from_dlpack(model.logits(ids)), np.from_dlpack(other.logits(ids))
    assert np.abs(a - b).max() > 100 * LOGITS_RTOL * np.abs(a).max(), what
