"""tools/convert_hf.py with DeepSeek-V3: tiny random DeepseekV3ForCausalLM (multi-latent
attention: a query latent of 24, a key/value latent of 16, heads of 16 + 8 RoPE channels for q
and k and of 12 for v; the first layer dense, then 8 experts in 4 groups, top 4 of the best 2, a
random e_score_correction_bias, an ungated shared expert) as transformers' save_pretrained writes
them, imported into braid and exported back.

- the round trip is bit-exact (the biases included) and the config equivalent; the checkpoint
  is format version 3; transformers loads the export with no missing or unexpected keys; braid's
  model of the import computes the logits of both the original and the exported HF model; also
  without a query latent (q_proj, DeepSeek-V2-Lite's), dense (first_k_dense_replace = the layer
  count), tied, and without groups
- braid's C++ loads the import and saves it as the import wrote it; a tp 2 x pp 2 re-save
  exports exactly; tools/generate.py decodes the import as transformers' generate does
- a checkpoint braid trained itself exports as DeepSeek-V3, and transformers computes its logits
- the multi-token-prediction layers are dropped; num_key_value_heads above the head count
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
from safetensors.torch import load_file, save_file

import braid
from braid.generate import config_from_metadata
from mpi_job import mpi_env
from test_convert_hf import (LOGITS_RTOL, RESAVE, ROOT, assert_fails, assert_same_bits,
                             convert_hf, edit_config, hf_weights, load_hf, perturb, run_tool)
from test_convert_hf_moe import metadata

EXPERTS, TOPK = 8, 4
IDS = np.random.default_rng(0).integers(0, 97, size=(3, 16), dtype=np.int64)
MARGIN = 1e-3  # the least gap between a token's last chosen and first unchosen group or expert
BIAS = "mlp.gate.e_score_correction_bias"
YARN = {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}  # V3's


def deepseek_v3(tmp, layers=3, dtype=torch.float32, seed=3, **extra):
    """A DeepseekV3ForCausalLM saved by save_pretrained: hidden 64, 4 heads, q_lora_rank 24,
    kv_lora_rank 16, qk_nope_head_dim 16, qk_rope_head_dim 8, v_head_dim 12; the first layer
    dense (intermediate_size 160), then 8 experts of 32 in 4 groups (top 4 of the best 2), a
    shared expert of 32, routed_scaling_factor 2.5; routers wide and the biases random so that
    they change choices. `extra`: more config fields. `seed`: one whose routing has no near tie
    on IDS."""
    torch.manual_seed(seed)
    fields = dict(
        vocab_size=97, hidden_size=64, intermediate_size=160, moe_intermediate_size=32,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        max_position_embeddings=64, n_routed_experts=EXPERTS, num_experts_per_tok=TOPK,
        n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
        norm_topk_prob=True, routed_scaling_factor=2.5, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default",
                                                    "rope_theta": 10000.0})
    fields.update(extra)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**fields)).eval()
    perturb(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model.to(dtype).save_pretrained(tmp)
    return tmp


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
}
CONFIG_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
               "tie_word_embeddings", "attention_bias", "rope_parameters", "rope_interleave",
               "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
               "v_head_dim", "qk_head_dim", "head_dim", "n_routed_experts",
               "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
               "first_k_dense_replace", "n_group", "topk_group", "norm_topk_prob",
               "routed_scaling_factor", "max_position_embeddings", "vocab_size")


def braid_model(ckpt):
    """A braid.GPTModel with the checkpoint's config, parameters and expert biases (read by the
    tool's reader)."""
    meta, tensors = convert_hf.read_checkpoint(str(ckpt))
    model = braid.GPTModel(config_from_metadata(meta["config"]), device="cpu", seed=1)
    params, biases = model.parameters(), model.expert_biases()
    assert sorted([*params, *biases]) == sorted(tensors)
    for name, t in tensors.items():
        assert t.dtype == "F32"
        (params[name] if name in params else biases[name]).copy_(
            np.ascontiguousarray(t.array, dtype=np.float32))
    return model


