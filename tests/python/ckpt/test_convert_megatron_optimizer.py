"""convert_megatron.py import carries megatron-core's Adam state: braid continues a Megatron run
where its optimizer stands.

megatron-core 0.16.1 trains a tiny Llama on the CPU with its own optimizer
(megatron_optimizer_saves.py: get_megatron_optimizer's Adam, clipping, weight decay, Megatron-LM's
scheduler) for 3 steps, saves, takes step 4 and saves again. braid imports the step-3 save and
takes step 4 on the same batch: its weights must be megatron-core's step-4 weights. The same with
fresh moments must not be (the state matters). The distributed optimizer's default save (flat
buffers per bucket; also at TP 2, with experts, under expert parallelism 2 (two chained
optimizers), with biases whose sizes leave padding, in bf16) imports
the state its per-parameter save does; so do the two saves of megatron-core before 0.14 (0.13.1:
flattened per parameter, the default of Megatron-LM then, and gathered per data-parallel group).
And back: megatron-core continues braid's exported state.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import braid
from braid.generate import config_from_metadata
from megatron_checkpoints import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.join(REPO, "tools"))
sys.path.insert(0, os.path.join(REPO, "tests", "python", "engine"))
from convert_hf import read_checkpoint  # noqa: E402
from convert_megatron import import_megatron  # noqa: E402
from pretrain_job import run  # noqa: E402

pytest.importorskip("megatron.core")
CONVERT = os.path.join(REPO, "tools", "convert_megatron.py")
# data-parallel ranks -> the jobs NAME:SHARDING:MODEL run in one process. The optimizer not
# distributed; distributed and saved per parameter (Megatron-LM's
# --dist-ckpt-optim-fully-reshardable); distributed, Megatron-LM's default save (flat buffers per
# data-parallel rank); in the legacy format (--ckpt-format torch), distributed (distrib_optim.pt
# beside each rank's file) or not (the state in the rank's file, numbered by position). The
# Llama, a GPT (LayerNorm, biases, learned positions, tied) and a Mixtral-like model (4 experts,
# top 2).
RUNS = {1: ["plain:plain:llama", "gpt:plain:gpt", "mixtral:plain:mixtral"],
        2: ["fully_reshardable:fully_reshardable:llama", "dp_reshardable:dp_reshardable:llama",
            "tp2:dp_reshardable-tp2:llama", "gpt_flat:dp_reshardable:gpt",
            "mixtral_flat:dp_reshardable:mixtral", "bf16_full:fully_reshardable:llama@bfloat16",
            "bf16_flat:dp_reshardable:llama@bfloat16", "ep2:dp_reshardable-ep2:mixtral",
            "legacy_tp2:legacy-tp2:llama", "legacy_ep2:legacy-ep2:mixtral",
            "legacy_plain_tp2:legacy_plain-tp2:gpt", "legacy_plain_ep2:legacy_plain-ep2:mixtral",
            "legacy_plain_bf16:legacy_plain:llama@bfloat16"]}
# megatron-core before 0.14 (0.13.1, which bootstrap installs beside the venv's: PRE014) saved
# the distributed optimizer's state per parameter in flattened pieces (fully_sharded_model_space,
# Megatron-LM's default then) or gathered per data-parallel group (dp_zero_gather_scatter). The
# GPT puts a parameter across the two ranks' ranges; TP 2 cuts the pieces' grid; bf16 keeps the
# main parameters as fp32_param; buckets of 10,500 elements join a bucket off the 64-element
# alignment of its parameters (-b10500); EP 2 chains two optimizers.
PRE014 = os.path.join(sys.prefix, "megatron-core-pre014")
PRE014_RUNS = ["fsms_gpt:fully_sharded_model_space:gpt",
               "fsms_tp2:fully_sharded_model_space-tp2:llama",
               "fsms_bf16:fully_sharded_model_space:llama@bfloat16",
               "dpz_buckets:dp_zero_gather_scatter-b10500:gpt",
               "dpz_ep2:dp_zero_gather_scatter-ep2:mixtral"]
# Pipeline parallel 2: megatron-core loads a save above into two stages, as Megatron-LM reshards
# a run, and saves it again without a step (NAME, SHARDING:KIND, the save it loads): the legacy
# format's rank folders per stage, the last stage's copy of the GPT's tied embedding in the
# optimizer not distributed.
RESAVED = [("pp2_legacy", "legacy-pp2:llama", "fully_reshardable"),
           ("pp2_flat", "dp_reshardable-pp2:llama", "fully_reshardable"),
           ("pp2_legacy_plain_gpt", "legacy_plain-pp2:gpt", "gpt")]
# Tensors whose step 4 is compared loosely (1e-2 of their scale), and why. k_proj's bias has a
# zero gradient in exact arithmetic (it adds the same to all of a query's scores): Adam divides
# its rounding noise by its own size (1.0e-3 off; the GPT's other tensors within 5.2e-7). In the
# Mixtral-like model one token's embedding row is 1.9e-4 of the table's scale off (one
# occurrence in the batch; every other tensor within 2.1e-7).
LOOSE = {"gpt": ("self_attn.k_proj.bias",), "mixtral": ("model.embed_tokens.weight",),
         "gpt_flat": ("self_attn.k_proj.bias",), "mixtral_flat": ("model.embed_tokens.weight",),
         "ep2": ("model.embed_tokens.weight",), "fsms_gpt": ("self_attn.k_proj.bias",),
         "dpz_buckets": ("self_attn.k_proj.bias",), "dpz_ep2": ("model.embed_tokens.weight",),
         "legacy_ep2": ("model.embed_tokens.weight",), "legacy_plain_tp2": (
             "self_attn.k_proj.bias",), "legacy_plain_ep2": ("model.embed_tokens.weight",)}


def pre014_installed():
    """Whether bootstrap's megatron-core 0.13.1 is there (CI: it must be)."""
    if os.path.isdir(os.path.join(PRE014, "megatron", "core")):
        return True
    assert not os.environ.get("CI"), f"{PRE014}: missing (scripts/bootstrap.sh installs it)"
    return False


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron_optimizer")
    launches = [(ranks, list(jobs), {}) for ranks, jobs in RUNS.items()]
    launches[-1][1].extend(f"{name}:{sharding}:{out / source}:resave"  # (after their sources)
                           for name, sharding, source in RESAVED)
    if pre014_installed():
        launches.append((2, PRE014_RUNS, {"PYTHONPATH": PRE014}))
    for i, (ranks, jobs, env) in enumerate(launches):
        r = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
             "--master-port", str(free_port()),
             os.path.join(HERE, "megatron_optimizer_saves.py"), str(out), *jobs],
            capture_output=True, text=True, timeout=600,
            env=dict(os.environ, OMP_NUM_THREADS="1", **env))
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return out


