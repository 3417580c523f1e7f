"""What a mixture-of-experts layer does in place of the dense MLP, for the planner
(braid.planner times it, docs/planner.md "Mixture of experts"): its GEMMs' shapes, the bytes its
routing moves, what it keeps for the backward - as braid runs it (TransformerLayer::mlp_forward
and mlp_backward, route_tokens in csrc/model/moe.cpp). Per microbatch and TP rank; T is the
rank's tokens (micro batch x sequence / cp), every one of them under SP too: the MLP's input is
gathered over TP first, so the router and the expert rows see all T.

braid's layer, dropless: the router GEMM [T, H] x [H, E] (f32 logits, replicated over TP), the
top k per token, a host plan of the N = T·k rows grouped by expert (a device-to-host copy of
the choices, a counting sort, three host-to-device copies of indices), the gather of the N
rows, each expert's fc1 and fc2 on its rows (every expert split over TP like the dense MLP),
the weighted combine into [T, H] - then the TP all-reduce (SP: reduce-scatter) of the output,
as dense. Backward: the probabilities' gradient [T, k] f32 all-reduced over TP, the gather of
the output gradient, each expert's GEMMs' backward, the combine of the input gradient, the
router's softmax and GEMM backward.

Expert parallelism (ep > 1, csrc/model/expert_parallel.cpp): an EP group is ep consecutive
dp x cp ranks (tp·ep consecutive global ranks), each holding E / ep experts of every expert
layer. Per layer and microbatch the forward all-gathers the E per-expert row counts over the
group (to the host: the plan of who sends what), sends each peer the rows routed to its experts
(batched p2p: an all-to-all of [rows, H] bf16; under TP each TP rank its own, all N rows whole),
permutes the M rows that arrive (a gather) into local-expert order, runs the local experts on
them - on average M = N rows, T·k·ep / E an expert: the rows an expert gets from the whole
group's tokens, so wider GEMMs - and permutes and sends the outputs back. The backward sends
the output gradient's rows there and the input gradient's back: 2 all-to-alls forward, 2
backward, a third under selective recomputation (expert_in is gathered and dispatched again);
none overlapped with compute (the exchange blocks). The experts' gradients are reduced, and
ZeRO shards their optimizer state, over the expert-data-parallel group of dp x cp / ep ranks.

A shared expert (moe_shared_expert_intermediate_size S, TransformerLayer::shared_expert_forward)
is a dense MLP of S on all T tokens, split over TP like the dense MLP, its partial output added
to the experts' before the same all-reduce; with moe_shared_expert_gate scaled per token by
sigmoid(x w), w [1, H] replicated over TP: an f32 [T, 1] GEMM forward, and in backward the
[T, 1] f32 gradient of the gate all-reduced over TP.

Whole experts (--expert-tensor-parallel-size 1 under TP, with SP: Megatron's MoE parallel folding,
TransformerLayer::mlp_block_forward): each TP rank routes its own T / tp sequence-parallel tokens
through whole experts of width F - the router GEMM and the dispatch on T / tp tokens, (T / tp)·k
rows through F-wide GEMMs (the same FLOPs a rank as T·k rows through F / tp), no all-gather of the
MLP's input nor reduce-scatter of its output (unless a shared expert, still split over TP like a
dense MLP, needs them: its input gathered, its output zeroed, reduce-scattered and added), no
[T, k] all-reduce of the probabilities' gradient. An EP group is then any ep consecutive ranks of
a stage's tp x dp x cp (ep divides them and E), exchanging the rank's own (T / tp)·k rows; the
expert-data-parallel group has tp x dp x cp / ep ranks; a rank holds E / ep whole experts and keeps
its rows' activations, all of them its own. The router's weight gradient, summed over TP once a
step ([E, H] f32), and token dropping's all-gathers of the capacity counts are not costed.

Routing is assumed uniform: each expert gets T·k/E rows of each rank's T tokens, and each EP
rank sends (ep - 1) / ep of its rows away and receives as many (load imbalance is not modelled:
a skewed router leaves some experts' GEMMs longer and others' thinner, and the EP rank holding
the busiest experts receives more rows while its group waits on it).

The router's options (--moe-router-score-function sigmoid, --moe-router-num-groups and
--moe-router-group-topk, --moe-router-topk-scaling-factor, --moe-router-enable-expert-bias, the
z-loss and the load-balancing losses) change only element-wise work on the [T, E] logits, next
to the router GEMM's, and the expert bias adds, per step, an all-reduce of E token counts over
DP x CP for each expert layer: not costed, the plan is the same with or without them.
"""

