"""tools/convert_hf.py with mixtures of experts: tiny random MixtralForCausalLM,
Qwen2MoeForCausalLM and Qwen3MoeForCausalLM (4 experts, top 2) as transformers' save_pretrained
writes them (one tensor per expert on disk: Mixtral's block_sparse_moe.experts.{j}.w1/w3/w2, the
Qwens' mlp.experts.{j}.gate_proj/up_proj/down_proj; Qwen2-MoE's mlp.shared_expert.* and
mlp.shared_expert_gate.weight), imported into braid and exported back.

- the round trip is bit-exact and the config equivalent; transformers loads the export with no
  missing or unexpected keys; braid's model of the import computes the logits of both the
  original and the exported HF model
- dense layers among expert ones (Qwen3-MoE's mlp_only_layers, Qwen2-MoE's decoder_sparse_step)
  import as braid's moe_layers and export as mlp_only_layers; transformers builds the same
  layers from either
- transformers 5's fused in-memory layout ([E, 2F, H] / [E, H, F] per layer) imports to the
  same tensors; a hub-style config (num_experts) imports
- a checkpoint braid trained and saved itself exports as Mixtral, Qwen3-MoE (norm_topk_prob
  false for moe_router_pre_softmax) or, with a gated shared expert, Qwen2-MoE (q, k, v biases of
  zero where it has none), the two Qwens also with a dense layer among expert ones (refused as
  Mixtral, which has none), and transformers computes its logits
- what braid cannot hold is refused with one line
"""

import json
import os
import shutil

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file

import braid
from convert_test_util import assert_bf16_round_trip
from hf_oracle import moe_routers
from test_convert_hf import (IDS, assert_computes_both, assert_configs_agree,
                             assert_exports_exactly, assert_fails, assert_import_refused,
                             assert_same_bits, assert_same_logits, braid_model, convert_hf,
                             edit_config, hf_weights, imported, load_hf, metadata, perturb,
                             resave_at_tp2_pp2, run_tool, save_after_a_step)


def mixtral(tmp, sliding_window=None, tie=False, dtype=torch.float32):
    torch.manual_seed(7)
    cfg = transformers.MixtralConfig(
        vocab_size=97, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5,
        sliding_window=sliding_window, tie_word_embeddings=tie)
    model = moe_routers(transformers.MixtralForCausalLM(cfg).eval())
    perturb(model)
    model.to(dtype).save_pretrained(tmp)
    return tmp


def qwen3_moe(tmp, norm_topk_prob=True, head_dim=16, layers=2, seed=8, **extra):
    """Qwen3-MoE; head_dim other than hidden / heads (16) is braid's kv_channels. `extra`:
    use_sliding_window and sliding_window (every layer, as transformers 5 builds it),
    mlp_only_layers (dense MLPs of intermediate_size 160). `seed`: one whose routing has no
    near tie on IDS."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=97, hidden_size=64, intermediate_size=160, moe_intermediate_size=48,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **extra)
    model = moe_routers(transformers.Qwen3MoeForCausalLM(cfg).eval())
    perturb(model)
    model.save_pretrained(tmp)
    return tmp


def qwen2_moe(tmp, norm_topk_prob=False, qkv_bias=True, layers=2, **extra):
    """Qwen2-MoE: q, k, v biases (qkv_bias), 4 experts of 48 and a shared expert of 96 behind its
    sigmoid gate. `extra`: use_sliding_window and sliding_window (on the layers layer_types,
    which transformers 5 fills in and writes, names), decoder_sparse_step (dense MLPs of
    intermediate_size 160 between)."""
    torch.manual_seed(16)  # a seed whose routing has no near tie on IDS
    cfg = transformers.Qwen2MoeConfig(
        vocab_size=97, hidden_size=64, intermediate_size=160, moe_intermediate_size=48,
        shared_expert_intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob, qkv_bias=qkv_bias, rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **extra)
    model = moe_routers(transformers.Qwen2MoeForCausalLM(cfg).eval())
    perturb(model)
    with torch.no_grad():  # the shared expert's gate away from sigmoid's linear middle
        for layer in model.model.layers:
            if hasattr(layer.mlp, "shared_expert_gate"):
                layer.mlp.shared_expert_gate.weight.normal_(0.0, 0.2)
    model.save_pretrained(tmp)
    return tmp


MODELS = {
    "mixtral": mixtral,
    # Mistral v0.1's window (here 5 keys) on every layer, and tied embeddings.
    "mixtral-tied-sliding-window": lambda d: mixtral(d, sliding_window=5, tie=True),
    "qwen3_moe-norm-topk": qwen3_moe,
    "qwen3_moe-softmax-first-wide-heads": lambda d: qwen3_moe(d, norm_topk_prob=False,
                                                             head_dim=32),
    "qwen3_moe-sliding-window": lambda d: qwen3_moe(d, use_sliding_window=True,
                                                   sliding_window=5),
    "qwen2_moe-softmax-first": qwen2_moe,
    # transformers 5 windows the first of the two layers (layer_types on disk)
    "qwen2_moe-norm-topk-sliding-window": lambda d: qwen2_moe(
        d, norm_topk_prob=True, use_sliding_window=True, sliding_window=5),
    # dense layers among expert ones: layer 0 (mlp_only_layers); layers 0 and 2 (every second
    # layer has experts)
    "qwen3_moe-mlp-only-layers": lambda d: qwen3_moe(d, layers=3, mlp_only_layers=[0], seed=12),
    "qwen2_moe-sparse-step-2": lambda d: qwen2_moe(d, layers=4, decoder_sparse_step=2),
}
MOE_LAYERS = {"qwen3_moe-mlp-only-layers": [0, 1, 1], "qwen2_moe-sparse-step-2": [0, 1, 0, 1]}
MOE_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
            "tie_word_embeddings", "sliding_window", "use_sliding_window", "num_local_experts",
            "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "rope_parameters",
            "shared_expert_intermediate_size", "qkv_bias", "layer_types")


def mixtral_default_head_dim(key, got, want, want_config):
    """Mixtral's head_dim null means hidden / heads, which export writes out."""
    if key == "head_dim" and want is None:
        want = want_config.hidden_size // want_config.num_attention_heads
    return got, want


