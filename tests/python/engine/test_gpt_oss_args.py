"""GPT-OSS's Megatron flags as pretrain_gpt.py reads them (braid.activation_args,
braid.attention_args): --quick-geglu, --glu-linear-offset, --activation-func-clamp-value,
--softmax-type, --position-embedding-type yarn and the --yarn-* flags. The refusals (before MPI,
naming the flags), the model config they give, a checkpoint's config taken back by
--use-checkpoint-args and tools/generate.py, the startup line's words, and the MFU's and the
planner's count of a quick GEGLU MLP. (What the model computes: the C++ tests; that the flags
train under every parallelism: test_pretrain_gpt_gpt_oss.py.)"""

import dataclasses
import os
import sys
import types

import pytest

import braid
from braid import activation_args, attention_args, checkpoint_args, flops, planner, planner_moe
from braid.arguments import ArgumentError, parse_args
from braid.megatron_flags import ONLY_VALUE, UNSUPPORTED, no_effect_given
from pretrain_job import save_metadata

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--device", "cpu"]
# The GPT-OSS launch script's flags braid did not know, and those around them (its sizes but for
# the hidden size and the experts', which it does not give): the MLP and attention's, then the
# experts' and the rest.
GPT_OSS_LAYERS = ["--quick-geglu", "--glu-linear-offset", "1.0", "--activation-func-clamp-value",
                  "7.0", "--softmax-type", "learnable", "--window-size", "127,0",
                  "--window-attn-skip-freq", "2", "--position-embedding-type", "yarn",
                  "--rotary-base", "150000", "--rotary-percent", "1.0", "--rotary-scaling-factor",
                  "32.0", "--yarn-original-max-position-embeddings", "4096", "--yarn-beta-fast",
                  "32.0", "--yarn-beta-slow", "1.0", "--mscale", "1.0", "--mscale-all-dim",
                  "0.0", "--no-yarn-correction-range-round-to-int"]
GPT_OSS = [*GPT_OSS_LAYERS, "--num-experts", "32", "--moe-ffn-hidden-size", "2880",
           "--moe-router-topk", "4", "--moe-router-score-function", "softmax",
           "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.0",
           "--moe-router-dtype", "fp32", "--untie-embeddings-and-output-weights",
           "--normalization", "RMSNorm", "--kv-channels", "64", "--group-query-attention",
           "--num-query-groups", "2"]
YARN = ["--position-embedding-type", "yarn"]
MLA = ["--multi-latent-attention", "--position-embedding-type", "rope", "--disable-bias-linear"]


def parse(*args, world_size=1):
    return parse_args([*MODEL, *args], world_size, check_files=False)