from __future__ import annotations

import math

from braid import planner_mtp as _mtp

# Assumed (docs/planner.md): the host's part of routing a layer's microbatch, during which the
# GPU waits - a device-to-host copy and stream sync, three small host-to-device copies - and
# the counting sort, per (token, choice).
ROUTING_HOST_S = 20e-6
ROUTING_HOST_S_PER_CHOICE = 2e-9
# Assumed: expert parallelism's host plan of a layer's forward - the counts' device-to-host copy
# and sync after their all-gather, the two orders' host-to-device copies - besides its loop over
# the rows received (ROUTING_HOST_S_PER_CHOICE a row).
EP_PLAN_HOST_S = 15e-6


def whole(model, lay) -> bool:
    """Whether `lay` runs the model's routed experts whole (--expert-tensor-parallel-size 1 under
    TP): each TP rank routes its own T / tp tokens through whole experts."""
    return bool(model.num_experts) and lay.etp == 1 and lay.tp > 1


def routed_tokens(model, lay, T: float) -> float:
    """The tokens a rank routes in a microbatch: all T (the MLP's input gathered over TP), or its
    own T / tp with whole experts."""
    return T / lay.tp if whole(model, lay) else T


def _ep_stride(lay) -> int:
    """The global ranks from one member of an EP group to the next: tp with the experts split
    over TP (the group's ranks share a TP coordinate), 1 with whole experts."""
    return 1 if lay.etp == 1 else lay.tp


def sp_collectives(model, lay) -> tuple:
    """(forward, backward): the all-gathers and reduce-scatters of [T, H] a layer runs over TP
    under SP - the attention's and the MLP's, 4 (backward 6: the norm output gathered again);
    with whole experts and no shared expert the attention's alone, 2 (3)."""
    if whole(model, lay) and not model.moe_shared_expert_intermediate_size:
        return 2, 3
    return 4, 6


def ep_label(model, lay) -> str:
    """" ep 8", " ep 8 etp 1" with whole experts, or "" (planner.why_nothing_fits' words)."""
    return (f" ep {lay.ep}" if lay.ep > 1 else "") + (" etp 1" if whole(model, lay) else "")


def rows_per_token(model) -> int:
    """The MLP rows each token becomes: k with experts, else 1."""
    return model.moe_router_topk if model.num_experts else 1


def mlp_gemms(model, T: float, t: int, ep: int = 1, whole: bool = False):
    """The MLP's forward GEMMs of one TP rank, as (count, m, n, k): fc1 [m, k] x [k, n] and
    fc2; with experts E / ep of each on the average expert's T·k·ep / E rows (uniform routing:
    its rows of the EP group's ep x T tokens) - `whole`, (T / t)·k·ep / E rows of experts F wide,
    not F / t - and the shared expert's on all T."""
    h, f, s = model.hidden_size, model.mlp_hidden_size, model.moe_shared_expert_intermediate_size
    gated = 2 if model.gated else 1
    count = model.num_experts // ep if model.num_experts else 1
    rows = (T / t if whole else T) * rows_per_token(model) / count
    split = 1 if whole else t
    out = [(count, rows, gated * f / split, h), (count, rows, h, f / split)]
    if model.num_experts and s:
        out += [(1, T, gated * s / t, h), (1, T, h, s / t)]
    return out


def replicated_gemms(model, T: float, routed: float | None = None):
    """(FLOPs, bytes) of the forward of each GEMM every TP rank computes whole, f32 out: the
    router [T, H] x [H, E] (on the `routed` tokens where given: a rank's own with whole experts)
    and the shared expert's gate [T, H] x [H, 1]. They are narrow (E of 8 to 128; 1), so they run
    at HBM speed, not at a GEMM curve's."""
    h = model.hidden_size
    rows = [(model.num_experts, T if routed is None else routed)] + \
        ([(1, T)] if model.moe_shared_expert_gate else [])
    return [(2 * m * h * n, m * (2 * h + 4 * n) + 2 * n * h) for n, m in rows]


