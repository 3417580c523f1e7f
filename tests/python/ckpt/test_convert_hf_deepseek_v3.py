"""tools/convert_hf.py with DeepSeek-V3: tiny random DeepseekV3ForCausalLM (multi-latent
attention: a query latent of 24, a key/value latent of 16, heads of 16 + 8 RoPE channels for q
and k and of 12 for v; the first layer dense, then 8 experts in 4 groups, top 4 of the best 2, a
random e_score_correction_bias, an ungated shared expert) as transformers' save_pretrained writes
them, imported into braid and exported back.

- the round trip is bit-exact (the biases included) and the config equivalent; the checkpoint
  is format version 3; transformers loads the export with no missing or unexpected keys; braid's
  model of the import computes the logits of both the original and the exported HF model; also
  without a query latent (q_proj, DeepSeek-V2-Lite's), dense (first_k_dense_replace = the layer
  count), tied, without groups, and with YaRN RoPE (DeepSeek-V3's rope_scaling, and mscale 0.8 /
  mscale_all_dim 0.6 on a dense model); transformers 4's rope_scaling imports as 5's
  rope_parameters does
- braid's C++ loads the import and saves it as the import wrote it; a tp 2 x pp 2 re-save
  exports exactly; tools/generate.py decodes the import as transformers' generate does
- a checkpoint braid trained itself exports as DeepSeek-V3, and transformers computes its logits;
  with YaRN too, an attention_factor written where transformers' own rule would differ
- the multi-token-prediction layers are dropped with --no-mtp (test_convert_hf_mtp.py: moved
  as braid's MTP depths); num_key_value_heads above the head count
  (transformers' default of 128 on a small model) imports
- what braid's multi-latent attention or router cannot compute as transformers' does is refused
  with one line
"""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers

import braid
from braid.generate import config_from_metadata
from convert_test_util import (BIAS, BRAID_ROUTER, HF_ROUTER, MLA_CONFIG_KEYS,
                               assert_mixed_bf16_round_trip, assert_mtp_layers_dropped,
                               assert_resaves_alike, export_with_clear_routing, hf_logits,
                               imported_mla, save_deepseek, without_yarn_type)
from test_convert_hf import (IDS, LOGITS_RTOL, ROOT, assert_computes_both, assert_configs_agree,
                             assert_exports_exactly, assert_import_refused, assert_same_bits,
                             assert_same_logits, braid_model, convert_hf, hf_weights, imported,
                             load_hf, metadata, resave_at_tp2_pp2, run_tool, save_after_a_step)

sys.path.insert(0, os.path.join(ROOT, "tools"))
from hf_configs import ConvertError, as_f32, hf_config_from_braid  # noqa: E402

YARN = {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}  # V3's
V3_YARN = {"rope_type": "yarn", "rope_theta": 10000.0,
           **{k: v for k, v in YARN.items() if k != "type"}}  # as transformers 5 holds it
# cos and sin times g(0.8) / g(0.6); an original context shorter than IDS
OTHER_YARN = {**V3_YARN, "mscale": 0.8, "mscale_all_dim": 0.6,
              "original_max_position_embeddings": 8}


def deepseek_v3(tmp, layers=3, dtype=torch.float32, seed=3, **extra):
    """A DeepseekV3ForCausalLM saved by save_pretrained (save_hf): hidden 64, 4 heads,
    q_lora_rank 24, kv_lora_rank 16, qk_nope_head_dim 16, qk_rope_head_dim 8, v_head_dim 12; the
    first layer dense (intermediate_size 160), then HF_ROUTER's experts. `extra`: more config
    fields. `seed`: one whose routing has no near tie on IDS."""
    return save_deepseek(transformers.DeepseekV3ForCausalLM, tmp, layers, dtype, seed, HF_ROUTER,
                         extra)


