"""Shared by the oracle tests: tiny HF models with random weights, copied into braid.

braid names parameters like HF Llama (model.layers.{i}.self_attn.q_proj.weight, ...), with
weights [out, in]. GPT-2's HF names differ and its Conv1D weights are [in, out] with q, k, v
fused in c_attn; `gpt2_to_braid` maps one onto the other. transformers 5 holds the experts of a
mixture-of-experts layer fused ([E, 2F, H] gate and up, [E, H, F] down); `experts_to_braid`
splits them into braid's per-expert names. The deepseek_* helpers serve the models with
DeepSeek-V3's router (DeepseekV3, Dots1, Glm4Moe): its expert biases and its group-limited choice;
deepseek_mla_config the tiny multi-latent attention models (DeepseekV2, DeepseekV3).
`add_mtp_depths` gives an HF model DeepSeek-V3's multi-token prediction depths as its last
layers, under braid's (and HF DeepSeek-V3's checkpoint) names.
"""

from __future__ import annotations

import numpy as np
import torch
import transformers

import braid
from braid.generate import Sampling, generate


def eager_model(model_class, hf_cfg, biases=False):
    """An HF model of `hf_cfg` with eager attention, in f32, its norm weights (and with
    `biases` its biases) moved off their trivial init so that they matter."""
    hf_cfg._attn_implementation = "eager"
    hf = model_class(hf_cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or (biases and name.endswith("bias")):
                p.add_(0.1 * torch.randn_like(p))
    return hf


def gpt2_pair(layers=2, hidden=64, heads=4, vocab=97, positions=32, seed=0):
    torch.manual_seed(seed)
    hf_cfg = transformers.GPT2Config(
        vocab_size=vocab, n_positions=positions, n_embd=hidden, n_layer=layers, n_head=heads,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
        activation_function="gelu_new", tie_word_embeddings=True)
    hf = transformers.GPT2LMHeadModel(hf_cfg).float().eval()
    with torch.no_grad():  # HF initialises biases and norms trivially; make them matter
        for name, p in hf.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    cfg = braid.TransformerConfig.preset("gpt2-tiny")
    cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads = layers, hidden, heads
    cfg.num_query_groups, cfg.ffn_hidden_size = heads, 4 * hidden
    cfg.vocab_size, cfg.max_position_embeddings, cfg.norm_eps = vocab, positions, 1e-5
    model = braid.GPTModel(cfg, device="cpu", seed=1)
    load_into_braid(model, gpt2_to_braid(hf, layers, hidden))
    return hf, model


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


def llama_pair(layers=2, hidden=64, heads=4, kv_heads=2, ffn=160, vocab=97, positions=64, seed=0,
               tie=False, llama3_rope=False, linear_rope=0.0, zero_centered_gamma=False, mtp=0,
               **fields):
    """LlamaForCausalLM and braid's copy of it; with zero_centered_gamma braid's norm weights
    hold HF's minus one (Megatron's --apply-layernorm-1p), the same model. With `mtp` depths of
    multi-token prediction: HF's model has them as its last layers (add_mtp_depths), braid's
    mtp_num_layers. linear_rope > 0: linear position interpolation by that factor (rope_type
    linear). `fields`: more braid config (mtp_loss_scaling_factor, ...)."""
    torch.manual_seed(seed)
    rope = {"rope_parameters": LLAMA3_ROPE} if llama3_rope else {"rope_theta": 10000.0}
    if linear_rope:
        rope = {"rope_parameters": {"rope_type": "linear", "factor": linear_rope,
                                    "rope_theta": 10000.0}}
        fields["rope_linear_factor"] = linear_rope
    hf_cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
        num_hidden_layers=layers + mtp, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=positions, rms_norm_eps=1e-5, tie_word_embeddings=tie,
        attention_bias=False, mlp_bias=False, **rope)
    hf = eager_model(transformers.LlamaForCausalLM, hf_cfg)
    if mtp:
        add_mtp_depths(hf, layers)
        fields["mtp_num_layers"] = mtp
    scaling = {"rope_scaling_factor": LLAMA3_ROPE["factor"],
               "rope_low_freq_factor": LLAMA3_ROPE["low_freq_factor"],
               "rope_high_freq_factor": LLAMA3_ROPE["high_freq_factor"],
               "rope_original_max_position_embeddings":
                   LLAMA3_ROPE["original_max_position_embeddings"]} if llama3_rope else {}
    model = braid_llama_like(hf, layers, hidden, heads, kv_heads, ffn, vocab, positions,
                             norm_eps=1e-5, tie_embeddings=tie,
                             zero_centered_gamma=zero_centered_gamma, **scaling, **fields)
    if zero_centered_gamma:
        for name, p in model.parameters().items():
            if name.endswith("norm.weight"):
                w = np.from_dlpack(p).copy()
                p.copy_(np.ascontiguousarray(w - 1.0, dtype=np.float32))
    return hf, model


