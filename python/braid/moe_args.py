"""Mixture of experts as Megatron's arguments give it (docs/arguments.md):

--num-experts E                    every layer's MLP is E experts (TransformerConfig.num_experts)
--moe-ffn-hidden-size F            each expert's hidden size (default --ffn-hidden-size)
--moe-router-topk K                experts per token (default 2)
--moe-router-score-function S      softmax (default) or sigmoid (DeepSeek-V3)
--moe-router-pre-softmax           softmax over all experts, then the top K (default: the top K
                                   logits, then their softmax: Mixtral's); softmax only
--moe-router-num-groups G          group-limited routing (DeepSeek-V3): the experts form G groups,
--moe-router-group-topk GK         each token's top K come from its GK best groups
--moe-router-topk-scaling-factor X the routing weights times X (DeepSeek's routed_scaling_factor)
--moe-router-enable-expert-bias    aux-loss-free balancing: a per-expert bias added to the sigmoid
--moe-router-bias-update-rate R    scores for the choice only, moved by R after every step
                                   (default 1e-3)
--moe-router-load-balancing-type   aux_loss (default; per microbatch), seq_aux_loss (per
                                   sequence) or none
--moe-aux-loss-coeff C             the load-balancing loss's weight (default 0: off)
--moe-z-loss-coeff C               the router z-loss's weight (default 0: off)
--moe-per-layer-logging            each expert layer's router losses in the metrics too
--moe-shared-expert-intermediate-size S
                                   a shared expert of hidden size S every token goes through
--moe-shared-expert-gate           its output scaled by a sigmoid gate (Qwen2-MoE)
--moe-layer-freq N | "[0]+[1]*23"  which layers have experts: N - layers 0, N, 2N, ... (0-based,
                                   Megatron's rule); a list - one 1 (experts) or 0 (dense) per layer
--moe-expert-capacity-factor F     token dropping: each expert keeps at most ceil(T k / E F) of
--moe-token-drop-policy P          the pairs routed to it, those of the highest probabilities
                                   (probs, default) or the first in token order (position)
--moe-pad-expert-input-to-capacity no effect (Megatron's padding only shapes its buffers)

braid's experts are dropless without a capacity factor (Megatron's default), and without expert
parallelism each expert is split over TP like the dense MLP (Megatron's expert tensor
parallelism at the TP size). The router's arithmetic is ops::MoeRouterSpec's
(include/braid/kernels/ops.h); TransformerConfig.validate checks the same rules again."""

from __future__ import annotations

import math

from braid import window_args

DEFAULT_BIAS_UPDATE_RATE = 1e-3  # Megatron's --moe-router-bias-update-rate default