MODELS = {
    "deepseek_v3": deepseek_v3,
    # DeepSeek-V2-Lite's queries (q_proj from the hidden state); tied embeddings; 2 shared experts
    "no-q-latent-tied": lambda d: deepseek_v3(d, q_lora_rank=None, tie_word_embeddings=True,
                                              n_shared_experts=2),
    # no layer has experts: a dense braid model; rope_theta other than the default
    "dense": lambda d: deepseek_v3(d, first_k_dense_replace=3, rope_parameters={
        "rope_type": "default", "rope_theta": 50000.0}),
    # no groups, top 2, experts on every layer
    "no-groups": lambda d: deepseek_v3(d, layers=2, n_group=1, topk_group=1,
                                       num_experts_per_tok=2, first_k_dense_replace=0),
    # DeepSeek-V3's YaRN
    "yarn": lambda d: deepseek_v3(d, rope_parameters=V3_YARN),
    # YaRN with cos and sin scaled too; dense
    "yarn-dense": lambda d: deepseek_v3(d, first_k_dense_replace=3, rope_parameters=OTHER_YARN),
}
CONFIG_KEYS = MLA_CONFIG_KEYS + ("rope_interleave",)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_round_trip_is_exact_and_logits_match(tmp_path, kind):
    hf_dir, ckpt, meta, hf_cfg = imported_mla(tmp_path, kind, MODELS)
    c = meta["config"]
    # kv_channels: the query/key head width, as braid's C++ saves an MLA model
    assert (c["kv_channels"], c["num_query_groups"], c["rotary_percent"]) == (24, 4, 1.0)
    rope = hf_cfg["rope_parameters"]
    if rope["rope_type"] == "yarn":
        assert (c["rope_yarn_factor"], c["rope_yarn_beta_fast"], c["rope_yarn_beta_slow"],
                c["rope_original_max_position_embeddings"]) == (
            40.0, 32.0, 1.0, rope["original_max_position_embeddings"])
        assert (c["rope_yarn_mscale"], c["rope_yarn_mscale_all_dim"]) == (
            as_f32(rope["mscale"]), as_f32(rope["mscale_all_dim"]))
        assert c["rope_scaling_factor"] == 0.0
    else:
        assert c["rope_yarn_factor"] == 0.0
    index = meta["tensors"]
    a = "model.layers.0.self_attn."
    assert index[a + "kv_a_proj_with_mqa.weight"]["shape"] == [24, 64]
    assert index[a + "kv_b_proj.weight"]["shape"] == [4 * (16 + 12), 16]
    assert index[a + "o_proj.weight"]["shape"] == [64, 4 * 12]
    assert (a + "q_a_proj.weight" in index) == (a + "q_a_layernorm.weight" in index) == (
        hf_cfg["q_lora_rank"] is not None) != (a + "q_proj.weight" in index)
    if hf_cfg["first_k_dense_replace"] >= hf_cfg["num_hidden_layers"]:  # dense
        assert not c.get("num_experts") and "moe_router_score_function" not in c
        assert not any(BIAS in name for name in index)
    else:
        groups = hf_cfg["n_group"] > 1
        assert (c["num_experts"], c["moe_router_topk"], c["moe_ffn_hidden_size"]) == (
            8, hf_cfg["num_experts_per_tok"], 32)
        assert (c["moe_router_score_function"], c["moe_router_enable_expert_bias"]) == (
            "sigmoid", True)
        assert (c["moe_router_num_groups"], c["moe_router_group_topk"]) == (
            (4, 2) if groups else (0, 0))
        assert c["moe_router_topk_scaling_factor"] == 2.5
        assert c["moe_shared_expert_intermediate_size"] == 32 * hf_cfg["n_shared_experts"]
        assert c["moe_layers"] == ([0, 1, 1] if hf_cfg["first_k_dense_replace"] else [])
        assert index[f"model.layers.1.{BIAS}"]["shape"] == [8]

    out = tmp_path / "out"
    r = run_tool("export", "--load", ckpt, "--hf-dir", out)
    assert r.returncode == 0, r.stderr
    got, want = hf_weights(out), hf_weights(hf_dir)
    assert_same_bits(got, want)
    assert_configs_agree(out, hf_dir, CONFIG_KEYS, without_yarn_type)
    written = json.loads((out / "config.json").read_text())
    if rope["rope_type"] == "yarn":  # transformers 4 and DeepSeek's own code read rope_scaling
        assert written["rope_scaling"] == {
            "type": "yarn", "rope_type": "yarn",
            **{k: v for k, v in rope.items() if k not in ("rope_theta", "rope_type")}}
    else:
        assert "rope_scaling" not in written
    assert_computes_both(braid_model(ckpt), hf_dir, out, hf_logits)


