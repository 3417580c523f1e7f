"""tools/convert_hf.py: tiny random HF models (Llama with GQA, untied and tied; GPT-2, tied, saved
sharded; a bf16 Llama) imported into braid checkpoints and exported back.

- the round trip is bit-exact and the config equivalent; transformers loads the export with no
  missing or unexpected keys
- braid's GPTModel, given the imported checkpoint's config and tensors, computes the exported
  HF model's logits (f32, same tolerance as test_hf_oracle.py)
- a checkpoint sharded as braid saves it at (tp 2, pp 2), optimizer state included, exports to
  the same bits
- bad inputs: one clear line on stderr and a non-zero exit
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file

import braid
from braid.generate import config_from_metadata
from sharded_saves import reshard, resave_at_tp2_pp2  # noqa: F401 (the other tests')

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..")
TOOL = os.path.join(ROOT, "tools", "convert_hf.py")
LOGITS_RTOL = 1e-5
IDS = np.random.default_rng(0).integers(0, 97, size=(3, 16), dtype=np.int64)

_spec = importlib.util.spec_from_file_location("convert_hf", TOOL)
convert_hf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(convert_hf)


def run_tool(*args):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, TOOL, *map(str, args)], capture_output=True, text=True,
                          env=env)


def perturb(model):
    """HF initialises biases and norms trivially; make them matter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or ".ln_" in name:
                p.add_(0.1 * torch.randn_like(p))


def llama(tmp, kv_heads=2, tie=False, dtype=torch.float32, **extra):
    torch.manual_seed(0)
    if "rope_parameters" not in extra:
        extra["rope_theta"] = 500000.0
    cfg = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
        rms_norm_eps=1e-5, tie_word_embeddings=tie, **extra)
    model = transformers.LlamaForCausalLM(cfg).eval()
    perturb(model)
    model.to(dtype).save_pretrained(tmp)
    return tmp


def gpt2(tmp, shard=False, tie=True, activation="gelu_new"):
    torch.manual_seed(1)
    cfg = transformers.GPT2Config(vocab_size=97, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                  layer_norm_epsilon=1e-5, activation_function=activation,
                                  tie_word_embeddings=tie)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    perturb(model)
    model.save_pretrained(tmp, max_shard_size="40KB" if shard else "10GB")
    return tmp


def qwen2(tmp, tie=False, layers=2, **sliding):
    """Llama with biases on q, k and v alone: braid's add_qkv_bias; `sliding`: Qwen2's
    use_sliding_window, sliding_window, max_window_layers."""
    torch.manual_seed(2)
    cfg = transformers.Qwen2Config(
        vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=tie, **sliding)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    perturb(model)
    model.save_pretrained(tmp)
    return tmp


def qwen3(tmp, head_dim=16, **sliding):
    """Llama with an RMSNorm on each query and key head: braid's qk_layernorm. A head_dim other
    than hidden / heads (16) is braid's kv_channels, as in Qwen3-0.6B. `sliding`: Qwen3's
    use_sliding_window, sliding_window, layer_types."""
    torch.manual_seed(3)
    cfg = transformers.Qwen3Config(
        vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=64,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, **sliding)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    perturb(model)
    model.save_pretrained(tmp)
    return tmp


def mistral(tmp, sliding_window=None):
    """Mistral NeMo's shape in small: no sliding window (v0.2 on), heads wider than hidden /
    heads (head_dim 32 on 64 / 4); otherwise Llama."""
    torch.manual_seed(5)
    cfg = transformers.MistralConfig(
        vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
        rms_norm_eps=1e-5, sliding_window=sliding_window, tie_word_embeddings=False)
    model = transformers.MistralForCausalLM(cfg).eval()
    perturb(model)
    model.save_pretrained(tmp)
    return tmp


