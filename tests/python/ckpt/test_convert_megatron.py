"""tools/convert_megatron.py against megatron-core 0.16.1 (megatron_checkpoints.py runs it on the
CPU in subprocesses: gloo, one process, then two ranks).

- import: tiny GPTModels (Llama: RMSNorm, SwiGLU, RoPE, 2 query groups, untied; Qwen-like: one
  query group, tied, q/k norms, q/k/v biases, Llama 3.1's RoPE scaling; GPT: LayerNorm, GELU,
  learned positions, biases, tied; Nemotron-like: LayerNorm saved as gamma - 1, squared ReLU,
  half-rotary RoPE, biases; Mixtral-like: experts on every layer; DeepSeek-V3-like: a dense layer,
  then experts routed by biased sigmoid scores beside a gated shared expert; multi-latent
  attention with a query latent and YaRN, without one and with plain RoPE; a DeepSeek-V3-like
  model with an MTP depth; a Llama with two) saved as Megatron-LM saves them: braid's own loader
  loads the import and computes megatron-core's logits and MTP depths' cross-entropies; the
  per-module norm names, the per-layer names of singleton_local_shards, a bf16 save and saves at
  TP 2 and at PP 2 import to the same bits; the iteration and consumed samples carry over (braid
  resumes there with --no-load-optim --no-load-rng)
- export: checkpoints braid trained and saved (also laid out at TP 2 x PP 2) load into
  megatron-core GPTModels with dist_checkpointing.load under TP 1, TP 2 and PP 2 (Megatron-LM's
  own way: common.pt read with weights_only), whose logits (and MTP depths' cross-entropies) are
  braid's; import(export(x)) and export(import(x)) are bit-exact
- refusals: one line naming what, where and what was expected, exit code 1
"""

import argparse
import contextlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import braid
from braid.generate import config_from_metadata, load_model
from megatron_checkpoints import (BASE_ARGS, CONSUMED, IDS, ITERATION, MODELS, PADDED_VOCAB,
                                  TARGETS, VOCAB, free_port)
from sharded_saves import reshard

HERE = os.path.dirname(os.path.abspath(__file__))
TOOL = os.path.join(HERE, "..", "..", "..", "tools", "convert_megatron.py")
HELPER = os.path.join(HERE, "megatron_checkpoints.py")
LOGITS_RTOL = 1e-5
ITER = f"iter_{ITERATION:07d}"

_spec = importlib.util.spec_from_file_location("convert_megatron", TOOL)
convert_megatron = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(convert_megatron)
convert_hf = sys.modules["convert_hf"]  # the tool's sibling, as the tool imported it
torch_dist = sys.modules["megatron_torch_dist"]

