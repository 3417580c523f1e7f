"""Shared by the convert_hf.py tests of models with DeepSeek-V3's router
(test_convert_hf_dots1.py, test_convert_hf_deepseek_v3.py): the router their tiny models have,
HF's logits with the routing checked clear of ties, a trained braid checkpoint exported with
such routing, and the checks both families make alike; and by the tests of DeepSeek's
multi-latent attention (test_convert_hf_deepseek_v3.py, test_convert_hf_deepseek_v2.py): their
tiny models, the import's attention checked, the config keys an export keeps."""

import json

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import braid
from hf_oracle import deepseek_mla_config, deepseek_routers, deepseek_routing_margin
from test_convert_hf import (IDS, assert_fails, assert_same_bits, convert_hf, edit_config,
                             hf_weights, imported, load_hf, metadata, perturb, run_tool)

MARGIN = 1e-3  # the least gap between a token's last chosen and first unchosen group or expert
BIAS = "mlp.gate.e_score_correction_bias"
# The router of the tests' models: on 3 layers the first dense, then 8 experts of 32 in 4 groups
# (top 4 of the best 2), an ungated shared expert of 32, routed_scaling_factor 2.5. HF's config
# fields, and braid's (with the expert-bias update and the aux loss on).
HF_ROUTER = dict(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=4, n_group=4,
                 topk_group=2, n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True,
                 routed_scaling_factor=2.5)
BRAID_ROUTER = dict(num_experts=8, moe_router_topk=4, moe_ffn_hidden_size=32,
                    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                    moe_router_bias_update_rate=0.02, moe_router_num_groups=4,
                    moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5,
                    moe_shared_expert_intermediate_size=32, moe_layers=[0, 1, 1],
                    moe_aux_loss_coeff=0.01)
# The HF config keys an export of a DeepSeek model with multi-latent attention agrees on with the
# original (assert_configs_agree), both DeepSeek-V2's and -V3's.
MLA_CONFIG_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                   "tie_word_embeddings", "attention_bias", "rope_parameters", "q_lora_rank",
                   "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                   "qk_head_dim", "head_dim", "n_routed_experts", "num_experts_per_tok",
                   "moe_intermediate_size", "n_shared_experts", "first_k_dense_replace",
                   "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor",
                   "max_position_embeddings", "vocab_size")


def save_hf(model, tmp, dtype):
    """The HF `model` saved in `tmp` by save_pretrained in `dtype`, its biases and norms off
    their init, its routers wide and its expert biases random so that they change choices."""
    perturb(model)
    deepseek_routers(model)
    model.to(dtype).save_pretrained(tmp)
    return tmp


def save_deepseek(model_class, tmp, layers, dtype, seed, router, extra):
    """A `model_class` (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM) of `layers` layers drawn
    with `seed` and saved by save_pretrained (save_hf): hidden 64, 4 heads, q_lora_rank 24,
    kv_lora_rank 16, qk_nope_head_dim 16, qk_rope_head_dim 8, v_head_dim 12, the dense MLPs 160
    wide (deepseek_mla_config); `router`'s config fields, then `extra`'s over them."""
    torch.manual_seed(seed)
    config = deepseek_mla_config(model_class.config_class, layers, 64, 4, 97, 64, 24, 16, 16, 8,
                                 12, intermediate_size=160, **{**router, **extra})
    return save_hf(model_class(config).eval(), tmp, dtype)


def imported_mla(tmp_path, kind, models):
    """imported's HF directory and checkpoint of the DeepSeek model `kind` of `models`, and the
    checkpoint's metadata and the HF config.json, checking the import's multi-latent attention:
    format version 3, the latent norms (qk_layernorm), the ranks and head widths, no biases."""
    hf_dir, ckpt = imported(tmp_path, kind, models)
    meta, hf_cfg = metadata(ckpt), json.loads((hf_dir / "config.json").read_text())
    c = meta["config"]
    # A version-2 reader would build other parameters (q, k, v): version 3.
    assert meta["format_version"] == 3
    assert c["multi_latent_attention"] and c["qk_layernorm"]
    assert (c["q_lora_rank"], c["kv_lora_rank"], c["qk_head_dim"], c["qk_pos_emb_head_dim"],
            c["v_head_dim"]) == (hf_cfg["q_lora_rank"] or 0, 16, 16, 8, 12)
    assert (c["add_bias_linear"], c["add_qkv_bias"]) == (False, False)
    return hf_dir, ckpt, meta, hf_cfg


def without_yarn_type(key, got, want, want_config):
    """rope_parameters without "type" (the export's rope_scaling also says type: yarn)."""
    if key == "rope_parameters":
        got, want = ({k: v for k, v in d.items() if k != "type"} for d in (got, want))
    return got, want


def hf_forward(hf, ids, routing_margin=deepseek_routing_margin):
    """HF's logits and the least gap, over every token and expert layer, between the last group
    and the last expert chosen and the first left out: `routing_margin(hf, router_logits)`,
    transformers' DeepseekV3TopkRouter's by default."""
    with torch.no_grad():
        out = hf(torch.from_numpy(ids), output_router_logits=True)
    return out.logits.numpy(), routing_margin(hf, out.router_logits)


