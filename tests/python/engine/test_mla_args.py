"""Megatron's multi-latent attention and YaRN arguments as pretrain_gpt.py reads them
(braid.attention_args): the refusals (before MPI, naming the flags), Megatron's defaults, the
model config they give, and a checkpoint's config taken back by --use-checkpoint-args and
tools/generate.py. (What the attention computes: the C++ tests and the HF oracle.)"""

import math
import types

import pytest

import braid
from braid import attention_args, checkpoint_args
from braid.arguments import ArgumentError, parse_args
from pretrain_job import save_metadata

# Megatron's MLA needs the last two on its command line to be braid's; without --rope-type it
# turns YaRN's RoPE (its defaults: factor 1).
MLA_YARN = ["--multi-latent-attention", "--position-embedding-type", "rope",
            "--disable-bias-linear"]
MLA = [*MLA_YARN, "--rope-type", "rope"]
# DeepSeek-V3's YaRN (its config.json's rope_scaling: factor 40, mscale and mscale_all_dim 1).
V3_YARN = ["--rotary-scaling-factor", "40", "--mscale", "1", "--mscale-all-dim", "1"]
ROPE = ["--position-embedding-type", "rope"]
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
    (["--multi-latent-attention"], "--multi-latent-attention needs --position-embedding-type rope"),
    (["--rope-type", "yarn"], "--rope-type yarn needs --position-embedding-type rope"),
    ([*MLA_YARN, "--use-rope-scaling"], "--use-rope-scaling with --rope-type yarn "
                                        "(--multi-latent-attention's default): Llama 3.1's RoPE "
                                        "scaling and YaRN exclude each other"),
    ([*ROPE, "--rope-type", "yarn", "--use-rope-scaling"],
     "--use-rope-scaling with --rope-type yarn: Llama 3.1's"),
    (["--rotary-scaling-factor", "40"], "--rotary-scaling-factor is YaRN's: it needs "
                                        "--position-embedding-type yarn (plain RoPE has no use"),
    ([*MLA, "--mscale", "1.0"], "--mscale is YaRN's: it needs --rope-type yarn"),
    ([*ROPE, "--mscale-all-dim", "1.0"], "--mscale-all-dim is YaRN's: it needs --rope-type yarn"),
    ([*MLA_YARN, "--rotary-scaling-factor", "0.5"],
     "--rotary-scaling-factor 0.5 must be >= 1: YaRN stretches the original context by it"),
    ([*MLA_YARN, "--rotary-scaling-factor", "0"],
     "argument --rotary-scaling-factor: must be > 0, got 0"),
    ([*MLA_YARN, "--rotary-scaling-factor", "inf"], "--rotary-scaling-factor must be finite"),
    ([*MLA_YARN, "--mscale", "-1"], "argument --mscale: must be >= 0, got -1"),
    ([*MLA_YARN, "--mscale-all-dim", "nan"], "argument --mscale-all-dim: must be >= 0, got nan"),
    ([*MLA_YARN, "--mscale-all-dim", "inf"], "--mscale-all-dim must be finite"),
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
    ([*MLA, "--rotary-interleaved"], "--rotary-interleaved with --multi-latent-attention: "
     "multi-latent attention pairs its RoPE channels interleaved already"),
    ([*MLA, "--qk-pos-emb-head-dim", "5"], "--qk-pos-emb-head-dim 5 must be even"),
    ([*MLA, "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "13"],
     "--v-head-dim 13 exceeds --qk-head-dim 8 + --qk-pos-emb-head-dim 4"),
    ([*MLA, "--q-lora-rank", "0"], "argument --q-lora-rank: must be > 0, got 0"),
    (["--q-lora-rank", "24"], "--q-lora-rank needs --multi-latent-attention"),
    (["--kv-lora-rank", "32"], "--kv-lora-rank needs --multi-latent-attention"),
    (["--qk-head-dim", "128"], "--qk-head-dim needs --multi-latent-attention"),
    (["--qk-pos-emb-head-dim", "64"], "--qk-pos-emb-head-dim needs --multi-latent-attention"),
    (["--v-head-dim", "128"], "--v-head-dim needs --multi-latent-attention"),
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
        assert a.rope_type == "rope" and a.rotary_scaling_factor is None


def test_megatrons_yarn_defaults():
    # Megatron's MLA without --rope-type is YaRN (MLATransformerConfig.rope_type), with the
    # command line's factor 1, mscale 1, mscale-all-dim 0 (not MLATransformerConfig's factor 40).
    a = parse(*MLA_YARN)
    assert a.rope_type == "yarn"
    assert (a.rotary_scaling_factor, a.mscale, a.mscale_all_dim) == (1.0, 1.0, 0.0)
    a = parse(*MLA_YARN, *V3_YARN)
    assert (a.rotary_scaling_factor, a.mscale, a.mscale_all_dim) == (40.0, 1.0, 1.0)
    # Ordinary attention: braid's YaRN too (Megatron's --rope-type yarn is MLA's only).
    a = parse(*ROPE, "--rope-type", "yarn", "--rotary-scaling-factor", "4")
    assert (a.rope_type, a.rotary_scaling_factor, a.mscale, a.mscale_all_dim) == (
        "yarn", 4.0, 1.0, 0.0)
    assert parse(*MLA).rope_type == "rope"


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
        assert not args["multi_latent_attention"] and args["rope_type"] == "rope"
        assert all(args[k] is None for k in MLA_KEYS[1:]) and args["kv_channels"] == 16


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
    # YaRN, with or without MLA (the f32 fields read back as doubles).
    yarn = dict(rope_yarn_factor=40.0, rope_original_max_position_embeddings=4096,
                rope_yarn_mscale=0.7070000171661377, rope_yarn_mscale_all_dim=0.0,
                rope_yarn_beta_fast=32.0, rope_yarn_beta_slow=1.0)
    words = ", YaRN RoPE (factor 40 of 4096 positions, mscale 0.707, mscale_all_dim 0)"
    assert attention_args.describe(types.SimpleNamespace(**yarn)) == words
    cfg.__dict__.update(yarn, rope_yarn_beta_fast=16.0)
    assert attention_args.describe(cfg).endswith(
        "v_head_dim 6), YaRN RoPE (factor 40 of 4096 positions, mscale 0.707, mscale_all_dim 0, "
        "beta 16 / 1)")
    assert attention_args.describe(types.SimpleNamespace(**dict(yarn, rope_yarn_factor=0.0))) \
        == ""


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


# ---- YaRN ---------------------------------------------------------------------------------------

def g(factor, m):  # YaRN's get_mscale
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


YARN_KEYS = ("rope_yarn_factor", "rope_yarn_beta_fast", "rope_yarn_beta_slow", "rope_yarn_mscale",
             "rope_yarn_mscale_all_dim")
# DeepSeek-V2's YaRN as braid's C++ saves it: f32 fields as their doubles.
V2_YARN = {"rope_yarn_factor": 40.0, "rope_yarn_beta_fast": 32.0, "rope_yarn_beta_slow": 1.0,
           "rope_yarn_mscale": 0.7070000171661377, "rope_yarn_mscale_all_dim": 0.7070000171661377,
           "rope_original_max_position_embeddings": 4096}


def test_checkpoint_config_gives_the_yarn_arguments():
    args = dict(checkpoint_args.model_args(config_json(**V2_YARN)))
    assert args["rope_type"] == "yarn" and not args["use_rope_scaling"]
    assert (args["rotary_scaling_factor"], args["mscale"], args["mscale_all_dim"]) == (
        40.0, 0.707, 0.707)  # the f32 values' shortest decimals
    # Older checkpoints (no YaRN keys) and those without YaRN: plain RoPE, the flags not given.
    for config in (config_json(), {k: v for k, v in config_json().items() if k not in YARN_KEYS}):
        args = dict(checkpoint_args.model_args(config))
        assert args["rope_type"] == "rope"
        assert (args["rotary_scaling_factor"], args["mscale"], args["mscale_all_dim"]) == (
            None, None, None)
    # YaRN without MLA (braid's, not Megatron's): the same arguments.
    args = dict(checkpoint_args.model_args(config_json(multi_latent_attention=False,
                                                       kv_channels=16, **V2_YARN)))
    assert args["rope_type"] == "yarn" and args["rotary_scaling_factor"] == 40.0
    # What Megatron's flags cannot say: beta fast and slow and the original context are
    # megatron-core's 32, 1 and 4096.
    for key, value in (("rope_original_max_position_embeddings", 16), ("rope_yarn_beta_fast", 16.0),
                       ("rope_yarn_beta_slow", 2.0)):
        with pytest.raises(ValueError, match=f"the checkpoint's {key} is .*; Megatron's "
                                             r"--rope-type yarn \(megatron-core's"):
            checkpoint_args.model_args(config_json(**{**V2_YARN, key: value}))
    # Llama 3.1's scaling keeps its own original context (8192); without either any is fine.
    assert checkpoint_args.model_args(config_json(rope_original_max_position_embeddings=16))
    with pytest.raises(ValueError, match="Megatron's --use-rope-scaling fixes it at 8192"):
        checkpoint_args.model_args(config_json(rope_scaling_factor=8.0,
                                               rope_original_max_position_embeddings=16))


def test_use_checkpoint_args_rebuilds_a_yarn_model(tmp_path):
    save_metadata(tmp_path, config_json(**V2_YARN))
    a = parse_args(["--load", str(tmp_path), "--use-checkpoint-args", "--device", "cpu"], 1)
    assert a.multi_latent_attention and a.rope_type == "yarn"
    assert (a.rotary_scaling_factor, a.mscale, a.mscale_all_dim) == (40.0, 0.707, 0.707)
    notes = "\n".join(a.checkpoint_args)
    assert "braid: --rotary-scaling-factor 40.0 from the checkpoint (the command line: None)" \
        in notes, notes
    assert "braid: --mscale 0.707 from the checkpoint" in notes, notes
    assert "--rope-type" not in notes, notes  # MLA's default is yarn
    # The command line's YaRN, loading a plain-RoPE checkpoint: the checkpoint's RoPE.
    other = tmp_path / "plain"
    save_metadata(other, config_json())
    a = parse_args(["--load", str(other), "--use-checkpoint-args", *MLA_YARN, *V3_YARN,
                    "--device", "cpu"], 1)
    assert a.rope_type == "rope" and a.rotary_scaling_factor is None
    assert "braid: --rope-type rope from the checkpoint (the command line: None)" in \
        "\n".join(a.checkpoint_args)


def test_generate_reads_the_yarn_keys():
    from braid.generate import config_from_metadata

    cfg = config_from_metadata(config_json(**V2_YARN))
    assert (cfg.rope_yarn_factor, cfg.rope_yarn_beta_fast, cfg.rope_yarn_beta_slow,
            cfg.rope_original_max_position_embeddings) == (40.0, 32.0, 1.0, 4096)
    assert cfg.rope_yarn_mscale == cfg.rope_yarn_mscale_all_dim == V2_YARN["rope_yarn_mscale"]
    assert cfg.rope_attention_factor == 1.0
    assert cfg.softmax_scale_factor == pytest.approx(g(40, 0.707) ** 2, rel=1e-6)
    old = config_from_metadata({k: v for k, v in config_json().items() if k not in YARN_KEYS})
    assert old.rope_yarn_factor == 0.0 and old.rope_attention_factor == 1.0


def test_the_arguments_give_the_yarn_config():
    from braid.training import model_config

    cfg = model_config(parse(*MLA_YARN, *SMALL, "--qk-layernorm", "--normalization", "RMSNorm"))
    assert (cfg.rope_yarn_factor, cfg.rope_yarn_mscale, cfg.rope_yarn_mscale_all_dim) == (
        1.0, 1.0, 0.0)  # Megatron's defaults: YaRN of factor 1
    assert (cfg.rope_yarn_beta_fast, cfg.rope_yarn_beta_slow,
            cfg.rope_original_max_position_embeddings) == (32.0, 1.0, 4096)
    assert cfg.rope_attention_factor == cfg.softmax_scale_factor == 1.0
    cfg = model_config(parse(*MLA_YARN, *SMALL, *V3_YARN, "--qk-layernorm"))
    assert cfg.rope_yarn_factor == 40.0 and cfg.rope_scaling_factor == 0.0
    assert cfg.rope_attention_factor == 1.0
    assert cfg.softmax_scale_factor == pytest.approx(g(40, 1) ** 2, rel=1e-6)
    cfg = model_config(parse(*MLA_YARN, *SMALL, "--rotary-scaling-factor", "40", "--mscale",
                             "0.8", "--mscale-all-dim", "0.6"))
    assert cfg.rope_attention_factor == pytest.approx(g(40, 0.8) / g(40, 0.6), rel=1e-6)
    # Without MLA the softmax scale stays (HF's YaRN models other than DeepSeek's).
    cfg = model_config(parse(*ROPE, "--rope-type", "yarn", "--rotary-scaling-factor", "4",
                             "--mscale-all-dim", "0.5"))
    assert not cfg.multi_latent_attention and cfg.rope_yarn_factor == 4.0
    assert cfg.rope_attention_factor == pytest.approx(g(4, 1) / g(4, 0.5), rel=1e-6)
    assert cfg.softmax_scale_factor == 1.0
    for args in ([*MLA, *SMALL], [*ROPE]):  # plain RoPE
        cfg = model_config(parse(*args))
        assert cfg.rope_yarn_factor == 0.0 and cfg.rope_original_max_position_embeddings == 8192


def test_numerics_warnings_name_the_yarn_flags():
    from braid.training import model_config

    cfg = model_config(parse(*MLA, *SMALL, "--qk-layernorm", "--normalization", "RMSNorm"))
    lines = "\n".join(checkpoint_args.numerics_warnings(config_json(**V2_YARN), cfg))
    assert "the checkpoint's model has rope_yarn_factor 40.0, this run's 0.0 (--rope-type yarn " \
           "--rotary-scaling-factor)" in lines, lines
    assert "rope_yarn_mscale_all_dim" in lines and "rope_original_max_position_embeddings" in lines
    assert not checkpoint_args.numerics_warnings(config_json(norm_eps=cfg.norm_eps), cfg)


def test_a_yarn_model_saves_the_five_keys_as_format_version_3(tmp_path):
    # braid's C++ writes the five YaRN fields under their names (format version 3, which a
    # version-2 reader refuses: it would run plain RoPE); tools/generate.py reads them back.
    from braid.generate import config_from_metadata
    from braid.training import model_config

    cfg = model_config(parse(*ROPE, "--rope-type", "yarn", "--rotary-scaling-factor", "4",
                             "--mscale", "0.5", "--normalization", "RMSNorm", "--swiglu",
                             "--vocab-size", "64", "--mock-data", "--seq-length", "16"))
    model = braid.GPTModel(cfg, device="cpu", seed=1)
    trainer = braid.Trainer(model, braid.AdamWConfig(), braid.LRSchedule(lr=1e-3,
                                                                         style="constant"))
    braid.save_checkpoint(str(tmp_path), trainer, save_optim=False)
    meta = braid.checkpoint_metadata(str(tmp_path))
    assert meta["format_version"] == 3
    c = meta["config"]
    assert (c["rope_yarn_factor"], c["rope_yarn_beta_fast"], c["rope_yarn_beta_slow"],
            c["rope_yarn_mscale"], c["rope_yarn_mscale_all_dim"],
            c["rope_original_max_position_embeddings"]) == (4.0, 32.0, 1.0, 0.5, 0.0, 4096)
    back = config_from_metadata(c)
    assert all(getattr(back, k) == c[k] for k in YARN_KEYS)
    assert dict(checkpoint_args.model_args(c))["rotary_scaling_factor"] == 4.0
