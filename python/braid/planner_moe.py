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

Routing is assumed uniform: each expert gets T·k/E rows (load imbalance is not modelled; a
skewed router leaves some experts' GEMMs longer and others' thinner).
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
    fc2; with experts E of each on the average expert's T·k/E rows (uniform routing)."""
    h, f = model.hidden_size, model.mlp_hidden_size
    fc1 = 2 * f if model.activation == "swiglu" else f
    count = model.num_experts or 1
    rows = T * rows_per_token(model) / count
    return [(count, rows, fc1 / t, h), (count, rows, h, f / t)]


def router(model, T: float):
    """(FLOPs, bytes) of the router GEMM's forward on every TP rank: [T, H] x [H, E] in, f32
    logits out. E is narrow (8 to 128), so it runs at HBM speed, not at a GEMM curve's."""
    h, e = model.hidden_size, model.num_experts
    return 2 * T * h * e, T * (2 * h + 4 * e) + 2 * e * h


def activation_bytes(model, t: int) -> float:
    """Bytes per token of the MLP's activation function (SwiGLU reads 2F, writes F), on the
    k rows of a token with experts."""
    per_row = (6 if model.activation == "swiglu" else 4) * model.mlp_hidden_size / t
    return rows_per_token(model) * per_row


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


def backward_all_reduce_bytes(model, T: float) -> float:
    """The probabilities' gradient [T, k] f32, all-reduced over TP in every backward."""
    return 4 * T * model.moe_router_topk


def kept_bytes(model, t: int, recompute: str) -> float:
    """Bytes per token the MLP keeps for its backward (LayerActivations), TP rank t's share.
    Dense: fc1_out [T, F|2F] and act_out [T, F] (none), fc1_out (selective). Experts, on the N =
    T·k rows: none expert_in [N, H], fc1_out [N, F|2F], act_out [N, F], expert_out [N, H], the
    router logits [T, E] f32 and the routing (probabilities, experts, the rows' tokens,
    probabilities and the tokens' rows: 20k bytes); selective fc1_out, expert_out, the logits
    and the routing. The [N, H] rows are whole on every TP rank (expert_out holds the rank's
    partial sums). Full keeps only the layer's input (planner.layer_activation_bytes)."""
    if recompute == "full":
        return 0.0
    h, f = model.hidden_size, model.mlp_hidden_size
    fc1 = 2 * (2 * f if model.activation == "swiglu" else f) / t
    act = 2 * f / t if recompute == "none" else 0.0
    if not model.num_experts:
        return fc1 + act
    k = model.moe_router_topk
    rows = fc1 + act + 2 * h + (2 * h if recompute == "none" else 0.0)
    return k * rows + 4 * model.num_experts + 20 * k


def why(model) -> str:
    """What planner.why_nothing_fits adds for an MoE model: the experts' share of the
    parameters, and that every rank holds all of its layers' experts."""
    if not model.num_experts:
        return ""
    experts = model.num_layers * (model.mlp_params() - model.router_params)
    share = experts / model.num_params()
    return (f"; the {model.num_experts} experts of each layer are {share:.0%} of them, and every "
            "rank holds all of its layers' experts (braid has no expert parallelism: only TP "
            "and PP split them, ZeRO their optimizer state)")
