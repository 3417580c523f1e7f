#!/usr/bin/env python3
"""Megatron-LM checkpoints (the torch_dist format, and the legacy torch format on import) to
braid checkpoints and back.

  convert_megatron.py import --megatron-dir DIR --save CKPT [--ckpt-step N]
      a Megatron-LM checkpoint saved under any TP/PP/EP layout
      (DIR/latest_checkpointed_iteration.txt, DIR/iter_0000100/ with metadata.json, .metadata,
      *.distcp, common.pt; or, --ckpt-format torch, with mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt)
      -> a braid checkpoint (tp=1, pp=1, at Megatron's iteration; with Adam's state, saved per
      parameter, flattened, or in the distributed optimizer's flat buffers, per bucket or
      gathered (distrib_optim.pt in the legacy format): megatron_optimizer.py); the
      model's shape comes from the args Megatron-LM saved with it
  convert_megatron.py export --load CKPT --megatron-dir OUT [--ckpt-step N]
                            [--expert-model-parallel-size N]
      a braid checkpoint saved under any layout -> a torch_dist checkpoint that megatron-core's
      dist_checkpointing loads into a GPTModel of the same shape under any TP/PP (Megatron-LM:
      --load OUT --no-load-rng, continuing Adam's state where braid's checkpoint holds it; or
      --finetune)

Model weights are moved as raw bytes (bf16 included): export followed by import gives back every
tensor bit for bit. Export carries braid's Adam state per parameter, as megatron-core's distributed
optimizer saves it fully reshardable (megatron_optimizer.py). Needs numpy and torch (for PyTorch's
distributed checkpoint files), not megatron-core. docs/convert_megatron.md has the name mapping and
what is refused; megatron_mapping.py maps names and arguments (megatron_mlp.py the MLPs and
experts, megatron_mla.py multi-latent attention and its YaRN, megatron_mtp.py the multi-token
prediction depths, megatron_gpt_oss.py attention sinks, the quick GEGLU and YaRN without MLA),
megatron_torch_dist.py reads and writes the torch_dist files, megatron_legacy.py reads the legacy
ones (merging their TP/PP/EP shards).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its siblings, when imported
from convert_hf import (TRACKER, braid_specs, checkpoint_metadata,  # noqa: E402
                        checkpoint_specs, read_checkpoint, write_checkpoint)
from hf_configs import ConvertError, check  # noqa: E402
from megatron_legacy import is_legacy, read_legacy  # noqa: E402
from megatron_optimizer import (BUFFERS, FLAT, GATHERED, adam_step, braid_state,  # noqa: E402
                                flat_bucket, flat_state, gathered_buckets, lr_schedule,
                                megatron_common, megatron_state, per_parameter_state, take_flat,
                                take_state, torch_dist_step, unchained)
from megatron_mapping import (EMBED, braid_config_from_args,  # noqa: E402
                              braid_to_megatron, extra_state_keys, megatron_args_from_braid,
                              megatron_names_of, megatron_to_braid, plain_args)
from megatron_torch_dist import (FormatError, is_torch_dist,  # noqa: E402
                                 load_object, read_common, read_torch_dist, require_torch,
                                 tensor_chunks, to_tensor, torch, write_torch_dist)
from safetensors_numpy import SafetensorsError  # noqa: E402

FLOAT_DTYPES = {"F32": "f32", "BF16": "bf16", "F16": "f16"}
# What a Megatron-LM save holds besides the model (key prefixes): not carried (docs).
NOT_CARRIED = ("optimizer", "rng_state", "rerun_state_machine")
EXTRA_STATE = "._extra_state/shard_"


# ---- finding the iteration's folder ----------------------------------------------------------

def megatron_iteration_dir(megatron_dir, step=None):
    """The iteration's folder of a Megatron-LM checkpoint directory: the tracker file's (or
    `step`'s) iter_NNNNNNN or release folder, or `megatron_dir` itself where it is an iteration's
    folder. Refuses folders in other formats, saying what they are."""
    check(os.path.isdir(megatron_dir), f"{megatron_dir}: no such directory")
    if step is None and (is_torch_dist(megatron_dir) or is_legacy(megatron_dir)):
        return megatron_dir
    if step is None:
        tracker = os.path.join(megatron_dir, TRACKER)
        check(os.path.isfile(tracker), f"{megatron_dir}: no {TRACKER} (not a Megatron-LM "
              "checkpoint directory; give the directory Megatron-LM's --save wrote, or pass "
              "--ckpt-step)")
        with open(tracker) as f:
            text = f.read().strip()
        check(text.isdigit() or text == "release", f"{tracker} should hold an iteration number "
              f"or 'release', holds {text!r}")
        step = 0 if text == "release" else int(text)
        folder = os.path.join(megatron_dir, "release" if text == "release" else f"iter_{step:07d}")
    else:
        folder = os.path.join(megatron_dir, f"iter_{step:07d}")
    check(os.path.isdir(folder), f"{folder} does not exist")
    check_format(folder)
    return folder


def check_format(folder):
    names = os.listdir(folder)
    if is_torch_dist(folder) or is_legacy(folder):
        return
    meta = os.path.join(folder, "metadata.json")
    if os.path.isfile(meta):
        with open(meta) as f:
            text = f.read()
        check('"braid-checkpoint"' not in text, f"{folder}: a braid checkpoint; convert it with "
              "export")
        try:
            backend = json.loads(text).get("sharded_backend")
        except (ValueError, AttributeError) as e:
            raise ConvertError(f"{meta}: not megatron-core's metadata.json ({e})") from None
        raise ConvertError(f"{folder}/metadata.json: sharded_backend is {backend!r}, not "
                           "'torch_dist' (zarr and the others are not read)")
    if ".metadata" in names:
        raise ConvertError(f"{folder}: a PyTorch distributed checkpoint without megatron-core's "
                           "metadata.json (Megatron-LM's torch_dcp or fsdp_dtensor format?); "
                           "this tool reads the torch_dist format")
    raise ConvertError(f"{folder}: no metadata.json and no mp_rank_* folders (neither a "
                       "torch_dist nor a legacy torch checkpoint)")


# ---- import ----------------------------------------------------------------------------------

def model_tensor(key):
    return not unchained(key).startswith(NOT_CARRIED)


def check_extra_states(objects, drop_fp8_state, where):
    """Every object of the model is a Transformer Engine _extra_state, empty unless the run
    used FP8 (its scaling factors and amax histories, which braid has no use for); the others
    (optimizer, RNG, rerun state) are not carried."""
    for key in sorted(objects):
        if unchained(key).startswith(NOT_CARRIED):
            continue
        check(EXTRA_STATE in key, f"{where}: unexpected object {key} (not a model tensor, an "
              "_extra_state or optimizer, RNG or rerun state)")
        if drop_fp8_state:
            continue
        try:
            value = load_object(objects[key], f"{where}: {key}")
        except FormatError:
            raise ConvertError(f"{where}: {key} holds an object torch.load(weights_only=True) "
                               "does not read (Transformer Engine 1.x's FP8 state?); pass "
                               "--drop-fp8-state to import the weights without it")
        empty = value is None or (hasattr(value, "numel") and value.numel() == 0)
        check(empty, f"{where}: {key} holds Transformer Engine state (FP8 scaling factors and "
              "amax histories: the run used FP8); braid has no FP8. Pass --drop-fp8-state to "
              "import the weights without it")


def check_common(common, where):
    """common.pt holds no model tensor outside the sharded ones."""
    def leaves(x, path):
        if isinstance(x, dict):
            for k, v in x.items():
                yield from leaves(v, f"{path}.{k}")
        elif x is not None:
            yield path, x
    for key in [k for k in common if str(k).startswith("model")]:
        for path, value in leaves(common[key], key):
            raise ConvertError(f"{where}/common.pt: {path} is a {type(value).__name__} outside the "
                               "sharded tensors; this tool carries sharded model tensors only")


def weights_dtype(tensors, where):
    # the experts' biases are f32 in bf16 models too (megatron-core's and braid's)
    dtypes = {t.dtype for n, t in tensors.items() if not n.endswith(BUFFERS)}
    for d in dtypes:
        check(d in FLOAT_DTYPES, f"{where}: weights of dtype {d}")
    return FLOAT_DTYPES[dtypes.pop()] if len(dtypes) == 1 else "f32"


def read_megatron(folder, drop_fp8_state):
    """(what a torch_dist save keeps in common.pt: args, iteration, opt_param_scheduler, ...; the
    model's global tensors under torch_dist's names, with the per-parameter optimizer state; the
    names of the tensors not carried) of an iteration's folder in either format."""
    if is_legacy(folder):
        return (*read_legacy(folder, drop_fp8_state), {})
    require_torch()
    common = read_common(folder)
    check(common.get("args") is not None, f"{folder}/common.pt: no args (Megatron-LM's "
          "save_checkpoint stores them; this tool takes the model's shape from them)")
    check_common(common, folder)
    tensors, objects, left_out = read_torch_dist(
        folder, lambda key: model_tensor(key) or per_parameter_state(key) or flat_bucket(key))
    check_extra_states(objects, drop_fp8_state, folder)
    return common, tensors, left_out, objects


def import_megatron(megatron_dir, save, step=None, drop_fp8_state=False):
    """Returns (the braid iteration directory, the config, the Adam steps of the optimizer state
    carried or None, a note on the optimizer state not carried or None)."""
    folder = megatron_iteration_dir(megatron_dir, step)
    common, tensors, left_out, objects = read_megatron(folder, drop_fp8_state)
    # Adam's (megatron_optimizer): per parameter, or the distributed optimizer's flat buffers
    problem = common.pop("optimizer_problem", None)  # the legacy format's state unread
    state, buckets = take_state(tensors), take_flat(tensors)
    args = common["args"]
    where = f"{folder}/common.pt" if not is_legacy(folder) else folder
    check(EMBED in tensors, f"{folder}: no {EMBED} (not a GPT model's checkpoint?)")
    config = braid_config_from_args(args, tensors[EMBED].shape[0],
                                    weights_dtype(tensors, folder), where)
    left = dict(tensors)  # megatron_to_braid takes what it maps
    braid_tensors = megatron_to_braid(left, config)
    if "lm_head.weight" in braid_tensors and config["tie_embeddings"]:
        check((braid_tensors["lm_head.weight"].array ==
               braid_tensors["model.embed_tokens.weight"].array).all(),
              f"{folder}: args say tied embeddings, but output_layer.weight differs from {EMBED}")
        del braid_tensors["lm_head.weight"]
    if left:
        more = "" if len(left) == 1 else f", and {len(left) - 1} more"
        raise ConvertError(f"{folder}: unexpected tensor {sorted(left)[0]} (not part of a GPT "
                           f"model with these args){more}")
    specs = checkpoint_specs(config)
    for name, shape, _ in specs:
        check(name in braid_tensors, f"{folder}: no {megatron_names_of(name, config)}")
        got = braid_tensors[name].shape
        check(got == shape, f"{folder}: {megatron_names_of(name, config)} holds {got}, the args "
              f"make {shape}")
    iteration = common.get("iteration", 0)
    check(isinstance(iteration, int) and iteration >= 0, f"{where}: iteration {iteration!r}")
    consumed = int(getattr(args, "consumed_train_samples", 0) or 0)
    scheduler = common.get("opt_param_scheduler")
    meta = checkpoint_metadata(config, specs, None)
    del meta["hf_config"]
    meta.update(iteration=iteration, consumed_samples=consumed, megatron_args=plain_args(args))
    # where the LR schedule stands: the samples of Megatron's successful updates
    update_samples = scheduler.get("num_steps") if isinstance(scheduler, dict) else None
    meta["trainer"].update(iteration=iteration, update_samples=int(update_samples or consumed))
    if isinstance(getattr(args, "global_batch_size", None), int):
        meta["trainer"]["global_batch_size"] = args.global_batch_size
    adam, note = None, optimizer_note(left_out)
    gathered = [k for k in objects if unchained(k).startswith(FLAT) and GATHERED in k]
    if problem is not None:
        note = f"the optimizer state is not carried ({problem}): braid starts Adam afresh"
    elif state or buckets or gathered:
        try:  # the weights import whatever the optimizer state holds; the note says why not it
            buckets.update(gathered_buckets(
                {k: load_object(objects[k], f"{folder}: {k}") for k in gathered}, to_tensor,
                folder))
            if buckets:
                chunks = {k: c for k, c in tensor_chunks(folder).items()
                          if k in tensors and not k.endswith(BUFFERS)}
                state = flat_state(buckets, tensors, chunks, folder)
            params = braid_specs(config)
            optim = braid_state(state, tensors, config, [n for n, _, _ in params], folder)
            groups = [load_object(v, f"{folder}: {k}") for k, v in objects.items()
                      if unchained(k).startswith(FLAT) and ".optimizer/" in k]
            adam = (adam_step([common.get("optimizer")], where) if is_legacy(folder)
                    else torch_dist_step(folder, where, groups))
            schedule = lr_schedule(common, args, where)
        except (ConvertError, FormatError) as e:
            note = f"the optimizer state is not carried ({e}): braid starts Adam afresh"
        else:
            braid_tensors.update(optim)
            specs = [(n, shape, dim) for name, shape, dim in params for n in
                     (f"optimizer.{k}.{name}" for k in ("exp_avg", "exp_avg_sq", "master"))
                     if n in optim]
            meta["tensors"].update(checkpoint_metadata(config, specs, None)["tensors"])
            meta.update(optimizer=True, lr_schedule=schedule)
            meta["trainer"]["optimizer_steps"] = adam
    return write_checkpoint(save, braid_tensors, meta), config, adam, note


def optimizer_note(left_out):
    """What import says of the optimizer tensors it leaves out (None: none): the legacy
    format's."""
    if left_out:
        return (f"{len(left_out)} optimizer tensors not carried (e.g. {left_out[0]}): braid "
                "starts its optimizer afresh")
    return None


# ---- export ----------------------------------------------------------------------------------

def export_megatron(load, out, step=None, expert_parallel=False):
    """Returns (the torch_dist iteration folder written, the config, the Adam steps of the
    optimizer state carried or None, a note on the optimizer state not carried or None).
    `expert_parallel`: Adam's state for a Megatron-LM run with --expert-model-parallel-size > 1
    (megatron-core then chains the experts' optimizer after the others')."""
    require_torch()
    meta, tensors = read_checkpoint(load, step, optimizer=True)
    config = meta["config"]
    where = os.path.join(load, f"iter_{meta['iteration']:07d}")
    optim, stacked_optim, adam, note = {}, [], None, None
    if any(k.startswith("optimizer.") for k in tensors):
        try:  # the weights export whatever the optimizer state holds; the note says why not it
            optimizer, scheduler, adam, optim_args = megatron_common(meta, where,
                                                                     expert_parallel)
        except ConvertError as e:
            note = f"the optimizer state is not carried ({e}): resume with --no-load-optim"
        else:
            optim, stacked_optim = megatron_state(tensors, config)
    tensors = {k: t for k, t in tensors.items() if not k.startswith("optimizer.")}
    args = argparse.Namespace(**megatron_args_from_braid(
        config, meta.get("consumed_samples", 0), meta.get("megatron_args") or {}))
    args.params_dtype = getattr(torch, args.params_dtype)  # Megatron-LM's is a torch.dtype
    specs = checkpoint_specs(config)
    for name, shape, _ in specs:
        check(name in tensors, f"{load}: the checkpoint has no {name}")
        check(tensors[name].shape == shape, f"{load}: {name} is {tensors[name].shape}, the "
              f"config makes it {shape}")
    extra = set(tensors) - {s[0] for s in specs}
    check(not extra, f"{load}: unexpected tensor {sorted(extra)[0] if extra else ''} for this "
          "config")
    iteration = meta["iteration"]
    megatron, stacked = braid_to_megatron(tensors, config)
    objects = {key: None for key in extra_state_keys(config)}
    common = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
              "num_floating_point_operations_so_far": 0,
              # Megatron-LM's: how the model's sharded_state_dict is laid out (swiglu's fc1 one
              # tensor, gate rows then up rows)
              "content_metadata": {"singleton_local_shards": False,
                                   "chained_optim_avoid_prefix": True}}
    if optim:  # Adam's state per parameter, as the distributed optimizer saves it fully reshardable
        megatron.update(optim)
        stacked += stacked_optim
        common.update(optimizer=optimizer, opt_param_scheduler=scheduler)
        common["content_metadata"]["distrib_optim_sharding_type"] = "fully_reshardable"
        vars(args).update(optim_args)
    check(not os.path.exists(os.path.join(out, TRACKER)), f"{out} already holds a checkpoint; "
          "export into a new directory")
    folder = os.path.join(out, f"iter_{iteration:07d}")
    check(not os.path.exists(folder), f"{folder} exists; export into a new directory")
    os.makedirs(out, exist_ok=True)
    write_torch_dist(folder, megatron, objects, common, stacked)
    with open(os.path.join(out, TRACKER), "w") as f:
        f.write(f"{iteration}")  # Megatron-LM writes the number alone
    return folder, config, adam, note


