"""tools/convert_hf.py with DeepSeek-V2: tiny random DeepseekV2ForCausalLM (test_convert_hf_
deepseek_v3.py's multi-latent attention; the first layer dense, then 8 experts routed by
DeepSeek-V2's softmax router: the top 3 of a softmax over all experts, not renormalised, times
routed_scaling_factor 2.5; 2 shared experts) as transformers' save_pretrained writes them,
imported into braid and exported back.

- the round trip is bit-exact and the config equivalent; the import is braid's pre-softmax
  router with a scaling factor and no bias, format version 3; transformers loads the export with
  no missing or unexpected keys; braid's model of the import computes the logits of both the
  original and the exported HF model; also without a query latent and tied (DeepSeek-V2-Lite's
  queries), group_limited_greedy with num_experts_per_tok = topk_group, dense (exported as
  DeepSeek-V2 again), and with DeepSeek-V2's YaRN; bf16 exact
- DeepSeek-V2-Lite's own config.json style (rope_scaling, scoring_func, moe_layer_freq,
  aux_loss_alpha, ...) imports as transformers 5's save does and those fields come back;
  norm_topk_prob, which transformers ignores, changes nothing
- braid's C++ loads the import and saves it as the import wrote it
- a checkpoint braid trained itself with multi-latent attention and a pre-softmax router exports
  as DeepSeek-V2 (with and without groups, without a query latent), and transformers computes its
  logits
- what braid's router cannot compute as transformers' does is refused with one line, on import
  and on export
"""

import json
import os
import re
import sys

import pytest
import torch
import transformers

import braid
from braid.generate import config_from_metadata
from convert_test_util import (MLA_CONFIG_KEYS, assert_mixed_bf16_round_trip,
                               assert_resaves_alike, export_with_clear_routing,
                               hf_logits as clear_hf_logits, imported_mla, save_deepseek,
                               without_yarn_type)
from test_convert_hf import (IDS, ROOT, assert_computes_both, assert_configs_agree,
                             assert_import_refused, assert_same_bits, assert_same_logits,
                             braid_model, convert_hf, edit_config, hf_weights, imported,
                             load_hf, metadata, run_tool)
from test_convert_hf_deepseek_v3 import braid_mla_checkpoint

sys.path.insert(0, os.path.join(ROOT, "tools"))
from hf_configs import as_f32  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "tests", "python", "model"))
from test_hf_deepseek_v2_oracle import v2_routing_margin  # noqa: E402

# DeepSeek-V2's and -V2-Lite's YaRN, as transformers 5 holds it
V2_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40, "mscale": 0.707,
           "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096, "beta_fast": 32,
           "beta_slow": 1}
GROUPED = {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
           "num_experts_per_tok": 2}
# The router of the tests' models: 8 experts of 32 after a dense first layer, top 3 (greedy), 2
# shared experts, routed_scaling_factor 2.5. HF's config fields.
HF_V2_ROUTER = dict(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3,
                    topk_method="greedy", n_group=1, topk_group=1, n_shared_experts=2,
                    first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=False)


def deepseek_v2(tmp, layers=3, dtype=torch.float32, seed=1, **extra):
    """A DeepseekV2ForCausalLM saved by save_pretrained (save_hf): hidden 64, 4 heads,
    q_lora_rank 24, kv_lora_rank 16, qk_nope_head_dim 16, qk_rope_head_dim 8, v_head_dim 12; the
    first layer dense (intermediate_size 160), then 8 experts of 32, top 3 (greedy), 2 shared
    experts, routed_scaling_factor 2.5. `extra`: more config fields. `seed`: one whose routing
    has no near tie on IDS."""
    return save_deepseek(transformers.DeepseekV2ForCausalLM, tmp, layers, dtype, seed,
                         HF_V2_ROUTER, extra)