def add_mtp_depths(hf, layers):
    """Turns the decoder layers of `hf` past its first `layers` into DeepSeek-V3's multi-token
    prediction depths, as HF's DeepSeek-V3 checkpoint holds its one (layer 61): each keeps its
    decoder layer (its class's, built with its own index) and gains enorm and hnorm (RMSNorm),
    eh_proj (Linear [H, 2H], no bias) and shared_head.norm (RMSNorm), with braid's names
    (model.layers.{i}.enorm.weight, ...); the norm weights off 1, as eager_model's. The model's
    forward then runs the first `layers` alone (it runs config.num_hidden_layers of them)."""
    cfg = hf.config
    assert len(hf.model.layers) > layers
    cfg.num_hidden_layers = layers
    h, eps = cfg.hidden_size, cfg.rms_norm_eps
    for layer in hf.model.layers[layers:]:
        layer.enorm = torch.nn.RMSNorm(h, eps=eps)
        layer.hnorm = torch.nn.RMSNorm(h, eps=eps)
        layer.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
        layer.shared_head = torch.nn.Module()
        layer.shared_head.norm = torch.nn.RMSNorm(h, eps=eps)
        with torch.no_grad():
            layer.eh_proj.weight.normal_(0.0, cfg.initializer_range)
            for norm in (layer.enorm, layer.hnorm, layer.shared_head.norm):
                norm.weight.add_(0.1 * torch.randn_like(norm.weight))
    return hf


def braid_llama_like(hf, layers, hidden, heads, kv_heads, ffn, vocab, positions, **fields):
    """braid's model of a Llama-shaped HF model `hf`: the shape, `fields` set on the config
    (norm_eps, rope_theta, add_qkv_bias, ...), HF's weights copied in."""
    cfg = braid.TransformerConfig.preset("llama-tiny")
    cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads = layers, hidden, heads
    cfg.num_query_groups, cfg.ffn_hidden_size = kv_heads, ffn
    cfg.vocab_size, cfg.max_position_embeddings = vocab, positions
    for name, value in fields.items():
        setattr(cfg, name, value)
    model = braid.GPTModel(cfg, device="cpu", seed=1)
    state = {n: p.detach().clone() for n, p in hf.named_parameters()}
    if cfg.num_experts:
        state = experts_to_braid(state, cfg.num_experts, cfg.moe_ffn_hidden_size or ffn)
    load_into_braid(model, state)
    return model


def qwen2_pair(layers=2, hidden=64, heads=4, kv_heads=2, ffn=160, vocab=97, positions=64, seed=0,
               sliding_window=None, max_window_layers=0):
    """Qwen2ForCausalLM: Llama with biases on q, k and v alone (braid's add_qkv_bias). With a
    sliding_window, layers from max_window_layers on attend in it (use_sliding_window)."""
    torch.manual_seed(seed)
    sliding = {} if sliding_window is None else {
        "use_sliding_window": True, "sliding_window": sliding_window,
        "max_window_layers": max_window_layers}
    hf_cfg = transformers.Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=positions,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, **sliding)
    hf = eager_model(transformers.Qwen2ForCausalLM, hf_cfg, biases=True)
    window = {} if sliding_window is None else {
        "window_size": sliding_window - 1,
        "window_layers": [int(i >= max_window_layers) for i in range(layers)]}
    return hf, braid_llama_like(hf, layers, hidden, heads, kv_heads, ffn, vocab, positions,
                                norm_eps=1e-6, rope_theta=1000000.0, tie_embeddings=True,
                                add_qkv_bias=True, **window)