def pre014(*values):
    return pytest.param(*values, marks=pytest.mark.skipif(
        not pre014_installed(), reason=f"no megatron-core 0.13.1 at {PRE014}"))


def tool(source, target):
    """convert_megatron.py import, the command."""
    r = subprocess.run([sys.executable, CONVERT, "import", "--megatron-dir", str(source),
                        "--save", str(target)], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=os.path.join(REPO, "python")))
    assert r.returncode == 0, r.stderr
    return r


def convert(source):
    """Megatron's save at `source` imported (once, in this process): the braid checkpoint."""
    target = source.parent / (source.name + ".braid")
    if not target.exists():
        import_megatron(str(source), str(target))
    return target


def trainer_of(ckpt, load_optim):
    """(model, trainer) resumed from a braid checkpoint, with megatron-core's Adam and schedule
    as megatron_optimizer_saves.py configures them (Megatron decays the embeddings too)."""
    meta, _ = read_checkpoint(str(ckpt))
    model = braid.GPTModel(config_from_metadata(meta["config"]), device="cpu", seed=5)
    trainer = braid.Trainer(model, braid.AdamWConfig(
        lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, clip_grad=1.0,
        decay_embeddings=True), braid.LRSchedule(lr=1e-2, min_lr=1e-2, decay_iters=100,
                                                 style="constant"))
    braid.load_checkpoint(str(ckpt), trainer, load_optim=load_optim, load_rng=False)
    return model, trainer


