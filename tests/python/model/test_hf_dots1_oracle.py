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
from hf_oracle import (assert_close_rel, batch, braid_grads, eager_model, experts_to_braid,
                       load_into_braid)

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
    hf = eager_model(model_class, hf_cfg, biases=True)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):  # decisive logits, as moe_routers
                p.normal_(0.0, 0.2)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, bias_std)
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
    load_into_braid(model, to_braid({n: p.detach().clone() for n, p in hf.named_parameters()},
                                    cfg.num_experts))
    biases = model.expert_biases()
    assert sorted(biases) == [f"model.layers.{i}.mlp.gate.e_score_correction_bias"
                              for i in (1, 2)]
    for name, b in hf.named_buffers():
        if name.endswith("e_score_correction_bias"):
            biases[name].copy_(b.numpy().copy())
    return hf, model


def to_braid(state, experts):
    """HF names -> braid's: the experts split, mlp.shared_experts -> mlp.shared_expert."""
    state = experts_to_braid(state, experts, FFN)
    return {n.replace("mlp.shared_experts.", "mlp.shared_expert."): t for n, t in state.items()}


def choices(logits, bias, groups=GROUPS, topk_group=TOPK_GROUP):
    """transformers' Dots1TopkRouter choice from router logits [T, E] (bias [E]): the sets of
    chosen experts [T, k] sorted, the least group margin and the least expert margin."""
    experts = logits.shape[1]
    scores = logits.sigmoid() + bias
    by_group = scores.view(-1, groups, experts // groups)
    group_scores = by_group.topk(2, dim=-1).values.sum(-1)
    top_groups = group_scores.topk(topk_group + 1 if topk_group < groups else groups, dim=-1)
    group_gap = (top_groups.values[:, topk_group - 1] - top_groups.values[:, topk_group]).min() \
        if topk_group < groups else torch.tensor(float("inf"))
    mask = torch.zeros_like(group_scores).scatter_(1, top_groups.indices[:, :topk_group], 1)
    mask = mask.repeat_interleave(experts // groups, dim=1).bool()
    masked = scores.masked_fill(~mask, float("-inf"))
    top = masked.topk(TOPK + 1, dim=-1)
    expert_gap = (top.values[:, TOPK - 1] - top.values[:, TOPK]).min()
    return top.indices[:, :TOPK].sort(dim=-1).values, group_gap.item(), expert_gap.item()


def check_routing(hf, router_logits):
    """No near tie on any layer, every expert chosen, and the bias and the groups each change
    some token's choice."""
    layers = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert layers == [1, 2] and len(router_logits) == 2
    for i, logits in zip(layers, router_logits):
        logits = logits.detach()
        bias = hf.model.layers[i].mlp.gate.e_score_correction_bias
        chosen, group_gap, expert_gap = choices(logits, bias)
        assert group_gap > MARGIN, f"layer {i}: a near tie among the groups ({group_gap:.1e})"
        assert expert_gap > MARGIN, f"layer {i}: a near tie among the experts ({expert_gap:.1e})"
        # 2 experts per group: the top 4 of 2 groups is all of them (no choice within)
        assert math.isfinite(expert_gap) == (logits.shape[1] // GROUPS * TOPK_GROUP > TOPK)
        counts = torch.bincount(chosen.reshape(-1), minlength=logits.shape[1])
        assert (counts > 0).all(), f"layer {i}: experts chosen {counts.tolist()}"
        unbiased, _, _ = choices(logits, torch.zeros_like(bias))
        assert (unbiased != chosen).any(), f"layer {i}: the bias changes no token's choice"
        ungrouped, _, _ = choices(logits, bias, groups=1, topk_group=1)
        assert (ungrouped != chosen).any(), f"layer {i}: the groups change no token's choice"


def hf_grads(hf):
    return to_braid({n: p.grad for n, p in hf.named_parameters()}, hf.config.n_routed_experts)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_logits_loss_and_gradients(kind):
    hf, model = sigmoid_moe_pair(kind)
    ids, targets = batch(VOCAB)
    out = hf(torch.from_numpy(ids), labels=torch.from_numpy(ids), output_router_logits=True)
    check_routing(hf, out.router_logits)
    logits = np.from_dlpack(model.logits(ids))
    assert logits.shape == out.logits.shape
    err = assert_close_rel("logits", logits, out.logits.detach().numpy(), LOGITS_RTOL)
    loss = model.forward(ids, targets)
    model.backward()
    out.loss.backward()
    assert abs(loss - out.loss.item()) <= 1e-5 * abs(out.loss.item()), (loss, out.loss.item())
    got, want = braid_grads(model), hf_grads(hf)
    assert sorted(got) == sorted(want)
    grad_err = max(assert_close_rel(name, got[name], g.numpy(), GRAD_RTOL)
                   for name, g in want.items())
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