def test_bf16_round_trip_is_exact(tmp_path):
    # Loaded in bf16, transformers keeps the routers' biases in f32.
    assert_mixed_bf16_round_trip(tmp_path, deepseek_v3(tmp_path / "f32"),
                                 f32_names=[f"model.layers.1.{BIAS}"],
                                 bf16_names=["model.layers.1.self_attn.kv_b_proj.weight"])


def test_transformers_4_rope_scaling_imports_as_rope_parameters(tmp_path):
    # DeepSeek-V3's own config.json: rope_scaling (type yarn) and rope_theta at the top level,
    # no rope_parameters. transformers 5 reads it so (rope_scaling wins over rope_parameters);
    # the import is the one of the same model saved by transformers 5.
    hf_dir, ckpt = imported(tmp_path, "yarn", MODELS)
    config = json.loads((hf_dir / "config.json").read_text())
    del config["rope_parameters"]
    config.update(rope_scaling=YARN, rope_theta=10000.0)
    (hf_dir / "config.json").write_text(json.dumps(config))
    assert transformers.AutoConfig.from_pretrained(hf_dir).rope_parameters["rope_type"] == "yarn"
    r = run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "v4")
    assert r.returncode == 0, r.stderr
    want = metadata(ckpt)["config"]
    assert metadata(tmp_path / "v4")["config"] == want
    # Both, differing: transformers takes rope_scaling, and so does the import.
    config["rope_parameters"] = {**V3_YARN, "factor": 8.0}
    (hf_dir / "config.json").write_text(json.dumps(config))
    assert run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "both").returncode == 0
    assert metadata(tmp_path / "both")["config"] == want


def test_braids_loader_reads_the_import_and_saves_it_alike(tmp_path):
    # C++ load_parameters takes the import's tensors (the latent projections, their norms, the
    # biases); save_checkpoint writes the index, the format version and the bytes the import
    # wrote.
    hf_dir, ckpt = imported(tmp_path, "deepseek_v3", MODELS)
    model = braid.GPTModel(config_from_metadata(metadata(ckpt)["config"]), device="cpu", seed=9)
    braid.load_parameters(str(ckpt), model)
    assert_same_logits(model, IDS, hf_logits(load_hf(hf_dir), IDS))
    resaved = assert_resaves_alike(model, ckpt, tmp_path / "resaved")
    assert resaved["format_version"] == 3


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_export_of_a_checkpoint_braid_saved_at_tp2_pp2(tmp_path, q_lora_rank):
    """braid's C++ loads the import into a tp = 2, pp = 2 job (4 ranks: the up projections and
    o_proj split by heads, the down projections and latent norms replicated) and saves it;
    export reassembles that save bit for bit."""
    hf_dir = deepseek_v3(tmp_path / "hf", layers=4, q_lora_rank=q_lora_rank)
    ckpt = tmp_path / "ckpt"
    assert run_tool("import", "--hf-dir", hf_dir, "--save", ckpt).returncode == 0
    resave_at_tp2_pp2(ckpt, tmp_path / "sharded")
    meta = metadata(tmp_path / "sharded")
    assert meta["format_version"] == 3
    index = meta["tensors"]
    a = "model.layers.0.self_attn."
    assert [s["length"] for s in index[a + "kv_b_proj.weight"]["shards"]] == [56, 56]
    assert [s["length"] for s in index[a + "o_proj.weight"]["shards"]] == [24, 24]
    assert index[a + "kv_a_proj_with_mqa.weight"]["split_dim"] == -1
    assert_exports_exactly(tmp_path / "sharded", tmp_path / "out", hf_dir)