def hf_logits(hf, ids):
    """HF's logits; the router's k-th and (k+1)-th choices of every token are apart, so braid,
    whose logits agree to ~1e-6, chooses the same experts."""
    with torch.no_grad():
        out = hf(torch.from_numpy(ids), output_router_logits=True)
    for logits in out.router_logits:
        top = torch.topk(logits, 3, dim=-1).values
        assert (top[:, 1] - top[:, 2]).min() > 1e-3
    return out.logits.numpy()


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_round_trip_is_exact_and_logits_match(tmp_path, kind):
    hf_dir, ckpt = imported(tmp_path, kind, MODELS)
    c = metadata(ckpt)["config"]
    hf_cfg = json.loads((hf_dir / "config.json").read_text())
    assert (c["num_experts"], c["moe_router_topk"], c["moe_ffn_hidden_size"]) == (4, 2, 48)
    assert c["moe_router_pre_softmax"] == (not hf_cfg.get("norm_topk_prob", True))
    assert c["qk_layernorm"] == kind.startswith("qwen3_moe")
    assert c["window_size"] == (4 if "sliding" in kind else -1)
    qwen2 = kind.startswith("qwen2_moe")
    assert c["add_qkv_bias"] == qwen2
    assert (c.get("moe_shared_expert_intermediate_size", 0),
            c.get("moe_shared_expert_gate", False)) == ((96, True) if qwen2 else (0, False))
    if qwen2 and "sliding" in kind:
        assert c["window_layers"] == [1, 0]
    assert c["moe_layers"] == MOE_LAYERS.get(kind, [])
    assert c["ffn_hidden_size"] == (48 if kind.startswith("mixtral") else 160)  # dense layers'
    out = tmp_path / "out"
    assert_exports_exactly(ckpt, out, hf_dir)
    assert_configs_agree(out, hf_dir, MOE_KEYS, mixtral_default_head_dim)
    exported = json.loads((out / "config.json").read_text())
    if not kind.startswith("mixtral"):
        dense = [i for i, e in enumerate(MOE_LAYERS.get(kind, [])) if not e]
        assert (exported["mlp_only_layers"], exported["decoder_sparse_step"]) == (dense, 1)

    # Export writes the dense layers as mlp_only_layers with decoder_sparse_step 1: an import's
    # decoder_sparse_step 2 comes back as other fields that build the same layers.
    assert_computes_both(braid_model(ckpt), hf_dir, out, hf_logits)