def nemotron(tmp, dtype=torch.float32):
    """Nemotron-4 in small: LayerNorm1P (weights holding gamma - 1), squared ReLU, RoPE on half
    of each head (transformers' default), biases on every linear layer."""
    torch.manual_seed(6)
    cfg = transformers.NemotronConfig(
        vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, norm_eps=1e-5,
        attention_bias=True, mlp_bias=True, tie_word_embeddings=False)
    assert cfg.rope_parameters["partial_rotary_factor"] == 0.5
    model = transformers.NemotronForCausalLM(cfg).eval()
    perturb(model)
    model.to(dtype).save_pretrained(tmp)
    return tmp


def stablelm(tmp):
    """Llama with LayerNorms, RoPE on a quarter of each head and q, k, v biases (StableLM 2's
    settings): braid's layernorm, rotary_percent and add_qkv_bias."""
    torch.manual_seed(4)
    cfg = transformers.StableLmConfig(
        vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        layer_norm_eps=1e-5, use_qkv_bias=True, tie_word_embeddings=False)
    assert cfg.rope_parameters["partial_rotary_factor"] == 0.25  # transformers' default
    model = transformers.StableLmForCausalLM(cfg).eval()
    perturb(model)
    model.save_pretrained(tmp)
    return tmp


MODELS = {
    "llama-gqa-untied": lambda d: llama(d, kv_heads=2, tie=False),
    "llama-mqa-tied": lambda d: llama(d, kv_heads=1, tie=True),
    "llama-bias": lambda d: llama(d, kv_heads=2, attention_bias=True, mlp_bias=True),
    # Llama 3.1's RoPE scaling; the original context (32) below the model's, as in the real ones.
    "llama-rope-llama3": lambda d: llama(d, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    # Linear position interpolation, by a factor whose division rounds.
    "llama-rope-linear": lambda d: llama(d, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.5}),
    "gpt2-tied-sharded": lambda d: gpt2(d, shard=True),
    "gpt2-untied": lambda d: gpt2(d, tie=False),
    # The exact GELU (torch's F.gelu, HF's "gelu"): braid's gelu_exact.
    "gpt2-exact-gelu": lambda d: gpt2(d, activation="gelu"),
    "qwen2-tied": lambda d: qwen2(d, tie=True),
    "qwen3-untied": qwen3,
    "qwen3-wide-heads": lambda d: qwen3(d, head_dim=32),
    "stablelm-partial-rotary": stablelm,
    "mistral-wide-heads": mistral,
    # Mistral 7B v0.1's sliding window on every layer, shorter than the test's 16 tokens.
    "mistral-sliding-window": lambda d: mistral(d, sliding_window=5),
    # Qwen2's windowed layers: the last two of three.
    "qwen2-sliding-layers": lambda d: qwen2(d, layers=3, use_sliding_window=True,
                                            sliding_window=4, max_window_layers=1),
    # Qwen3's, from layer_types: the first of two windowed, not a suffix.
    "qwen3-sliding-layer-types": lambda d: qwen3(
        d, use_sliding_window=True, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"]),
    "nemotron-bias": nemotron,
}


def hf_weights(hf_dir):
    files = [n for n in os.listdir(hf_dir) if n.endswith(".safetensors")]
    out = {}
    for name in files:
        out.update(load_file(os.path.join(hf_dir, name)))
    return out


def assert_same_bits(got, want):
    assert sorted(got) == sorted(want)
    for name in want:
        a, b = got[name], want[name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.numel() else True, name


CONFIG_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size",
               "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
               "mlp_bias", "n_embd", "n_layer", "n_head", "n_positions", "n_inner",
               "layer_norm_epsilon", "activation_function", "hidden_act", "head_dim",
               "sliding_window", "use_sliding_window", "max_window_layers", "layer_types")


def assert_configs_agree(got_dir, want_dir, keys, compared=None):
    """The config in `got_dir` (an export's) is of the class of want_dir's and agrees with it on
    each of `keys` that want_dir's has. `compared(key, got, want, want_config)`: the two values
    to compare instead of got and want. Returns both configs."""
    got = transformers.AutoConfig.from_pretrained(got_dir)
    want = transformers.AutoConfig.from_pretrained(want_dir)
    assert type(got) is type(want)
    for key in keys:
        if hasattr(want, key):
            g, w = getattr(got, key), getattr(want, key)
            if compared:
                g, w = compared(key, g, w, want)
            assert g == w, (key, g, w)
    return got, want


def gpt2_default_n_inner(key, got, want, want_config):
    """GPT-2's n_inner null means 4 x n_embd, which export writes out."""
    if key == "n_inner" and want is None:
        want = 4 * want_config.n_embd
    return got, want


def assert_equivalent_configs(got_dir, want_dir):
    got, want = assert_configs_agree(got_dir, want_dir, CONFIG_KEYS, gpt2_default_n_inner)
    if want.model_type in ("llama", "qwen2", "qwen3"):
        assert got.rope_parameters == want.rope_parameters


def load_hf(out_dir):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        out_dir, output_loading_info=True, attn_implementation="eager")
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info[kind], (kind, info[kind])
    return model.float().eval()


