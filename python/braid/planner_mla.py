"""What multi-latent attention (DeepSeek-V2/V3's; TransformerConfig.multi_latent_attention) does
in place of ordinary attention's projections, for the planner (braid.planner times it,
docs/planner.md "Multi-latent attention"): its parameters, its GEMMs' shapes, its element-wise
bytes, its TP collectives and what it keeps for the backward - as braid runs it
(csrc/model/latent_attention.cpp). Per layer, microbatch and TP rank; T is the rank's tokens
(micro batch x sequence / cp).

With n heads, Lq and Lkv the latent ranks, Dn + Dr = D the query/key head and Dv the value
head, braid's layer: q_a_proj [Lq, H] and the query latent's norm, q_b_proj [n·D, Lq] (or
q_proj [n·D, H] without a query latent, Lq = 0); kv_a_proj_with_mqa [Lkv + Dr, H] - run as two
GEMMs, the latent's Lkv rows and the shared RoPE key's Dr - and the latent's norm; kv_b_proj
[n·(Dn + Dv), Lkv]; o_proj [H, n·Dv]. Under TP the down projections and the latent norms are
replicated and the up projections and o_proj split by heads:
- without SP every rank runs the replicated layers on every token (they do not shrink with TP),
  and the backward all-reduces the latents' and the shared RoPE key's gradients, each rank's
  heads' share - three all-reduces of T·Lq, T·Lkv and T·Dr bf16 values (two without a query
  latent), not overlapped;
- with SP (megatron-core's MLA under SP) each rank runs them on its own T / t tokens and
  all-gathers [q latent | kv latent | k_pe], W = Lq + Lkv + Dr bf16 values a token, in place of
  the hidden state's all-gather (without a query latent q_proj still takes the gathered hidden
  state, and the latents' gather comes on top); the backward reduce-scatters their gradients in
  one call in place of the all-gather of the normed input and the reduce-scatter of its
  gradient (both stay without a query latent). Packing and unpacking the W channels costs a copy
  each way.
The keys are assembled per head (Dn channels from kv_b_proj, the Dr RoPE channels copied into
every head), the values padded with zeros to D, so that one attention kernel takes heads of
width D: its time is that of D-wide values (the planner's attention term with head_dim = D),
while the model FLOPs (braid.flops) count Dv.

The latent norms exist with qk_layernorm (braid's and Megatron's meaning of it with MLA; every
DeepSeek model has them). YaRN (--rope-type yarn) changes RoPE's frequencies and two scale
factors, not the work: it costs what plain RoPE does.

Selective recomputation with megatron-core's --recompute-modules mla_up_proj (Layout's
recompute_mla_up_proj; TransformerConfig's, csrc/model/transformer_layer.cpp) keeps the gathered
latents, which selective keeps anyway, and the rotated k_pe [T, Dr] in place of q, k and v
([T, n/t, D] each): the backward runs q_b_proj (q_proj on the gathered input without a query
latent: under SP an all-gather more) and kv_b_proj again, RoPE on the queries and the keys' and
values' assembly. HFU counts the GEMMs' FLOPs, MFU does not. The search tries it beside plain
selective for MLA models; a fixed recompute is plain unless it is asked for, as in
pretrain_gpt.py.
"""

from __future__ import annotations

import dataclasses

# Element-wise kernels MLA adds to ordinary attention's (whose two RoPE kernels it keeps, on the
# queries' RoPE channels and the shared key part): the keys' assembly (a copy, a broadcast),
# the values' (zeros, a copy), o_proj's input (a copy); and one per latent norm.
ASSEMBLY_KERNELS = 5


def latent_norms(model) -> list:
    """The ranks of the latents braid norms: [Lq (with a query latent), Lkv], with
    qk_layernorm; [] without."""
    if not model.qk_layernorm:
        return []
    return ([model.q_lora_rank] if model.q_lora_rank else []) + [model.kv_lora_rank]


