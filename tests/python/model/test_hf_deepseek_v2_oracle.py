"""braid's import of DeepSeek-V2 (tools/convert_hf.py) against Hugging Face transformers (CPU,
f32): a tiny random DeepseekV2ForCausalLM saved by save_pretrained and imported; logits, loss and
every parameter gradient of braid's model of the import against transformers', and greedy
decoding over braid's KV cache against transformers' generate.

The model: test_hf_deepseek_v3_oracle.py's multi-latent attention (3 layers, hidden 64, 4 heads,
a query latent of 24 or none, a key/value latent of 16, heads of 16 + 8 RoPE channels for q and
k and 12 for v), the first layer dense, then 8 experts of 32 and a shared expert of 2 x 32
(n_shared_experts 2, ungated). DeepSeek-V2's router (DeepseekV2TopkRouter): p = softmax over
all 8 experts of the router logits; topk_method greedy takes the top 3 (or 1) of p,
group_limited_greedy the top 2 among the 2 best of 4 groups of 2, a group scored by its best p;
each chosen expert weighted by its p, not renormalised, times routed_scaling_factor 2.5. braid:
moe_router_pre_softmax, moe_router_topk_scaling_factor, moe_router_num_groups / group_topk (a
group scored by its best moe_router_topk / group_topk = 1). Variants: without a query latent
(DeepSeek-V2-Lite's q_proj), with DeepSeek-V2's YaRN (factor 40, mscale = mscale_all_dim =
0.707: cos and sin unscaled, the softmax scale times g(0.707)^2), and dense.

Both sides must choose the same experts: on HF's router logits the tests check that no token's
group or expert choice is within 1e-3 of a tie (the softmax keeps the logits' order, so the
gaps are taken in logits), that every expert is chosen and that the groups change some token's
choice. Tolerances as test_hf_deepseek_v3_oracle.py's.
"""

import importlib.util
import math
import os

import numpy as np
import pytest
import torch
import transformers

import braid
from braid.generate import config_from_metadata
from hf_oracle import (assert_fields_matter, assert_greedy_decoding_matches_generate, batch,
                       compare_logits_loss_and_gradients, deepseek_grads, deepseek_mla_config,
                       eager_model, moe_routers)

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..")
_spec = importlib.util.spec_from_file_location(
    "convert_hf", os.path.join(ROOT, "tools", "convert_hf.py"))
convert_hf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(convert_hf)

LOGITS_RTOL = 1e-5
GRAD_RTOL = 1e-4
MARGIN = 1e-3  # the least gap between a token's last chosen and first unchosen group or expert
LAYERS, HIDDEN, HEADS, VOCAB, POSITIONS = 3, 64, 4, 97, 64
Q_RANK, KV_RANK, NOPE, ROPE, V_DIM = 24, 16, 16, 8, 12
EXPERTS, TOPK, FFN, SCALE = 8, 3, 32, 2.5
GROUPED = {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
           "num_experts_per_tok": 2}
# DeepSeek-V2's and -V2-Lite's (their rope_scaling, as transformers 5 holds it)
V2_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40, "mscale": 0.707,
           "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096, "beta_fast": 32,
           "beta_slow": 1}

# (HF config fields beyond the shared ones, seed: one whose routing of batch(97) has no near tie)
KINDS = {
    "greedy": ({}, 2),
    # DeepSeek-V2-Lite's queries: q_proj from the hidden state
    "greedy-no-q-latent": ({"q_lora_rank": None}, 0),
    "grouped": (GROUPED, 0),
    "grouped-no-q-latent": ({**GROUPED, "q_lora_rank": None}, 0),
    "top-1": ({"num_experts_per_tok": 1}, 2),
    # DeepSeek-V2-Lite's: no query latent, YaRN
    "yarn": ({"q_lora_rank": None, "rope_parameters": V2_YARN}, 0),
    # no layer has experts: braid's model is dense; tied embeddings
    "dense": ({"first_k_dense_replace": LAYERS, "tie_word_embeddings": True}, 0),
}


def hf_config(**fields):
    router = dict(moe_intermediate_size=FFN, n_routed_experts=EXPERTS, num_experts_per_tok=TOPK,
                  topk_method="greedy", n_group=1, topk_group=1, n_shared_experts=2,
                  first_k_dense_replace=1, routed_scaling_factor=SCALE)
    return deepseek_mla_config(transformers.DeepseekV2Config, LAYERS, HIDDEN, HEADS, VOCAB,
                               POSITIONS, Q_RANK, KV_RANK, NOPE, ROPE, V_DIM,
                               **{**router, **fields})