def narrow_gemm_s(gpu, flops: float, nbytes: float) -> float:
    """Seconds of a GEMM too narrow for the efficiency curve (one dimension of at most ~128:
    the router's E, the gate's 1, MLA's shared RoPE key's 64; planner_mla): the larger of its
    FLOPs at e_max and its bytes at HBM speed, plus a kernel's latency."""
    from braid import planner as p
    return max(flops / (gpu.peak_tflops * 1e12 * gpu.gemm_eff_max),
               nbytes / (gpu.hbm_gbps * 1e9 * p.HBM_EFFICIENCY)) + p.KERNEL_LATENCY_S


def activation_bytes(model, t: int) -> float:
    """Bytes per token of the MLP's activation function (a gated one reads 2F, writes F), on the
    k rows of a token with experts, and the shared expert's on its one row."""
    per_hidden = (6 if model.gated else 4) / t
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


def routing_s(model, cluster, lay, T: float):
    """(forward, backward) seconds an expert layer adds to its GEMMs and activation function, one
    TP rank and microbatch: the router and the gate (narrow: at HBM speed), the dispatch's bytes,
    the shared expert's element-wise work, the host's routing plan, the backward's TP
    all-reduces, selective recomputation's second gather - all but expert parallelism's
    exchange (exchange_s). With whole experts the router, the dispatch, the plan and the gather
    see the rank's own tokens, and a shared expert's output (its gradient) is zeroed [T, H] and,
    reduce-scattered, added to the experts' [T / tp, H]."""
    from braid import planner as p  # its cost primitives (planner imports this module)
    gpu, t, R = cluster.gpu, lay.tp, routed_tokens(model, lay, T)
    forward = 0.0
    for flops, nbytes in replicated_gemms(model, T, R):
        forward += narrow_gemm_s(gpu, flops, nbytes)
    forward += p._bytes_time(gpu, dispatch_bytes(model) * R, DISPATCH_KERNELS)
    backward = 2 * forward + p._bytes_time(gpu, *shared_expert_bytes(model, T, True))
    forward += p._bytes_time(gpu, *shared_expert_bytes(model, T))
    if whole(model, lay) and model.moe_shared_expert_intermediate_size:
        h = model.hidden_size
        forward += p._bytes_time(gpu, 2 * h * T + 6 * h * R, 2)
        backward += p._bytes_time(gpu, 2 * h * T + 6 * h * R, 2)
    forward += routing_host_s(model, R)
    if t > 1:
        backward += sum(p._ring(n, t, *p._link(cluster, t), "all_reduce")
                        for n in backward_all_reduces(model, T, whole(model, lay)))
    if lay.recompute == "selective":
        backward += p._bytes_time(gpu, regather_bytes(model) * R, 1)
    return forward, backward


def exchange_s(model, cluster, lay, T: float):
    """(forward, backward) seconds of an expert layer's expert-parallel exchange, one TP rank and
    microbatch ((0, 0) without EP): forward the counts' all-gather (E i64 a rank) and the host's
    plan, then 2 all-to-alls of the N = T·k rows [N, H] bf16 (whole experts: the rank's own
    (T / tp)·k), each with its permutation (a gather of the M = N rows, 4H + 4 bytes a row);
    backward 2 of them, 3 under selective recomputation. None overlaps compute."""
    ep, h = lay.ep, model.hidden_size
    if ep == 1 or not model.num_experts:
        return 0.0, 0.0
    from braid import planner as p
    rows = routed_tokens(model, lay, T) * model.moe_router_topk
    move = all_to_all_s(cluster, lay, 2 * h * rows) + \
        p._bytes_time(cluster.gpu, (4 * h + 4) * rows, 1)
    span = _ep_stride(lay) * ep  # the global ranks the group spans
    counts = p._ring(8 * model.num_experts * ep, ep, *p._link(cluster, span), "all_gather")
    plan = counts + EP_PLAN_HOST_S + ROUTING_HOST_S_PER_CHOICE * rows
    return plan + 2 * move, (3 if lay.recompute == "selective" else 2) * move


