"""The MLP's gated activations beyond --swiglu as Megatron's arguments give them
(docs/arguments.md):

--quick-geglu                     gate sigmoid(1.702 gate) * up (GPT-OSS's; TransformerConfig
                                  activation "quick_geglu"), gated like --swiglu
--glu-linear-offset B             a gated activation's act(gate) * (up + B) (GPT-OSS: 1;
                                  TransformerConfig.glu_linear_offset)
--activation-func-clamp-value C   a gated activation's gate clamped to at most C and up to
                                  [-C, C] before they meet (GPT-OSS's swiglu_limit 7;
                                  TransformerConfig.activation_clamp)

Megatron ignores the last two without a gated activation; braid refuses them there, before MPI,
naming the flags (TransformerConfig.validate checks the rule again). Megatron keeps
--ffn-hidden-size's default of 4 x hidden with --quick-geglu (its 2/3 rule is --swiglu's), and
so does braid."""

from __future__ import annotations

import math

# TransformerConfig's gated activations (its gated_activation()): fc1 is [gate; up], and the MLP
# has three matrices.
GATED = ("swiglu", "quick_geglu")


def add_arguments(g):
    g.add_argument("--quick-geglu", action="store_true",
                   help="the quick GEGLU MLP, gate sigmoid(1.702 gate) * up (GPT-OSS's), gated "
                        "like --swiglu; --ffn-hidden-size's default stays 4 x hidden")
    g.add_argument("--glu-linear-offset", type=float, default=None,
                   help="with --swiglu or --quick-geglu: act(gate) * (up + offset) (GPT-OSS: 1; "
                        "default 0)")
    g.add_argument("--activation-func-clamp-value", type=float, default=None,
                   help="with --swiglu or --quick-geglu: the gate clamped to at most this and "
                        "up to [-this, this] (GPT-OSS: 7; default: no clamp)")


def gated(a) -> bool:
    """Whether the arguments' MLP is gated (--swiglu or --quick-geglu)."""
    return a.swiglu or a.quick_geglu


def check(a) -> str | None:
    """What is wrong with the run's activation arguments, or None."""
    for other in ("swiglu", "squared_relu"):
        if a.quick_geglu and getattr(a, other):
            return (f"--quick-geglu and --{other.replace('_', '-')} are two activations; give "
                    "one")
    offset, clamp = a.glu_linear_offset, a.activation_func_clamp_value
    if offset is not None and not math.isfinite(offset):
        return f"--glu-linear-offset must be finite, got {offset}"
    if clamp is not None and not (clamp > 0 and math.isfinite(clamp)):
        return (f"--activation-func-clamp-value must be > 0 and finite, got {clamp} (omit it "
                "for no clamp)")
    if not gated(a):
        flag = ("--glu-linear-offset" if offset is not None else
                "--activation-func-clamp-value" if clamp is not None else None)
        if flag is not None:
            return (f"{flag} needs a gated activation (--swiglu or --quick-geglu): it acts on "
                    "the gate and up projections of one (Megatron ignores it without)")
    return None


def configure(cfg, a):
    """Sets the TransformerConfig's GLU offset and clamp from checked arguments (neither when not
    given, so a config of a build before them stays as it was); the activation itself is
    megatron_flags.activation's."""
    if a.glu_linear_offset:
        cfg.glu_linear_offset = a.glu_linear_offset
    if a.activation_func_clamp_value is not None:
        cfg.activation_clamp = a.activation_func_clamp_value


def describe(cfg) -> str:
    """The startup line's words for a quick GEGLU MLP or a gated one with an offset or a clamp
    ("" otherwise)."""
    offset = getattr(cfg, "glu_linear_offset", 0.0)
    clamp = getattr(cfg, "activation_clamp", 0.0)
    if cfg.activation not in GATED or (cfg.activation == "swiglu" and not (offset or clamp)):
        return ""
    name = "quick GEGLU" if cfg.activation == "quick_geglu" else "SwiGLU"
    extras = ([f"up {'+' if offset > 0 else '-'} {abs(offset):g}"] if offset else []) + \
        ([f"clamped at {clamp:g}"] if clamp else [])
    return f", {name} MLP" + (f" ({', '.join(extras)})" if extras else "")