def add_arguments(g, pos_int, nonneg_float, pos_float):
    g.add_argument("--num-experts", type=pos_int, default=None,
                   help="mixture of experts: every layer's MLP is this many experts, of which "
                        "a router picks --moe-router-topk per token (at most 1024)")
    g.add_argument("--moe-ffn-hidden-size", type=pos_int, default=None,
                   help="each expert's hidden size (default --ffn-hidden-size)")
    g.add_argument("--moe-router-topk", type=pos_int, default=2)
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="softmax over all experts before the top k (OLMoE, Qwen2-MoE); default: "
                        "the softmax of the top k logits (Mixtral, Qwen3-MoE); softmax only")
    g.add_argument("--moe-router-score-function", default="softmax",
                   choices=["softmax", "sigmoid"],
                   help="softmax, or sigmoid (DeepSeek-V3: the top k of sigmoid(logits), "
                        "their weights those scores over their sum)")
    g.add_argument("--moe-router-num-groups", type=pos_int, default=None,
                   help="group-limited routing (DeepSeek-V3): the experts form this many groups "
                        "of consecutive ones; with --moe-router-group-topk")
    g.add_argument("--moe-router-group-topk", type=pos_int, default=None,
                   help="each token's experts come from its this many best groups (a group "
                        "scores the sum of its top --moe-router-topk / this scores)")
    g.add_argument("--moe-router-topk-scaling-factor", type=nonneg_float, default=None,
                   help="multiply the routing weights by this (DeepSeek's routed_scaling_factor; "
                        "default: 1)")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="aux-loss-free load balancing (DeepSeek-V3): a per-expert bias added to "
                        "the sigmoid scores for the choice only, moved after every step towards "
                        "the experts that got fewer tokens; needs --moe-router-score-function "
                        "sigmoid")
    g.add_argument("--moe-router-bias-update-rate", type=nonneg_float, default=None,
                   help="how far each step moves an expert bias (default "
                        f"{DEFAULT_BIAS_UPDATE_RATE:g})")
    # Megatron takes a list of types (and of coefficients), one loss each; braid one of them.
    g.add_argument("--moe-router-load-balancing-type", nargs="+", default="aux_loss",
                   metavar="TYPE", choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"],
                   help="aux_loss (the Switch Transformer loss of each microbatch), seq_aux_loss "
                        "(of each sequence, averaged: DeepSeek-V3's) or none; one type")
    g.add_argument("--moe-aux-loss-coeff", type=nonneg_float, nargs="+", default=0.0,
                   metavar="COEFF",
                   help="the load-balancing loss's coefficient (0: off); one value")
    g.add_argument("--moe-z-loss-coeff", type=nonneg_float, default=None,
                   help="the router z-loss's coefficient (ST-MoE: the mean of "
                        "logsumexp(logits)^2; default: off)")
    g.add_argument("--moe-per-layer-logging", action="store_true",
                   help="also write each expert layer's router losses to the metrics "
                        "(moe/load_balancing_loss_layer_{i}, moe/z_loss_layer_{i}: Megatron's "
                        "names)")
    g.add_argument("--moe-shared-expert-intermediate-size", type=pos_int, default=None,
                   help="a shared expert (an MLP of this hidden size) every token goes through "
                        "besides its routed ones (DeepSeek, Qwen2-MoE)")
    g.add_argument("--moe-shared-expert-gate", action="store_true",
                   help="scale the shared expert's output by sigmoid(x w), w [1, hidden] "
                        "(Qwen2-MoE's shared_expert_gate)")
    g.add_argument("--moe-layer-freq", type=window_args.skip_freq, default=1,
                   help="which layers have experts: N - layers 0, N, 2N, ... (counted from 0); "
                        "or a list, one 1 (experts) or 0 (dense MLP) per layer, e.g. "
                        "\"[0]+[1]*23\"")
    g.add_argument("--moe-expert-capacity-factor", type=pos_float, default=None,
                   help="token dropping: each expert keeps at most ceil(T k / E x this) of the "
                        "(token, choice) pairs routed to it, T the tokens this rank routes in a "
                        "microbatch; the others add nothing to their tokens' outputs (default: "
                        "dropless)")
    # Megatron's default is probs; None tells a given policy from the default.
    g.add_argument("--moe-token-drop-policy", default=None, choices=["probs", "position"],
                   help="which pairs an expert past its capacity drops: those of the lowest "
                        "routing probabilities (probs, the default) or the last in token order "
                        "(position)")
    g.add_argument("--expert-model-parallel-size", type=pos_int, default=1,
                   help="expert parallelism: each group of this many data-parallel ranks splits "
                        "the experts between them and exchanges the tokens routed to them "
                        "(all-to-all); must divide --num-experts and the data-parallel size x "
                        "--context-parallel-size")
    g.add_argument("--expert-tensor-parallel-size", type=pos_int, default=None,
                   help="the TP size (default): each expert is split over the TP group like the "
                        "dense MLP; 1: whole experts, each TP rank routing its own "
                        "sequence-parallel tokens (needs --sequence-parallel), and "
                        "--expert-model-parallel-size dividing TP x DP x CP (Megatron's MoE "
                        "parallel folding)")


def _one_value(a, dest: str) -> str | None:
    """Megatron's list flags (nargs "+") as the one value braid takes: sets it on `a`; what is
    wrong with more than one, or None."""
    value = getattr(a, dest)
    if not isinstance(value, list):
        return None
    if len(value) != 1:
        flag = "--" + dest.replace("_", "-")
        what = {"moe_router_load_balancing_type": "one load-balancing type (aux_loss, "
                                                  "seq_aux_loss or none): Megatron's "
                                                  "combination of several losses is not "
                                                  "implemented",
                "moe_aux_loss_coeff": "one coefficient, that of the one "
                                      "--moe-router-load-balancing-type"}[dest]
        return f"{flag} {' '.join(map(str, value))}: braid takes {what}"
    setattr(a, dest, value[0])
    return None


