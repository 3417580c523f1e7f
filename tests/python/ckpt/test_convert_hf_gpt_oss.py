"""tools/convert_hf.py with GPT-OSS: tiny random GptOssForCausalLM (4 experts of 64, top 2, biases
everywhere, attention sinks drawn wide, windows of 5 positions on alternate layers, GPT-OSS's YaRN
with truncate false, a clamp low enough to bite) as transformers' save_pretrained writes them
(the experts fused: gate_up_proj [E, H, 2F] with gate and up in alternate columns), imported into
braid and exported back; and the same checkpoint with its experts in MXFP4, as openai's are.

- the round trip is bit-exact and the config equivalent; the checkpoint is format version 7;
  transformers loads the export; braid's model of the import computes the logits of both the
  original and the exported HF model; braid's C++ loads the import and saves it alike, and its
  tp 2 x pp 2 re-save exports exactly
- the MXFP4 dequantizer is transformers' (random packed data, f32 and bf16); a checkpoint packed
  by this file's packer imports to the tensors of the unpacked one, and transformers' own MXFP4
  loader reads it as the same model
- a braid model with off-by-one sinks exports with sinks of 0; a checkpoint braid trained exports
  and transformers computes its logits
- openai/gpt-oss-20b's config.json maps to braid's config; what braid cannot hold is refused
"""

import json
import os
import shutil
import sys

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

import braid
from braid.generate import config_from_metadata
from convert_test_util import assert_bf16_round_trip, assert_resaves_alike
from test_convert_hf import (IDS, LOGITS_RTOL, ROOT, assert_configs_agree, assert_fails,
                             assert_import_refused, assert_same_bits, braid_model, convert_hf,
                             edit_config, hf_weights, imported, load_hf, metadata, perturb,
                             resave_at_tp2_pp2, run_tool, save_after_a_step)

sys.path.insert(0, os.path.join(ROOT, "tools"))
from hf_configs import ConvertError  # noqa: E402
from hf_gpt_oss import (E2M1, dequantize_mxfp4_experts, gpt_oss_architecture,  # noqa: E402
                        gpt_oss_config_from_hf, mxfp4_dequantize)
from safetensors_numpy import Tensor  # noqa: E402

MARGIN = 1e-3  # the least gap between a token's k-th and (k+1)-th router logits
# GPT-OSS's YaRN (openai/gpt-oss-20b's rope_scaling): unrounded correction range
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}
EXPERTS = ("gate_up_proj", "down_proj")
CONFIG_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size",
               "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
               "num_local_experts", "num_experts_per_tok", "swiglu_alpha", "swiglu_limit",
               "sliding_window", "layer_types", "rope_parameters", "router_aux_loss_coef")