# braid models of the export tests (trained one step by braid, saved by braid's C++).
BRAID_MODELS = {
    # with linear position interpolation (--rotary-seq-len-interpolation-factor 2) and
    # interleaved RoPE pairs (--rotary-interleaved)
    "llama": dict(normalization="rmsnorm", activation="swiglu", position_embedding="rope",
                  num_query_groups=2, add_bias_linear=False, tie_embeddings=False,
                  rope_theta=500000.0, rope_linear_factor=2.0, rotary_interleaved=True),
    "gpt": dict(normalization="layernorm", activation="gelu", position_embedding="learned",
                num_query_groups=4, add_bias_linear=True, tie_embeddings=True),
    # GELU's two forms where Megatron-LM's rule needs a flag: the exact one with biases
    # (bias_gelu_fusion off), the tanh one without (openai_gelu)
    "gpt-erf": dict(normalization="layernorm", activation="gelu_exact",
                    position_embedding="learned", num_query_groups=4, add_bias_linear=True,
                    tie_embeddings=True),
    "gpt-tanh-no-bias": dict(normalization="layernorm", activation="gelu",
                             position_embedding="learned", num_query_groups=4,
                             add_bias_linear=False, tie_embeddings=True),
    # a dense first layer, then 4 experts (top 2 of sigmoid scores with a bias the step moved,
    # scaled by 2.5) beside a gated shared expert
    "moe": dict(normalization="rmsnorm", activation="swiglu", position_embedding="rope",
                num_query_groups=2, add_bias_linear=False, tie_embeddings=False, num_experts=4,
                moe_router_topk=2, moe_ffn_hidden_size=32, moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.02,
                moe_router_topk_scaling_factor=2.5, moe_shared_expert_intermediate_size=48,
                moe_shared_expert_gate=True, moe_layers=[0, 1]),
    # DeepSeek-V3-like: multi-latent attention with a query latent and YaRN (factor 4, mscale 0.9,
    # mscale_all_dim 0.7), the moe model's experts, an MTP depth (with experts, as the last layer)
    "mla-mtp": dict(normalization="rmsnorm", activation="swiglu", position_embedding="rope",
                    num_query_groups=4, add_bias_linear=False, tie_embeddings=False,
                    multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=32, qk_head_dim=16,
                    qk_pos_emb_head_dim=8, v_head_dim=16, qk_layernorm=True,
                    rope_yarn_factor=4.0, rope_yarn_mscale=0.9, rope_yarn_mscale_all_dim=0.7,
                    rope_original_max_position_embeddings=4096, num_experts=4,
                    moe_router_topk=2, moe_ffn_hidden_size=32,
                    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                    moe_router_bias_update_rate=0.02, moe_router_topk_scaling_factor=2.5,
                    moe_shared_expert_intermediate_size=48, moe_layers=[0, 1], mtp_num_layers=1),
    # no query latent, plain RoPE, LayerNorm (the latent norm's bias), tied
    "mla-plain": dict(normalization="layernorm", activation="swiglu", position_embedding="rope",
                      num_query_groups=4, add_bias_linear=False, tie_embeddings=True,
                      multi_latent_attention=True, q_lora_rank=0, kv_lora_rank=24,
                      qk_head_dim=8, qk_pos_emb_head_dim=16, v_head_dim=12, qk_layernorm=True,
                      rope_theta=50000.0),
    # GPT-OSS-like: learnable attention sinks, the quick GEGLU (offset 1, a clamp that bites),
    # biases (the router's too), 4 experts, a window on the first layer, YaRN unrounded
    "gpt-oss": dict(normalization="rmsnorm", activation="quick_geglu", position_embedding="rope",
                    num_query_groups=2, add_bias_linear=True, tie_embeddings=False,
                    softmax_type="learnable", glu_linear_offset=1.0, activation_clamp=0.5,
                    rope_theta=150000.0, rope_yarn_factor=32.0,
                    rope_original_max_position_embeddings=4096, rope_yarn_truncate=False,
                    window_size=4, window_layers=[1, 0], num_experts=4, moe_router_topk=2,
                    moe_ffn_hidden_size=32),
}
BRAID_SHAPE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, kv_channels=16,
                   ffn_hidden_size=160, vocab_size=VOCAB, max_position_embeddings=64,
                   norm_eps=1e-5)