MODELS = {
    "greedy": deepseek_v2,
    # DeepSeek-V2-Lite's queries (q_proj from the hidden state); tied; 1 shared expert
    "no-q-latent-tied": lambda d: deepseek_v2(d, q_lora_rank=None, tie_word_embeddings=True,
                                              n_shared_experts=1),
    # the top 2 among the best 2 of 4 groups, a group scored by its best expert
    "grouped": lambda d: deepseek_v2(d, **GROUPED),
    # no layer has experts: a dense braid model, which exports as DeepSeek-V2 again
    "dense": lambda d: deepseek_v2(d, first_k_dense_replace=3),
    # DeepSeek-V2-Lite's YaRN and queries; experts on every layer
    "yarn": lambda d: deepseek_v2(d, layers=2, q_lora_rank=None, first_k_dense_replace=0,
                                  rope_parameters=V2_YARN),
}
CONFIG_KEYS = MLA_CONFIG_KEYS + ("mlp_bias", "topk_method")


def hf_logits(hf, ids):
    """HF's logits, checking that no token's group or expert choice is near a tie in DeepSeek-V2's
    routing (convert_test_util.hf_logits with v2_routing_margin)."""
    return clear_hf_logits(hf, ids, v2_routing_margin)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_round_trip_is_exact_and_logits_match(tmp_path, kind):
    hf_dir, ckpt, meta, hf_cfg = imported_mla(tmp_path, kind, MODELS)
    c = meta["config"]
    if hf_cfg["rope_parameters"]["rope_type"] == "yarn":
        assert (c["rope_yarn_factor"], c["rope_original_max_position_embeddings"]) == (40.0,
                                                                                      4096)
        assert c["rope_yarn_mscale"] == c["rope_yarn_mscale_all_dim"] == as_f32(0.707)
    index = meta["tensors"]
    if hf_cfg["first_k_dense_replace"] >= hf_cfg["num_hidden_layers"]:  # dense
        assert not c.get("num_experts") and "moe_router_score_function" not in c
    else:
        grouped = hf_cfg["topk_method"] == "group_limited_greedy"
        assert (c["num_experts"], c["moe_router_topk"], c["moe_ffn_hidden_size"]) == (
            8, hf_cfg["num_experts_per_tok"], 32)
        assert (c["moe_router_score_function"], c["moe_router_pre_softmax"],
                c["moe_router_enable_expert_bias"]) == ("softmax", True, False)
        assert (c["moe_router_num_groups"], c["moe_router_group_topk"]) == (
            (4, 2) if grouped else (0, 0))
        assert c["moe_router_topk_scaling_factor"] == 2.5
        assert c["moe_shared_expert_intermediate_size"] == 32 * hf_cfg["n_shared_experts"]
        assert not c["moe_shared_expert_gate"]
        assert c["moe_layers"] == ([0, 1, 1] if hf_cfg["first_k_dense_replace"] else [])
        assert not any("e_score_correction_bias" in name for name in index)

    out = tmp_path / "out"
    r = run_tool("export", "--load", ckpt, "--hf-dir", out)
    assert r.returncode == 0, r.stderr
    assert_same_bits(hf_weights(out), hf_weights(hf_dir))
    assert_configs_agree(out, hf_dir, CONFIG_KEYS, without_yarn_type)
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["DeepseekV2ForCausalLM"]
    assert "rope_interleave" not in written and "num_nextn_predict_layers" not in written
    assert_computes_both(braid_model(ckpt), hf_dir, out, hf_logits)


def test_bf16_round_trip_is_exact(tmp_path):
    # Loaded in bf16, transformers keeps the routers in f32: a mixed import, computed in f32.
    assert_mixed_bf16_round_trip(tmp_path, deepseek_v2(tmp_path / "f32"),
                                 f32_names=["model.layers.1.mlp.gate.weight"],
                                 bf16_names=["model.layers.1.self_attn.kv_b_proj.weight"])


