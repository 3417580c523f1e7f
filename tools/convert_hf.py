#!/usr/bin/env python3
"""Hugging Face Llama / Mistral / Qwen2 / Qwen3 / StableLM / Nemotron / GPT-2 / Mixtral /
Qwen2-MoE / Qwen3-MoE / dots1 / GLM-4.5 / DeepSeek-V2 / DeepSeek-V3 / GPT-OSS directories to braid
checkpoints and back.

  convert_hf.py import --hf-dir DIR --save CKPT   config.json + model.safetensors (or sharded,
                                                  model.safetensors.index.json) -> a braid
                                                  checkpoint at iteration 0, no optimizer state
  convert_hf.py export --load CKPT --hf-dir OUT   a braid checkpoint saved under any layout ->
                                                  config.json + model.safetensors that
                                                  transformers.AutoModelForCausalLM loads

The checkpoint format is csrc/engine/checkpoint.cpp's: <CKPT>/latest_checkpointed_iteration.txt,
<CKPT>/iter_0000000/metadata.json (config, layout, tensor index) and mp_rank_TT_PPP.safetensors
shards. An import writes the tp=1, pp=1 layout (one file holding every tensor, indexed as braid
indexes a tp=1 save); braid's loader reshards it to any layout (load it with --finetune or
--no-load-optim). An export assembles every tensor from the shards the index lists.

GLM-4.5's and DeepSeek-V3's multi-token-prediction layers (model.layers.{L}.*, after the last)
import as braid's MTP depths (mtp_num_layers) where the weights hold them, and braid's depths
export as those layers; --no-mtp, on either command, leaves them out.

Tensors are moved as raw bytes (bf16 included): a round trip is bit-exact. Only numpy is needed.
docs/convert_hf.md has the name mapping and what is refused; hf_configs.py maps the configs,
hf_moe.py what is particular to mixtures of experts, hf_deepseek.py to DeepSeek-V3 and -V2 (their
multi-latent attention and their routing), hf_gpt_oss.py to GPT-OSS (its fused experts, attention
sinks and the MXFP4 experts of its released checkpoints, dequantized on import).
"""

import argparse
import json
import os
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling, when imported
from safetensors_numpy import (STORAGE, SafetensorsError, Tensor,  # noqa: E402
                               bf16_bits, read_safetensors, write_safetensors, write_text)
from hf_configs import (GATED, LLAMA_LIKE, ConvertError, braid_architecture,  # noqa: E402
                        braid_config_from_hf, check, check_new_hf_dir, head_width,
                        hf_architecture, hf_architecture_or_none, hf_config_from_braid,
                        read_json)
from hf_moe import (MOE_ARCHITECTURES, braid_moe_tensors_to_hf, expert_layers,  # noqa: E402
                    hf_moe_config, moe_architecture, moe_config_from_hf, moe_ffn,
                    moe_tensors_to_braid)
from hf_deepseek import (DEEPSEEK_MOE_ARCHITECTURES, LATENT_ARCHITECTURES,  # noqa: E402
                         MTP_ARCHITECTURES, SIGMOID_MOE_ARCHITECTURES,
                         braid_deepseek_moe_tensors_to_hf, braid_mtp_copies_to_hf,
                         check_mtp_export, deepseek_moe_tensors_to_braid, expert_bias_specs,
                         hf_latent_attention_config, hf_mtp_count, hf_sigmoid_moe_config,
                         hf_softmax_moe_config, latent_attention_architecture,
                         latent_attention_config_from_hf, mtp_config_from_hf,
                         sigmoid_moe_architecture, sigmoid_moe_config_from_hf, sigmoid_router,
                         softmax_moe_config_from_hf, take_mtp_layers, without_mtp)
from hf_gpt_oss import (braid_gpt_oss_tensors_to_hf, check_quantization,  # noqa: E402
                        gpt_oss_architecture, gpt_oss_config_from_hf, gpt_oss_tensors_to_braid,
                        hf_gpt_oss_config)

FLOAT_DTYPES = {"F32": "f32", "BF16": "bf16", "F16": "f16"}  # what braid's parameters can be
TORCH_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
BIAS_SUFFIX = "e_score_correction_bias"

FORMAT = "braid-checkpoint"
# The newest format read; 2 marks a model with MoE router features version-1 readers do not know,
# 3 one with multi-latent attention or YaRN, 4 one with multi-token prediction, 5 one with linear
# RoPE interpolation, 6 one with interleaved RoPE pairs outside multi-latent attention
# (checkpoint.h), 7 one with attention sinks, the quick GEGLU, a GLU offset or clamp, untruncated
# YaRN or a router bias, each written only for such a model (format_version).
FORMAT_VERSION = 7
TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "metadata.json"
SHARD_FILE = "mp_rank_00_000.safetensors"