def braid_model(ckpt, config=config_from_metadata):
    """A braid.GPTModel of the checkpoint (its config made by `config` from the metadata's) with
    the parameters and expert biases the tool's reader reads."""
    meta, tensors = convert_hf.read_checkpoint(str(ckpt))
    model = braid.GPTModel(config(meta["config"]), device="cpu", seed=1)
    params, biases = model.parameters(), model.expert_biases()
    assert sorted([*params, *biases]) == sorted(tensors)
    for name, t in tensors.items():
        assert t.dtype == "F32"
        (params[name] if name in params else biases[name]).copy_(
            np.ascontiguousarray(t.array, dtype=np.float32))
    return model


def metadata(ckpt, iteration=0):
    return json.loads((ckpt / f"iter_{iteration:07d}" / "metadata.json").read_text())


def assert_same_logits(model, ids, want):
    """braid's `model` computes the logits `want` of `ids` (within LOGITS_RTOL of their
    largest)."""
    got = np.from_dlpack(model.logits(ids))
    assert got.shape == want.shape
    err = np.abs(got.astype(np.float64) - want).max() / np.abs(want).max()
    assert err <= LOGITS_RTOL, err


def mlp_kinds(hf):
    """The class of each layer's MLP, as transformers built it: its experts or its dense MLP."""
    return [type(layer.mlp).__name__ for layer in hf.model.layers]


def assert_computes_both(model, hf_dir, out, hf_logits):
    """braid's `model` of an import computes the logits of IDS of both the original HF model in
    `hf_dir` and the export in `out`, whose layers transformers builds with the same MLPs.
    `hf_logits(hf, ids)`: an HF model's logits, its routing checked."""
    original, back = load_hf(hf_dir), load_hf(out)
    assert mlp_kinds(back) == mlp_kinds(original)
    assert_same_logits(model, IDS, hf_logits(back, IDS))
    assert_same_logits(model, IDS, hf_logits(original, IDS))


def save_after_a_step(cfg, path, seed, routers=("mlp.gate.weight",)):
    """A braid.GPTModel of `cfg` (`seed`) saved at `path` by braid itself after one training step
    on IDS, the weights named `routers` drawn wide (std 0.2, as the HF models') first so that no
    token's routing is near a tie."""
    model = braid.GPTModel(cfg, device="cpu", seed=seed)
    rng = np.random.default_rng(seed)
    for name, p in model.parameters().items():
        if name.endswith(routers):
            p.copy_(rng.normal(0.0, 0.2, size=tuple(p.shape)).astype(np.float32))
    trainer = braid.Trainer(model, braid.AdamWConfig(), braid.LRSchedule(lr=1e-3,
                                                                         style="constant"))
    trainer.train_step(IDS, IDS)
    braid.save_checkpoint(str(path), trainer)
    return model


