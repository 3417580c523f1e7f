"""pretrain_gpt.py's activation recomputation arguments: Megatron's --recompute-granularity
(and its shorthand --recompute-activations), --recompute-method, --recompute-num-layers and
megatron-core's --recompute-modules, checked against each other (training.py turns them into
TransformerConfig's recompute fields)."""

from __future__ import annotations

import argparse
from typing import Callable

# megatron-core's selective recomputation modules, and those braid's selective policy
# recomputes (all of them at once: TransformerConfig's Recompute::selective; mla_up_proj is
# TransformerConfig.recompute_mla_up_proj on top).
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe",
                     "shared_experts")
SELECTIVE_MODULES = {"core_attn", "moe_act", "layernorm"}


def add_arguments(g, pos_int):
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"])
    g.add_argument("--recompute-activations", action="store_true",
                   help="Megatron's shorthand for --recompute-granularity selective (not with "
                        "--recompute-granularity full)")
    g.add_argument("--recompute-modules", nargs="+", default=None, choices=RECOMPUTE_MODULES,
                   help="with --recompute-granularity selective, megatron-core's parts to "
                        "recompute: braid's selective recomputes core_attn, layernorm and "
                        "moe_act together (any subset of them is that); mla_up_proj adds "
                        "multi-latent attention's up projections and RoPE")
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"],
                   help="with --recompute-granularity full: uniform - each model chunk's layers "
                        "in groups of --recompute-num-layers, only a group's input kept; "
                        "block - the first --recompute-num-layers layers of each chunk only "
                        "(default: uniform, groups of 1)")
    g.add_argument("--recompute-num-layers", type=pos_int, default=None,
                   help="layers per uniform group, or recomputed per chunk by block (default 1)")


def validate(a: argparse.Namespace, check: Callable[[bool, str], None]):
    """check(ok, message) raises the argument error."""
    # Megatron's validate_args sets selective over whatever --recompute-granularity says;
    # braid refuses the one combination where that would silently drop the full granularity.
    if getattr(a, "recompute_activations", False):  # tools/plan.py's arguments lack it
        check(a.recompute_granularity != "full",
              "--recompute-activations is Megatron's shorthand for --recompute-granularity "
              "selective (Megatron would drop full for it); give one of them")
        a.recompute_granularity = "selective"
    modules = set(a.recompute_modules or ())
    check(a.recompute_modules is None or a.recompute_granularity == "selective",
          "--recompute-modules needs --recompute-granularity selective")
    check("mla_up_proj" not in modules or a.multi_latent_attention,
          "--recompute-modules mla_up_proj needs --multi-latent-attention")
    other = sorted(modules - SELECTIVE_MODULES - {"mla_up_proj"})
    check(not other, f"--recompute-modules {' '.join(other)}: braid's selective recomputation "
          "reruns flash attention's core, both norms and the MLP activation (core_attn, "
          "layernorm, moe_act; and mla_up_proj if asked) and keeps the rest; recompute whole "
          "layers with --recompute-granularity full")
    check(a.recompute_method is None or a.recompute_granularity == "full",
          f"--recompute-method {a.recompute_method} needs --recompute-granularity full "
          "(selective recomputation works inside every layer)")
    check(a.recompute_num_layers is None or a.recompute_method is not None,
          "--recompute-num-layers needs --recompute-method uniform or block")