def fused_dir(hf_dir, dst):
    """`hf_dir` with its weights as transformers 5 holds them in memory (the experts of a layer
    fused, Mixtral's block_sparse_moe named mlp), saved as they are."""
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    dst.mkdir()
    state = {n: t.contiguous() for n, t in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(hf_dir / "config.json", dst / "config.json")
    return dst


@pytest.mark.parametrize("kind", ["mixtral-tied-sliding-window", "qwen3_moe-norm-topk",
                                  "qwen2_moe-softmax-first"])
def test_fused_experts_import_as_the_per_expert_layout(tmp_path, kind):
    hf_dir, ckpt = imported(tmp_path, kind, MODELS)
    fused = fused_dir(hf_dir, tmp_path / "fused")
    r = run_tool("import", "--hf-dir", fused, "--save", tmp_path / "ckpt2")
    assert r.returncode == 0, r.stderr
    _, want = convert_hf.read_checkpoint(str(ckpt))
    _, got = convert_hf.read_checkpoint(str(tmp_path / "ckpt2"))
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype
        np.testing.assert_array_equal(got[name].array, want[name].array, err_msg=name)


def test_bf16_round_trip_is_exact(tmp_path):
    assert_bf16_round_trip(tmp_path, mixtral(tmp_path / "hf", dtype=torch.bfloat16))


def test_hub_style_configs(tmp_path):
    # Qwen3-MoE's hub configs name the count num_experts (transformers 5 writes
    # num_local_experts); a Mixtral config without rope_theta means transformers' 1e6.
    hf_dir = qwen3_moe(tmp_path / "q")
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["num_experts"] = cfg.pop("num_local_experts")
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    assert run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "c1").returncode == 0
    assert metadata(tmp_path / "c1")["config"]["num_experts"] == 4
    hf_dir = mixtral(tmp_path / "m")
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg.pop("rope_parameters")
    cfg.pop("rope_theta", None)
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    assert transformers.AutoConfig.from_pretrained(hf_dir).rope_parameters["rope_theta"] == 1e6
    assert run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "c2").returncode == 0
    assert metadata(tmp_path / "c2")["config"]["rope_theta"] == 1e6


def braid_moe_checkpoint(path, qk_layernorm, pre_softmax, **fields):
    """A checkpoint braid saved itself after one training step (aux loss on), its routers (and
    shared experts' gates) widened first (as the HF models') so that no token's routing is near
    a tie. `fields`: more config (a shared expert, q, k, v biases)."""
    cfg = braid.TransformerConfig.preset("llama-tiny")
    cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups = 2, 64, 4, 2
    cfg.ffn_hidden_size, cfg.vocab_size, cfg.max_position_embeddings = 160, 97, 64
    cfg.num_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size = 4, 2, 48
    cfg.qk_layernorm, cfg.moe_router_pre_softmax, cfg.moe_aux_loss_coeff = (
        qk_layernorm, pre_softmax, 0.01)
    for name, value in fields.items():
        setattr(cfg, name, value)
    return save_after_a_step(cfg, path, 3, ("mlp.gate.weight", "shared_expert_gate.weight"))


SHARED = {"moe_shared_expert_intermediate_size": 32, "moe_shared_expert_gate": True}


@pytest.mark.parametrize("qk_layernorm,pre_softmax,fields,arch", [
    (False, False, {}, "mixtral"), (True, False, {}, "qwen3_moe"), (True, True, {}, "qwen3_moe"),
    # q, k, v biases of zero in the export
    (False, True, SHARED, "qwen2_moe"),
    (False, False, dict(SHARED, add_qkv_bias=True), "qwen2_moe"),
    # a dense layer (ffn_hidden_size 160) among expert ones: mlp_only_layers
    (True, False, {"moe_layers": [0, 1]}, "qwen3_moe"),
    (False, True, dict(SHARED, moe_layers=[1, 0]), "qwen2_moe")])
def test_a_trained_braid_moe_exports(tmp_path, qk_layernorm, pre_softmax, fields, arch):
    model = braid_moe_checkpoint(tmp_path / "ckpt", qk_layernorm, pre_softmax, **fields)
    out = tmp_path / "out"
    r = run_tool("export", "--load", tmp_path / "ckpt", "--hf-dir", out)
    assert r.returncode == 0, r.stderr
    hf = load_hf(out)
    assert hf.config.model_type == arch
    assert hf.config.num_experts_per_tok == 2
    assert (hf.config.num_experts if arch == "qwen2_moe" else hf.config.num_local_experts) == 4
    if arch == "mixtral":
        assert hf.config.intermediate_size == 48
    else:
        assert hf.config.moe_intermediate_size == 48
        assert hf.config.norm_topk_prob == (not pre_softmax)
        dense = [i for i, e in enumerate(fields.get("moe_layers", [1, 1])) if not e]
        assert (hf.config.mlp_only_layers, hf.config.decoder_sparse_step) == (dense, 1)
        assert hf.config.intermediate_size == 160
        for i in dense:
            assert hf.model.layers[i].mlp.down_proj.weight.shape == (64, 160)
    if arch == "qwen2_moe":
        assert hf.config.shared_expert_intermediate_size == 32
        bias = hf.model.layers[0].self_attn.q_proj.bias
        assert bool(bias.any()) == bool(fields.get("add_qkv_bias"))
    assert_same_logits(model, IDS, hf_logits(hf, IDS))