@pytest.mark.parametrize("args, message", [
    (["--quick-geglu", "--swiglu"], "--quick-geglu and --swiglu are two activations; give one"),
    (["--quick-geglu", "--squared-relu"],
     "--quick-geglu and --squared-relu are two activations; give one"),
    (["--glu-linear-offset", "1"], "--glu-linear-offset needs a gated activation (--swiglu or "
                                   "--quick-geglu): it acts on the gate and up projections"),
    (["--squared-relu", "--activation-func-clamp-value", "7"],
     "--activation-func-clamp-value needs a gated activation (--swiglu or --quick-geglu)"),
    (["--swiglu", "--activation-func-clamp-value", "0"],
     "--activation-func-clamp-value must be > 0 and finite, got 0.0 (omit it for no clamp)"),
    (["--quick-geglu", "--activation-func-clamp-value", "-7"],
     "--activation-func-clamp-value must be > 0 and finite, got -7.0"),
    (["--swiglu", "--activation-func-clamp-value", "inf"],
     "--activation-func-clamp-value must be > 0 and finite, got inf"),
    (["--swiglu", "--activation-func-clamp-value", "nan"],
     "--activation-func-clamp-value must be > 0 and finite, got nan"),
    (["--quick-geglu", "--glu-linear-offset", "nan"],
     "--glu-linear-offset must be finite, got nan"),
    (["--softmax-type", "sinks"], "argument --softmax-type: invalid choice: 'sinks'"),
    ([*MLA, "--softmax-type", "learnable"], "--softmax-type learnable with "
     "--multi-latent-attention: braid's multi-latent attention computes the vanilla softmax only"),
    ([*MLA, "--softmax-type", "off-by-one"], "--softmax-type off-by-one with "
                                             "--multi-latent-attention"),
    (["--position-embedding-type", "rope", "--yarn-beta-fast", "16"],
     "--yarn-beta-fast is YaRN's: it needs --rope-type yarn or --position-embedding-type yarn "
     "(plain RoPE has no use for it)"),
    (["--yarn-original-max-position-embeddings", "8192"],
     "--yarn-original-max-position-embeddings is YaRN's: it needs --position-embedding-type "
     "yarn (plain"),
    (["--no-yarn-correction-range-round-to-int"],
     "--no-yarn-correction-range-round-to-int is YaRN's: it needs --position-embedding-type "
     "yarn"),
    (["--position-embedding-type", "rope", "--yarn-correction-range-round-to-int"],
     "--yarn-correction-range-round-to-int is YaRN's"),
    ([*MLA, "--rope-type", "rope", "--yarn-beta-slow", "2"],
     "--yarn-beta-slow with --multi-latent-attention: megatron-core's"),
    ([*MLA, "--rope-type", "rope", "--mscale", "1.0"],
     "--mscale is YaRN's: it needs --rope-type yarn (plain RoPE has no use for it)"),
    ([*YARN, "--rope-type", "rope"],
     "--position-embedding-type yarn and --rope-type rope: give one kind of RoPE"),
    ([*MLA, "--position-embedding-type", "yarn"], "--position-embedding-type yarn with "
     "--multi-latent-attention: multi-latent attention's YaRN is --position-embedding-type rope "
     "with --rope-type yarn"),
    ([*MLA, "--yarn-beta-fast", "16"], "--yarn-beta-fast with --multi-latent-attention: "
     "megatron-core's multi-latent attention builds its YaRN from MLATransformerConfig's beta "
     "fast 32, beta slow 1 and original context 4096"),
    ([*MLA, "--no-yarn-correction-range-round-to-int"],
     "--no-yarn-correction-range-round-to-int with --multi-latent-attention"),
    ([*YARN, "--yarn-beta-slow", "40"], "--yarn-beta-slow 40 exceeds --yarn-beta-fast 32: YaRN "
                                        "keeps the frequencies"),
    ([*YARN, "--yarn-beta-fast", "inf"], "--yarn-beta-fast must be finite"),
    ([*YARN, "--yarn-beta-slow", "nan"], "--yarn-beta-slow must be finite"),
    ([*YARN, "--yarn-original-max-position-embeddings", "0"],
     "argument --yarn-original-max-position-embeddings: must be > 0, got 0"),
    ([*YARN, "--use-rope-scaling"], "--use-rope-scaling with --position-embedding-type yarn: "
                                    "Llama 3.1's RoPE scaling and YaRN exclude each other"),
    ([*YARN, "--rotary-scaling-factor", "0.5"], "--rotary-scaling-factor 0.5 must be >= 1"),
])
def test_refused_naming_the_flag(args, message):
    with pytest.raises(ArgumentError) as e:
        parse(*args)
    assert message in str(e.value)


def test_the_flags_are_no_longer_refused_nor_noted():
    for flag in ("--quick-geglu", "--glu-linear-offset", "--activation-func-clamp-value"):
        assert flag not in UNSUPPORTED
    assert "--softmax-type" not in ONLY_VALUE
    notes = "\n".join(no_effect_given(parse(*GPT_OSS)))
    assert notes == "braid: --moe-router-dtype fp32 has no effect: braid's router logits and " \
                    "probabilities are always f32 (its GEMMs take the activations' dtype with " \
                    "f32 accumulation)", notes


