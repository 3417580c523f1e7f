"""What the planner (braid.planner) is asked about: a model's shape, the GPU types and a
cluster of them, and a parallel layout (with the uneven stage splits the search tries). The GPU
table's efficiency curves are the planner's fitted numbers (docs/planner.md,
benchmarks/planner_validation.py --fit).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re

from braid import planner_mla as _mla
from braid.activation_args import GATED
from braid import planner_mtp as _mtp


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The attribute names braid.flops reads (TransformerConfig's)."""
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    seq_length: int
    # "swiglu" (Llama), "quick_geglu" (GPT-OSS; gated as swiglu), "gelu" (GPT) or "squared_relu"
    # (ungated)
    activation: str = "swiglu"
    # vocab_size 0: a bare stack of layers, no embedding or LM head (tests)
    tied_embeddings: bool = False
    qk_layernorm: bool = False  # a norm on each query and key head (Qwen3)
    kv_channels: int = 0  # each head's width; 0: hidden_size / num_attention_heads
    # Sliding-window attention as TransformerConfig has it: each query of a windowed layer sees
    # itself and window_size keys before it (-1: no window); window_layers, one 0/1 per layer
    # (empty: every layer windowed).
    window_size: int = -1
    window_layers: tuple = ()
    # Mixture of experts as TransformerConfig has it: an expert layer's MLP is num_experts MLPs
    # of moe_ffn_hidden_size (0: ffn_hidden_size), moe_router_topk of them per token, and a
    # router [num_experts, hidden] (replicated over TP). 0 experts: dense. With experts, a
    # shared expert every token goes through, an MLP of moe_shared_expert_intermediate_size (0:
    # none) split over TP like the dense one, with moe_shared_expert_gate its gate [1, hidden]
    # (replicated). moe_layers, one 0/1 per layer (empty: every layer has experts;
    # braid.moe_args.moe_layers of Megatron's --moe-layer-freq): the layers marked 0 have the
    # dense MLP of ffn_hidden_size instead - no router, no experts, no shared expert.
    num_experts: int = 0
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 0
    moe_shared_expert_intermediate_size: int = 0
    moe_shared_expert_gate: bool = False
    moe_layers: tuple = ()
    # Multi-latent attention as TransformerConfig has it (DeepSeek-V2/V3; braid.planner_mla):
    # queries through a latent of q_lora_rank (0: q_proj from the hidden state), keys and values
    # from one of kv_lora_rank per token; each query/key head qk_head_dim + qk_pos_emb_head_dim
    # wide (head_dim), each value head v_head_dim; kv_heads = the heads; with qk_layernorm the
    # two latent norms (not q_norm and k_norm).
    multi_latent_attention: bool = False
    q_lora_rank: int = 0
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    # Multi-token prediction as TransformerConfig has it (DeepSeek-V3's; braid.planner_mtp):
    # this many depths after the last layer, on the last pipeline stage, each a layer of the
    # last layer's kind with eh_proj [H, 2H] and three norms, and its own logits. 0: none.
    mtp_num_layers: int = 0
    # Linear biases (Megatron's add_bias_linear: attention's q, k, v and output, the MLPs' fc1
    # and fc2, the router's) and the norms (LayerNorm: weight and bias, RMSNorm: weight); None:
    # a GELU model's are GPT's (biases, LayerNorm), any other's Llama's (none, RMSNorm).
    add_bias_linear: bool | None = None
    normalization: str | None = None
    # The attention's softmax (TransformerConfig's softmax_type): "learnable" adds a sink per
    # head and layer (GPT-OSS's self_attn.sinks, split over TP); "vanilla" and "off-by-one"
    # have no parameter. Either way its cost is the softmax's.
    softmax_type: str = "vanilla"

    def __post_init__(self):
        if self.normalization not in (None, "LayerNorm", "RMSNorm"):
            raise ValueError(f"normalization {self.normalization!r}: LayerNorm or RMSNorm")
        # Kept only where they differ from the activation's, so that equal models compare equal.
        gpt = self.activation == "gelu"
        if self.add_bias_linear == gpt:
            object.__setattr__(self, "add_bias_linear", None)
        if self.normalization == ("LayerNorm" if gpt else "RMSNorm"):
            object.__setattr__(self, "normalization", None)
        if self.softmax_type not in ("vanilla", "off-by-one", "learnable"):
            raise ValueError(f"softmax_type {self.softmax_type!r}: vanilla, off-by-one or "
                             "learnable")
        if self.mtp_num_layers < 0:
            raise ValueError(f"mtp_num_layers {self.mtp_num_layers}: 0 (none) or more depths")
        if self.multi_latent_attention and self.kv_heads != self.num_attention_heads:
            raise ValueError(f"multi-latent attention: kv heads {self.kv_heads} must be the "
                             f"{self.num_attention_heads} heads (every head has its own key "
                             "and value)")
        if self.multi_latent_attention and self.linear_biases:
            raise ValueError("multi-latent attention has no linear biases: not with "
                             "add_bias_linear (a GELU model's default)")

    @property
    def head_dim(self) -> int:
        if self.multi_latent_attention:
            return self.qk_head_dim + self.qk_pos_emb_head_dim
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def q_size(self) -> int:
        """The queries' (and the attention output's) width: hidden_size unless kv_channels
        widens or narrows the heads."""
        return self.num_attention_heads * self.head_dim

    def windowed(self, layer: int) -> bool:
        """Whether layer `layer` (0-based) attends in the sliding window."""
        return self.window_size >= 0 and (not self.window_layers or
                                          bool(self.window_layers[layer]))

    def executed_keys(self, layer: int | None = None) -> float:
        """The keys a causal flash attention computes per query of layer `layer`, averaged over
        the sequence (None: and over the layers): about half the sequence on a full layer; on
        a windowed one min(i + 1, window + 1) for the query at position i."""
        if layer is None:
            return sum(map(self.executed_keys, range(self.num_layers))) / self.num_layers
        s, w = self.seq_length, self.window_size + 1
        if not self.windowed(layer) or w >= s:
            return s / 2
        return w - (w - 1) * w / (2 * s)

    @property
    def linear_biases(self) -> bool:
        """Whether the linear layers have biases (add_bias_linear, else GPT's with GELU)."""
        return self.activation == "gelu" if self.add_bias_linear is None else self.add_bias_linear

    @property
    def layernorm(self) -> bool:
        """Whether the norms are LayerNorms, with a bias and two f32 statistics a token
        (normalization, else GPT's with GELU); else RMSNorms, one statistic."""
        if self.normalization is None:
            return self.activation == "gelu"
        return self.normalization == "LayerNorm"

    @property
    def gated(self) -> bool:
        """Whether the MLP is gated: fc1 is [gate; up], three matrices."""
        return self.activation in GATED

    def has_experts(self, layer: int) -> bool:
        """Whether layer `layer` (0-based) is a mixture-of-experts layer (else: dense)."""
        return bool(self.num_experts) and (not self.moe_layers or bool(self.moe_layers[layer]))

    @property
    def expert_layers(self) -> int:
        """How many layers have experts."""
        if not self.num_experts:
            return 0
        return sum(map(bool, self.moe_layers)) if self.moe_layers else self.num_layers

    @property
    def mixed_mlps(self) -> bool:
        """Whether moe_layers may mix dense layers among the expert ones."""
        return bool(self.num_experts and self.moe_layers)

    def mlp_kinds(self, layer: int | None = None) -> dict:
        """{whether the MLP has experts: its share of the layers}, of layer `layer` alone or
        (None) of all of them: what the planner weighs a layer's two kinds by."""
        if layer is not None:
            return {self.has_experts(layer): 1.0}
        e, n = self.expert_layers, self.num_layers
        return {x: w for x, w in ((True, e / n), (False, (n - e) / n)) if w}

    def with_experts(self, experts: bool) -> "ModelShape":
        """This model with every layer's MLP that of its expert layers (experts) or its dense
        one (not): the model the planner costs a layer of that kind with."""
        return self._expert_model if experts and self.num_experts else self._dense_model

    @functools.cached_property  # cached on the instance (its fields never change)
    def _expert_model(self) -> "ModelShape":
        return dataclasses.replace(self, moe_layers=())

    @functools.cached_property
    def _dense_model(self) -> "ModelShape":
        return dataclasses.replace(self, num_experts=0, moe_layers=(),
                                   moe_shared_expert_intermediate_size=0,
                                   moe_shared_expert_gate=False)

    @property
    def mlp_hidden_size(self) -> int:
        """Each MLP's hidden size: an expert's with experts (TransformerConfig's
        mlp_hidden_size())."""
        return (self.moe_ffn_hidden_size or self.ffn_hidden_size) if self.num_experts \
            else self.ffn_hidden_size

    @property
    def router_params(self) -> int:
        """An expert layer's router [num_experts, hidden] and, in a model with biases, its bias
        [num_experts] (megatron-core's TopKRouter), whole on every TP rank."""
        return self.num_experts * (self.hidden_size + (1 if self.linear_biases else 0))

    @property
    def replicated_params(self) -> int:
        """An expert layer's parameters whole on every TP rank: the router and the shared
        expert's gate [1, hidden] (no bias)."""
        if not self.num_experts:
            return 0
        return self.router_params + (self.hidden_size if self.moe_shared_expert_gate else 0)

    def one_mlp_params(self, f: int) -> float:
        """An MLP of hidden size f: fc1 (gate and up when gated) and fc2 [+ their biases]."""
        h = self.hidden_size
        return (3 if self.gated else 2) * h * f + \
            (((2 if self.gated else 1) * f + h) if self.linear_biases else 0)

    def mlp_params(self, experts: bool = True) -> float:
        """A layer's MLP: an expert layer's (experts, with experts in the model) num_experts
        MLPs with the router, the shared expert and its gate; else one dense MLP."""
        if not (experts and self.num_experts):
            return self.one_mlp_params(self.ffn_hidden_size)
        shared = self.moe_shared_expert_intermediate_size
        return self.one_mlp_params(self.mlp_hidden_size) * self.num_experts + \
            self.replicated_params + (self.one_mlp_params(shared) if shared else 0)

    def layer_params(self, tp: int = 1, layer: int | None = None) -> float:
        """Layer `layer`'s parameters (None: the layers' mean); with tp, one TP rank's share:
        the router and the gate whole, the rest split (the norms too, an O(h) approximation)."""
        return sum(w * self._kind_params(tp, x) for x, w in self.mlp_kinds(layer).items())

    def layers_params(self, begin: int, end: int, tp: int = 1, ep: int = 1,
                      whole: bool = False) -> float:
        """The parameters of layers [begin, end) (one TP rank's share with tp; with ep, one
        expert-parallel rank's: E / ep experts of each expert layer, split over TP or `whole`)."""
        if not self.mixed_mlps:
            return (end - begin) * self._kind_params(tp, bool(self.num_experts), ep, whole)
        experts = self.experts_before(end) - self.experts_before(begin)
        return experts * self._kind_params(tp, True, ep, whole) + \
            (end - begin - experts) * self._kind_params(tp, False)

    def routed_params(self, tp: int = 1) -> float:
        """An expert layer's routed experts (not the router, not the shared expert), one TP
        rank's share."""
        return self.num_experts * self.one_mlp_params(self.mlp_hidden_size) / tp

    def experts_params(self, begin: int, end: int, tp: int = 1, ep: int = 1,
                       whole: bool = False) -> float:
        """The routed experts' parameters of layers [begin, end) one (TP, EP) rank holds: its
        share of each of E / ep experts, or them `whole` (--expert-tensor-parallel-size 1)."""
        layers = self.experts_before(end) - self.experts_before(begin) if self.mixed_mlps else \
            (end - begin if self.num_experts else 0)
        return layers * self.routed_params(1 if whole else tp) / ep

    def experts_before(self, layer: int) -> int:
        """How many of layers [0, layer) have experts."""
        return self._experts_before[layer]

    @functools.cached_property
    def _experts_before(self) -> list:
        return [0] + list(itertools.accumulate(map(self.has_experts, range(self.num_layers))))

    def _kind_params(self, tp: int, experts: bool, ep: int = 1,
                     whole_experts: bool = False) -> float:
        key = (tp, experts, ep, whole_experts)  # the search asks for a few keys, many times
        if key not in self._kind_params_memo:
            self._kind_params_memo[key] = self._count_kind_params(*key)
        return self._kind_params_memo[key]

    @functools.cached_property
    def _kind_params_memo(self) -> dict:
        return {}

    def _count_kind_params(self, tp: int, experts: bool, ep: int,
                           whole_experts: bool) -> float:
        """An expert layer's (experts) or a dense layer's parameters, one TP (and EP) rank's
        share; `whole_experts`: the rank's E / ep routed experts whole, not split over TP."""
        h, q, kv = self.hidden_size, self.q_size, self.kv_heads * self.head_dim
        split, whole = _mla.params(self) if self.multi_latent_attention else \
            (h * (q + 2 * kv) + q * h, 0)
        p = split + whole + self.mlp_params(experts)
        p += 4 * h if self.layernorm else 2 * h                  # norms (weight [+ bias])
        if self.qk_layernorm and not self.multi_latent_attention:
            p += (4 if self.layernorm else 2) * self.head_dim    # q_norm, k_norm
        if self.linear_biases:
            p += (q + 2 * kv) + h                                # attention's biases
        if self.softmax_type == "learnable":
            p += self.num_attention_heads                        # the sinks
        replicated = (self.replicated_params if experts else 0) + whole
        held = (p - replicated) / tp + replicated
        if experts and whole_experts:  # E / ep experts whole in place of a TP share of all E
            held += self.routed_params() / ep - self.routed_params(tp)
        elif experts and ep > 1:  # the other EP ranks' experts
            held -= self.routed_params(tp) * (ep - 1) / ep
        return held

    def num_params(self) -> float:
        """The model's parameters (not the final norm), each once: the multi-token prediction
        depths' too, which share the embedding and the LM head."""
        emb = self.vocab_size * self.hidden_size
        return self.layers_params(0, self.num_layers) + \
            emb * (1 if self.tied_embeddings else 2) + \
            self.mtp_num_layers * _mtp.depth_params(self)


