"""Multi-latent attention and RoPE's kind as Megatron's arguments give them (docs/arguments.md):

--multi-latent-attention      DeepSeek-V2/V3's attention (TransformerConfig.multi_latent_attention):
                              keys and values from one compressed latent per token
--q-lora-rank R               the queries' own latent of R (q_a_proj, q_b_proj); default none:
                              q_proj straight from the hidden state
--kv-lora-rank R              the keys' and values' latent (default 32)
--qk-head-dim D               each query and key head's channels without RoPE (default 128; HF's
                              qk_nope_head_dim)
--qk-pos-emb-head-dim D       and with RoPE (default 64; HF's qk_rope_head_dim)
--v-head-dim D                each value head's width (default 128)
--rope-type rope|yarn         plain RoPE or YaRN; default yarn with --multi-latent-attention (as
                              megatron-core's MLATransformerConfig), else rope
--rotary-scaling-factor S     YaRN's factor (default 1)
--mscale M, --mscale-all-dim A  YaRN's attention factors (default 1 and 0): cos and sin times
                              g(M) / g(A), and with multi-latent attention the softmax scale
                              times g(A)^2, g(m) = 0.1 m ln(S) + 1 (1 for S <= 1)

--position-embedding-type yarn  newer Megatron's spelling of RoPE with YaRN (GPT-OSS's): read
                              as --position-embedding-type rope --rope-type yarn
--yarn-original-max-position-embeddings L, --yarn-beta-fast F, --yarn-beta-slow S,
--[no-]yarn-correction-range-round-to-int
                              YaRN's original context, its two rotation counts and whether its
                              correction range is floored and ceiled (defaults 4096, 32, 1, yes;
                              TransformerConfig.rope_original_max_position_embeddings,
                              rope_yarn_beta_fast, rope_yarn_beta_slow, rope_yarn_truncate)
--softmax-type vanilla|off-by-one|learnable
                              each head's softmax: plain, with one more logit of 0, or with a
                              learned logit per head (GPT-OSS's sinks;
                              TransformerConfig.softmax_type)

The defaults are Megatron-LM's command line's (megatron/training/arguments.py, _add_mla_args),
not megatron-core's MLATransformerConfig's (ranks of 512, rotary_scaling_factor 40). The --yarn-*
flags set megatron-core's TransformerConfig.yarn_* fields, which only its GPT model's YaRN
(--position-embedding-type yarn) reads: multi-latent attention builds its YaRN from
MLATransformerConfig's fixed 32, 1 and 4096, rounding the range, so they are refused with it.
TransformerConfig.validate checks the model's rules again; these are refused here, before MPI,
naming the flags."""

from __future__ import annotations

import math

