"""megatron-core (0.16.1) on the CPU for test_convert_megatron.py: tiny GPTModels (the local
layer spec, f32) built from Megatron-LM-style args, their logits by megatron-core's own forward,
and checkpoints saved as Megatron-LM saves them (torch_dist, iter_NNNNNNN folders, a tracker,
common.pt holding args, iteration, checkpoint_version).

Run as a script (in a subprocess: megatron-core sets process-wide state):
  python megatron_checkpoints.py save OUT        one process: the models, their saves, logits
  python -m torch.distributed.run --nproc-per-node 2 megatron_checkpoints.py ranks OUT JOBS
                                                 two ranks (gloo): the llama save loaded and
                                                 saved again at TP 2 and at PP 2 (with TP 2
                                                 logits); each braid export in JOBS loaded at
                                                 TP 1 (x DP 2) and TP 2 (logits) and at PP 2
                                                 (saved again; MLA at TP 2 too)

megatron-core 0.16.1 assumes CUDA in a few places that do not compute anything; on the CPU
(cpu_stand_ins) the device is the CPU (.cuda() included), CUDA's synchronize does nothing, the
model-parallel CUDA RNG tracker's fork (dropout, 0 here) does nothing, the torch_dist writer's
process-memory probe (psutil, only logged) reads 0, and the MoE router's GEMM finds no Transformer
Engine GEMM (megatron-core 0.16.1 names it without defining it when TE is absent). Its
multi-latent attention runs with Transformer Engine only: MLASelfAttention builds its core
attention with k_channels and v_channels (TE's DotProductAttention's arguments), which the local
spec's DotProductAttention does not take, and without TE it takes the TE wrappers' placeholders
for classes (HAVE_TE true); here the local core attention takes them (its output heads
v_channels wide, its products and softmax its own) and MLA sees HAVE_TE false. Its softmax builds
a sliding window's mask on CUDA (get_sliding_window_causal_mask); here the same mask on the CPU.
The tensors, the files and the forward (MLA's projections, norms and RoPE, the MTP depths, the
attention sinks, the windows, YaRN) are megatron-core's.
"""

import argparse
import contextlib
import dataclasses
import json
import os
import random
import socket
import sys

import numpy as np

IDS = np.random.default_rng(0).integers(0, 97, size=(3, 16), dtype=np.int64)
TARGETS = np.random.default_rng(1).integers(0, 97, size=(3, 16), dtype=np.int64)  # MTP's labels
ITERATION = 120
CONSUMED = 120 * 32
VOCAB, PADDED_VOCAB = 97, 128

# Megatron-LM's args after validate_args, for the fields the model reads (and a few others a real
# save holds, an enum and a dtype among them). Per model: what differs.
BASE_ARGS = dict(
    num_layers=2, hidden_size=64, ffn_hidden_size=160, num_attention_heads=4, kv_channels=16,
    group_query_attention=False, num_query_groups=1, max_position_embeddings=64, seq_length=16,
    position_embedding_type="rope", add_position_embedding=True,
    use_rotary_position_embeddings=False, rotary_base=10000, rotary_percent=1.0,
    rotary_interleaved=False, use_rope_scaling=False, rope_scaling_factor=8.0,
    rotary_seq_len_interpolation_factor=None,
    normalization="RMSNorm", norm_epsilon=1e-5, apply_layernorm_1p=False, swiglu=False,
    squared_relu=False, bias_gelu_fusion=True, bias_swiglu_fusion=True, add_bias_linear=False,
    add_qkv_bias=False, qk_layernorm=False, untie_embeddings_and_output_weights=False,
    window_size=None, window_attn_skip_freq=None, num_experts=None,
    multi_latent_attention=False, q_lora_rank=None, kv_lora_rank=32, qk_head_dim=128,
    qk_pos_emb_head_dim=64, v_head_dim=128, rope_type=None, rotary_scaling_factor=1.0, mscale=1.0,
    mscale_all_dim=0.0, mtp_num_layers=None, mtp_loss_scaling_factor=0.1, vocab_size=VOCAB,
    padded_vocab_size=PADDED_VOCAB, make_vocab_size_divisible_by=128,
    tokenizer_type="HuggingFaceTokenizer", tensor_model_parallel_size=1,
    pipeline_model_parallel_size=1, ckpt_format="torch_dist", consumed_train_samples=CONSUMED,
    consumed_valid_samples=0, micro_batch_size=2, global_batch_size=32, lr=3e-4, seed=1234,
    hidden_dropout=0.0, attention_dropout=0.0, moe_router_topk=2, moe_ffn_hidden_size=None,
    moe_router_pre_softmax=False, moe_router_score_function="softmax",
    moe_router_enable_expert_bias=False, moe_router_num_groups=None, moe_router_group_topk=None,
    moe_router_topk_scaling_factor=None, moe_expert_capacity_factor=None,
    moe_token_drop_policy="probs", moe_shared_expert_intermediate_size=None,
    moe_shared_expert_gate=False, moe_layer_freq=1, moe_router_load_balancing_type="aux_loss",
    moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
    quick_geglu=False, glu_linear_offset=0.0, activation_func_clamp_value=None,
    softmax_type="vanilla")