def test_a_braid_moe_with_dense_layers_and_no_qk_norms_is_not_mixtral(tmp_path):
    # Mixtral has experts on every layer; without q/k norms (Qwen3-MoE) or a shared expert
    # (Qwen2-MoE) no HF model holds a dense layer among expert ones.
    braid_moe_checkpoint(tmp_path / "ckpt", False, False, moe_layers=[0, 1])
    assert_fails(run_tool("export", "--load", tmp_path / "ckpt", "--hf-dir", tmp_path / "out"),
                 "experts on some layers only (moe_layers)",
                 "MixtralForCausalLM has experts on every layer")
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
@pytest.mark.parametrize("kind", ["qwen3_moe-softmax-first-wide-heads", "qwen2_moe-softmax-first",
                                  "qwen2_moe-sparse-step-2"])
def test_export_of_a_checkpoint_braid_saved_at_tp2_pp2(tmp_path, kind):
    """braid's C++ loads the import into a tp = 2, pp = 2 job (4 ranks; each expert's and the
    shared expert's columns split like a dense MLP's, the router and the shared expert's gate
    replicated; with decoder_sparse_step 2 a dense and an expert layer on each stage) and saves
    it; export reassembles that save bit for bit."""
    hf_dir, ckpt = imported(tmp_path, kind, MODELS)
    resave_at_tp2_pp2(ckpt, tmp_path / "sharded")
    assert len(os.listdir(tmp_path / "sharded" / "iter_0000000")) == 5
    assert_exports_exactly(tmp_path / "sharded", tmp_path / "out", hf_dir)


# ---- refused ---------------------------------------------------------------------------------

@pytest.mark.parametrize("make,changes,words", [
    # a config whose dense layers the weights do not have
    (qwen3_moe, {"mlp_only_layers": [1]}, ("the HF weights have no "
                                           "model.layers.1.mlp.gate_proj.weight",)),
    (qwen2_moe, {"decoder_sparse_step": 2}, ("the HF weights have no "
                                             "model.layers.0.mlp.gate_proj.weight",)),
    (qwen3_moe, {"mlp_only_layers": [0, 1]}, ("mlp_only_layers", "no layer has experts")),
    (qwen2_moe, {"decoder_sparse_step": 3}, ("decoder_sparse_step", "no layer has experts")),
    (qwen2_moe, {"decoder_sparse_step": 0}, ("decoder_sparse_step", "positive integer")),
    (qwen3_moe, {"mlp_only_layers": "0"}, ("mlp_only_layers", "list of layer numbers")),
    (qwen2_moe, {"shared_expert_intermediate_size": 64}, (
        "model.layers.0.mlp.shared_expert.gate_proj.weight", "[96, 64]", "[64, 64]")),
    (qwen2_moe, {"shared_expert_intermediate_size": 0}, ("shared_expert_intermediate_size",
                                                         "positive integer")),
    (qwen2_moe, {"qkv_bias": False}, ("unexpected tensor", "self_attn.k_proj.bias")),
    (qwen3_moe, {"attention_bias": True}, ("attention_bias", "not supported")),
    (mixtral, {"num_experts_per_tok": 5}, ("num_experts_per_tok", "[1, 4]")),
    (mixtral, {"num_local_experts": 5}, ("model.layers.0.block_sparse_moe.experts.4.w1.weight",)),
    (mixtral, {"intermediate_size": 32}, ("model.layers.0.mlp.experts.0.gate_proj.weight",
                                          "[48, 64]", "[32, 64]")),
])
def test_refuses_what_braid_cannot_hold(tmp_path, make, changes, words):
    assert_import_refused(make(tmp_path / "hf"), changes, words, tmp_path / "c")


