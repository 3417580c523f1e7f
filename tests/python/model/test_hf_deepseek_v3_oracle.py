"""braid's multi-latent attention against Hugging Face transformers (CPU, f32) with identical
weights: logits, loss and every parameter gradient of DeepseekV3ForCausalLM, and greedy
decoding over braid's KV cache against transformers' generate.

The model: 3 layers, hidden 64, 4 heads; queries through a latent of 24 (q_a_proj,
q_a_layernorm, q_b_proj), keys and values from one of 16 (kv_a_proj_with_mqa, kv_a_layernorm,
kv_b_proj); each query and key head 16 channels without position (qk_nope_head_dim) then 8 turned
by RoPE in interleaved pairs (qk_rope_head_dim; the key's one per token, shared by the heads),
each value head 12 wide (v_head_dim, narrower than the 24 of q and k on purpose: braid pads the
values to run its attention); softmax scale 1/sqrt(24). The first layer dense, then 8 experts
in 4 groups routed as test_hf_dots1_oracle.py's (sigmoid scores, the top 4 of scores +
e_score_correction_bias among the best 2 groups, renormalised, scaled by 2.5, an ungated shared
expert). Variants: DeepSeek-V2-Lite's queries straight from the hidden state (q_lora_rank null:
q_proj), a dense model (first_k_dense_replace = the layer count: no experts anywhere), and YaRN
RoPE (rope_type yarn, factor 40 as DeepSeek-V3's; over the 4 frequency pairs of 8 RoPE channels
the original context picks which keep their frequency, which are divided by the factor and which
blend the two): DeepSeek-V3's mscale = mscale_all_dim = 1 (cos and sin unscaled, the softmax
scale times g(1)^2, g(m) = 0.1 m ln 40 + 1), mscale 0.8 with mscale_all_dim 0.6 (cos and sin
times g(0.8) / g(0.6) as well), and neither (cos and sin times g(1), the softmax scale as it is).

braid: multi_latent_attention, q_lora_rank (0 for null), kv_lora_rank, qk_head_dim,
qk_pos_emb_head_dim, v_head_dim, qk_layernorm (the latent norms), rope_yarn_factor,
rope_yarn_beta_fast, rope_yarn_beta_slow, rope_yarn_mscale, rope_yarn_mscale_all_dim and
rope_original_max_position_embeddings; HF's parameter names as they are but for the experts
(split) and the shared expert (mlp.shared_expert).

Both sides must choose the same experts: as test_hf_dots1_oracle.py, the tests check on HF's
router logits that no token's group or expert choice is near a tie, that every expert is chosen
and that the bias and the groups each change some token's choice. Tolerances as
test_hf_dots1_oracle.py's.
"""

import math

import numpy as np
import pytest
import torch
import transformers

import braid
from hf_oracle import (assert_fields_matter, assert_greedy_decoding_matches_generate, batch,
                       check_deepseek_routing, compare_logits_loss_and_gradients, deepseek_grads,
                       deepseek_mla_config, deepseek_routers, deepseek_routing_margin,
                       eager_model, load_deepseek_into_braid)

LOGITS_RTOL = 1e-5
GRAD_RTOL = 1e-4
MARGIN = 1e-3  # the least gap between a token's last chosen and first unchosen group or expert
LAYERS, HIDDEN, HEADS, VOCAB, POSITIONS = 3, 64, 4, 97, 64
Q_RANK, KV_RANK, NOPE, ROPE, V_DIM = 24, 16, 16, 8, 12
EXPERTS, TOPK, GROUPS, TOPK_GROUP, FFN, SCALE = 8, 4, 4, 2, 32, 2.5



def yarn(original, **mscales):
    return {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40,
                                "original_max_position_embeddings": original, "beta_fast": 32,
                                "beta_slow": 1, **mscales}}


# (HF config fields beyond the shared ones, seed: one whose routing of batch(97) has no near tie)
KINDS = {
    "q-latent": ({}, 0),
    # DeepSeek-V2-Lite's queries: q_proj from the hidden state, no query latent or its norm
    "no-q-latent": ({"q_lora_rank": None}, 0),
    # no layer has experts: braid's model is dense; tied embeddings
    "dense": ({"first_k_dense_replace": LAYERS, "tie_word_embeddings": True}, 0),
    # DeepSeek-V3's YaRN and original context (longer than the sequence): of the 4 pairs, 2 keep
    # their frequency, 1 blends, 1 is divided by 40
    "yarn": (yarn(4096, mscale=1.0, mscale_all_dim=1.0), 0),
    # cos and sin scaled too; an original context shorter than the sequence: 1 pair kept, 3
    # divided
    "yarn-mscale": (yarn(8, mscale=0.8, mscale_all_dim=0.6), 0),
    # transformers' g(1) on cos and sin, the softmax scale as it is; 1 kept, 1 blended, 2 divided
    "yarn-no-mscale": ({**yarn(256), "q_lora_rank": None}, 0),
}
# the pairs each YaRN kind keeps, blends and divides by the factor
YARN_PAIRS = {"yarn": (2, 1, 1), "yarn-mscale": (1, 0, 3), "yarn-no-mscale": (1, 1, 2)}