@pytest.mark.parametrize("rope", ["default", "yarn"])
def test_generate_tool_decodes_an_import_as_transformers_does(tmp_path, rope):
    # tools/generate.py builds the model from the checkpoint's metadata (YaRN's keys included)
    # and decodes over braid's KV cache; transformers' generate over its own. Dense, with weights
    # drawn wider than transformers' init so that every step's top two logits are apart.
    extra = {"rope_parameters": OTHER_YARN} if rope == "yarn" else {}
    hf_dir = deepseek_v3(tmp_path / "hf", first_k_dense_replace=3, initializer_range=0.1,
                         **extra)
    assert run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "ckpt").returncode == 0
    hf = load_hf(hf_dir)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 97, size=6).tolist() for _ in range(3)]
    with torch.no_grad():
        out = hf.generate(torch.tensor(prompts), do_sample=False, max_new_tokens=20,
                          min_new_tokens=20, eos_token_id=None, pad_token_id=0,
                          attention_mask=torch.ones(3, 6, dtype=torch.long))
        top2 = torch.topk(hf(out).logits[:, 5:-1].double(), 2, dim=-1).values
        assert (top2[..., 0] - top2[..., 1]).min() > 1e-3
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.path.join(ROOT, "python"))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "generate.py"), "--load",
                        str(tmp_path / "ckpt"), "--greedy", "--max-new-tokens", "20",
                        "--prompt-ids", *[",".join(map(str, p)) for p in prompts]],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert [list(map(int, line.split())) for line in r.stdout.splitlines()] == \
        out[:, 6:].tolist()


def test_mtp_layers_are_dropped(tmp_path):
    # DeepSeek-V3's checkpoints hold num_nextn_predict_layers multi-token-prediction layers
    # after the last (model.layers.61.*: eh_proj, enorm, hnorm, shared_head, a whole layer),
    # which transformers' causal LM does not load: import --no-mtp drops them too.
    hf_dir, ckpt = imported(tmp_path, "deepseek_v3", MODELS)
    assert_mtp_layers_dropped(tmp_path, hf_dir, ckpt, (
        "eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight",
        "self_attn.kv_b_proj.weight", "mlp.experts.0.up_proj.weight"))