def imported(tmp_path, kind, models=MODELS):
    hf_dir = models[kind](tmp_path / "hf")
    r = run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "ckpt")
    assert r.returncode == 0, r.stderr
    return hf_dir, tmp_path / "ckpt"


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_round_trip_is_exact_and_logits_match(tmp_path, kind):
    hf_dir, ckpt = imported(tmp_path, kind)
    if kind.startswith("gpt2-tied-sharded"):
        assert os.path.exists(hf_dir / "model.safetensors.index.json")
    out = tmp_path / "out"
    r = run_tool("export", "--load", ckpt, "--hf-dir", out)
    assert r.returncode == 0, r.stderr
    assert_same_bits(hf_weights(out), hf_weights(hf_dir))
    assert_equivalent_configs(out, hf_dir)

    hf = load_hf(out)
    model = braid_model(ckpt)
    with torch.no_grad():
        want = hf(torch.from_numpy(IDS)).logits.numpy()
    assert_same_logits(model, IDS, want)


def test_imported_metadata_is_a_tp1_braid_save(tmp_path):
    _, ckpt = imported(tmp_path, "llama-gqa-untied")
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "0\n"
    meta = json.loads((ckpt / "iter_0000000" / "metadata.json").read_text())
    assert meta["format"] == "braid-checkpoint" and meta["format_version"] == 1
    assert meta["iteration"] == 0 and meta["optimizer"] is False
    for key in ("consumed_samples", "trainer", "loss_scaler", "layout", "lr_schedule"):
        assert key in meta
    c = meta["config"]
    assert (c["normalization"], c["activation"], c["position_embedding"]) == ("rmsnorm", "swiglu",
                                                                             "rope")
    assert c["num_query_groups"] == 2 and c["tie_embeddings"] is False
    t = meta["tensors"]
    assert t["model.layers.0.self_attn.k_proj.weight"] == {
        "shape": [32, 64], "split_dim": 0,
        "shards": [{"file": "mp_rank_00_000.safetensors", "start": 0, "length": 32}]}
    assert t["model.layers.0.self_attn.o_proj.weight"]["split_dim"] == 1
    assert t["model.layers.0.self_attn.o_proj.weight"]["shards"][0]["length"] == 64
    assert t["model.norm.weight"]["split_dim"] == -1
    assert t["model.norm.weight"]["shards"][0]["length"] == 64
    assert t["lm_head.weight"]["shards"][0]["length"] == 97
    assert not any(name.startswith("optimizer.") for name in t)


def test_bf16_round_trip_is_exact(tmp_path):
    hf_dir = llama(tmp_path / "hf", dtype=torch.bfloat16)
    assert run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "ckpt").returncode == 0
    meta = json.loads((tmp_path / "ckpt" / "iter_0000000" / "metadata.json").read_text())
    assert meta["config"]["params_dtype"] == "bf16"
    r = run_tool("export", "--load", tmp_path / "ckpt", "--hf-dir", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    got, want = hf_weights(tmp_path / "out"), hf_weights(hf_dir)
    assert all(t.dtype == torch.bfloat16 for t in want.values())
    assert_same_bits(got, want)
    assert load_hf(tmp_path / "out").config.vocab_size == 97


@pytest.mark.parametrize("make,dtype,shift", [(llama, torch.float32, -1),
                                              (llama, torch.bfloat16, -1),
                                              (nemotron, torch.bfloat16, 1)])
def test_export_writes_norm_weights_in_hfs_convention(tmp_path, make, dtype, shift):
    # braid's norm weights hold gamma - 1 with --apply-layernorm-1p (zero_centered_gamma) and
    # gamma without; HF's Llama holds gamma, its Nemotron gamma - 1. The import is rewritten as
    # a braid model of the other convention (norm weights shifted by one), and the export gives
    # back HF's weights: bit for bit from gamma - 1 to gamma (w - 1 + 1 is w near 1, in bf16
    # too), within the rounding of 1 + w the other way.
    hf_dir = make(tmp_path / "hf", dtype=dtype)
    ckpt = tmp_path / "ckpt"
    assert run_tool("import", "--hf-dir", hf_dir, "--save", ckpt).returncode == 0
    iter_dir = ckpt / "iter_0000000"
    meta = json.loads((iter_dir / "metadata.json").read_text())
    meta["config"]["zero_centered_gamma"] = shift < 0
    _, tensors = convert_hf.read_checkpoint(str(ckpt))
    torch_dtype = {"F32": torch.float32, "BF16": torch.bfloat16}
    for name, t in tensors.items():
        if name.endswith("norm.weight"):
            w = torch.from_numpy(t.array.copy()).view(torch_dtype[t.dtype]) + shift
            tensors[name] = t.like(w.view(torch.int16 if t.dtype == "BF16" else dtype).numpy()
                                   .view(t.array.dtype))
    convert_hf.write_safetensors(str(iter_dir / "mp_rank_00_000.safetensors"), tensors)
    (iter_dir / "metadata.json").write_text(json.dumps(meta))
    out = tmp_path / "out"
    r = run_tool("export", "--load", ckpt, "--hf-dir", out)
    assert r.returncode == 0, r.stderr
    got, want = hf_weights(out), hf_weights(hf_dir)
    if shift < 0:
        assert_same_bits(got, want)
    for name in want:
        tol = torch.finfo(dtype).eps if name.endswith("norm.weight") else 0
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=tol)
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, 97, size=(2, 12)))
    with torch.no_grad():
        torch.testing.assert_close(load_hf(out)(ids).logits, load_hf(hf_dir)(ids).logits,
                                   rtol=2e-2, atol=2e-2)