def params(model) -> tuple:
    """(split, whole): a layer's attention parameters (no biases, not the input norm) that TP
    splits by heads - q_b_proj or q_proj, kv_b_proj, o_proj - and those every TP rank holds
    whole - q_a_proj, kv_a_proj_with_mqa, the latent norms' weights (RMSNorm)."""
    h, n, lq, lkv = model.hidden_size, model.num_attention_heads, model.q_lora_rank, \
        model.kv_lora_rank
    d, dr = model.head_dim, model.qk_pos_emb_head_dim
    split = n * d * (lq or h) + n * (model.qk_head_dim + model.v_head_dim) * lkv + \
        h * n * model.v_head_dim
    whole = lq * h + (lkv + dr) * h + sum(latent_norms(model))
    return split, whole


def gemms(model, T: float, t: int, sp: bool = False) -> list:
    """The attention's forward GEMMs on the efficiency curve, one TP rank, as (count, m, n, k):
    q_a_proj (whole) and q_b_proj (its heads), or q_proj; kv_a_proj_with_mqa's latent rows
    (whole); kv_b_proj and o_proj (its heads). The down projections run on every token, or with
    SP on the rank's T / t. The shared RoPE key's Dr rows are narrow: rope_key_gemm."""
    h, n, lq, lkv = model.hidden_size, model.num_attention_heads, model.q_lora_rank, \
        model.kv_lora_rank
    down = T / t if sp else T
    up_q, up_kv = up_gemms(model, T, t)
    q = [(1, down, lq, h), up_q] if lq else [up_q]
    return q + [(1, down, lkv, h), up_kv, (1, T, h, n * model.v_head_dim / t)]


def up_gemms(model, T: float, t: int) -> list:
    """The up projections' forward GEMMs, one TP rank, as (count, m, n, k), on every token (the
    gathered latents under SP): q_b_proj [T, Lq] x [Lq, n·D / t] (q_proj, k = H, without a query
    latent) and kv_b_proj [T, Lkv] x [Lkv, n·(Dn + Dv) / t]."""
    n = model.num_attention_heads
    return [(1, T, n * model.head_dim / t, model.q_lora_rank or model.hidden_size),
            (1, T, n * (model.qk_head_dim + model.v_head_dim) / t, model.kv_lora_rank)]


def rope_key_gemm(model, T: float) -> tuple:
    """(FLOPs, bytes) of the forward GEMM of kv_a_proj_with_mqa's last Dr rows, the shared RoPE
    key [T, H] x [H, Dr] on the T tokens a rank runs the down projections on: narrow (Dr of 64),
    so at HBM speed like the MoE router's (planner_moe.narrow_gemm_s)."""
    h, dr = model.hidden_size, model.qk_pos_emb_head_dim
    return 2 * T * h * dr, T * (2 * h + 2 * dr) + 2 * dr * h


def latent_width(model) -> int:
    """W: the channels a token's latents all-gather carries under SP, q latent, kv latent and
    the RoPE key part."""
    return model.q_lora_rank + model.kv_lora_rank + model.qk_pos_emb_head_dim


def elementwise_bytes(model, t: int, sp: bool = False) -> float:
    """Bytes per token of the attention's element-wise work in place of ordinary attention's
    RoPE on q and k (4(q + kv)/t), forward: RoPE on the queries' Dr channels (4·n·Dr/t) and on
    the shared key part (4·Dr); the latent norms' inputs and outputs (4·L each, on the tokens
    the rank runs them on); the keys' assembly - Dn channels copied from kv_b_proj's output, the
    RoPE part broadcast into every head ((4·Dn + 2·Dr)·n/t + 2·Dr) -, the values' - zeros of D,
    Dv channels copied (2·D + 4·Dv)·n/t -, and o_proj's input, the Dv channels of each head
    (4·Dv·n/t); with SP the latents' packing (4·W/t) and unpacking (4·W)."""
    n, dn, dr, dv = model.num_attention_heads, model.qk_head_dim, model.qk_pos_emb_head_dim, \
        model.v_head_dim
    per_head = 4 * dr + (4 * dn + 2 * dr) + (2 * model.head_dim + 4 * dv) + 4 * dv
    norms = 4 * sum(latent_norms(model)) / (t if sp else 1)
    packing = 4 * latent_width(model) * (1 + 1 / t) if sp else 0
    return n * per_head / t + 4 * dr + 2 * dr + norms + packing