# ---- command line ----------------------------------------------------------------------------

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="See docs/convert_megatron.md.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("import", help="Megatron-LM checkpoint (torch_dist or the legacy torch "
                       "format) -> braid checkpoint")
    p.add_argument("--megatron-dir", required=True,
                   help="Megatron-LM's --save directory (or one iteration's folder in it)")
    p.add_argument("--save", required=True, help="braid checkpoint directory to create")
    p.add_argument("--ckpt-step", type=int, default=None,
                   help="iteration to import (default: the tracker file's)")
    p.add_argument("--drop-fp8-state", action="store_true",
                   help="import the weights of a run that used FP8, leaving out Transformer "
                   "Engine's FP8 scaling state")
    p = sub.add_parser("export", help="braid checkpoint -> Megatron-LM torch_dist checkpoint")
    p.add_argument("--load", required=True, help="braid checkpoint directory (any layout)")
    p.add_argument("--megatron-dir", required=True, help="directory to create")
    p.add_argument("--ckpt-step", type=int, default=None,
                   help="iteration to export (default: the tracker file's)")
    p.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="the expert parallelism of the Megatron-LM run that loads Adam's state "
                   "(above 1 megatron-core keeps the experts' optimizer apart; default 1)")
    args = parser.parse_args(argv)
    try:
        if args.command == "import":
            where, c, adam, note = import_megatron(
                args.megatron_dir, args.save, args.ckpt_step, args.drop_fp8_state)
            if note:
                print(f"convert_megatron.py import: note: {note}", file=sys.stderr)
            if adam is not None:
                print(f"convert_megatron.py import: Adam's state carried (step {adam}, "
                      "Megatron's learning-rate schedule): resume without --no-load-optim")
            print(f"imported a {c['num_layers']}-layer model (hidden {c['hidden_size']}, "
                  f"{c['params_dtype']}) into {where}")
        else:
            check(args.expert_model_parallel_size >= 1, "--expert-model-parallel-size "
                  f"{args.expert_model_parallel_size}: at least 1")
            where, c, adam, note = export_megatron(args.load, args.megatron_dir,
                                                   args.ckpt_step,
                                                   args.expert_model_parallel_size > 1)
            if note:
                print(f"convert_megatron.py export: note: {note}", file=sys.stderr)
            if adam is not None:
                print(f"convert_megatron.py export: Adam's state carried (step {adam}, the "
                      "learning-rate schedule): Megatron-LM resumes it without --no-load-optim")
            print(f"exported a {c['num_layers']}-layer model (hidden {c['hidden_size']}) to "
                  f"{where}")
    except (ConvertError, FormatError, SafetensorsError) as e:
        print(f"convert_megatron.py {args.command}: error: {e}", file=sys.stderr)
        return 1
    except (KeyError, TypeError) as e:
        print(f"convert_megatron.py {args.command}: error: the checkpoint lacks or mistypes a "
              f"field: {e!r}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