# ---- a checkpoint in braid's sharded layout (sharded_saves.py) ----------------------------

@pytest.mark.parametrize("kind", ["llama-gqa-untied", "llama-mqa-tied", "gpt2-untied",
                                  "qwen2-tied", "qwen3-wide-heads"])
def test_export_reassembles_a_sharded_braid_save(tmp_path, kind):
    hf_dir, ckpt = imported(tmp_path, kind)
    files = reshard(ckpt, tmp_path / "sharded", tp=2, pp=2)
    assert files == ["mp_rank_00_000.safetensors", "mp_rank_00_001.safetensors",
                     "mp_rank_01_000.safetensors", "mp_rank_01_001.safetensors"]
    assert_exports_exactly(tmp_path / "sharded", tmp_path / "out", hf_dir)
    assert_equivalent_configs(tmp_path / "out", hf_dir)


def assert_exports_exactly(ckpt, out, hf_dir):
    """The export of `ckpt` to `out` holds the tensors of hf_dir bit for bit, and transformers
    loads it."""
    r = run_tool("export", "--load", ckpt, "--hf-dir", out)
    assert r.returncode == 0, r.stderr
    assert_same_bits(hf_weights(out), hf_weights(hf_dir))
    load_hf(out)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
@pytest.mark.parametrize("kind", ["llama-gqa-untied", "gpt2-untied", "qwen2-tied",
                                  "qwen3-untied", "qwen3-wide-heads", "stablelm-partial-rotary",
                                  "nemotron-bias"])
def test_export_of_a_checkpoint_braid_saved_at_tp2_pp2(tmp_path, kind):
    """The real path: braid's C++ loads the import into a tp = 2, pp = 2 job (4 ranks) and saves
    it there; export reassembles that save bit for bit."""
    hf_dir, ckpt = imported(tmp_path, kind)
    resave_at_tp2_pp2(ckpt, tmp_path / "sharded")
    files = sorted(os.listdir(tmp_path / "sharded" / "iter_0000000"))
    assert files == ["metadata.json", "mp_rank_00_000.safetensors", "mp_rank_00_001.safetensors",
                     "mp_rank_01_000.safetensors", "mp_rank_01_001.safetensors"]
    assert_exports_exactly(tmp_path / "sharded", tmp_path / "out", hf_dir)


# ---- bad inputs ------------------------------------------------------------------------------