def check(a, tp: int, data_ranks: int | None = None) -> str | None:
    """What is wrong with the run's mixture-of-experts arguments, or None. Sets Megatron's list
    flags (--moe-router-load-balancing-type, --moe-aux-loss-coeff) to their one value.
    `data_ranks`: the data-parallel size x --context-parallel-size, when known."""
    for dest in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        error = _one_value(a, dest)
        if error:
            return error
    if a.num_experts is None:
        for flag, given in (("--moe-ffn-hidden-size", a.moe_ffn_hidden_size is not None),
                            ("--moe-router-pre-softmax", a.moe_router_pre_softmax),
                            ("--moe-router-score-function sigmoid",
                             a.moe_router_score_function != "softmax"),
                            ("--moe-router-num-groups", a.moe_router_num_groups is not None),
                            ("--moe-router-group-topk", a.moe_router_group_topk is not None),
                            ("--moe-router-topk-scaling-factor",
                             a.moe_router_topk_scaling_factor is not None),
                            ("--moe-router-enable-expert-bias", a.moe_router_enable_expert_bias),
                            ("--moe-router-bias-update-rate",
                             a.moe_router_bias_update_rate is not None),
                            ("--moe-aux-loss-coeff", a.moe_aux_loss_coeff != 0.0),
                            ("--moe-z-loss-coeff", a.moe_z_loss_coeff not in (None, 0.0)),
                            ("--moe-shared-expert-intermediate-size",
                             a.moe_shared_expert_intermediate_size is not None),
                            ("--moe-shared-expert-gate", a.moe_shared_expert_gate),
                            ("--moe-layer-freq", a.moe_layer_freq != 1),
                            ("--moe-expert-capacity-factor",
                             a.moe_expert_capacity_factor is not None),
                            ("--moe-pad-expert-input-to-capacity",
                             a.moe_pad_expert_input_to_capacity),
                            ("--expert-model-parallel-size", a.expert_model_parallel_size != 1)):
            if given:
                return f"{flag} needs --num-experts"
        return None
    if a.num_experts > 1024:
        return f"--num-experts {a.num_experts}: braid's router takes at most 1024 experts"
    if a.moe_router_topk > a.num_experts:
        return (f"--moe-router-topk {a.moe_router_topk} is more than --num-experts "
                f"{a.num_experts}")
    error = _router_error(a) or _dropping_error(a)
    if error:
        return error
    freq = a.moe_layer_freq
    if isinstance(freq, list) and len(freq) != a.num_layers:
        return (f"--moe-layer-freq gives {len(freq)} layers for --num-layers {a.num_layers} "
                "(one entry per layer)")
    layers = moe_layers(freq, a.num_layers)
    if layers and not any(layers):
        return f"--moe-layer-freq {freq} gives no layer experts"
    ep = a.expert_model_parallel_size
    if a.num_experts % ep:
        return (f"--expert-model-parallel-size {ep} does not divide --num-experts "
                f"{a.num_experts}: each expert-parallel rank holds an equal share of the experts")
    etp = a.expert_tensor_parallel_size
    if etp not in (None, tp, 1):
        return (f"--expert-tensor-parallel-size {etp}: braid splits experts over the TP group "
                f"(--tensor-model-parallel-size {tp}) or keeps them whole (1)")
    whole = etp == 1 and tp > 1
    if whole:
        error = _whole_experts_error(a, tp, data_ranks)
        if error:
            return error
    elif data_ranks is not None and data_ranks % ep:
        return (f"--expert-model-parallel-size {ep} does not divide the {data_ranks} data-parallel "
                "x context-parallel ranks: expert parallelism splits them into groups of "
                f"{ep}")
    ffn = a.moe_ffn_hidden_size or a.ffn_hidden_size
    if ffn % tp and not whole:
        return (f"--moe-ffn-hidden-size {ffn} is not divisible by --tensor-model-parallel-size "
                f"{tp}")
    shared = a.moe_shared_expert_intermediate_size
    if a.moe_shared_expert_gate and shared is None:
        return "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size"
    if shared is not None and shared % tp:
        return (f"--moe-shared-expert-intermediate-size {shared} is not divisible by "
                f"--tensor-model-parallel-size {tp}")
    return None


