"""What a mixture-of-experts layer does in place of the dense MLP, for the planner
(braid.planner times it, docs/planner.md "Mixture of experts"): its GEMMs' shapes, the bytes its
routing moves, what it keeps for the backward - as braid runs it (TransformerLayer::mlp_forward
and mlp_backward, route_tokens in csrc/model/moe.cpp). Per microbatch and TP rank; T is the
rank's tokens (micro batch x sequence / cp), every one of them under SP too: the MLP's input is
gathered over TP first, so the router and the expert rows see all T.

braid's layer, without expert parallelism (every rank holds all E experts, each split over TP
like the dense MLP) and dropless: the router GEMM [T, H] x [H, E] (f32 logits, replicated over
TP), the top k per token, a host plan of the N = T·k rows grouped by expert (a device-to-host
copy of the choices, a counting sort, three host-to-device copies of indices), the gather of
the N rows, each expert's fc1 and fc2 on its rows, the weighted combine into [T, H] - then the
TP all-reduce (SP: reduce-scatter) of the output, as dense. Backward: the probabilities'
gradient [T, k] f32 all-reduced over TP, the gather of the output gradient, each expert's
GEMMs' backward, the combine of the input gradient, the router's softmax and GEMM backward.

A shared expert (moe_shared_expert_intermediate_size S, TransformerLayer::shared_expert_forward)
is a dense MLP of S on all T tokens, split over TP like the dense MLP, its partial output added
to the experts' before the same all-reduce; with moe_shared_expert_gate scaled per token by
sigmoid(x w), w [1, H] replicated over TP: an f32 [T, 1] GEMM forward, and in backward the
[T, 1] f32 gradient of the gate all-reduced over TP.

Routing is assumed uniform: each expert gets T·k/E rows (load imbalance is not modelled; a
skewed router leaves some experts' GEMMs longer and others' thinner).

The router's options (--moe-router-score-function sigmoid, --moe-router-num-groups and
--moe-router-group-topk, --moe-router-topk-scaling-factor, --moe-router-enable-expert-bias, the
z-loss and the load-balancing losses) change only element-wise work on the [T, E] logits, next
to the router GEMM's, and the expert bias adds, per step, an all-reduce of E token counts over
DP x CP for each expert layer: not costed, the plan is the same with or without them.
"""

from __future__ import annotations

# Assumed (docs/planner.md): the host's part of routing a layer's microbatch, during which the
# GPU waits - a device-to-host copy and stream sync, three small host-to-device copies - and
# the counting sort, per (token, choice).
ROUTING_HOST_S = 20e-6
ROUTING_HOST_S_PER_CHOICE = 2e-9


def rows_per_token(model) -> int:
    """The MLP rows each token becomes: k with experts, else 1."""
    return model.moe_router_topk if model.num_experts else 1


def mlp_gemms(model, T: float, t: int):
    """The MLP's forward GEMMs of one TP rank, as (count, m, n, k): fc1 [m, k] x [k, n] and
    fc2; with experts E of each on the average expert's T·k/E rows (uniform routing), and the
    shared expert's on all T."""
    h, f, s = model.hidden_size, model.mlp_hidden_size, model.moe_shared_expert_intermediate_size
    gated = 2 if model.activation == "swiglu" else 1
    count = model.num_experts or 1
    rows = T * rows_per_token(model) / count
    out = [(count, rows, gated * f / t, h), (count, rows, h, f / t)]
    if model.num_experts and s:
        out += [(1, T, gated * s / t, h), (1, T, h, s / t)]
    return out


def replicated_gemms(model, T: float):
    """(FLOPs, bytes) of the forward of each GEMM every TP rank computes whole, f32 out: the
    router [T, H] x [H, E] and the shared expert's gate [T, H] x [H, 1]. They are narrow (E of
    8 to 128; 1), so they run at HBM speed, not at a GEMM curve's."""
    h = model.hidden_size
    widths = [model.num_experts] + ([1] if model.moe_shared_expert_gate else [])
    return [(2 * T * h * n, T * (2 * h + 4 * n) + 2 * n * h) for n in widths]


def activation_bytes(model, t: int) -> float:
    """Bytes per token of the MLP's activation function (SwiGLU reads 2F, writes F), on the
    k rows of a token with experts, and the shared expert's on its one row."""
    per_hidden = (6 if model.activation == "swiglu" else 4) / t
    shared = model.moe_shared_expert_intermediate_size if model.num_experts else 0
    return per_hidden * (rows_per_token(model) * model.mlp_hidden_size + shared)