MODELS = {
    # Llama: RMSNorm, SwiGLU, RoPE, 2 query groups, untied
    "llama": dict(swiglu=True, group_query_attention=True, num_query_groups=2, rotary_base=500000,
                  untie_embeddings_and_output_weights=True),
    # Llama with linear position interpolation (--rotary-seq-len-interpolation-factor 3:
    # megatron-core's positions / 3 against braid's, HF's, frequencies / 3)
    "llama-interpolated": dict(swiglu=True, group_query_attention=True, num_query_groups=2,
                               untie_embeddings_and_output_weights=True,
                               rotary_seq_len_interpolation_factor=3),
    # Llama with GPT-J's interleaved RoPE pairs (--rotary-interleaved) on half of each head
    "llama-interleaved": dict(swiglu=True, group_query_attention=True, num_query_groups=2,
                              untie_embeddings_and_output_weights=True, rotary_interleaved=True,
                              rotary_percent=0.5),
    # Qwen-like: one query group, tied, q/k norms, q/k/v biases, Llama 3.1's RoPE scaling
    "qwen-tied": dict(swiglu=True, group_query_attention=True, num_query_groups=1,
                      qk_layernorm=True, add_qkv_bias=True, use_rope_scaling=True),
    # GPT: LayerNorm, GELU (megatron-core's fused bias-GELU), learned positions, biases, tied
    "gpt": dict(normalization="LayerNorm", position_embedding_type="learned_absolute",
                add_bias_linear=True, add_qkv_bias=True),
    # GPT with the exact (erf) GELU: megatron-core's unfused GELU (--no-bias-gelu-fusion)
    "gpt-erf": dict(normalization="LayerNorm", position_embedding_type="learned_absolute",
                    add_bias_linear=True, add_qkv_bias=True, bias_gelu_fusion=False),
    # Nemotron-like: LayerNorm weights saved as gamma - 1 (--apply-layernorm-1p), squared ReLU,
    # RoPE on half of each head, biases, 2 query groups, untied
    "nemotron-1p": dict(normalization="LayerNorm", squared_relu=True, rotary_percent=0.5,
                        add_bias_linear=True, add_qkv_bias=True, group_query_attention=True,
                        num_query_groups=2, untie_embeddings_and_output_weights=True,
                        apply_layernorm_1p=True),
    # Mixtral-like: 4 experts on every layer (stacked names), top 2 of a softmax over the top 2
    "mixtral": dict(swiglu=True, group_query_attention=True, num_query_groups=2,
                    untie_embeddings_and_output_weights=True, num_experts=4,
                    moe_ffn_hidden_size=32),
    # DeepSeek-V3-like: a dense first layer (per-layer names), then 4 experts routed by sigmoid
    # scores with a bias, scaled by 2.5, beside a gated shared expert
    "moe-shared": dict(swiglu=True, untie_embeddings_and_output_weights=True, num_experts=4,
                       moe_ffn_hidden_size=32, moe_router_score_function="sigmoid",
                       moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5,
                       moe_shared_expert_intermediate_size=48, moe_shared_expert_gate=True,
                       moe_layer_freq=[0, 1]),
    # DeepSeek-V3's attention: multi-latent attention with a query latent, the latent norms, YaRN
    # (factor 4, mscale 0.9 and mscale_all_dim 0.7: cos, sin and the softmax scale change)
    "deepseek-mla": dict(swiglu=True, untie_embeddings_and_output_weights=True,
                         multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=32,
                         qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, qk_layernorm=True,
                         rope_type="yarn", rotary_scaling_factor=4.0, mscale=0.9,
                         mscale_all_dim=0.7),
    # DeepSeek-V2-Lite's: no query latent (linear_q_proj), plain RoPE, LayerNorm latent norms
    # (with biases), tied
    "mla-no-q-lora": dict(normalization="LayerNorm", swiglu=True, multi_latent_attention=True,
                          q_lora_rank=None, kv_lora_rank=24, qk_head_dim=8,
                          qk_pos_emb_head_dim=16, v_head_dim=12, qk_layernorm=True,
                          rope_type="rope", rotary_base=50000),
    # DeepSeek-V3-like with a multi-token prediction depth: MLA (YaRN by Megatron-LM's default
    # --rope-type), a dense layer then experts as moe-shared's, the MTP layer with experts
    "deepseek-v3-mtp": dict(swiglu=True, untie_embeddings_and_output_weights=True,
                            multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=32,
                            qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
                            qk_layernorm=True, num_experts=4, moe_ffn_hidden_size=32,
                            moe_router_score_function="sigmoid",
                            moe_router_enable_expert_bias=True,
                            moe_router_topk_scaling_factor=2.5,
                            moe_shared_expert_intermediate_size=48, moe_layer_freq=[0, 1],
                            mtp_num_layers=1),
    # Llama with two MTP depths (the local spec's fused norm names in the MTP layers)
    "llama-mtp": dict(swiglu=True, group_query_attention=True, num_query_groups=2,
                      untie_embeddings_and_output_weights=True, mtp_num_layers=2),
    # GPT-OSS-like (Megatron-LM's GPT-OSS recipe in small): learnable attention sinks, the quick
    # GEGLU with offset 1 and a clamp that bites, biases (the router's too), 4 experts on every
    # layer, a window of 4 + 1 on the first layer, YaRN with the correction range unrounded
    "gpt-oss": dict(quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=0.5,
                    softmax_type="learnable", add_bias_linear=True, add_qkv_bias=True,
                    bias_gelu_fusion=False, group_query_attention=True, num_query_groups=2,
                    untie_embeddings_and_output_weights=True, num_experts=4,
                    moe_ffn_hidden_size=32, window_size=(4, 0), window_attn_skip_freq=2,
                    position_embedding_type="yarn", rotary_base=150000,
                    rotary_scaling_factor=32.0, yarn_original_max_position_embeddings=4096,
                    yarn_beta_fast=32.0, yarn_beta_slow=1.0,
                    yarn_correction_range_round_to_int=False),
}
# Saves of a model under args import refuses (per model: the variant's name and its args' changes)
REFUSED_ARGS = {
    "deepseek-mla": {"mla-bias": dict(add_bias_linear=True)},
    # plain RoPE whose softmax megatron-core's MLA still scales by g(mscale_all_dim)^2
    "mla-no-q-lora": {"mla-rope-mscale": dict(rotary_scaling_factor=4.0, mscale_all_dim=1.0)},
    "llama-mtp": {"mtp-learned": dict(position_embedding_type="learned_absolute")},
}
# MLATransformerConfig's fields that core_transformer_config_from_args takes from the args
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
              "rotary_scaling_factor", "mscale", "mscale_all_dim",
              "original_max_position_embeddings", "beta_fast", "beta_slow")