PRESETS = {
    "gpt2-1.5b": ModelShape(48, 1600, 25, 25, 6400, 50257, 1024, "gelu", True),
    "llama2-7b": ModelShape(32, 4096, 32, 32, 11008, 32000, 4096),
    "llama3-8b": ModelShape(32, 4096, 32, 8, 14336, 128256, 8192),
    "llama2-70b": ModelShape(80, 8192, 64, 8, 28672, 32000, 4096),
    "llama3-70b": ModelShape(80, 8192, 64, 8, 28672, 128256, 8192),
    "llama3-405b": ModelShape(126, 16384, 128, 8, 53248, 128256, 8192),
    "gpt3-175b": ModelShape(96, 12288, 96, 96, 49152, 51200, 2048, "gelu", True),
    # The seed scenario's ~650B Llama-style model (docs/planner.md): 655B parameters.
    "llama-650b": ModelShape(128, 20480, 160, 16, 67584, 128256, 4096),
    # Mixtral 8x7B (Mistral AI's config.json): 8 experts of 14336, top 2; 46.7B parameters,
    # 12.9B active per token.
    "mixtral-8x7b": ModelShape(32, 4096, 32, 8, 14336, 32000, 4096, num_experts=8,
                               moe_router_topk=2, moe_ffn_hidden_size=14336),
    # DeepSeek-V3 (deepseek-ai's config.json, without the multi-token-prediction module):
    # multi-latent attention (187,107,328 parameters a layer), 3 dense layers of 18432, then
    # 256 routed experts of 2048, top 8, and a shared expert of 2048; its sigmoid router with
    # expert bias and groups costs what a softmax one does (planner_moe). 671.0B parameters.
    "deepseek-v3": ModelShape(61, 7168, 128, 128, 18432, 129280, 4096, qk_layernorm=True,
                              num_experts=256, moe_router_topk=8, moe_ffn_hidden_size=2048,
                              moe_shared_expert_intermediate_size=2048,
                              moe_layers=(0,) * 3 + (1,) * 58, multi_latent_attention=True,
                              q_lora_rank=1536, kv_lora_rank=512),
    # DeepSeek-V2-Lite: no query latent, 1 dense layer of 10944, then 64 experts of 1408, top 6,
    # and two shared experts (one of 2 x 1408, as Megatron's flag has them). 15.7B parameters.
    "deepseek-v2-lite": ModelShape(27, 2048, 16, 16, 10944, 102400, 4096, qk_layernorm=True,
                                   num_experts=64, moe_router_topk=6, moe_ffn_hidden_size=1408,
                                   moe_shared_expert_intermediate_size=2816,
                                   moe_layers=(0,) + (1,) * 26, multi_latent_attention=True,
                                   kv_lora_rank=512),
}