def tool(*args):
    """convert_megatron.py's main in this process: (exit code, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = convert_megatron.main([str(a) for a in args])
    return code, err.getvalue()


def assert_refused(args, *phrases):
    code, err = tool(*args)
    assert code == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"convert_megatron.py {args[0]}: error: "), err
    for phrase in phrases:
        assert phrase in err, (phrase, err)


def imported(megatron, name, save, *flags):
    code, err = tool("import", "--megatron-dir", megatron / name, "--save", save, *flags)
    assert code == 0, err
    return save


def helper(*args, ranks=1):
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    launch = [sys.executable] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
        str(ranks)]
    r = subprocess.run([*launch, HELPER, *map(str, args)], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]


def relative_error(got, want):
    return np.abs(got.astype(np.float64) - want).max() / np.abs(want).max()


def braid_logits(ckpt):
    """braid's logits of IDS from the checkpoint, loaded by braid's C++ (load_parameters)."""
    model, _ = load_model(str(ckpt))
    return np.from_dlpack(model.logits(IDS))


def mtp_cross_entropies(mtp_logits, vocab):
    """Per MTP depth k (1-based) of megatron-core's logits [D, B, S, V]: (the sum of the
    cross-entropies of its first `vocab` columns against TARGETS shifted left by k, their
    count), the last k positions having no target."""
    out = []
    for k, x in enumerate(mtp_logits.astype(np.float64)[..., :vocab], start=1):
        x, targets = x[:, :-k], TARGETS[:, k:]
        top = x.max(axis=-1, keepdims=True)
        lse = top[..., 0] + np.log(np.exp(x - top).sum(axis=-1))
        out.append(((lse - np.take_along_axis(x, targets[..., None], -1)[..., 0]).sum(),
                    targets.size))
    return out


def braid_mtp_losses(model):
    """braid's MTP depths' (sum of cross-entropies, count) for IDS and TARGETS."""
    model.take_mtp_losses()
    model.forward(IDS, TARGETS)
    return model.take_mtp_losses()


def assert_mtp_matches(braid, megatron, what):
    assert len(braid) == len(megatron)
    for k, ((got, n), (want, m)) in enumerate(zip(braid, megatron), start=1):
        err = abs(got - want) / abs(want)
        print(f"{what}: MTP depth {k} cross-entropy sum, braid vs megatron-core, relative "
              f"difference {err:.1e}")
        assert n == m and err <= LOGITS_RTOL


def model_tensors(ckpt):
    return convert_hf.read_checkpoint(str(ckpt))[1]


def assert_same_tensors(got, want):
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        np.testing.assert_array_equal(got[name].array, want[name].array, err_msg=name)


def metadata(ckpt):
    with open(os.path.join(ckpt, ITER, "metadata.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """megatron-core's saves (Megatron-LM's layout) and logits of MODELS and the variants."""
    out = tmp_path_factory.mktemp("megatron")
    helper("save", out)
    return out


def braid_checkpoint(path, kind):
    """A braid model of BRAID_MODELS[kind] trained one step on IDS and saved by braid (with its
    optimizer state): the model."""
    cfg = config_from_metadata({**BRAID_SHAPE, **BRAID_MODELS[kind]})
    for key, value in BRAID_MODELS[kind].items():  # (fields a metadata config does not hold)
        if key.startswith("moe_router_bias"):
            setattr(cfg, key, value)
    model = braid.GPTModel(cfg, device="cpu", seed=3)
    rng = np.random.default_rng(3)
    for name, p in model.parameters().items():  # routers wide: no token near a routing tie
        if name.endswith("mlp.gate.weight"):
            p.copy_(rng.normal(0.0, 0.5, size=tuple(p.shape)).astype(np.float32))
    trainer = braid.Trainer(model, braid.AdamWConfig(), braid.LRSchedule(lr=1e-3,
                                                                         style="constant"))
    trainer.train_step(IDS, IDS)
    braid.save_checkpoint(str(path), trainer, consumed_samples=48)
    return model


@pytest.fixture(scope="module")
def exported(megatron, tmp_path_factory):
    """braid checkpoints (and a TP 2 x PP 2 relayout of the llama), their logits, their exports;
    then two ranks load the exports into megatron-core (and save the llama at TP 2 and PP 2)."""
    out = tmp_path_factory.mktemp("exported")
    runs = {}
    for kind in BRAID_MODELS:
        model = braid_checkpoint(out / f"{kind}-braid", kind)
        runs[kind] = dict(braid=out / f"{kind}-braid", logits=np.from_dlpack(model.logits(IDS)),
                          megatron=out / kind, mtp=braid_mtp_losses(model))
        code, err = tool("export", "--load", out / f"{kind}-braid", "--megatron-dir", out / kind)
        assert code == 0, err
    # the llama's tensors as braid's tp = 2, pp = 2 save lays them out (with optimizer state)
    meta, tensors = convert_hf.read_checkpoint(str(out / "llama-braid"))
    specs = convert_hf.checkpoint_specs(meta["config"])
    convert_hf.write_checkpoint(str(out / "llama-tp1"), tensors,
                                convert_hf.checkpoint_metadata(meta["config"], specs, None))
    reshard(out / "llama-tp1", out / "llama-tp2-pp2", tp=2, pp=2)
    helper("ranks", megatron, json.dumps([str(r["megatron"]) for r in runs.values()]), ranks=2)
    return runs


# ---- import ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(MODELS))
def test_import_computes_megatrons_logits(megatron, tmp_path, kind):
    ckpt = imported(megatron, kind, tmp_path / "ckpt")
    want = np.load(megatron / f"{kind}.logits.npy")
    got = braid_logits(ckpt)
    assert got.shape == want.shape == (3, 16, PADDED_VOCAB)  # the padded vocabulary is kept
    err = relative_error(got, want)
    print(f"{kind}: braid vs megatron-core logits, max relative difference {err:.1e}")
    assert err <= LOGITS_RTOL
    if MODELS[kind].get("mtp_num_layers"):
        model, _ = load_model(str(ckpt))
        assert_mtp_matches(braid_mtp_losses(model),
                           mtp_cross_entropies(np.load(megatron / f"{kind}.mtp-logits.npy"),
                                               PADDED_VOCAB), kind)
    c = metadata(ckpt)["config"]
    assert c["vocab_size"] == PADDED_VOCAB
    assert c.get("mtp_num_layers", 0) == (MODELS[kind].get("mtp_num_layers") or 0)
    assert c.get("multi_latent_attention", False) == MODELS[kind].get("multi_latent_attention",
                                                                       False)
    if kind == "deepseek-mla":
        assert (c["q_lora_rank"], c["kv_channels"], c["rope_yarn_factor"],
                c["rope_yarn_mscale_all_dim"]) == (24, 24, 4.0, np.float32(0.7))
    if kind == "deepseek-v3-mtp":  # Megatron-LM's --rope-type default: YaRN, its factor 1
        assert (c["rope_yarn_factor"], c["rope_original_max_position_embeddings"]) == (1.0, 4096)
    assert c["zero_centered_gamma"] == (kind == "nemotron-1p")
    assert c["tie_embeddings"] == (kind in ("gpt", "gpt-erf", "qwen-tied", "mla-no-q-lora"))
    if kind in ("gpt", "gpt-erf"):  # the fused bias-GELU's tanh form, the unfused exact one
        assert c["activation"] == {"gpt": "gelu", "gpt-erf": "gelu_exact"}[kind]
    if kind == "gpt-oss":  # (a version-6 reader would run another softmax and activation)
        assert metadata(ckpt)["format_version"] == 7
        assert (c["activation"], c["glu_linear_offset"], c["activation_clamp"],
                c["softmax_type"]) == ("quick_geglu", 1.0, 0.5, "learnable")
        assert (c["rope_yarn_factor"], c["rope_original_max_position_embeddings"],
                c["rope_yarn_truncate"], c["rope_yarn_mscale"], c["rope_yarn_mscale_all_dim"],
                c["window_size"], c["window_layers"]) == (32.0, 4096, False, 1.0, 0.0, 4, [1, 0])


def test_imported_metadata_carries_the_iteration(megatron, tmp_path):
    ckpt = imported(megatron, "llama", tmp_path / "ckpt")
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == f"{ITERATION}\n"
    meta = metadata(ckpt)
    assert meta["format"] == "braid-checkpoint" and meta["optimizer"] is False
    assert meta["iteration"] == meta["trainer"]["iteration"] == ITERATION
    assert meta["consumed_samples"] == meta["trainer"]["update_samples"] == CONSUMED
    assert meta["layout"]["tensor_model_parallel_size"] == 1
    assert meta["megatron_args"]["tokenizer_type"] == "HuggingFaceTokenizer"
    assert "hf_config" not in meta
    c = meta["config"]
    assert (c["normalization"], c["activation"], c["position_embedding"]) == (
        "rmsnorm", "swiglu", "rope")
    assert (c["num_query_groups"], c["kv_channels"], c["rope_theta"]) == (2, 16, 500000.0)
    # braid resumes at Megatron's iteration with --no-load-optim --no-load-rng, ...
    cfg = config_from_metadata(c)
    trainer = braid.Trainer(braid.GPTModel(cfg, device="cpu", seed=5), braid.AdamWConfig(),
                            braid.LRSchedule(lr=1e-3, style="constant"))
    assert braid.load_checkpoint(str(ckpt), trainer, load_optim=False,
                                 load_rng=False) == CONSUMED
    assert trainer.iteration == ITERATION
    # ... from iteration 0 with --finetune, and says what is missing otherwise
    trainer = braid.Trainer(braid.GPTModel(cfg, device="cpu", seed=5), braid.AdamWConfig(),
                            braid.LRSchedule(lr=1e-3, style="constant"))
    assert braid.load_checkpoint(str(ckpt), trainer, finetune=True) == 0
    assert trainer.iteration == 0
    with pytest.raises(ValueError, match="saved without optimizer state"):
        braid.load_checkpoint(str(ckpt), trainer)
    with pytest.raises(ValueError, match="without RNG state at iteration 120"):
        braid.load_checkpoint(str(ckpt), trainer, load_optim=False)


@pytest.mark.parametrize("variant, base", [("llama-unfused-names", "llama"),
                                           ("llama-singleton", "llama"),
                                           ("moe-shared-singleton", "moe-shared"),
                                           ("deepseek-mla-te-names", "deepseek-mla")])
def test_import_reads_every_naming(megatron, tmp_path, variant, base):
    """The per-module norm names (input_layernorm, pre_mlp_layernorm) with a Transformer Engine
    spec's core_attention extra state and an optimizer tensor, megatron-core's per-layer (and
    per-expert) names with SwiGLU's fc1 as weight_w / weight_v (singleton_local_shards), and
    an MLA model's norms under Transformer Engine's spec's names (linear_q_up_proj's,
    linear_kv_up_proj's and mlp.linear_fc1's layer_norm_weight): the same model."""
    want = model_tensors(imported(megatron, base, tmp_path / base))
    code, err = tool("import", "--megatron-dir", megatron / variant, "--save", tmp_path / "ckpt")
    assert code == 0, err
    # its one optimizer tensor is not Adam's whole state: the weights alone, and a note why
    assert ("the optimizer state is not carried (" in err and "has no optimizer.state.exp_avg_sq"
            in err) == (variant == "llama-unfused-names"), err
    assert_same_tensors(model_tensors(tmp_path / "ckpt"), want)


def test_bf16_import_and_round_trip_are_exact(megatron, tmp_path):
    """A bf16 save imports as bf16, each tensor the f32 one rounded by torch; export and import
    again give the same bits."""
    import torch
    f32 = model_tensors(imported(megatron, "llama", tmp_path / "f32"))
    ckpt = imported(megatron, "llama-bf16", tmp_path / "bf16")
    assert metadata(ckpt)["config"]["params_dtype"] == "bf16"
    got = model_tensors(ckpt)
    assert sorted(got) == sorted(f32)
    for name, t in got.items():
        want = torch.from_numpy(np.ascontiguousarray(f32[name].array)).bfloat16()
        assert t.dtype == "BF16"
        np.testing.assert_array_equal(t.array, want.view(torch.int16).numpy().view(np.uint16))
    code, err = tool("export", "--load", ckpt, "--megatron-dir", tmp_path / "out")
    assert code == 0, err
    assert_same_tensors(model_tensors(imported(tmp_path, "out", tmp_path / "back")), got)


def test_import_is_layout_free(megatron, exported, tmp_path):
    """The llama loaded by megatron-core at TP 2 and at PP 2 (two ranks) and saved there imports
    to the same bits; megatron-core's logits at TP 2 are its logits at TP 1."""
    want = model_tensors(imported(megatron, "llama", tmp_path / "llama"))
    for layout in ("llama-tp2-pp1", "llama-tp1-pp2"):
        assert_same_tensors(model_tensors(imported(megatron, layout, tmp_path / layout)), want)
    tp1, tp2 = (np.load(megatron / f"llama{s}.logits.npy") for s in ("", "-tp2"))
    assert relative_error(tp2, tp1) <= LOGITS_RTOL


