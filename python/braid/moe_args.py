"""Mixture of experts as Megatron's arguments give it (docs/arguments.md):

--num-experts E                    every layer's MLP is E experts (TransformerConfig.num_experts)
--moe-ffn-hidden-size F            each expert's hidden size (default --ffn-hidden-size)
--moe-router-topk K                experts per token (default 2)
--moe-router-pre-softmax           softmax over all experts, then the top K (default: the top K
                                   logits, then their softmax: Mixtral's)
--moe-router-load-balancing-type   aux_loss (default) or none
--moe-aux-loss-coeff C             the aux_loss's weight (default 0: off)
--moe-shared-expert-intermediate-size S
                                   a shared expert of hidden size S every token goes through
--moe-shared-expert-gate           its output scaled by a sigmoid gate (Qwen2-MoE)
--moe-layer-freq N | "[0]+[1]*23"  which layers have experts: N - layers 0, N, 2N, ... (0-based,
                                   Megatron's rule); a list - one 1 (experts) or 0 (dense) per layer

braid's experts are dropless (Megatron's default, no capacity factor), and without expert
parallelism each expert is split over TP like the dense MLP (Megatron's expert tensor
parallelism at the TP size)."""

from __future__ import annotations

from braid import window_args


def add_arguments(g, pos_int, nonneg_float):
    g.add_argument("--num-experts", type=pos_int, default=None,
                   help="mixture of experts: every layer's MLP is this many experts, of which "
                        "a router picks --moe-router-topk per token (at most 1024)")
    g.add_argument("--moe-ffn-hidden-size", type=pos_int, default=None,
                   help="each expert's hidden size (default --ffn-hidden-size)")
    g.add_argument("--moe-router-topk", type=pos_int, default=2)
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="softmax over all experts before the top k (OLMoE, Qwen2-MoE); default: "
                        "the softmax of the top k logits (Mixtral, Qwen3-MoE)")
    g.add_argument("--moe-router-score-function", default="softmax",
                   choices=["softmax", "sigmoid"], help="braid's router: softmax")
    g.add_argument("--moe-router-load-balancing-type", default="aux_loss",
                   choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"],
                   help="braid: aux_loss (the Switch Transformer loss of each microbatch, with "
                        "--moe-aux-loss-coeff) or none")
    g.add_argument("--moe-aux-loss-coeff", type=nonneg_float, default=0.0)
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
    g.add_argument("--expert-model-parallel-size", type=pos_int, default=1,
                   help="braid: 1 (experts are split over TP like the dense MLP)")
    g.add_argument("--expert-tensor-parallel-size", type=pos_int, default=None,
                   help="braid: the TP size")


def check(a, tp: int) -> str | None:
    """What is wrong with the run's mixture-of-experts arguments, or None."""
    if a.num_experts is None:
        for flag, given in (("--moe-ffn-hidden-size", a.moe_ffn_hidden_size is not None),
                            ("--moe-router-pre-softmax", a.moe_router_pre_softmax),
                            ("--moe-aux-loss-coeff", a.moe_aux_loss_coeff != 0.0),
                            ("--moe-shared-expert-intermediate-size",
                             a.moe_shared_expert_intermediate_size is not None),
                            ("--moe-shared-expert-gate", a.moe_shared_expert_gate),
                            ("--moe-layer-freq", a.moe_layer_freq != 1),
                            ("--expert-model-parallel-size", a.expert_model_parallel_size != 1)):
            if given:
                return f"{flag} needs --num-experts"
        return None
    if a.num_experts > 1024:
        return f"--num-experts {a.num_experts}: braid's router takes at most 1024 experts"
    if a.moe_router_topk > a.num_experts:
        return (f"--moe-router-topk {a.moe_router_topk} is more than --num-experts "
                f"{a.num_experts}")
    if a.moe_router_score_function != "softmax":
        return "--moe-router-score-function sigmoid is not implemented: braid's router is softmax"
    if a.moe_router_load_balancing_type not in ("aux_loss", "none"):
        return (f"--moe-router-load-balancing-type {a.moe_router_load_balancing_type} is not "
                "implemented: braid has aux_loss (per microbatch) and none")
    freq = a.moe_layer_freq
    if isinstance(freq, list) and len(freq) != a.num_layers:
        return (f"--moe-layer-freq gives {len(freq)} layers for --num-layers {a.num_layers} "
                "(one entry per layer)")
    layers = moe_layers(freq, a.num_layers)
    if layers and not any(layers):
        return f"--moe-layer-freq {freq} gives no layer experts"
    if a.expert_model_parallel_size != 1:
        return (f"--expert-model-parallel-size {a.expert_model_parallel_size}: expert "
                "parallelism is not implemented; every rank holds every expert, split over TP "
                "like the dense MLP (1)")
    if a.expert_tensor_parallel_size not in (None, tp):
        return (f"--expert-tensor-parallel-size {a.expert_tensor_parallel_size}: braid splits "
                f"experts over the TP group (--tensor-model-parallel-size {tp})")
    ffn = a.moe_ffn_hidden_size or a.ffn_hidden_size
    if ffn % tp:
        return (f"--moe-ffn-hidden-size {ffn} is not divisible by --tensor-model-parallel-size "
                f"{tp}")
    shared = a.moe_shared_expert_intermediate_size
    if a.moe_shared_expert_gate and shared is None:
        return "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size"
    if shared is not None and shared % tp:
        return (f"--moe-shared-expert-intermediate-size {shared} is not divisible by "
                f"--tensor-model-parallel-size {tp}")
    return None


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
    cfg.moe_shared_expert_intermediate_size = a.moe_shared_expert_intermediate_size or 0
    cfg.moe_shared_expert_gate = a.moe_shared_expert_gate
    cfg.moe_layers = moe_layers(a.moe_layer_freq, a.num_layers)
    if a.moe_router_load_balancing_type == "aux_loss":
        cfg.moe_aux_loss_coeff = a.moe_aux_loss_coeff
