"""Multi-token prediction in the model FLOPs behind MFU (braid.flops): each depth's layer (of the
last layer's kind), eh_proj and logits against hand-computed counts, Megatron-LM's terms but for
causal halving and the norms, and every model without it counted as before."""

import types

import pytest

import braid
from braid import flops

S = 32


def model(**changes):
    """A 2-layer model of hidden 64, 4 heads of 16, 2 KV heads, SwiGLU MLP of 96, vocabulary 256,
    with one multi-token prediction depth."""
    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=4, head_dim=16, kv_heads=2,
                  ffn_hidden_size=96, vocab_size=256, activation="swiglu", window_size=-1,
                  window_layers=[], mtp_num_layers=1)
    return types.SimpleNamespace(**{**fields, **changes})


def test_each_depth_counts_a_layer_eh_proj_and_its_logits():
    # Per token, forward, 2 FLOPs a multiply-add:
    #   a layer: QKV 2·64·(64 + 2·32) = 16384, output 2·64·64 = 8192, attention 4·64 a key
    #   x 32 keys = 8192 (no causal halving), SwiGLU MLP 2·3·64·96 = 36864       -> 69632
    #   the main model: 2 layers and the LM head 2·64·256 = 32768                 -> 172032
    #   a depth: its layer 69632, eh_proj 2·128·64 = 16384, its logits 32768      -> 118784
    assert flops.forward_flops_per_token(model(mtp_num_layers=0), S) == 172032
    assert flops.forward_flops_per_token(model(), S) == 172032 + 118784
    assert flops.forward_flops_per_token(model(mtp_num_layers=2), S) == 172032 + 2 * 118784
    assert flops.flops_per_iteration(model(), S, 3) == 3 * (172032 + 118784) * S * 3


def test_a_depth_is_of_the_last_layers_kind():
    # Experts on one of the two layers: 4 experts of 32, top 2: 2·3·64·32·2 + the router 2·64·4
    # = 25088 in place of the dense MLP's 36864, an expert layer 57856.
    moe = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
    main = 69632 + 57856 + 32768
    assert flops.forward_flops_per_token(model(**moe, moe_layers=[0, 1]), S) == \
        main + 57856 + 16384 + 32768
    assert flops.forward_flops_per_token(model(**moe, moe_layers=[1, 0]), S) == \
        main + 69632 + 16384 + 32768
    assert flops.forward_flops_per_token(model(**moe, moe_layers=[]), S) == \
        2 * 57856 + 32768 + 57856 + 16384 + 32768
    # A window of 7 on the last layer: its depth attends to 8 keys, 256·8 in place of 256·32.
    windowed_last = model(window_size=7, window_layers=[0, 1])
    full_last = model(window_size=7, window_layers=[1, 0])
    assert flops.forward_flops_per_token(windowed_last, S) == \
        flops.forward_flops_per_token(full_last, S) - 256 * (S - 8)
    assert flops.forward_flops_per_token(full_last, S) == 172032 - 256 * (S - 8) + 118784


def megatron(cfg, depths: int) -> float:
    """Megatron-LM's num_floating_point_operations (megatron/training/training.py,
    transformer_flops, GQA without an output gate) for one token: forward + backward."""
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, \
        cfg.kv_heads * cfg.head_dim
    layers = cfg.num_layers + depths
    attention = 3 * 2 * (h * (q + 2 * kv) + q * S / 2 * 2 + q * h)
    mlp = 3 * 2 * h * cfg.ffn_hidden_size * 3
    return layers * (attention + mlp) + 3 * 2 * depths * (3 * h + 2 * h * h) + \
        3 * 2 * h * cfg.vocab_size * (depths + 1)


@pytest.mark.parametrize("depths", [0, 1, 3])
def test_megatrons_count_but_for_causal_halving_and_the_norms(depths):
    cfg = model(mtp_num_layers=depths)
    q, h = cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size
    braid_count = 3 * flops.forward_flops_per_token(cfg, S)
    # braid counts every key (4·q a key, Megatron 2·q on half of them) in each of the
    # layers and depths, and not the depths' three norms (2·3h a token forward).
    assert braid_count - megatron(cfg, depths) == \
        3 * ((cfg.num_layers + depths) * 2 * q * S - depths * 2 * 3 * h)


def test_a_config_without_the_field_counts_as_none():
    without = types.SimpleNamespace(**{k: v for k, v in vars(model()).items()
                                       if k != "mtp_num_layers"})
    assert flops.forward_flops_per_token(without, S) == \
        flops.forward_flops_per_token(model(mtp_num_layers=0), S) == 172032


@pytest.mark.skipif(not hasattr(braid.TransformerConfig(), "mtp_num_layers"),
                    reason="needs a braid._C built with TransformerConfig.mtp_num_layers")
def test_a_transformer_config_with_mtp_counts_alike():
    cfg = braid.TransformerConfig.preset("llama-tiny")  # hidden 64, 4 heads, 2 KV heads
    base = flops.forward_flops_per_token(cfg, S)
    cfg.mtp_num_layers = 2
    cfg.validate()
    kv = cfg.kv_heads * 16
    layer = 2 * 64 * (64 + 2 * kv) + 2 * 64 * 64 + 4 * 64 * S + 2 * 3 * 64 * cfg.ffn_hidden_size
    assert flops.forward_flops_per_token(cfg, S) == \
        base + 2 * (layer + 2 * 2 * 64 * 64 + 2 * 64 * cfg.vocab_size)