def export_of_import(megatron, kind, tmp_path):
    """(tensors, objects) of the export of the import of megatron-core's `kind` save (in
    tmp_path/out), and (tensors, objects) of that save."""
    imported(megatron, kind, tmp_path / "ckpt")
    code, err = tool("export", "--load", tmp_path / "ckpt", "--megatron-dir", tmp_path / "out")
    assert code == 0, err
    got, objects, _ = torch_dist.read_torch_dist(str(tmp_path / "out" / ITER))
    want, want_objects, _ = torch_dist.read_torch_dist(str(megatron / kind / ITER),
                                                       convert_megatron.model_tensor)
    return got, objects, want, want_objects


def test_export_of_an_import_is_megatrons_save(megatron, tmp_path):
    """export(import(x)) holds x's model tensors bit for bit (Megatron's stacked names) and
    x's _extra_state objects; common.pt gives back Megatron's arguments."""
    got, objects, want, want_objects = export_of_import(megatron, "qwen-tied", tmp_path)
    assert_same_tensors(got, want)
    assert {k for k in want_objects if "_extra_state" in k} <= set(objects)
    common = torch_dist.read_common(str(tmp_path / "out" / ITER))
    assert common["iteration"] == ITERATION and common["checkpoint_version"] == 3.0
    args = common["args"]
    assert args.consumed_train_samples == CONSUMED and args.tokenizer_type == "HuggingFaceTokenizer"
    assert (args.qk_layernorm, args.use_rope_scaling, args.num_query_groups) == (True, True, 1)
    assert (tmp_path / "out" / "latest_checkpointed_iteration.txt").read_text() == str(ITERATION)