def test_gpt_oss_flags_as_braid_reads_them():
    a = parse(*GPT_OSS)
    assert a.quick_geglu and not a.swiglu
    assert (a.glu_linear_offset, a.activation_func_clamp_value) == (1.0, 7.0)
    assert a.softmax_type == "learnable"
    # --position-embedding-type yarn is braid's rope with --rope-type yarn.
    assert (a.position_embedding_type, a.rope_type) == ("rope", "yarn")
    assert (a.rotary_scaling_factor, a.mscale, a.mscale_all_dim) == (32.0, 1.0, 0.0)
    assert (a.yarn_original_max_position_embeddings, a.yarn_beta_fast, a.yarn_beta_slow,
            a.yarn_correction_range_round_to_int) == (4096, 32.0, 1.0, False)
    assert a.ffn_hidden_size == 4 * 64  # Megatron's default: the 2/3 rule is --swiglu's
    assert parse("--swiglu").ffn_hidden_size == 128
    # Newer Megatron's defaults, and braid's older spelling of the same YaRN.
    for args in (YARN, ["--position-embedding-type", "rope", "--rope-type", "yarn"],
                 [*YARN, "--rope-type", "yarn"]):
        a = parse(*args)
        assert (a.position_embedding_type, a.rope_type, a.rotary_scaling_factor) == (
            "rope", "yarn", 1.0), args
        assert (a.yarn_original_max_position_embeddings, a.yarn_beta_fast, a.yarn_beta_slow,
                a.yarn_correction_range_round_to_int) == (4096, 32.0, 1.0, True), args
    a = parse(*YARN, "--yarn-correction-range-round-to-int", "--yarn-beta-fast", "8",
              "--yarn-beta-slow", "8")
    assert (a.yarn_beta_fast, a.yarn_beta_slow, a.yarn_correction_range_round_to_int) == (
        8.0, 8.0, True)
    a = parse()  # none of them
    assert not a.quick_geglu and a.softmax_type == "vanilla" and a.rope_type == "rope"
    assert (a.glu_linear_offset, a.activation_func_clamp_value,
            a.yarn_correction_range_round_to_int) == (None, None, None)
    # Multi-latent attention's YaRN keeps megatron-core's fixed values.
    a = parse(*MLA)
    assert (a.rope_type, a.yarn_beta_fast, a.yarn_original_max_position_embeddings,
            a.yarn_correction_range_round_to_int) == ("yarn", 32.0, 4096, True)


def test_the_arguments_give_the_config():
    from braid.training import model_config

    cfg = model_config(parse(*GPT_OSS))
    assert cfg.activation == "quick_geglu" and cfg.softmax_type == "learnable"
    assert (cfg.glu_linear_offset, cfg.activation_clamp) == (1.0, 7.0)
    assert cfg.position_embedding == "rope" and cfg.add_bias_linear
    assert (cfg.rope_yarn_factor, cfg.rope_yarn_mscale, cfg.rope_yarn_mscale_all_dim) == (
        32.0, 1.0, 0.0)
    assert (cfg.rope_original_max_position_embeddings, cfg.rope_yarn_beta_fast,
            cfg.rope_yarn_beta_slow, cfg.rope_yarn_truncate) == (4096, 32.0, 1.0, False)
    assert (cfg.window_size, list(cfg.window_layers)) == (127, [1, 0])
    assert (cfg.num_experts, cfg.moe_ffn_hidden_size, cfg.head_dim) == (32, 2880, 64)
    cfg = model_config(parse(*YARN, "--yarn-beta-fast", "16", "--yarn-beta-slow", "2",
                             "--yarn-original-max-position-embeddings", "8192",
                             "--rotary-scaling-factor", "4"))
    assert (cfg.rope_original_max_position_embeddings, cfg.rope_yarn_beta_fast,
            cfg.rope_yarn_beta_slow, cfg.rope_yarn_truncate) == (8192, 16.0, 2.0, True)
    cfg = model_config(parse("--swiglu", "--glu-linear-offset", "-0.5", "--softmax-type",
                             "off-by-one"))
    assert (cfg.activation, cfg.glu_linear_offset, cfg.activation_clamp) == ("swiglu", -0.5, 0.0)
    assert cfg.softmax_type == "off-by-one"
    cfg = model_config(parse())
    assert (cfg.activation, cfg.softmax_type, cfg.glu_linear_offset, cfg.activation_clamp,
            cfg.rope_yarn_truncate) == ("gelu", "vanilla", 0.0, 0.0, True)
    # The sinks are one parameter per head and layer.
    heads = 4 * 2
    assert model_config(parse("--softmax-type", "learnable")).num_parameters() == \
        model_config(parse()).num_parameters() + heads
    assert model_config(parse("--softmax-type", "off-by-one")).num_parameters() == \
        model_config(parse()).num_parameters()