# ---- braid's parameters (include/braid/model/parameters.h) ----------------------------------

def braid_specs(c):
    """[(name, shape, tp_dim)] of the whole model in flat-buffer order, as parameter_layout."""
    h, f = c["hidden_size"], c["ffn_hidden_size"]
    head_dim = head_width(c)
    q_out, kv_out = c["num_attention_heads"] * head_dim, c["num_query_groups"] * head_dim
    bias, layernorm = c["add_bias_linear"], c["normalization"] == "layernorm"
    qkv_bias = bias or c.get("add_qkv_bias", False)  # absent in checkpoints before it
    specs = [("model.embed_tokens.weight", [c["vocab_size"], h], 0)]
    if c["position_embedding"] == "learned":
        specs.append(("model.embed_positions.weight", [c["max_position_embeddings"], h], -1))

    def norm(prefix, size=h):
        specs.append((prefix + ".weight", [size], -1))
        if layernorm:
            specs.append((prefix + ".bias", [size], -1))

    def mlp(prefix, f):  # the dense MLP or an expert; gated activations have a gate_proj
        mlp_in = ["gate_proj", "up_proj"] if c["activation"] in GATED else ["up_proj"]
        specs.extend((prefix + f"{m}.weight", [f, h], 0) for m in mlp_in)
        if bias:
            specs.extend((prefix + f"{m}.bias", [f], 0) for m in mlp_in)
        specs.append((prefix + "down_proj.weight", [h, f], 1))
        if bias:
            specs.append((prefix + "down_proj.bias", [h], -1))

    def mlp_or_experts(p, has_experts):
        if not has_experts:  # (num_experts, moe_layers: absent in checkpoints before them)
            mlp(p + "mlp.", f)
            return
        specs.append((p + "mlp.gate.weight", [c["num_experts"], h], -1))
        if bias:  # the router's bias (Megatron's router has one with add_bias_linear)
            specs.append((p + "mlp.gate.bias", [c["num_experts"]], -1))
        for j in range(c["num_experts"]):
            mlp(p + f"mlp.experts.{j}.", moe_ffn(c))
        if c.get("moe_shared_expert_intermediate_size"):  # absent before shared experts
            mlp(p + "mlp.shared_expert.", c["moe_shared_expert_intermediate_size"])
            if c.get("moe_shared_expert_gate"):
                specs.append((p + "mlp.shared_expert_gate.weight", [1, h], -1))

    def latent_attention(p):  # multi-latent attention (parameters.cpp add_latent_attention)
        heads, lq, lkv = c["num_attention_heads"], c["q_lora_rank"], c["kv_lora_rank"]
        d = c["qk_head_dim"] + c["qk_pos_emb_head_dim"]
        if lq:
            specs.append((p + "q_a_proj.weight", [lq, h], -1))
            if c["qk_layernorm"]:
                norm(p + "q_a_layernorm", lq)
            specs.append((p + "q_b_proj.weight", [heads * d, lq], 0))
        else:
            specs.append((p + "q_proj.weight", [heads * d, h], 0))
        specs.append((p + "kv_a_proj_with_mqa.weight", [lkv + c["qk_pos_emb_head_dim"], h], -1))
        if c["qk_layernorm"]:
            norm(p + "kv_a_layernorm", lkv)
        specs.append((p + "kv_b_proj.weight", [heads * (c["qk_head_dim"] + c["v_head_dim"]), lkv],
                      0))
        specs.append((p + "o_proj.weight", [h, heads * c["v_head_dim"]], 1))

    def layer(p, has_experts):
        norm(p + "input_layernorm")
        if c.get("multi_latent_attention"):  # absent in checkpoints before it
            latent_attention(p + "self_attn.")
            norm(p + "post_attention_layernorm")
            mlp_or_experts(p, has_experts)
            return
        specs.extend([(p + "self_attn.q_proj.weight", [q_out, h], 0),
                      (p + "self_attn.k_proj.weight", [kv_out, h], 0),
                      (p + "self_attn.v_proj.weight", [kv_out, h], 0)])
        if qkv_bias:
            specs.extend([(p + "self_attn.q_proj.bias", [q_out], 0),
                          (p + "self_attn.k_proj.bias", [kv_out], 0),
                          (p + "self_attn.v_proj.bias", [kv_out], 0)])
        if c.get("qk_layernorm"):
            norm(p + "self_attn.q_norm", head_dim)
            norm(p + "self_attn.k_norm", head_dim)
        specs.append((p + "self_attn.o_proj.weight", [h, q_out], 1))
        if bias:
            specs.append((p + "self_attn.o_proj.bias", [h], -1))
        if c.get("softmax_type") == "learnable":  # attention sinks, one per head
            specs.append((p + "self_attn.sinks", [c["num_attention_heads"]], 0))
        norm(p + "post_attention_layernorm")
        mlp_or_experts(p, has_experts)

    layers = c["num_layers"]
    experts = expert_layers(c) if c.get("num_experts") else [0] * layers
    for i in range(layers):
        layer(f"model.layers.{i}.", experts[i])
    # multi-token prediction (parameters.cpp add_mtp_depth): depth k is layer L + k - 1, of the
    # last layer's kind; absent in checkpoints before it
    for i in range(layers, layers + c.get("mtp_num_layers", 0)):
        p = f"model.layers.{i}."
        norm(p + "enorm")
        norm(p + "hnorm")
        specs.append((p + "eh_proj.weight", [h, 2 * h], -1))
        layer(p, experts[-1])
        norm(p + "shared_head.norm")
    norm("model.norm")
    if not c["tie_embeddings"]:
        specs.append(("lm_head.weight", [c["vocab_size"], h], 0))
    return specs


