"""Megatron's multi-latent attention arguments as pretrain_gpt.py reads them (braid.attention_args):
the refusals (before MPI, naming the flags), Megatron's defaults, the model config they give, and a
checkpoint's config taken back by --use-checkpoint-args and tools/generate.py. (What the attention
computes: the C++ tests and the HF oracle.)"""

import json
import os
import types

import pytest

import braid
from braid import attention_args, checkpoint_args
from braid.arguments import ArgumentError, parse_args

# Megatron's MLA needs all three on its command line to be braid's.
MLA = ["--multi-latent-attention", "--rope-type", "rope", "--position-embedding-type", "rope",
       "--disable-bias-linear"]
SMALL = ["--q-lora-rank", "24", "--kv-lora-rank", "16", "--qk-head-dim", "8",
         "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6"]
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--device", "cpu"]

needs_mla_build = pytest.mark.skipif(
    not hasattr(braid.TransformerConfig(), "multi_latent_attention"),
    reason="needs a braid._C built with TransformerConfig.multi_latent_attention")


def parse(*args, world_size=1):
    return parse_args([*MODEL, *args], world_size, check_files=False)


@pytest.mark.parametrize("args, message", [
    (["--multi-latent-attention"],
     "--multi-latent-attention without --rope-type is YaRN RoPE in Megatron"),
    (["--multi-latent-attention"], "pass --rope-type rope for plain RoPE"),
    (["--multi-latent-attention", "--rope-type", "yarn"],
     "--rope-type yarn is not supported: braid does not implement YaRN"),
    (["--rope-type", "yarn"], "(Megatron's ordinary attention takes rope only)"),
    (["--multi-latent-attention", "--rope-type", "rope"],
     "--multi-latent-attention needs --position-embedding-type rope"),
    (["--multi-latent-attention", "--rope-type", "rope", "--position-embedding-type", "rope"],
     "--multi-latent-attention needs --disable-bias-linear"),
    ([*MLA, "--add-qkv-bias"], "--add-qkv-bias with --multi-latent-attention"),
    ([*MLA, "--kv-channels", "16"], "--kv-channels 16 with --multi-latent-attention"),
    ([*MLA, "--group-query-attention", "--num-query-groups", "2"],
     "--num-query-groups 2 with --multi-latent-attention: every head has its own key and value"),
    ([*MLA, "--rotary-percent", "0.5"], "--rotary-percent 0.5 with --multi-latent-attention"),
    ([*MLA, "--use-rope-scaling"], "--use-rope-scaling with --multi-latent-attention"),
    ([*MLA, "--qk-pos-emb-head-dim", "5"], "--qk-pos-emb-head-dim 5 must be even"),
    ([*MLA, "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "13"],
     "--v-head-dim 13 exceeds --qk-head-dim 8 + --qk-pos-emb-head-dim 4"),
    ([*MLA, "--q-lora-rank", "0"], "argument --q-lora-rank: must be > 0, got 0"),
    (["--q-lora-rank", "24"], "--q-lora-rank needs --multi-latent-attention"),
    (["--kv-lora-rank", "32"], "--kv-lora-rank needs --multi-latent-attention"),
    (["--qk-head-dim", "128"], "--qk-head-dim needs --multi-latent-attention"),
    (["--qk-pos-emb-head-dim", "64"], "--qk-pos-emb-head-dim needs --multi-latent-attention"),
    (["--v-head-dim", "128"], "--v-head-dim needs --multi-latent-attention"),
    (["--rotary-scaling-factor", "40"], "--rotary-scaling-factor is not supported by braid: "
                                        "YaRN's"),
    (["--mscale", "1.0"], "--mscale is not supported by braid: YaRN's"),
    (["--mscale-all-dim", "1.0"], "--mscale-all-dim is not supported by braid: YaRN's"),
])
def test_refused_naming_the_flag(args, message):
    with pytest.raises(ArgumentError) as e:
        parse(*args)
    assert message in str(e.value)


def test_megatrons_defaults_and_the_head_width():
    a = parse(*MLA)
    # Megatron's command line (_add_mla_args): no query latent, 32, 128, 64, 128.
    assert (a.q_lora_rank, a.kv_lora_rank, a.qk_head_dim, a.qk_pos_emb_head_dim,
            a.v_head_dim) == (None, 32, 128, 64, 128)
    assert a.kv_channels == 128 + 64 and a.num_query_groups == 4
    a = parse(*MLA, *SMALL, "--group-query-attention", "--num-query-groups", "4")
    assert (a.q_lora_rank, a.kv_lora_rank, a.qk_head_dim, a.qk_pos_emb_head_dim,
            a.v_head_dim, a.kv_channels) == (24, 16, 8, 4, 6, 12)
    # The hidden size need not divide by the heads: the MLA widths give theirs.
    assert parse(*MLA, "--hidden-size", "66").kv_channels == 192


def test_plain_attention_is_as_before():
    for args in ([], ["--rope-type", "rope"], ["--position-embedding-type", "rope",
                                               "--rope-type", "rope"]):
        a = parse(*args)
        assert not a.multi_latent_attention and a.kv_channels == 16, args
        assert (a.q_lora_rank, a.kv_lora_rank, a.v_head_dim) == (None, None, None)


def config_json(**changes):
    """metadata.json's "config" as braid's C++ writes it (engine::config_json): the MLA model
    of SMALL, 2 layers of hidden 64, 4 heads; kv_channels is the query/key head width."""
    config = {
        "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 4,
        "kv_channels": 12, "ffn_hidden_size": 96, "vocab_size": 256,
        "max_position_embeddings": 16, "normalization": "rmsnorm", "activation": "swiglu",
        "position_embedding": "rope", "add_bias_linear": False, "add_qkv_bias": False,
        "qk_layernorm": True, "zero_centered_gamma": False, "tie_embeddings": False,
        "rope_theta": 10000.0, "rope_scaling_factor": 0.0, "rope_low_freq_factor": 1.0,
        "rope_high_freq_factor": 4.0, "rope_original_max_position_embeddings": 8192,
        "rotary_percent": 1.0, "window_size": -1, "window_layers": [], "num_experts": 0,
        "moe_router_topk": 2, "moe_ffn_hidden_size": 0, "moe_router_pre_softmax": False,
        "moe_shared_expert_intermediate_size": 0, "moe_shared_expert_gate": False,
        "moe_layers": [], "moe_router_score_function": "softmax",
        "moe_router_enable_expert_bias": False, "moe_router_num_groups": 0,
        "moe_router_group_topk": 0, "moe_router_topk_scaling_factor": 1.0,
        "moe_expert_capacity_factor": 0.0, "moe_token_drop_policy": "probs", "norm_eps": 1e-5,
        "params_dtype": "f32", "multi_latent_attention": True, "q_lora_rank": 24,
        "kv_lora_rank": 16, "qk_head_dim": 8, "qk_pos_emb_head_dim": 4, "v_head_dim": 6}
    return {**config, **changes}


MLA_KEYS = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
            "qk_pos_emb_head_dim", "v_head_dim")


