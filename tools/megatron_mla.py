"""Multi-latent attention and its YaRN RoPE between Megatron-LM and braid
(docs/convert_megatron.md): megatron-core's MLASelfAttention tensors <-> braid's (HF
DeepSeek-V3's) names; Megatron-LM's --multi-latent-attention, --q-lora-rank, --kv-lora-rank,
--qk-head-dim, --qk-pos-emb-head-dim, --v-head-dim, --rope-type, --rotary-scaling-factor,
--mscale, --mscale-all-dim <-> braid's config.

The layouts are braid's: linear_q_up_proj's (linear_q_proj's) rows are per head qk_head_dim
channels then qk_pos_emb_head_dim RoPE channels (q_b_proj, q_proj), linear_kv_down_proj's the
latent's kv_lora_rank rows then the key's RoPE rows (kv_a_proj_with_mqa), linear_kv_up_proj's per
head qk_head_dim key rows then v_head_dim value rows (kv_b_proj). megatron-core's MLA RoPE
(_apply_rotary_pos_emb_bshd with multi_latent_attention) gathers a head's RoPE channels as
[evens | odds] and turns channel i with i + R/2 at frequency i: the pairs (2i, 2i + 1) braid's MLA
turns in place, at the same frequencies, its output permuted alike in q and k (their products are
braid's), so the weights move unpermuted. Its softmax scale is 1/sqrt(qk_head_dim +
qk_pos_emb_head_dim) times g(mscale_all_dim)^2 (g(m) = 0.1 m ln(rotary_scaling_factor) + 1, 1 for
a factor <= 1), with plain RoPE too; braid's with YaRN only.

Norm names: the local layer spec names the latent norms self_attention.q_layernorm and
kv_layernorm and the layer's input_layernorm and pre_mlp_layernorm; Transformer Engine's spec
fuses the latent norms into linear_q_up_proj / linear_kv_up_proj (layer_norm_weight) and, in a
dense layer, the pre-MLP norm into mlp.linear_fc1. Export writes each under both; import takes
either (the same norm)."""

from hf_configs import NO_ROPE_SCALING, ConvertError, as_f32, check, f32_value, yarn_mscale
from megatron_mlp import arg

