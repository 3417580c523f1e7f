"""Multi-latent attention in the model FLOPs behind MFU (braid.flops): its GEMMs and attention
against hand-computed counts, Megatron-LM's terms but for causal halving and the latent norms,
and every other model's count unchanged."""

import types

import pytest

import braid
from braid import flops

S = 32


def mla(**changes):
    """A 2-layer model of hidden 64, 4 heads, SwiGLU MLP of 96, vocabulary 256, with multi-latent
    attention: query latent 24, key/value latent 16, heads of 8 + 4 RoPE channels, values of 6."""
    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96,
                  vocab_size=256, activation="swiglu", window_size=-1, window_layers=[],
                  multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8,
                  qk_pos_emb_head_dim=4, v_head_dim=6)
    return types.SimpleNamespace(**{**fields, **changes})


def test_mla_counts_its_latent_projections_and_attention():
    # Per token and layer, forward, 2 FLOPs a multiply-add:
    #   q_a_proj 2·64·24 = 3072, q_b_proj 2·24·4·(8+4) = 2304        -> 5376
    #   kv_a_proj_with_mqa 2·64·(16+4) = 2560
    #   kv_b_proj 2·16·4·(8+6) = 1792
    #   o_proj 2·4·6·64 = 3072                                         -> projections 12800
    #   scores 2·4·12 and values 2·4·6 per key: 144 x 32 keys = 4608 (no causal halving)
    #   SwiGLU MLP 2·3·64·96 = 36864                                   -> 54272 a layer
    # Two layers and the LM head 2·64·256 = 32768: 141312.
    assert flops.attention_flops(mla()) == (12800, 144)
    assert flops.forward_flops_per_token(mla(), S) == 141312
    assert flops.flops_per_iteration(mla(), S, 3) == 3 * 141312 * S * 3
    # Without a query latent q_proj is 2·64·4·12 = 6144 in place of 5376.
    assert flops.forward_flops_per_token(mla(q_lora_rank=0), S) == 141312 + 2 * (6144 - 5376)
    # A sliding window counts min(s, W + 1) keys as for every other attention.
    assert flops.forward_flops_per_token(mla(window_size=7), S) == 141312 - 2 * 144 * (S - 8)


def test_mla_is_megatrons_count_without_causal_halving_and_norms():
    # Megatron-LM's training.py, num_floating_point_operations, multi_latent_attention branch:
    # per token and layer, forward + backward, its core attention halved for the causal mask and
    # Lq + Lkv added for the two latent norms.
    c = mla()
    heads, qk = c.num_attention_heads, c.qk_head_dim + c.qk_pos_emb_head_dim
    q_term = c.q_lora_rank * (c.hidden_size + heads * qk + 1)
    megatron = 3 * 2 * (q_term
                        + c.kv_lora_rank * (c.hidden_size + heads * (c.qk_head_dim + c.v_head_dim)
                                            + 1)
                        + c.hidden_size * c.qk_pos_emb_head_dim
                        + heads * c.v_head_dim * c.hidden_size
                        + S * heads * qk / 2 + S * heads * c.v_head_dim / 2)
    projections, per_key = flops.attention_flops(c)
    braid_count = 3 * (projections + per_key * S)
    assert braid_count - megatron == 3 * 2 * (S / 2 * heads * (qk + c.v_head_dim)
                                              - c.q_lora_rank - c.kv_lora_rank)


@pytest.mark.parametrize("preset", ["llama-tiny", "gpt2-tiny"])
def test_other_models_count_as_before(preset):
    # llama-tiny: 4 heads of 16, 2 KV heads, SwiGLU 192; gpt2-tiny: 4 KV heads, GELU 256. Per
    # token and layer: QKV 2·64·(64 + 2·kv), output 2·64·64, attention 4·64·s, the MLP; the LM
    # head 2·64·256 once.
    cfg = braid.TransformerConfig.preset(preset)
    kv = cfg.kv_heads * 16
    mlp = 2 * (3 if cfg.activation == "swiglu" else 2) * 64 * cfg.ffn_hidden_size
    layer = 2 * 64 * (64 + 2 * kv) + 2 * 64 * 64 + 4 * 64 * S + mlp
    assert flops.forward_flops_per_token(cfg, S) == 2 * layer + 2 * 64 * 256
    # multi_latent_attention off counts as a config without the field (a build before it).
    shape = types.SimpleNamespace(
        num_layers=2, hidden_size=64, num_attention_heads=4, head_dim=16, kv_heads=cfg.kv_heads,
        ffn_hidden_size=cfg.ffn_hidden_size, vocab_size=256, activation=cfg.activation,
        window_size=-1, window_layers=[])
    off = types.SimpleNamespace(**vars(shape), multi_latent_attention=False)
    assert flops.forward_flops_per_token(shape, S) == flops.forward_flops_per_token(off, S) \
        == 2 * layer + 2 * 64 * 256


@pytest.mark.skipif(not hasattr(braid.TransformerConfig(), "multi_latent_attention"),
                    reason="needs a braid._C built with TransformerConfig.multi_latent_attention")
def test_a_transformer_config_with_mla_counts_alike():
    cfg = braid.TransformerConfig.preset("llama-tiny")
    cfg.ffn_hidden_size, cfg.num_query_groups, cfg.kv_channels = 96, 0, 0
    cfg.multi_latent_attention = True
    cfg.q_lora_rank, cfg.kv_lora_rank = 24, 16
    cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim = 8, 4, 6
    cfg.validate()
    assert flops.forward_flops_per_token(cfg, S) == 141312