def checkpoint_specs(c):
    """braid_specs and the expert biases (f32, replicated; not parameters): every tensor of a
    checkpoint but the optimizer's."""
    return braid_specs(c) + expert_bias_specs(c)


# ---- tensor names ----------------------------------------------------------------------------

def hf_to_braid(hf, arch, c):
    """HF tensors (name -> Tensor) -> braid's names and layout; consumes what it maps."""
    take = hf.pop
    if arch == "gpt_oss":
        gpt_oss_tensors_to_braid(hf, c)
    if arch in MOE_ARCHITECTURES + DEEPSEEK_MOE_ARCHITECTURES and c.get("num_experts"):
        moe_tensors_to_braid(hf, arch, c)
    if arch in DEEPSEEK_MOE_ARCHITECTURES:
        deepseek_moe_tensors_to_braid(hf, c)
    if arch in LLAMA_LIKE:
        out = {}
        for name, _, _ in checkpoint_specs(c):
            check(name in hf, f"the HF weights have no {name}")
            out[name] = take(name)
        if c["tie_embeddings"] and "lm_head.weight" in hf:  # a tied copy saved anyway
            check(np.array_equal(hf["lm_head.weight"].array, out["model.embed_tokens.weight"].array),
                  "tie_word_embeddings is true but lm_head.weight differs from embed_tokens")
            take("lm_head.weight")
        for name in [n for n in hf if n.endswith("rotary_emb.inv_freq")]:  # old buffers
            take(name)
        return out

    # GPT-2: optional "transformer." prefix; Conv1D weights are [in, out]; c_attn is [q | k | v].
    def get(name):
        for key in ("transformer." + name, name):
            if key in hf:
                return take(key)
        raise ConvertError(f"the HF weights have no transformer.{name}")

    h = c["hidden_size"]
    out = {"model.embed_tokens.weight": get("wte.weight"),
           "model.embed_positions.weight": get("wpe.weight")}
    for i in range(c["num_layers"]):
        s, b = f"h.{i}.", f"model.layers.{i}."
        for key in ("attn.bias", "attn.masked_bias"):  # causal-mask buffers of old checkpoints
            for prefix in ("transformer." + s, s):
                hf.pop(prefix + key, None)
        qkv_w, qkv_b = get(s + "attn.c_attn.weight"), get(s + "attn.c_attn.bias")
        check(qkv_w.shape == [h, 3 * h], f"{s}attn.c_attn.weight is {qkv_w.shape}, config.json "
              f"says {[h, 3 * h]}")
        check(qkv_b.shape == [3 * h], f"{s}attn.c_attn.bias is {qkv_b.shape}, config.json says "
              f"{[3 * h]}")
        for j, proj in enumerate(("q_proj", "k_proj", "v_proj")):
            out[b + f"self_attn.{proj}.weight"] = qkv_w.like(qkv_w.array[:, j * h:(j + 1) * h].T)
            out[b + f"self_attn.{proj}.bias"] = qkv_b.like(qkv_b.array[j * h:(j + 1) * h])
        for hf_name, braid_name in (("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm")):
            out[b + braid_name + ".weight"] = get(s + hf_name + ".weight")
            out[b + braid_name + ".bias"] = get(s + hf_name + ".bias")
        for hf_name, braid_name in (("attn.c_proj", "self_attn.o_proj"), ("mlp.c_fc", "mlp.up_proj"),
                                    ("mlp.c_proj", "mlp.down_proj")):
            w = get(s + hf_name + ".weight")
            check(w.array.ndim == 2, f"{s}{hf_name}.weight is {w.shape}, expected a matrix")
            out[b + braid_name + ".weight"] = w.like(w.array.T)
            out[b + braid_name + ".bias"] = get(s + hf_name + ".bias")
    out["model.norm.weight"], out["model.norm.bias"] = get("ln_f.weight"), get("ln_f.bias")
    if not c["tie_embeddings"]:
        check("lm_head.weight" in hf, "the HF weights have no lm_head.weight "
              "(tie_word_embeddings is false)")
        out["lm_head.weight"] = take("lm_head.weight")
    elif "lm_head.weight" in hf:
        check(np.array_equal(hf["lm_head.weight"].array, out["model.embed_tokens.weight"].array),
              "tie_word_embeddings is true but lm_head.weight differs from wte")
        take("lm_head.weight")
    return out