def backward_all_reduces(model, T: float) -> list:
    """The bytes of each all-reduce over TP in every backward: the gradients of the query
    latent [T, Lq] (with one), the key/value latent [T, Lkv] and the shared RoPE key [T, Dr],
    bf16."""
    lq = [2 * T * model.q_lora_rank] if model.q_lora_rank else []
    return lq + [2 * T * model.kv_lora_rank, 2 * T * model.qk_pos_emb_head_dim]


def extra_s(model, cluster, lay, T: float) -> tuple:
    """(forward, backward) seconds MLA adds to its GEMMs on the curve, its attention and its
    element-wise bytes (elementwise_bytes, in the layer's), one TP rank and microbatch: the
    narrow RoPE-key GEMM (backward twice its forward), the assembly's and the latent norms'
    kernel launches, and its TP collectives - without SP the backward's all-reduces; with SP the
    latents' all-gather and reduce-scatter, less the hidden-state collectives they replace
    (planner.layer_cost counts those of every attention). (0, 0) without MLA."""
    if not model.multi_latent_attention:
        return 0.0, 0.0
    from braid import planner as p  # its cost primitives (planner imports this module)
    from braid import planner_moe
    t, sp = lay.tp, lay.sequence_parallel and lay.tp > 1
    kernels = (ASSEMBLY_KERNELS + len(latent_norms(model)) + (6 if sp else 0)) * p.KERNEL_LATENCY_S
    forward = planner_moe.narrow_gemm_s(cluster.gpu, *rope_key_gemm(model, T / t if sp else T))
    forward += kernels
    backward = 2 * forward
    if t == 1:
        return forward, backward
    bw, alpha = p._link(cluster, t)
    if not sp:
        backward += sum(p._ring(b, t, bw, alpha, "all_reduce")
                        for b in backward_all_reduces(model, T))
        return forward, backward
    latents = 2 * T * latent_width(model)
    hidden = p._ring(2 * T * model.hidden_size, t, bw, alpha, "all_gather")  # = reduce-scatter's
    replaced = 1 if model.q_lora_rank else 0  # without a query latent q_proj gathers h itself
    forward += p._ring(latents, t, bw, alpha, "all_gather") - replaced * hidden
    backward += p._ring(latents, t, bw, alpha, "reduce_scatter") - 2 * replaced * hidden
    return forward, backward


def kept_bytes(model, recompute: str, t: int = 1, sp: bool = False, up: bool = False) -> float:
    """Bytes per token MLA keeps for its backward besides q, k, v, attn_out and lse (which are
    ordinary attention's, n heads of D: the values padded): under none and selective the down
    projections' outputs [T, Lq] and [T, Lkv] and, with the latent norms, their outputs and f32
    statistics (RMSNorm: rstd) - on every token under TP; with SP the outputs and statistics on
    the rank's T / t tokens and the gathered latents on every token. Full keeps only the layer's
    input (planner.layer_activation_bytes). `up` (selective with mla_up_proj): the rotated k_pe
    more and q, k and v less (up_saved_bytes)."""
    if not model.multi_latent_attention or recompute == "full":
        return 0.0
    latents = sum([model.q_lora_rank] if model.q_lora_rank else []) + model.kv_lora_rank
    norms = latent_norms(model)
    if sp and t > 1:
        kept = 2 * latents / t + 2 * latents + 4 * len(norms) / t
    else:
        kept = 2 * latents + sum(2 * r + 4 for r in norms)
    return kept - up_saved_bytes(model, t) if up and recompute == "selective" else kept