def saved_config(**changes):
    """metadata.json's "config" of a small GPT-OSS-shaped model as braid's C++ writes it
    (engine::config_json): f32 fields as their doubles."""
    config = {
        "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
        "kv_channels": 24, "ffn_hidden_size": 256, "vocab_size": 256,
        "max_position_embeddings": 32, "normalization": "rmsnorm", "activation": "quick_geglu",
        "position_embedding": "rope", "add_bias_linear": True, "add_qkv_bias": False,
        "qk_layernorm": False, "zero_centered_gamma": False, "tie_embeddings": False,
        "rope_theta": 150000.0, "rope_scaling_factor": 0.0, "rope_low_freq_factor": 1.0,
        "rope_high_freq_factor": 4.0, "rope_original_max_position_embeddings": 4096,
        "rope_yarn_factor": 32.0, "rope_yarn_beta_fast": 32.0, "rope_yarn_beta_slow": 1.0,
        "rope_yarn_mscale": 1.0, "rope_yarn_mscale_all_dim": 0.0, "rope_linear_factor": 0.0,
        "rotary_percent": 1.0, "rotary_interleaved": False, "rope_yarn_truncate": False,
        "softmax_type": "learnable", "glu_linear_offset": 1.0, "activation_clamp": 7.0,
        "window_size": 7, "window_layers": [1, 0], "num_experts": 4, "moe_router_topk": 2,
        "moe_ffn_hidden_size": 32, "moe_router_pre_softmax": False,
        "moe_shared_expert_intermediate_size": 0, "moe_shared_expert_gate": False,
        "moe_layers": [], "moe_router_score_function": "softmax",
        "moe_router_enable_expert_bias": False, "moe_router_num_groups": 0,
        "moe_router_group_topk": 0, "moe_router_topk_scaling_factor": 1.0,
        "moe_expert_capacity_factor": 0.0, "moe_token_drop_policy": "probs", "norm_eps": 1e-5,
        "params_dtype": "f32", "multi_latent_attention": False, "q_lora_rank": 0,
        "kv_lora_rank": 32, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64, "v_head_dim": 128}
    return {**config, **changes}


NEW_KEYS = ("softmax_type", "glu_linear_offset", "activation_clamp", "rope_yarn_truncate")


def test_checkpoint_config_gives_the_gpt_oss_arguments():
    args = dict(checkpoint_args.model_args(saved_config()))
    assert args["quick_geglu"] and not args["swiglu"] and not args["squared_relu"]
    assert (args["glu_linear_offset"], args["activation_func_clamp_value"]) == (1.0, 7.0)
    assert args["softmax_type"] == "learnable"
    assert (args["position_embedding_type"], args["rope_type"]) == ("rope", "yarn")
    assert (args["yarn_original_max_position_embeddings"], args["yarn_beta_fast"],
            args["yarn_beta_slow"], args["yarn_correction_range_round_to_int"]) == (
        4096, 32.0, 1.0, False)
    # Without MLA, other betas and contexts are the --yarn-* flags' (no longer refused).
    args = dict(checkpoint_args.model_args(saved_config(
        rope_yarn_beta_fast=16.0, rope_original_max_position_embeddings=8192)))
    assert (args["yarn_beta_fast"], args["yarn_original_max_position_embeddings"]) == (16.0, 8192)
    # A checkpoint from before these keys: vanilla, no offset nor clamp, rounded YaRN.
    old = {k: v for k, v in saved_config(activation="swiglu").items() if k not in NEW_KEYS}
    args = dict(checkpoint_args.model_args(old))
    assert args["swiglu"] and not args["quick_geglu"] and args["softmax_type"] == "vanilla"
    assert (args["glu_linear_offset"], args["activation_func_clamp_value"]) == (None, None)
    assert args["yarn_correction_range_round_to_int"] is True
    # Plain RoPE: none of YaRN's flags.
    args = dict(checkpoint_args.model_args(saved_config(rope_yarn_factor=0.0)))
    assert args["rope_type"] == "rope"
    assert all(args[dest] is None for dest in (*attention_args.YARN_DEFAULTS,
                                               *attention_args.YARN_FLAGS))
    # Multi-latent attention's YaRN rounds its range in megatron-core: Megatron's flags cannot
    # say otherwise.
    mla = saved_config(multi_latent_attention=True, activation="swiglu", add_bias_linear=False,
                       num_query_groups=4, softmax_type="vanilla", glu_linear_offset=0.0,
                       activation_clamp=0.0, window_size=-1, window_layers=[])
    args = dict(checkpoint_args.model_args({**mla, "rope_yarn_truncate": True}))
    assert args["rope_type"] == "yarn" and args["yarn_correction_range_round_to_int"] is None
    with pytest.raises(ValueError, match="the checkpoint's rope_yarn_truncate is False; "
                                         r"Megatron's --rope-type yarn \(megatron-core's"):
        checkpoint_args.model_args(mla)