def test_export_refuses_an_moe_with_no_hf_counterpart():
    c = {"normalization": "rmsnorm", "activation": "swiglu", "position_embedding": "rope",
         "add_bias_linear": False, "add_qkv_bias": False, "qk_layernorm": False,
         "num_layers": 2, "num_experts": 4, "moe_router_topk": 2, "moe_router_pre_softmax": False,
         "window_size": -1, "window_layers": [], "hidden_size": 64, "num_attention_heads": 4,
         "num_query_groups": 2, "kv_channels": 16}
    arch = convert_hf.moe_architecture
    assert arch(c) == "mixtral"
    assert arch(dict(c, window_size=4)) == "mixtral"
    assert arch(dict(c, qk_layernorm=True, moe_router_pre_softmax=True)) == "qwen3_moe"
    with pytest.raises(convert_hf.ConvertError, match="Mixtral.* renormalises"):
        arch(dict(c, moe_router_pre_softmax=True))
    with pytest.raises(convert_hf.ConvertError, match="experts and biases"):
        arch(dict(c, add_qkv_bias=True))
    with pytest.raises(convert_hf.ConvertError, match="window on some layers only"):
        arch(dict(c, window_size=4, window_layers=[1, 0]))
    with pytest.raises(convert_hf.ConvertError, match="stablelm shaped"):
        arch(dict(c, normalization="layernorm"))
    # Dense layers among expert ones: Qwen3-MoE with q/k norms (mlp_only_layers), never Mixtral.
    assert arch(dict(c, moe_layers=[1, 1])) == "mixtral"
    assert arch(dict(c, qk_layernorm=True, moe_layers=[0, 1])) == "qwen3_moe"
    with pytest.raises(convert_hf.ConvertError, match="MixtralForCausalLM has experts on every"):
        arch(dict(c, moe_layers=[0, 1]))
    # A shared expert: Qwen2-MoE, under either router, with q, k, v biases or none, windowed on
    # any layers; refused ungated, with q/k norms or with biases on every linear layer.
    s = dict(c, moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True)
    assert arch(s) == "qwen2_moe"
    assert arch(dict(s, moe_router_pre_softmax=True, add_qkv_bias=True)) == "qwen2_moe"
    assert arch(dict(s, window_size=4, window_layers=[1, 0])) == "qwen2_moe"
    assert arch(dict(s, moe_layers=[1, 0])) == "qwen2_moe"
    with pytest.raises(convert_hf.ConvertError, match="shared expert without a gate"):
        arch(dict(s, moe_shared_expert_gate=False))
    with pytest.raises(convert_hf.ConvertError, match="shared expert and q/k norms"):
        arch(dict(s, qk_layernorm=True))
    with pytest.raises(convert_hf.ConvertError, match="biases on every linear layer"):
        arch(dict(s, add_bias_linear=True))
    with pytest.raises(convert_hf.ConvertError, match="shared expert and is stablelm shaped"):
        arch(dict(s, normalization="layernorm"))


def test_qwen2_moe_without_qkv_biases_exports_zero_biases(tmp_path):
    # qkv_bias false (transformers 5's switch) imports without biases; export writes them as
    # zeros (transformers 4 always builds them), the same model.
    hf_dir = qwen2_moe(tmp_path / "hf", qkv_bias=False)
    assert run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "ckpt").returncode == 0
    assert metadata(tmp_path / "ckpt")["config"]["add_qkv_bias"] is False
    out = tmp_path / "out"
    r = run_tool("export", "--load", tmp_path / "ckpt", "--hf-dir", out)
    assert r.returncode == 0, r.stderr
    got, want = hf_weights(out), hf_weights(hf_dir)
    biases = {n for n in got if n.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))}
    assert len(biases) == 6 and not any(got[n].any() for n in biases)
    assert_same_bits({n: t for n, t in got.items() if n not in biases}, want)
    hf = load_hf(out)
    assert hf.config.qkv_bias
    model = braid_model(tmp_path / "ckpt")
    assert_same_logits(model, IDS, hf_logits(hf, IDS))
    assert_same_logits(model, IDS, hf_logits(load_hf(hf_dir), IDS))


def test_qwen2_moe_windows_where_transformers_puts_them(tmp_path):
    # Without layer_types, transformers 5 windows Qwen2-MoE's even layers below
    # max_window_layers (Qwen2's windows those from it on); import reads it so. Export writes
    # layer_types.
    hf_dir = qwen2_moe(tmp_path / "hf")
    edit_config(hf_dir, use_sliding_window=True, sliding_window=5, layer_types=None)
    for max_window_layers, want in ((28, [1, 0]), (1, [1, 0]), (0, [0, 0])):
        edit_config(hf_dir, max_window_layers=max_window_layers)
        layer_types = transformers.AutoConfig.from_pretrained(hf_dir).layer_types
        assert [int(k == "sliding_attention") for k in layer_types] == want
        shutil.rmtree(tmp_path / "c", ignore_errors=True)
        assert run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "c").returncode == 0
        c = metadata(tmp_path / "c")["config"]
        assert (c["window_size"], c["window_layers"]) == ((4, want) if any(want) else (-1, []))
    edit_config(hf_dir, use_sliding_window=False, layer_types=["sliding_attention"] * 2)
    assert_fails(run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "d"), "layer_types",
                 "use_sliding_window is false")