def _whole_experts_error(a, tp: int, data_ranks: int | None) -> str | None:
    """What is wrong with --expert-tensor-parallel-size 1 under TP, or None."""
    ep = a.expert_model_parallel_size
    if not a.sequence_parallel:
        return (f"--expert-tensor-parallel-size 1 with --tensor-model-parallel-size {tp} needs "
                "--sequence-parallel: each TP rank routes its own share of the tokens through "
                "whole experts")
    if data_ranks is not None and (tp * data_ranks) % ep:
        return (f"--expert-model-parallel-size {ep} does not divide the {tp * data_ranks} "
                "tensor x data x context-parallel ranks: with --expert-tensor-parallel-size 1 "
                f"expert parallelism splits them into groups of {ep}")
    runs = a.micro_batch_size * (2 if a.context_parallel_size > 1 else 1)
    if (a.moe_router_load_balancing_type == "seq_aux_loss" and a.moe_aux_loss_coeff
            and runs % tp and tp % runs):
        return (f"--moe-router-load-balancing-type seq_aux_loss with --expert-tensor-parallel-size"
                f" 1: each of the {tp} TP ranks' token shards must hold whole sequences "
                f"(context-parallel chunks) or lie within one; --micro-batch-size "
                f"{a.micro_batch_size} gives {runs}, which neither divides nor is divided by "
                f"--tensor-model-parallel-size {tp}")
    return None


def _router_error(a) -> str | None:
    """What is wrong with the router's flags of a run with experts, or None."""
    sigmoid = a.moe_router_score_function == "sigmoid"
    if sigmoid and a.moe_router_pre_softmax:
        return ("--moe-router-pre-softmax is for --moe-router-score-function softmax, not "
                "sigmoid")
    if a.moe_router_enable_expert_bias and not sigmoid:
        return ("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid "
                "(as Megatron's)")
    if a.moe_router_bias_update_rate is not None and not a.moe_router_enable_expert_bias:
        return ("--moe-router-bias-update-rate needs --moe-router-enable-expert-bias (it moves "
                "the expert biases)")
    if a.moe_router_bias_update_rate is not None and not math.isfinite(
            a.moe_router_bias_update_rate):
        return f"--moe-router-bias-update-rate must be finite, got {a.moe_router_bias_update_rate}"
    scale = a.moe_router_topk_scaling_factor
    if scale is not None and not (0.0 < scale < math.inf):
        return f"--moe-router-topk-scaling-factor must be > 0 and finite, got {scale}"
    z = a.moe_z_loss_coeff
    if z is not None and not math.isfinite(z):
        return f"--moe-z-loss-coeff must be finite, got {z}"
    if not math.isfinite(a.moe_aux_loss_coeff):
        return f"--moe-aux-loss-coeff must be finite, got {a.moe_aux_loss_coeff}"
    groups, group_topk, k, e = (a.moe_router_num_groups, a.moe_router_group_topk,
                                a.moe_router_topk, a.num_experts)
    if groups is not None and group_topk is None:
        return ("--moe-router-num-groups needs --moe-router-group-topk (how many of the groups "
                "each token's experts come from)")
    if group_topk is not None and groups is None:
        return "--moe-router-group-topk needs --moe-router-num-groups"
    if groups is not None:
        if e % groups:
            return f"--moe-router-num-groups {groups} does not divide --num-experts {e}"
        if group_topk > groups:
            return (f"--moe-router-group-topk {group_topk} is more than --moe-router-num-groups "
                    f"{groups}")
        if k % group_topk:
            return (f"--moe-router-topk {k} is not divisible by --moe-router-group-topk "
                    f"{group_topk} (a group scores the sum of its top k / group-topk experts)")
        if k // group_topk > e // groups:
            return (f"--moe-router-topk {k} over --moe-router-group-topk {group_topk} groups is "
                    f"{k // group_topk} experts a group, more than a group's {e // groups} "
                    f"(--num-experts {e} / --moe-router-num-groups {groups})")
    balancing = a.moe_router_load_balancing_type
    if balancing not in ("aux_loss", "seq_aux_loss", "none"):
        return (f"--moe-router-load-balancing-type {balancing} is not implemented: braid has "
                "aux_loss (per microbatch), seq_aux_loss (per sequence) and none")
    return None