def step_four(ckpt, batch, load_optim):
    """braid's next step from a checkpoint: (its loss, its weights)."""
    model, trainer = trainer_of(ckpt, load_optim)
    stats = trainer.train_step(batch["ids"], batch["labels"])
    return stats.loss, {n: np.from_dlpack(t) for n, t in model.parameters().items()}


def values(t):
    """A Tensor's values in float64 (bf16 from its 16 bits)."""
    if t.dtype == "BF16":
        return (t.array.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return t.array.astype(np.float64)


def relative_error(got, want):
    """||got - want|| / ||want|| of two Tensors (0 for two zero tensors). A state placed on
    another parameter of the same shape is off by ~0.1 or more (0.13 the least seen)."""
    a, b = values(got), values(want)
    norm = np.linalg.norm(b)
    return np.linalg.norm(a - b) / norm if norm > 0 else float(np.linalg.norm(a))


def max_errors(got, want):
    """{name: max relative difference}: braid's weights against an imported Megatron step's."""
    errors = {n: np.abs(got[n] - w.array).max() / np.abs(w.array).max() for n, w in want.items()}
    assert set(errors) == set(got)
    return errors


@pytest.mark.parametrize("sharding", ["plain", "fully_reshardable", "gpt", "mixtral",
                                      "dp_reshardable", "tp2", "gpt_flat", "mixtral_flat",
                                      "ep2", "legacy_tp2", "legacy_ep2", "legacy_plain_tp2",
                                      "legacy_plain_ep2",
                                      *map(pre014, ("fsms_gpt", "fsms_tp2",
                                                    "dpz_buckets", "dpz_ep2"))])
def test_braid_takes_megatrons_next_step(saves, sharding):
    ckpt = convert(saves / sharding)
    meta, tensors = read_checkpoint(str(ckpt))
    assert meta["optimizer"] is True and meta["trainer"]["optimizer_steps"] == 3
    assert meta["lr_schedule"]["lr"] == pytest.approx(1e-2) and \
        meta["lr_schedule"]["decay_iters"] == 100  # Megatron's samples / the global batch
    _, want = read_checkpoint(str(convert(saves / sharding / "after")))
    batch = np.load(saves / sharding / "step4.npz")
    loss, got = step_four(ckpt, batch, load_optim=True)
    assert loss == pytest.approx(batch["losses"][3], rel=1e-5)
    errors = max_errors(got, want)
    loose = [n for n in errors if n.endswith(LOOSE.get(sharding, ()))]
    print(f"{sharding}: braid's step 4 vs megatron-core's, max relative difference "
          f"{max(errors[n] for n in errors if n not in loose):.2g}")
    assert max(errors[n] for n in errors if n not in loose) < 1e-5, errors
    assert all(errors[n] < 1e-2 for n in loose), errors
    # Fresh moments: the same gradients (the same loss), another step.
    loss, fresh = step_four(ckpt, batch, load_optim=False)
    assert loss == pytest.approx(batch["losses"][3], rel=1e-5)
    assert max(np.abs(fresh[n] - w.array).max() / np.abs(w.array).max()
               for n, w in want.items()) > 1e-2


def test_pretrain_gpt_resumes_the_import_with_its_optimizer(saves, tmp_path):
    r = tool(saves / "plain", tmp_path / "ckpt")
    assert "Adam's state carried (step 3" in r.stdout, r.stdout
    common = ["--device", "cpu", "--load", str(tmp_path / "ckpt"), "--use-checkpoint-args",
              "--no-load-rng", "--mock-data", "--seq-length", "16", "--micro-batch-size", "2",
              "--global-batch-size", "2", "--train-iters", "100", "--lr-decay-iters", "100",
              "--lr-decay-style", "constant", "--min-lr", "1e-2", "--weight-decay", "0.1",
              "--clip-grad", "1.0", "--adam-beta2", "0.95", "--exit-interval", "4",
              "--eval-iters", "0", "--log-interval", "1"]
    r = run(1, [*common, "--lr", "1e-2"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert " iteration        4/     100 |" in r.stdout, r.stdout
    # Megatron's rule: continuing the optimizer takes the checkpoint's learning-rate schedule.
    r = run(1, [*common, "--lr", "3e-2"])
    assert r.returncode != 0 and "the learning-rate schedule differs from the checkpoint's: " \
        "learning rate: 0.03 (the checkpoint: 0.01)" in r.stderr, r.stderr


@pytest.mark.parametrize("flat,full", [("dp_reshardable", "fully_reshardable"),
                                       ("bf16_flat", "bf16_full"), ("legacy_tp2", "tp2"),
                                       ("legacy_ep2", "ep2"), ("pp2_legacy", "fully_reshardable"),
                                       ("pp2_flat", "fully_reshardable"),
                                       ("pp2_legacy_plain_gpt", "gpt"),
                                       pre014("fsms_bf16", "bf16_full"),
                                       pre014("dpz_buckets", "fsms_gpt"),
                                       pre014("dpz_ep2", "ep2")])
def test_flat_state_is_the_per_parameter_state(saves, flat, full):
    """The distributed optimizer's default save (flat buffers per bucket) and its save per
    parameter, of the same run, import the same tensors, Adam's included, bit for bit: f32, and
    bf16 weights (the flat buffers' f32 main parameters rounded to match them; braid's masters
    the main parameters). So do the legacy format's (its distrib_optim.pt per rank, placed by
    value in that rank's parameters, then joined over TP as the weights are), megatron-core
    0.13's saves, flattened and gathered, of the same runs as megatron-core 0.16's, and saves
    resharded to two pipeline stages."""
    cross_version = flat in {name.split(":")[0] for name in PRE014_RUNS}
    meta, flat = read_checkpoint(str(convert(saves / flat)), optimizer=True)
    _, full = read_checkpoint(str(convert(saves / full)), optimizer=True)
    assert any(n.startswith("optimizer.exp_avg_sq.") for n in full) and set(flat) == set(full)
    if cross_version:
        # Two megatron-core versions' runs of the same steps: on some CPUs (AVX-512 BF16 ones
        # seen) their reductions round the last bits otherwise (5e-7 of a norm seen). k_proj's
        # bias has a true gradient of 0 (the softmax cancels it), so its moments are rounding
        # noise, which differs wholly, and Adam's steps on that noise move the bias itself.
        for n in full:
            if not n.endswith("k_proj.bias"):
                assert relative_error(flat[n], full[n]) <= 1e-5, n
    else:
        assert all(np.array_equal(flat[n].array, full[n].array) for n in full)
    masters = [n for n in full if n.startswith("optimizer.master.")]
    assert len(masters) == (len(full) // 4 if meta["config"]["params_dtype"] == "bf16" else 0)


def test_legacy_state_of_the_optimizer_not_distributed_in_bf16(saves):
    """The legacy format's optimizer not distributed in bf16 keeps its f32 main parameters
    (fp32_from_fp16_params) per param group: they become braid's masters. The same run with the
    distributed optimizer reduces its bf16 gradients otherwise, and Adam's steps amplify the
    difference where a gradient is near 0 (up to 0.6% of a tensor's norm seen, on an AVX-512
    BF16 CPU); a state placed on another parameter would differ by 13% or more."""
    meta, plain = read_checkpoint(str(convert(saves / "legacy_plain_bf16")), optimizer=True)
    _, full = read_checkpoint(str(convert(saves / "bf16_full")), optimizer=True)
    assert meta["config"]["params_dtype"] == "bf16" and set(plain) == set(full)
    assert len([n for n in plain if n.startswith("optimizer.master.")]) == len(plain) // 4
    for n, t in full.items():
        if t.dtype == "F32":
            assert relative_error(plain[n], t) <= 3e-2, n


def test_flat_state_that_values_cannot_place_is_refused(saves):
    """Which parameter lies where in a bucket is found by value: a piece that matches no
    parameter, or two parameters of equal values, are refused rather than guessed."""
    from hf_configs import ConvertError
    from megatron_optimizer import flat_state, take_flat
    from megatron_torch_dist import read_torch_dist, tensor_chunks
    folder = str(saves / "dp_reshardable" / "iter_0000003")
    tensors, _, _ = read_torch_dist(folder, lambda k: not k.startswith(("rng", "rerun")))
    buckets = take_flat(tensors)
    chunks = {k: c for k, c in tensor_chunks(folder).items() if k in tensors}
    norm = "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    flat_state(buckets, tensors, chunks, "here")  # as saved: placed
    final = "decoder.final_layernorm.weight"  # a second tensor of the same values
    with pytest.raises(ConvertError, match="hold the same values"):
        flat_state(buckets, dict(tensors, twin=tensors[final]),
                   dict(chunks, twin=chunks[final]), "here")
    other = dict(tensors)
    other[norm] = tensors[norm].like(tensors[norm].array + np.float32(1e-3))
    with pytest.raises(ConvertError, match="match no parameter"):
        flat_state(buckets, other, chunks, "here")


@pytest.mark.parametrize("damage,said", [
    ("another step", "mp_rank_01/distrib_optim.pt: distrib_optim.pt[0].buffer_0: elements 0.. "
     "match no parameter"),
    ("truncated", "mp_rank_01/distrib_optim.pt: not a readable torch.save file"),
    ("missing", "args.use_distributed_optimizer, but no rank folder holds distrib_optim.pt")])
def test_legacy_state_that_cannot_be_placed_leaves_the_weights(saves, tmp_path, damage, said):
    """A distrib_optim.pt whose main parameters are not its rank's weights (another step's), a
    truncated one, or none at all: the weights import, Adam starts afresh, and the note says
    why."""
    import torch
    shutil.copytree(saves / "legacy_tp2", tmp_path / "megatron")
    path = tmp_path / "megatron" / "iter_0000003" / "mp_rank_01" / "distrib_optim.pt"
    if damage == "another step":
        state = torch.load(path, weights_only=True)
        (buffer,) = state[0].values()
        buffer["param"] += 1e-3
        torch.save(state, path)
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:1000])
    else:
        for rank in ("mp_rank_00", "mp_rank_01"):
            (path.parent.parent / rank / "distrib_optim.pt").unlink()
    r = tool(tmp_path / "megatron", tmp_path / "ckpt")
    assert "the optimizer state is not carried (" in r.stderr and said in r.stderr and \
        "starts Adam afresh" in r.stderr, r.stderr
    meta, tensors = read_checkpoint(str(tmp_path / "ckpt"), optimizer=True)
    _, imported = read_checkpoint(str(convert(saves / "legacy_tp2")))
    assert not meta.get("optimizer") and set(tensors) == set(imported)
    assert all(np.array_equal(tensors[n].array, imported[n].array) for n in imported)


def test_legacy_state_in_other_param_groups_leaves_the_weights(saves, tmp_path):
    """The optimizer not distributed numbers its state by position in its param groups: groups
    that are not megatron-core's default ones (here a parameter moved to the other group) are
    said, not guessed; the weights import."""
    import torch
    shutil.copytree(saves / "legacy_plain_tp2", tmp_path / "megatron")
    path = tmp_path / "megatron" / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    decay, no_decay = state["optimizer"]["param_groups"]
    decay["params"].append(no_decay["params"].pop())
    torch.save(state, path)
    r = tool(tmp_path / "megatron", tmp_path / "ckpt")
    assert "the optimizer state is not carried (" in r.stderr and "param group 0" in r.stderr \
        and "starts Adam afresh" in r.stderr, r.stderr
    meta, _ = read_checkpoint(str(tmp_path / "ckpt"))
    assert not meta.get("optimizer")


def test_a_moment_missing_for_a_parameter_is_refused(saves):
    from hf_configs import ConvertError
    from megatron_optimizer import braid_state, take_state
    from megatron_torch_dist import read_torch_dist
    from convert_hf import braid_specs
    tensors, _, _ = read_torch_dist(str(saves / "plain" / "iter_0000003"),
                                    lambda k: not k.startswith(("rng", "rerun")))
    state = take_state(tensors)
    meta, _ = read_checkpoint(str(convert(saves / "plain")))
    params = [n for n, _, _ in braid_specs(meta["config"])]
    del state["exp_avg_sq"]["decoder.final_layernorm.weight"]
    with pytest.raises(ConvertError, match="no exp_avg_sq for the parameter model.norm.weight"):
        braid_state(state, tensors, meta["config"], params, "here")



# ---- export: Megatron continues a braid run ----------------------------------------------------

@pytest.fixture(scope="module")
def exported(saves, tmp_path_factory):
    """braid's step 4 from Megatron's step-3 save (2 data-parallel ranks), saved with its Adam
    state and exported (the command); megatron-core loads that as Megatron-LM does, its
    optimizer not distributed and distributed, on 2 ranks, and takes step 5."""
    out = tmp_path_factory.mktemp("exported")
    for model, source, more in (("braid", "fully_reshardable", []),
                                ("braid_moe", "mixtral_flat", ["--expert-model-parallel-size",
                                                               "2"])):
        _, trainer = trainer_of(convert(saves / source), load_optim=True)
        batch = np.load(saves / source / "step4.npz")
        trainer.train_step(batch["ids"], batch["labels"])
        braid.save_checkpoint(str(out / model), trainer, consumed_samples=16)
        r = subprocess.run([sys.executable, CONVERT, "export", "--load", str(out / model),
                            "--megatron-dir", str(out / model.replace("braid", "megatron")),
                            *more], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=os.path.join(REPO, "python")))
        assert r.returncode == 0 and "Adam's state carried (step 4" in r.stdout, \
            r.stdout + r.stderr
    jobs = [f"{name}:{sharding}:llama:{out / 'megatron'}"
            for name, sharding in (("plain", "plain"), ("distributed", "fully_reshardable"))]
    jobs.append(f"moe:fully_reshardable-ep2:mixtral:{out / 'megatron_moe'}")
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()),
         os.path.join(HERE, "megatron_optimizer_saves.py"), str(out), *jobs],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return out