def mistral_pair(layers=2, hidden=64, heads=4, kv_heads=2, ffn=160, vocab=97, positions=64,
                 seed=0, sliding_window=5):
    """MistralForCausalLM v0.1: Llama whose every layer attends in a sliding window of
    `sliding_window` keys (the query's own among them: braid's window_size is one less)."""
    torch.manual_seed(seed)
    hf_cfg = transformers.MistralConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=positions,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        sliding_window=sliding_window)
    hf = eager_model(transformers.MistralForCausalLM, hf_cfg)
    return hf, braid_llama_like(hf, layers, hidden, heads, kv_heads, ffn, vocab, positions,
                                norm_eps=1e-5, tie_embeddings=False,
                                window_size=sliding_window - 1)


def qwen3_pair(layers=2, hidden=64, heads=4, kv_heads=2, ffn=160, vocab=97, positions=64, seed=0,
               head_dim=None):
    """Qwen3ForCausalLM: Llama with an RMSNorm on each query and key head (qk_layernorm);
    `head_dim` other than hidden / heads is braid's kv_channels (Qwen3-0.6B's 128 on 1024 / 16)."""
    head_dim = head_dim or hidden // heads
    torch.manual_seed(seed)
    hf_cfg = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=positions, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=False)
    hf = eager_model(transformers.Qwen3ForCausalLM, hf_cfg)
    return hf, braid_llama_like(hf, layers, hidden, heads, kv_heads, ffn, vocab, positions,
                                norm_eps=1e-6, rope_theta=1000000.0, tie_embeddings=False,
                                qk_layernorm=True, kv_channels=head_dim)


def stablelm_pair(layers=2, hidden=64, heads=4, kv_heads=2, ffn=160, vocab=97, positions=64,
                  seed=0, partial=0.25, qkv_bias=True):
    """StableLmForCausalLM: Llama with LayerNorms (weight and bias), RoPE on the first
    `partial` of each head (rotary_percent) and biases on q, k and v (use_qkv_bias)."""
    torch.manual_seed(seed)
    hf_cfg = transformers.StableLmConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=positions,
        layer_norm_eps=1e-5, use_qkv_bias=qkv_bias, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": partial})
    hf = eager_model(transformers.StableLmForCausalLM, hf_cfg, biases=True)
    assert hf.model.layers[0].self_attn.rotary_ndims == int(hidden // heads * partial)
    return hf, braid_llama_like(hf, layers, hidden, heads, kv_heads, ffn, vocab, positions,
                                normalization="layernorm", norm_eps=1e-5, tie_embeddings=False,
                                add_qkv_bias=qkv_bias, rotary_percent=partial)


def nemotron_pair(layers=2, hidden=64, heads=4, kv_heads=2, ffn=160, vocab=97, positions=64,
                  seed=0, bias=True):
    """NemotronForCausalLM: LayerNorm1P (weights holding gamma - 1: zero_centered_gamma), an
    ungated squared-ReLU MLP, RoPE on half of each head, optional biases on every linear."""
    torch.manual_seed(seed)
    hf_cfg = transformers.NemotronConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=positions,
        norm_eps=1e-5, attention_bias=bias, mlp_bias=bias, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5})
    hf = eager_model(transformers.NemotronForCausalLM, hf_cfg, biases=True)
    return hf, braid_llama_like(hf, layers, hidden, heads, kv_heads, ffn, vocab, positions,
                                normalization="layernorm", activation="squared_relu",
                                zero_centered_gamma=True, norm_eps=1e-5, tie_embeddings=False,
                                add_bias_linear=bias, rotary_percent=0.5)


