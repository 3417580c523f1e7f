"""tools/convert_hf.py with DeepSeek-V3's routing: tiny random Dots1ForCausalLM and
Glm4MoeForCausalLM (8 experts in 4 groups, top 4 from the best 2 groups, a random
e_score_correction_bias, an ungated shared expert, the first layer dense) as transformers'
save_pretrained writes them, imported into braid and exported back.

- the round trip is bit-exact (the biases included) and the config equivalent; transformers
  loads the export with no missing or unexpected keys; braid's model of the import computes
  the logits of both the original and the exported HF model
- braid's C++ loads the import (the biases from the checkpoint's tensors) and saves it as the
  import wrote it; a tp 2 x pp 2 re-save exports exactly
- a checkpoint braid trained itself (its biases moved by the bias update) exports as dots1 or
  GLM-4.5, and transformers computes its logits
- what braid's router cannot compute as transformers' does is refused with one line
"""

import json
import re
import shutil

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file

import braid
from convert_test_util import (BIAS, BRAID_ROUTER, HF_ROUTER, assert_mixed_bf16_round_trip,
                               assert_mtp_layers_dropped, assert_resaves_alike,
                               export_with_clear_routing, hf_logits, save_hf)
from test_convert_hf import (IDS, assert_computes_both, assert_configs_agree,
                             assert_exports_exactly, assert_import_refused, assert_same_bits,
                             assert_same_logits, braid_model, convert_hf, hf_weights, imported,
                             load_hf, metadata, resave_at_tp2_pp2, run_tool, save_after_a_step)


def sigmoid_moe(tmp, kind="dots1", layers=3, dtype=torch.float32, seed=3, **extra):
    """A Dots1ForCausalLM or Glm4MoeForCausalLM saved by save_pretrained (save_hf): the first
    layer dense (intermediate_size 160), then HF_ROUTER's experts. `extra`: more config fields.
    `seed`: one whose routing has no near tie on IDS."""
    torch.manual_seed(seed)
    make = {"dots1": (transformers.Dots1Config, transformers.Dots1ForCausalLM),
            "glm4_moe": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM)}[kind]
    fields = dict(
        vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **HF_ROUTER)
    fields.update(extra)
    return save_hf(make[1](make[0](**fields)).eval(), tmp, dtype)


MODELS = {
    "dots1": sigmoid_moe,
    # a window of 5 keys on the last layer (layer_types); tied embeddings; two shared experts
    "dots1-window-tied": lambda d: sigmoid_moe(
        d, sliding_window=5, layer_types=["full_attention"] * 2 + ["sliding_attention"],
        tie_word_embeddings=True, n_shared_experts=2),
    # no groups, top 2, experts on every layer
    "dots1-no-groups": lambda d: sigmoid_moe(d, layers=2, n_group=1, topk_group=1,
                                             num_experts_per_tok=2, first_k_dense_replace=0,
                                             seed=5),
    # GLM-4.5: q, k, v biases, RoPE on half of each head (transformers' default)
    "glm4_moe": lambda d: sigmoid_moe(d, "glm4_moe", attention_bias=True),
    "glm4_moe-qk-norm-quarter-rotary": lambda d: sigmoid_moe(
        d, "glm4_moe", attention_bias=False, use_qk_norm=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25}),
}
CONFIG_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
               "tie_word_embeddings", "attention_bias", "use_qk_norm", "layer_types",
               "sliding_window", "rope_parameters", "n_routed_experts", "num_experts_per_tok",
               "moe_intermediate_size", "n_shared_experts", "first_k_dense_replace", "n_group",
               "topk_group", "norm_topk_prob", "routed_scaling_factor")


