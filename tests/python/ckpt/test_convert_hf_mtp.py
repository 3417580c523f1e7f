"""tools/convert_hf.py with multi-token prediction: braid's MTP depths (mtp_num_layers) as
DeepSeek-V3's and GLM-4.5's MTP layers, model.layers.{L}.* after the last (enorm, hnorm,
eh_proj, a layer with experts, shared_head.norm, and copies of embed_tokens and lm_head). The
models: braid checkpoints of 3 layers trained a step with one depth (layer 3), the first layer
dense, then the experts of test_convert_hf_deepseek_v3.py (multi-latent attention) and of
test_convert_hf_dots1.py (GLM-4.5's attention: q, k, v biases, RoPE on half of each head).

- convert_hf.py's parameter list of a model with MTP depths is the one braid's C++ saves
- the export writes the depth under DeepSeek's names with num_nextn_predict_layers 1 and the
  embedding and head copies; transformers loads the causal LM (the MTP layer its only
  unexpected keys) with braid's logits, and its own MTP layer (MtpModel, which drafts for
  generate(use_mtp=True)) reads the export's and computes braid's depth-1 loss
- the export imports back bit for bit (format version 4, mtp_num_layers 1); braid's C++ loads
  the import and re-saves it alike; a tp 2 x pp 2 re-save exports exactly
- --no-mtp leaves the depths out, on import and on export
- an MTP layer whose embedding or head copy differs from the model's, a depth or a tensor
  missing, a dense DeepSeek-V3 with an MTP layer are refused with one line; without the copies
  the layer imports alike; transformers' save_pretrained (no MTP tensors) imports without MTP,
  saying so; export refuses MTP depths an architecture has no layers for
"""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file
from transformers.modeling_layers import MtpModel

import braid
from braid.generate import config_from_metadata
from convert_test_util import BIAS, MARGIN, assert_resaves_alike, hf_forward
from hf_oracle import deepseek_choices
from sharded_saves import resave_at_tp2_pp2
from test_convert_hf import (IDS, assert_fails, assert_same_bits, assert_same_logits,
                             braid_model, convert_hf, edit_config, hf_weights, load_hf, metadata,
                             run_tool)
from test_convert_hf_deepseek_v3 import braid_mla_checkpoint, deepseek_v3
from test_convert_hf_dots1 import braid_sigmoid_checkpoint, sigmoid_moe

LAYERS = 3  # the MTP layer is model.layers.3
DEPTH = f"model.layers.{LAYERS}."
COPIES = {DEPTH + "embed_tokens.weight": "model.embed_tokens.weight",
          DEPTH + "shared_head.head.weight": "lm_head.weight"}
ARCHS = {
    "deepseek_v3": (transformers.DeepseekV3ForCausalLM, braid_mla_checkpoint, {}),
    "glm4_moe": (transformers.Glm4MoeForCausalLM, braid_sigmoid_checkpoint,
                 {"qk_layernorm": False, "add_qkv_bias": True, "rotary_percent": 0.5}),
}
LOSS_RTOL = 1e-5


def load_with_mtp(out, arch):
    """transformers' causal LM of the export `out`, checking that the MTP layer's tensors are
    its only unexpected keys, and its MtpModel (which raises on a missing weight). The causal
    LM ignores, and MtpModel reads, the MTP layers of the full-size models alone (layer 61 of
    DeepSeek-V3, 46 and 92 of GLM-4.5's): told about layer 3 here."""
    cls = ARCHS[arch][0]
    hf, info = cls.from_pretrained(out, output_loading_info=True, attn_implementation="eager")
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert info["unexpected_keys"] and all(k.startswith(DEPTH) for k in info["unexpected_keys"])
    with pytest.MonkeyPatch.context() as m:
        m.setattr(cls, "_keys_to_ignore_on_load_unexpected", [rf"model\.layers\.{LAYERS}\..*"])
        hf = cls.from_pretrained(out, attn_implementation="eager").float().eval()
        mtp = MtpModel.from_pretrained(hf).float().eval()
    return hf, mtp