def moe_routers(hf, std=0.2):
    """Router weights drawn wider than HF's init (std 0.02): decisive logits, so that no token's
    k-th and (k+1)-th experts are near a tie that rounding could flip."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, std)
    return hf


def mixtral_pair(layers=2, hidden=64, heads=4, kv_heads=2, ffn=48, experts=4, topk=2, vocab=97,
                 positions=64, seed=0, **fields):
    """MixtralForCausalLM: Mistral whose MLPs are `experts` SwiGLU experts of width `ffn`, `topk`
    chosen per token and weighted by a softmax over their logits. `fields`: more braid config
    (moe_aux_loss_coeff, ...). HF's own aux loss is off (router_aux_loss_coef 0)."""
    torch.manual_seed(seed)
    hf_cfg = transformers.MixtralConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=positions,
        num_local_experts=experts, num_experts_per_tok=topk, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        router_aux_loss_coef=0.0, tie_word_embeddings=False)
    hf = moe_routers(eager_model(transformers.MixtralForCausalLM, hf_cfg))
    return hf, braid_llama_like(hf, layers, hidden, heads, kv_heads, ffn, vocab, positions,
                                norm_eps=1e-5, rope_theta=1000000.0, tie_embeddings=False,
                                num_experts=experts, moe_router_topk=topk,
                                moe_ffn_hidden_size=ffn, **fields)


def expert_layers(hf):
    """braid's moe_layers for an HF MoE model: 1 on the layers transformers built experts on,
    0 on those with its dense MLP ([] when every layer has experts)."""
    layers = [int(hasattr(layer.mlp, "experts")) for layer in hf.model.layers]
    return [] if all(layers) else layers


def qwen3_moe_pair(layers=2, hidden=64, heads=4, kv_heads=2, ffn=48, experts=4, topk=2, vocab=97,
                   positions=64, seed=0, norm_topk_prob=True, mlp_only_layers=(), **fields):
    """Qwen3MoeForCausalLM: Qwen3 (q/k norms) whose MLPs are experts; norm_topk_prob false
    weights the chosen experts by their softmax over all experts, not renormalised (braid's
    moe_router_pre_softmax). The layers mlp_only_layers lists have the dense MLP of
    intermediate_size (4 x hidden: braid's ffn_hidden_size)."""
    torch.manual_seed(seed)
    hf_cfg = transformers.Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
        moe_intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=hidden // heads, max_position_embeddings=positions,
        num_experts=experts, num_experts_per_tok=topk, norm_topk_prob=norm_topk_prob,
        mlp_only_layers=list(mlp_only_layers), rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        router_aux_loss_coef=0.0, tie_word_embeddings=False)
    hf = moe_routers(eager_model(transformers.Qwen3MoeForCausalLM, hf_cfg))
    return hf, braid_llama_like(hf, layers, hidden, heads, kv_heads, 4 * hidden, vocab,
                                positions, norm_eps=1e-6, rope_theta=1000000.0,
                                tie_embeddings=False, qk_layernorm=True, num_experts=experts,
                                moe_router_topk=topk, moe_ffn_hidden_size=ffn,
                                moe_router_pre_softmax=not norm_topk_prob,
                                moe_layers=expert_layers(hf), **fields)