# MLATransformerConfig's values where Megatron-LM's args lack a field (its YaRN's original context
# and betas have no Megatron-LM flag); the ranks' where an older Megatron-LM had no flag.
MLA_CONFIG_DEFAULTS = {"q_lora_rank": 512, "kv_lora_rank": 512, "qk_head_dim": 128,
                       "qk_pos_emb_head_dim": 64, "v_head_dim": 128, "rotary_scaling_factor": 40.0,
                       "mscale": 1.0, "mscale_all_dim": 0.0,
                       "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                       "beta_slow": 1.0}
WIDTHS = ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")

ATTN = "self_attention."
# Per layer with multi-latent attention: braid's name (after model.layers.{i}.) -> megatron-core's
# (after decoder.layers.); export writes every one, import reads any (the same tensor).
LATENT_NAMES = {
    "input_layernorm.weight": ("input_layernorm.weight",),
    "input_layernorm.bias": ("input_layernorm.bias",),
    "self_attn.q_proj.weight": (ATTN + "linear_q_proj.weight",),
    "self_attn.q_a_proj.weight": (ATTN + "linear_q_down_proj.weight",),
    "self_attn.q_b_proj.weight": (ATTN + "linear_q_up_proj.weight",),
    "self_attn.q_a_layernorm.weight": (ATTN + "linear_q_up_proj.layer_norm_weight",
                                       ATTN + "q_layernorm.weight"),
    "self_attn.q_a_layernorm.bias": (ATTN + "linear_q_up_proj.layer_norm_bias",
                                     ATTN + "q_layernorm.bias"),
    "self_attn.kv_a_proj_with_mqa.weight": (ATTN + "linear_kv_down_proj.weight",),
    "self_attn.kv_a_layernorm.weight": (ATTN + "linear_kv_up_proj.layer_norm_weight",
                                        ATTN + "kv_layernorm.weight"),
    "self_attn.kv_a_layernorm.bias": (ATTN + "linear_kv_up_proj.layer_norm_bias",
                                      ATTN + "kv_layernorm.bias"),
    "self_attn.kv_b_proj.weight": (ATTN + "linear_kv_up_proj.weight",),
    "self_attn.o_proj.weight": (ATTN + "linear_proj.weight",),
    "post_attention_layernorm.weight": ("mlp.linear_fc1.layer_norm_weight",
                                        "pre_mlp_layernorm.weight"),
    "post_attention_layernorm.bias": ("mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias"),
}


def latent_extra_state_modules(c):
    """The modules of an MLA layer's attention that have an _extra_state under the local or the
    Transformer Engine spec (TE's input norm is a module of its own there)."""
    q = ("linear_q_down_proj", "linear_q_up_proj") if c.get("q_lora_rank") else ("linear_q_proj",)
    return tuple(ATTN + m for m in q + ("linear_kv_down_proj", "linear_kv_up_proj", "linear_proj",
                                        "core_attention")) + ("input_layernorm",)


# ---- Megatron-LM's arguments -> braid's config -----------------------------------------------

def mla_value(args, name):
    """args.name as core_transformer_config_from_args hands it to MLATransformerConfig (None
    kept: q_lora_rank None is no query latent), the config's default where args lack it."""
    return getattr(args, name) if hasattr(args, name) else MLA_CONFIG_DEFAULTS[name]


def refuse(name, value, why, where):
    raise ConvertError(f"{where}: args.{name} = {value!r} is not supported ({why})")


def latent_config_from_args(args, position, where):
    """braid's attention and RoPE fields for Megatron-LM's args with --multi-latent-attention
    ({} without), over the ones braid_config_from_args derives; ConvertError for what braid's
    multi-latent attention does not compute as megatron-core's MLASelfAttention does."""
    if not arg(args, "multi_latent_attention", False):
        return {}
    heads = args.num_attention_heads
    if position != "rope":
        refuse("position_embedding_type", position, "megatron-core then adds learned position "
               "embeddings besides MLA's RoPE; braid's multi-latent attention has its RoPE alone",
               where)
    if arg(args, "add_bias_linear", True):
        refuse("add_bias_linear", True, "biases on the attention's output and the MLPs; braid's "
               "multi-latent attention has no linear biases (--disable-bias-linear)", where)
    if arg(args, "rotary_interleaved", False):
        refuse("rotary_interleaved", True, "megatron-core refuses it with multi-latent "
               "attention", where)
    if arg(args, "group_query_attention", False) and args.num_query_groups != heads:
        refuse("num_query_groups", args.num_query_groups, f"multi-latent attention gives each of "
               f"the {heads} heads its own key and value", where)
    widths = {}
    for name in WIDTHS:
        value = mla_value(args, name)
        check(isinstance(value, int) and value > 0, f"{where}: args.{name} should be a positive "
              f"integer, is {value!r}")
        widths[name] = value
    q_rank = mla_value(args, "q_lora_rank")
    check(q_rank is None or (isinstance(q_rank, int) and q_rank > 0), f"{where}: "
          f"args.q_lora_rank should be None or a positive integer, is {q_rank!r}")
    dn, dr, dv = widths["qk_head_dim"], widths["qk_pos_emb_head_dim"], widths["v_head_dim"]
    if dr % 2:
        refuse("qk_pos_emb_head_dim", dr, "RoPE turns pairs of channels", where)
    if dv > dn + dr:
        refuse("v_head_dim", dv, f"wider than the query and key heads ({dn + dr}); braid's "
               "attention runs the value heads padded to their width", where)
    return {"multi_latent_attention": True, "q_lora_rank": q_rank or 0, **widths,
            "kv_channels": dn + dr, "num_query_groups": heads,
            "add_qkv_bias": False, "rotary_interleaved": False,
            **latent_rope_from_args(args, where)}


def latent_rope_from_args(args, where):
    """braid's RoPE fields for MLA's RoPE (args.rope_type: rope, or yarn, MLATransformerConfig's
    default where None). megatron-core builds MLA's RoPE itself: the GPT model's RoPE arguments
    (--use-rope-scaling, --rotary-seq-len-interpolation-factor) build nothing, nor does
    --rotary-percent with YaRN."""
    kind = arg(args, "rope_type", "yarn")
    if kind not in ("rope", "yarn"):
        refuse("rope_type", kind, "megatron-core's MLA turns rope or yarn", where)
    factor, mscale, all_dim = (mla_value(args, n) for n in ("rotary_scaling_factor", "mscale",
                                                            "mscale_all_dim"))
    for name, value in (("rotary_scaling_factor", factor), ("mscale", mscale),
                        ("mscale_all_dim", all_dim)):
        check(isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0,
              f"{where}: args.{name} should be a number >= 0, is {value!r}")
    rope = dict(NO_ROPE_SCALING, rope_theta=as_f32(arg(args, "rotary_base", 10000)))
    if kind == "rope":
        if arg(args, "rotary_percent", 1.0) != 1.0:
            refuse("rotary_percent", args.rotary_percent, "braid's multi-latent attention turns "
                   "every one of the qk_pos_emb_head_dim channels", where)
        if yarn_mscale(factor, all_dim) != 1.0:
            refuse("mscale_all_dim", all_dim, f"with plain RoPE megatron-core's MLA still scales "
                   f"its softmax by g(mscale_all_dim)^2 for rotary_scaling_factor {factor}; "
                   "braid's only with YaRN", where)
        return rope
    if factor < 1:
        refuse("rotary_scaling_factor", factor, "braid's YaRN stretches the original context by "
               "a factor >= 1", where)
    fast, slow = mla_value(args, "beta_fast"), mla_value(args, "beta_slow")
    check(0 < slow <= fast, f"{where}: args.beta_slow {slow} should be positive and at most "
          f"args.beta_fast {fast}")
    original = mla_value(args, "original_max_position_embeddings")
    check(isinstance(original, int) and original > 0, f"{where}: "
          f"args.original_max_position_embeddings should be a positive integer, is {original!r}")
    return dict(rope, rope_yarn_factor=as_f32(factor), rope_yarn_beta_fast=as_f32(fast),
                rope_yarn_beta_slow=as_f32(slow), rope_yarn_mscale=as_f32(mscale),
                rope_yarn_mscale_all_dim=as_f32(all_dim),
                rope_original_max_position_embeddings=original)


# ---- braid's config -> Megatron-LM's arguments -----------------------------------------------

def megatron_latent_args(c):
    """Megatron-LM's MLA and RoPE-type arguments for a braid config (multi_latent_attention
    false and Megatron-LM's defaults without MLA, whose YaRN is megatron_gpt_oss.py's);
    ConvertError where megatron-core's MLA would compute another model."""
    yarn = bool(c.get("rope_yarn_factor"))
    if not c.get("multi_latent_attention"):
        return {"multi_latent_attention": False, "rope_type": None}
    check(not yarn or c.get("rope_yarn_truncate", True), "this braid model has multi-latent "
          "attention with YaRN's correction range unrounded (rope_yarn_truncate false); "
          "megatron-core's MLA rounds it (its YarnRotaryEmbedding's default)")
    check(not c.get("rope_linear_factor") and not c.get("rope_scaling_factor"),
          "this braid model has multi-latent attention with linear RoPE interpolation or Llama "
          "3.1's scaling; megatron-core's MLA turns plain RoPE or YaRN")
    args = {"multi_latent_attention": True, "q_lora_rank": c["q_lora_rank"] or None,
            **{name: c[name] for name in WIDTHS}, "rope_type": "yarn" if yarn else "rope",
            # Megatron-LM's defaults: plain RoPE's softmax scale unchanged (g = 1)
            "rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
    if yarn:
        fixed = (c["rope_original_max_position_embeddings"], c["rope_yarn_beta_fast"],
                 c["rope_yarn_beta_slow"])
        check(fixed == (4096, 32.0, 1.0), "this braid model's YaRN has original context, "
              f"beta_fast and beta_slow {fixed}; Megatron-LM has no flag for them: "
              "megatron-core's MLATransformerConfig fixes (4096, 32, 1)")
        args.update(rotary_scaling_factor=f32_value(c["rope_yarn_factor"]),
                     mscale=f32_value(c["rope_yarn_mscale"]),
                     mscale_all_dim=f32_value(c["rope_yarn_mscale_all_dim"]))
    return args