def assert_fails(r, *words):
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_missing_directory_and_files(tmp_path):
    assert_fails(run_tool("import", "--hf-dir", tmp_path / "nope", "--save", tmp_path / "c"),
                 "no such directory")
    (tmp_path / "empty").mkdir()
    assert_fails(run_tool("import", "--hf-dir", tmp_path / "empty", "--save", tmp_path / "c"),
                 "no config.json")
    hf_dir = llama(tmp_path / "hf")
    os.remove(hf_dir / "model.safetensors")
    assert_fails(run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "c"),
                 "model.safetensors")
    assert_fails(run_tool("export", "--load", tmp_path / "nothing", "--hf-dir", tmp_path / "o"),
                 "no such directory")
    assert_fails(run_tool("export", "--load", tmp_path / "empty", "--hf-dir", tmp_path / "o"),
                 "latest_checkpointed_iteration.txt")


def test_unsupported_architecture(tmp_path):
    cfg = transformers.GPTNeoXConfig(vocab_size=97, hidden_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, intermediate_size=128)
    transformers.GPTNeoXForCausalLM(cfg).save_pretrained(tmp_path / "neox")
    assert_fails(run_tool("import", "--hf-dir", tmp_path / "neox", "--save", tmp_path / "c"),
                 "unsupported architecture", "GPTNeoXForCausalLM")
    assert not (tmp_path / "c").exists()


def edit_config(hf_dir, **changes):
    path = hf_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def assert_import_refused(hf_dir, changes, words, save):
    """With `changes` in its config.json, the import of hf_dir fails with one line holding
    `words` and writes nothing at `save`."""
    edit_config(hf_dir, **changes)
    assert_fails(run_tool("import", "--hf-dir", hf_dir, "--save", save), *words)
    assert not save.exists()


@pytest.mark.parametrize("make,changes,field", [
    (llama, {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling"),
    (llama, {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0}},
     "rope_parameters.rope_type"),
    (llama, {"hidden_act": "gelu"}, "hidden_act"),
    (llama, {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    (llama, {"attention_bias": True}, "attention_bias"),
    (stablelm, {"qk_layernorm": True}, "qk_layernorm"),
    (stablelm, {"use_parallel_residual": True}, "use_parallel_residual"),
    (llama, {"sliding_window": 4096}, "sliding_window"),
    (qwen2, {"use_sliding_window": True, "layer_types": ["full_attention", "chunked_attention"]},
     "layer_types"),
])
def test_refuses_what_braid_cannot_represent(tmp_path, make, changes, field):
    hf_dir = make(tmp_path / "hf")
    edit_config(hf_dir, **changes)
    assert_fails(run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "c"), field,
                 "not supported")


@pytest.mark.parametrize("make,key", [(llama, "num_hidden_layers"), (gpt2, "n_layer"),
                                      (gpt2, "n_positions")])
def test_a_size_that_is_not_a_positive_integer_is_named_as_config_json_names_it(tmp_path, make,
                                                                               key):
    hf_dir = make(tmp_path / "hf")
    edit_config(hf_dir, **{key: "2"})
    assert_fails(run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "c"),
                 f"config.json: {key} should be a positive integer, is '2'")
    assert not (tmp_path / "c").exists()


def test_head_dim_must_agree_with_the_weights_and_be_even(tmp_path):
    hf_dir = llama(tmp_path / "hf")  # 4 heads of 16 on hidden 64
    edit_config(hf_dir, head_dim=32)
    assert_fails(run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "c"),
                 "model.layers.0.self_attn.q_proj.weight", "[128, 64]")
    edit_config(hf_dir, head_dim=15)
    assert_fails(run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "c"),
                 "head_dim 15 x partial_rotary_factor 1.0 = 15 channels turn")
    assert not (tmp_path / "c").exists()


def imported_config(tmp_path, hf_dir):
    r = run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "c")
    assert r.returncode == 0, r.stderr
    config = json.loads((tmp_path / "c" / "iter_0000000" / "metadata.json").read_text())["config"]
    shutil.rmtree(tmp_path / "c")
    return config