@pytest.mark.parametrize("optimizer", ["plain", "distributed", "moe"])
def test_megatron_takes_braids_next_step(exported, optimizer):
    """The optimizer not distributed; distributed; distributed under expert parallelism 2 (a
    Mixtral-like model: two chained optimizers)."""
    batch = np.load(exported / optimizer / "next.npz")
    braid_run = exported / ("braid_moe" if optimizer == "moe" else "braid")
    loss, got = step_four(braid_run, batch, load_optim=True)  # braid's step 5
    assert loss == pytest.approx(float(batch["loss"]), rel=1e-5)
    meta, want = read_checkpoint(str(convert(exported / optimizer)))
    assert meta["trainer"]["optimizer_steps"] == 5
    errors = max_errors(got, want)
    print(f"{optimizer}: braid's step 5 vs megatron-core's, max relative difference "
          f"{max(errors.values()):.2g}")
    assert max(errors.values()) < 1e-5, errors


def test_export_round_trips_the_optimizer_state_bit_for_bit(exported, tmp_path):
    from convert_megatron import export_megatron
    meta, tensors = read_checkpoint(str(exported / "braid"), optimizer=True)
    _, back = read_checkpoint(str(convert(exported / "megatron")), optimizer=True)
    assert any(n.startswith("optimizer.exp_avg_sq.") for n in tensors)
    assert set(back) == set(tensors)
    assert all(np.array_equal(back[n].array, t.array) for n, t in tensors.items())
    # A decoupled learning rate gives Megatron-LM other param groups: the weights go alone.
    with open(exported / "braid" / "iter_0000004" / "metadata.json") as f:
        edited = json.load(f)
    edited["lr_schedule"]["decoupled_lr"] = 1e-3
    copy = tmp_path / "braid"
    shutil.copytree(exported / "braid", copy)
    with open(copy / "iter_0000004" / "metadata.json", "w") as f:
        json.dump(edited, f)
    _, _, adam, note = export_megatron(str(copy), str(tmp_path / "megatron"))
    assert adam is None and "decoupled learning rate" in note and "--no-load-optim" in note
