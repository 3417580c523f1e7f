"""Model FLOPs, device peaks and MFU, as Megatron-LM reports them.

Model FLOPs follow Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU
Clusters", eq. 3), generalised to grouped-query attention and gated MLPs (SwiGLU, quick GEGLU:
three matrices): every matrix product of the forward pass counts 2·m·n·k, attention counts QKᵀ
and the weighted sum over the whole sequence (no causal halving) - on a sliding-window layer
over min(sequence, window + 1) keys, as Megatron-Bridge counts it - and a training iteration is
3× the forward (backward = 2×).
Recomputation is not counted: that is the hardware FLOPs (HFU), not the model's. For GPT-2
shapes (ffn = 4h, no GQA) this is exactly the paper's 72·B·s·l·h²·(1 + s/6h + V/12lh).

A mixture-of-experts layer (num_experts > 0) counts, in place of the dense MLP, the k =
moe_router_topk experts each token is routed to (their MLPs of moe_ffn_hidden_size, or
ffn_hidden_size) and the router GEMM [h -> E]: per token 2·k·m·h·F + 2·h·E, m = 3 with a gated
MLP, else 2. The experts' term is Megatron-LM's (megatron/training/training.py,
num_floating_point_operations: 3 · 2 · B·s · h · (F · k · m) per MoE layer, "routed experts";
the megatron-core wheel does not ship that file); Megatron leaves out the router, which braid
counts as it counts every other matrix product of the forward pass (Mixtral 8x7B: 0.008% of
its layers' model FLOPs). Only the experts a token is routed to count: the model FLOPs of an
E-expert top-k layer are those of a dense layer of k·F (+ the router), whatever E is. A shared
expert (moe_shared_expert_intermediate_size S) counts as a dense MLP of S, its gate as a [h -> 1]
GEMM. The layers moe_layers marks 0 count their dense MLP of ffn_hidden_size.

Multi-latent attention (multi_latent_attention; n heads, latent ranks Lq and Lkv, head widths
Dn = qk_head_dim, Dr = qk_pos_emb_head_dim, Dv = v_head_dim) counts its GEMMs per token: the
queries 2·(h·Lq + Lq·n·(Dn + Dr)) through their latent (q_a_proj, q_b_proj), or 2·h·n·(Dn + Dr)
without one (Lq = 0, q_proj); kv_a_proj_with_mqa 2·h·(Lkv + Dr); kv_b_proj 2·Lkv·n·(Dn + Dv);
o_proj 2·n·Dv·h; and attention 2·n·(Dn + Dr) per key for the scores and 2·n·Dv per key for the
values. These are Megatron-LM's terms (training.py, num_floating_point_operations, its
multi_latent_attention branch) but for two things braid counts as it counts every model: no
causal halving of the attention (Megatron halves it), and no elementwise terms (Megatron adds
Lq + Lkv per token for the two latent norms).

Multi-token prediction (mtp_num_layers D > 0, DeepSeek-V3's; each depth on every token) counts,
per depth, what it runs besides the main model: one transformer layer of the last layer's kind
(its attention window, its MLP dense or experts, as the layers above count), eh_proj [2h -> h]
2·2h·h, and its logits through the shared LM head 2·h·V (V as the main head's). These are
Megatron-LM's terms (training.py, num_floating_point_operations: mtp_num_layers more layers of
the last layer's kind, 2·(2·h·h) for eh_proj and the logits counted D + 1 times) but for what
braid leaves out of every model: the causal halving, and the elementwise 2·3h per token Megatron
adds for the depth's three norms (enorm, hnorm, the final one). Its embedding lookup has no
FLOPs.

MFU = achieved model FLOP/s per device / the device's dense bf16 peak (A100 312 TFLOP/s,
H100/H200 989). On the CPU the peak is measured: one core's f32 GEMM rate (numpy's BLAS, one
thread) times the cores this rank has, cached per machine in ~/.cache/braid/cpu_peak.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from braid.activation_args import GATED

# Dense (no sparsity) bf16 tensor-core peaks, TFLOP/s, by the device name's model.
GPU_PEAK_TFLOPS = {"A100": 312.0, "H100": 989.0, "H200": 989.0, "H800": 989.0, "GH200": 989.0}


def attended_keys(cfg, seq_length: int) -> float:
    """The keys each query is counted against, summed over `cfg`'s layers: seq_length on a
    full-attention layer, min(seq_length, window_size + 1) on a windowed one."""
    window = getattr(cfg, "window_size", -1)
    if window < 0:
        return cfg.num_layers * seq_length
    windowed = sum(cfg.window_layers) if len(cfg.window_layers) else cfg.num_layers
    return (cfg.num_layers - windowed) * seq_length + windowed * min(seq_length, window + 1)


def last_layer_keys(cfg, seq_length: int) -> float:
    """The keys each query of `cfg`'s last layer is counted against (a multi-token prediction
    depth's, which is of the last layer's kind): seq_length, or min(seq_length, window_size + 1)
    where that layer is windowed."""
    window, layers = getattr(cfg, "window_size", -1), list(getattr(cfg, "window_layers", ()))
    if window < 0 or (layers and not layers[-1]):
        return seq_length
    return min(seq_length, window + 1)


def attention_flops(cfg) -> tuple[int, int]:
    """Forward FLOPs of one token in one layer's attention: (its projections, its scores and
    weighted values per key it attends to)."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    if getattr(cfg, "multi_latent_attention", False):  # the module docstring
        qk = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim
        lq, lkv, v = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.v_head_dim
        projections = 2 * (h * lq + lq * heads * qk) if lq else 2 * h * heads * qk
        projections += 2 * h * (lkv + cfg.qk_pos_emb_head_dim)  # kv_a_proj_with_mqa
        projections += 2 * lkv * heads * (cfg.qk_head_dim + v)  # kv_b_proj
        projections += 2 * heads * v * h                         # o_proj
        return projections, 2 * heads * qk + 2 * heads * v
    q = heads * cfg.head_dim  # h, unless --kv-channels widens the heads
    kv = cfg.kv_heads * cfg.head_dim
    # query, key and value projections, the output projection; QKᵀ and the probabilities times V
    return 2 * h * (q + 2 * kv) + 2 * q * h, 2 * 2 * q