def test_more_key_value_heads_than_heads_import(tmp_path):
    # DeepseekV3Config's num_key_value_heads defaults to 128 whatever the head count; every
    # query head has its own key and value anyway (kv_b_proj). transformers' sdpa attention
    # computes that (its eager one fails to repeat them); braid imports it so, and the export
    # says num_key_value_heads = num_attention_heads.
    hf_dir = deepseek_v3(tmp_path / "hf", first_k_dense_replace=3, num_key_value_heads=128)
    r = run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "ckpt")
    assert r.returncode == 0, r.stderr
    assert metadata(tmp_path / "ckpt")["config"]["num_query_groups"] == 4
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa")
    with torch.no_grad():
        want = hf(torch.from_numpy(IDS)).logits.numpy()
    got = np.from_dlpack(braid_model(tmp_path / "ckpt").logits(IDS))
    assert np.abs(got - want).max() <= LOGITS_RTOL * np.abs(want).max()
    r = run_tool("export", "--load", tmp_path / "ckpt", "--hf-dir", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert load_hf(tmp_path / "out").config.num_key_value_heads == 4


# ---- a checkpoint braid trained ----------------------------------------------------------------

def braid_mla_checkpoint(path, seed=3, **fields):
    """A checkpoint braid saved itself after a training step (save_after_a_step) with the
    expert-bias update on: 3 layers, multi-latent attention of test_hf_deepseek_v3_oracle.py's
    shape, BRAID_ROUTER's experts. `fields`: more config."""
    cfg = braid.TransformerConfig.preset("llama-tiny")
    cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups = 3, 64, 4, 4
    cfg.ffn_hidden_size, cfg.vocab_size, cfg.max_position_embeddings = 160, 97, 64
    cfg.norm_eps = 1e-6  # DeepseekV3ForCausalLM's latent norms' whatever rms_norm_eps says
    cfg.multi_latent_attention, cfg.qk_layernorm, cfg.kv_channels = True, True, 0
    cfg.q_lora_rank, cfg.kv_lora_rank, cfg.v_head_dim = 24, 16, 12
    cfg.qk_head_dim, cfg.qk_pos_emb_head_dim = 16, 8
    for name, value in {**BRAID_ROUTER, **fields}.items():
        setattr(cfg, name, value)
    return save_after_a_step(cfg, path, seed)


DENSE = {"num_experts": 0, "moe_router_topk": 2, "moe_router_score_function": "softmax",
         "moe_router_enable_expert_bias": False, "moe_router_num_groups": 0,
         "moe_router_group_topk": 0, "moe_router_topk_scaling_factor": 1.0,
         "moe_shared_expert_intermediate_size": 0, "moe_layers": [], "moe_aux_loss_coeff": 0.0}


@pytest.mark.parametrize("fields", [
    {},
    # DeepSeek-V2-Lite's queries; no bias (zeros in the export), top 2 without groups
    {"q_lora_rank": 0, "moe_router_enable_expert_bias": False, "moe_router_num_groups": 0,
     "moe_router_group_topk": 0, "moe_router_topk": 2},
    # dense: first_k_dense_replace = 3
    DENSE,
    # DeepSeek-V3's YaRN
    {"rope_yarn_factor": 40.0, "rope_yarn_mscale": 1.0, "rope_yarn_mscale_all_dim": 1.0,
     "rope_original_max_position_embeddings": 4096},
    # Megatron's --mscale 0.8 with --mscale-all-dim 0: cos and sin times g(0.8), which
    # transformers' rule (g(1) unless both are set) would not give: an attention_factor
    {**DENSE, "rope_yarn_factor": 40.0, "rope_yarn_mscale": 0.8,
     "rope_original_max_position_embeddings": 8},
], ids=["moe", "no-q-latent", "dense", "yarn", "yarn-attention-factor"])
def test_a_trained_braid_model_exports(tmp_path, fields):
    model, out, hf = export_with_clear_routing(tmp_path, braid_mla_checkpoint, **fields)
    assert hf.config.model_type == "deepseek_v3" and hf.config.rope_interleave
    assert (hf.config.q_lora_rank, hf.config.kv_lora_rank) == (fields.get("q_lora_rank", 24) or
                                                               None, 16)
    assert (hf.config.qk_nope_head_dim, hf.config.qk_rope_head_dim, hf.config.v_head_dim) == (
        16, 8, 12)
    if fields.get("num_experts") == 0:
        assert hf.config.first_k_dense_replace == 3
        assert not any(hasattr(layer.mlp, "experts") for layer in hf.model.layers)
    else:
        assert (hf.config.n_routed_experts, hf.config.first_k_dense_replace) == (8, 1)
        assert hf.config.routed_scaling_factor == 2.5 and hf.config.norm_topk_prob
        biases = {n: np.from_dlpack(b).copy() for n, b in model.expert_biases().items()}
        written = hf_weights(out)
        for i in (1, 2):
            np.testing.assert_array_equal(written[f"model.layers.{i}.{BIAS}"].numpy(),
                                          biases.get(f"model.layers.{i}.{BIAS}",
                                                     np.zeros(8, np.float32)))
    rope = hf.config.rope_parameters
    if fields.get("rope_yarn_factor"):
        assert rope["rope_type"] == "yarn" and rope["factor"] == 40.0
        assert (rope["mscale"], rope["mscale_all_dim"]) == (
            fields["rope_yarn_mscale"], fields.get("rope_yarn_mscale_all_dim", 0.0))
        assert rope["original_max_position_embeddings"] == \
            fields["rope_original_max_position_embeddings"]
        assert ("attention_factor" in rope) == (fields["rope_yarn_mscale"] == 0.8)
        assert hf.model.rotary_emb.attention_scaling == pytest.approx(
            model.config.rope_attention_factor, rel=1e-7)
        # ... and imports back as braid's model was
        r = run_tool("import", "--hf-dir", out, "--save", tmp_path / "back")
        assert r.returncode == 0, r.stderr
        back = metadata(tmp_path / "back")["config"]
        for key in ("rope_yarn_factor", "rope_yarn_beta_fast", "rope_yarn_beta_slow",
                    "rope_yarn_mscale", "rope_yarn_mscale_all_dim",
                    "rope_original_max_position_embeddings"):
            assert back[key] == getattr(model.config, key), key
    else:
        assert rope["rope_type"] == "default"
    assert_same_logits(model, IDS, hf_logits(hf, IDS))


# ---- refused -----------------------------------------------------------------------------------

@pytest.mark.parametrize("changes,words", [
    ({"rope_interleave": False}, ("rope_interleave", "interleaved pairs")),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
     ("rope_parameters.rope_type = \"linear\"", "plain RoPE or YaRN's")),
    ({"rope_scaling": {**YARN, "truncate": False}},
     ("rope_scaling.truncate = false", "unrounded correction range")),
    ({"rope_parameters": {**V3_YARN, "attention_factor": 1.5}},
     ("rope_parameters.attention_factor = 1.5", "g(mscale) / g(mscale_all_dim) = 1,")),
    # transformers ignores mscale without mscale_all_dim (g(1) on cos and sin); DeepSeek's code
    # and megatron-core take g(0.707) / g(0)
    ({"rope_parameters": {**V3_YARN, "mscale": 0.707, "mscale_all_dim": 0}},
     ("rope_parameters.mscale = 0.707", "g(1) = 1.368888", "= 1.260804")),
    ({"rope_scaling": {k: v for k, v in YARN.items() if k != "mscale"}},
     ("rope_scaling.mscale_all_dim = 1.0", "g(1) = 1.368888", "= 1,")),
    ({"rope_parameters": {**V3_YARN, "factor": 0.5}},
     ("rope_parameters.factor should be a number >= 1, is 0.5",)),
    ({"rope_parameters": {k: v for k, v in V3_YARN.items() if k != "factor"}},
     ("rope_type yarn without its factor",)),
    ({"rope_parameters": {**V3_YARN, "beta_slow": 64}},
     ("rope_parameters.beta_slow = 64", "0 < beta_slow <= beta_fast (32)")),
    ({"attention_bias": True}, ("attention_bias", "q_a_proj, kv_a_proj_with_mqa and o_proj")),
    ({"num_key_value_heads": 2}, ("num_key_value_heads", "its own key and value")),
    ({"v_head_dim": 32}, ("v_head_dim", "qk_nope_head_dim + qk_rope_head_dim = 24")),
    ({"qk_rope_head_dim": 7}, ("qk_rope_head_dim should be a positive even number",)),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}},
     ("quantization_config (fp8)", "dequantize")),
    # DeepSeek-V3's own: FP8 weights with YaRN
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}, "rope_scaling": YARN},
     ("quantization_config (fp8)", "dequantize")),
    ({"hidden_act": "gelu"}, ("hidden_act",)),
    ({"rms_norm_eps": 1e-5}, ("rms_norm_eps", "latent norms (q_a_layernorm, kv_a_layernorm) use "
                              "1e-06 whatever rms_norm_eps says")),
    ({"kv_lora_rank": 8}, ("kv_a_proj_with_mqa.weight", "[24, 64]", "[16, 64]")),
    ({"q_lora_rank": None}, ("the HF weights have no model.layers.0.self_attn.q_proj.weight",)),
    ({"norm_topk_prob": False}, ("norm_topk_prob", "always divides")),
    ({"topk_group": 1}, ("n_group", "num_experts_per_tok is 4 and topk_group 1")),
    # DeepSeek-V3's weights named DeepSeek-V2: V2's softmax router has no expert bias
    ({"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2"},
     ("unexpected tensor model.layers.1.mlp.gate.e_score_correction_bias", "deepseek_v2")),
])
def test_refuses_what_braid_cannot_hold(tmp_path, changes, words):
    assert_import_refused(deepseek_v3(tmp_path / "hf"), changes, words, tmp_path / "c")


