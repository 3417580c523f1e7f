"""tools/convert_megatron.py's import of Megatron-LM's legacy checkpoints (--ckpt-format torch),
against megatron-core 0.16.1 (megatron_legacy_saves.py writes them on the CPU: two gloo ranks,
then four).

- a Llama, a 4-layer Llama, a GPT (LayerNorm, biases, learned positions, tied), a
  DeepSeek-V3-like mixture of experts (a dense layer, then experts beside a gated shared
  expert), a DeepSeek-V3-like model with multi-latent attention and an MTP depth and a
  GPT-OSS-like model (attention sinks, the quick GEGLU, biases, experts, YaRN), saved at
  TP 1: braid's loader loads the import and computes megatron-core's logits
  (and the MTP depth's cross-entropy); iteration, consumed samples and the LR schedule's
  position carry over
- megatron-core's GPTModels of the same weights at TP 2, PP 2, TP 2 x PP 2 (four ranks; the
  GPT's last stage with the tied output layer's copy), PP 2 with virtual stages, PP 2 split
  unevenly, EP 2 (MLA with MTP at TP 2 and PP 2, the GPT-OSS-like model at TP 2) saved in the
  legacy format import to the bits of the TP 1 legacy save and of the torch_dist save
- refusals: a missing rank file, an extra one, shards of one tensor of different shapes,
  replicated tensors that differ, an unknown checkpoint_version, FP8 state (Transformer Engine's
  extra states without FP8 are read)
"""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from braid.generate import load_model
from megatron_checkpoints import CONSUMED, ITERATION, PADDED_VOCAB, free_port
from megatron_legacy_saves import (FOUR_RANK_LAYOUTS, LAYOUTS, MODELS, RANK_FILE,
                                   SCHEDULER_STEPS)
from test_convert_megatron import (ITER, LOGITS_RTOL, assert_mtp_matches, assert_refused,
                                   assert_same_tensors, braid_logits, braid_mtp_losses,
                                   imported, metadata, model_tensors,
                                   mtp_cross_entropies, relative_error, tool)

HERE = os.path.dirname(os.path.abspath(__file__))
HELPER = os.path.join(HERE, "megatron_legacy_saves.py")
LAYOUT_CASES = [(name, layout) for of_model in (LAYOUTS, FOUR_RANK_LAYOUTS)
                for name, layouts in of_model.items() for layout in layouts]


@pytest.fixture(scope="module")
def legacy(tmp_path_factory):
    """The legacy saves (and torch_dist saves, logits) of megatron_legacy_saves.py: two ranks,
    then four."""
    out = tmp_path_factory.mktemp("legacy")
    for ranks in (2, 4):
        env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()))
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc-per-node", str(ranks), HELPER, str(out)], env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return out


def rank_file(save, folder):
    return save / ITER / folder / RANK_FILE


def edit_rank_file(path, edit):
    """Loads a rank file (the test's own: torch.load in full), lets `edit` change its dict,
    saves it back."""
    import torch
    state = torch.load(path, weights_only=False)
    edit(state)
    torch.save(state, path)


# ---- import ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(MODELS))
def test_legacy_import_computes_megatrons_logits(legacy, tmp_path, name):
    ckpt = imported(legacy, name, tmp_path / "ckpt")
    want = np.load(legacy / f"{name}.logits.npy")
    got = braid_logits(ckpt)
    assert got.shape == want.shape == (3, 16, PADDED_VOCAB)
    err = relative_error(got, want)
    print(f"{name} (legacy, TP 1): braid vs megatron-core logits, max relative difference "
          f"{err:.1e}")
    assert err <= LOGITS_RTOL
    if name == "mla-mtp":
        model, _ = load_model(str(ckpt))
        assert_mtp_matches(braid_mtp_losses(model),
                           mtp_cross_entropies(np.load(legacy / f"{name}.mtp-logits.npy"),
                                               PADDED_VOCAB), name)
    # the same tensors as the torch_dist save of the model
    torch_dist = imported(legacy, f"{name}-torch-dist", tmp_path / "torch-dist")
    assert_same_tensors(model_tensors(ckpt), model_tensors(torch_dist))


def test_legacy_import_carries_the_position(legacy, tmp_path):
    """Iteration, consumed samples (args) and the LR schedule's position (the scheduler's
    num_steps); an optimizer state whose param groups are not megatron-core's (the helper's one
    torch Adam group) is left out, and said why (megatron-core's own: test_convert_megatron_
    optimizer.py)."""
    code, err = tool("import", "--megatron-dir", legacy / "llama-tp2", "--save", tmp_path / "ckpt")
    assert code == 0, err
    assert "the optimizer state is not carried (" in err and "param group 0" in err, err
    meta = metadata(tmp_path / "ckpt")
    assert (meta["iteration"], meta["consumed_samples"]) == (ITERATION, CONSUMED)
    assert (meta["trainer"]["iteration"], meta["trainer"]["update_samples"]) == (
        ITERATION, SCHEDULER_STEPS)
    assert meta["optimizer"] is False
    assert meta["megatron_args"]["tensor_model_parallel_size"] == 2
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(
        ITERATION)