MOE_FIELDS = ("moe_router_topk", "moe_ffn_hidden_size", "moe_router_pre_softmax",
              "moe_router_score_function", "moe_router_enable_expert_bias",
              "moe_router_num_groups", "moe_router_group_topk", "moe_router_topk_scaling_factor",
              "moe_expert_capacity_factor", "moe_token_drop_policy",
              "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_layer_freq")
NORM_SUFFIXES = ("layer_norm_weight", "norm.weight")  # every norm's weight (enorm, hnorm)
# megatron-core's config attributes of GPTModel's YaRN (--position-embedding-type yarn) and the
# Megatron-LM arguments they come from
YARN_FIELDS = {"yarn_rotary_scaling_factor": "rotary_scaling_factor",
               "yarn_original_max_position_embeddings": "yarn_original_max_position_embeddings",
               "yarn_beta_fast": "yarn_beta_fast", "yarn_beta_slow": "yarn_beta_slow",
               "yarn_mscale": "mscale", "yarn_mscale_all_dim": "mscale_all_dim",
               "yarn_correction_range_round_to_int": "yarn_correction_range_round_to_int"}


def megatron_args(kind, **changes):
    from megatron.core.transformer.enums import AttnBackend
    import torch
    return argparse.Namespace(**{**BASE_ARGS, **MODELS[kind], **{
        "attention_backend": AttnBackend.auto, "params_dtype": torch.float32, **changes}})


