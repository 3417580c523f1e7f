"""Multi-latent attention as Megatron's arguments give it (docs/arguments.md):

--multi-latent-attention      DeepSeek-V2/V3's attention (TransformerConfig.multi_latent_attention):
                              keys and values from one compressed latent per token
--q-lora-rank R               the queries' own latent of R (q_a_proj, q_b_proj); default none:
                              q_proj straight from the hidden state
--kv-lora-rank R              the keys' and values' latent (default 32)
--qk-head-dim D               each query and key head's channels without RoPE (default 128; HF's
                              qk_nope_head_dim)
--qk-pos-emb-head-dim D       and with RoPE (default 64; HF's qk_rope_head_dim)
--v-head-dim D                each value head's width (default 128)
--rope-type rope              plain RoPE; yarn (Megatron's default for MLA) is not implemented

The defaults are Megatron-LM's command line's (megatron/training/arguments.py, _add_mla_args),
not megatron-core's MLATransformerConfig's (ranks of 512). TransformerConfig.validate checks the
model's rules again; these are refused here, before MPI, naming the flags."""

from __future__ import annotations

# Megatron's --kv-lora-rank, --qk-head-dim, --qk-pos-emb-head-dim, --v-head-dim defaults. The
# arguments default to None so that one given without --multi-latent-attention is refused.
DEFAULTS = {"kv_lora_rank": 32, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64, "v_head_dim": 128}
RANKS_AND_WIDTHS = ("q_lora_rank", *DEFAULTS)

YARN = ("braid does not implement YaRN, which would need its interpolated RoPE frequencies "
        "(--rotary-scaling-factor, beta fast and slow, the original context length) and its "
        "attention-scale correction (--mscale, --mscale-all-dim)")