@pytest.mark.parametrize("name, layout", LAYOUT_CASES)
def test_legacy_layouts_import_to_the_same_bits(legacy, tmp_path, name, layout):
    """Each layout's shards merge into the TP 1 save's tensors, bit for bit (read from the
    iteration's folder itself too)."""
    want = model_tensors(imported(legacy, name, tmp_path / "tp1"))
    got = model_tensors(imported(legacy, f"{name}-{layout}", tmp_path / "ckpt"))
    assert_same_tensors(got, want)
    if layout == "tp2":
        folder = imported(legacy / f"{name}-{layout}", ITER, tmp_path / "folder")
        assert_same_tensors(model_tensors(folder), want)


def test_legacy_files_are_what_megatron_lm_writes(legacy):
    """The files of each layout, named as get_checkpoint_name names them."""
    names = {layout: sorted(os.listdir(legacy / f"{name}-{layout}" / ITER))
             for name, layout in LAYOUT_CASES if name in ("llama", "moe")}
    assert os.listdir(legacy / "gpt-tp2-pp2" / ITER / "mp_rank_01_001") == [RANK_FILE]
    assert names == {"tp2": ["mp_rank_00", "mp_rank_01"],
                     "pp2": ["mp_rank_00_000", "mp_rank_00_001"],
                     "ep2": ["mp_rank_00_000", "mp_rank_00_001"],
                     "tp2-pp2": ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000",
                                 "mp_rank_01_001"]}
    import torch
    state = torch.load(rank_file(legacy / "llama-4-pp2-vp2", "mp_rank_00_001"),
                       weights_only=False)
    assert {"args", "checkpoint_version", "iteration", "model0", "model1", "optimizer",
            "opt_param_scheduler", "rng_state"} <= set(state)


# ---- refusals --------------------------------------------------------------------------------

def copy_save(legacy, name, dst):
    shutil.copytree(legacy / name, dst)
    return dst


def test_legacy_refusals(legacy, tmp_path):
    missing = copy_save(legacy, "llama-tp2", tmp_path / "missing")
    shutil.rmtree(missing / ITER / "mp_rank_01")
    assert_refused(["import", "--megatron-dir", missing, "--save", tmp_path / "a"],
                   "no mp_rank_01/model_optim_rng.pt", "TP 2 x PP 1 x EP 1")
    extra = copy_save(legacy, "llama-tp2", tmp_path / "extra")
    shutil.copytree(extra / ITER / "mp_rank_01", extra / ITER / "mp_rank_02")
    assert_refused(["import", "--megatron-dir", extra, "--save", tmp_path / "b"],
                   "holds mp_rank_02, which TP 2 x PP 1 x EP 1")

    def narrow(state):
        w = state["model"]["decoder.layers.1.self_attention.linear_proj.weight"]
        state["model"]["decoder.layers.1.self_attention.linear_proj.weight"] = w[:, :16].clone()
    shapes = copy_save(legacy, "llama-tp2", tmp_path / "shapes")
    edit_rank_file(rank_file(shapes, "mp_rank_01"), narrow)
    assert_refused(["import", "--megatron-dir", shapes, "--save", tmp_path / "c"],
                   "decoder.layers.1.self_attention.linear_proj.weight is F32 [64, 32] at TP "
                   "rank 0, F32 [64, 16] at TP rank 1")

    def other_norm(state):
        state["model"]["decoder.final_layernorm.weight"] += 1.0
    norms = copy_save(legacy, "llama-tp2", tmp_path / "norms")
    edit_rank_file(rank_file(norms, "mp_rank_01"), other_norm)
    assert_refused(["import", "--megatron-dir", norms, "--save", tmp_path / "d"],
                   "TP ranks 0 and 1 hold different decoder.final_layernorm.weight")

    def version(state):
        state["checkpoint_version"] = 2.0
    old = copy_save(legacy, "llama", tmp_path / "old")
    edit_rank_file(rank_file(old, "mp_rank_00"), version)
    assert_refused(["import", "--megatron-dir", old, "--save", tmp_path / "e"],
                   "checkpoint_version 2.0; this tool reads 3.0")

    def fp8(state):
        import torch
        state["model"]["decoder.layers.0.self_attention.linear_proj._extra_state"] = \
            torch.arange(40, dtype=torch.uint8)
    fp8_save = copy_save(legacy, "llama", tmp_path / "fp8")
    edit_rank_file(rank_file(fp8_save, "mp_rank_00"), fp8)
    assert_refused(["import", "--megatron-dir", fp8_save, "--save", tmp_path / "f"],
                   "linear_proj._extra_state holds Transformer Engine state", "--drop-fp8-state")
    want = model_tensors(imported(legacy, "llama", tmp_path / "h"))
    assert_same_tensors(model_tensors(imported(tmp_path, "fp8", tmp_path / "g",
                                               "--drop-fp8-state")), want)

    def no_fp8(state):
        """Transformer Engine's extra states without FP8: TE 1's BytesIO of a torch.save of
        None, TE 2's byte tensor of a pickle of None, or empty."""
        import io
        import pickle
        import torch
        te1 = io.BytesIO()
        torch.save(None, te1)
        model = state["model"]
        model["decoder.layers.0.self_attention.linear_proj._extra_state"] = te1
        model["decoder.layers.0.self_attention.linear_qkv._extra_state"] = torch.frombuffer(
            bytearray(pickle.dumps(None)), dtype=torch.uint8)
        model["decoder.layers.1.self_attention.linear_qkv._extra_state"] = torch.empty(
            0, dtype=torch.uint8)
    te = copy_save(legacy, "llama", tmp_path / "te")
    edit_rank_file(rank_file(te, "mp_rank_00"), no_fp8)
    assert_same_tensors(model_tensors(imported(tmp_path, "te", tmp_path / "i")), want)