def cpu_stand_ins():
    import torch
    import megatron.core.dist_checkpointing.strategies.filesystem_async as filesystem_async
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core import tensor_parallel
    from megatron.core.models import backends
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # tied embeddings across stages
    torch.cuda.synchronize = lambda *args, **kwargs: None
    filesystem_async._process_memory = lambda: 0
    moe_utils.te_general_gemm = None  # the router's GEMM refers to it without Transformer Engine
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    mla.HAVE_TE = False  # (megatron-core's TE wrappers import as placeholders without TE)
    fused_softmax.get_sliding_window_causal_mask = sliding_window_mask
    backends.LocalSpecProvider.core_attention = lambda self: latent_core_attention()


def sliding_window_mask(sq, skv, window_size):
    """megatron-core's get_sliding_window_causal_mask on the CPU: True where a query does not
    see a key (those after it, and those more than window_size[0] before it)."""
    import torch
    m = torch.ones(sq, skv, dtype=torch.bool)
    return ~torch.tril(torch.triu(m, diagonal=skv - sq - window_size[0]),
                       diagonal=skv - sq + window_size[1])


def latent_core_attention():
    """The local spec's DotProductAttention taking MLA's k_channels and v_channels, as Transformer
    Engine's does: its output is the heads' v_channels-wide values (it computes with the q, k and
    v it is given; the widths only shape its output)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class LatentDotProductAttention(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)
            if v_channels is not None:
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return LatentDotProductAttention


def moe_config(a):
    """TransformerConfig's MoE fields for Megatron-LM's args (none without experts)."""
    if not a.num_experts:
        return {}
    fields = {name: getattr(a, name) for name in MOE_FIELDS if getattr(a, name, None) is not None}
    return dict(fields, num_moe_experts=a.num_experts, moe_aux_loss_coeff=0.0,
                moe_token_dispatcher_type="allgather")  # the dispatcher that runs on the CPU


def build(a, vp_stage=None):
    """A GPTModel of Megatron-LM's args `a` for this rank's TP/PP/EP position (and virtual
    pipeline stage `vp_stage`), as Megatron-LM's core_transformer_config_from_args would configure
    it (the local layer spec, f32, CPU; --decoder-first/last-pipeline-num-layers): with
    --multi-latent-attention an MLATransformerConfig taking the args' MLA fields (--rope-type
    left to its default where None), with --mtp-num-layers the MTP block spec of the last layer's
    spec."""
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec,
                                                          get_gpt_layer_local_spec,
                                                          get_gpt_mtp_block_spec)
    from megatron.core.transformer.transformer_config import (MLATransformerConfig,
                                                              TransformerConfig)
    from megatron.core.transformer.utils import openai_gelu
    # Megatron-LM's: --openai-gelu's tanh form, else F.gelu (the fused bias-GELU, when on, being
    # its tanh form)
    gelu = openai_gelu if getattr(a, "openai_gelu", False) else F.gelu
    geglu = getattr(a, "quick_geglu", False) and not a.swiglu  # (Megatron-LM: --swiglu first)
    if geglu:
        from megatron.core.fusions.fused_bias_geglu import quick_gelu as gelu
    elif a.squared_relu:
        from megatron.core.activations import squared_relu as gelu
    activation = F.silu if a.swiglu else gelu
    latent = getattr(a, "multi_latent_attention", False)
    mla = {}
    if latent:
        mla = {name: getattr(a, name) for name in MLA_FIELDS if hasattr(a, name)}
        if a.rope_type is not None:
            mla["rope_type"] = a.rope_type
        mla.update(rotary_base=a.rotary_base, rotary_percent=a.rotary_percent)
    cls = MLATransformerConfig if latent else TransformerConfig
    config = cls(**installed_fields(cls, dict(
        num_layers=a.num_layers, hidden_size=a.hidden_size, ffn_hidden_size=a.ffn_hidden_size,
        num_attention_heads=a.num_attention_heads, kv_channels=a.kv_channels,
        num_query_groups=a.num_query_groups if a.group_query_attention else None,
        normalization=a.normalization, layernorm_epsilon=a.norm_epsilon,
        gated_linear_unit=a.swiglu or geglu, activation_func=activation,
        bias_activation_fusion=(a.bias_gelu_fusion and a.add_bias_linear
                                and not (a.swiglu or geglu or a.squared_relu)),
        glu_linear_offset=getattr(a, "glu_linear_offset", 0.0),
        activation_func_clamp_value=getattr(a, "activation_func_clamp_value", None),
        softmax_type=getattr(a, "softmax_type", "vanilla"),
        window_size=a.window_size, window_attn_skip_freq=a.window_attn_skip_freq,
        add_bias_linear=a.add_bias_linear, add_qkv_bias=a.add_qkv_bias,
        qk_layernorm=a.qk_layernorm, rotary_interleaved=a.rotary_interleaved,
        hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=a.params_dtype,
        bf16=a.params_dtype == torch.bfloat16,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=(
            parallel_state.get_virtual_pipeline_model_parallel_world_size()),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
        num_layers_in_first_pipeline_stage=getattr(a, "decoder_first_pipeline_num_layers", None),
        num_layers_in_last_pipeline_stage=getattr(a, "decoder_last_pipeline_num_layers", None),
        pipeline_dtype=a.params_dtype, mtp_num_layers=getattr(a, "mtp_num_layers", None),
        **mla, **moe_config(a))))
    if a.position_embedding_type == "yarn":  # (attributes GPTModel reads, not config fields)
        for field, name in YARN_FIELDS.items():
            setattr(config, field, getattr(a, name))
    if a.num_experts:  # megatron-core's MoE layers (SequentialMLP) where moe_layer_freq says
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                          normalization=a.normalization, vp_stage=vp_stage)
    else:
        spec = get_gpt_layer_local_spec(normalization=a.normalization,
                                        qk_layernorm=a.qk_layernorm,
                                        multi_latent_attention=latent)
    mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False,
                                 vp_stage=vp_stage) if config.mtp_num_layers else None
    return GPTModel(
        config, spec, vocab_size=a.padded_vocab_size, max_sequence_length=a.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False,
                                                           vp_stage=vp_stage),
        parallel_output=False, vp_stage=vp_stage,
        share_embeddings_and_output_weights=not a.untie_embeddings_and_output_weights,
        position_embedding_type=a.position_embedding_type, rotary_percent=a.rotary_percent,
        rotary_base=a.rotary_base, rope_scaling=a.use_rope_scaling,
        rope_scaling_factor=a.rope_scaling_factor,
        seq_len_interpolation_factor=a.rotary_seq_len_interpolation_factor,
        mtp_block_spec=mtp).eval()


def installed_fields(cls, fields):
    """`fields` of the megatron-core config class `cls` that the installed megatron-core has: one
    it lacks must be off (None, 0, False, "vanilla"), as for the pre-0.14 megatron-core that
    megatron_pre014_saves.py runs."""
    known = {f.name for f in dataclasses.fields(cls)}
    for name in fields.keys() - known:
        assert fields[name] in (None, 0, False, "vanilla"), f"megatron-core has no {name}"
    return {k: v for k, v in fields.items() if k in known}


def randomize(model, seed):
    """Weights that make every tensor matter: norms near 1, biases and matrices random."""
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            norm = name.endswith(NORM_SUFFIXES)
            # attention sinks as large as the scores (a few units)
            p.copy_(1.0 + 0.1 * noise if norm else 1.5 * noise if name.endswith(
                "softmax_offset") else 0.1 * noise)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def logits(model):
    """megatron-core's logits of IDS [B, S, V], and with MTP depths each depth's [D, B, S, V]
    (None without): its forward with labels (TARGETS; GPTModel computes the MTP depths only
    then), the output layer's outputs taken as they come (each depth's, then the model's)."""
    import torch
    ids = torch.from_numpy(IDS)
    positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    mask = torch.triu(torch.ones(1, 1, ids.shape[1], ids.shape[1]), diagonal=1).bool()
    if not model.config.mtp_num_layers:
        with torch.no_grad():
            return model(ids, positions, attention_mask=mask).numpy(), None
    outputs = []  # copies: the loss's cross-entropy works on the logits in place
    hook = model.output_layer.register_forward_hook(lambda m, i, o: outputs.append(o[0].clone()))
    with torch.no_grad():
        model(ids, positions, attention_mask=mask, labels=torch.from_numpy(TARGETS))
    hook.remove()
    per_depth = [x.transpose(0, 1).numpy() for x in outputs]  # [S, B, V] -> [B, S, V]
    return per_depth[-1], np.stack(per_depth[:-1])