def test_checkpoint_config_gives_the_mla_arguments():
    args = dict(checkpoint_args.model_args(config_json()))
    assert args["multi_latent_attention"] and args["rope_type"] == "rope"
    assert (args["q_lora_rank"], args["kv_lora_rank"], args["qk_head_dim"],
            args["qk_pos_emb_head_dim"], args["v_head_dim"]) == (24, 16, 8, 4, 6)
    assert args["kv_channels"] is None  # the MLA widths give the heads'
    assert args["position_embedding_type"] == "rope" and args["disable_bias_linear"]
    assert args["qk_layernorm"]  # with MLA: the latents' norms
    assert dict(checkpoint_args.model_args(config_json(q_lora_rank=0)))["q_lora_rank"] is None
    # A model without MLA, saved before these keys or after: none given, the head width kept.
    for config in (config_json(multi_latent_attention=False, kv_channels=16),
                   {k: v for k, v in config_json(kv_channels=16).items() if k not in MLA_KEYS}):
        args = dict(checkpoint_args.model_args(config))
        assert not args["multi_latent_attention"] and "rope_type" not in args
        assert all(args[k] is None for k in MLA_KEYS[1:]) and args["kv_channels"] == 16


def save_metadata(directory, config, iteration=5):
    path = braid.iteration_directory(str(directory), iteration)
    os.makedirs(path)
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump({"config": config}, f)
    with open(os.path.join(str(directory), "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))


def test_use_checkpoint_args_rebuilds_an_mla_model(tmp_path):
    save_metadata(tmp_path, config_json())
    a = parse_args(["--load", str(tmp_path), "--use-checkpoint-args", "--device", "cpu"], 1)
    assert a.multi_latent_attention and a.rope_type == "rope" and a.disable_bias_linear
    assert (a.q_lora_rank, a.kv_lora_rank, a.qk_head_dim, a.qk_pos_emb_head_dim, a.v_head_dim,
            a.kv_channels, a.num_query_groups) == (24, 16, 8, 4, 6, 12, 4)
    notes = "\n".join(a.checkpoint_args)
    assert "braid: --multi-latent-attention True from the checkpoint" in notes, notes
    assert "braid: --rope-type rope from the checkpoint" in notes, notes
    assert "--kv-channels" not in notes, notes
    # The command line's MLA model, loading one without: the checkpoint's plain attention.
    other = tmp_path / "plain"
    save_metadata(other, {k: v for k, v in config_json(kv_channels=16).items()
                          if k not in MLA_KEYS})
    a = parse_args(["--load", str(other), "--use-checkpoint-args", *MLA, "--device", "cpu"], 1)
    assert not a.multi_latent_attention and a.kv_channels == 16 and a.kv_lora_rank is None


def test_the_startup_line_names_mla_and_its_ranks():
    cfg = types.SimpleNamespace(multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16,
                                qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6)
    assert attention_args.describe(cfg) == (
        ", multi-latent attention (q_lora_rank 24, kv_lora_rank 16, qk_head_dim 8, "
        "qk_pos_emb_head_dim 4, v_head_dim 6)")
    cfg.q_lora_rank = 0
    assert "(no query latent, kv_lora_rank 16" in attention_args.describe(cfg)
    assert attention_args.describe(types.SimpleNamespace()) == ""
    assert attention_args.describe(types.SimpleNamespace(multi_latent_attention=False)) == ""


def test_a_config_from_before_mla_loads_for_generation():
    from braid.generate import config_from_metadata

    old = {k: v for k, v in config_json(kv_channels=16, qk_layernorm=False).items()
           if k not in MLA_KEYS}
    cfg = config_from_metadata(old)
    assert cfg.head_dim == 16 and cfg.kv_heads == 4


@needs_mla_build
def test_the_arguments_give_the_mla_config():
    from braid.training import model_config

    cfg = model_config(parse(*MLA, *SMALL, "--qk-layernorm", "--normalization", "RMSNorm"))
    assert cfg.multi_latent_attention and cfg.qk_layernorm
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim,
            cfg.v_head_dim) == (24, 16, 8, 4, 6)
    assert (cfg.kv_channels, cfg.head_dim, cfg.value_head_dim, cfg.kv_heads,
            cfg.rotary_dim) == (0, 12, 6, 4, 4)
    assert cfg.position_embedding == "rope" and not cfg.add_bias_linear
    assert model_config(parse(*MLA)).q_lora_rank == 0  # Megatron's None: q_proj
    assert not model_config(parse()).multi_latent_attention


@needs_mla_build
def test_generate_rebuilds_an_mla_model_from_its_checkpoint_config():
    from braid.generate import config_from_metadata

    cfg = config_from_metadata(config_json())
    assert cfg.multi_latent_attention and cfg.kv_channels == 0 and cfg.head_dim == 12
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim,
            cfg.v_head_dim) == (24, 16, 8, 4, 6)
    assert not config_from_metadata(config_json(multi_latent_attention=False, kv_channels=16)
                                    ).multi_latent_attention