def transformers_mtp_loss(hf, mtp, ids):
    """transformers' MTP layer as braid (megatron-core) trains depth 1 on `ids`: position p reads
    h_0 (the final norm's output) at p and the id at p + 1, at RoPE position p, and predicts the
    target at p + 1 (the ids, as in braid's step below); the last position, with none, is left
    out. (The mean cross-entropy, the least gap of the layer's routing.)"""
    gate = mtp.layers[0].mtp_block.mlp.gate
    seen = []
    hook = gate.register_forward_hook(lambda module, args, out: seen.append(args[0].detach()))
    ids = torch.from_numpy(ids)
    n = ids.shape[1] - 1
    with torch.no_grad():
        h0 = hf.model(ids).last_hidden_state
        h1 = mtp.forward_layer(0, h0[:, :n], torch.arange(n).expand(ids.shape[0], n), None,
                               input_ids=ids[:, 1:])
        logits = mtp.shared_head(h1).double()
    hook.remove()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    x = seen[0].reshape(-1, gate.hidden_dim).float()
    _, group_gap, expert_gap = deepseek_choices(F.linear(x, gate.weight.float()),
                                                gate.e_score_correction_bias, gate.num_group,
                                                gate.topk_group, gate.top_k)
    return float(loss), min(float(group_gap), float(expert_gap))


def trainer(model):
    return braid.Trainer(model, braid.AdamWConfig(), braid.LRSchedule(lr=1e-3, style="constant"))


@dataclass
class Trained:
    arch: str
    ckpt: Path  # braid's save, with one MTP depth
    out: Path  # its export
    logits: np.ndarray  # transformers' of IDS
    mtp_loss: float  # transformers_mtp_loss's


@pytest.fixture(scope="module", params=sorted(ARCHS))
def trained(request, tmp_path_factory):
    """The first of seeds 3 to 10 whose braid checkpoint (one MTP depth), exported, routes IDS
    in transformers with no near tie in the model or its MTP layer."""
    arch, tmp = request.param, tmp_path_factory.mktemp(request.param)
    _, checkpoint, fields = ARCHS[arch]
    for seed in range(3, 11):
        ckpt, out = tmp / f"ckpt{seed}", tmp / f"out{seed}"
        checkpoint(ckpt, seed, mtp_num_layers=1, **fields)
        r = run_tool("export", "--load", ckpt, "--hf-dir", out)
        assert r.returncode == 0, r.stderr
        hf, mtp = load_with_mtp(out, arch)
        logits, margin = hf_forward(hf, IDS)
        loss, mtp_margin = transformers_mtp_loss(hf, mtp, IDS)
        if min(margin, mtp_margin) > MARGIN:
            return Trained(arch, ckpt, out, logits, loss)
    pytest.fail("every seed's routing has a near tie")


def test_checkpoint_specs_are_what_braid_saves(tmp_path):
    # Two depths after 3 layers (the first dense), multi-latent attention or GQA with tied
    # embeddings: the names, shapes and split dims of braid's own save, expert biases included.
    for mla in (True, False):
        cfg = braid.TransformerConfig.preset("llama-tiny")
        cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups = 3, 64, 4, 2
        cfg.vocab_size, cfg.mtp_num_layers, cfg.tie_embeddings = 97, 2, not mla
        for name, value in dict(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32,
                                moe_router_score_function="sigmoid", moe_layers=[0, 1, 1],
                                moe_router_enable_expert_bias=True,
                                moe_shared_expert_intermediate_size=32).items():
            setattr(cfg, name, value)
        if mla:
            cfg.norm_eps, cfg.multi_latent_attention, cfg.qk_layernorm = 1e-6, True, True
            cfg.kv_channels, cfg.num_query_groups, cfg.q_lora_rank, cfg.kv_lora_rank = 0, 4, 24, 16
            cfg.v_head_dim, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim = 12, 16, 8
        model = braid.GPTModel(cfg, device="cpu", seed=1)
        braid.save_checkpoint(str(tmp_path / str(mla)), trainer(model), save_optim=False)
        meta = metadata(tmp_path / str(mla))
        specs = convert_hf.checkpoint_specs(meta["config"])
        assert {n: (s, d) for n, s, d in specs} == {
            n: (e["shape"], e["split_dim"]) for n, e in meta["tensors"].items()}
        assert f"model.layers.4.{BIAS}" in meta["tensors"]  # the second depth's