def hf_logits(hf, ids, routing_margin=deepseek_routing_margin):
    """HF's logits, checking that no token's group or expert choice is near a tie (braid's
    router logits agree to ~1e-6, so braid chooses the same experts); `routing_margin`: as
    hf_forward's."""
    logits, margin = hf_forward(hf, ids, routing_margin)
    assert margin > MARGIN, f"a near tie in the routing ({margin:.1e})"
    return logits


def export_with_clear_routing(tmp_path, checkpoint, routing_margin=deepseek_routing_margin,
                              **fields):
    """The first of seeds 3 to 10 whose braid-trained checkpoint, `checkpoint(path, seed,
    **fields)`, exported, routes IDS in transformers with no near tie (`routing_margin`: as
    hf_forward's): (braid's model, the export's directory, transformers' model of it). What
    training does to the weights is braid's C++'s; the tests need braid and transformers to
    choose alike."""
    for seed in range(3, 11):
        model = checkpoint(tmp_path / f"ckpt{seed}", seed, **fields)
        out = tmp_path / f"out{seed}"
        r = run_tool("export", "--load", tmp_path / f"ckpt{seed}", "--hf-dir", out)
        assert r.returncode == 0, r.stderr
        hf = load_hf(out)
        if hf_forward(hf, IDS, routing_margin)[1] > MARGIN:
            return model, out, hf
    pytest.fail("every seed's routing has a near tie")


def assert_mixed_bf16_round_trip(tmp_path, f32_dir, f32_names, bf16_names):
    """transformers' bf16 save of the f32 model in `f32_dir` keeps `f32_names` (the routers'
    biases, ...) in f32 and `bf16_names` in bf16: the import is mixed, so braid computes in f32
    (params_dtype), each tensor stored as it came, and the export gives them back bit for bit
    with torch_dtype bfloat16."""
    hf_dir = tmp_path / "hf"
    transformers.AutoModelForCausalLM.from_pretrained(f32_dir, dtype=torch.bfloat16
                                                      ).save_pretrained(hf_dir)
    want = hf_weights(hf_dir)
    for name in f32_names:
        assert want[name].dtype == torch.float32, name
    for name in bf16_names:
        assert want[name].dtype == torch.bfloat16, name
    assert run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "ckpt").returncode == 0
    assert metadata(tmp_path / "ckpt")["config"]["params_dtype"] == "f32"
    r = run_tool("export", "--load", tmp_path / "ckpt", "--hf-dir", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert_same_bits(hf_weights(tmp_path / "out"), want)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def assert_resaves_alike(model, ckpt, dst):
    """braid's save_checkpoint of `model` (loaded from the import `ckpt`) at `dst` writes the
    index, the config and the bytes the import wrote. Returns the save's metadata."""
    trainer = braid.Trainer(model, braid.AdamWConfig(), braid.LRSchedule(lr=1e-3,
                                                                         style="constant"))
    braid.save_checkpoint(str(dst), trainer, save_optim=False)
    meta, resaved = metadata(ckpt), metadata(dst)
    assert resaved["tensors"] == meta["tensors"]
    assert {k: v for k, v in resaved["config"].items() if k in meta["config"]} == meta["config"]
    _, want = convert_hf.read_checkpoint(str(ckpt))
    _, got = convert_hf.read_checkpoint(str(dst))
    for name in want:
        assert got[name].dtype == want[name].dtype
        np.testing.assert_array_equal(got[name].array, want[name].array, err_msg=name)
    return resaved


def assert_mtp_layers_dropped(tmp_path, hf_dir, ckpt, names):
    """hf_dir (of 3 layers, imported as `ckpt`) with a multi-token-prediction layer after its
    last (model.layers.3.`names`, and num_nextn_predict_layers 1 in its config, as the hub
    checkpoints hold them; transformers does not load them) imports with --no-mtp to the same
    tensors and exports num_nextn_predict_layers 0; without --no-mtp the layer, not a whole
    depth, is refused, and so are the extra tensors with that count 0."""
    state = load_file(str(hf_dir / "model.safetensors"))
    for name in names:
        state[f"model.layers.3.{name}"] = torch.ones(4, 4)
    save_file(state, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    assert json.loads((hf_dir / "config.json").read_text())["num_nextn_predict_layers"] == 1
    r = run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "ckpt2", "--no-mtp")
    assert r.returncode == 0, r.stderr
    _, want = convert_hf.read_checkpoint(str(ckpt))
    _, got = convert_hf.read_checkpoint(str(tmp_path / "ckpt2"))
    assert sorted(got) == sorted(want)
    r = run_tool("export", "--load", tmp_path / "ckpt2", "--hf-dir", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "out" / "config.json").read_text())[
        "num_nextn_predict_layers"] == 0
    assert_fails(run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "ckpt3"),
                 "model.layers.3.")
    edit_config(hf_dir, num_nextn_predict_layers=0)
    assert_fails(run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "ckpt4"),
                 "unexpected tensor model.layers.3.")


def assert_bf16_round_trip(tmp_path, hf_dir):
    """A bf16 HF checkpoint imports as bf16 and exports back bit for bit."""
    assert run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "ckpt").returncode == 0
    assert metadata(tmp_path / "ckpt")["config"]["params_dtype"] == "bf16"
    r = run_tool("export", "--load", tmp_path / "ckpt", "--hf-dir", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    want = hf_weights(hf_dir)
    assert all(t.dtype == torch.bfloat16 for t in want.values())
    assert_same_bits(hf_weights(tmp_path / "out"), want)