def imported(tmp_path, kind):
    hf_dir = MODELS[kind](tmp_path / "hf")
    r = run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "ckpt")
    assert r.returncode == 0, r.stderr
    return hf_dir, tmp_path / "ckpt"


def hf_forward(hf, ids):
    """HF's logits and the least gap, over every token and expert layer, between the last group
    and the last expert chosen and the first left out (transformers' DeepseekV3TopkRouter)."""
    with torch.no_grad():
        out = hf(torch.from_numpy(ids), output_router_logits=True)
    routers = [layer.mlp.gate for layer in hf.model.layers if hasattr(layer.mlp, "experts")]
    assert len(routers) == len(out.router_logits or ())
    margin = float("inf")
    for router, logits in zip(routers, out.router_logits):
        scores = logits.sigmoid() + router.e_score_correction_bias
        groups, topk_group, k = router.num_group, router.topk_group, router.top_k
        if groups > 1:
            sums = scores.view(-1, groups, EXPERTS // groups).topk(2, dim=-1).values.sum(-1)
            top = sums.topk(topk_group + 1, dim=-1)
            margin = min(margin, (top.values[:, topk_group - 1] -
                                  top.values[:, topk_group]).min().item())
            keep = torch.zeros_like(sums).scatter_(1, top.indices[:, :topk_group], 1)
            scores = scores.masked_fill(
                ~keep.repeat_interleave(EXPERTS // groups, dim=1).bool(), float("-inf"))
        top = scores.topk(k + 1, dim=-1).values
        margin = min(margin, (top[:, k - 1] - top[:, k]).min().item())
    return out.logits.numpy(), margin


def hf_logits(hf, ids):
    """HF's logits, checking that no token's group or expert choice is near a tie (braid's
    router logits agree to ~1e-6, so braid chooses the same experts)."""
    logits, margin = hf_forward(hf, ids)
    assert margin > MARGIN, f"a near tie in the routing ({margin:.1e})"
    return logits


def assert_same_logits(model, hf, ids):
    got = np.from_dlpack(model.logits(ids))
    want = hf_logits(hf, ids)
    assert got.shape == want.shape
    err = np.abs(got.astype(np.float64) - want).max() / np.abs(want).max()
    assert err <= LOGITS_RTOL, err


def assert_equivalent_configs(got_dir, want_dir):
    got = transformers.AutoConfig.from_pretrained(got_dir)
    want = transformers.AutoConfig.from_pretrained(want_dir)
    assert type(got) is type(want)
    for key in CONFIG_KEYS:
        if hasattr(want, key):
            assert getattr(got, key) == getattr(want, key), (key, getattr(got, key),
                                                             getattr(want, key))


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_round_trip_is_exact_and_logits_match(tmp_path, kind):
    hf_dir, ckpt = imported(tmp_path, kind)
    meta, hf_cfg = metadata(ckpt), json.loads((hf_dir / "config.json").read_text())
    c = meta["config"]
    # A version-2 reader would build other parameters (q, k, v): version 3.
    assert meta["format_version"] == 3
    assert c["multi_latent_attention"] and c["qk_layernorm"]
    assert (c["q_lora_rank"], c["kv_lora_rank"], c["qk_head_dim"], c["qk_pos_emb_head_dim"],
            c["v_head_dim"]) == (hf_cfg["q_lora_rank"] or 0, 16, 16, 8, 12)
    # kv_channels: the query/key head width, as braid's C++ saves an MLA model
    assert (c["kv_channels"], c["num_query_groups"], c["rotary_percent"]) == (24, 4, 1.0)
    assert (c["add_bias_linear"], c["add_qkv_bias"]) == (False, False)
    index = meta["tensors"]
    a = "model.layers.0.self_attn."
    assert index[a + "kv_a_proj_with_mqa.weight"]["shape"] == [24, 64]
    assert index[a + "kv_b_proj.weight"]["shape"] == [4 * (16 + 12), 16]
    assert index[a + "o_proj.weight"]["shape"] == [64, 4 * 12]
    assert (a + "q_a_proj.weight" in index) == (a + "q_a_layernorm.weight" in index) == (
        hf_cfg["q_lora_rank"] is not None) != (a + "q_proj.weight" in index)
    if kind == "dense":
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
    assert_equivalent_configs(out, hf_dir)
    model = braid_model(ckpt)
    original, back = load_hf(hf_dir), load_hf(out)
    assert [type(layer.mlp).__name__ for layer in back.model.layers] == \
        [type(layer.mlp).__name__ for layer in original.model.layers]
    assert_same_logits(model, back, IDS)
    assert_same_logits(model, original, IDS)


def test_bf16_round_trip_is_exact(tmp_path):
    # Loaded in bf16, transformers keeps the routers and their biases in f32: the import is
    # mixed, so braid computes in f32 (params_dtype), each tensor stored as it came.
    f32_dir = deepseek_v3(tmp_path / "f32")
    hf_dir = tmp_path / "hf"
    transformers.AutoModelForCausalLM.from_pretrained(f32_dir, dtype=torch.bfloat16
                                                      ).save_pretrained(hf_dir)
    want = hf_weights(hf_dir)
    assert want[f"model.layers.1.{BIAS}"].dtype == torch.float32
    assert want["model.layers.1.self_attn.kv_b_proj.weight"].dtype == torch.bfloat16
    assert run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "ckpt").returncode == 0
    assert metadata(tmp_path / "ckpt")["config"]["params_dtype"] == "f32"
    r = run_tool("export", "--load", tmp_path / "ckpt", "--hf-dir", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert_same_bits(hf_weights(tmp_path / "out"), want)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_braids_loader_reads_the_import_and_saves_it_alike(tmp_path):
    # C++ load_parameters takes the import's tensors (the latent projections, their norms, the
    # biases); save_checkpoint writes the index, the format version and the bytes the import
    # wrote.
    hf_dir, ckpt = imported(tmp_path, "deepseek_v3")
    meta = metadata(ckpt)
    model = braid.GPTModel(config_from_metadata(meta["config"]), device="cpu", seed=9)
    braid.load_parameters(str(ckpt), model)
    assert_same_logits(model, load_hf(hf_dir), IDS)
    trainer = braid.Trainer(model, braid.AdamWConfig(), braid.LRSchedule(lr=1e-3,
                                                                         style="constant"))
    braid.save_checkpoint(str(tmp_path / "resaved"), trainer, save_optim=False)
    resaved = metadata(tmp_path / "resaved")
    assert resaved["format_version"] == 3
    assert resaved["tensors"] == meta["tensors"]
    assert {k: v for k, v in resaved["config"].items() if k in meta["config"]} == meta["config"]
    _, want = convert_hf.read_checkpoint(str(ckpt))
    _, got = convert_hf.read_checkpoint(str(tmp_path / "resaved"))
    for name in want:
        assert got[name].dtype == want[name].dtype
        np.testing.assert_array_equal(got[name].array, want[name].array, err_msg=name)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_export_of_a_checkpoint_braid_saved_at_tp2_pp2(tmp_path, q_lora_rank):
    """braid's C++ loads the import into a tp = 2, pp = 2 job (4 ranks: the up projections and
    o_proj split by heads, the down projections and latent norms replicated) and saves it;
    export reassembles that save bit for bit."""
    hf_dir = deepseek_v3(tmp_path / "hf", layers=4, q_lora_rank=q_lora_rank)
    ckpt = tmp_path / "ckpt"
    assert run_tool("import", "--hf-dir", hf_dir, "--save", ckpt).returncode == 0
    script = tmp_path / "resave.py"
    script.write_text(RESAVE)
    r = subprocess.run(["mpirun", "-np", "4", "--oversubscribe", sys.executable, str(script),
                        str(ckpt), str(tmp_path / "sharded")],
                       env=mpi_env(), capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    meta = metadata(tmp_path / "sharded")
    assert meta["format_version"] == 3
    index = meta["tensors"]
    a = "model.layers.0.self_attn."
    assert [s["length"] for s in index[a + "kv_b_proj.weight"]["shards"]] == [56, 56]
    assert [s["length"] for s in index[a + "o_proj.weight"]["shards"]] == [24, 24]
    assert index[a + "kv_a_proj_with_mqa.weight"]["split_dim"] == -1
    out = tmp_path / "out"
    r = run_tool("export", "--load", tmp_path / "sharded", "--hf-dir", out)
    assert r.returncode == 0, r.stderr
    assert_same_bits(hf_weights(out), hf_weights(hf_dir))
    load_hf(out)


def test_generate_tool_decodes_an_import_as_transformers_does(tmp_path):
    # tools/generate.py builds the model from the checkpoint's metadata and decodes over braid's
    # KV cache; transformers' generate over its own. Dense, with weights drawn wider than
    # transformers' init so that every step's top two logits are apart.
    hf_dir = deepseek_v3(tmp_path / "hf", first_k_dense_replace=3, initializer_range=0.1)
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
    # which transformers' causal LM does not load: import drops them too.
    hf_dir, ckpt = imported(tmp_path, "deepseek_v3")
    state = load_file(str(hf_dir / "model.safetensors"))
    for name in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight",
                 "self_attn.kv_b_proj.weight", "mlp.experts.0.up_proj.weight"):
        state[f"model.layers.3.{name}"] = torch.ones(4, 4)
    save_file(state, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    assert json.loads((hf_dir / "config.json").read_text())["num_nextn_predict_layers"] == 1
    r = run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "ckpt2")
    assert r.returncode == 0, r.stderr
    _, want = convert_hf.read_checkpoint(str(ckpt))
    _, got = convert_hf.read_checkpoint(str(tmp_path / "ckpt2"))
    assert sorted(got) == sorted(want)
    r = run_tool("export", "--load", tmp_path / "ckpt2", "--hf-dir", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "out" / "config.json").read_text())[
        "num_nextn_predict_layers"] == 0
    edit_config(hf_dir, num_nextn_predict_layers=0)
    assert_fails(run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "ckpt3"),
                 "unexpected tensor model.layers.3.")


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
    """A checkpoint braid saved itself after a training step with the expert-bias update on,
    its routers widened first (as the HF models'): 3 layers, multi-latent attention of
    test_hf_deepseek_v3_oracle.py's shape, the first layer dense, 8 experts in 4 groups, top 4
    of the best 2, an ungated shared expert, scaling 2.5. `fields`: more config."""
    cfg = braid.TransformerConfig.preset("llama-tiny")
    cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups = 3, 64, 4, 4
    cfg.ffn_hidden_size, cfg.vocab_size, cfg.max_position_embeddings = 160, 97, 64
    cfg.norm_eps = 1e-6  # DeepseekV3ForCausalLM's latent norms' whatever rms_norm_eps says
    cfg.multi_latent_attention, cfg.qk_layernorm, cfg.kv_channels = True, True, 0
    cfg.q_lora_rank, cfg.kv_lora_rank, cfg.v_head_dim = 24, 16, 12
    cfg.qk_head_dim, cfg.qk_pos_emb_head_dim = 16, 8
    cfg.num_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size = 8, 4, 32
    cfg.moe_router_score_function, cfg.moe_router_enable_expert_bias = "sigmoid", True
    cfg.moe_router_bias_update_rate = 0.02
    cfg.moe_router_num_groups, cfg.moe_router_group_topk = 4, 2
    cfg.moe_router_topk_scaling_factor, cfg.moe_shared_expert_intermediate_size = 2.5, 32
    cfg.moe_layers, cfg.moe_aux_loss_coeff = [0, 1, 1], 0.01
    for name, value in fields.items():
        setattr(cfg, name, value)
    model = braid.GPTModel(cfg, device="cpu", seed=seed)
    rng = np.random.default_rng(seed)
    for name, p in model.parameters().items():
        if name.endswith("mlp.gate.weight"):
            p.copy_(rng.normal(0.0, 0.2, size=tuple(p.shape)).astype(np.float32))
    trainer = braid.Trainer(model, braid.AdamWConfig(), braid.LRSchedule(lr=1e-3,
                                                                         style="constant"))
    trainer.train_step(IDS, IDS)
    braid.save_checkpoint(str(path), trainer)
    return model


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
], ids=["moe", "no-q-latent", "dense"])
def test_a_trained_braid_model_exports(tmp_path, fields):
    # The first of a few seeds whose trained model routes IDS with no near tie.
    for seed in range(3, 11):
        model = braid_mla_checkpoint(tmp_path / f"ckpt{seed}", seed, **fields)
        out = tmp_path / f"out{seed}"
        r = run_tool("export", "--load", tmp_path / f"ckpt{seed}", "--hf-dir", out)
        assert r.returncode == 0, r.stderr
        hf = load_hf(out)
        if hf_forward(hf, IDS)[1] > MARGIN:
            break
    else:
        pytest.fail("every seed's routing has a near tie")
    assert hf.config.model_type == "deepseek_v3" and hf.config.rope_interleave
    assert (hf.config.q_lora_rank, hf.config.kv_lora_rank) == (fields.get("q_lora_rank", 24) or
                                                               None, 16)
    assert (hf.config.qk_nope_head_dim, hf.config.qk_rope_head_dim, hf.config.v_head_dim) == (
        16, 8, 12)
    if fields is DENSE:
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
    assert_same_logits(model, hf, IDS)