def random_deepseek_v2(kind, seed=None, **hf_fields):
    """An HF DeepseekV2ForCausalLM of `kind` (f32, eager attention, norms off their init, routers
    wide). `hf_fields`: more HF config; `seed`: other than KINDS'."""
    fields, kind_seed = KINDS[kind]
    torch.manual_seed(kind_seed if seed is None else seed)
    return moe_routers(eager_model(transformers.DeepseekV2ForCausalLM,
                                   hf_config(**{**fields, **hf_fields})))


def imported_model(hf, tmp_path):
    """braid's model of `hf` as convert_hf.py imports its save_pretrained directory, and the
    import's braid config."""
    hf.save_pretrained(tmp_path / "hf")
    convert_hf.import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    meta, tensors = convert_hf.read_checkpoint(str(tmp_path / "ckpt"))
    model = braid.GPTModel(config_from_metadata(meta["config"]), device="cpu", seed=1)
    params = model.parameters()
    assert sorted(params) == sorted(tensors) and not model.expert_biases()
    for name, t in tensors.items():
        params[name].copy_(np.ascontiguousarray(t.array, dtype=np.float32))
    return model, meta["config"]


# ---- DeepSeek-V2's router (transformers' DeepseekV2TopkRouter) -----------------------------------

def v2_choices(logits, groups, topk_group, topk):
    """DeepseekV2TopkRouter's choice from router logits [T, E] with `groups` (1: greedy): the
    sets of chosen experts [T, k] sorted, the least gap in logits between a token's last chosen
    and first unchosen group (a group scored by its best expert; inf where every group is
    chosen), and the same gap for its experts (inf when the chosen groups hold k experts)."""
    experts = logits.shape[1]
    allowed = torch.ones_like(logits, dtype=torch.bool)
    group_gap = float("inf")
    if 1 < groups and topk_group < groups:
        top = logits.view(-1, groups, experts // groups).max(-1).values.topk(topk_group + 1)
        group_gap = (top.values[:, topk_group - 1] - top.values[:, topk_group]).min().item()
        mask = torch.zeros(logits.shape[0], groups, dtype=torch.bool)
        allowed = mask.scatter_(1, top.indices[:, :topk_group], True).repeat_interleave(
            experts // groups, dim=1)
    top = logits.masked_fill(~allowed, float("-inf")).topk(min(topk + 1, experts))
    expert_gap = (top.values[:, topk - 1] - top.values[:, topk]).min().item() \
        if topk < int(allowed[0].sum()) else float("inf")
    return top.indices[:, :topk].sort(dim=-1).values, group_gap, expert_gap


def v2_routing(hf, router_logits):
    """(layer number, router logits (f64), the router's groups, topk_group and k) of each expert
    layer of `hf`; `router_logits` as hf(..., output_router_logits=True) returns them."""
    layers = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert len(layers) == len(router_logits or ())
    out = []
    for i, logits in zip(layers, router_logits or ()):
        gate = hf.model.layers[i].mlp.gate
        grouped = gate.topk_method == "group_limited_greedy"
        out.append((i, logits.detach().double(), gate.num_group if grouped else 1,
                    gate.topk_group if grouped else 1, gate.top_k))
    return out


def v2_routing_margin(hf, router_logits):
    """The least gap, over every token of every expert layer, between the last chosen and the
    first unchosen group or expert (v2_choices)."""
    margin = float("inf")
    for _, logits, groups, topk_group, topk in v2_routing(hf, router_logits):
        _, group_gap, expert_gap = v2_choices(logits, groups, topk_group, topk)
        margin = min(margin, group_gap, expert_gap)
    return margin


def check_v2_routing(hf, router_logits, margin=MARGIN):
    """On every expert layer: no token's group or expert choice within `margin` of a tie, every
    expert chosen, and with groups the choice greedy's: with topk_group = k (what braid holds) no
    group can hold an expert of the greedy top k and be left out, as k other groups would each
    hold a better expert."""
    for i, logits, groups, topk_group, topk in v2_routing(hf, router_logits):
        chosen, group_gap, expert_gap = v2_choices(logits, groups, topk_group, topk)
        assert group_gap > margin, f"layer {i}: a near tie among the groups ({group_gap:.1e})"
        assert expert_gap > margin, f"layer {i}: a near tie among the experts ({expert_gap:.1e})"
        counts = torch.bincount(chosen.reshape(-1), minlength=logits.shape[1])
        assert (counts > 0).all(), f"layer {i}: experts chosen {counts.tolist()}"
        if groups > 1:
            assert topk_group == topk
            assert torch.equal(v2_choices(logits, 1, 1, topk)[0], chosen), f"layer {i}"


# ---- the tests -----------------------------------------------------------------------------------

def g(m):  # YaRN's get_mscale at factor 40
    return 0.1 * m * math.log(40) + 1.0


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_logits_loss_and_gradients(tmp_path, kind):
    hf = random_deepseek_v2(kind)
    model, c = imported_model(hf, tmp_path)
    hc = hf.config
    assert c["multi_latent_attention"] and c["q_lora_rank"] == (hc.q_lora_rank or 0)
    attn = hf.model.layers[0].self_attn
    assert (attn.q_proj is None) == (hc.q_lora_rank is not None)
    if kind == "dense":
        assert not c.get("num_experts") and not model.config.num_experts
    else:
        grouped = hc.topk_method == "group_limited_greedy"
        assert (c["moe_router_score_function"], c["moe_router_pre_softmax"],
                c["moe_router_enable_expert_bias"]) == ("softmax", True, False)
        assert (c["num_experts"], c["moe_router_topk"], c["moe_router_topk_scaling_factor"]) == (
            EXPERTS, hc.num_experts_per_tok, SCALE)
        assert (c["moe_router_num_groups"], c["moe_router_group_topk"]) == (
            (4, 2) if grouped else (0, 0))
        assert (c["moe_shared_expert_intermediate_size"], c["moe_layers"]) == (2 * FFN,
                                                                               [0, 1, 1])
    if hc.rope_parameters["rope_type"] == "yarn":
        # transformers' factors on cos and sin (complex freqs_cis) and on the softmax scale are
        # braid's: g(0.707) / g(0.707) = 1 and g(0.707)^2
        assert hf.model.rotary_emb.attention_scaling == pytest.approx(1.0, rel=1e-12)
        assert model.config.rope_attention_factor == pytest.approx(1.0, rel=1e-7)
        assert model.config.softmax_scale_factor == pytest.approx(g(0.707) ** 2, rel=1e-6)
        assert attn.scaling == pytest.approx(g(0.707) ** 2 * (NOPE + ROPE) ** -0.5, rel=1e-12)
    else:
        assert attn.scaling == (NOPE + ROPE) ** -0.5
    assert attn.kv_a_layernorm.variance_epsilon == 1e-6
    ids, targets = batch(VOCAB)
    out = hf(torch.from_numpy(ids), labels=torch.from_numpy(ids), output_router_logits=True)
    check_v2_routing(hf, out.router_logits)
    err, grad_err, got = compare_logits_loss_and_gradients(model, hf, out, ids, targets,
                                                           deepseek_grads, LOGITS_RTOL, GRAD_RTOL)
    for name in got:  # every parameter takes part
        assert np.abs(got[name]).max() > 0, name
    print(f"{kind}: logits {err:.1e}, gradients {grad_err:.1e} (max relative error)")


def test_transformers_ignores_norm_topk_prob():
    # DeepseekV2TopkRouter never renormalises the top k (DeepSeek's own code does where
    # norm_topk_prob is true): the import follows transformers, and does not read the field.
    ids, _ = batch(VOCAB)
    with torch.no_grad():
        want = random_deepseek_v2("greedy")(torch.from_numpy(ids)).logits
        got = random_deepseek_v2("greedy", norm_topk_prob=True)(torch.from_numpy(ids)).logits
    assert torch.equal(got, want)


@pytest.mark.parametrize("kind,other", [
    ("greedy", {"routed_scaling_factor": 1.0}),
    ("yarn", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
], ids=["scaling", "yarn"])
def test_the_compared_fields_matter(tmp_path, kind, other):
    # braid's import computes HF's logits, and HF's model of the same weights with `other` logits
    # far beyond the tolerance: the comparison checks what those fields change.
    hf, changed = random_deepseek_v2(kind), random_deepseek_v2(kind, **other)
    model, _ = imported_model(hf, tmp_path)
    assert_fields_matter(model, hf, changed, VOCAB, LOGITS_RTOL)


NEW_TOKENS = 20
# kind -> a seed whose every decoding step's choice and routing is clear
DECODE_SEEDS = {"greedy-no-q-latent": 0, "grouped": 3, "yarn": 1}


@pytest.mark.parametrize("kind", sorted(DECODE_SEEDS))
def test_greedy_decoding_over_the_kv_cache_matches_generate(tmp_path, kind):
    # braid's decode fills its cache with the prompt, then one token a step: every step's logits
    # are transformers' (over its own cache) and the tokens chosen the same; every step's choice
    # and every token's routing clear, so the test is exact (assert_greedy_decoding_matches_
    # generate). Weights drawn wider than transformers' init (std 0.02): logits of a few units,
    # whose top two are apart.
    hf = random_deepseek_v2(kind, seed=DECODE_SEEDS[kind], initializer_range=0.1)
    model, _ = imported_model(hf, tmp_path)
    _, err = assert_greedy_decoding_matches_generate(hf, model, VOCAB, NEW_TOKENS,
                                                     v2_routing_margin, MARGIN, LOGITS_RTOL)
    print(f"{kind}: decode logits {err:.1e} (max relative error)")