# The norms export writes under both specs' names, a name of one beside the other's.
SPEC_TWINS = (("self_attention.linear_q_up_proj.layer_norm_", "self_attention.q_layernorm."),
              ("self_attention.linear_kv_up_proj.layer_norm_", "self_attention.kv_layernorm."),
              ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."))


def drop_spec_twins(got, want):
    """Takes out of `got` the norms not in `want` (a local spec's save) that are its norms under
    the other spec's names, each checked equal to its twin; returns their names."""
    dropped = []
    for name in sorted(set(got) - set(want)):
        twins = [name.replace(a, b) for a, b in SPEC_TWINS + tuple((b, a) for a, b in SPEC_TWINS)
                 if a in name]
        twin = next((t for t in twins if t in want), None)
        assert twin is not None, name
        np.testing.assert_array_equal(got.pop(name).array, got[twin].array, err_msg=name)
        dropped.append(name)
    return dropped


def test_export_of_an_imported_mixture_of_experts(megatron, tmp_path):
    """The same with experts on the second layer only (megatron-core's per-layer names), and the
    pre-MLP norm of that layer also under Transformer Engine's name."""
    got, objects, want, want_objects = export_of_import(megatron, "moe-shared", tmp_path)
    assert drop_spec_twins(got, want) == ["decoder.layers.1.pre_mlp_layernorm.weight"]
    assert_same_tensors(got, want)
    assert {k for k in want_objects if "_extra_state" in k} <= set(objects)
    args = torch_dist.read_common(str(tmp_path / "out" / ITER))["args"]
    assert (args.num_experts, args.moe_layer_freq, args.moe_router_score_function) == (
        4, [0, 1], "sigmoid")


def test_export_of_an_imported_gpt_oss(megatron, tmp_path):
    """The same for the GPT-OSS-like model: the sinks (core_attention.softmax_offset [L, heads])
    and the router's bias (mlp.router.bias) come back with the other tensors, --quick-geglu, the
    GLU's offset and clamp, --softmax-type and the YaRN arguments with them."""
    got, objects, want, want_objects = export_of_import(megatron, "gpt-oss", tmp_path)
    assert drop_spec_twins(got, want) == ["decoder.layers.pre_mlp_layernorm.weight"]
    assert want["decoder.layers.self_attention.core_attention.softmax_offset"].shape == [2, 4]
    assert want["decoder.layers.mlp.router.bias"].shape == [2, 4]
    assert_same_tensors(got, want)
    assert {k for k in want_objects if "_extra_state" in k} <= set(objects)
    args = torch_dist.read_common(str(tmp_path / "out" / ITER))["args"]
    assert (args.quick_geglu, args.swiglu, args.glu_linear_offset,
            args.activation_func_clamp_value, args.softmax_type) == (
        True, False, 1.0, 0.5, "learnable")
    assert (args.position_embedding_type, args.rotary_scaling_factor,
            args.yarn_original_max_position_embeddings, args.yarn_correction_range_round_to_int,
            args.mscale, args.mscale_all_dim) == ("yarn", 32.0, 4096, False, 1.0, 0.0)


def test_export_of_an_imported_mla_with_mtp(megatron, tmp_path):
    """The same for multi-latent attention with an MTP depth with experts (megatron-core's
    mtp.layers.0.*): its tensors and extra states; the latent norms and the dense layer's pre-MLP
    norm also under Transformer Engine's names; the MLA and MTP arguments given back."""
    got, objects, want, want_objects = export_of_import(megatron, "deepseek-v3-mtp", tmp_path)
    twins = drop_spec_twins(got, want)
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in twins
    assert "mtp.layers.0.transformer_layer.self_attention.linear_kv_up_proj.layer_norm_weight" \
        in twins
    assert any(name.startswith("mtp.layers.0.transformer_layer.mlp.experts.") for name in want)
    assert_same_tensors(got, want)
    assert {k for k in want_objects if "_extra_state" in k} <= set(objects)
    args = torch_dist.read_common(str(tmp_path / "out" / ITER))["args"]
    assert (args.multi_latent_attention, args.q_lora_rank, args.mtp_num_layers,
            args.rope_type) == (True, 24, 1, "yarn")


# ---- export ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(BRAID_MODELS))
def test_export_loads_into_megatron_core(exported, kind):
    """megatron-core's dist_checkpointing.load puts the export into GPTModels at TP 1 and TP 2,
    which compute braid's logits (the vocabulary padded to 128 with zero rows: logits 0)."""
    run = exported[kind]
    for tp in (1, 2):
        got = np.load(f"{run['megatron']}.tp{tp}.logits.npy")
        assert np.all(got[..., VOCAB:] == 0)
        err = relative_error(got[..., :VOCAB], run["logits"])
        print(f"{kind} export at TP {tp}: megatron-core vs braid logits, max relative "
              f"difference {err:.1e}")
        assert err <= LOGITS_RTOL
        if BRAID_MODELS[kind].get("mtp_num_layers"):
            mtp = np.load(f"{run['megatron']}.tp{tp}.mtp-logits.npy")
            assert np.all(mtp[..., VOCAB:] == 0)
            assert_mtp_matches(run["mtp"], mtp_cross_entropies(mtp, VOCAB),
                               f"{kind} export at TP {tp}")


@pytest.mark.parametrize("kind", sorted(BRAID_MODELS))
def test_export_round_trips(exported, tmp_path, kind):
    """import(export(x)) is x bit for bit, and so is what megatron-core loaded at PP 2 (MLA also
    at TP 2) and saved again (but for the vocabulary rows its model pads with zeros)."""
    run = exported[kind]
    want = model_tensors(run["braid"])
    back = imported(run["megatron"].parent, kind, tmp_path / "back")
    assert_same_tensors(model_tensors(back), want)
    braid_meta, back_meta = (json.loads(next(p.glob("iter_*/metadata.json")).read_text())
                             for p in (run["braid"], back))
    assert back_meta["iteration"] == braid_meta["iteration"] == 1
    assert back_meta["consumed_samples"] == 48
    shared = back_meta["config"].keys() & braid_meta["config"].keys()
    assert len(shared) >= 25
    assert {k: back_meta["config"][k] for k in shared} == {k: braid_meta["config"][k]
                                                          for k in shared}
    layouts = ["tp1-pp2"] + (["tp2-pp1"] if BRAID_MODELS[kind].get("multi_latent_attention")
                             else [])
    for layout in layouts:
        resaved = model_tensors(imported(run["megatron"].parent, f"{kind}-{layout}",
                                         tmp_path / layout))
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name in want:
                assert not resaved[name].array[VOCAB:].any()
                resaved[name] = resaved[name].like(resaved[name].array[:VOCAB])
        assert_same_tensors(resaved, want)


def test_export_assembles_any_layout(exported, tmp_path):
    """A checkpoint laid out as braid saves at TP 2 x PP 2 (optimizer state beside) exports the
    model tensors of the one-process save. Its metadata, an HF import's, has no record of Adam's
    constants: the weights go alone, and a note says why."""
    out = exported["llama"]["braid"].parent
    code, err = tool("export", "--load", out / "llama-tp2-pp2", "--megatron-dir", tmp_path / "m")
    assert code == 0 and "no record of Adam's betas and eps" in err, err
    got, _, _ = torch_dist.read_torch_dist(str(tmp_path / "m" / "iter_0000005"))
    want, _, _ = torch_dist.read_torch_dist(str(exported["llama"]["megatron"] / "iter_0000001"),
                                            lambda key: not key.startswith("optimizer."))
    assert_same_tensors(got, want)


def edited_copy(ckpt, dst, **config):
    """A copy of the braid checkpoint `ckpt` at `dst` with fields of its config changed."""
    shutil.copytree(ckpt, dst)
    meta_path = next(dst.glob("iter_*/metadata.json"))
    meta = json.loads(meta_path.read_text())
    meta["config"].update(config)
    meta_path.write_text(json.dumps(meta))
    return dst


def test_windows_round_trip(exported, tmp_path):
    """A sliding window on some layers goes out as Megatron's window_size (W, 0) and
    window_attn_skip_freq and comes back (megatron-core builds its window mask on CUDA only, so
    no logits here)."""
    ckpt = edited_copy(exported["llama"]["braid"], tmp_path / "ckpt", window_size=3,
                       window_layers=[1, 0])
    code, err = tool("export", "--load", ckpt, "--megatron-dir", tmp_path / "out")
    assert code == 0, err
    args = torch_dist.read_common(str(tmp_path / "out" / "iter_0000001"))["args"]
    assert (args.window_size, args.window_attn_skip_freq) == ((3, 0), [1, 0])
    c = json.loads(next(imported(tmp_path, "out", tmp_path / "back").glob(
        "iter_*/metadata.json")).read_text())["config"]
    assert (c["window_size"], c["window_layers"]) == (3, [1, 0])


# ---- refusals --------------------------------------------------------------------------------

def test_refuses_what_it_does_not_read(megatron, exported, tmp_path):
    assert_refused(["import", "--megatron-dir", tmp_path / "nowhere", "--save", tmp_path / "a"],
                   "nowhere: no such directory")
    legacy = tmp_path / "legacy"
    (legacy / "iter_0000005" / "mp_rank_00").mkdir(parents=True)
    (legacy / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"")
    (legacy / "latest_checkpointed_iteration.txt").write_text("5")
    assert_refused(["import", "--megatron-dir", legacy, "--save", tmp_path / "b"],
                   "mp_rank_00/model_optim_rng.pt: not a readable torch.save file")
    dcp = tmp_path / "dcp" / "iter_0000005"
    dcp.mkdir(parents=True)
    (dcp / ".metadata").write_bytes(b"")
    (dcp.parent / "latest_checkpointed_iteration.txt").write_text("5")
    assert_refused(["import", "--megatron-dir", dcp.parent, "--save", tmp_path / "c"],
                   "without megatron-core's metadata.json", "torch_dcp")
    (dcp / "metadata.json").write_text('{"sharded_backend": "zarr"}')  # an older backend
    assert_refused(["import", "--megatron-dir", dcp.parent, "--save", tmp_path / "c"],
                   "metadata.json: sharded_backend is 'zarr', not 'torch_dist'")
    assert_refused(["import", "--megatron-dir", exported["gpt"]["braid"], "--save",
                    tmp_path / "d"], "a braid checkpoint; convert it with export")
    assert_refused(["import", "--megatron-dir", megatron / "llama", "--save", tmp_path / "e",
                    "--ckpt-step", "7"], "iter_0000007 does not exist")
    imported(megatron, "llama", tmp_path / "f")
    assert_refused(["import", "--megatron-dir", megatron / "llama", "--save", tmp_path / "f"],
                   "already holds a checkpoint")


def test_refuses_what_it_does_not_map(megatron, tmp_path):
    assert_refused(["import", "--megatron-dir", megatron / "llama-router", "--save",
                    tmp_path / "a"], "unexpected tensor decoder.layers.mlp.router.weight (layer 0)",
                   "not part of a GPT model with these args")
    assert_refused(["import", "--megatron-dir", megatron / "llama-moe-args", "--save",
                    tmp_path / "b"], "no decoder.layers.mlp.router.weight (layer 0)")
    assert_refused(["import", "--megatron-dir", megatron / "llama-fp8", "--save", tmp_path / "d"],
                   "core_attention._extra_state/shard_0_2 holds Transformer Engine state (FP8",
                   "--drop-fp8-state")
    for variant, phrases in (
            ("mla-bias", ("args.add_bias_linear = True is not supported", "--disable-bias-linear")),
            ("mla-rope-mscale", ("args.mscale_all_dim = 1.0", "g(mscale_all_dim)^2")),
            ("mtp-learned", ("args.mtp_num_layers 2 with learned positions", "need RoPE"))):
        assert_refused(["import", "--megatron-dir", megatron / variant, "--save",
                        tmp_path / variant], *phrases)
    dropped = imported(megatron, "llama-fp8", tmp_path / "d", "--drop-fp8-state")
    assert_same_tensors(model_tensors(dropped),
                        model_tensors(imported(megatron, "llama", tmp_path / "e")))


@pytest.mark.parametrize("changes,phrases", [
    (dict(softmax_type="sideways"), ("args.softmax_type = 'sideways'",)),
    (dict(swiglu=True), ("args.quick_geglu = True", "not given with --swiglu")),
    # megatron-core's fused bias-SwiGLU ignores the offset (and the clamp)
    (dict(quick_geglu=False, swiglu=True, bias_swiglu_fusion=True),
     ("args.glu_linear_offset = 1.0", "fused bias-SwiGLU")),
    (dict(activation_func_clamp_value=-1.0), ("args.activation_func_clamp_value = -1.0",
                                              "positive limit")),
    (dict(yarn_original_max_position_embeddings=None),
     ("args.yarn_original_max_position_embeddings (or args.original_max_position_embeddings) "
      "is missing",)),
    (dict(rotary_percent=0.5), ("args.rotary_percent = 0.5", "YaRN on a part of each head")),
    (dict(rotary_scaling_factor=0.5), ("args.rotary_scaling_factor = 0.5", "factor >= 1")),
    (dict(multi_latent_attention=True), ("args.position_embedding_type = 'yarn'",
                                         "builds its own RoPE")),
    (dict(multi_latent_attention=True, position_embedding_type="rope"),
     ("args.softmax_type = 'learnable'", "usual softmax")),
])
def test_refuses_gpt_oss_args_braid_does_not_compute(changes, phrases):
    args = argparse.Namespace(**{**BASE_ARGS, **MODELS["gpt-oss"], **changes})
    with pytest.raises(convert_hf.ConvertError) as e:
        sys.modules["megatron_mapping"].braid_config_from_args(args, 128, "f32", "common.pt")
    for phrase in phrases:
        assert phrase in str(e.value), (phrase, str(e.value))


def test_activation_is_taken_in_megatron_lms_order():
    activation_of = sys.modules["megatron_mapping"].activation_of
    both = argparse.Namespace(squared_relu=True, quick_geglu=True, swiglu=False)
    assert activation_of(both, "common.pt") == "squared_relu"
    assert activation_of(argparse.Namespace(quick_geglu=True), "common.pt") == "quick_geglu"


def test_export_refuses_models_megatron_does_not_compute(exported, tmp_path):
    for n, (kind, edit, phrase) in enumerate((
            ("llama", dict(rope_linear_factor=0.0, rope_yarn_factor=4.0),
             "YaRN RoPE with interleaved pairs; megatron-core's YarnRotaryEmbedding"),
            ("gpt-oss", dict(rope_linear_factor=2.0),
             "YaRN RoPE with linear interpolation or Llama 3.1's scaling"),
            ("mla-mtp", dict(rope_yarn_truncate=False), "correction range unrounded"),
            ("mla-mtp", dict(rope_original_max_position_embeddings=8192),
             "original context, beta_fast and beta_slow (8192, 32.0, 1.0)"),
            ("mla-plain", dict(rope_linear_factor=2.0), "linear RoPE interpolation"))):
        ckpt = edited_copy(exported[kind]["braid"], tmp_path / f"ckpt{n}", **edit)
        assert_refused(["export", "--load", ckpt, "--megatron-dir", tmp_path / "out"], phrase)
    assert_refused(["export", "--load", exported["gpt"]["braid"], "--megatron-dir",
                    exported["gpt"]["megatron"]], "already holds a checkpoint")


def test_command_line_exit_codes(megatron, tmp_path):
    r = subprocess.run([sys.executable, TOOL, "import", "--megatron-dir",
                        megatron / "llama-router", "--save", tmp_path / "ckpt"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.startswith("convert_megatron.py import: error: ")
    r = subprocess.run([sys.executable, TOOL, "import", "--megatron-dir", megatron / "gpt",
                        "--save", tmp_path / "ckpt"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"imported a 2-layer model (hidden 64, f32) into {tmp_path}")