def test_export_writes_deepseeks_mtp_layer(trained):
    meta, tensors = convert_hf.read_checkpoint(str(trained.ckpt))
    assert meta["format_version"] == 4 and meta["config"]["mtp_num_layers"] == 1
    config = json.loads((trained.out / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"],
            config["num_nextn_predict_layers"]) == (trained.arch, LAYERS, 1)
    written = hf_weights(trained.out)
    depth = {n: t for n, t in tensors.items() if n.startswith(DEPTH)}
    assert depth[DEPTH + "eh_proj.weight"].shape == [64, 128]
    assert {DEPTH + n for n in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight",
                                "mlp.experts.7.down_proj.weight", BIAS)} <= set(depth)
    assert np.abs(depth[DEPTH + BIAS].array).max() > 0  # moved by the bias update
    hf_name = {n: n.replace(".shared_expert.", ".shared_experts.") for n in depth}
    assert {n for n in written if n.startswith(DEPTH)} == set(hf_name.values()) | set(COPIES)
    for name, t in depth.items():
        np.testing.assert_array_equal(written[hf_name[name]].numpy(), t.array, err_msg=name)
    for copy, of in COPIES.items():
        assert torch.equal(written[copy], written[of]), copy


def test_transformers_computes_the_export_as_braid(trained):
    # The causal LM's logits, and transformers' MTP layer's depth-1 loss: braid's, trained.
    model = braid_model(trained.ckpt)
    assert_same_logits(model, IDS, trained.logits)
    got = trainer(model).train_step(IDS, IDS).mtp_losses
    assert len(got) == 1
    assert abs(got[0] - trained.mtp_loss) <= LOSS_RTOL * trained.mtp_loss, (got, trained.mtp_loss)


def assert_same_checkpoint_tensors(got_ckpt, want_ckpt, leave_out=None):
    _, got = convert_hf.read_checkpoint(str(got_ckpt))
    _, want = convert_hf.read_checkpoint(str(want_ckpt))
    want = {n: t for n, t in want.items() if not (leave_out and n.startswith(leave_out))}
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype, name
        np.testing.assert_array_equal(got[name].array, t.array, err_msg=name)