def qwen2_moe_pair(layers=2, hidden=64, heads=4, kv_heads=2, ffn=48, shared=96, experts=4,
                   topk=2, vocab=97, positions=64, seed=0, norm_topk_prob=False,
                   decoder_sparse_step=1, **fields):
    """Qwen2MoeForCausalLM: Qwen2 (q, k, v biases) whose MLPs are experts plus a shared expert
    of width `shared` that every token goes through, its output scaled by sigmoid(x w_gate)
    (braid's moe_shared_expert_intermediate_size and moe_shared_expert_gate). Its router's
    norm_topk_prob defaults to false: the top k of a softmax over all experts. With
    decoder_sparse_step N only layers N-1, 2N-1, ... have experts, the others the dense MLP of
    intermediate_size (4 x hidden: braid's ffn_hidden_size)."""
    torch.manual_seed(seed)
    hf_cfg = transformers.Qwen2MoeConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
        moe_intermediate_size=ffn, shared_expert_intermediate_size=shared,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=positions, num_experts=experts, num_experts_per_tok=topk,
        norm_topk_prob=norm_topk_prob, decoder_sparse_step=decoder_sparse_step,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        router_aux_loss_coef=0.0, tie_word_embeddings=False)
    hf = moe_routers(eager_model(transformers.Qwen2MoeForCausalLM, hf_cfg, biases=True))
    with torch.no_grad():  # gate logits of a few units: the sigmoid far from linear
        for name, p in hf.named_parameters():
            if name.endswith("shared_expert_gate.weight"):
                p.normal_(0.0, 0.2)
    return hf, braid_llama_like(hf, layers, hidden, heads, kv_heads, 4 * hidden, vocab,
                                positions, norm_eps=1e-6, rope_theta=1000000.0,
                                tie_embeddings=False, add_qkv_bias=True, num_experts=experts,
                                moe_router_topk=topk, moe_ffn_hidden_size=ffn,
                                moe_router_pre_softmax=not norm_topk_prob,
                                moe_shared_expert_intermediate_size=shared,
                                moe_shared_expert_gate=True, moe_layers=expert_layers(hf),
                                **fields)