# ---- refused -----------------------------------------------------------------------------------

@pytest.mark.parametrize("changes,words", [
    ({"rope_interleave": False}, ("rope_interleave", "interleaved pairs")),
    ({"rope_scaling": YARN}, ("rope_scaling", "braid has no YaRN")),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0}},
     ("rope_parameters.rope_type", "braid has no YaRN")),
    ({"attention_bias": True}, ("attention_bias", "q_a_proj, kv_a_proj_with_mqa and o_proj")),
    ({"num_key_value_heads": 2}, ("num_key_value_heads", "its own key and value")),
    ({"v_head_dim": 32}, ("v_head_dim", "qk_nope_head_dim + qk_rope_head_dim = 24")),
    ({"qk_rope_head_dim": 7}, ("qk_rope_head_dim should be a positive even number",)),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}},
     ("quantization_config (fp8)", "dequantize")),
    ({"hidden_act": "gelu"}, ("hidden_act",)),
    ({"rms_norm_eps": 1e-5}, ("rms_norm_eps", "latent norms (q_a_layernorm, kv_a_layernorm) use "
                              "1e-06 whatever rms_norm_eps says")),
    ({"kv_lora_rank": 8}, ("kv_a_proj_with_mqa.weight", "[24, 64]", "[16, 64]")),
    ({"q_lora_rank": None}, ("the HF weights have no model.layers.0.self_attn.q_proj.weight",)),
    ({"norm_topk_prob": False}, ("norm_topk_prob", "always divides")),
    ({"topk_group": 1}, ("n_group", "num_experts_per_tok is 4 and topk_group 1")),
    ({"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2"},
     ("unsupported architecture DeepseekV2ForCausalLM", "topk_method")),
])
def test_refuses_what_braid_cannot_hold(tmp_path, changes, words):
    hf_dir = deepseek_v3(tmp_path / "hf")
    edit_config(hf_dir, **changes)
    assert_fails(run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "c"), *words)
    assert not (tmp_path / "c").exists()


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