def packed_experts(rng, experts, rows, columns):
    """Random MXFP4 blocks and scales of an [experts, rows, columns] matrix, the scales near
    2^-6 (values up to 6 / 32, as wide as an expert's weights need to be to reach the clamp)."""
    blocks = rng.integers(0, 256, size=(experts, rows, columns // 32, 16), dtype=np.uint8)
    scales = rng.integers(119, 123, size=(experts, rows, columns // 32), dtype=np.uint8)
    return torch.from_numpy(blocks), torch.from_numpy(scales)


def randomize(model, seed):
    """Weights that make every part matter: biases and norms off their init (perturb), sinks of
    a few units (as large as the scores), q and k wide enough for RoPE and the windows to change
    the scores, routers wide (no near ties), the experts' matrices MXFP4 values (transformers'
    dequantization of random blocks: the MXFP4 variant holds the same model)."""
    perturb(model)
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.sinks.normal_(0.0, 1.5)
            attn.q_proj.weight.normal_(0.0, 0.2)
            attn.k_proj.weight.normal_(0.0, 0.2)
            mlp.router.weight.normal_(0.0, 0.3)
            mlp.router.bias.normal_(0.0, 0.3)
            for name in EXPERTS:
                param = getattr(mlp.experts, name)
                experts, columns, rows = param.shape
                param.copy_(convert_moe_packed_tensors(*packed_experts(rng, experts, rows,
                                                                       columns),
                                                       dtype=torch.float32))
    return model


def gpt_oss(tmp, layers=4, dtype=torch.float32, seed=11, **extra):
    """A GptOssForCausalLM saved by save_pretrained: hidden 64, 4 heads of 16, 2 key/value heads,
    4 experts of 64, top 2, sliding windows of 5 on the even layers (transformers' default
    layer_types), GPT-OSS's YaRN, swiglu_limit 0.25 (the clamp bites). `extra`: more config.
    `seed`: one whose routing has no near tie on IDS."""
    torch.manual_seed(seed)
    cfg = transformers.GptOssConfig(**{**dict(
        vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=131072,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=5, swiglu_limit=0.25,
        rms_norm_eps=1e-5, tie_word_embeddings=False, rope_parameters=YARN), **extra})
    model = randomize(transformers.GptOssForCausalLM(cfg).eval(), seed)
    model.to(dtype).save_pretrained(tmp)
    return tmp


MODELS = {
    "gpt_oss": gpt_oss,
    # tied, plain RoPE, no window, the clamp openai's checkpoints have
    "tied-plain-rope": lambda d: gpt_oss(d, layers=2, tie_word_embeddings=True, swiglu_limit=7.0,
                                         layer_types=["full_attention"] * 2, rope_parameters={
                                             "rope_type": "default", "rope_theta": 150000.0}),
}


def hf_logits(hf, ids=IDS):
    """HF's logits of `ids`, checking that no token's top k experts are near a tie (braid's
    router logits agree to ~1e-6, so braid chooses the same experts)."""
    with torch.no_grad():
        out = hf(torch.from_numpy(ids), output_router_logits=True)
    k = hf.config.num_experts_per_tok
    margin = min((top[:, k - 1] - top[:, k]).min().item() for top in (
        torch.sort(x, dim=-1, descending=True).values for x in out.router_logits))
    assert margin > MARGIN, f"a near tie in the routing ({margin:.1e})"
    return out.logits.numpy()


def assert_computes(model, hf, what):
    """braid's `model` computes the HF model's logits of IDS (hf_logits) within LOGITS_RTOL of
    their largest; prints the difference."""
    want = hf_logits(hf)
    got = np.from_dlpack(model.logits(IDS))
    assert got.shape == want.shape
    err = np.abs(got.astype(np.float64) - want).max() / np.abs(want).max()
    print(f"{what}: braid vs transformers logits, max relative difference {err:.1e}")
    assert err <= LOGITS_RTOL, err


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_round_trip_is_exact_and_logits_match(tmp_path, kind):
    hf_dir, ckpt = imported(tmp_path, kind, MODELS)
    meta, hf_cfg = metadata(ckpt), json.loads((hf_dir / "config.json").read_text())
    c = meta["config"]
    # a version-6 reader would run another softmax and activation
    assert meta["format_version"] == 7
    assert (c["activation"], c["softmax_type"], c["glu_linear_offset"], c["activation_clamp"]) == (
        "quick_geglu", "learnable", 1.0, hf_cfg["swiglu_limit"])
    assert (c["num_experts"], c["moe_router_topk"], c["moe_ffn_hidden_size"],
            c["moe_router_pre_softmax"], c["add_bias_linear"]) == (4, 2, 64, False, True)
    assert (c["kv_channels"], c["num_query_groups"]) == (16, 2)
    if kind == "gpt_oss":
        assert (c["window_size"], c["window_layers"]) == (4, [1, 0, 1, 0])
        assert (c["rope_yarn_factor"], c["rope_yarn_truncate"], c["rope_yarn_mscale"],
                c["rope_yarn_mscale_all_dim"], c["rope_original_max_position_embeddings"]) == (
            32.0, False, 1.0, 0.0, 4096)
    else:
        assert (c["window_size"], c["rope_yarn_factor"], c["tie_embeddings"]) == (-1, 0.0, True)
    index = meta["tensors"]
    p = "model.layers.0."
    assert index[p + "self_attn.sinks"]["shape"] == [4] and \
        index[p + "self_attn.sinks"]["split_dim"] == 0
    assert index[p + "mlp.gate.bias"]["shape"] == [4]
    assert index[p + "mlp.experts.3.gate_proj.weight"]["shape"] == [64, 64]
    assert index[p + "mlp.experts.3.down_proj.bias"]["shape"] == [64]

    # braid's gate and up are the even and odd columns of HF's fused gate_up_proj
    _, tensors = convert_hf.read_checkpoint(str(ckpt))
    gate_up = hf_weights(hf_dir)[p + "mlp.experts.gate_up_proj"].numpy()
    np.testing.assert_array_equal(tensors[p + "mlp.experts.1.gate_proj.weight"].array,
                                  gate_up[1][:, 0::2].T)
    np.testing.assert_array_equal(tensors[p + "mlp.experts.1.up_proj.weight"].array,
                                  gate_up[1][:, 1::2].T)

    out = tmp_path / "out"
    r = run_tool("export", "--load", ckpt, "--hf-dir", out)
    assert r.returncode == 0, r.stderr
    assert_same_bits(hf_weights(out), hf_weights(hf_dir))
    assert_configs_agree(out, hf_dir, CONFIG_KEYS)
    model = braid_model(ckpt)
    assert_computes(model, load_hf(hf_dir), f"{kind} import")
    assert_computes(model, load_hf(out), f"{kind} export")


def test_the_test_model_exercises_every_part(tmp_path):
    """The sinks, the interleaving of gate and up, the clamp, the untruncated YaRN and the
    windows each change transformers' logits by more than ten times the tests' tolerance (so a
    braid model that got one wrong would fail the tests above)."""
    hf_dir = gpt_oss(tmp_path / "hf")
    want = hf_logits(load_hf(hf_dir))

    def changed(edit=None, **config):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            hf_dir, attn_implementation="eager", **config).eval()
        with torch.no_grad():
            if edit:
                edit(model)
            got = model(torch.from_numpy(IDS)).logits.numpy()
        return np.abs(got - want).max() / np.abs(want).max()

    def no_sinks(model):
        for layer in model.model.layers:
            layer.self_attn.sinks.zero_()

    def swapped(model):
        for layer in model.model.layers:
            w = layer.mlp.experts.gate_up_proj
            w.copy_(torch.stack([w[..., 1::2], w[..., 0::2]], dim=-1).flatten(-2))

    # (the correction range's rounding moves the logits least: 3e-4, 30 x the tests' tolerance)
    for err in (changed(no_sinks), changed(swapped), changed(swiglu_limit=7.0),
                changed(rope_parameters={**YARN, "truncate": True}), changed(sliding_window=16)):
        assert err > 10 * LOGITS_RTOL, err


def test_bf16_round_trip_is_exact(tmp_path):
    assert_bf16_round_trip(tmp_path, gpt_oss(tmp_path / "hf", layers=2, dtype=torch.bfloat16))


def test_braids_loader_reads_the_import_and_saves_it_alike(tmp_path):
    # C++ load_parameters takes the import's tensors (sinks, router biases, the experts' gate and
    # up); save_checkpoint writes the index, the format version and the bytes the import wrote.
    hf_dir, ckpt = imported(tmp_path, "gpt_oss", MODELS)
    model = braid.GPTModel(config_from_metadata(metadata(ckpt)["config"]), device="cpu", seed=9)
    braid.load_parameters(str(ckpt), model)
    assert_computes(model, load_hf(hf_dir), "import loaded by braid's C++")
    assert assert_resaves_alike(model, ckpt, tmp_path / "resaved")["format_version"] == 7


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
def test_export_of_a_checkpoint_braid_saved_at_tp2_pp2(tmp_path):
    """braid's C++ loads the import into a tp = 2, pp = 2 job (4 ranks: the sinks split by heads,
    each expert's columns split like a dense MLP's, the router and its bias replicated) and saves
    it; export reassembles that save bit for bit."""
    hf_dir, ckpt = imported(tmp_path, "gpt_oss", MODELS)
    resave_at_tp2_pp2(ckpt, tmp_path / "sharded")
    meta = metadata(tmp_path / "sharded")
    assert meta["format_version"] == 7
    index = meta["tensors"]
    p = "model.layers.2."
    assert [s["length"] for s in index[p + "self_attn.sinks"]["shards"]] == [2, 2]
    assert index[p + "mlp.gate.bias"]["split_dim"] == -1
    assert [s["length"] for s in index[p + "mlp.experts.0.up_proj.weight"]["shards"]] == [32, 32]
    r = run_tool("export", "--load", tmp_path / "sharded", "--hf-dir", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert_same_bits(hf_weights(tmp_path / "out"), hf_weights(hf_dir))


# ---- MXFP4 -------------------------------------------------------------------------------------

def mxfp4_pack(param):
    """MXFP4 blocks and scales of an expert parameter [E, C, R] whose values MXFP4 holds (its
    transpose [E, R, C] in blocks of 32 along C): each block's least power of two 2^k with every
    |value| / 2^k at most 6, the quotients' E2M1 codes (the sign in bit 3, -0 kept), two a byte,
    the low nibble first."""
    m = np.swapaxes(param, 1, 2)
    values = m.reshape(m.shape[:-1] + (m.shape[-1] // 32, 32))
    top = np.abs(values).max(axis=-1)
    k = np.where(top > 0, np.ceil(np.log2(np.where(top > 0, top, 1) / 6)), 0).astype(np.int32)
    quotients = np.abs(values) / np.exp2(k)[..., None]
    magnitudes = E2M1[:8]
    found = quotients[..., None] == magnitudes
    assert found.any(axis=-1).all(), "a value MXFP4 does not hold"
    codes = (found.argmax(axis=-1) | (np.signbit(values) << 3)).astype(np.uint8)
    assert (k + 127 >= 0).all() and (k + 127 <= 254).all()
    return (np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << 4)),
            np.ascontiguousarray(k + 127, dtype=np.uint8))


def mxfp4_dir(hf_dir, dst):
    """hf_dir with its experts packed by mxfp4_pack, as openai's checkpoints hold them
    (X_blocks, X_scales; quantization_config quant_method mxfp4), each checked to dequantize back
    to hf_dir's tensor bit for bit by transformers' dequantizer and by braid's."""
    state = load_file(str(hf_dir / "model.safetensors"))
    for name in [n for n in state if n.endswith(EXPERTS)]:
        param = state.pop(name).numpy()
        blocks, scales = (torch.from_numpy(x) for x in mxfp4_pack(param))
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).numpy()
        ours = np.stack([mxfp4_dequantize(b, s).T for b, s in zip(blocks.numpy(), scales.numpy())])
        for got in (theirs, ours):
            np.testing.assert_array_equal(got.view(np.uint32), param.view(np.uint32), err_msg=name)
        state[name + "_blocks"], state[name + "_scales"] = blocks, scales
    dst.mkdir()
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(hf_dir / "config.json", dst / "config.json")
    edit_config(dst, quantization_config={  # openai/gpt-oss-20b's
        "quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]})
    return dst


@pytest.mark.parametrize("dtype,safetensors_dtype", [(torch.float32, "F32"),
                                                     (torch.bfloat16, "BF16")])
def test_the_mxfp4_dequantizer_is_transformers(dtype, safetensors_dtype):
    # random packed bytes, every scale but those that overflow f32 (above 6 x 2^125)
    rng = np.random.default_rng(5)
    blocks = rng.integers(0, 256, size=(3, 40, 2, 16), dtype=np.uint8)
    scales = rng.integers(0, 253, size=(3, 40, 2), dtype=np.uint8)
    want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                      dtype=dtype)
    tensors = {"model.layers.0.mlp.experts.down_proj_blocks": Tensor("U8", blocks),
               "model.layers.0.mlp.experts.down_proj_scales": Tensor("U8", scales)}
    assert dequantize_mxfp4_experts(tensors, safetensors_dtype) == 1
    got = tensors.pop("model.layers.0.mlp.experts.down_proj")
    assert not tensors and got.dtype == safetensors_dtype and got.shape == [3, 64, 40]
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    np.testing.assert_array_equal(got.array.view(np.int32 if bits == torch.int32 else np.int16),
                                  want.view(bits).numpy())


def test_an_mxfp4_checkpoint_imports_as_its_dequantized_weights(tmp_path):
    hf_dir, ckpt = imported(tmp_path, "gpt_oss", MODELS)
    packed = mxfp4_dir(hf_dir, tmp_path / "mxfp4")
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in load_file(
        str(packed / "model.safetensors"))
    r = run_tool("import", "--hf-dir", packed, "--save", tmp_path / "ckpt2")
    assert r.returncode == 0, r.stderr
    _, want = convert_hf.read_checkpoint(str(ckpt))
    _, got = convert_hf.read_checkpoint(str(tmp_path / "ckpt2"))
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype
        np.testing.assert_array_equal(got[name].array.view(np.uint32),
                                      want[name].array.view(np.uint32), err_msg=name)
    assert metadata(tmp_path / "ckpt2")["config"] == metadata(ckpt)["config"]
    # transformers' own MXFP4 loader (dequantizing on the CPU) reads it as the same model
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        packed, dtype=torch.float32, attn_implementation="eager",
        quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    np.testing.assert_array_equal(hf_logits(hf), hf_logits(load_hf(hf_dir)))
    # the export writes the experts dequantized, without the quantization_config
    r = run_tool("export", "--load", tmp_path / "ckpt2", "--hf-dir", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert_same_bits(hf_weights(tmp_path / "out"), hf_weights(hf_dir))
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())


def test_mxfp4_refusals(tmp_path):
    packed = mxfp4_dir(gpt_oss(tmp_path / "hf", layers=2), tmp_path / "mxfp4")
    state = load_file(str(packed / "model.safetensors"))
    name = "model.layers.1.mlp.experts.down_proj_scales"
    state[name][0, 0, 0] = 255  # E8M0's NaN
    save_file(state, str(packed / "model.safetensors"), metadata={"format": "pt"})
    assert_fails(run_tool("import", "--hf-dir", packed, "--save", tmp_path / "a"),
                 "model.layers.1.mlp.experts.down_proj_blocks", "overflow")
    del state[name]
    save_file(state, str(packed / "model.safetensors"), metadata={"format": "pt"})
    assert_fails(run_tool("import", "--hf-dir", packed, "--save", tmp_path / "b"),
                 "down_proj_blocks but no model.layers.1.mlp.experts.down_proj_scales")
    edit_config(packed, quantization_config={"quant_method": "fp8"})
    assert_fails(run_tool("import", "--hf-dir", packed, "--save", tmp_path / "c"),
                 "quantization_config (fp8) is not supported")


# ---- export of braid's models --------------------------------------------------------------------

def test_off_by_one_sinks_export_as_sinks_of_zero(tmp_path):
    # braid's off-by-one softmax is GPT-OSS's with every sink 0 (braid keeps no tensor for them)
    hf_dir, ckpt = imported(tmp_path, "gpt_oss", MODELS)
    meta, tensors = convert_hf.read_checkpoint(str(ckpt))
    config = dict(meta["config"], softmax_type="off-by-one")
    tensors = {n: t for n, t in tensors.items() if not n.endswith("self_attn.sinks")}
    convert_hf.write_checkpoint(str(tmp_path / "off"), tensors, convert_hf.checkpoint_metadata(
        config, convert_hf.checkpoint_specs(config), meta["hf_config"]))
    r = run_tool("export", "--load", tmp_path / "off", "--hf-dir", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    written = hf_weights(tmp_path / "out")
    assert not any(written[f"model.layers.{i}.self_attn.sinks"].any() for i in range(4))
    assert_computes(braid_model(tmp_path / "off"), load_hf(tmp_path / "out"), "off-by-one export")


def test_a_trained_braid_model_exports(tmp_path):
    # the import's config, trained one step by braid (routers drawn wide) and saved by its C++
    _, ckpt = imported(tmp_path, "gpt_oss", MODELS)
    cfg = config_from_metadata(metadata(ckpt)["config"])
    model = save_after_a_step(cfg, tmp_path / "trained", 4)
    r = run_tool("export", "--load", tmp_path / "trained", "--hf-dir", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    hf = load_hf(tmp_path / "out")
    assert hf.config.model_type == "gpt_oss" and hf.config.swiglu_limit == 0.25
    assert hf.config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert_computes(model, hf, "trained braid model's export")


def test_export_refuses_what_gpt_oss_does_not_hold():
    c = {"normalization": "rmsnorm", "activation": "quick_geglu", "position_embedding": "rope",
         "softmax_type": "learnable", "glu_linear_offset": 1.0, "activation_clamp": 7.0,
         "add_bias_linear": True, "num_layers": 2, "num_experts": 4, "moe_router_topk": 2}
    assert gpt_oss_architecture(c) == "gpt_oss"
    assert gpt_oss_architecture(dict(c, softmax_type="off-by-one")) == "gpt_oss"
    for changes, words in (
            ({"activation": "swiglu"}, "rmsnorm/swiglu/rope shaped"),
            ({"softmax_type": "vanilla"}, "usual softmax"),
            ({"glu_linear_offset": 0.0}, "glu_linear_offset 0.0"),
            ({"activation_clamp": 0.0}, "without a clamp"),
            ({"add_bias_linear": False}, "no biases"),
            ({"qk_layernorm": True}, "q/k norms"),
            ({"num_experts": 0}, "no experts"),
            ({"moe_layers": [0, 1]}, "dense layers"),
            ({"moe_shared_expert_intermediate_size": 32}, "shared expert"),
            ({"moe_router_pre_softmax": True}, "another router"),
            ({"moe_router_score_function": "sigmoid"}, "another router")):
        with pytest.raises(ConvertError, match=words):
            gpt_oss_architecture(dict(c, **changes))


# ---- config.json ---------------------------------------------------------------------------------

def test_openais_config_maps_to_braids():
    # openai/gpt-oss-20b's config.json (transformers 4's rope_scaling, MXFP4 experts)
    hf = {"architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
          "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
          "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
          "intermediate_size": 2880,
          "layer_types": ["sliding_attention", "full_attention"] * 12,
          "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
          "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
          "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
          "quantization_config": {"modules_to_not_convert": [
              "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
              "lm_head"], "quant_method": "mxfp4"},
          "rms_norm_eps": 1e-05, "rope_scaling": {
              "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
              "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
          "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
          "swiglu_limit": 7.0, "tie_word_embeddings": False, "use_cache": True,
          "vocab_size": 201088}
    c = gpt_oss_config_from_hf(hf, "bf16")
    assert (c["num_layers"], c["hidden_size"], c["num_attention_heads"], c["num_query_groups"],
            c["kv_channels"], c["vocab_size"]) == (24, 2880, 64, 8, 64, 201088)
    assert (c["num_experts"], c["moe_router_topk"], c["moe_ffn_hidden_size"]) == (32, 4, 2880)
    assert (c["window_size"], c["window_layers"]) == (127, [1, 0] * 12)
    assert (c["rope_theta"], c["rope_yarn_factor"], c["rope_yarn_truncate"],
            c["rope_original_max_position_embeddings"]) == (150000.0, 32.0, False, 4096)
    assert (c["activation_clamp"], c["glu_linear_offset"], c["softmax_type"]) == (
        7.0, 1.0, "learnable")
    # transformers reads it alike
    t = transformers.GptOssConfig(**{k: v for k, v in hf.items()
                                     if k not in ("architectures", "model_type")})
    assert t.rope_parameters["truncate"] is False and t.sliding_window == 128


def test_fields_left_out_are_transformers_defaults():
    # No RoPE fields (YaRN, as GptOssConfig fills in) and no num_key_value_heads (8).
    hf = {"hidden_size": 256, "num_attention_heads": 16, "num_hidden_layers": 2,
          "vocab_size": 300, "max_position_embeddings": 8192}
    c = gpt_oss_config_from_hf(hf, "f32")
    t = transformers.GptOssConfig(**hf)
    assert c["num_query_groups"] == t.num_key_value_heads == 8
    params = t.rope_parameters
    assert (c["rope_theta"], c["rope_yarn_factor"], c["rope_yarn_beta_fast"],
            c["rope_yarn_beta_slow"], c["rope_yarn_truncate"],
            c["rope_original_max_position_embeddings"]) == (
        params["rope_theta"], params["factor"], params["beta_fast"], params["beta_slow"],
        params["truncate"], params["original_max_position_embeddings"])


@pytest.mark.parametrize("changes,words", [
    ({"swiglu_alpha": 1.5}, ("swiglu_alpha = 1.5", "sigmoid(1.702 g)")),
    ({"swiglu_limit": None}, ("swiglu_limit = null", "positive")),
    ({"swiglu_limit": 0}, ("swiglu_limit = 0",)),
    ({"attention_bias": False}, ("attention_bias = false", "always have biases")),
    ({"sliding_window": None}, ("sliding_window = null", "sliding_attention layers")),
    ({"layer_types": ["chunked_attention", "full_attention"]}, ("layer_types",
                                                                "chunked_attention")),
    ({"rope_parameters": {**YARN, "partial_rotary_factor": 0.5}}, ("partial_rotary_factor",)),
    ({"rope_parameters": {**YARN, "truncate": "no"}}, ("truncate should be true or false",)),
    ({"quantization_config": {"quant_method": "fp8"}}, ("quantization_config (fp8)",)),
    ({"num_local_experts": 5}, ("model.layers.0.mlp.experts.gate_up_proj is [4, 64, 128]",
                                "config.json makes it [5, 64, 128]")),
])
def test_refuses_what_braid_cannot_hold(tmp_path, changes, words):
    assert_import_refused(gpt_oss(tmp_path / "hf", layers=2), changes, words, tmp_path / "c")