def braid_to_hf(t, arch, c):
    """braid's tensors -> HF names and layout (the inverse of hf_to_braid)."""
    if arch in LLAMA_LIKE:
        out = dict(t)
        # A windowed Llama as Qwen2, or a model with a shared expert as Qwen2-MoE, without
        # q, k, v biases: those always have them (zeros here).
        if arch in ("qwen2", "qwen2_moe") and not c.get("add_qkv_bias"):
            for i in range(c["num_layers"]):
                for p in ("q_proj", "k_proj", "v_proj"):
                    w = t[f"model.layers.{i}.self_attn.{p}.weight"]
                    out[f"model.layers.{i}.self_attn.{p}.bias"] = w.like(
                        np.zeros(w.shape[0], dtype=w.array.dtype))
        if arch in MOE_ARCHITECTURES:
            braid_moe_tensors_to_hf(out, arch, c)
        if arch in DEEPSEEK_MOE_ARCHITECTURES:
            braid_deepseek_moe_tensors_to_hf(out, c)
        if arch in MTP_ARCHITECTURES:
            braid_mtp_copies_to_hf(out, c)
        if arch == "gpt_oss":
            braid_gpt_oss_tensors_to_hf(out, c)
        return out
    out = {"transformer.wte.weight": t["model.embed_tokens.weight"],
           "transformer.wpe.weight": t["model.embed_positions.weight"],
           "transformer.ln_f.weight": t["model.norm.weight"],
           "transformer.ln_f.bias": t["model.norm.bias"]}
    for i in range(c["num_layers"]):
        s, b = f"transformer.h.{i}.", f"model.layers.{i}."
        q = [t[b + f"self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")]
        check(len({x.dtype for x in q}) == 1, f"layer {i}: q, k, v weights differ in dtype")
        out[s + "attn.c_attn.weight"] = q[0].like(np.concatenate([x.array for x in q], axis=0).T)
        qb = [t[b + f"self_attn.{p}.bias"] for p in ("q_proj", "k_proj", "v_proj")]
        out[s + "attn.c_attn.bias"] = qb[0].like(np.concatenate([x.array for x in qb]))
        for hf_name, braid_name in (("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm")):
            out[s + hf_name + ".weight"] = t[b + braid_name + ".weight"]
            out[s + hf_name + ".bias"] = t[b + braid_name + ".bias"]
        for hf_name, braid_name in (("attn.c_proj", "self_attn.o_proj"), ("mlp.c_fc", "mlp.up_proj"),
                                    ("mlp.c_proj", "mlp.down_proj")):
            w = t[b + braid_name + ".weight"]
            out[s + hf_name + ".weight"] = w.like(w.array.T)
            out[s + hf_name + ".bias"] = t[b + braid_name + ".bias"]
    if not c["tie_embeddings"]:
        out["lm_head.weight"] = t["lm_head.weight"]
    return out


# ---- reading an HF directory -----------------------------------------------------------------

def read_hf_config(hf_dir):
    check(os.path.isdir(hf_dir), f"{hf_dir}: no such directory")
    config_path = os.path.join(hf_dir, "config.json")
    check(os.path.exists(config_path), f"{hf_dir}: no config.json")
    return read_json(config_path, "the model's config, a JSON object")


def read_hf_weights(hf_dir):
    """name -> Tensor over every weight file."""
    single = os.path.join(hf_dir, "model.safetensors")
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(single):
        files = ["model.safetensors"]
    elif os.path.exists(index):
        weight_map = read_json(index, "an object with a weight_map").get("weight_map")
        check(isinstance(weight_map, dict) and weight_map and all(
            isinstance(v, str) for v in weight_map.values()), f"{index}: weight_map should be a "
            "non-empty object of tensor name -> .safetensors file name")
        files = sorted(set(weight_map.values()))
    else:
        bins = [n for n in os.listdir(hf_dir) if n.endswith(".bin")]
        raise ConvertError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json" +
                           (" (only PyTorch .bin weights, which this tool does not read: "
                            "re-save them with safe_serialization=True)" if bins else ""))
    tensors = {}
    for name in files:
        path = os.path.join(hf_dir, name)
        check(os.path.isfile(path), f"{hf_dir}: {name} is missing")
        part, _ = read_safetensors(path)
        for key in part:
            check(key not in tensors, f"{hf_dir}: {key} is in more than one weight file")
        tensors.update(part)
    return tensors