# ---- selective recomputation of the up projections (--recompute-modules mla_up_proj) ---------

# Its element-wise kernels: RoPE on the queries, the keys' assembly (a copy, a broadcast), the
# values' (zeros, a copy). The shared key part is kept rotated.
UP_KERNELS = 5


def recomputes_up(model, lay) -> bool:
    """Whether `lay`'s backward projects q, k and v again (selective with mla_up_proj)."""
    return model.multi_latent_attention and lay.recompute == "selective" and \
        lay.recompute_mla_up_proj


def layout_error(model, lay) -> str | None:
    """Why `lay`'s recompute_mla_up_proj does not go with the model or the policy, or None."""
    if not lay.recompute_mla_up_proj:
        return None
    if not model.multi_latent_attention:
        return "--recompute-modules mla_up_proj needs --multi-latent-attention"
    if lay.recompute != "selective":
        return f"--recompute-modules mla_up_proj needs recompute selective, not {lay.recompute}"
    return None


def up_saved_bytes(model, t: int = 1) -> float:
    """Bytes per token mla_up_proj keeps less: q, k and v, n/t heads of D (bf16) each, against
    the rotated k_pe [T, Dr] of every token (the latents are kept anyway)."""
    return 3 * 2 * model.num_attention_heads * model.head_dim / t - 2 * model.qk_pos_emb_head_dim


def up_bytes(model, t: int) -> float:
    """Bytes per token of the rerun's element-wise work (as elementwise_bytes counts them): RoPE
    on the queries' Dr channels (4·n·Dr/t), the keys' assembly ((4·Dn + 2·Dr)·n/t + 2·Dr) and
    the values' ((2·D + 4·Dv)·n/t)."""
    n, dn, dr, dv = model.num_attention_heads, model.qk_head_dim, model.qk_pos_emb_head_dim, \
        model.v_head_dim
    return n * (4 * dr + 4 * dn + 2 * dr + 2 * model.head_dim + 4 * dv) / t + 2 * dr


def up_recompute_s(model, cluster, lay, T: float) -> float:
    """Seconds the rerun adds to a layer's backward, one TP rank and microbatch (0 unless
    recomputes_up): the up projections' forward GEMMs (up_gemms), their element-wise work
    (up_bytes) and, without a query latent under SP, the all-gather of the normed input that
    q_proj takes."""
    if not recomputes_up(model, lay):
        return 0.0
    from braid import planner as p  # its cost primitives (planner imports this module)
    gpu, t = cluster.gpu, lay.tp
    seconds = sum(c * p._gemm_time(gpu, m, n, k) for c, m, n, k in up_gemms(model, T, t))
    seconds += p._bytes_time(gpu, up_bytes(model, t) * T, UP_KERNELS)
    if lay.sequence_parallel and t > 1 and not model.q_lora_rank:
        seconds += p._ring(2 * T * model.hidden_size, t, *p._link(cluster, t), "all_gather")
    return seconds


def up_recompute_flops(model, lay, T: float) -> float:
    """The FLOPs the rerun repeats, one TP rank and microbatch (HFU counts them, MFU not):
    2·T·(Lq·n·D + Lkv·n·(Dn + Dv)) / t (H for Lq without a query latent)."""
    if not recomputes_up(model, lay):
        return 0.0
    return sum(2 * c * m * n * k for c, m, n, k in up_gemms(model, T, lay.tp))


def selective_choices(model, lay, fixed: dict) -> list:
    """`lay` (selective) as the search tries it: for an MLA model with and without mla_up_proj,
    unless fixed; a fixed recompute without recompute_mla_up_proj is without it (as
    pretrain_gpt.py's --recompute-granularity selective alone)."""
    up = fixed.get("recompute_mla_up_proj", False if "recompute" in fixed else None)
    ups = [up] if up is not None else [False, True] if model.multi_latent_attention else [False]
    return [dataclasses.replace(lay, recompute_mla_up_proj=u) for u in ups]
