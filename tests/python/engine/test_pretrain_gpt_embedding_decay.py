"""megatron-core's weight-decay rule in pretrain_gpt.py: every matrix decays, the word and
position embeddings and the output layer too (get_standard_config_overrides skips only biases and
1-D parameters); --embedding-init-method-std gives the embeddings their own init std and changes
nothing else (current Megatron-LM; older versions also exempted them from decay).

One step at a constant learning rate from the same initial weights: a decayed tensor X ends
lr * wd * X0 below its undecayed twin (decoupled decay of the initial weights), so
(twin - decayed) / (lr * wd) is X0 itself, whose std is the init's.
"""

import importlib.util
import os

import numpy as np

from pretrain_job import MODEL, REPO, run

_spec = importlib.util.spec_from_file_location(
    "convert_hf", os.path.join(REPO, "tools", "convert_hf.py"))
convert_hf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(convert_hf)

LR, WD = 3e-3, 0.5
# Learned positions (an embedding of their own), untied output layer; one step at lr.
ONE_STEP = [*[a for a in MODEL if a not in ("--position-embedding-type", "rope")],
            "--position-embedding-type", "learned_absolute", "--max-position-embeddings", "32",
            "--lr", str(LR), "--lr-warmup-iters", "0", "--lr-decay-style", "constant",
            "--train-iters", "1", "--eval-iters", "0"]
EMBEDDINGS = ("model.embed_tokens.weight", "model.embed_positions.weight")


def trained(tmp_path, name, *flags):
    """The tensors after one step with `flags`, as braid saved them."""
    ckpt = tmp_path / name
    r = run(1, [*ONE_STEP, *flags, "--save", str(ckpt)])
    assert r.returncode == 0, r.stdout + r.stderr
    return {n: t.array.astype(np.float64) for n, t in convert_hf.read_checkpoint(str(ckpt))[1].items()
            if not n.startswith("optimizer.")}


def initial(twin, decayed):
    """X0 from a step without decay and the same step with decay WD."""
    return (twin - decayed) / (LR * WD)


def test_embeddings_decay_as_in_megatron_unless_given_their_own_init(tmp_path):
    plain = trained(tmp_path, "wd0", "--weight-decay", "0")
    decayed = trained(tmp_path, "wd", "--weight-decay", str(WD))
    for name in (*EMBEDDINGS, "lm_head.weight", "model.layers.1.mlp.down_proj.weight"):
        x0 = initial(plain[name], decayed[name])
        std = {"model.layers.1.mlp.down_proj.weight": 0.02 / np.sqrt(8)}.get(name, 0.02)
        print(f"{name}: decayed; the initial weights' std {x0.std():.5f} (init {std:.5f})")
        assert abs(x0.std() / std - 1) < 0.05, (name, x0.std())
    for name in ("model.norm.weight", "model.layers.1.input_layernorm.weight"):
        np.testing.assert_array_equal(plain[name], decayed[name], err_msg=name)

    # --embedding-init-method-std 0.1: the embeddings start at std 0.1 and still decay; the
    # output layer and the other matrices start at --init-method-std.
    own = ["--embedding-init-method-std", "0.1"]
    plain = trained(tmp_path, "own_wd0", *own, "--weight-decay", "0")
    decayed = trained(tmp_path, "own_wd", *own, "--weight-decay", str(WD))
    for name, std in ((EMBEDDINGS[0], 0.1), (EMBEDDINGS[1], 0.1), ("lm_head.weight", 0.02),
                      ("model.layers.1.self_attn.o_proj.weight", 0.02 / np.sqrt(8))):
        x0 = initial(plain[name], decayed[name])
        assert abs(x0.std() / std - 1) < 0.05, (name, x0.std())


def test_embedding_init_method_std_must_be_positive():
    r = run(1, [*ONE_STEP, "--embedding-init-method-std", "0"])
    assert r.returncode == 2 and "--embedding-init-method-std" in r.stdout + r.stderr, \
        r.stdout + r.stderr