def braid_config(c):
    """The TransformerConfig of a checkpoint's metadata config (every field it has; f32)."""
    cfg = braid.TransformerConfig()
    for key, value in c.items():
        if hasattr(cfg, key):
            setattr(cfg, key, value)
    cfg.params_dtype = "f32"
    cfg.validate()
    return cfg


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_round_trip_is_exact_and_logits_match(tmp_path, kind):
    hf_dir, ckpt = imported(tmp_path, kind, MODELS)
    c, hf_cfg = metadata(ckpt)["config"], json.loads((hf_dir / "config.json").read_text())
    groups = hf_cfg["n_group"] > 1
    assert (c["num_experts"], c["moe_router_topk"], c["moe_ffn_hidden_size"]) == (
        8, hf_cfg["num_experts_per_tok"], 32)
    assert (c["moe_router_score_function"], c["moe_router_enable_expert_bias"]) == ("sigmoid", True)
    assert (c["moe_router_num_groups"], c["moe_router_group_topk"]) == (
        (4, 2) if groups else (0, 0))
    assert c["moe_router_topk_scaling_factor"] == 2.5
    # A version-1 reader would route these with a softmax and no bias: version 2.
    assert metadata(ckpt)["format_version"] == 2
    assert (c["moe_shared_expert_intermediate_size"], c["moe_shared_expert_gate"]) == (
        32 * hf_cfg["n_shared_experts"], False)
    assert c["moe_layers"] == ([0, 1, 1] if hf_cfg["first_k_dense_replace"] else [])
    glm = kind.startswith("glm4_moe")
    assert c["qk_layernorm"] == (not glm or hf_cfg["use_qk_norm"])
    assert (c["add_qkv_bias"], c["add_bias_linear"]) == (glm and hf_cfg["attention_bias"], False)
    assert c["rotary_percent"] == {"glm4_moe": 0.5, "glm4_moe-qk-norm-quarter-rotary": 0.25}.get(
        kind, 1.0)
    assert (c["window_size"], c["window_layers"]) == ((4, [0, 0, 1]) if "window" in kind
                                                      else (-1, []))
    index = metadata(ckpt)["tensors"]
    assert index[f"model.layers.1.{BIAS}"] == {
        "shape": [8], "split_dim": -1,
        "shards": [{"file": "mp_rank_00_000.safetensors", "start": 0, "length": 8}]}
    assert (f"model.layers.0.{BIAS}" in index) == (not hf_cfg["first_k_dense_replace"])

    out = tmp_path / "out"
    r = run_tool("export", "--load", ckpt, "--hf-dir", out)
    assert r.returncode == 0, r.stderr
    got, want = hf_weights(out), hf_weights(hf_dir)
    assert want[f"model.layers.1.{BIAS}"].abs().min() > 0  # the biases came through
    assert_same_bits(got, want)
    assert_configs_agree(out, hf_dir, CONFIG_KEYS)
    assert_computes_both(braid_model(ckpt, braid_config), hf_dir, out, hf_logits)


def test_bf16_round_trip_is_exact(tmp_path):
    # Loaded in bf16, transformers keeps the routers and their biases in f32
    # (_keep_in_fp32_modules_strict) and saves them so.
    assert_mixed_bf16_round_trip(
        tmp_path, sigmoid_moe(tmp_path / "f32"),
        f32_names=[f"model.layers.1.{BIAS}", "model.layers.1.mlp.gate.weight"],
        bf16_names=["model.layers.1.self_attn.q_proj.weight"])


def test_an_f32_bias_in_a_bf16_model_keeps_its_dtype(tmp_path):
    # A hub checkpoint: every weight bf16 but the biases f32 (DeepSeek-V3's, dots1's) imports
    # as a bf16 model; a bf16 bias imports as f32 (exact; braid's biases are f32).
    hf_dir = sigmoid_moe(tmp_path / "hf")
    state = {n: t.to(torch.bfloat16) if not n.endswith(BIAS) else t
             for n, t in hf_weights(hf_dir).items()}
    state[f"model.layers.2.{BIAS}"] = state[f"model.layers.2.{BIAS}"].to(torch.bfloat16)
    save_file(state, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    assert run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "ckpt").returncode == 0
    assert metadata(tmp_path / "ckpt")["config"]["params_dtype"] == "bf16"
    _, got = convert_hf.read_checkpoint(str(tmp_path / "ckpt"))
    assert got[f"model.layers.1.{BIAS}"].dtype == got[f"model.layers.2.{BIAS}"].dtype == "F32"
    np.testing.assert_array_equal(got[f"model.layers.2.{BIAS}"].array,
                                  state[f"model.layers.2.{BIAS}"].float().numpy())
    assert got["model.layers.1.mlp.gate.weight"].dtype == "BF16"