def test_use_checkpoint_args_takes_the_gpt_oss_model(tmp_path):
    save_metadata(tmp_path, saved_config())
    data = ["--mock-data", "--seq-length", "32", "--device", "cpu"]
    a = parse_args(["--load", str(tmp_path), "--use-checkpoint-args", *data], 1)
    assert a.quick_geglu and a.softmax_type == "learnable" and a.rope_type == "yarn"
    assert (a.glu_linear_offset, a.activation_func_clamp_value,
            a.yarn_correction_range_round_to_int) == (1.0, 7.0, False)
    notes = "\n".join(a.checkpoint_args)
    for line in ("--quick-geglu True from the checkpoint (the command line: False)",
                 "--softmax-type learnable from the checkpoint (the command line: vanilla)",
                 "--glu-linear-offset 1.0 from the checkpoint (the command line: None)",
                 "--activation-func-clamp-value 7.0 from the checkpoint (the command line: None)",
                 "--yarn-correction-range-round-to-int False from the checkpoint"):
        assert f"braid: {line}" in notes, notes
    assert "--yarn-beta-fast" not in notes, notes  # the default, as the command line's
    # The same model on the command line (Megatron's spelling of YaRN): nothing to say about it.
    a = parse_args(["--load", str(tmp_path), "--use-checkpoint-args", *data, "--num-layers", "2",
                    "--hidden-size", "64", "--num-attention-heads", "4", *GPT_OSS_LAYERS,
                    "--window-size", "7,0"], 1)
    notes = "\n".join(a.checkpoint_args)
    assert "braid: --num-experts 4 from the checkpoint" in notes, notes  # not given here
    for flag in ("geglu", "softmax", "offset", "clamp", "yarn", "mscale", "rotary",
                 "--rope-type", "--position-embedding-type"):
        assert flag not in notes, notes
    # The command line's GPT-OSS flags, loading a plain checkpoint: the checkpoint's model.
    plain = tmp_path / "plain"
    save_metadata(plain, {k: v for k, v in saved_config(
        activation="swiglu", rope_yarn_factor=0.0, window_size=-1, window_layers=[]).items()
        if k not in NEW_KEYS})
    a = parse_args(["--load", str(plain), "--use-checkpoint-args", *data, *GPT_OSS_LAYERS], 1)
    assert a.swiglu and not a.quick_geglu and a.softmax_type == "vanilla"
    assert a.rope_type == "rope" and a.yarn_correction_range_round_to_int is None
    assert (a.glu_linear_offset, a.activation_func_clamp_value) == (None, None)


def test_a_gpt_oss_model_saves_format_version_7_and_comes_back(tmp_path):
    from braid.generate import config_from_metadata
    from braid.training import model_config

    small = [a.replace("2880", "32").replace("127,0", "7,0") for a in GPT_OSS]
    small[small.index("--num-experts") + 1] = "4"
    a = parse(*small, "--vocab-size", "64", "--mock-data", "--seq-length", "16")
    cfg = model_config(a)
    trainer = braid.Trainer(braid.GPTModel(cfg, device="cpu", seed=1), braid.AdamWConfig(),
                            braid.LRSchedule(lr=1e-3, style="constant"))
    braid.save_checkpoint(str(tmp_path), trainer, save_optim=False)
    meta = braid.checkpoint_metadata(str(tmp_path))
    assert meta["format_version"] == 7
    c = meta["config"]
    assert (c["activation"], c["softmax_type"], c["glu_linear_offset"], c["activation_clamp"],
            c["rope_yarn_truncate"]) == ("quick_geglu", "learnable", 1.0, 7.0, False)
    back = parse_args(["--load", str(tmp_path), "--use-checkpoint-args", "--device", "cpu",
                       "--mock-data", "--seq-length", "16"], 1)
    again = model_config(back)
    for field in ("activation", "softmax_type", "glu_linear_offset", "activation_clamp",
                  "rope_yarn_truncate", "rope_yarn_factor", "rope_yarn_beta_fast",
                  "rope_original_max_position_embeddings", "window_size", "num_experts",
                  "add_bias_linear", "kv_channels", "num_parameters"):
        mine, theirs = getattr(cfg, field), getattr(again, field)
        assert (mine() if callable(mine) else mine) == (theirs() if callable(theirs) else theirs)
    assert not checkpoint_args.numerics_warnings(c, again)
    generated = config_from_metadata(c)
    assert all(getattr(generated, k) == c[k] for k in NEW_KEYS)