def weights_dtype(tensors, hf_dir):
    # DeepSeek-V3-style routers' e_score_correction_bias is f32 in bf16 models too (as braid's)
    dtypes = {t.dtype for n, t in tensors.items() if not n.endswith(BIAS_SUFFIX)}
    for d in dtypes:
        check(d in FLOAT_DTYPES, f"{hf_dir}: weights of dtype {d} (braid's parameters are F32, "
              "BF16 or F16)")
    if len(dtypes) == 1:
        return FLOAT_DTYPES[dtypes.pop()]
    return "f32"  # mixed: braid computes in f32; every tensor is still stored as it came


# ---- import ----------------------------------------------------------------------------------

def format_version(config) -> int:
    """braid's format_version (csrc/engine/checkpoint_config.cpp) for a model config."""
    untruncated_yarn = config.get("rope_yarn_factor", 0.0) > 0 and not config.get(
        "rope_yarn_truncate", True)
    if (config.get("softmax_type", "vanilla") != "vanilla"
            or config.get("activation") == "quick_geglu" or untruncated_yarn
            or config.get("glu_linear_offset", 0.0) != 0 or config.get("activation_clamp", 0.0) != 0
            or (config.get("num_experts", 0) > 0 and config["add_bias_linear"])):
        return 7
    if config.get("rotary_interleaved") and not config.get("multi_latent_attention"):
        return 6
    if config.get("rope_linear_factor", 0.0) > 0:
        return 5
    if config.get("mtp_num_layers", 0) > 0:
        return 4
    if config.get("multi_latent_attention") or config.get("rope_yarn_factor", 0.0) > 0:
        return 3
    new_router = config.get("num_experts", 0) > 0 and (
        config.get("moe_router_score_function", "softmax") != "softmax"
        or config.get("moe_router_enable_expert_bias", False)
        or config.get("moe_router_num_groups", 0) > 0
        or config.get("moe_router_topk_scaling_factor", 1.0) != 1.0
        or config.get("moe_expert_capacity_factor", 0.0) > 0)
    return 2 if new_router else 1


def checkpoint_metadata(config, specs, hf):
    index = {}
    for name, shape, tp_dim in specs:  # stored_slices at tp = 1
        index[name] = {"shape": shape, "split_dim": tp_dim,
                       "shards": [{"file": SHARD_FILE, "start": 0,
                                   "length": shape[tp_dim] if tp_dim >= 0 else shape[0]}]}
    return {"format": FORMAT, "format_version": format_version(config), "iteration": 0,
            "config": config,
            "layout": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                       "data_parallel_size": 1, "virtual_pipeline_stages": 1,
                       "use_distributed_optimizer": False},
            "trainer": {"iteration": 0, "skipped_iterations": 0, "optimizer_steps": 0},
            "lr_schedule": {"lr": 0.0, "min_lr": 0.0, "warmup_iters": 0, "decay_iters": 0,
                            "style": "cosine", "lr_now": 0.0},
            "loss_scaler": {"scale": 1.0, "growth_tracker": 0, "hysteresis_tracker": 0},
            "consumed_samples": 0, "optimizer": False, "tensors": index,
            "hf_config": hf}