def _dropping_error(a) -> str | None:
    """What is wrong with the token-dropping flags of a run with experts, or None."""
    factor = a.moe_expert_capacity_factor
    if factor is not None and not math.isfinite(factor):
        return f"--moe-expert-capacity-factor must be finite, got {factor}"
    if a.moe_pad_expert_input_to_capacity:
        if factor is None:
            return ("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor (as "
                    "Megatron's: no capacity to pad to)")
        if a.moe_router_enable_expert_bias:
            return ("--moe-pad-expert-input-to-capacity with --moe-router-enable-expert-bias is "
                    "not implemented: Megatron then counts the padding in the expert-bias token "
                    "counts (every expert its whole capacity, so the biases never move); braid "
                    "counts the pairs each expert keeps")
    return None


def notes(a) -> list[str]:
    """Log lines for the mixture-of-experts flags given that change nothing in this run."""
    if a.moe_token_drop_policy is not None and a.moe_expert_capacity_factor is None:
        return [f"braid: --moe-token-drop-policy {a.moe_token_drop_policy} has no effect: "
                "without --moe-expert-capacity-factor no token is dropped (as in Megatron)"]
    return []


def moe_layers(freq: int | list[int], num_layers: int) -> list[int]:
    """One entry per layer, 1: experts, 0: the dense MLP ([] when every layer has experts):
    Megatron's rule for --moe-layer-freq, layer i has experts when i % N == 0."""
    layers = list(freq) if isinstance(freq, list) else \
        [1 if i % freq == 0 else 0 for i in range(num_layers)]
    return [] if all(layers) else layers


def configure(cfg, a):
    """Sets the TransformerConfig's expert fields from checked arguments."""
    if a.num_experts is None:
        return
    cfg.num_experts = a.num_experts
    cfg.moe_router_topk = a.moe_router_topk
    cfg.moe_ffn_hidden_size = a.moe_ffn_hidden_size or 0
    cfg.moe_router_pre_softmax = a.moe_router_pre_softmax
    cfg.moe_router_score_function = a.moe_router_score_function
    cfg.moe_router_num_groups = a.moe_router_num_groups or 0
    cfg.moe_router_group_topk = a.moe_router_group_topk or 0
    cfg.moe_router_topk_scaling_factor = a.moe_router_topk_scaling_factor or 1.0
    cfg.moe_router_enable_expert_bias = a.moe_router_enable_expert_bias
    cfg.moe_router_bias_update_rate = (DEFAULT_BIAS_UPDATE_RATE
                                       if a.moe_router_bias_update_rate is None
                                       else a.moe_router_bias_update_rate)
    cfg.moe_z_loss_coeff = a.moe_z_loss_coeff or 0.0
    cfg.moe_shared_expert_intermediate_size = a.moe_shared_expert_intermediate_size or 0
    cfg.moe_shared_expert_gate = a.moe_shared_expert_gate
    cfg.moe_layers = moe_layers(a.moe_layer_freq, a.num_layers)
    if a.moe_expert_capacity_factor is not None:  # else dropless: the policy stays the default
        cfg.moe_expert_capacity_factor = a.moe_expert_capacity_factor
        cfg.moe_token_drop_policy = a.moe_token_drop_policy or "probs"
    if a.moe_router_load_balancing_type != "none":  # none: no loss, coefficient 0
        cfg.moe_router_load_balancing_type = a.moe_router_load_balancing_type
        cfg.moe_aux_loss_coeff = a.moe_aux_loss_coeff