def test_numerics_warnings_name_the_new_flags():
    from braid.training import model_config

    cfg = model_config(parse(*GPT_OSS_LAYERS))
    saved = saved_config(glu_linear_offset=0.5, activation_clamp=10.0, rope_yarn_truncate=True,
                         rope_yarn_beta_fast=16.0)
    lines = "\n".join(checkpoint_args.numerics_warnings(saved, cfg))
    for words in ("glu_linear_offset 0.5, this run's 1.0 (--glu-linear-offset)",
                  "activation_clamp 10.0, this run's 7.0 (--activation-func-clamp-value)",
                  "rope_yarn_truncate True, this run's False "
                  "(--[no-]yarn-correction-range-round-to-int)",
                  "rope_yarn_beta_fast 16.0, this run's 32.0 (--yarn-beta-fast)"):
        assert words in lines, lines


def test_the_startup_line_names_sinks_quick_geglu_and_unrounded_yarn():
    sinks = types.SimpleNamespace(softmax_type="learnable")
    assert attention_args.describe(sinks) == ", learnable attention sinks (a logit per head)"
    assert attention_args.describe(types.SimpleNamespace(softmax_type="off-by-one")) == \
        ", off-by-one softmax (a zero logit in every row)"
    yarn = dict(rope_yarn_factor=32.0, rope_original_max_position_embeddings=4096,
                rope_yarn_mscale=1.0, rope_yarn_mscale_all_dim=0.0, rope_yarn_beta_fast=32.0,
                rope_yarn_beta_slow=1.0, rope_yarn_truncate=False)
    assert attention_args.describe(types.SimpleNamespace(**yarn)) == (
        ", YaRN RoPE (factor 32 of 4096 positions, mscale 1, mscale_all_dim 0, correction range "
        "not rounded)")
    assert "not rounded" not in attention_args.describe(
        types.SimpleNamespace(**dict(yarn, rope_yarn_truncate=True)))

    def mlp(activation, offset=0.0, clamp=0.0):
        return activation_args.describe(types.SimpleNamespace(
            activation=activation, glu_linear_offset=offset, activation_clamp=clamp))

    assert mlp("quick_geglu", 1.0, 7.0) == ", quick GEGLU MLP (up + 1, clamped at 7)"
    assert mlp("quick_geglu") == ", quick GEGLU MLP"
    assert mlp("swiglu", -0.5) == ", SwiGLU MLP (up - 0.5)"
    assert mlp("swiglu") == mlp("gelu") == mlp("squared_relu") == ""


def shape(activation, **kw):
    return planner.ModelShape(4, 64, 4, 2, 96, 300, 32, activation, **kw)


def test_quick_geglu_counts_as_a_gated_mlp():
    # Three matrices, as SwiGLU: in the MFU's FLOPs, the planner's parameters, GEMMs and
    # activation bytes; an ungated MLP has two.
    for kw in ({}, {"num_experts": 4, "moe_ffn_hidden_size": 32}):
        geglu, swiglu, relu2 = (shape(x, **kw) for x in ("quick_geglu", "swiglu",
                                                         "squared_relu"))
        assert flops.forward_flops_per_token(geglu, 32) == \
            flops.forward_flops_per_token(swiglu, 32) > flops.forward_flops_per_token(relu2, 32)
        assert geglu.layer_params() == swiglu.layer_params() > relu2.layer_params()
        assert planner_moe.mlp_gemms(geglu, 64.0, 2) == planner_moe.mlp_gemms(swiglu, 64.0, 2)
        assert planner_moe.activation_bytes(geglu, 2) == planner_moe.activation_bytes(swiglu, 2)
        assert geglu.gated and swiglu.gated and not relu2.gated and not shape("gelu").gated
    assert activation_args.GATED == ("swiglu", "quick_geglu")