def g(m):  # YaRN's get_mscale at factor 40
    return 0.1 * m * math.log(40) + 1.0


def hf_config(**fields):
    router = dict(moe_intermediate_size=FFN, n_routed_experts=EXPERTS, num_experts_per_tok=TOPK,
                  n_group=GROUPS, topk_group=TOPK_GROUP, n_shared_experts=1,
                  first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=SCALE)
    return deepseek_mla_config(transformers.DeepseekV3Config, LAYERS, HIDDEN, HEADS, VOCAB,
                               POSITIONS, Q_RANK, KV_RANK, NOPE, ROPE, V_DIM,
                               **{**router, **fields})


def braid_config(hf_cfg):
    """braid's TransformerConfig of a DeepSeek-V3 config made by hf_config."""
    cfg = braid.TransformerConfig.preset("llama-tiny")
    cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads = LAYERS, HIDDEN, HEADS
    cfg.num_query_groups, cfg.kv_channels, cfg.ffn_hidden_size = HEADS, 0, 4 * HIDDEN
    cfg.vocab_size, cfg.max_position_embeddings = VOCAB, POSITIONS
    cfg.norm_eps, cfg.rope_theta = 1e-6, 10000.0
    cfg.tie_embeddings = hf_cfg.tie_word_embeddings
    cfg.multi_latent_attention, cfg.qk_layernorm = True, True
    cfg.q_lora_rank, cfg.kv_lora_rank = hf_cfg.q_lora_rank or 0, KV_RANK
    cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim = NOPE, ROPE, V_DIM
    rope = hf_cfg.rope_parameters
    if rope["rope_type"] == "yarn":  # convert_hf.py's mapping (hf_deepseek.yarn_config_from_hf)
        both = rope.get("mscale") and rope.get("mscale_all_dim")
        cfg.rope_yarn_factor = rope["factor"]
        cfg.rope_yarn_beta_fast, cfg.rope_yarn_beta_slow = rope["beta_fast"], rope["beta_slow"]
        cfg.rope_yarn_mscale = rope["mscale"] if both else 1.0
        cfg.rope_yarn_mscale_all_dim = rope.get("mscale_all_dim") or 0.0
        cfg.rope_original_max_position_embeddings = rope["original_max_position_embeddings"]
    first = hf_cfg.first_k_dense_replace
    if first < LAYERS:
        cfg.num_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size = EXPERTS, TOPK, FFN
        cfg.moe_router_score_function, cfg.moe_router_enable_expert_bias = "sigmoid", True
        cfg.moe_router_num_groups, cfg.moe_router_group_topk = GROUPS, TOPK_GROUP
        cfg.moe_router_topk_scaling_factor = SCALE
        cfg.moe_shared_expert_intermediate_size = FFN
        cfg.moe_layers = [int(i >= first) for i in range(LAYERS)]
    return cfg


def deepseek_v3_pair(kind, seed=None, **hf_fields):
    """An HF DeepseekV3ForCausalLM of `kind` (norms off their init, routers wide, the biases
    random) and braid's copy of it. `hf_fields`: more HF config; `seed`: other than KINDS'."""
    fields, kind_seed = KINDS[kind]
    torch.manual_seed(kind_seed if seed is None else seed)
    hf = deepseek_routers(eager_model(transformers.DeepseekV3ForCausalLM,
                                      hf_config(**{**fields, **hf_fields})))
    model = braid.GPTModel(braid_config(hf.config), device="cpu", seed=1)
    load_deepseek_into_braid(model, hf)
    return hf, model


def expert_layers(hf):
    return [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]