def save_logits(prefix, result):
    """`result` (logits') as prefix.logits.npy and prefix.mtp-logits.npy."""
    np.save(f"{prefix}.logits.npy", result[0])
    if result[1] is not None:
        np.save(f"{prefix}.mtp-logits.npy", result[1])


def save_megatron_lm(model, a, out, content_metadata=None, edit=None):
    """Saves `model` as Megatron-LM's save_checkpoint does with --ckpt-format torch_dist (model,
    RNG and rerun state, args, iteration; no optimizer) into out/iter_NNNNNNN and the tracker
    file.
    `edit(sharded_state_dict)` changes the model's sharded tensors first."""
    import torch
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    sharded = model.sharded_state_dict(metadata=dict(content_metadata or {}))
    if edit:
        edit(sharded)
    tp, pp = (parallel_state.get_tensor_model_parallel_world_size(),
              parallel_state.get_pipeline_model_parallel_world_size())
    rng = {"random_rng_state": random.getstate(), "torch_rng_state": torch.get_rng_state()}
    state = {"args": a, "checkpoint_version": 3.0, "iteration": ITERATION, "model": sharded,
             "num_floating_point_operations_so_far": 0,
             "rerun_state_machine": {"mode": "disabled", "sharded": ShardedObject(
                 "rerun_state_machine_state", {"rerun_requested": False},
                 (torch.distributed.get_world_size(),), (torch.distributed.get_rank(),))},
             "rng_state": ShardedObject(
                 "rng_state", [rng], (pp, tp), (parallel_state.get_pipeline_model_parallel_rank(),
                                                parallel_state.get_tensor_model_parallel_rank()),
                 replica_id=parallel_state.get_data_parallel_rank())}
    folder = os.path.join(out, f"iter_{ITERATION:07d}")
    if torch.distributed.get_rank() == 0:
        os.makedirs(folder)
    torch.distributed.barrier()
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
                **(content_metadata or {})}
    # a synchronous save writes with one worker (Megatron-LM sets dist_ckpt_workers to 1)
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
    dist_checkpointing.save(state, folder, strategy, content_metadata=metadata)
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))
    torch.distributed.barrier()