def test_braids_loader_reads_the_import_and_saves_it_alike(tmp_path):
    # C++ load_parameters takes the biases from the checkpoint's tensors; save_checkpoint writes
    # the index and the bytes the import wrote.
    hf_dir, ckpt = imported(tmp_path, "dots1", MODELS)
    model = braid.GPTModel(braid_config(metadata(ckpt)["config"]), device="cpu", seed=9)
    braid.load_parameters(str(ckpt), model)
    _, want = convert_hf.read_checkpoint(str(ckpt))
    for name, b in model.expert_biases().items():
        np.testing.assert_array_equal(np.from_dlpack(b), want[name].array, err_msg=name)
    assert_same_logits(model, IDS, hf_logits(load_hf(hf_dir), IDS))
    assert_resaves_alike(model, ckpt, tmp_path / "resaved")


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
@pytest.mark.parametrize("kind", ["dots1", "glm4_moe"])
def test_export_of_a_checkpoint_braid_saved_at_tp2_pp2(tmp_path, kind):
    """braid's C++ loads the import into a tp = 2, pp = 2 job (4 ranks; layer 0 dense and layer
    1's experts on the first stage, layers 2 and 3 on the second; each stage's biases in its
    tp-rank-0 file) and saves it; export reassembles that save bit for bit."""
    hf_dir = sigmoid_moe(tmp_path / "hf", kind, layers=4)
    ckpt = tmp_path / "ckpt"
    assert run_tool("import", "--hf-dir", hf_dir, "--save", ckpt).returncode == 0
    resave_at_tp2_pp2(ckpt, tmp_path / "sharded")
    assert metadata(tmp_path / "sharded")["format_version"] == 2  # braid's C++ says so too
    index = metadata(tmp_path / "sharded")["tensors"]
    for i, stage in ((1, 0), (2, 1), (3, 1)):
        assert index[f"model.layers.{i}.{BIAS}"]["shards"] == [
            {"file": f"mp_rank_00_{stage:03d}.safetensors", "start": 0, "length": 8}]
    assert_exports_exactly(tmp_path / "sharded", tmp_path / "out", hf_dir)


def test_glm_multi_token_prediction_layers_are_dropped(tmp_path):
    # GLM-4.5's checkpoints hold num_nextn_predict_layers layers after the last (model.layers.46
    # of GLM-4.5-Air), which transformers' causal LM does not load: import --no-mtp drops them
    # (test_convert_hf_mtp.py imports them as braid's MTP depths).
    hf_dir, ckpt = imported(tmp_path, "glm4_moe", MODELS)
    assert_mtp_layers_dropped(tmp_path, hf_dir, ckpt, (
        "eh_proj.weight", "enorm.weight", "self_attn.q_proj.weight",
        "mlp.experts.0.up_proj.weight"))


# ---- a checkpoint braid trained ----------------------------------------------------------------

def braid_sigmoid_checkpoint(path, seed=3, **fields):
    """A checkpoint braid saved itself after a training step (save_after_a_step) with the
    expert-bias update on (each bias moved by +-0.02: not zero): 3 layers with q/k norms,
    BRAID_ROUTER's experts. `fields`: more config."""
    cfg = braid.TransformerConfig.preset("llama-tiny")
    cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups = 3, 64, 4, 2
    cfg.ffn_hidden_size, cfg.vocab_size, cfg.max_position_embeddings = 160, 97, 64
    cfg.qk_layernorm = True
    for name, value in {**BRAID_ROUTER, **fields}.items():
        setattr(cfg, name, value)
    return save_after_a_step(cfg, path, seed)


@pytest.mark.parametrize("fields,arch", [
    ({}, "dots1"),
    # a window on the last layer: dots1's layer_types
    ({"window_size": 4, "window_layers": [0, 0, 1]}, "dots1"),
    # GLM-4.5's attention
    ({"qk_layernorm": False, "add_qkv_bias": True, "rotary_percent": 0.5}, "glm4_moe"),
    # no bias (zeros in the export), no groups, two shared experts, top 2
    ({"moe_router_enable_expert_bias": False, "moe_router_num_groups": 0,
      "moe_router_group_topk": 0, "moe_router_topk": 2, "moe_shared_expert_intermediate_size": 64},
     "dots1")])
def test_a_trained_braid_model_exports(tmp_path, fields, arch):
    model, out, hf = export_with_clear_routing(tmp_path, braid_sigmoid_checkpoint, **fields)
    biases = {n: np.from_dlpack(b).copy() for n, b in model.expert_biases().items()}
    assert all(np.abs(b).max() > 0 for b in biases.values())  # moved by the update
    assert hf.config.model_type == arch
    assert (hf.config.n_routed_experts, hf.config.first_k_dense_replace) == (8, 1)
    assert hf.config.routed_scaling_factor == 2.5 and hf.config.norm_topk_prob
    written = hf_weights(out)
    for i in (1, 2):
        bias = written[f"model.layers.{i}.{BIAS}"]
        assert bias.dtype == torch.float32
        np.testing.assert_array_equal(bias.numpy(), biases.get(f"model.layers.{i}.{BIAS}",
                                                               np.zeros(8, np.float32)))
    assert_same_logits(model, IDS, hf_logits(hf, IDS))