# Megatron's --kv-lora-rank, --qk-head-dim, --qk-pos-emb-head-dim, --v-head-dim defaults. The
# arguments default to None so that one given without --multi-latent-attention is refused.
DEFAULTS = {"kv_lora_rank": 32, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64, "v_head_dim": 128}
RANKS_AND_WIDTHS = ("q_lora_rank", *DEFAULTS)
# Megatron's command-line defaults of YaRN's flags (None here: given or not) and the values
# megatron-core fixes where Megatron-LM has no flag (MLATransformerConfig's), as config fields.
YARN_DEFAULTS = {"rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
YARN_FIXED = {"rope_yarn_beta_fast": 32.0, "rope_yarn_beta_slow": 1.0,
              "rope_original_max_position_embeddings": 4096}
# Newer Megatron's --yarn-* flags and their defaults (None here: given or not), and the config
# field each sets; multi-latent attention keeps YARN_FIXED's (and a rounded range).
YARN_FLAGS = {"yarn_original_max_position_embeddings": 4096, "yarn_beta_fast": 32.0,
              "yarn_beta_slow": 1.0, "yarn_correction_range_round_to_int": True}
YARN_FIELDS = {"yarn_original_max_position_embeddings": "rope_original_max_position_embeddings",
               "yarn_beta_fast": "rope_yarn_beta_fast", "yarn_beta_slow": "rope_yarn_beta_slow",
               "yarn_correction_range_round_to_int": "rope_yarn_truncate"}
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def add_arguments(g, pos_int, pos_float, nonneg_float):
    g.add_argument("--multi-latent-attention", action="store_true",
                   help="DeepSeek-V2/V3's multi-latent attention: keys and values expanded per "
                        "head from one compressed latent per token (needs "
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
                   help="rope: plain RoPE; yarn: YaRN's interpolated frequencies and attention "
                        "factors. Default: yarn with --multi-latent-attention (Megatron's), "
                        "else rope")
    g.add_argument("--rotary-scaling-factor", type=pos_float, default=None,
                   help="with --rope-type yarn: YaRN's factor, >= 1 (default "
                        f"{YARN_DEFAULTS['rotary_scaling_factor']:g}, Megatron's; DeepSeek-V3: "
                        "40); its original context is 4096 (megatron-core's)")
    g.add_argument("--mscale", type=nonneg_float, default=None,
                   help="with --rope-type yarn: cos and sin times g(mscale) / g(mscale-all-dim), "
                        "g(m) = 0.1 m ln(factor) + 1 (default "
                        f"{YARN_DEFAULTS['mscale']:g})")
    g.add_argument("--mscale-all-dim", type=nonneg_float, default=None,
                   help="with --rope-type yarn: see --mscale; with --multi-latent-attention also "
                        "the softmax scale times g(mscale-all-dim)^2 (default "
                        f"{YARN_DEFAULTS['mscale_all_dim']:g})")
    g.add_argument("--yarn-original-max-position-embeddings", type=pos_int, default=None,
                   help="with YaRN: the context the model was trained on before it (default "
                        f"{YARN_FLAGS['yarn_original_max_position_embeddings']})")
    g.add_argument("--yarn-beta-fast", type=pos_float, default=None,
                   help="with YaRN: a frequency that turns more often than this over the "
                        "original context keeps its value (default "
                        f"{YARN_FLAGS['yarn_beta_fast']:g})")
    g.add_argument("--yarn-beta-slow", type=pos_float, default=None,
                   help="with YaRN: one that turns less often than this is divided by the "
                        f"factor; those between blend the two (default "
                        f"{YARN_FLAGS['yarn_beta_slow']:g})")
    g.add_argument("--yarn-correction-range-round-to-int", action="store_const", const=True,
                   default=None, help="with YaRN: floor and ceil its correction range (the "
                                      "default; DeepSeek's)")
    g.add_argument("--no-yarn-correction-range-round-to-int",
                   dest="yarn_correction_range_round_to_int", action="store_const", const=False,
                   help="with YaRN: keep its correction range fractional (GPT-OSS's)")
    g.add_argument("--softmax-type", default="vanilla", choices=SOFTMAX_TYPES,
                   help="each attention head's softmax: vanilla; off-by-one, one more logit of 0 "
                        "in every row; learnable, that logit a parameter per head (GPT-OSS's "
                        "sinks)")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _given(a, dest: str) -> str:
    """The flag that set `dest` (--no-yarn-correction-range-round-to-int for its False)."""
    if dest == "yarn_correction_range_round_to_int" and a.yarn_correction_range_round_to_int \
            is False:
        return "--no-yarn-correction-range-round-to-int"
    return _flag(dest)


def take_position_yarn(a) -> str | None:
    """Newer Megatron's --position-embedding-type yarn (RoPE with YaRN) as braid's
    --position-embedding-type rope --rope-type yarn, before --use-checkpoint-args compares them
    with a checkpoint's; what is wrong with it, or None."""
    if a.position_embedding_type != "yarn":
        return None
    if a.multi_latent_attention:
        return ("--position-embedding-type yarn with --multi-latent-attention: multi-latent "
                "attention's YaRN is --position-embedding-type rope with --rope-type yarn (its "
                "default)")
    if a.rope_type == "rope":
        return "--position-embedding-type yarn and --rope-type rope: give one kind of RoPE"
    a.position_embedding_type, a.rope_type = "rope", "yarn"
    a.yarn_spelling = "--position-embedding-type yarn"
    return None


def _check_rope(a) -> str | None:
    """--rope-type and YaRN's flags: sets rope_type (Megatron's default when not given: yarn with
    --multi-latent-attention, else rope) and, with yarn, YaRN's defaults."""
    given = [_given(a, dest) for dest in (*YARN_DEFAULTS, *YARN_FLAGS)
             if getattr(a, dest) is not None]
    defaulted = a.rope_type is None
    if defaulted:
        a.rope_type = "yarn" if a.multi_latent_attention else "rope"
    newer = [_given(a, dest) for dest in YARN_FLAGS if getattr(a, dest) is not None]
    if a.multi_latent_attention and newer:
        return (f"{newer[0]} with --multi-latent-attention: megatron-core's multi-latent "
                "attention builds its YaRN from MLATransformerConfig's beta fast 32, beta slow 1 "
                "and original context 4096, its correction range rounded; the --yarn-* flags "
                "set its GPT model's YaRN (--position-embedding-type yarn) only")
    if a.rope_type == "rope":
        if not given:
            return None
        # The spellings that would then be accepted.
        needs = "--rope-type yarn" if a.multi_latent_attention else \
            "--rope-type yarn or --position-embedding-type yarn" \
            if a.position_embedding_type == "rope" else "--position-embedding-type yarn"
        return (f"{given[0]} is YaRN's: it needs {needs} (plain RoPE has no use for it"
                + ("; megatron-core's MLA would still scale its softmax by it"
                   if given[0] == "--mscale-all-dim" else "") + ")")
    spelling = getattr(a, "yarn_spelling", "--rope-type yarn")
    how = " (--multi-latent-attention's default)" if defaulted else ""
    if a.use_rope_scaling:
        return (f"--use-rope-scaling with {spelling}{how}: Llama 3.1's RoPE scaling and "
                "YaRN exclude each other")
    if a.position_embedding_type != "rope" and not a.multi_latent_attention:
        return (f"--rope-type yarn needs --position-embedding-type rope (with "
                f"{a.position_embedding_type} there is no RoPE to scale)")
    for dest, default in {**YARN_DEFAULTS, **YARN_FLAGS}.items():
        if getattr(a, dest) is None:
            setattr(a, dest, default)
        if not math.isfinite(getattr(a, dest)):
            return f"{_flag(dest)} must be finite"
    if a.rotary_scaling_factor < 1.0:
        return (f"--rotary-scaling-factor {a.rotary_scaling_factor:g} must be >= 1: YaRN "
                "stretches the original context by it")
    if a.yarn_beta_slow > a.yarn_beta_fast:
        return (f"--yarn-beta-slow {a.yarn_beta_slow:g} exceeds --yarn-beta-fast "
                f"{a.yarn_beta_fast:g}: YaRN keeps the frequencies that turn more than beta-fast "
                "times over the original context and divides those under beta-slow, so slow <= "
                "fast")
    return None


def check(a) -> str | None:
    """What is wrong with the run's attention-kind arguments, or None. Sets rope_type and YaRN's
    defaults (_check_rope). With --multi-latent-attention fills in Megatron's default ranks and
    widths and sets kv_channels to the query/key head width (qk_head_dim + qk_pos_emb_head_dim,
    what checkpoints save)."""
    rope_error = _check_rope(a)
    if rope_error is not None:
        return rope_error
    if not a.multi_latent_attention:
        for dest in RANKS_AND_WIDTHS:
            if getattr(a, dest) is not None:
                return f"{_flag(dest)} needs --multi-latent-attention"
        return None
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
        (a.softmax_type != "vanilla",
         f"--softmax-type {a.softmax_type} with --multi-latent-attention: braid's multi-latent "
         "attention computes the vanilla softmax only"),
        (a.rotary_interleaved,
         "--rotary-interleaved with --multi-latent-attention: multi-latent attention pairs its "
         "RoPE channels interleaved already (DeepSeek's), and megatron-core refuses the flag "
         "with it"),
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
    defaults for the latent ranks and head widths, its --rope-type (yarn with
    --multi-latent-attention) and YaRN's flags' defaults."""
    if dest == "kv_channels":
        return a.hidden_size // a.num_attention_heads
    if dest == "rope_type":
        return "yarn" if a.multi_latent_attention else "rope"
    return {**DEFAULTS, **YARN_DEFAULTS, **YARN_FLAGS}.get(dest)


def configure(cfg, a):
    """Sets the TransformerConfig's multi-latent attention, YaRN and softmax fields from checked
    arguments (none without --multi-latent-attention, YaRN or another softmax, so a config of a
    build before them stays as it was)."""
    if a.rope_type == "yarn":  # with multi-latent attention the --yarn-* flags are YARN_FIXED's
        cfg.rope_yarn_factor = a.rotary_scaling_factor
        cfg.rope_yarn_mscale = a.mscale
        cfg.rope_yarn_mscale_all_dim = a.mscale_all_dim
        cfg.rope_original_max_position_embeddings = a.yarn_original_max_position_embeddings
        cfg.rope_yarn_beta_fast = a.yarn_beta_fast
        cfg.rope_yarn_beta_slow = a.yarn_beta_slow
        if not a.yarn_correction_range_round_to_int:
            cfg.rope_yarn_truncate = False
    if a.softmax_type != "vanilla":
        cfg.softmax_type = a.softmax_type
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
    """The startup line's words for a model with multi-latent attention, YaRN, linear RoPE
    interpolation, interleaved RoPE pairs or attention sinks ("" with none)."""
    words = ""
    if getattr(cfg, "multi_latent_attention", False):
        q = f"q_lora_rank {cfg.q_lora_rank}" if cfg.q_lora_rank else "no query latent"
        words += (f", multi-latent attention ({q}, kv_lora_rank {cfg.kv_lora_rank}, qk_head_dim "
                  f"{cfg.qk_head_dim}, qk_pos_emb_head_dim {cfg.qk_pos_emb_head_dim}, v_head_dim "
                  f"{cfg.v_head_dim})")
    if getattr(cfg, "rope_yarn_factor", 0.0) > 0:
        betas = (cfg.rope_yarn_beta_fast, cfg.rope_yarn_beta_slow)
        words += (f", YaRN RoPE (factor {cfg.rope_yarn_factor:g} of "
                  f"{cfg.rope_original_max_position_embeddings} positions, mscale "
                  f"{cfg.rope_yarn_mscale:g}, mscale_all_dim {cfg.rope_yarn_mscale_all_dim:g}"
                  + (f", beta {betas[0]:g} / {betas[1]:g}" if betas != (32.0, 1.0) else "")
                  + (", correction range not rounded" if not getattr(cfg, "rope_yarn_truncate",
                                                                     True) else "") + ")")
    if getattr(cfg, "rope_linear_factor", 0.0) > 0:
        words += f", RoPE positions interpolated by 1/{cfg.rope_linear_factor:g}"
    if getattr(cfg, "rotary_interleaved", False) and not cfg.multi_latent_attention:
        words += ", interleaved RoPE pairs"
    softmax = getattr(cfg, "softmax_type", "vanilla")
    if softmax == "learnable":
        words += ", learnable attention sinks (a logit per head)"
    elif softmax == "off-by-one":
        words += ", off-by-one softmax (a zero logit in every row)"
    return words