def load_into(model, folder):
    from megatron.core import dist_checkpointing
    # a metadata dict, as Megatron-LM passes (megatron-core fills in the data-parallel group; the
    # GPT model's MTP stage reads it from there)
    state = dist_checkpointing.load({"model": model.sharded_state_dict(metadata={})}, folder)
    model.load_state_dict(state["model"], strict=True)  # as Megatron-LM's load_checkpoint


# ---- edits of a sharded state dict (the variants' saves) -------------------------------------

def unfused_norm_names(sharded):
    """The per-module norm names (input_layernorm, pre_mlp_layernorm) in place of the fused ones
    megatron-core's checkpoints use under both specs; a Transformer Engine spec's empty
    core_attention _extra_state per layer; and an optimizer tensor, named as megatron-core's
    reshardable optimizer state is (optimizer.state.<state>.<parameter>)."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    renames = {"self_attention.linear_qkv.layer_norm_": "input_layernorm.",
               "mlp.linear_fc1.layer_norm_": "pre_mlp_layernorm."}
    layers = len({k.split(".")[2] for k in sharded if k.startswith("decoder.layers.")})
    for value in sharded.values():
        for old, new in renames.items():
            if hasattr(value, "key") and old in value.key:
                value.key = value.key.replace(old, new)
    sharded["optimizer"] = ShardedTensor.from_rank_offsets(
        "optimizer.state.exp_avg.decoder.final_layernorm.weight", torch.zeros(64), replica_id=0)
    for i in range(layers):
        sharded[f"te.{i}"] = ShardedObject(
            "decoder.layers.self_attention.core_attention._extra_state", None, (layers,), (i,),
            replica_id=0)


def te_latent_names(sharded):
    """Transformer Engine's spec's names of an MLA model's norms: the latent norms fused into
    linear_q_up_proj and linear_kv_up_proj, a dense layer's pre-MLP norm into mlp.linear_fc1
    (layer_norm_weight); TE's empty core_attention and input_layernorm extra states."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    renames = {"self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
               "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
               "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
    for value in sharded.values():
        for old, new in renames.items():
            if hasattr(value, "key") and old in value.key:
                value.key = value.key.replace(old, new)
    for i in range(2):
        for module in ("self_attention.core_attention", "input_layernorm"):
            sharded[f"te.{module}.{i}"] = ShardedObject(
                f"decoder.layers.{module}._extra_state", None, (2,), (i,), replica_id=0)