# ---- refused -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,changes,words", [
    ("dots1", {"norm_topk_prob": False}, ("norm_topk_prob", "always divides")),
    ("dots1", {"num_experts_per_tok": 1, "n_group": 1, "topk_group": 1},
     ("norm_topk_prob", "makes every weight 1")),
    ("dots1", {"topk_group": 1}, ("n_group", "num_experts_per_tok is 4 and topk_group 1")),
    ("dots1", {"num_experts_per_tok": 5}, ("n_group", "num_experts_per_tok is 5 and topk_group 2")),
    ("dots1", {"n_group": 3}, ("n_group should divide n_routed_experts 8",)),
    ("dots1", {"topk_group": 5}, ("topk_group should be in [1, 4]",)),
    ("dots1", {"first_k_dense_replace": 3}, ("first_k_dense_replace", "no layer of the 3")),
    ("dots1", {"n_shared_experts": 0}, ("n_shared_experts should be a positive integer",)),
    ("dots1", {"n_shared_experts": 2}, ("model.layers.1.mlp.shared_expert.gate_proj.weight",
                                        "[32, 64]", "[64, 64]")),
    ("dots1", {"attention_bias": True}, ("attention_bias", "q, k, v and o")),
    ("dots1", {"partial_rotary_factor": 0.5}, ("partial_rotary_factor", "whole head")),
    ("dots1", {"layer_types": ["full_attention"] * 2 + ["sliding_attention"],
               "sliding_window": None}, ("layer_types", "sliding_window is null")),
    ("glm4_moe", {"first_k_dense_replace": 0}, ("the HF weights have no "
                                               "model.layers.0.mlp.experts.0.gate_proj.weight",)),
])
def test_refuses_what_braid_cannot_hold(tmp_path, kind, changes, words):
    assert_import_refused(sigmoid_moe(tmp_path / "hf", kind), changes, words, tmp_path / "c")


def test_export_chooses_dots1_or_glm4_moe_or_refuses():
    c = {"normalization": "rmsnorm", "activation": "swiglu", "position_embedding": "rope",
         "add_bias_linear": False, "add_qkv_bias": False, "qk_layernorm": True,
         "rotary_percent": 1.0, "num_layers": 3, "num_experts": 8, "moe_router_topk": 4,
         "moe_ffn_hidden_size": 32, "ffn_hidden_size": 160, "moe_router_pre_softmax": False,
         "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
         "moe_router_num_groups": 4, "moe_router_group_topk": 2,
         "moe_router_topk_scaling_factor": 2.5, "moe_shared_expert_intermediate_size": 32,
         "moe_shared_expert_gate": False, "moe_layers": [0, 1, 1], "window_size": -1,
         "window_layers": [], "hidden_size": 64, "num_attention_heads": 4,
         "num_query_groups": 2, "kv_channels": 16}
    arch = convert_hf.sigmoid_moe_architecture
    assert arch(c) == "dots1"
    assert arch(dict(c, window_size=4, window_layers=[0, 1, 0])) == "dots1"
    assert arch(dict(c, moe_layers=[])) == "dots1"
    assert arch(dict(c, moe_router_enable_expert_bias=False)) == "dots1"  # zero biases
    assert arch(dict(c, qk_layernorm=False)) == "glm4_moe"
    assert arch(dict(c, add_qkv_bias=True, rotary_percent=0.5)) == "glm4_moe"
    assert arch(dict(c, moe_router_num_groups=1, moe_router_group_topk=1)) == "dots1"
    refusals = [
        (dict(c, moe_shared_expert_gate=True), "gates its shared expert"),
        (dict(c, moe_shared_expert_intermediate_size=0), "no shared expert"),
        (dict(c, moe_shared_expert_intermediate_size=48), "not a multiple of the experts' 32"),
        (dict(c, moe_layers=[1, 0, 1]), "dense layers after expert ones"),
        (dict(c, moe_router_group_topk=1), "its best moe_router_topk / group_topk = 4 / 1"),
        (dict(c, add_bias_linear=True), "biases on every linear layer"),
        (dict(c, normalization="layernorm"), "layernorm/swiglu/rope shaped"),
        (dict(c, add_qkv_bias=True, window_size=4), "sliding window but q, k, v biases"),
        (dict(c, rotary_percent=0.5, window_size=4), "sliding window but RoPE on a part"),
    ]
    for config, words in refusals:
        with pytest.raises(convert_hf.ConvertError, match=re.escape(words)):
            arch(config)
    # softmax routers (Mixtral, the Qwens) have neither groups nor a scaling factor
    softmax = dict(c, moe_router_score_function="softmax", moe_router_enable_expert_bias=False,
                   moe_router_topk_scaling_factor=1.0, moe_shared_expert_intermediate_size=0,
                   moe_layers=[])
    assert convert_hf.moe_architecture(dict(softmax, moe_router_num_groups=0)) == "qwen3_moe"
    with pytest.raises(convert_hf.ConvertError, match="picks experts from groups"):
        convert_hf.moe_architecture(softmax)
    with pytest.raises(convert_hf.ConvertError, match="scales the weights by 2.5"):
        convert_hf.moe_architecture(dict(softmax, moe_router_num_groups=0,
                                         moe_router_topk_scaling_factor=2.5))