# DeepSeek-V2-Lite's config.json (as its hub repository has it) beyond the model's shape
V2_LITE_FIELDS = {"rope_scaling": {"type": "yarn", "factor": 40, "mscale": 0.707,
                                   "mscale_all_dim": 0.707,
                                   "original_max_position_embeddings": 4096, "beta_fast": 32,
                                   "beta_slow": 1},
                  "rope_theta": 10000.0, "scoring_func": "softmax", "moe_layer_freq": 1,
                  "aux_loss_alpha": 0.001, "seq_aux": True, "ep_size": 1,
                  "topk_method": "greedy", "n_group": 1, "topk_group": 1,
                  "norm_topk_prob": False}


def test_v2_lite_style_config_imports_as_transformers_5s_save(tmp_path):
    # transformers 4's rope_scaling (type yarn) and DeepSeek's own fields, which transformers 5
    # does not read: the import is that of the same model saved by transformers 5, and export
    # writes DeepSeek's fields back as they were.
    hf_dir, ckpt = imported(tmp_path, "yarn", MODELS)
    config = json.loads((hf_dir / "config.json").read_text())
    del config["rope_parameters"]
    config.update(V2_LITE_FIELDS)
    (hf_dir / "config.json").write_text(json.dumps(config))
    assert transformers.AutoConfig.from_pretrained(hf_dir).rope_parameters["rope_type"] == "yarn"
    r = run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "lite")
    assert r.returncode == 0, r.stderr
    assert metadata(tmp_path / "lite")["config"] == metadata(ckpt)["config"]
    r = run_tool("export", "--load", tmp_path / "lite", "--hf-dir", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    for key in ("scoring_func", "moe_layer_freq", "aux_loss_alpha", "seq_aux", "ep_size",
                "n_group", "topk_group", "topk_method", "norm_topk_prob"):
        assert written[key] == V2_LITE_FIELDS[key], key
    assert written["rope_scaling"]["type"] == "yarn"
    assert_same_logits(braid_model(tmp_path / "lite"), IDS, hf_logits(load_hf(hf_dir), IDS))
    # norm_topk_prob true: transformers' DeepseekV2 does not read it, nor does the import (its
    # logits: test_hf_deepseek_v2_oracle.py); export writes false, which DeepSeek's code reads
    # as transformers computes
    edit_config(hf_dir, norm_topk_prob=True)
    assert run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "norm").returncode == 0
    assert metadata(tmp_path / "norm")["config"] == metadata(ckpt)["config"]
    assert run_tool("export", "--load", tmp_path / "norm", "--hf-dir",
                    tmp_path / "out2").returncode == 0
    assert not json.loads((tmp_path / "out2" / "config.json").read_text())["norm_topk_prob"]


@pytest.mark.parametrize("groups", [{"n_group": 4, "topk_group": 4}, {"n_group": 1}])
def test_groups_that_leave_none_out_import_as_greedy(tmp_path, groups):
    # group_limited_greedy choosing every group (or of one group) is greedy's choice
    hf_dir = deepseek_v2(tmp_path / "hf", topk_method="group_limited_greedy",
                         **{"topk_group": 1, **groups})
    r = run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "ckpt")
    assert r.returncode == 0, r.stderr
    c = metadata(tmp_path / "ckpt")["config"]
    assert (c["moe_router_num_groups"], c["moe_router_group_topk"], c["moe_router_topk"]) == (
        0, 0, 3)
    assert_same_logits(braid_model(tmp_path / "ckpt"), IDS, hf_logits(load_hf(hf_dir), IDS))


def test_braids_loader_reads_the_import_and_saves_it_alike(tmp_path):
    # C++ load_parameters takes the import's tensors; save_checkpoint writes the index, the
    # config (the pre-softmax router, its scaling and groups) and the bytes the import wrote.
    hf_dir, ckpt = imported(tmp_path, "grouped", MODELS)
    model = braid.GPTModel(config_from_metadata(metadata(ckpt)["config"]), device="cpu", seed=9)
    braid.load_parameters(str(ckpt), model)
    assert_same_logits(model, IDS, hf_logits(load_hf(hf_dir), IDS))
    assert assert_resaves_alike(model, ckpt, tmp_path / "resaved")["format_version"] == 3