def shared_expert_bytes(model, T: float, backward: bool = False):
    """(bytes, kernels) of the shared expert's forward (or backward) besides its GEMMs, its
    activation and its gate's GEMM: forward, its output added to the experts' [T, H] (6H a
    token) and with the gate the logit's sigmoid (8) and the output's scaling (4H + 4);
    backward, with the gate, the sigmoid again, the output gradient's scaling (4H + 4), the
    gate's gradient (4H + 4), the sigmoid's backward (12) and the logit gradient's cast (6)
    (the gate's GEMMs: twice its forward, as the router's); without the gate the output
    gradient goes to the GEMMs as it is. (0, 0) without a shared expert."""
    if not (model.num_experts and model.moe_shared_expert_intermediate_size):
        return 0.0, 0
    h, gate = model.hidden_size, model.moe_shared_expert_gate
    if backward:
        return (T * (8 * h + 34), 5) if gate else (0.0, 0)
    return (T * (10 * h + 12), 3) if gate else (T * 6 * h, 1)


def dispatch_bytes(model) -> float:
    """Bytes per token the routing moves in the forward (backward: about twice): the top k of
    the f32 logits (4E in, probabilities and experts 8k out), the rows' probabilities gathered
    (12k), the k rows gathered (4Hk + index 4k) and combined into the token (2Hk + 8k in, 2H
    out)."""
    h, e, k = model.hidden_size, model.num_experts, model.moe_router_topk
    return 4 * e + 6 * h * k + 2 * h + 32 * k


DISPATCH_KERNELS = 4  # top-k, the probabilities' gather, the rows' gather, the combine


def regather_bytes(model) -> float:
    """Selective recomputation: the backward gathers the k rows of each token again (4Hk + 4k
    bytes), as braid keeps no expert_in under it."""
    return (4 * model.hidden_size + 4) * model.moe_router_topk


def routing_host_s(model, T: float) -> float:
    """Seconds the GPU waits for the host to plan a forward's dispatch."""
    return ROUTING_HOST_S + ROUTING_HOST_S_PER_CHOICE * T * model.moe_router_topk


def backward_all_reduces(model, T: float) -> list:
    """The bytes of each all-reduce over TP in every backward: the probabilities' gradient
    [T, k] f32, and the shared expert's gate's [T, 1] f32."""
    return [4 * T * model.moe_router_topk] + ([4 * T] if model.moe_shared_expert_gate else [])


def kept_bytes(model, t: int, recompute: str) -> float:
    """Bytes per token the MLP keeps for its backward (LayerActivations), TP rank t's share.
    Dense: fc1_out [T, F|2F] and act_out [T, F] (none), fc1_out (selective). Experts, on the N =
    T·k rows: none expert_in [N, H], fc1_out [N, F|2F], act_out [N, F], expert_out [N, H], the
    router logits [T, E] f32 and the routing (probabilities, experts, the rows' tokens,
    probabilities and the tokens' rows: 20k bytes); selective fc1_out, expert_out, the logits
    and the routing. The [N, H] rows are whole on every TP rank (expert_out holds the rank's
    partial sums). A shared expert of S, on the T rows: shared_fc1_out [T, S | 2S] and
    shared_act_out [T, S] (none), shared_fc1_out (selective); with its gate also shared_out
    [T, H] (the rank's partial output, whole tokens) and the f32 logit [T, 1]. Full keeps only
    the layer's input (planner.layer_activation_bytes)."""
    if recompute == "full":
        return 0.0

    def mlp(f):  # fc1_out [+ act_out] of one row through an MLP of hidden f
        fc1 = 2 * (2 * f if model.activation == "swiglu" else f) / t
        return fc1 + (2 * f / t if recompute == "none" else 0.0)

    h = model.hidden_size
    if not model.num_experts:
        return mlp(model.mlp_hidden_size)
    k, s = model.moe_router_topk, model.moe_shared_expert_intermediate_size
    rows = mlp(model.mlp_hidden_size) + 2 * h + (2 * h if recompute == "none" else 0.0)
    shared = (mlp(s) if s else 0.0) + (2 * h + 4 if model.moe_shared_expert_gate else 0.0)
    return k * rows + 4 * model.num_experts + 20 * k + shared


def by_kind(model, layer: int | None = None) -> list:
    """[(weight, model)]: the model the planner costs layer `layer` with - every layer of its
    MLP's kind, with experts or dense (ModelShape.with_experts) - or (None) each kind of the
    model's layers with its share. A model whose layers are all of one kind stands for itself."""
    if not model.mixed_mlps:
        return [(1.0, model)]
    return [(w, model.with_experts(x)) for x, w in model.mlp_kinds(layer).items()]


def why(model) -> str:
    """What planner.why_nothing_fits adds for an MoE model: the experts' share of the
    parameters, and that every rank holds all of its layers' experts."""
    if not model.num_experts:
        return ""
    experts = model.expert_layers * model.num_experts * \
        model.one_mlp_params(model.mlp_hidden_size)
    share = experts / model.num_params()
    return (f"; the {model.num_experts} experts of each layer are {share:.0%} of them, and every "
            "rank holds all of its layers' experts (braid has no expert parallelism: only TP "
            "and PP split them, ZeRO their optimizer state)")
