"""What multi-token prediction (DeepSeek-V3's; TransformerConfig.mtp_num_layers, Megatron's
--mtp-num-layers) adds to the last pipeline stage, for the planner (braid.planner times it,
docs/planner.md "Multi-token prediction"): the depths' parameters, their compute and collectives
per microbatch, what they keep for the backward - as braid runs them
(csrc/model/multi_token_prediction.cpp), on the last model chunk of the last pipeline rank, after
the main head, as megatron-core places them.

Depth k (of D) of a microbatch, on the rank's T tokens (micro batch x sequence / cp) - R = T / t
of them, its sequence-parallel region, under SP: the ids shifted left by k looked up in the
word embedding (vocab-parallel: each TP rank its slice of every token's row, then a
reduce-scatter over TP under SP, an all-reduce without), enorm of that and hnorm of h_{k-1} (h_0
the final norm's output) copied side by side, eh_proj [2H -> H] - replicated over TP: each rank
projects its own R tokens, with no collective, and its weight gradient is summed over TP once a
step under SP (without SP every rank projects every token, and the gradients agree) - one
transformer layer of the last layer's kind (its window; dense or experts, with expert
parallelism's exchange), the final norm and the shared LM head's logits [T, V / t] and
cross-entropy, costed as the main head's (planner.head_cost). Backward: the head's, the layer's
(full recomputation reruns its forward, under `block` too: braid gives the depth's layer the
config's policy), 2x the GEMM and the bytes, the next depth's gradient added in, the lookup's
all-gather under SP.

Memory: per depth the layer's parameters (its TP and EP share) and eh_proj [H, 2H] and the three
norms whole on every TP rank; with untied embeddings under PP the last stage's own copy of the
word embedding, which the depths look up (its gradient summed with the first stage's over the
embedding group, as tied embeddings'). Kept per microbatch: the layer's activations under the
layout's recomputation, the embedding, the eh_proj input [R, 2H], the layer's output and the
depth's normed output, the norms' f32 statistics, the depth's bf16 logits [T, V / t] and the
cross-entropy's f32 max and sum of each token; and h_0, which braid keeps for the first depth.
"""

from __future__ import annotations

import dataclasses


def depths(model) -> int:
    """The multi-token prediction depths (0: none)."""
    return getattr(model, "mtp_num_layers", 0) or 0


def norm_params(model) -> int:
    """One norm's parameters: a LayerNorm's weight and bias, an RMSNorm's weight."""
    return (2 if model.layernorm else 1) * model.hidden_size


def depth_params(model, tp: int = 1, ep: int = 1, whole: bool = False) -> float:
    """One depth's parameters one TP (and EP) rank holds: its layer's share (the last layer's
    kind, planner_inputs.ModelShape.layers_params), eh_proj [H, 2H] and enorm, hnorm and the
    final norm whole."""
    last, h = model.num_layers - 1, model.hidden_size
    return model.layers_params(last, last + 1, tp, ep, whole) + 2 * h * h + 3 * norm_params(model)


def params(model, lay) -> float:
    """What the depths add to the last pipeline rank's last model chunk, one TP rank's share: D
    depths, and with untied embeddings under PP a copy of the word embedding (V / t rows)."""
    from braid import planner_moe
    d = depths(model)
    if not d:
        return 0.0
    copy = model.vocab_size * model.hidden_size / lay.tp \
        if lay.pp > 1 and not model.tied_embeddings else 0.0
    return d * depth_params(model, lay.tp, lay.ep, planner_moe.whole(model, lay)) + copy


def experts(model, lay) -> float:
    """The routed experts' parameters among params(): the depths' layers' E / ep experts, when
    the last layer has experts (planner_moe.chunk_experts)."""
    from braid import planner_moe
    last = model.num_layers - 1
    return depths(model) * model.experts_params(last, last + 1, lay.tp, lay.ep,
                                                planner_moe.whole(model, lay))


@dataclasses.dataclass
class DepthsCost:
    """The depths of one microbatch on the last rank: seconds of forward and backward (full
    recomputation's rerun included), the forward FLOPs reruns repeat (HFU: full's, or MLA's up
    projections under selective), the seconds of expert parallelism's exchange among them; and
    per step, the seconds of summing eh_proj's gradient over TP."""
    forward: float = 0.0
    backward: float = 0.0
    rerun_flops: float = 0.0
    exchange: float = 0.0
    grad_sync: float = 0.0


def cost(model, cluster, lay, layer, head) -> DepthsCost:
    """The depths' DepthsCost, given `layer`, planner.LayerCost of the model's last layer (one
    microbatch, one TP rank), and `head`, planner.head_cost's (forward, backward)."""
    from braid import planner as p
    d = depths(model)
    if not d:
        return DepthsCost()
    gpu, t, h = cluster.gpu, lay.tp, model.hidden_size
    T = lay.micro_batch_size * model.seq_length / lay.cp
    R = T / t if lay.sequence_parallel else T  # the tokens eh_proj and the norms run on
    eh_proj = p._gemm_time(gpu, R, h, 2 * h)
    # the lookup ([T, H] written, its rows read), three norms and the two copies into
    # eh_proj's input, 4H bytes a token each
    nbytes = 4 * h * T + 5 * 4 * h * R
    forward = eh_proj + p._bytes_time(gpu, nbytes, 6) + layer.forward + head[0]
    backward = 2 * eh_proj + p._bytes_time(gpu, 2 * nbytes + 6 * h * R, 7) + layer.backward + \
        head[1]
    if t > 1:  # the vocab-parallel lookup's [T, H] bf16 over TP
        bw, alpha = p._link(cluster, t)
        if lay.sequence_parallel:
            forward += p._ring(2 * h * T, t, bw, alpha, "reduce_scatter")
            backward += p._ring(2 * h * T, t, bw, alpha, "all_gather")
        else:
            forward += p._ring(2 * h * T, t, bw, alpha, "all_reduce")
    rerun = lay.recompute == "full"
    grad_sync = 0.0
    if lay.sequence_parallel and t > 1:  # eh_proj's f32 gradient, each rank's tokens' share
        grad_sync = d * p._ring(4 * 2 * h * h, t, *p._link(cluster, t), "all_reduce")
    return DepthsCost(
        forward=d * forward, backward=d * (backward + (layer.forward if rerun else 0.0)),
        rerun_flops=d * (layer.model_flops if rerun else layer.rerun_flops),  # selective's too
        exchange=d * ((2 if rerun else 1) * layer.exchange_forward + layer.exchange_backward),
        grad_sync=grad_sync)


def kept(model, lay, chunk: tuple) -> tuple:
    """The last model chunk's (kept, transient) activation bytes per microbatch
    (planner.chunk_activation_bytes' `chunk`) with the depths' added: what each depth keeps
    (the module docstring) and h_0; under full recomputation a depth's layer holds its whole
    forward again during its backward."""
    d = depths(model)
    if not d:
        return chunk
    from braid import planner as p
    last, h, t = model.num_layers - 1, model.hidden_size, lay.tp
    T = lay.micro_batch_size * model.seq_length / lay.cp
    R = T / t if lay.sequence_parallel else T
    stats = 8 if model.layernorm else 4  # a norm's f32 statistics a token
    rec = "full" if lay.recompute == "full" else lay.recompute
    depth = p.layer_activation_bytes(model, lay, rec, last) + R * (10 * h + 3 * stats) + \
        T * (2 * model.vocab_size / t + 8)
    transient = p.layer_activation_bytes(model, lay, "none", last) if rec == "full" else 0.0
    return chunk[0] + d * depth + R * (2 * h + stats), max(chunk[1], transient)