def fp8_extra_state(sharded):
    """Transformer Engine's FP8 scaling state (a pickled dict as a byte tensor) in the first
    layer's core attention, the second's empty (as TE saves it without FP8)."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    states = (torch.arange(40, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8))
    for i, state in enumerate(states):
        sharded[f"fp8.{i}"] = ShardedObject(
            "decoder.layers.self_attention.core_attention._extra_state", state, (2,), (i,),
            replica_id=0)


def moe_router(sharded):
    """A tensor no dense model has: a mixture of experts' router, stacked over the layers."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    for i in range(2):
        sharded[f"router.{i}"] = ShardedTensor.from_rank_offsets(
            "decoder.layers.mlp.router.weight", torch.ones(4, 64), (0, i, 2), replica_id=0,
            prepend_axis_num=1)


def one_minus(model):
    """Norm weights as --apply-layernorm-1p keeps them: gamma - 1."""
    import torch
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(NORM_SUFFIXES):
                p.sub_(1.0)


# ---- the jobs --------------------------------------------------------------------------------

def expert_tp(a, tp):
    """The expert TP size of a layout with TP `tp`: TP's, but 1 for experts with biases
    (megatron-core's MoE biases need whole experts: --expert-tensor-parallel-size 1, as
    Megatron-LM's GPT-OSS recipes run)."""
    return 1 if a.num_experts and a.add_bias_linear else tp