def test_sliding_windows_import_as_transformers_reads_them(tmp_path):
    # Mistral: a config.json without sliding_window has transformers' default, 4096 keys (its
    # own among them): braid's window_size 4095, every layer. null: no window.
    hf_dir = mistral(tmp_path / "hf")
    cfg = json.loads((hf_dir / "config.json").read_text())
    del cfg["sliding_window"]
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    config = imported_config(tmp_path, hf_dir)
    assert (config["window_size"], config["window_layers"]) == (4095, [])
    edit_config(hf_dir, sliding_window=None)
    assert imported_config(tmp_path, hf_dir)["window_size"] == -1
    # Qwen2: the window is unused unless use_sliding_window (as Qwen2.5's configs have it);
    # then on the layers from max_window_layers on, or those layer_types names.
    hf_dir = qwen2(tmp_path / "qwen2", layers=2)
    edit_config(hf_dir, sliding_window=4096, max_window_layers=1)
    assert imported_config(tmp_path, hf_dir)["window_size"] == -1
    edit_config(hf_dir, use_sliding_window=True, layer_types=None)
    config = imported_config(tmp_path, hf_dir)
    assert (config["window_size"], config["window_layers"]) == (4095, [0, 1])
    edit_config(hf_dir, layer_types=["sliding_attention", "full_attention"])
    assert imported_config(tmp_path, hf_dir)["window_layers"] == [1, 0]


def test_stablelm_default_partial_rotary(tmp_path):
    # A config.json without partial_rotary_factor means a quarter (transformers' default).
    hf_dir = stablelm(tmp_path / "hf")
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg.pop("partial_rotary_factor", None)
    cfg.get("rope_parameters", {}).pop("partial_rotary_factor", None)
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    assert run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "c").returncode == 0
    meta = json.loads((tmp_path / "c" / "iter_0000000" / "metadata.json").read_text())
    assert meta["config"]["rotary_percent"] == 0.25


def test_export_refuses_what_no_hf_architecture_holds():
    c = {"normalization": "layernorm", "activation": "swiglu", "position_embedding": "rope",
         "add_bias_linear": False, "qk_layernorm": False, "hidden_size": 64,
         "num_attention_heads": 4, "num_query_groups": 4, "kv_channels": 16}
    assert convert_hf.braid_architecture(c) == "stablelm"
    with pytest.raises(convert_hf.ConvertError, match="StableLM shaped but its heads are 32 wide"):
        convert_hf.braid_architecture(dict(c, kv_channels=32))
    with pytest.raises(convert_hf.ConvertError, match="only StableLM and Nemotron"):
        convert_hf.braid_architecture(dict(c, normalization="rmsnorm", rotary_percent=0.5))
    with pytest.raises(convert_hf.ConvertError, match="Nemotron shaped .* but has qk_layernorm"):
        convert_hf.braid_architecture(dict(c, activation="squared_relu", qk_layernorm=True))