def add_arguments(g, pos_int):
    g.add_argument("--multi-latent-attention", action="store_true",
                   help="DeepSeek-V2/V3's multi-latent attention: keys and values expanded per "
                        "head from one compressed latent per token (needs --rope-type rope, "
                        "--position-embedding-type rope and --disable-bias-linear)")
    g.add_argument("--q-lora-rank", type=pos_int, default=None,
                   help="with --multi-latent-attention: the queries' latent rank (q_a_proj, "
                        "q_b_proj); default none: q_proj from the hidden state")
    g.add_argument("--kv-lora-rank", type=pos_int, default=None,
                   help=f"the keys' and values' latent rank (default {DEFAULTS['kv_lora_rank']})")
    g.add_argument("--qk-head-dim", type=pos_int, default=None,
                   help="each query and key head's channels without RoPE (HF's qk_nope_head_dim; "
                        f"default {DEFAULTS['qk_head_dim']})")
    g.add_argument("--qk-pos-emb-head-dim", type=pos_int, default=None,
                   help="each query and key head's RoPE channels (HF's qk_rope_head_dim; default "
                        f"{DEFAULTS['qk_pos_emb_head_dim']})")
    g.add_argument("--v-head-dim", type=pos_int, default=None,
                   help=f"each value head's width (default {DEFAULTS['v_head_dim']})")
    g.add_argument("--rope-type", default=None, choices=["rope", "yarn"],
                   help="rope: plain RoPE (ordinary attention's only kind); yarn, Megatron's "
                        "default with --multi-latent-attention, is not implemented")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check(a) -> str | None:
    """What is wrong with the run's attention-kind arguments, or None. With
    --multi-latent-attention fills in Megatron's default ranks and widths and sets kv_channels
    to the query/key head width (qk_head_dim + qk_pos_emb_head_dim, what checkpoints save)."""
    if a.rope_type == "yarn":
        return (f"--rope-type yarn is not supported: {YARN}; --rope-type rope is plain RoPE"
                + ("" if a.multi_latent_attention else " (Megatron's ordinary attention takes "
                                                       "rope only)"))
    if not a.multi_latent_attention:
        for dest in RANKS_AND_WIDTHS:
            if getattr(a, dest) is not None:
                return f"{_flag(dest)} needs --multi-latent-attention"
        return None
    if a.rope_type is None:
        return ("--multi-latent-attention without --rope-type is YaRN RoPE in Megatron "
                "(megatron-core's MLATransformerConfig.rope_type defaults to yarn), and "
                f"{YARN}: pass --rope-type rope for plain RoPE")
    for dest, default in DEFAULTS.items():
        if getattr(a, dest) is None:
            setattr(a, dest, default)
    heads = a.num_attention_heads
    refusals = (
        (a.position_embedding_type != "rope",
         f"--multi-latent-attention needs --position-embedding-type rope (with "
         f"{a.position_embedding_type}, Megatron's default, megatron-core adds learned position "
         "embeddings besides MLA's RoPE; braid's MLA has its RoPE alone)"),
        (not a.disable_bias_linear,
         "--multi-latent-attention needs --disable-bias-linear: braid's multi-latent attention "
         "has no linear biases (Megatron adds them by default; DeepSeek's recipes pass "
         "--disable-bias-linear)"),
        (a.add_qkv_bias, "--add-qkv-bias with --multi-latent-attention: braid's multi-latent "
                         "attention has no biases"),
        (a.kv_channels is not None,
         f"--kv-channels {a.kv_channels} with --multi-latent-attention: the heads' widths are "
         "--qk-head-dim + --qk-pos-emb-head-dim (queries, keys) and --v-head-dim (values)"),
        (a.group_query_attention and a.num_query_groups != heads,
         f"--num-query-groups {a.num_query_groups} with --multi-latent-attention: every head "
         f"has its own key and value (expanded from the latent), so it must be "
         f"--num-attention-heads {heads} (or leave out --group-query-attention)"),
        (a.rotary_percent != 1.0,
         f"--rotary-percent {a.rotary_percent} with --multi-latent-attention: RoPE turns every "
         "one of the --qk-pos-emb-head-dim channels"),
        (a.use_rope_scaling,
         "--use-rope-scaling with --multi-latent-attention: megatron-core builds MLA's RoPE "
         "without Llama 3.1's scaling"),
        (a.qk_pos_emb_head_dim % 2 != 0,
         f"--qk-pos-emb-head-dim {a.qk_pos_emb_head_dim} must be even: RoPE turns pairs of "
         "channels"),
        (a.v_head_dim > a.qk_head_dim + a.qk_pos_emb_head_dim,
         f"--v-head-dim {a.v_head_dim} exceeds --qk-head-dim {a.qk_head_dim} + "
         f"--qk-pos-emb-head-dim {a.qk_pos_emb_head_dim}: braid's attention runs the value "
         "heads padded to the query/key width"),
    )
    for refused, message in refusals:
        if refused:
            return message
    a.kv_channels = a.qk_head_dim + a.qk_pos_emb_head_dim
    return None


def command_line_default(a, dest: str):
    """What the command line's None means for `dest` (compared with a checkpoint's value by
    --use-checkpoint-args): the head width hidden / heads for kv_channels, Megatron's MLA
    defaults for the latent ranks and head widths."""
    if dest == "kv_channels":
        return a.hidden_size // a.num_attention_heads
    return DEFAULTS.get(dest)


def configure(cfg, a):
    """Sets the TransformerConfig's multi-latent attention fields from checked arguments (none
    without --multi-latent-attention, so a config of a build before them stays as it was)."""
    if not a.multi_latent_attention:
        return
    cfg.multi_latent_attention = True
    cfg.q_lora_rank = a.q_lora_rank or 0
    cfg.kv_lora_rank = a.kv_lora_rank
    cfg.qk_head_dim = a.qk_head_dim
    cfg.qk_pos_emb_head_dim = a.qk_pos_emb_head_dim
    cfg.v_head_dim = a.v_head_dim
    cfg.kv_channels = 0  # the widths above give the heads'


def describe(cfg) -> str:
    """The startup line's words for a model with multi-latent attention ("" without)."""
    if not getattr(cfg, "multi_latent_attention", False):
        return ""
    q = f"q_lora_rank {cfg.q_lora_rank}" if cfg.q_lora_rank else "no query latent"
    return (f", multi-latent attention ({q}, kv_lora_rank {cfg.kv_lora_rank}, qk_head_dim "
            f"{cfg.qk_head_dim}, qk_pos_emb_head_dim {cfg.qk_pos_emb_head_dim}, v_head_dim "
            f"{cfg.v_head_dim})")