def test_import_of_the_export_is_exact(trained, tmp_path):
    back = tmp_path / "back"
    r = run_tool("import", "--hf-dir", trained.out, "--save", back)
    assert r.returncode == 0 and not r.stderr, r.stderr
    assert "and 1 MTP depth," in r.stdout
    meta = metadata(back)
    assert meta["format_version"] == 4 and meta["config"]["mtp_num_layers"] == 1
    assert_same_checkpoint_tensors(back, trained.ckpt)
    # braid's C++ loads it (the depth's parameters and expert bias) and saves it alike
    model = braid.GPTModel(config_from_metadata(meta["config"]), device="cpu", seed=9)
    braid.load_parameters(str(back), model)
    assert assert_resaves_alike(model, back, tmp_path / "resaved")["format_version"] == 4


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_export_of_a_checkpoint_braid_saved_at_tp2_pp2(tmp_path, arch):
    # 4 layers, 2 a stage: the depth (layer 4) on the last stage, beside its own copy of the
    # embedding. braid's save -> export -> import -> a tp 2 x pp 2 save -> export: the same.
    _, checkpoint, fields = ARCHS[arch]
    checkpoint(tmp_path / "trained", 3, mtp_num_layers=1, num_layers=4, moe_layers=[0, 1, 1, 1],
               **fields)
    hf_dir = tmp_path / "hf"
    assert run_tool("export", "--load", tmp_path / "trained", "--hf-dir", hf_dir).returncode == 0
    assert run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "ckpt").returncode == 0
    resave_at_tp2_pp2(tmp_path / "ckpt", tmp_path / "sharded")
    meta = metadata(tmp_path / "sharded")
    assert meta["format_version"] == 4
    assert {s["file"] for s in meta["tensors"]["model.layers.4.eh_proj.weight"]["shards"]} == {
        "mp_rank_00_001.safetensors"}
    r = run_tool("export", "--load", tmp_path / "sharded", "--hf-dir", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert_same_bits(hf_weights(tmp_path / "out"), hf_weights(hf_dir))


def test_no_mtp_leaves_the_depths_out(trained, tmp_path):
    r = run_tool("import", "--hf-dir", trained.out, "--save", tmp_path / "plain", "--no-mtp")
    assert r.returncode == 0 and not r.stderr, r.stderr
    meta = metadata(tmp_path / "plain")
    assert "mtp_num_layers" not in meta["config"]
    assert meta["format_version"] == (3 if trained.arch == "deepseek_v3" else 2)
    assert_same_checkpoint_tensors(tmp_path / "plain", trained.ckpt, leave_out=DEPTH)
    out = tmp_path / "out"
    r = run_tool("export", "--load", trained.ckpt, "--hf-dir", out, "--no-mtp")
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 0
    assert_same_bits(hf_weights(out), {n: t for n, t in hf_weights(trained.out).items()
                                       if not n.startswith(DEPTH)})
    load_hf(out)  # no unexpected keys


def edited_export(trained, dst, edit):
    """A copy of the export at `dst`, its weights (name -> torch tensor) edited by `edit`."""
    shutil.copytree(trained.out, dst)
    weights = load_file(str(dst / "model.safetensors"))
    edit(weights)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def nudged(name):
    def edit(weights):
        weights[name] = weights[name].clone()
        weights[name].view(-1)[0] += 1.0
    return edit


@pytest.mark.parametrize("edit,changes,words", [
    (nudged(DEPTH + "embed_tokens.weight"), {},
     (f"{DEPTH}embed_tokens.weight differs from model.embed_tokens.weight", "--no-mtp")),
    (nudged(DEPTH + "shared_head.head.weight"), {},
     (f"{DEPTH}shared_head.head.weight differs from lm_head.weight", "--no-mtp")),
    (lambda w: w.pop(DEPTH + "enorm.weight"), {},
     (f"the HF weights have no {DEPTH}enorm.weight",)),
    (None, {"num_nextn_predict_layers": 2},
     ("num_nextn_predict_layers is 2", "no model.layers.4.*", "--no-mtp")),
], ids=["embed-copy", "head-copy", "no-enorm", "two-depths"])
def test_import_refuses_an_mtp_layer_braid_cannot_hold(trained, tmp_path, edit, changes, words):
    hf_dir = edited_export(trained, tmp_path / "hf", edit or (lambda w: None))
    if changes:
        edit_config(hf_dir, **changes)
    assert_fails(run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "c"), *words)
    # ... which --no-mtp leaves out
    r = run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "plain", "--no-mtp")
    assert r.returncode == 0, r.stderr


def test_import_refuses_mtp_on_a_dense_deepseek_v3(tmp_path):
    # transformers, vLLM and DeepSeek's code build the MTP layer with experts whatever
    # first_k_dense_replace says; braid builds its depth as the last layer, dense here.
    hf_dir = deepseek_v3(tmp_path / "hf", first_k_dense_replace=3)
    weights = load_file(str(hf_dir / "model.safetensors"))
    weights[DEPTH + "eh_proj.weight"] = torch.zeros(64, 128)
    save_file(weights, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    assert_fails(run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "c"),
                 "first_k_dense_replace = 3", "the multi-token-prediction layers have experts",
                 "--no-mtp")


def test_import_without_the_copies_is_alike(trained, tmp_path):
    # An MTP layer without the copies (a checkpoint that shares them) imports alike.
    hf_dir = edited_export(trained, tmp_path / "hf", lambda w: [w.pop(n) for n in COPIES])
    r = run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "back")
    assert r.returncode == 0, r.stderr
    assert_same_checkpoint_tensors(tmp_path / "back", trained.ckpt)