def test_export_refuses_an_mla_model_with_no_hf_counterpart():
    c = {"normalization": "rmsnorm", "activation": "swiglu", "position_embedding": "rope",
         "add_bias_linear": False, "add_qkv_bias": False, "qk_layernorm": True,
         "rotary_percent": 1.0, "num_layers": 3, "multi_latent_attention": True,
         "q_lora_rank": 24, "kv_lora_rank": 16, "qk_head_dim": 16, "qk_pos_emb_head_dim": 8,
         "v_head_dim": 12, "rope_scaling_factor": 0.0, "norm_eps": 9.999999974752427e-07,
         "num_experts": 8, "moe_router_topk": 4, "moe_ffn_hidden_size": 32, "ffn_hidden_size": 160, "moe_router_pre_softmax": False,
         "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
         "moe_router_num_groups": 4, "moe_router_group_topk": 2,
         "moe_router_topk_scaling_factor": 2.5, "moe_shared_expert_intermediate_size": 32,
         "moe_shared_expert_gate": False, "moe_layers": [0, 1, 1], "window_size": -1,
         "window_layers": [], "hidden_size": 64, "num_attention_heads": 4,
         "num_query_groups": 4, "kv_channels": 24}
    arch = convert_hf.latent_attention_architecture
    assert arch(c) == "deepseek_v3"
    assert arch(dict(c, rope_yarn_factor=40.0)) == "deepseek_v3"  # YaRN
    assert arch(dict(c, num_experts=0)) == "deepseek_v3"  # dense
    assert arch(dict(c, q_lora_rank=0)) == "deepseek_v3"
    refusals = [
        (dict(c, qk_layernorm=False), "without its latent norms (qk_layernorm)"),
        (dict(c, moe_router_score_function="softmax"), "a softmax router"),
        (dict(c, window_size=4), "a sliding window"),
        (dict(c, normalization="layernorm"), "layernorm/swiglu/rope shaped"),
        (dict(c, rope_scaling_factor=8.0), "Llama 3.1's RoPE scaling"),
        (dict(c, norm_eps=1e-5), "norm_eps 1e-05; DeepseekV3ForCausalLM's latent norms use 1e-06"),
        (dict(c, moe_shared_expert_gate=True), "gates its shared expert"),
        (dict(c, moe_router_group_topk=1), "its best moe_router_topk / group_topk = 4 / 1"),
    ]
    for config, words in refusals:
        with pytest.raises(convert_hf.ConvertError, match=re.escape(words)):
            arch(config)