def free_port():
    """A TCP port no one listens on now, for torch.distributed's rendezvous (tests run two at a
    time under make test)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(tp=1, pp=1, vp=None, ep=1, etp=None):
    import torch
    from megatron.core import parallel_state
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        torch.distributed.init_process_group("gloo")
        cpu_stand_ins()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vp,
                                             expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=etp)


def save_job(out):
    """Every model saved at TP 1 with its logits; the llama with the variants' edits; the
    refused variants."""
    import torch
    init()
    for seed, kind in enumerate(MODELS):
        a = megatron_args(kind)
        model = build(megatron_args(kind, apply_layernorm_1p=False))  # megatron-core's norms
        randomize(model, seed)
        save_logits(os.path.join(out, kind), logits(model))
        if a.apply_layernorm_1p:
            one_minus(model)
        save_megatron_lm(model, a, os.path.join(out, kind))
        if kind == "llama":
            save_megatron_lm(model, a, os.path.join(out, "llama-unfused-names"),
                             edit=unfused_norm_names)
            save_megatron_lm(model, a, os.path.join(out, "llama-singleton"),
                             content_metadata={"singleton_local_shards": True})
            save_megatron_lm(model, a, os.path.join(out, "llama-fp8"), edit=fp8_extra_state)
            save_megatron_lm(model, a, os.path.join(out, "llama-router"), edit=moe_router)
            save_megatron_lm(model, megatron_args(kind, num_experts=4),
                             os.path.join(out, "llama-moe-args"))
            save_megatron_lm(model.bfloat16(), megatron_args(kind, bf16=True,
                                                             params_dtype=torch.bfloat16),
                             os.path.join(out, "llama-bf16"))
        if kind == "moe-shared":
            save_megatron_lm(model, a, os.path.join(out, "moe-shared-singleton"),
                             content_metadata={"singleton_local_shards": True})
        if kind == "deepseek-mla":
            save_megatron_lm(model, a, os.path.join(out, "deepseek-mla-te-names"),
                             edit=te_latent_names)
        for variant, changes in REFUSED_ARGS.get(kind, {}).items():
            save_megatron_lm(model, megatron_args(kind, **changes), os.path.join(out, variant))


def common_args(folder):
    """The args of a common.pt, read as Megatron-LM reads them: weights only, with the classes
    megatron-core registers as safe when imported."""
    import torch
    return torch.load(os.path.join(folder, "common.pt"), weights_only=True)["args"]


def ranks_job(out, jobs):
    """Two ranks: the llama save at TP 2 (logits) and PP 2; each export of `jobs` loaded (and
    saved again at PP 2, MLA ones at TP 2 too)."""
    import torch
    a = megatron_args("llama")
    for tp, pp in ((2, 1), (1, 2)):
        init(tp, pp)
        model = build(a)
        load_into(model, os.path.join(out, "llama", f"iter_{ITERATION:07d}"))
        if pp == 1:
            result = logits(model)
            if torch.distributed.get_rank() == 0:
                save_logits(os.path.join(out, f"llama-tp{tp}"), result)
        save_megatron_lm(model, a, os.path.join(out, f"llama-tp{tp}-pp{pp}"))
    for export in jobs:
        with open(os.path.join(export, "latest_checkpointed_iteration.txt")) as f:
            folder = os.path.join(export, f"iter_{int(f.read()):07d}")
        a = common_args(folder)
        for tp, pp in ((1, 1), (2, 1), (1, 2)):
            init(tp, pp, etp=expert_tp(a, tp))
            model = build(a)
            load_into(model, folder)
            if pp == 1:
                result = logits(model)
                if torch.distributed.get_rank() == 0:
                    save_logits(f"{export}.tp{tp}", result)
            if pp == 2 or (tp == 2 and getattr(a, "multi_latent_attention", False)):
                # (MLA at TP 2: its latent projections split by rows, its norms replicated)
                save_megatron_lm(model, a, f"{export}-tp{tp}-pp{pp}")


def main():
    import warnings
    warnings.filterwarnings("ignore")
    command, out = sys.argv[1], sys.argv[2]
    if command == "save":
        save_job(out)
    else:
        import torch
        torch.distributed.init_process_group("gloo")
        cpu_stand_ins()
        ranks_job(out, json.loads(sys.argv[3]))
    import torch
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