def yarn_pairs(hf):
    """How many of HF's RoPE frequency pairs keep the plain frequency, blend it with the
    interpolated one, and are the interpolated one (plain / factor)."""
    inv_freq = hf.model.rotary_emb.inv_freq.double()
    plain = 1.0 / 10000.0 ** (torch.arange(0, ROPE, 2, dtype=torch.float32) / ROPE).double()
    kept = torch.isclose(inv_freq, plain, rtol=1e-6)
    divided = torch.isclose(inv_freq, plain / 40, rtol=1e-6)
    return int(kept.sum()), int((~kept & ~divided).sum()), int(divided.sum())


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_logits_loss_and_gradients(kind):
    hf, model = deepseek_v3_pair(kind)
    assert hf.config.rope_interleave  # transformers' default: braid's pairing
    attn = hf.model.layers[0].self_attn
    rope = hf.config.rope_parameters
    if rope["rope_type"] == "yarn":
        assert yarn_pairs(hf) == YARN_PAIRS[kind]
        # transformers' factors on cos and sin and on the softmax scale are braid's
        cos_sin = hf.model.rotary_emb.attention_scaling
        softmax = g(rope.get("mscale_all_dim") or 0.0) ** 2
        assert cos_sin == pytest.approx({"yarn": 1.0, "yarn-mscale": g(0.8) / g(0.6),
                                         "yarn-no-mscale": g(1.0)}[kind], rel=1e-12)
        assert model.config.rope_attention_factor == pytest.approx(cos_sin, rel=1e-7)
        assert model.config.softmax_scale_factor == pytest.approx(softmax, rel=1e-7)
        assert attn.scaling == pytest.approx(softmax * (NOPE + ROPE) ** -0.5, rel=1e-12)
    else:
        assert attn.scaling == (NOPE + ROPE) ** -0.5
    # the latent norms' eps is 1e-6 whatever rms_norm_eps says (convert_hf.py refuses others)
    assert attn.kv_a_layernorm.variance_epsilon == hf.config.rms_norm_eps == 1e-6
    assert (attn.q_proj is None) == (hf.config.q_lora_rank is not None)
    ids, targets = batch(VOCAB)
    out = hf(torch.from_numpy(ids), labels=torch.from_numpy(ids), output_router_logits=True)
    if kind == "dense":
        assert not expert_layers(hf) and not model.config.num_experts
    else:
        assert expert_layers(hf) == [1, 2]
        check_deepseek_routing(hf, out.router_logits, MARGIN)
    err, grad_err, got = compare_logits_loss_and_gradients(model, hf, out, ids, targets,
                                                           deepseek_grads, LOGITS_RTOL, GRAD_RTOL)
    for name in got:  # every parameter takes part (the RoPE rows of kv_a_proj_with_mqa too)
        assert np.abs(got[name]).max() > 0, name
    print(f"{kind}: logits {err:.1e}, gradients {grad_err:.1e} (max relative error)")


def assert_hf_fields_matter(kind, **other):
    """braid's model of `kind` computes HF's logits, and HF's model of the same weights with the
    config fields `other` logits far beyond the tolerance: the comparison checks what they
    change."""
    hf, model = deepseek_v3_pair(kind)
    changed, _ = deepseek_v3_pair(kind, **other)
    assert_fields_matter(model, hf, changed, VOCAB, LOGITS_RTOL)


@pytest.mark.parametrize("kind", sorted(YARN_PAIRS))
def test_yarn_matters(kind):
    # The same weights with plain RoPE: other logits, so the comparison above checks braid's YaRN.
    assert_hf_fields_matter(kind, rope_parameters={"rope_type": "default",
                                                   "rope_theta": 10000.0})


def test_the_pairing_of_the_rope_channels_matters():
    # transformers with rope_interleave false turns halves (rotate_half) on the same weights:
    # other logits, so the comparison above checks braid's pairing.
    assert_hf_fields_matter("dense", rope_interleave=False)


NEW_TOKENS = 20


# kind -> a seed whose every decoding step's choice and routing is clear
DECODE_SEEDS = {"q-latent": 0, "no-q-latent": 0, "yarn": 1, "yarn-mscale": 4}


@pytest.mark.parametrize("kind", sorted(DECODE_SEEDS))
def test_greedy_decoding_over_the_kv_cache_matches_generate(kind):
    # braid's decode fills its cache with the prompt, then one token a step: every step's logits
    # are transformers' (over its own cache) and the tokens chosen the same; every step's choice
    # and every token's routing clear, so the test is exact (assert_greedy_decoding_matches_
    # generate). Weights drawn wider than transformers' init (std 0.02): logits of a few units,
    # whose top two are apart. With YaRN the 26 positions outrun yarn-mscale's original context
    # of 8.
    hf, model = deepseek_v3_pair(kind, seed=DECODE_SEEDS[kind], initializer_range=0.1)
    cache, err = assert_greedy_decoding_matches_generate(hf, model, VOCAB, NEW_TOKENS,
                                                         deepseek_routing_margin, MARGIN,
                                                         LOGITS_RTOL)
    assert cache.length == 5 + NEW_TOKENS
    print(f"{kind}: decode logits {err:.1e} (max relative error)")