# ---- a checkpoint braid trained ----------------------------------------------------------------

V2_ROUTER = {"moe_router_score_function": "softmax", "moe_router_pre_softmax": True,
             "moe_router_enable_expert_bias": False, "moe_router_num_groups": 0,
             "moe_router_group_topk": 0, "moe_router_topk": 3,
             "moe_shared_expert_intermediate_size": 64}


@pytest.mark.parametrize("fields", [
    {},
    # DeepSeek-V2-Lite's queries; the top 2 of the best 2 of 4 groups
    {"q_lora_rank": 0, "moe_router_num_groups": 4, "moe_router_group_topk": 2,
     "moe_router_topk": 2},
    # DeepSeek-V2's YaRN
    {"rope_yarn_factor": 40.0, "rope_yarn_mscale": 0.707, "rope_yarn_mscale_all_dim": 0.707,
     "rope_original_max_position_embeddings": 4096},
], ids=["greedy", "grouped", "yarn"])
def test_a_trained_braid_model_exports(tmp_path, fields):
    # braid_mla_checkpoint: test_convert_hf_deepseek_v3.py's model, here routed by DeepSeek-V2's
    # router; the first of seeds 3 to 10 whose export routes IDS with no near tie
    model, out, hf = export_with_clear_routing(tmp_path, braid_mla_checkpoint, v2_routing_margin,
                                               **{**V2_ROUTER, **fields})
    h = hf.config
    assert h.model_type == "deepseek_v2" and not h.norm_topk_prob
    assert (h.q_lora_rank, h.kv_lora_rank) == (fields.get("q_lora_rank", 24) or None, 16)
    assert (h.n_routed_experts, h.first_k_dense_replace, h.n_shared_experts) == (8, 1, 2)
    assert (h.num_experts_per_tok, h.routed_scaling_factor) == (
        fields.get("moe_router_topk", 3), 2.5)
    if fields.get("moe_router_num_groups"):
        assert (h.topk_method, h.n_group, h.topk_group) == ("group_limited_greedy", 4, 2)
    else:
        assert h.topk_method == "greedy"
    assert h.rope_parameters["rope_type"] == ("yarn" if fields.get("rope_yarn_factor")
                                              else "default")
    assert not any("e_score_correction_bias" in n for n in hf_weights(out))
    assert_same_logits(model, IDS, hf_logits(hf, IDS))


# ---- refused -----------------------------------------------------------------------------------

@pytest.mark.parametrize("changes,words", [
    # DeepSeek-V2's (236B) routing: the top 6 among the best 3 of 8 groups
    ({"topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3,
      "num_experts_per_tok": 6},
     ("topk_group = 3", "n_group = 8 groups by its best expert",
      "num_experts_per_tok / topk_group = 6 / 3", "num_experts_per_tok = topk_group")),
    ({**GROUPED, "num_experts_per_tok": 1}, ("topk_group = 2", "= 1 / 2")),
    ({"topk_method": "group_limited_greedy", "n_group": None},
     ("topk_method group_limited_greedy needs n_group and topk_group",)),
    ({**GROUPED, "n_group": 3}, ("n_group should divide n_routed_experts 8",)),
    ({"topk_method": "noaux_tc"}, ("topk_method = \"noaux_tc\"", "greedy and "
                                   "group_limited_greedy", "DeepseekV3ForCausalLM")),
    ({"scoring_func": "sigmoid"}, ("scoring_func = \"sigmoid\"", "softmax over the experts")),
    ({"moe_layer_freq": 2}, ("moe_layer_freq = 2", "every moe_layer_freq-th layer")),
    ({"num_experts_per_tok": None}, ("num_experts_per_tok should be in [1, 8]",)),
    ({"n_shared_experts": None}, ("n_shared_experts should be a positive integer",)),
    ({"mlp_bias": True}, ("mlp_bias = true", "not on the routed experts")),
    ({"attention_bias": True}, ("attention_bias", "DeepseekV2Attention then has biases")),
    ({"rms_norm_eps": 1e-5}, ("rms_norm_eps", "DeepseekV2Attention's latent norms")),
    ({"rope_parameters": {**V2_YARN, "mscale_all_dim": None}},
     ("rope_parameters.mscale = 0.707", "g(1) = 1.368888")),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
     ("rope_parameters.rope_type = \"linear\"", "DeepSeek-V2's and -V3's")),
])
def test_refuses_what_braid_cannot_hold(tmp_path, changes, words):
    assert_import_refused(deepseek_v2(tmp_path / "hf"), changes, words, tmp_path / "c")