def forward_flops_per_token(cfg, seq_length: int) -> float:
    """Model FLOPs of one token's forward pass through `cfg` (a TransformerConfig) with
    sequences of `seq_length`: the linear layers, attention scores and context, the LM head,
    and the multi-token prediction depths (the module docstring)."""
    h = cfg.hidden_size
    mlp_matrices = 3 if cfg.activation in GATED else 2
    per_layer, per_key = attention_flops(cfg)
    dense_mlp = 2 * mlp_matrices * h * cfg.ffn_hidden_size
    experts = getattr(cfg, "num_experts", 0) or 0
    moe_layers, pattern = 0, ()
    if experts:  # the k routed experts' MLPs and the router (the module docstring)
        ffn = getattr(cfg, "moe_ffn_hidden_size", 0) or cfg.ffn_hidden_size
        moe_mlp = 2 * mlp_matrices * h * ffn * cfg.moe_router_topk + 2 * h * experts
        shared = getattr(cfg, "moe_shared_expert_intermediate_size", 0) or 0
        moe_mlp += 2 * mlp_matrices * h * shared  # the shared expert, as a dense MLP
        moe_mlp += 2 * h if getattr(cfg, "moe_shared_expert_gate", False) else 0
        pattern = list(getattr(cfg, "moe_layers", ()) or ())
        moe_layers = sum(pattern) if pattern else cfg.num_layers
    attention = per_key * attended_keys(cfg, seq_length)
    mlps = moe_layers * moe_mlp + (cfg.num_layers - moe_layers) * dense_mlp if experts else \
        cfg.num_layers * dense_mlp
    main = cfg.num_layers * per_layer + mlps + attention + 2 * h * cfg.vocab_size
    depths = getattr(cfg, "mtp_num_layers", 0) or 0
    if not depths:
        return main
    # Each depth: a layer of the last layer's kind, eh_proj [2h -> h], its logits.
    last_moe = bool(experts) and (not pattern or bool(pattern[-1]))
    last_mlp = moe_mlp if last_moe else dense_mlp
    depth = per_layer + last_mlp + per_key * last_layer_keys(cfg, seq_length) + \
        2 * 2 * h * h + 2 * h * cfg.vocab_size
    return main + depths * depth


def flops_per_iteration(cfg, seq_length: int, global_batch_size: int) -> float:
    """Model FLOPs of one training iteration (forward + backward) over the global batch."""
    return 3 * forward_flops_per_token(cfg, seq_length) * seq_length * global_batch_size


def gpu_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU from its name ("NVIDIA H200", "NVIDIA A100-SXM4-80GB"),
    None for one not in the table."""
    words = device_name.replace("-", " ").upper().split()
    for model in sorted(GPU_PEAK_TFLOPS, key=len, reverse=True):
        if model in words:
            return GPU_PEAK_TFLOPS[model]
    return None


_CORE_GEMM = r"""
import time, numpy as np
n = 512
a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
b = a.T.copy()
for _ in range(3): a @ b
best = float("inf")
for _ in range(7):
    t = time.perf_counter(); [a @ b for _ in range(4)]; best = min(best, time.perf_counter() - t)
print(4 * 2 * n ** 3 / best)
"""


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown cpu"


def cpu_core_peak_flops(cache_dir: str | None = None) -> float:
    """One core's f32 GEMM rate (FLOP/s), measured once per machine and cached."""
    base = cache_dir or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "braid")
    path = os.path.join(base, "cpu_peak.json")
    key = f"{_cpu_model()} / {os.cpu_count()} cores"
    try:
        with open(path, encoding="utf-8") as f:
            cached = json.load(f)
        if cached.get("cpu") == key:
            return float(cached["core_flops"])
    except (OSError, ValueError, KeyError):
        pass
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _CORE_GEMM], env=env, capture_output=True,
                         text=True, check=True)
    core = float(out.stdout.split()[-1])
    try:
        os.makedirs(base, exist_ok=True)
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"cpu": key, "core_flops": core}, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: measure again next time
    return core


def cpu_peak_flops(ranks_on_this_node: int) -> float:
    """The f32 peak one rank has: one core's GEMM rate × this node's cores / its ranks."""
    return cpu_core_peak_flops() * (os.cpu_count() or 1) / max(1, ranks_on_this_node)