def import_hf(hf_dir, save, mtp=True):
    """`mtp`: import GLM-4.5's and DeepSeek-V3's multi-token-prediction layers, where the weights
    hold them, as braid's MTP depths (else leave them out)."""
    hf = read_hf_config(hf_dir)
    arch = hf_architecture(hf)
    quant = hf.get("quantization_config")
    check(not quant or arch == "gpt_oss", f"config.json: quantization_config "
          f"({quant.get('quant_method') if isinstance(quant, dict) else quant}) is not supported "
          "(braid's parameters are F32, BF16 or F16: dequantize the weights first)")
    latent = latent_attention_config_from_hf(hf, arch) if arch in LATENT_ARCHITECTURES else {}
    tensors = read_hf_weights(hf_dir)
    if arch == "gpt_oss":  # its MXFP4 experts, dequantized
        check_quantization(hf, tensors)
    depths = take_mtp_layers(tensors, hf, arch, keep=mtp)
    dtype = weights_dtype(tensors, hf_dir)
    config = gpt_oss_config_from_hf(hf, dtype) if arch == "gpt_oss" else \
        braid_config_from_hf(hf, arch, dtype)
    config.update(latent)
    config.update(moe_config_from_hf(hf, arch))
    if arch in SIGMOID_MOE_ARCHITECTURES:
        config.update(sigmoid_moe_config_from_hf(hf, arch))
    if arch == "deepseek_v2":
        config.update(softmax_moe_config_from_hf(hf))
    config.update(mtp_config_from_hf(hf, config, depths))
    hf_keys = ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions") if arch == "gpt2" \
        else ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size",
              "max_position_embeddings")
    for key, hf_key in zip(("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                            "max_position_embeddings"), hf_keys):
        check(isinstance(config[key], int) and config[key] > 0, f"config.json: {hf_key} should "
              f"be a positive integer, is {config[key]!r}")
    check(arch in LLAMA_LIKE or config["hidden_size"] % config["num_attention_heads"] == 0,
          "config.json: the hidden size is not a multiple of the number of attention heads")
    if not latent:  # (MLA's widths: latent_attention_config_from_hf)
        check(isinstance(config["kv_channels"], int) and config["kv_channels"] > 0,
              f"config.json: head_dim should be a positive integer, is {config['kv_channels']!r}")
        rotated = int(config["kv_channels"] * config["rotary_percent"])  # transformers' rounding
        check(arch not in LLAMA_LIKE or rotated % 2 == 0,
              f"config.json: head_dim {config['kv_channels']} x partial_rotary_factor "
              f"{config['rotary_percent']} = {rotated} channels turn; RoPE turns pairs")
    left = dict(tensors)  # hf_to_braid takes what it maps; what is left is unexpected
    braid_tensors = hf_to_braid(left, arch, config)
    if left:
        more = "" if len(left) == 1 else f", and {len(left) - 1} more"
        raise ConvertError(f"{hf_dir}: unexpected tensor {sorted(left)[0]} (not part of a {arch} "
                           f"model with this config.json){more}")
    specs = checkpoint_specs(config)
    for name, shape, _ in specs:
        got = braid_tensors[name].shape
        check(got == shape, f"{name}: the weights hold {got}, config.json makes it {shape}")
    check(set(braid_tensors) == {s[0] for s in specs}, "internal: mapped tensors differ from specs")

    iter_dir = write_checkpoint(save, braid_tensors, checkpoint_metadata(config, specs, hf))
    return iter_dir, arch, config


def write_checkpoint(save, tensors, meta):
    """Writes braid's tp=1, pp=1 checkpoint of `tensors` (name -> Tensor) and `meta` (its
    metadata.json) at meta["iteration"] into the new checkpoint directory `save`; returns the
    iteration's directory. Refuses a directory that already holds a checkpoint."""
    check(not os.path.exists(save) or os.path.isdir(save), f"{save} is a file, not a directory")
    if os.path.exists(os.path.join(save, TRACKER)):
        raise ConvertError(f"{save} already holds a checkpoint; import into a new directory")
    iter_dir = os.path.join(save, f"iter_{meta['iteration']:07d}")
    tmp_dir = iter_dir + ".tmp"
    os.makedirs(save, exist_ok=True)
    shutil.rmtree(tmp_dir, ignore_errors=True)
    os.makedirs(tmp_dir)
    write_safetensors(os.path.join(tmp_dir, SHARD_FILE), tensors)
    # As braid writes it (nlohmann::json: sorted keys), so the two look alike.
    write_text(os.path.join(tmp_dir, METADATA), json.dumps(meta, indent=1, sort_keys=True) + "\n")
    if os.path.exists(iter_dir):
        shutil.rmtree(iter_dir)
    os.replace(tmp_dir, iter_dir)
    write_text(os.path.join(save, TRACKER), f"{meta['iteration']}\n")
    return iter_dir


# ---- export ----------------------------------------------------------------------------------

def read_checkpoint(load, iteration=None, optimizer=False):
    """(metadata, name -> Tensor of every model tensor, assembled from its shards; with
    `optimizer` the optimizer.* tensors too)."""
    check(os.path.isdir(load), f"{load}: no such directory")
    if iteration is None:
        tracker = os.path.join(load, TRACKER)
        check(os.path.isfile(tracker), f"{load}: no {TRACKER} (nothing saved there)")
        text = open(tracker).read().strip()
        check(text.isdigit(), f"{tracker} should hold an iteration number, holds {text!r}")
        iteration = int(text)
    path = os.path.join(load, f"iter_{iteration:07d}")
    check(os.path.isdir(path), f"{path} does not exist")
    meta_path = os.path.join(path, METADATA)
    check(os.path.exists(meta_path), f"{path}: no {METADATA}")
    meta = read_json(meta_path, "braid's checkpoint metadata, a JSON object")
    check(meta.get("format") == FORMAT, f"{meta_path}: not a braid checkpoint")
    for key in ("config", "tensors"):
        check(isinstance(meta.get(key), dict), f"{meta_path}: \"{key}\" should be an object, is "
              f"{json.dumps(meta[key])[:40] if key in meta else 'missing'}")
    check(meta.get("format_version", 0) <= FORMAT_VERSION, f"{meta_path}: format version "
          f"{meta.get('format_version')} is newer than this tool reads ({FORMAT_VERSION})")
    files = {}

    def shard(file, name):
        if file not in files:
            full = os.path.join(path, file)
            check(os.path.exists(full), f"{path}: {file} is missing")
            check(os.path.isfile(full), f"{full} is a directory, expected a .safetensors file")
            files[file] = read_safetensors(full)[0]
        check(name in files[file], f"{path}/{file} has no {name}, the index says it does")
        return files[file][name]

    tensors = {}
    for name, entry in meta["tensors"].items():
        if name.startswith("optimizer.") and not optimizer:
            continue
        check(isinstance(entry, dict) and isinstance(entry.get("shape"), list) and entry["shape"]
              and entry.get("split_dim") in range(-1, len(entry["shape"]))
              and isinstance(entry.get("shards"), list), f"{meta_path}: the entry of {name} "
              "should be an object of shape, split_dim (-1 or a dimension) and shards")
        shape, dim = entry["shape"], entry["split_dim"]
        whole, covered = None, np.zeros(shape[max(dim, 0)], dtype=bool)
        for s in entry["shards"]:
            part = shard(s["file"], name)
            start, length = (s["start"], s["length"]) if dim >= 0 else (0, shape[0])
            want = list(shape)
            want[max(dim, 0)] = length
            check(part.shape == want if dim >= 0 else part.shape == shape,
                  f"{path}/{s['file']}: {name} holds {part.shape}, the index says "
                  f"{want if dim >= 0 else shape}")
            if whole is None:
                whole = Tensor(part.dtype, np.empty(shape, dtype=STORAGE[part.dtype]))
            check(part.dtype == whole.dtype, f"{path}: the shards of {name} differ in dtype")
            check(not covered[start:start + length].any(), f"{path}: shards of {name} overlap")
            covered[start:start + length] = True
            index = [slice(None)] * len(shape)
            index[max(dim, 0)] = slice(start, start + length)
            whole.array[tuple(index)] = part.array
        check(whole is not None and covered.all(), f"{path}: the shards of {name} do not cover it")
        tensors[name] = whole
    if meta.get("format_version", 0) < 7:  # a router of then had no bias: it is one of zeros
        for name, t in list(tensors.items()):
            bias = name[:-len("weight")] + "bias"
            if name.endswith(".mlp.gate.weight") and meta["config"].get("add_bias_linear"):
                tensors.setdefault(bias, t.like(np.zeros(t.shape[:1], dtype=t.array.dtype)))
    return meta, tensors


def plus(t, delta):
    """t + delta in t's dtype (round to nearest even): a norm weight to or from gamma - 1."""
    if t.dtype != "BF16":
        return t.like(t.array + t.array.dtype.type(delta))
    return t.like(bf16_bits((t.array.astype(np.uint32) << 16).view(np.float32) +
                            np.float32(delta)))


def export_hf(load, out, iteration=None, mtp=True):
    """`mtp`: export braid's multi-token-prediction depths (else leave them out). Refuses an
    `out` that already holds an HF model."""
    check_new_hf_dir(out)
    meta, tensors = read_checkpoint(load, iteration)
    config = meta["config"]
    if not mtp:
        tensors, config = without_mtp(tensors, config)
    check(not config.get("rotary_interleaved"), "this braid model pairs RoPE's channels "
          "interleaved (rotary_interleaved, Megatron's --rotary-interleaved); the transformers "
          "architectures convert_hf.py writes pair them as rotate_half")
    if config.get("multi_latent_attention"):
        arch = latent_attention_architecture(config, meta.get("hf_config"))
    elif config.get("softmax_type", "vanilla") != "vanilla" or \
            config["activation"] == "quick_geglu":
        arch = gpt_oss_architecture(config)
    elif not config.get("num_experts"):
        arch = braid_architecture(config)
    else:
        arch = (sigmoid_moe_architecture if sigmoid_router(config) else moe_architecture)(config)
    # Nemotron's LayerNorm1P holds gamma - 1, every other HF norm gamma.
    delta = int(bool(config.get("zero_centered_gamma"))) - int(arch == "nemotron")
    if delta:
        tensors = {n: plus(t, delta) if n.endswith("norm.weight") else t
                   for n, t in tensors.items()}
    if arch == "llama" and not config["add_bias_linear"] and \
            hf_architecture_or_none(meta.get("hf_config") or {}) == "mistral":
        arch = "mistral"  # an imported Mistral goes back as one
    check_mtp_export(config, arch)
    specs = checkpoint_specs(config)
    for name, shape, _ in specs:
        check(name in tensors, f"{load}: the checkpoint has no {name}")
        check(tensors[name].shape == shape, f"{load}: {name} is {tensors[name].shape}, the "
              f"config makes it {shape}")
    extra = set(tensors) - {s[0] for s in specs}
    if extra:
        raise ConvertError(f"{load}: unexpected tensor {sorted(extra)[0]} for this config")
    hf_tensors = braid_to_hf(tensors, arch, config)
    # transformers keeps dots1's, GLM-4.5's, DeepSeek-V2's and -V3's routers and biases in f32 in
    # any dtype
    kept_f32 = (BIAS_SUFFIX, "mlp.gate.weight") if arch in DEEPSEEK_MOE_ARCHITECTURES else (
        BIAS_SUFFIX,)
    dtypes = {t.dtype for n, t in hf_tensors.items() if not n.endswith(kept_f32)}
    torch_dtype = TORCH_NAMES.get(dtypes.pop(), "float32") if len(dtypes) == 1 else "float32"
    hf = hf_gpt_oss_config(config, torch_dtype, meta.get("hf_config")) if arch == "gpt_oss" \
        else hf_config_from_braid(config, arch, torch_dtype, meta.get("hf_config"))
    if arch in MOE_ARCHITECTURES:
        hf.update(hf_moe_config(config, arch))
    if arch in SIGMOID_MOE_ARCHITECTURES and config.get("num_experts"):
        hf.update(hf_sigmoid_moe_config(config, arch))
    if arch == "deepseek_v2" and config.get("num_experts"):
        hf.update(hf_softmax_moe_config(config))
    if arch in LATENT_ARCHITECTURES:
        hf.update(hf_latent_attention_config(config, meta.get("hf_config"), arch))
    os.makedirs(out, exist_ok=True)
    write_safetensors(os.path.join(out, "model.safetensors"), hf_tensors, {"format": "pt"})
    write_text(os.path.join(out, "config.json"), json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return arch, config


# ---- command line ----------------------------------------------------------------------------

def mtp_depths(c):
    depths = c.get("mtp_num_layers", 0)
    return f" and {depths} MTP depth{'s' if depths > 1 else ''}" if depths else ""


def note_mtp_layers_absent(hf_dir, arch, c):
    """After an import that kept MTP layers where the weights hold them: says on stderr where
    config.json counts some but the weights held none (transformers' save_pretrained writes
    none), so the model has no multi-token prediction."""
    count = hf_mtp_count(read_hf_config(hf_dir)) if arch in MTP_ARCHITECTURES else 0
    if count and not c.get("mtp_num_layers"):
        print(f"convert_hf.py import: note: config.json says num_nextn_predict_layers {count} "
              f"but the weights hold no model.layers.{c['num_layers']}.* (transformers' "
              "save_pretrained writes none): imported without multi-token prediction "
              "(mtp_num_layers 0)", file=sys.stderr)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="See docs/convert_hf.md.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("import", help="HF directory -> braid checkpoint")
    p.add_argument("--hf-dir", required=True, help="config.json + model.safetensors[.index.json]")
    p.add_argument("--save", required=True, help="checkpoint directory to create")
    p.add_argument("--no-mtp", dest="mtp", action="store_false",
                   help="leave out GLM-4.5's and DeepSeek-V3's multi-token-prediction layers "
                   "(default: import them as braid's MTP depths where the weights hold them)")
    p = sub.add_parser("export", help="braid checkpoint -> HF directory")
    p.add_argument("--load", required=True, help="checkpoint directory (any layout)")
    p.add_argument("--hf-dir", required=True, help="output directory")
    p.add_argument("--ckpt-step", type=int, default=None,
                   help="iteration to export (default: the tracker file's)")
    p.add_argument("--no-mtp", dest="mtp", action="store_false",
                   help="leave out the multi-token-prediction depths (mtp_num_layers): "
                   "num_nextn_predict_layers 0")
    args = parser.parse_args(argv)
    try:
        if args.command == "import":
            where, arch, c = import_hf(args.hf_dir, args.save, args.mtp)
            if args.mtp:
                note_mtp_layers_absent(args.hf_dir, arch, c)
            print(f"imported {arch} ({c['num_layers']} layers{mtp_depths(c)}, hidden "
                  f"{c['hidden_size']}, {c['params_dtype']}) into {where}")
        else:
            arch, c = export_hf(args.load, args.hf_dir, args.ckpt_step, args.mtp)
            print(f"exported {arch} ({c['num_layers']} layers{mtp_depths(c)}, hidden "
                  f"{c['hidden_size']}) to {args.hf_dir}")
    except (ConvertError, SafetensorsError) as e:
        print(f"convert_hf.py {args.command}: error: {e}", file=sys.stderr)
        return 1
    except (KeyError, TypeError) as e:
        print(f"convert_hf.py {args.command}: error: config.json or metadata.json lacks or "
              f"mistypes a field: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
