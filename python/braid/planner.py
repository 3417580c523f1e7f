"""The cluster planner: predicted step time, MFU, memory, scaling, time and cost of training a
GPT/Llama model with braid on N GPUs, for one parallel layout or the best of all that fit.

The model (docs/planner.md has the derivation, the assumed and the fitted numbers):

* compute: per layer and microbatch, every GEMM's FLOPs at an efficiency that grows with the
  GEMM's smallest dimension (e_max · n / (n + n_half), per GPU type), flash attention's
  executed (causal) FLOPs at its own efficiency, the elementwise ops' bytes at HBM bandwidth;
  backward = 2× the GEMMs, 2.5× attention, 2× the bytes; full recompute adds the forward.
* pipeline: braid's own schedule (make_1f1b / make_interleaved_1f1b) simulated through
  braid._C.simulate with per-(rank, chunk) forward/backward costs (embedding and LM head on
  the first/last stage) and the p2p transfer time; the result is each rank's finish time.
* communication: NCCL ring/tree alpha-beta costs; NVLink inside a node, the network across.
  TP collectives are not overlapped (braid does not), p2p is as exposed as the schedule
  leaves it; with overlap_grad_reduce (braid's --overlap-grad-reduce) each model chunk's DP
  reduction starts while its last backward runs, bucket by bucket, and the chunks queue on
  the DP channel (interleaved: behind the other chunks' backwards); the ZeRO param
  all-gather overlaps the first forward with --overlap-param-gather.
* memory: braid's accounting: bf16 parameters, f32 gradient buffer, f32 master + two f32
  Adam moments (sharded by dp under ZeRO-1), activations per layer as docs/memory.md
  (LayerActivations) times the (chunk, microbatch) pairs the schedule keeps in flight.
* --grad-reduce-in-bf16 (Layout.grad_reduce_in_bf16): the DP reduction moves bf16, and each
  rank keeps a bf16 staging copy of the gradients it reduces (counted in "grads").
* context parallelism (cp > 1): every rank computes and keeps its 1/cp of each sequence's
  tokens (balanced chunks: its queries see half the keys on average, as without CP); per
  layer it all-gathers the keys and values over the CP group (2 forward; backward 2 more and 2
  reduce-scatters of their gradients), not overlapped (braid does not); gradients are reduced,
  and ZeRO shards, over dp x cp.
* mixture of experts (num_experts > 0, braid.planner_moe): the router, E experts' GEMMs on
  T·k/E rows each (uniform routing), the dispatch's bytes and host planning, the backward's
  [T, k] all-reduce; a shared expert as a dense MLP on all T (its gate: a [T, 1] GEMM and
  all-reduce); with expert parallelism (ep) E / ep experts a rank, the all-to-alls not overlapped,
  the experts' gradients over dp x cp / ep; whole experts (etp 1: each TP rank its own tokens,
  ep dividing tp x dp x cp) without the MLP's TP collectives. The dense layers among them
  (moe_layers) are costed, held and kept as a dense model's, each stage its own.
* multi-latent attention (braid.planner_mla): its projections, replicated down projections and
  latents, padded values and TP collectives (under SP the latents' in place of the hidden
  state's) in place of q/k/v's; selective recomputation of its up projections (mla_up_proj).
* multi-token prediction (braid.planner_mtp): each depth's layer, eh_proj, logits and loss on the
  last model chunk, its parameters (and the embedding's copy) and activations there.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

from braid import _C
from braid import flops as _flops
from braid import planner_mla as _mla
from braid import planner_moe as _moe
from braid import planner_mtp as _mtp
from braid import planner_split as _split
from braid.planner_split import in_flight, peak_kept, schedule  # noqa: F401
from braid.planner_inputs import (GPUS, PRESETS, Cluster, GPUType, Layout,  # noqa: F401
                                  ModelShape, parse_bandwidth, stage_splits)

GB = 1e9


# ---- the assumed constants (the inputs: braid.planner_inputs) -------------------------------

# Assumed constants (docs/planner.md):
HBM_EFFICIENCY = 0.8          # elementwise kernels reach ~80% of HBM bandwidth
KERNEL_LATENCY_S = 6e-6       # launch + tail per kernel
NVLINK_EFFICIENCY = 0.8       # NCCL bus bandwidth / link bandwidth in a node (A100: ~235/300)
NET_EFFICIENCY = 0.9          # NCCL bus bandwidth / NIC line rate (IB, RoCE)
NVLINK_ALPHA_S = 5e-6         # NCCL per-step latency in a node
NET_ALPHA_S = 12e-6           # ... across nodes
MEMORY_RESERVED_GB = 4.0      # CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers, fragmentation
OPTIMIZER_BYTES_PER_PARAM = 34  # AdamW: grads, master, m, v read; master, m, v, bf16 written; norm


def stage_ranges(model: ModelShape, lay: Layout):
    """[rank][chunk] layer ranges, braid's own split (engine::stage_layers; a layout's model
    chunks, planner_split); ValueError naming the rule when the layers do not split."""
    return _C.stage_layers(model.num_layers, lay.pp, lay.virtual_stages, lay.first_stage_layers,
                           lay.last_stage_layers, list(lay.model_chunk_layers))


# ---- costs ---------------------------------------------------------------------------------

def _gemm_time(gpu: GPUType, m: float, n: float, k: float) -> float:
    small = min(m, n, k)
    eff = gpu.gemm_eff_max * small / (small + gpu.gemm_n_half)
    return 2.0 * m * n * k / (gpu.peak_tflops * 1e12 * eff) + KERNEL_LATENCY_S


def _bytes_time(gpu: GPUType, nbytes: float, kernels: int) -> float:
    return nbytes / (gpu.hbm_gbps * 1e9 * HBM_EFFICIENCY) + kernels * KERNEL_LATENCY_S


def _ring(nbytes: float, n: int, bw: float, alpha: float, kind: str) -> float:
    """NCCL ring time of one collective over n ranks: all_reduce moves 2(n-1)/n of the buffer,
    reduce_scatter / all_gather (n-1)/n (nbytes is the full buffer). For large n across nodes
    NCCL may pick a tree for all-reduce (2 log2 n latency steps): the faster one is taken."""
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        ring = 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * alpha
        tree = 2 * nbytes / bw + 2 * math.log2(n) * alpha
        return min(ring, tree)
    return (n - 1) / n * nbytes / bw + (n - 1) * alpha


def _link(cluster: Cluster, span: int):
    """(bandwidth, alpha) of a group whose ranks span `span` consecutive global ranks."""
    if span <= cluster.gpus_per_node:
        return cluster.nvlink_bw * NVLINK_EFFICIENCY, NVLINK_ALPHA_S
    return cluster.net_bw * NET_EFFICIENCY, NET_ALPHA_S


def layer_activation_bytes(model: ModelShape, lay: Layout, recompute: str | None = None,
                           layer: int | None = None) -> float:
    """Bytes layer `layer` (None: the layers' mean) keeps for its backward per microbatch and
    rank (docs/memory.md, generalised to GQA and SwiGLU): 16-bit tensors, f32 norm statistics
    and lse; its MLP's as its kind, dense or with experts, keeps them (planner_moe)."""
    kinds = _moe.by_kind(model, layer)
    if kinds[0][1] is not model:
        return sum(w * layer_activation_bytes(one, lay, recompute) for w, one in kinds)
    t, h, a, q = lay.tp, model.hidden_size, model.num_attention_heads, model.q_size
    kv = model.kv_heads * model.head_dim
    sp = t if lay.sequence_parallel else 1
    tokens = lay.micro_batch_size * model.seq_length / lay.cp
    rec, whole = recompute or lay.recompute, _moe.whole(model, lay)
    if rec == "full":
        per_token = 2 * h / sp
    elif rec == "selective":
        per_token = 2 * h / sp + (2 * q + 4 * kv) / t + 2 * q / t + 4 * a / t + 2 * h / sp \
            + _moe.kept_bytes(model, t, rec, lay.ep, whole)
    else:
        per_token = (2 * h + 8 + 2 * h) / sp + (2 * q + 4 * kv) / t + 2 * q / t + 4 * a / t \
            + (2 * h + 8 + 2 * h) / sp + _moe.kept_bytes(model, t, rec, lay.ep, whole)
        if model.qk_layernorm and not model.multi_latent_attention:  # q, k before their norms
            stats = 8 if model.layernorm else 4                       # and the norms' statistics
            per_token += (2 * q + 2 * kv) / t + stats * (a + model.kv_heads) / t
    per_token += _mla.kept_bytes(model, rec, t, lay.sequence_parallel,  # latents (planner_mla)
                                 lay.recompute_mla_up_proj)
    return per_token * tokens


@dataclasses.dataclass
class LayerCost:
    forward: float
    backward: float       # including selective recomputation, not full (recomputed_layers)
    model_flops: float    # forward model FLOPs of this rank (braid.flops' count)
    exchange_forward: float = 0.0   # of forward: expert parallelism's exchange (planner_moe)
    exchange_backward: float = 0.0  # of backward
    rerun_flops: float = 0.0        # forward FLOPs selective reruns (MLA's up projections; HFU)


def recomputed_layers(lay: Layout, layers: int) -> int:
    """Layers of a model chunk of `layers` whose forward full recomputation reruns."""
    if lay.recompute != "full":
        return 0
    return min(lay.recompute_num_layers, layers) if lay.recompute_method == "block" else layers


def chunk_activation_bytes(model: ModelShape, lay: Layout, layers: int, first: int = 0):
    """(kept, transient): the bytes a model chunk of `layers` layers from layer `first` keeps
    per microbatch from its forward to its backward, and what its backward holds at most on top
    (full recomputation's rerun layers), per rank; each layer as its kind keeps them."""
    kinds = [model.has_experts(l) for l in range(first, first + layers)]

    def one(rec):  # a layer's bytes under rec, by its kind
        return {x: layer_activation_bytes(model, lay, rec, first + kinds.index(x))
                for x in set(kinds)}

    def held(each, which):  # the bytes of the chunk's layers `which` (indices)
        return sum(b * sum(kinds[i] == x for i in which) for x, b in each.items())

    if lay.recompute != "full":
        return held(one(None), range(layers)), 0.0
    inp, every = one("full"), one("none")
    n = lay.recompute_num_layers
    if lay.recompute_method == "block":
        k = min(n, layers)
        return held(inp, range(k)) + held(every, range(k, layers)), \
            max((every[kinds[i]] for i in range(k)), default=0.0)
    groups = [range(b, min(b + n, layers)) for b in range(0, layers, n)]
    return held(inp, [g[0] for g in groups]), max((held(every, g) for g in groups), default=0.0)


def layer_cost(model: ModelShape, cluster: Cluster, lay: Layout,
               layer: int | None = None) -> LayerCost:
    """Transformer layer `layer` (None: the layers' mean; they differ in their attention window
    and whether their MLP has experts), one microbatch, one TP (and CP) rank."""
    kinds = _moe.by_kind(model, layer)
    if kinds[0][1] is not model:  # the layer's MLP kind (None: each kind by its share)
        costs = [(w, layer_cost(one, cluster, lay, layer)) for w, one in kinds]
        return LayerCost(*(sum(w * getattr(c, f.name) for w, c in costs)
                           for f in dataclasses.fields(LayerCost)))
    gpu, t = cluster.gpu, lay.tp
    h, s, q = model.hidden_size, model.seq_length, model.q_size
    kv = model.kv_heads * model.head_dim
    T = lay.micro_batch_size * s / lay.cp  # this rank's tokens
    h_rep = h / t if lay.sequence_parallel else h
    mla = model.multi_latent_attention  # its projections in place of q/k/v's (planner_mla)
    sp = lay.sequence_parallel and t > 1
    attention = _mla.gemms(model, T, t, sp) if mla else \
        [(1, T, (q + 2 * kv) / t, h), (1, T, h, q / t)]
    gemms = [*attention, *_moe.mlp_gemms(model, T, t, lay.ep, _moe.whole(model, lay))]
    gemm_f = sum(c * _gemm_time(gpu, m, n, k) for c, m, n, k in gemms)
    # QKᵀ and PV over the keys causal flash attention executes (half the sequence; a window's)
    attn_exec = 4 * T * model.executed_keys(layer) * q / t
    attn_f = attn_exec / (gpu.peak_tflops * 1e12 * gpu.attn_eff) + KERNEL_LATENCY_S
    act_bytes = _moe.activation_bytes(model, t)
    norm_bytes = 8 * h_rep
    rope_bytes = _mla.elementwise_bytes(model, t, sp) if mla else 4 * (q + kv) / t
    elem_bytes = norm_bytes + 12 * h_rep + rope_bytes + act_bytes
    elem_f = _bytes_time(gpu, elem_bytes * T, 8)
    # TP: two all-reduces (or with SP two all-gathers + two reduce-scatters, the same bytes)
    # per forward, as many in backward; SP's backward all-gathers the norm outputs again. Whole
    # experts without a shared expert: the attention's alone.
    tp_f = tp_b = 0.0
    if t > 1:
        bw, alpha = _link(cluster, t)
        ar = _ring(T * h * 2, t, bw, alpha, "all_reduce")
        ag = _ring(T * h * 2, t, bw, alpha, "all_gather")
        sp_f, sp_b = _moe.sp_collectives(model, lay)
        tp_f = 2 * ar if not lay.sequence_parallel else sp_f * ag
        tp_b = 2 * ar if not lay.sequence_parallel else sp_b * ag
    # CP: the keys and values of the whole sequence (this rank's kv heads, bf16), gathered over
    # the cp ranks - which stride by tp - twice forward; backward gathers them again and
    # reduce-scatters their gradients (summed in f32).
    cp_f = cp_b = 0.0
    if lay.cp > 1:
        bw, alpha = _link(cluster, t * lay.cp)
        kv_local = max(model.kv_heads // t, 1) * model.head_dim
        full = lay.micro_batch_size * s * kv_local * 2
        cp_f = 2 * _ring(full, lay.cp, bw, alpha, "all_gather")
        cp_b = cp_f + 2 * _ring(2 * full, lay.cp, bw, alpha, "reduce_scatter")
    # planner_moe: router, dispatch, host routing; expert parallelism's exchange
    moe_f, moe_b = _moe.routing_s(model, cluster, lay, T) if model.num_experts else (0.0, 0.0)
    ex_f, ex_b = _moe.exchange_s(model, cluster, lay, T)
    mla_f, mla_b = _mla.extra_s(model, cluster, lay, T)  # narrow GEMM, kernels, TP collectives
    forward = gemm_f + attn_f + elem_f + tp_f + cp_f + moe_f + ex_f + mla_f
    backward = 2 * gemm_f + 2.5 * attn_f + 2 * elem_f + tp_b + cp_b + moe_b + ex_b + mla_b
    if lay.recompute == "selective":  # braid's: the two norm outputs and the activation
        backward += _bytes_time(gpu, (norm_bytes + act_bytes) * T, 3)
    backward += _mla.up_recompute_s(model, cluster, lay, T)  # mla_up_proj: q, k, v again
    layers = model.num_layers if layer is None else 1
    one = model if layer is None else dataclasses.replace(  # this layer alone
        model, num_layers=1, window_layers=(), window_size=model.window_size
        if model.windowed(layer) else -1)
    model_flops = _flops.forward_flops_per_token(
        dataclasses.replace(one, vocab_size=0, mtp_num_layers=0), s) / layers * T / t
    return LayerCost(forward, backward, model_flops, ex_f, ex_b,
                     _mla.up_recompute_flops(model, lay, T))


def head_cost(model: ModelShape, cluster: Cluster, lay: Layout):
    """(forward, backward) of the LM head + vocab-parallel cross-entropy on the last stage."""
    gpu, t = cluster.gpu, lay.tp
    if model.vocab_size == 0:  # a bare stack of layers (tests)
        return 0.0, 0.0
    T = lay.micro_batch_size * model.seq_length / lay.cp
    g = _gemm_time(gpu, T, model.vocab_size / t, model.hidden_size)
    ce = _bytes_time(gpu, T * model.vocab_size / t * (2 + 4 + 4), 3)  # logits, f32 softmax
    return g + ce, 2 * g + ce


# ---- memory --------------------------------------------------------------------------------

def stage_params(model: ModelShape, lay: Layout):
    """Parameters held by each pipeline rank (one TP shard)."""
    return [sum(chunks) for chunks in chunk_params(model, lay)]


def chunk_params(model: ModelShape, lay: Layout):
    """Parameters of each model chunk of each pipeline rank ([rank][chunk], one TP shard):
    the embedding in rank 0's chunk 0, the LM head and final norm in the last rank's last."""
    ranges = stage_ranges(model, lay)
    emb = model.vocab_size * model.hidden_size / lay.tp
    whole = _moe.whole(model, lay)  # the experts whole (--expert-tensor-parallel-size 1)
    out = [[model.layers_params(b, e, lay.tp, lay.ep, whole) for b, e in chunks]
           for chunks in ranges]
    out[0][0] += emb
    head = emb + model.hidden_size
    if model.tied_embeddings and lay.pp == 1:
        head -= emb
    out[lay.pp - 1][lay.virtual_stages - 1] += head + _mtp.params(model, lay)
    return out


def memory(model: ModelShape, cluster: Cluster, lay: Layout, microbatches: int):
    """Per-GPU memory parts (GB) of the rank that needs the most, each rank's own layers
    counted: its chunks' activations, and (chunks of different kinds of layers) as many of
    each at once as braid's schedule keeps."""
    T = lay.micro_batch_size * model.seq_length / lay.cp
    best, ranges = None, stage_ranges(model, lay)

    @functools.cache
    def chunk(first, layers):  # chunks of a size are alike unless their layers' kinds differ
        return chunk_activation_bytes(model, lay, layers, first)

    experts = [sum(x) for x in _moe.chunk_experts(model, lay, ranges)]
    for r, (p, n) in enumerate(zip(stage_params(model, lay), in_flight(lay, microbatches))):
        acts = [chunk(b if model.mixed_mlps else 0, e - b) for b, e in ranges[r]]
        if r == lay.pp - 1:  # the multi-token prediction depths on the last chunk
            acts[-1] = _mtp.kept(model, lay, acts[-1])
        kept = [k for k, _ in acts]  # chunks that keep different amounts: walk the schedule
        act = kept[0] * n if len(set(kept)) == 1 else peak_kept(
            schedule(lay.pp, microbatches, lay.virtual_stages), r, kept)
        act += max(t for _, t in acts)
        if r == lay.pp - 1:          # bf16 logits and their f32 softmax / gradient
            act += T * model.vocab_size / lay.tp * (2 + 4)
        grads = 4 * p + 2 * _moe.grad_reduce_buffer(lay, p, experts[r])  # f32; bf16 staging
        parts = {"params": 2 * p / GB, "grads": grads / GB,
                 "optimizer": 12 * _moe.sharded(lay, p, experts[r]) / GB,
                 "activations": act / GB, "reserved": MEMORY_RESERVED_GB}
        total = sum(parts.values())
        if best is None or total > best[0]:
            best = (total, parts)
    return best


# ---- one layout ----------------------------------------------------------------------------

class DoesNotFit(Exception):
    pass


def check_layout(model: ModelShape, cluster: Cluster, lay: Layout, global_batch: int) -> int:
    """The number of microbatches, or ValueError saying why the layout is not valid."""
    t, p, d, b, v = lay.tp, lay.pp, lay.dp, lay.micro_batch_size, lay.virtual_stages
    c = lay.cp
    if t * c * p * d != cluster.num_gpus:
        cp_term = f" x cp {c}" if c > 1 else ""
        raise ValueError(f"tp {t}{cp_term} x pp {p} x dp {d} = {t * c * p * d} != "
                         f"{cluster.num_gpus} GPUs")
    if c < 1 or (c > 1 and model.seq_length % (2 * c)):
        raise ValueError(f"cp {c}: the sequence ({model.seq_length}) does not split into 2 x cp "
                         "chunks")
    if model.num_attention_heads % t:
        raise ValueError(f"{model.num_attention_heads} heads do not divide by tp {t}")
    if model.kv_heads % t and t % model.kv_heads:
        raise ValueError(f"{model.kv_heads} KV heads and tp {t}: neither divides the other")
    widths = [("ffn", model.ffn_hidden_size), *_moe.widths(model, lay), ("vocab", model.vocab_size)]
    if any(w % t for _, w in widths):
        raise ValueError(" / ".join(f"{name} {w}" for name, w in widths) + f" by tp {t}")
    if _moe.layout_error(model, lay):
        raise ValueError(_moe.layout_error(model, lay))
    if lay.sequence_parallel and (t == 1 or model.seq_length % (t * c)):
        raise ValueError("sequence parallelism needs tp > 1 dividing the sequence (per CP rank)")
    if global_batch % (b * d):
        raise ValueError(f"global batch {global_batch} is not a multiple of micro batch {b} "
                         f"x dp {d}")
    m = global_batch // (b * d)
    stage_ranges(model, lay)  # ValueError naming the rule unless the layers split
    if v > 1 and (p == 1 or m % p):
        raise ValueError(f"virtual stages need pp > 1 and microbatches {m} divisible by pp {p}")
    if lay.recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute {lay.recompute!r}: none, selective or full")
    if lay.recompute_method not in ("uniform", "block") or lay.recompute_num_layers < 1:
        raise ValueError(f"recompute method {lay.recompute_method!r} with "
                         f"{lay.recompute_num_layers} layers: uniform or block, at least 1")
    if lay.recompute != "full" and (lay.recompute_method, lay.recompute_num_layers) != \
            ("uniform", 1):
        raise ValueError(f"recompute method {lay.recompute_method} needs recompute full")
    if _mla.layout_error(model, lay):
        raise ValueError(_mla.layout_error(model, lay))
    return m


def predict(model: ModelShape, cluster: Cluster, lay: Layout, global_batch: int,
            baseline: bool = True) -> dict:
    """The prediction for one layout (ValueError if invalid, DoesNotFit if over memory).
    baseline=False: the scaling baseline's run, timed whether or not it fits (a reference
    point, not a proposal), without a baseline of its own."""
    m = check_layout(model, cluster, lay, global_batch)
    total_mem, parts = memory(model, cluster, lay, m)
    if baseline and total_mem > cluster.gpu.memory_gb:
        raise DoesNotFit(f"needs {total_mem:.1f} GB per GPU (params {parts['params']:.1f}, "
                         f"grads {parts['grads']:.1f}, optimizer {parts['optimizer']:.1f}, "
                         f"activations {parts['activations']:.1f}, reserved "
                         f"{parts['reserved']:.1f}) > {cluster.gpu.memory_gb:.0f} GB")
    gpu, p, v, t, d, cp = cluster.gpu, lay.pp, lay.virtual_stages, lay.tp, lay.dp, lay.cp
    # Each layer's cost by its kind (its attention window, its MLP dense or experts); a chunk's
    # is its layers' sum, full recomputation adding the forward of those it reruns (its first).
    kinds = [(model.windowed(l), model.has_experts(l)) for l in range(model.num_layers)]
    by_kind = {k: layer_cost(model, cluster, lay, kinds.index(k)) for k in set(kinds)}
    costs = [by_kind[k] for k in kinds]
    hf, hb = head_cost(model, cluster, lay)
    mtp = _mtp.cost(model, cluster, lay, costs[-1], (hf, hb))  # after the head (planner_mtp)
    ranges = stage_ranges(model, lay)

    def rerun(b, e):
        return range(b, b + recomputed_layers(lay, e - b))

    fwd = [[sum(costs[l].forward for l in range(b, e)) for b, e in rank] for rank in ranges]
    bwd = [[sum(costs[l].backward for l in range(b, e)) +
            sum(costs[l].forward for l in rerun(b, e)) for b, e in rank] for rank in ranges]
    fwd[p - 1][v - 1] += hf + mtp.forward  # the last model chunk: LM head and loss
    bwd[p - 1][v - 1] += hb + mtp.backward
    T = lay.micro_batch_size * model.seq_length / cp
    p2p_bytes = T * model.hidden_size * 2 / (t if lay.sequence_parallel else 1)
    bw, alpha = _link(cluster, t * cp * d * p)
    p2p = alpha + p2p_bytes / bw if p > 1 else 0.0
    sim = _C.simulate(schedule(p, m, v), forward_by_chunk=fwd, backward_by_chunk=bwd, p2p=p2p)
    if not sim.ok:
        raise RuntimeError(f"braid's schedule failed to simulate: {sim.error}")
    # DP: each model chunk's gradients, f32 (bf16: --grad-reduce-in-bf16), are reduced (ZeRO:
    # reduce-scattered) over dp (x cp, `d` below; the experts' over dp x cp / ep: planner_moe).
    # With overlap_grad_reduce, as braid does: a chunk's buckets are posted while its last
    # microbatch's backward completes them (the first once a bucket's share of that backward
    # has run, the last at its end), the chunks one after another on the rank's DP channel in
    # the order their last backwards end - under the interleaved schedule the later chunks
    # finish theirs first, so their reductions hide behind the earlier chunks' backwards.
    # Without it: the whole buffer after the rank's last action.
    d *= cp
    per_chunk, experts = chunk_params(model, lay), _moe.chunk_experts(model, lay, ranges)
    params, held = [sum(c) for c in per_chunk], [sum(x) for x in experts]
    bucket = max(40e6, 1e6 * d)  # braid's (and Megatron's) default DDP bucket, in elements
    began, ended = sim.last_backward_start, sim.last_backward_end
    ends = []
    for r in range(p):
        if d == 1:
            ends.append(sim.finish[r])
            continue
        if not lay.overlap_grad_reduce:
            ends.append(sim.finish[r] + _moe.grad_sync_s(cluster, lay, params[r], held[r]))
            continue
        free = 0.0
        for c in sorted(range(v), key=lambda c: ended[r][c]):
            begin, end = began[r][c], ended[r][c]
            reduce_s = _moe.grad_sync_s(cluster, lay, per_chunk[r][c], experts[r][c])
            first = min(1.0, bucket / max(per_chunk[r][c], 1.0))  # the first bucket's share
            start = max(free, begin + first * (end - begin))
            free = max(start + reduce_s, end + first * reduce_s)
        ends.append(max(sim.finish[r], free))
    ends[-1] += mtp.grad_sync  # eh_proj's gradient summed over TP
    shard = max(map(functools.partial(_moe.sharded, lay), params, held))
    opt = _bytes_time(gpu, OPTIMIZER_BYTES_PER_PARAM * shard, 4)
    gather = 0.0
    if lay.zero:  # bf16 params all-gathered; with overlap, during the first forward
        gather = max(_moe.data_sync_s(cluster, lay, 2, n, x, "all_gather")
                     for n, x in zip(params, held))
        if lay.overlap_param_gather:
            bucket = max(40e6, 1e6 * d) / max(max(params), 1.0)
            gather = max(gather - sum(fwd[0]), gather * min(1.0, bucket))
    emb_sync = 0.0
    if (model.tied_embeddings or _mtp.depths(model)) and p > 1:  # the last stage's copy
        nbw, nalpha = _link(cluster, cluster.num_gpus)
        emb_sync = _ring(4 * model.vocab_size * model.hidden_size / t, 2, nbw, nalpha,
                         "all_reduce")
    step = max(ends) + opt + gather + emb_sync + 2 * NET_ALPHA_S * math.log2(max(2, d * p * t))
    model_flops = _flops.flops_per_iteration(model, model.seq_length, global_batch)
    rerun_flops = sum(costs[l].model_flops for rank in ranges for b, e in rank
                      for l in rerun(b, e)) + mtp.rerun_flops + sum(c.rerun_flops for c in costs)
    hw_flops = model_flops + rerun_flops * t * m * d  # d: dp x cp
    peak = gpu.peak_tflops * 1e12
    out = dict(
        tp=t, pp=p, dp=lay.dp, cp=cp, ep=lay.ep, micro_batch_size=lay.micro_batch_size,
        virtual_stages=v, expert_tensor_parallel_size=1 if _moe.whole(model, lay) else t,
        first_stage_layers=lay.first_stage_layers, last_stage_layers=lay.last_stage_layers,
        stage_layers=[sum(e - b for b, e in chunks) for chunks in ranges],
        **({"model_chunk_layers": list(lay.model_chunk_layers)} if lay.model_chunk_layers else {}),
        recompute=lay.recompute, recompute_method=lay.recompute_method,
        recompute_num_layers=lay.recompute_num_layers,
        **({"recompute_mla_up_proj": True} if lay.recompute_mla_up_proj else {}),
        **({"grad_reduce_in_bf16": True} if lay.grad_reduce_in_bf16 else {}),
        sequence_parallel=lay.sequence_parallel, zero=lay.zero,
        microbatches=m, step_time_s=step, tokens_per_s=global_batch * model.seq_length / step,
        mfu=model_flops / (step * cluster.num_gpus * peak),
        hfu=hw_flops / (step * cluster.num_gpus * peak),
        model_tflops_per_gpu=model_flops / (step * cluster.num_gpus) / 1e12,
        memory_gb_per_gpu=total_mem, memory_parts_gb=parts,
        bubble_fraction=sim.bubble_fraction, pipeline_s=sim.makespan,
        exposed_dp_s=max(ends) - max(sim.finish), optimizer_s=opt + gather + emb_sync,
        expert_exchange_s=_moe.step_exchange_s(costs, ranges, m, rerun, mtp.exchange),
    )
    out["scaling_efficiency"] = _scaling(model, cluster, lay, m, out) if baseline else 1.0
    return out


def _scaling(model, cluster, lay, m, result) -> float:
    """Per-GPU throughput against the same layout (tp, cp, ep, pp, micro batch, microbatches per
    replica, ...) on one node's worth of data parallelism: dp0 = max(1, gpus_per_node /
    (tp cp pp)) replicas (or whole EP groups), where DP traffic stays on NVLink (or none)."""
    dp0 = max(1, cluster.gpus_per_node // (lay.tp * lay.cp * lay.pp))
    dp0 = _moe.baseline_dp(model, lay, dp0)  # whole EP groups: the same ep
    if dp0 >= lay.dp:
        return 1.0
    small = dataclasses.replace(cluster, num_gpus=lay.tp * lay.cp * lay.pp * dp0)
    base = predict(model, small, dataclasses.replace(lay, dp=dp0),
                   m * lay.micro_batch_size * dp0, baseline=False)
    per_gpu = result["tokens_per_s"] / cluster.num_gpus
    return per_gpu / (base["tokens_per_s"] / small.num_gpus)


# ---- search --------------------------------------------------------------------------------

def _pow2_upto(n):
    return [1 << i for i in range(n.bit_length())]


def _divisors(n):
    return [k for k in range(1, n + 1) if n % k == 0]


def _cp_choices(model):
    """The context-parallel sizes the search tries: 1, and 2, 4, 8 where each sequence splits
    into 2 x cp chunks of 2048 tokens or more (shorter ones leave a rank's GEMMs too thin to
    gain)."""
    s = model.seq_length
    return [c for c in _pow2_upto(8) if c == 1 or (s % (2 * c) == 0 and s // (2 * c) >= 2048)]


def search(model: ModelShape, cluster: Cluster, global_batch: int, fixed: dict | None = None,
           train_tokens: float | None = None, gpu_hour_price: float | None = None,
           rampup: list[tuple[int, int]] | None = None):
    """All valid layouts that fit, best (highest tokens/s) first, and the reasons the others
    were rejected (a dict reason -> count; empty when something fits). `rampup`: the
    (global batch, steps) of a --rampup-batch-size phase, part of train_tokens, each costed at
    its own batch's step time (for a fixed dp and micro batch: the run's)."""
    fixed = {k: v for k, v in (fixed or {}).items() if v is not None}
    n = cluster.num_gpus
    tps = [fixed["tp"]] if "tp" in fixed else _pow2_upto(min(cluster.gpus_per_node, n))
    cps = [fixed["cp"]] if "cp" in fixed else _cp_choices(model)
    pps = [fixed["pp"]] if "pp" in fixed else [p for p in _divisors(n) if p <= model.num_layers]
    mbs = [fixed["micro_batch_size"]] if "micro_batch_size" in fixed else [1, 2, 4, 8]
    vs = [fixed["virtual_stages"]] if "virtual_stages" in fixed else [1, 2, 4, 8]
    recs = [fixed["recompute"]] if "recompute" in fixed else ["none", "selective", "full"]
    sps = [fixed["sequence_parallel"]] if "sequence_parallel" in fixed else [True, False]
    zeros = [fixed["zero"]] if "zero" in fixed else [True, False]
    overlap = fixed.get("overlap_grad_reduce", True)
    overlap_gather = fixed.get("overlap_param_gather", True)
    bf16_reduce = fixed.get("grad_reduce_in_bf16", False)  # a numerics choice: never searched
    results, rejected = [], {}
    for t, c, p, b, v, rec, sp, z in itertools.product(tps, cps, pps, mbs, vs, recs, sps, zeros):
        d = max(1, n // (t * c * p))  # check_layout rejects t c p d != n
        if "dp" in fixed and fixed["dp"] != d:
            continue
        if sp and t == 1 and "sequence_parallel" not in fixed:
            continue
        if z and d * c == 1 and "zero" not in fixed:
            continue  # ZeRO over one rank shards nothing: the row without it, twice
        splits, why = _split.splits(model, p, v, fixed)  # [(first, last, model chunk layers)]
        experts = _moe.expert_choices(model, t, d * c, sp, fixed)  # [(etp, ep)]
        for (first, last, chunks), (w, e) in itertools.product(splits, experts):
            lay = Layout(t, p, d, b, v, rec, sp, z, overlap, overlap_gather, first, last, cp=c,
                         ep=e, etp=w, model_chunk_layers=chunks, grad_reduce_in_bf16=bf16_reduce)
            for lay in _recompute_choices(model, cluster, lay, global_batch, fixed):
                r = _predict_if_it_fits(model, cluster, lay, global_batch, rejected,
                                        single=len(tps) * len(cps) * len(pps) * len(mbs)
                                        * len(vs) == 1)
                if r is not None:
                    _add_time_and_cost(r, cluster, train_tokens, gpu_hour_price,
                                       _rampup_cost(model, cluster, lay, rampup))
                    results.append(r)
        if not splits and len(tps) * len(cps) * len(pps) * len(mbs) * len(vs) == 1:
            rejected[why] = rejected.get(why, 0) + 1
    results.sort(key=lambda r: -r["tokens_per_s"])
    return results, rejected


def _recompute_choices(model, cluster, lay, global_batch, fixed):
    """The layout under the recompute methods the search tries: selective with and without
    MLA's up projections (planner_mla.selective_choices); the fixed one; else, for full
    recomputation, uniform groups of one layer and - when it fits - block with the fewest
    recomputed layers per chunk that fit (the fastest full recomputation that fits)."""
    if lay.recompute == "selective":
        return _mla.selective_choices(model, lay, fixed)
    if lay.recompute != "full":
        return [lay]
    if "recompute_method" in fixed or "recompute_num_layers" in fixed:
        return [dataclasses.replace(lay, recompute_method=fixed.get("recompute_method", "uniform"),
                                    recompute_num_layers=fixed.get("recompute_num_layers", 1))]
    choices = [lay]
    try:
        m = check_layout(model, cluster, lay, global_batch)
    except ValueError:
        return choices
    def block(k):
        return dataclasses.replace(lay, recompute_method="block", recompute_num_layers=k)

    def fits(k):  # memory falls as k grows: binary search for the smallest k that fits
        return memory(model, cluster, block(k), m)[0] <= cluster.gpu.memory_gb

    low, high = 1, max(e - b for rank in stage_ranges(model, lay) for b, e in rank) - 1
    if high < 1 or not fits(high):
        return choices
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if fits(mid) else (mid + 1, high)
    return choices + [block(low)]


def _predict_if_it_fits(model, cluster, lay, global_batch, rejected, single):
    """predict(), or None after counting why not in `rejected` (an invalid layout's reason only
    when the search had one layout shape to try)."""
    try:
        check_layout(model, cluster, lay, global_batch)
    except ValueError as e:
        if single:
            rejected[str(e)] = rejected.get(str(e), 0) + 1
        return None
    try:
        return predict(model, cluster, lay, global_batch)
    except DoesNotFit:
        rejected["out of memory"] = rejected.get("out of memory", 0) + 1
        return None


def _rampup_cost(model, cluster, lay, rampup):
    """(seconds, tokens) of the ramp's steps under `lay`: each batch with its own microbatch
    count and so its own pipeline bubble."""
    seconds = sum(steps * predict(model, cluster, lay, batch)["step_time_s"]
                  for batch, steps in rampup or ())
    return seconds, sum(steps * batch for batch, steps in rampup or ()) * model.seq_length


def _add_time_and_cost(r, cluster, train_tokens, price, rampup_cost=(0.0, 0)):
    if train_tokens:
        ramp_seconds, ramp_tokens = rampup_cost
        seconds = ramp_seconds + (train_tokens - ramp_tokens) / r["tokens_per_s"]
        r["days_to_train"] = seconds / 86400
        r["gpu_hours"] = seconds / 3600 * cluster.num_gpus
        if price is not None:
            r["cost"] = r["gpu_hours"] * price


def why_nothing_fits(model: ModelShape, cluster: Cluster, global_batch: int, fixed: dict) -> str:
    """Why none fits: the smallest valid layout's memory, or the rule the first one tried breaks."""
    fixed = {k: v for k, v in (fixed or {}).items() if v is not None}
    best, first_error = None, None
    n = cluster.num_gpus
    tps = [fixed["tp"]] if "tp" in fixed else _pow2_upto(min(cluster.gpus_per_node, n))
    cps = [fixed["cp"]] if "cp" in fixed else _cp_choices(model)
    for t, c in itertools.product(tps, cps):
        for p in ([fixed["pp"]] if "pp" in fixed else _divisors(n)):
            d, v = fixed.get("dp", max(1, n // (t * c * p))), fixed.get("virtual_stages", 1)
            splits, why = _split.splits(model, p, v, fixed)
            if not splits:
                first_error = first_error or f"tp {t} cp {c} pp {p} v {v}: {why}"
            for (first, last, chunks), (w, ep) in itertools.product(  # fewest experts a rank
                    splits, _moe.fewest_experts(model, t, d * c, fixed)):
                get = fixed.get
                lay = Layout(t, p, d, get("micro_batch_size", 1), v, get("recompute", "full"),
                             get("sequence_parallel", t > 1), get("zero", True),
                             first_stage_layers=first, last_stage_layers=last, cp=c, ep=ep, etp=w,
                             model_chunk_layers=chunks,
                             recompute_method=get("recompute_method", "uniform"),
                             recompute_num_layers=get("recompute_num_layers", 1),
                             recompute_mla_up_proj=get("recompute_mla_up_proj", False),
                             grad_reduce_in_bf16=get("grad_reduce_in_bf16", False))
                try:
                    m = check_layout(model, cluster, lay, global_batch)
                except ValueError as e:
                    first_error = first_error or f"tp {t} cp {c} pp {p} v {v}: {e}"
                    continue
                mem = memory(model, cluster, lay, m)
                if best is None or mem[0] < best[0][0]:
                    best = (mem, lay)
    if best is None:
        return ("no valid layout: tp x cp x pp x dp must equal the GPUs, heads/ffn/vocab "
                "divide by tp, layers split over pp x v, ep divide the experts and dp x cp, "
                "the global batch by micro batch x dp"
                + (f" (the first tried, {first_error})" if first_error else ""))
    (total, parts), lay = best
    return (f"no layout fits in {cluster.gpu.memory_gb:.0f} GB per {cluster.gpu.name}: the "
            f"smallest, tp {lay.tp}{f' cp {lay.cp}' if lay.cp > 1 else ''} pp {lay.pp} dp "
            f"{lay.dp}{_moe.ep_label(model, lay)} micro batch "
            f"{lay.micro_batch_size} recompute {lay.recompute}"
            f"{'+up' if lay.recompute_mla_up_proj else ''}"
            f"{f' block {lay.recompute_num_layers}' if lay.recompute_method == 'block' else ''}"
            f" ZeRO {lay.zero}, needs "
            f"{total:.1f} GB (params {parts['params']:.1f}, grads {parts['grads']:.1f}, "
            f"optimizer {parts['optimizer']:.1f}, activations {parts['activations']:.1f}, "
            f"reserved {parts['reserved']:.1f}); {model.num_params() / 1e9:.1f}B parameters "
            f"need {18 * model.num_params() / GB / cluster.num_gpus:.1f} GB per GPU of state "
            "even fully sharded" + _moe.why(model, lay) + ": more GPUs, or a GPU with more memory")