@pytest.mark.parametrize("make", [deepseek_v3, lambda d: sigmoid_moe(d, "glm4_moe")],
                         ids=["deepseek_v3", "glm4_moe"])
def test_a_transformers_save_imports_without_mtp(tmp_path, make):
    # transformers defaults num_nextn_predict_layers to 1 and saves no MTP layer: the import
    # has none, and says so (not with --no-mtp).
    hf_dir = make(tmp_path / "hf")
    assert json.loads((hf_dir / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert not any(n.startswith(DEPTH) for n in hf_weights(hf_dir))
    r = run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "ckpt")
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().splitlines() == [
        "convert_hf.py import: note: config.json says num_nextn_predict_layers 1 but the "
        f"weights hold no {DEPTH}* (transformers' save_pretrained writes none): imported "
        "without multi-token prediction (mtp_num_layers 0)"]
    meta = metadata(tmp_path / "ckpt")
    assert "mtp_num_layers" not in meta["config"] and meta["format_version"] in (2, 3)
    r = run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "plain", "--no-mtp")
    assert r.returncode == 0 and not r.stderr, r.stderr


def test_export_refuses_depths_an_architecture_has_no_layers_for(tmp_path):
    # A Llama with an MTP depth: Llama has no MTP layers (--no-mtp exports the model alone).
    cfg = braid.TransformerConfig.preset("llama-tiny")
    cfg.mtp_num_layers = 1
    model = braid.GPTModel(cfg, device="cpu", seed=1)
    braid.save_checkpoint(str(tmp_path / "ckpt"), trainer(model), save_optim=False)
    assert_fails(run_tool("export", "--load", tmp_path / "ckpt", "--hf-dir", tmp_path / "out"),
                 "1 multi-token-prediction depth (mtp_num_layers) and exports as llama, which "
                 "has none", "--no-mtp")
    r = run_tool("export", "--load", tmp_path / "ckpt", "--hf-dir", tmp_path / "out", "--no-mtp")
    assert r.returncode == 0, r.stderr
    assert_same_logits(model, IDS, load_hf(tmp_path / "out")(torch.from_numpy(IDS)).logits
                       .detach().numpy())
    # DeepSeek-V2 has none either; a dense DeepSeek-V3's would have experts
    for arch, c, words in [("deepseek_v2", {"num_experts": 8}, "exports as deepseek_v2"),
                           ("deepseek_v3", {"num_experts": 0}, "and no experts")]:
        with pytest.raises(convert_hf.ConvertError, match=words):
            convert_hf.check_mtp_export(dict(c, mtp_num_layers=1), arch)
    convert_hf.check_mtp_export({"num_experts": 8, "mtp_num_layers": 1}, "deepseek_v3")


def test_a_dots1_shaped_model_with_mtp_exports_as_glm4_moe():
    # dots1 has no MTP layers; GLM-4.5 holds the same model (q/k norms, RoPE on whole heads)
    c = {"normalization": "rmsnorm", "activation": "swiglu", "position_embedding": "rope",
         "add_bias_linear": False, "add_qkv_bias": False, "qk_layernorm": True,
         "rotary_percent": 1.0, "num_layers": 3, "num_experts": 8, "moe_router_topk": 4,
         "moe_ffn_hidden_size": 32, "ffn_hidden_size": 160,
         "moe_shared_expert_intermediate_size": 32, "moe_layers": [0, 1, 1],
         "moe_router_num_groups": 4, "moe_router_group_topk": 2, "window_size": -1,
         "window_layers": []}
    arch = convert_hf.sigmoid_moe_architecture
    assert arch(c) == "dots1"
    assert arch(dict(c, mtp_num_layers=1)) == "glm4_moe"
    # with a window GLM-4.5 cannot hold it: dots1, whose export refuses the depths
    windowed = dict(c, mtp_num_layers=1, window_size=4, window_layers=[0, 0, 1])
    assert arch(windowed) == "dots1"
    with pytest.raises(convert_hf.ConvertError, match="exports as dots1, which has none"):
        convert_hf.check_mtp_export(windowed, "dots1")