def _gpt_oss(layers: int, experts: int) -> ModelShape:
    """OpenAI's GPT-OSS (openai/gpt-oss-* config.json): 64 heads of 64, 8 KV heads, experts of
    2880 (quick GEGLU, top 4) with biases, attention sinks, RMSNorm, a window of 128 (HF's
    sliding_window, the query's own position counted) on the even layers, untied, pretrained
    at 4096 tokens (YaRN stretches that to 131072; RoPE costs nothing here)."""
    return ModelShape(layers, 2880, 64, 8, 2880, 201088, 4096, "quick_geglu", kv_channels=64,
                      window_size=127, window_layers=(1, 0) * (layers // 2), num_experts=experts,
                      moe_router_topk=4, moe_ffn_hidden_size=2880, add_bias_linear=True,
                      normalization="RMSNorm", softmax_type="learnable")


# GPT-OSS-120B: 116.8B parameters, 5.1B active per token; GPT-OSS-20B: 20.9B, 3.6B active.
PRESETS["gpt-oss-120b"] = _gpt_oss(36, 128)
PRESETS["gpt-oss-20b"] = _gpt_oss(24, 32)


@dataclasses.dataclass(frozen=True)
class GPUType:
    name: str
    peak_tflops: float       # dense bf16 (braid.flops.GPU_PEAK_TFLOPS)
    memory_gb: float         # HBM capacity, 1e9 bytes
    hbm_gbps: float          # HBM bandwidth, GB/s
    gemm_eff_max: float      # GEMM efficiency for large GEMMs (fitted, see docs/planner.md)
    gemm_n_half: float       # smallest GEMM dimension at which efficiency is e_max / 2
    attn_eff: float          # flash attention's executed FLOPs / peak


# Fitted (benchmarks/planner_validation.py --fit, worst row error minimised over a grid):
#   gemm_eff_max and gemm_n_half of the A100 to the four Narayanan et al. 2021 rows
#   (0.90, 2048: their 1.7B model, h 2304, runs at 0.53 x e_max, the 1T at 0.93 x e_max);
#   gemm_eff_max of the H100 to the one Megatron-Core row (0.91). One row cannot fit two
#   numbers, so the H100 keeps the A100's n_half (assumed), and the H200 the H100's curve
#   (same SMs and clocks; its larger, faster HBM enters through memory_gb and hbm_gbps).
#   The curve also absorbs what the model does not itemise (the published runs' non-flash
#   attention, unfused kernels, stragglers): it is an effective, not a cuBLAS, efficiency.
# Assumed: attn_eff, flash attention's executed FLOPs / peak (FlashAttention-2's published
# forward + backward rates: ~0.55 of peak on A100, ~0.45 on H100 with FA2-class kernels).
GPUS = {
    "a100-40g": GPUType("a100-40g", 312.0, 40.0, 1555.0, 0.90, 2048.0, 0.55),
    "a100-80g": GPUType("a100-80g", 312.0, 80.0, 2039.0, 0.90, 2048.0, 0.55),
    "h100-80g": GPUType("h100-80g", 989.0, 80.0, 3350.0, 0.91, 2048.0, 0.45),
    "h200": GPUType("h200", 989.0, 141.0, 4800.0, 0.91, 2048.0, 0.45),
}

@dataclasses.dataclass(frozen=True)
class Cluster:
    gpu: GPUType
    gpus_per_node: int
    num_gpus: int
    nvlink_bw: float   # bytes/s per GPU per direction
    net_bw: float      # bytes/s per GPU


_UNITS = {"": None, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_bandwidth(text: str, flag: str) -> float:
    """'300GB/s' -> 3e11 bytes/s, '200Gb/s' -> 2.5e10 bytes/s (B bytes, b bits; GiB/s too).
    A bare number is an error naming the flag, as the unit decides a factor of 8."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtT]?)(i?)([Bb])"
                     r"(?:/[sS]|ps)\s*", str(text))
    if not m:
        raise ValueError(f"{flag} {text!r}: give a bandwidth with its unit, e.g. 300GB/s "
                         "(bytes) or 200Gb/s (bits)")
    value, prefix, binary, unit = m.groups()
    scale = _UNITS[prefix.lower()] or 1.0
    if binary:
        scale = 1024.0 ** " kmgt".index(prefix.lower())
    out = float(value) * scale / (8.0 if unit == "b" else 1.0)
    if not 0 < out < math.inf:
        raise ValueError(f"{flag} {text!r}: the bandwidth must be positive and finite")
    return out


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    virtual_stages: int = 1
    recompute: str = "none"          # none | selective | full
    sequence_parallel: bool = False
    zero: bool = False               # ZeRO-1 (--use-distributed-optimizer)
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True  # with ZeRO (braid's --overlap-param-gather)
    # Uneven stages (--decoder-first/last-pipeline-num-layers); None: num_layers / pp each.
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    # With full: Megatron's --recompute-method / --recompute-num-layers, per model chunk
    # (braid's GPTModel): uniform groups of N layers keep one input each; block recomputes the
    # first N layers and keeps everything of the rest.
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    # Context parallelism (--context-parallel-size): each sequence split over cp ranks.
    cp: int = 1
    # Expert parallelism (--expert-model-parallel-size): each expert layer's experts split over
    # groups of ep consecutive dp x cp ranks (E / ep each), the routed rows exchanged all-to-all.
    ep: int = 1
    # Expert tensor parallelism (--expert-tensor-parallel-size): 0 or tp, each expert split over
    # TP like the dense MLP; 1 under TP (needs SP), whole experts - each TP rank routes its own
    # sequence-parallel tokens, and ep groups any ep consecutive ranks of a stage's tp x dp x cp
    # (Megatron's MoE parallel folding; planner_moe.whole).
    etp: int = 0
    # Every model chunk's layers, pp x virtual_stages in model-chunk order (chunk c of rank r is
    # model chunk c pp + r; the first and the last may hold none): a --pipeline-model-parallel-
    # layout's or the --account-for-embedding/loss-in-pipeline-split split (planner_split).
    # Empty: the split above.
    model_chunk_layers: tuple = ()
    # With selective and multi-latent attention, megatron-core's --recompute-modules mla_up_proj
    # (TransformerConfig.recompute_mla_up_proj): the latents and the rotated k_pe kept in place
    # of q, k and v, which the backward projects again (planner_mla.up_recompute_s).
    recompute_mla_up_proj: bool = False
    # --grad-reduce-in-bf16 (a numerics choice, never searched): each gradient bucket reduced
    # over data parallelism is rounded into a bf16 staging buffer of its own (kept), reduced as
    # bf16 - half the bytes on the wire - and widened back into the f32 buffer (grad_buffer.h).
    grad_reduce_in_bf16: bool = False

    @property
    def grad_reduce_bytes(self) -> int:
        """Bytes per gradient element the data-parallel reduction moves."""
        return 2 if self.grad_reduce_in_bf16 else 4


def stage_splits(num_layers: int, pp: int, v: int):
    """The (first, last) stage sizes the search tries for pp stages of v chunks: the even split
    (None, None) where the layers divide, and uneven ones whose first and last stages are up to
    2 v layers lighter than the stages between them (or, at pp 2, the last up to 2 v lighter
    than the first) - room for the embedding and the LM head, and the only way to pipeline a
    model whose layers do not divide by pp (Llama 3 405B: 126 layers, pp 16 -> 7 | 8 ... | 7)."""
    if pp == 1:
        return [(None, None)]
    out = []
    if num_layers % pp == 0 and num_layers // pp % v == 0:
        out.append((None, None))
    if pp == 2:
        for last in range(v, num_layers, v):
            first = num_layers - last
            if first % v == 0 and 0 < first - last <= 2 * v:
                out.append((first, last))
        return out
    for middle in range(v, num_layers // (pp - 2) + 1, v):  # layers of each stage between
        rest = num_layers - middle * (pp - 2)
        for first in range(max(v, middle - 2 * v), middle + 1, v):
            last = rest - first
            if max(v, middle - 2 * v) <= last <= middle and last % v == 0 \
                    and (first, last) != (middle, middle):
                out.append((first, last))
    return out