def test_plan_takes_quick_geglu_from_its_flag_and_a_training_command_line():
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import plan

    cluster = ["--gpu", "h100-80g", "--num-gpus", "8", "--nvlink-bw", "450GB/s", "--net-bw",
               "400Gb/s"]
    a = plan.parse_args([*cluster, "--num-layers", "4", "--hidden-size", "64",
                         "--num-attention-heads", "4", "--num-query-groups", "2",
                         "--ffn-hidden-size", "96", "--vocab-size", "300", "--seq-length", "32",
                         "--activation", "quick_geglu", "--global-batch", "8"])
    assert a.model_shape.activation == "quick_geglu" and a.model_shape.gated
    training = [*MODEL[:-2], *GPT_OSS, "--vocab-size", "300", "--mock-data", "--seq-length",
                "128", "--micro-batch-size", "1", "--global-batch-size", "8"]
    a = plan.parse_args([*cluster, "--", *training])
    shape = a.model_shape
    assert shape.activation == "quick_geglu"
    assert (shape.window_size, shape.num_experts) == (127, 32)
    # The planner counts what braid builds: the biases (the router's too), the sinks, the
    # RMSNorms (braid's count has the final norm, the planner's not).
    from braid.training import model_config
    assert shape.linear_biases and not shape.layernorm and shape.softmax_type == "learnable"
    built = model_config(parse_args(training, 1, check_files=False)).num_parameters()
    assert shape.num_params() + 64 == built
    assert dataclasses.replace(shape, softmax_type="vanilla").num_params() == \
        built - 64 - 2 * 4  # a sink per head and layer
    biases = 2 * (4 * 64 + 2 * 2 * 64 + 64 + 32 * (2 * 2880 + 64) + 32)  # q k v o, experts, router
    assert dataclasses.replace(shape, add_bias_linear=False).num_params() == \
        built - 64 - biases
    assert dataclasses.replace(shape, normalization="LayerNorm").num_params() == \
        built - 64 + 2 * 2 * 64  # each layer's two norms with a bias


def test_a_router_saved_before_its_bias_loads_with_a_bias_of_zeros(tmp_path):
    """A model with experts and biases saved before format 7 has no mlp.gate.bias: it loads
    (parameters and optimizer state) with a bias of zeros, the router it was saved with."""
    import json
    import numpy as np

    cfg = braid.TransformerConfig.preset("gpt2-tiny")
    cfg.num_layers, cfg.num_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size = 2, 4, 2, 32
    assert cfg.add_bias_linear
    saved = braid.GPTModel(cfg, device="cpu", seed=1)
    trainer = braid.Trainer(saved, braid.AdamWConfig(),
                            braid.LRSchedule(lr=1e-3, style="constant"))
    braid.save_checkpoint(str(tmp_path), trainer)
    meta_path = tmp_path / braid.iteration_directory(str(tmp_path), 0) / "metadata.json"
    meta = json.loads(meta_path.read_text())
    biases = [k for k in meta["tensors"] if k.endswith(".mlp.gate.bias")]
    assert len(biases) == 3 * cfg.num_layers  # the value, exp_avg and exp_avg_sq
    for key in biases:
        del meta["tensors"][key]
    # As a format-6 writer saved it; a format-7 one must have the bias.
    for version, loads in ((6, True), (7, False)):
        meta["format_version"] = version
        meta_path.write_text(json.dumps(meta))
        loaded = braid.GPTModel(cfg, device="cpu", seed=2)
        again = braid.Trainer(loaded, braid.AdamWConfig(),
                              braid.LRSchedule(lr=1e-3, style="constant"))
        if not loads:
            with pytest.raises(ValueError, match="has no tensor model.layers.0.mlp.gate.bias"):
                braid.load_checkpoint(str(tmp_path), again)
            continue
        braid.load_checkpoint(str(tmp_path), again)
        for name, value in loaded.parameters().items():
            got = np.from_dlpack(value)
            want = np.zeros_like(got) if name.endswith(".mlp.gate.bias") \
                else np.from_dlpack(saved.parameters()[name])
            assert np.array_equal(got, want), name
        # The converters read it so too (tools/convert_hf.py's reader, also convert_megatron's).
        sys.path.insert(0, os.path.join(REPO, "tools"))
        import convert_hf

        _, tensors = convert_hf.read_checkpoint(str(tmp_path))
        for layer in range(cfg.num_layers):
            bias = tensors[f"model.layers.{layer}.mlp.gate.bias"]
            assert bias.array.shape == (cfg.num_experts,) and not bias.array.any()