MLA_SOFTMAX = {
    "normalization": "rmsnorm", "activation": "swiglu", "position_embedding": "rope",
    "add_bias_linear": False, "add_qkv_bias": False, "qk_layernorm": True, "rotary_percent": 1.0,
    "num_layers": 3, "multi_latent_attention": True, "q_lora_rank": 24, "kv_lora_rank": 16,
    "qk_head_dim": 16, "qk_pos_emb_head_dim": 8, "v_head_dim": 12, "rope_scaling_factor": 0.0,
    "norm_eps": 9.999999974752427e-07, "num_experts": 8, "moe_router_topk": 2,
    "moe_ffn_hidden_size": 32, "ffn_hidden_size": 160, "moe_router_pre_softmax": True,
    "moe_router_score_function": "softmax", "moe_router_enable_expert_bias": False,
    "moe_router_num_groups": 4, "moe_router_group_topk": 2,
    "moe_router_topk_scaling_factor": 2.5, "moe_shared_expert_intermediate_size": 64,
    "moe_shared_expert_gate": False, "moe_layers": [0, 1, 1], "window_size": -1,
    "window_layers": [], "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 4,
    "kv_channels": 24}


def test_export_picks_deepseek_v2_by_the_router():
    arch, c = convert_hf.latent_attention_architecture, MLA_SOFTMAX
    assert arch(c) == "deepseek_v2"
    assert arch(dict(c, moe_router_num_groups=0, moe_router_group_topk=0)) == "deepseek_v2"
    # every group chosen: greedy's choice, whatever the groups' scores
    assert arch(dict(c, moe_router_topk=4, moe_router_group_topk=4)) == "deepseek_v2"
    assert arch(dict(c, moe_router_score_function="sigmoid", moe_router_pre_softmax=False,
                     moe_router_topk=4)) == "deepseek_v3"
    # dense: DeepSeek-V2 where the import was one (the same model either way)
    v2 = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2"}
    assert arch(dict(c, num_experts=0), v2) == "deepseek_v2"
    assert arch(dict(c, num_experts=0)) == "deepseek_v3"
    refusals = [
        (dict(c, moe_router_pre_softmax=False), "a softmax router over the top k logits "
         "(moe_router_pre_softmax false); DeepseekV2ForCausalLM takes the top k of a softmax"),
        (dict(c, moe_router_topk=4, moe_router_num_groups=4, moe_router_group_topk=2),
         "in 4 groups, each scored by the sum of its best moe_router_topk / group_topk = 4 / 2"),
        (dict(c, moe_shared_expert_gate=True), "gates its shared expert; DeepseekV2ForCausalLM"),
        (dict(c, moe_shared_expert_intermediate_size=0), "has no shared expert"),
        (dict(c, moe_shared_expert_intermediate_size=48), "48 wide, not a multiple"),
        (dict(c, moe_layers=[1, 0, 1]), "dense layers after expert ones"),
        (dict(c, add_bias_linear=True), "biases on every linear layer"),
        (dict(c, norm_eps=1e-5), "norm_eps 1e-05; DeepseekV2ForCausalLM's latent norms"),
        (dict(c, num_experts=0, qk_layernorm=False), "DeepseekV3ForCausalLM always norms them"),
    ]
    for config, words in refusals:
        with pytest.raises(convert_hf.ConvertError, match=re.escape(words)):
            arch(config)