def test_export_refuses_yarn_without_multi_latent_attention():
    # braid's YaRN on ordinary attention (--rope-type yarn without --multi-latent-attention)
    # has no counterpart convert_hf.py moves: Llama and the others import and export plain RoPE
    # or Llama 3.1's scaling only.
    c = {"normalization": "rmsnorm", "activation": "swiglu", "position_embedding": "rope",
         "add_bias_linear": False, "add_qkv_bias": False, "qk_layernorm": False,
         "rotary_percent": 1.0, "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
         "num_query_groups": 2, "kv_channels": 16, "ffn_hidden_size": 160, "vocab_size": 97,
         "max_position_embeddings": 64, "rope_theta": 10000.0, "rope_scaling_factor": 0.0,
         "norm_eps": 1e-5, "tie_embeddings": False, "window_size": -1, "window_layers": [],
         "rope_yarn_factor": 4.0, "rope_yarn_beta_fast": 32.0, "rope_yarn_beta_slow": 1.0,
         "rope_yarn_mscale": 1.0, "rope_yarn_mscale_all_dim": 0.0,
         "rope_original_max_position_embeddings": 4096}
    assert convert_hf.braid_architecture(c) == "llama"
    with pytest.raises(ConvertError, match="this braid model has YaRN RoPE and exports as llama; "
                                           "convert_hf.py moves YaRN with DeepSeek-V3"):
        hf_config_from_braid(c, "llama", "float32", None)
    assert hf_config_from_braid(dict(c, rope_yarn_factor=0.0), "llama", "float32", None)[
        "rope_parameters"]["rope_type"] == "default"