def experts_to_braid(state, num_experts, ffn):
    """transformers 5's fused experts (mlp.experts.gate_up_proj [E, 2F, H], gate rows first;
    mlp.experts.down_proj [E, H, F]) -> braid's mlp.experts.{j}.{gate,up,down}_proj.weight; the
    other tensors as they are. Gradients map alike."""
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[:-len("gate_up_proj")]
            for j in range(num_experts):
                out[f"{prefix}{j}.gate_proj.weight"] = t[j, :ffn]
                out[f"{prefix}{j}.up_proj.weight"] = t[j, ffn:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[:-len("down_proj")]
            for j in range(num_experts):
                out[f"{prefix}{j}.down_proj.weight"] = t[j]
        else:
            out[name] = t
    return out


def gpt2_to_braid(hf, layers, hidden):
    """HF GPT-2 state -> braid names (weights transposed to [out, in], c_attn split)."""
    sd = {n: p.detach() for n, p in hf.named_parameters()}
    out = {"model.embed_tokens.weight": sd["transformer.wte.weight"],
           "model.embed_positions.weight": sd["transformer.wpe.weight"],
           "model.norm.weight": sd["transformer.ln_f.weight"],
           "model.norm.bias": sd["transformer.ln_f.bias"]}
    for i in range(layers):
        h, b = f"transformer.h.{i}.", f"model.layers.{i}."
        q, k, v = sd[h + "attn.c_attn.weight"].t().split(hidden, dim=0)
        qb, kb, vb = sd[h + "attn.c_attn.bias"].split(hidden)
        out.update({
            b + "input_layernorm.weight": sd[h + "ln_1.weight"], b + "input_layernorm.bias": sd[h + "ln_1.bias"],
            b + "self_attn.q_proj.weight": q, b + "self_attn.k_proj.weight": k, b + "self_attn.v_proj.weight": v,
            b + "self_attn.q_proj.bias": qb, b + "self_attn.k_proj.bias": kb, b + "self_attn.v_proj.bias": vb,
            b + "self_attn.o_proj.weight": sd[h + "attn.c_proj.weight"].t(), b + "self_attn.o_proj.bias": sd[h + "attn.c_proj.bias"],
            b + "post_attention_layernorm.weight": sd[h + "ln_2.weight"], b + "post_attention_layernorm.bias": sd[h + "ln_2.bias"],
            b + "mlp.up_proj.weight": sd[h + "mlp.c_fc.weight"].t(), b + "mlp.up_proj.bias": sd[h + "mlp.c_fc.bias"],
            b + "mlp.down_proj.weight": sd[h + "mlp.c_proj.weight"].t(), b + "mlp.down_proj.bias": sd[h + "mlp.c_proj.bias"],
        })
    return out


def gpt2_grads_in_braid_names(hf, layers, hidden):
    """The HF GPT-2 model's .grad tensors under braid's names and layout."""
    class _G:  # gpt2_to_braid reads named_parameters(); hand it the grads instead
        def __init__(self, m):
            self.m = m

        def named_parameters(self):
            return [(n, p.grad) for n, p in self.m.named_parameters()]
    return gpt2_to_braid(_G(hf), layers, hidden)


def assert_close_rel(name, got, want, rtol):
    """max |got - want| <= rtol x max |want|; returns that relative error."""
    want = np.asarray(want, dtype=np.float64)
    scale = max(np.abs(want).max(), 1e-6)
    err = np.abs(np.asarray(got, dtype=np.float64) - want).max() / scale
    assert err <= rtol, f"{name}: max error {err:.2e} (relative to max |value| {scale:.3e}) > {rtol:.0e}"
    return err


def load_into_braid(model, state):
    params = model.parameters()
    assert set(params) == set(state), (sorted(set(params) ^ set(state)))
    for name, value in state.items():
        params[name].copy_(np.ascontiguousarray(value.detach().float().numpy()))


def braid_grads(model):
    return {n: np.from_dlpack(g).copy() for n, g in model.gradients().items()}


def batch(vocab, b=3, s=16, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(b, s), dtype=np.int64)
    targets = np.concatenate([ids[:, 1:], np.full((b, 1), -1)], axis=1)
    return ids, targets


def compare_logits_loss_and_gradients(model, hf, out, ids, targets, hf_grads, logits_rtol,
                                      grad_rtol):
    """braid's logits, loss and gradients of (ids, targets) against HF's. `out`: HF's output of
    the same batch with labels, not yet backpropagated; `hf_grads(hf)`: HF's gradients under
    braid's names. Logits and each gradient within their rtol x their largest value, the loss
    within 1e-5 x HF's. Returns the logits' and the gradients' largest relative error and
    braid's gradients."""
    logits = np.from_dlpack(model.logits(ids))
    assert logits.shape == out.logits.shape
    err = assert_close_rel("logits", logits, out.logits.detach().numpy(), logits_rtol)
    loss = model.forward(ids, targets)
    model.backward()
    out.loss.backward()
    assert abs(loss - out.loss.item()) <= 1e-5 * abs(out.loss.item()), (loss, out.loss.item())
    got, want = braid_grads(model), hf_grads(hf)
    assert sorted(got) == sorted(want)
    grad_err = max(assert_close_rel(name, got[name], g.numpy(), grad_rtol)
                   for name, g in want.items())
    return err, grad_err, got


def assert_fields_matter(model, hf, changed, vocab, logits_rtol):
    """braid's `model` computes `hf`'s logits of batch(vocab) within logits_rtol, and `changed`,
    HF's model of the same weights with other config fields, logits beyond 100 x that: the
    comparison checks what those fields change."""
    ids, _ = batch(vocab)
    with torch.no_grad():
        want = hf(torch.from_numpy(ids)).logits.numpy()
        different = changed(torch.from_numpy(ids)).logits.numpy()
    got = np.from_dlpack(model.logits(ids))
    assert np.abs(got - want).max() <= logits_rtol * np.abs(want).max()
    assert np.abs(got - different).max() > 100 * logits_rtol * np.abs(want).max()


def assert_greedy_decoding_matches_generate(hf, model, vocab, new_tokens, routing_margin, margin,
                                            logits_rtol):
    """braid's decode fills its cache with the prompt, then one token a step: every step's
    logits are transformers' (over its own cache, within logits_rtol) and the tokens chosen the
    same, for 3 prompts of 6 tokens (seed 1) and `new_tokens` steps. Every step's top two logits
    are more than 1e-3 apart and every token's routing (`routing_margin(hf, router_logits)`) more
    than `margin` from a tie, so that the test is exact; not one token repeated. Returns braid's
    cache after the last step and the decode logits' largest relative error."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, vocab, size=6).tolist() for _ in range(3)]
    with torch.no_grad():
        out = hf.generate(torch.tensor(prompts), do_sample=False, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0,
                          attention_mask=torch.ones(3, 6, dtype=torch.long))
        full = hf(out, output_router_logits=True)
        top2 = torch.topk(full.logits[:, 5:-1].double(), 2, dim=-1).values
        assert (top2[..., 0] - top2[..., 1]).min() > 1e-3
        assert routing_margin(hf, full.router_logits) > margin
    want = out[:, 6:].tolist()
    assert any(len(set(w)) > 3 for w in want)  # not one token repeated
    assert generate(model, prompts, new_tokens, Sampling(greedy=True)) == want

    cache = model.kv_cache(3, 6 + new_tokens)
    tokens = out.numpy().astype(np.int32)
    steps = [np.from_dlpack(model.decode(tokens[:, :6], cache))]
    for t in range(6, 6 + new_tokens - 1):
        steps.append(np.from_dlpack(model.decode(tokens[:, t:t + 1], cache)))
    err = assert_close_rel("decode logits", np.concatenate(steps, axis=1),
                           full.logits[:, :-1].numpy(), logits_rtol)
    return cache, err


def deepseek_mla_config(config_class, layers, hidden, heads, vocab, positions, q_rank, kv_rank,
                        nope, rope, v_dim, **fields):
    """transformers' `config_class` (DeepseekV2Config, DeepseekV3Config) of a tiny model with
    multi-latent attention: `layers` layers of width `hidden` (the dense MLPs 4 x hidden wide),
    `heads` heads each with its own key and value, a query latent of q_rank (None: q_proj) and a
    key/value latent of kv_rank, query and key heads of nope channels then rope turned by RoPE,
    value heads of v_dim; RMSNorm eps 1e-6, plain RoPE (theta 10000), untied embeddings.
    `fields`: the router's and any others, over these."""
    return config_class(**{
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 4 * hidden,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
        "q_lora_rank": q_rank, "kv_lora_rank": kv_rank, "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope, "v_head_dim": v_dim, "max_position_embeddings": positions,
        "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False, **fields})


# ---- DeepSeek-V3's router (DeepseekV3, Dots1, Glm4Moe) -------------------------------------------

def deepseek_routers(hf, bias_std=0.1):
    """moe_routers, and each e_score_correction_bias drawn random (std `bias_std`) so that it
    changes choices."""
    moe_routers(hf)
    with torch.no_grad():
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, bias_std)
    return hf


def deepseek_to_braid(hf, state):
    """The parameters or gradients `state` of a model with DeepSeek-V3's MoE under braid's names:
    the experts split (experts_to_braid), mlp.shared_experts.* as mlp.shared_expert.*, a tied
    lm_head left out."""
    if hf.config.tie_word_embeddings:
        state = {n: t for n, t in state.items() if n != "lm_head.weight"}
    state = experts_to_braid(state, hf.config.n_routed_experts, hf.config.moe_intermediate_size)
    return {n.replace("mlp.shared_experts.", "mlp.shared_expert."): t for n, t in state.items()}


def deepseek_grads(hf):
    """HF's gradients under braid's names (deepseek_to_braid)."""
    return deepseek_to_braid(hf, {n: p.grad for n, p in hf.named_parameters()})


def load_deepseek_into_braid(model, hf):
    """HF's parameters (deepseek_to_braid) and expert biases (e_score_correction_bias) into
    braid's `model`, which has the same expert layers."""
    load_into_braid(model, deepseek_to_braid(hf, {n: p.detach().clone()
                                                  for n, p in hf.named_parameters()}))
    biases = model.expert_biases()
    hf_biases = {n: b for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")}
    assert sorted(biases) == sorted(hf_biases)
    for name, b in hf_biases.items():
        biases[name].copy_(b.numpy().copy())


def deepseek_choices(logits, bias, groups, topk_group, topk):
    """transformers' DeepseekV3TopkRouter choice from router logits [T, E] (bias [E]): the sets
    of chosen experts [T, k] sorted, the least gap between a token's last chosen and first
    unchosen group (inf with every group chosen) and the same gap for its experts (inf when the
    chosen groups hold k experts)."""
    experts = logits.shape[1]
    scores = logits.sigmoid() + bias
    group_scores = scores.view(-1, groups, experts // groups).topk(2, dim=-1).values.sum(-1)
    top_groups = group_scores.topk(min(topk_group + 1, groups), dim=-1)
    group_gap = (top_groups.values[:, topk_group - 1] - top_groups.values[:, topk_group]).min() \
        if topk_group < groups else torch.tensor(float("inf"))
    mask = torch.zeros_like(group_scores).scatter_(1, top_groups.indices[:, :topk_group], 1)
    mask = mask.repeat_interleave(experts // groups, dim=1).bool()
    masked = scores.masked_fill(~mask, float("-inf"))
    top = masked.topk(min(topk + 1, experts), dim=-1)
    expert_gap = (top.values[:, topk - 1] - top.values[:, topk]).min() if topk < experts \
        else torch.tensor(float("inf"))
    return top.indices[:, :topk].sort(dim=-1).values, group_gap.item(), expert_gap.item()


def deepseek_routing(hf, router_logits):
    """(layer number, router logits, router) of each expert layer of `hf`; `router_logits` as
    hf(..., output_router_logits=True) returns them (None without expert layers)."""
    layers = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert len(layers) == len(router_logits or ())
    return [(i, logits.detach(), hf.model.layers[i].mlp.gate)
            for i, logits in zip(layers, router_logits or ())]


def deepseek_routing_margin(hf, router_logits):
    """The least gap, over every token of every expert layer, between the last chosen and the
    first unchosen group or expert (deepseek_choices with each router's settings)."""
    margin = float("inf")
    for _, logits, router in deepseek_routing(hf, router_logits):
        _, group_gap, expert_gap = deepseek_choices(logits, router.e_score_correction_bias,
                                                    router.num_group, router.topk_group,
                                                    router.top_k)
        margin = min(margin, group_gap, expert_gap)
    return margin


def check_deepseek_routing(hf, router_logits, margin):
    """On every expert layer: no token's group or expert choice within `margin` of a tie, every
    expert chosen, and the bias and the groups each change some token's choice (so that a router
    ignoring either fails). Returns each expert layer's least expert gap, by layer number."""
    expert_gaps = {}
    for i, logits, router in deepseek_routing(hf, router_logits):
        bias, topk = router.e_score_correction_bias, router.top_k
        chosen, group_gap, expert_gap = deepseek_choices(logits, bias, router.num_group,
                                                         router.topk_group, topk)
        assert group_gap > margin, f"layer {i}: a near tie among the groups ({group_gap:.1e})"
        assert expert_gap > margin, f"layer {i}: a near tie among the experts ({expert_gap:.1e})"
        counts = torch.bincount(chosen.reshape(-1), minlength=logits.shape[1])
        assert (counts > 0).all(), f"layer {i}: experts chosen {counts.tolist()}"
        unbiased, _, _ = deepseek_choices(logits, torch.zeros_like(bias), router.num_group,
                                          router.topk_group, topk)
        assert (unbiased != chosen).any(), f"layer {i}: the bias changes no token's choice"
        ungrouped, _, _ = deepseek_choices(logits, bias, 1, 1, topk)
        assert (ungrouped != chosen).any(), f"layer {i}: the groups change no token's choice"
        expert_gaps[i] = expert_gap
    return expert_gaps