def test_export_refuses_interleaved_rope(tmp_path):
    # --rotary-interleaved pairs RoPE's channels as GPT-J does; the exported architectures pair
    # them as rotate_half, so the export would compute another model.
    _, ckpt = imported(tmp_path, "mistral-sliding-window")
    meta_path = ckpt / "iter_0000000" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["config"]["rotary_interleaved"] = True
    meta_path.write_text(json.dumps(meta))
    r = run_tool("export", "--load", ckpt, "--hf-dir", tmp_path / "out")
    assert r.returncode == 1 and "pairs RoPE's channels interleaved (rotary_interleaved" in \
        r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_windowed_llama_exports_as_qwen2_with_zero_biases(tmp_path):
    # A braid model windowed on some layers and without biases (as --window-attn-skip-freq
    # trains one) has no Llama or Mistral form: it exports as Qwen2 with q, k, v biases of zero,
    # and transformers computes braid's logits from it.
    _, ckpt = imported(tmp_path, "mistral-sliding-window")
    meta_path = ckpt / "iter_0000000" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["config"]["window_layers"] = [0, 1]
    meta.pop("hf_config", None)
    meta_path.write_text(json.dumps(meta))
    out = tmp_path / "out"
    r = run_tool("export", "--load", ckpt, "--hf-dir", out)
    assert r.returncode == 0, r.stderr
    hf = load_hf(out)
    assert hf.config.model_type == "qwen2"
    assert hf.config.layer_types == ["full_attention", "sliding_attention"]
    assert hf.config.sliding_window == 5
    assert not hf.model.layers[0].self_attn.q_proj.bias.any()
    model = braid_model(ckpt)
    assert list(model.config.window_layers) == [0, 1]
    ids = np.random.default_rng(0).integers(0, 97, size=(3, 16), dtype=np.int64)
    got = np.from_dlpack(model.logits(ids))
    with torch.no_grad():
        want = hf(torch.from_numpy(ids)).logits.numpy()
    err = np.abs(got.astype(np.float64) - want).max() / np.abs(want).max()
    assert err <= LOGITS_RTOL, err


def test_export_of_windowed_models(tmp_path):
    # A window on every layer of a Llama-shaped model is Mistral; on some, Qwen2 (its q, k, v
    # biases written as zeros); biases on every linear layer or another shape: refused.
    c = {"normalization": "rmsnorm", "activation": "swiglu", "position_embedding": "rope",
         "add_bias_linear": False, "qk_layernorm": False, "window_size": 7, "window_layers": [],
         "num_layers": 2}
    assert convert_hf.braid_architecture(c) == "mistral"
    assert convert_hf.braid_architecture(dict(c, window_layers=[1, 0])) == "qwen2"
    assert convert_hf.braid_architecture(dict(c, window_layers=[1, 1])) == "mistral"
    assert convert_hf.braid_architecture(dict(c, window_layers=[0, 0])) == "llama"  # no window
    assert convert_hf.braid_architecture(dict(c, qk_layernorm=True)) == "qwen3"
    with pytest.raises(convert_hf.ConvertError, match="sliding window and biases"):
        convert_hf.braid_architecture(dict(c, add_bias_linear=True))
    with pytest.raises(convert_hf.ConvertError, match="only Mistral, Qwen2 and Qwen3"):
        convert_hf.braid_architecture(dict(c, normalization="layernorm"))


def test_refuses_gpt2_activation(tmp_path):
    hf_dir = gpt2(tmp_path / "hf")
    edit_config(hf_dir, activation_function="relu")
    assert_fails(run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "c"),
                 "activation_function")


def test_shape_that_disagrees(tmp_path):
    hf_dir = llama(tmp_path / "hf")
    edit_config(hf_dir, intermediate_size=128)
    assert_fails(run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "c"),
                 "mlp.gate_proj.weight", "[160, 64]", "[128, 64]")
    hf_dir = gpt2(tmp_path / "g")
    edit_config(hf_dir, n_embd=32)
    assert_fails(run_tool("import", "--hf-dir", hf_dir, "--save", tmp_path / "c2"), "c_attn")


def test_export_refuses_a_shape_that_disagrees(tmp_path):
    _, ckpt = imported(tmp_path, "llama-gqa-untied")
    path = ckpt / "iter_0000000" / "metadata.json"
    meta = json.loads(path.read_text())
    meta["tensors"]["model.norm.weight"]["shape"] = [65]
    meta["config"]["hidden_size"] = 64
    path.write_text(json.dumps(meta))
    assert_fails(run_tool("export", "--load", ckpt, "--hf-dir", tmp_path / "o"),
                 "model.norm.weight")


def test_import_refuses_an_existing_checkpoint(tmp_path):
    hf_dir, ckpt = imported(tmp_path, "llama-mqa-tied")
    assert_fails(run_tool("import", "--hf-dir", hf_dir, "--save", ckpt), "already holds")
