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

braid's experts are dropless (Megatron's default, no capacity factor), every layer is an MoE
layer, and without expert parallelism each expert is split over TP like the dense MLP (Megatron's
expert tensor parallelism at the TP size)."""

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
                   help="braid: 1 (every layer is an MoE layer)")
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
    if freq != 1 and not (isinstance(freq, list) and len(freq) == a.num_layers and all(freq)):
        return (f"--moe-layer-freq {freq}: dense layers between MoE layers are not implemented; "
                "braid makes every layer an MoE layer (1)")
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
    if a.moe_router_load_balancing_type == "aux_loss":
        cfg.moe_aux_loss_coeff = a.moe_aux_loss_coeff