def all_to_all_s(cluster, lay, nbytes: float) -> float:
    """One all-to-all over an EP group, `nbytes` a rank of which each sends (ep - 1) / ep to its
    peers and receives as much, by the alpha-beta costs of the planner's collectives: in a node
    (the group's tp·ep consecutive ranks fit; ep with whole experts) over NVLink, a latency step
    a peer - the bytes and steps of a ring all-gather of the same buffer. Across nodes the bytes
    for peers on other nodes go over the network while those for the peers on the node go over
    NVLink, the slower of the two, at the network's latency a peer."""
    from braid import planner as p
    ep, t, node = lay.ep, _ep_stride(lay), cluster.gpus_per_node
    if t * ep <= node:
        return p._ring(nbytes, ep, *p._link(cluster, t * ep), "all_gather")
    here = max(1, node // t)  # the group's ranks on one node, this one included
    nvlink = (here - 1) / ep * nbytes / (cluster.nvlink_bw * p.NVLINK_EFFICIENCY)
    net = (ep - here) / ep * nbytes / (cluster.net_bw * p.NET_EFFICIENCY)
    return max(nvlink, net) + (ep - 1) * p.NET_ALPHA_S


def step_exchange_s(costs, ranges, microbatches: int, rerun, last: float = 0.0) -> float:
    """The seconds of a step the busiest pipeline rank spends in expert parallelism's exchanges
    (part of its forwards and backwards, not overlapped): each of its layers' (planner.LayerCost
    `costs`, `ranges` its chunks' layers) for every microbatch, the forward's again in the layers
    full recomputation reruns (`rerun(begin, end)`); the last rank's `last` a microbatch besides
    (its multi-token prediction depths', planner_mtp)."""
    per_rank = [sum((1 + (l in rerun(b, e))) * costs[l].exchange_forward +
                    costs[l].exchange_backward for b, e in rank for l in range(b, e))
                for rank in ranges]
    per_rank[-1] += last
    return microbatches * max(per_rank)


def chunk_experts(model, lay, ranges) -> list:
    """[rank][chunk]: the routed experts' parameters each model chunk of `ranges` (planner
    .stage_ranges) holds, one TP rank's share of E / ep experts of each of its expert layers (or
    them whole); the last rank's last chunk those of the multi-token prediction depths too."""
    out = [[model.experts_params(b, e, lay.tp, lay.ep, whole(model, lay)) for b, e in chunks]
           for chunks in ranges]
    out[-1][-1] += _mtp.experts(model, lay)
    return out


def data_groups(lay, params: float, experts: float) -> list:
    """[(parameters, group size)]: what the gradient reduction (and ZeRO) of a rank's `params`,
    `experts` of them its experts', runs over - all over dp x cp; with expert parallelism the
    dense ones over dp x cp and the experts' over the expert-data-parallel group, dp x cp /
    ep; with whole experts (any ep) theirs over tp x dp x cp / ep, where a rank holds any."""
    d = lay.dp * lay.cp
    if lay.etp == 1 and lay.tp > 1:  # whole experts (a dense model holds none: one group)
        return [(params - experts, d)] + ([(experts, lay.tp * d // lay.ep)] if experts else [])
    if lay.ep == 1:
        return [(params, d)]
    return [(params - experts, d), (experts, d // lay.ep)]


def data_sync_s(cluster, lay, bytes_each: float, params: float, experts: float,
                kind: str) -> float:
    """Seconds of a collective (`kind`) over the data-parallel ranks (dp x cp) of `params`
    parameters at `bytes_each` bytes, `experts` of them experts', which go over their own
    expert-DP group: the gradients' reduction (all_reduce; ZeRO: reduce_scatter) or ZeRO's
    parameter all-gather. Both groups span about the same ranks (the expert-DP one strides by
    tp·ep, by ep over the whole stage with whole experts): the same links."""
    from braid import planner as p
    bw, alpha = p._link(cluster, lay.tp * lay.cp * lay.dp)
    return sum(p._ring(bytes_each * n, g, bw, alpha, kind)
               for n, g in data_groups(lay, params, experts))


def grad_sync_s(cluster, lay, params: float, experts: float) -> float:
    """Seconds of the gradients' data-parallel reduction of `params` (`experts` of them
    experts'): all-reduced, with ZeRO reduce-scattered; f32, or bf16 with --grad-reduce-in-bf16
    (Layout.grad_reduce_bytes)."""
    kind = "reduce_scatter" if lay.zero else "all_reduce"
    return data_sync_s(cluster, lay, lay.grad_reduce_bytes, params, experts, kind)


def sharded(lay, params: float, experts: float) -> float:
    """The parameters whose f32 master weights and Adam moments a rank holds and updates: all of
    its `params` without ZeRO, else its shard of each data group's."""
    return sum(n / g for n, g in data_groups(lay, params, experts)) if lay.zero else params


def grad_reduce_buffer(lay, params: float, experts: float) -> float:
    """Elements of --grad-reduce-in-bf16's bf16 staging buffers on a rank: one element per
    gradient of every bucket that has a group of more than one rank to reduce over (none
    without the flag)."""
    if not lay.grad_reduce_in_bf16:
        return 0.0
    return sum(n for n, g in data_groups(lay, params, experts) if g > 1)


def ep_choices(model, data_ranks: int, fixed: dict | None = None) -> list:
    """The expert-parallel sizes the search tries: fixed["ep"] where given, else the divisors of
    E that divide the dp x cp ranks (1 alone for a dense model)."""
    if fixed and fixed.get("ep") is not None:
        return [fixed["ep"]]
    e = model.num_experts
    return [x for x in range(1, e + 1) if e % x == 0 and data_ranks % x == 0] if e else [1]


def expert_choices(model, t: int, data_ranks: int, sp: bool, fixed: dict | None = None) -> list:
    """[(etp, ep)]: the expert layouts the search tries at tp t: the experts split over TP (etp
    0, or fixed["etp"] where it is not 1) with each of ep_choices, and for a model with experts
    at t > 1 with SP whole ones (etp 1) with each ep that divides E and the t x dp x cp ranks;
    fixed["etp"] 1 keeps those alone (under SP; where SP is fixed off the layout check refuses
    them)."""
    fixed = fixed or {}
    etp = fixed.get("etp")
    split = [(etp or 0, e) for e in ep_choices(model, data_ranks, fixed)]
    if not model.num_experts or t == 1 or etp not in (None, 1):
        return split
    folded = [(1, e) for e in ep_choices(model, t * data_ranks, fixed)]
    if etp == 1:
        return folded if sp or "sequence_parallel" in fixed else []
    return split + (folded if sp else [])


def fewest_experts(model, t: int, data_ranks: int, fixed: dict) -> list:
    """[(etp, ep)]: of each kind expert_choices tries (split, whole), the largest ep - the fewest
    experts a rank holds (planner.why_nothing_fits)."""
    most = {}
    for w, e in expert_choices(model, t, data_ranks, fixed.get("sequence_parallel", t > 1), fixed):
        most[w] = max(most.get(w, 0), e)
    return sorted(most.items())


def baseline_dp(model, lay, dp0: int) -> int:
    """The scaling baseline's data-parallel size: dp0 rounded up to whole EP groups (the same
    ep), of dp x cp ranks, or of tp x dp x cp with whole experts."""
    g = lay.cp * (lay.tp if whole(model, lay) else 1)
    return math.lcm(dp0 * g, lay.ep) // g


def widths(model, lay) -> list:
    """[(name, width)]: the hidden sizes of an expert layer's MLPs that TP splits, the experts'
    (not whole ones) and the shared expert's (for planner.check_layout's message)."""
    s = model.moe_shared_expert_intermediate_size
    split = model.num_experts and not whole(model, lay)
    return ([("expert ffn", model.mlp_hidden_size)] if split else []) + \
        ([("shared expert", s)] if s else [])


def layout_error(model, lay) -> str | None:
    """What is wrong with the layout's expert parallelism and expert TP (braid.moe_args.check's
    words)."""
    ep, e, data, t = lay.ep, model.num_experts, lay.dp * lay.cp, lay.tp
    if lay.etp not in (0, 1, t):
        return (f"--expert-tensor-parallel-size {lay.etp}: braid splits experts over the TP "
                f"group (--tensor-model-parallel-size {t}) or keeps them whole (1)")
    if whole(model, lay) and not lay.sequence_parallel:
        return (f"--expert-tensor-parallel-size 1 with --tensor-model-parallel-size {t} needs "
                "--sequence-parallel: each TP rank routes its own share of the tokens through "
                "whole experts")
    if ep == 1:
        return None
    if ep < 1 or not e:
        return f"--expert-model-parallel-size {ep} needs --num-experts (and to be at least 1)"
    if e % ep:
        return (f"--expert-model-parallel-size {ep} does not divide --num-experts {e}: each "
                "expert-parallel rank holds an equal share of the experts")
    if whole(model, lay) and t * data % ep:
        return (f"--expert-model-parallel-size {ep} does not divide the {t * data} tensor x data "
                "x context-parallel ranks: with --expert-tensor-parallel-size 1 expert "
                f"parallelism splits them into groups of {ep}")
    if data % ep and not whole(model, lay):
        return (f"--expert-model-parallel-size {ep} does not divide the {data} data-parallel x "
                f"context-parallel ranks: expert parallelism splits them into groups of {ep}")
    return None


def backward_all_reduces(model, T: float, whole: bool = False) -> list:
    """The bytes of each all-reduce over TP in every backward: the probabilities' gradient
    [T, k] f32 (none with `whole` experts: a rank's outputs are whole, so are their dots), and
    the shared expert's gate's [T, 1] f32."""
    return ([] if whole else [4 * T * model.moe_router_topk]) + \
        ([4 * T] if model.moe_shared_expert_gate else [])


def kept_bytes(model, t: int, recompute: str, ep: int = 1, whole: bool = False) -> float:
    """Bytes per token the MLP keeps for its backward (LayerActivations), TP rank t's share.
    Dense: fc1_out [T, F|2F] and act_out [T, F] (none), fc1_out (selective). Experts, on the N =
    T·k rows: none expert_in [N, H], fc1_out [N, F|2F], act_out [N, F], expert_out [N, H], the
    router logits [T, E] f32 and the routing (probabilities, experts, the rows' tokens,
    probabilities and the tokens' rows: 20k bytes); selective fc1_out, expert_out, the logits
    and the routing. The [N, H] rows are whole on every TP rank (expert_out holds the rank's
    partial sums). A shared expert of S, on the T rows: shared_fc1_out [T, S | 2S] and
    shared_act_out [T, S] (none), shared_fc1_out (selective); with its gate also shared_out
    [T, H] (the rank's partial output, whole tokens) and the f32 logit [T, 1]. Expert
    parallelism also keeps the dispatch's two i32 orders of the M rows (on average N: 8k bytes).
    With `whole` experts a rank keeps all of the above but the shared expert's for its own T / t
    tokens, its rows F wide: fc1_out and act_out as split ones per token, the rest / t. Full
    keeps only the layer's input (planner.layer_activation_bytes)."""
    if recompute == "full":
        return 0.0

    def mlp(f):  # fc1_out [+ act_out] of one row through an MLP of hidden f
        fc1 = 2 * (2 * f if model.gated else f) / t
        return fc1 + (2 * f / t if recompute == "none" else 0.0)

    h = model.hidden_size
    if not model.num_experts:
        return mlp(model.mlp_hidden_size)
    k, s = model.moe_router_topk, model.moe_shared_expert_intermediate_size
    rows = mlp(model.mlp_hidden_size) + 2 * h + (2 * h if recompute == "none" else 0.0)
    shared = (mlp(s) if s else 0.0) + (2 * h + 4 if model.moe_shared_expert_gate else 0.0)
    if whole:  # (T / t)·k rows of mlp(F)·t bytes: k·mlp(F) a token; the rows' H-wide ones / t
        own = k * (rows - mlp(model.mlp_hidden_size)) + 4 * model.num_experts
        return k * mlp(model.mlp_hidden_size) + (own + (28 if ep > 1 else 20) * k) / t + shared
    return k * rows + 4 * model.num_experts + (28 if ep > 1 else 20) * k + shared


def by_kind(model, layer: int | None = None) -> list:
    """[(weight, model)]: the model the planner costs layer `layer` with - every layer of its
    MLP's kind, with experts or dense (ModelShape.with_experts) - or (None) each kind of the
    model's layers with its share. A model whose layers are all of one kind stands for itself."""
    if not model.mixed_mlps:
        return [(1.0, model)]
    return [(w, model.with_experts(x)) for x, w in model.mlp_kinds(layer).items()]


def why(model, lay) -> str:
    """What planner.why_nothing_fits adds for an MoE model: the experts' share of the
    parameters, and how far expert parallelism could split them beyond the smallest layout
    `lay`."""
    if not model.num_experts:
        return ""
    share = model.expert_layers * model.routed_params() / model.num_params()
    data = lay.dp * lay.cp
    more = max(ep_choices(model, data * (lay.tp if whole(model, lay) else 1)))
    split = (f", and expert parallelism could split them over up to {more} ranks "
             "(--expert-model-parallel-size)" if more > lay.ep else "")
    folded = max(ep_choices(model, lay.tp * data))  # whole: 1 / folded of them a rank
    if not whole(model, lay) and folded > lay.tp * max(more, lay.ep):
        split += (", or with whole experts (--expert-tensor-parallel-size 1) over up to "
                  f"{folded} ranks" if split else ", and with whole experts (--expert-tensor-"
                  f"parallel-size 1) expert parallelism could split them over up to {folded} "
                  "ranks")
    return f"; the {model.num_experts} experts of each layer are {share:.0%} of them{split}"
