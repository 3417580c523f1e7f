"""Megatron-LM's Adam state on import and export (convert_megatron.py; docs/convert_megatron.md,
"What is carried"), so that braid continues a Megatron-LM run where its Adam stands, and
Megatron-LM a braid run.

megatron-core saves it per parameter, in the model's own names and layout, when the optimizer is
not distributed (`optimizer.state.exp_avg.<tensor>`, `optimizer.state.exp_avg_sq.<tensor>`, the
step in common.pt's `optimizer.state.common_step`) or distributed and saved fully reshardable
(Megatron-LM's --dist-ckpt-optim-fully-reshardable: the same names, the f32 main parameters as
`optimizer.state.param.<tensor>`, the step in its param groups). Those map to braid's names as
the weights do, moment by moment; braid's checkpoint then holds `optimizer.exp_avg.<name>`,
`optimizer.exp_avg_sq.<name>` (and `optimizer.master.<name>` for 16-bit parameters), its
optimizer steps and Megatron's learning-rate schedule. megatron-core before 0.14 saved that
per-parameter state in flattened pieces (fully_sharded_model_space, which
megatron_torch_dist reads back into each tensor's shape). The distributed optimizer's default save
(dp_reshardable) keeps flat buffers per gradient bucket instead, whose parameters flat_state
places by value; so do its older gathered save (dp_zero_gather_scatter: gathered_buckets) and the
legacy format's distrib_optim.pt (megatron_legacy.distrib_optim_state).

Export writes braid's state per parameter as the distributed optimizer saves it fully
reshardable, with common.pt entries that megatron-core's distributed optimizer and (for f32
weights) its optimizer not distributed both load.
"""

import os
import re

import numpy as np

from hf_configs import ConvertError, check, f32_value
from megatron_legacy import LazyTensor, RankFile
from megatron_mapping import braid_to_megatron, megatron_to_braid
from megatron_torch_dist import torch
from safetensors_numpy import Tensor, bf16_bits

STATE = "optimizer.state."
CHAINED = re.compile(r"^chained_\d+\.")
MOMENTS = ("exp_avg", "exp_avg_sq")
MAIN_PARAMS = ("param", "fp32_param")  # the distributed optimizer's f32 main parameters
FLAT = "optimizer.distributed."         # dp_reshardable / dp_zero_gather_scatter
BUCKET = ".bucket_idx_"                 # dp_reshardable's flat buffers: a key per bucket
GATHERED = ".param_state"               # dp_zero_gather_scatter's: an object per DP group
FLAT_KINDS = ("param", "exp_avg", "exp_avg_sq")
ALIGN, PREFIX = 64, 4  # where a bucket's parameters may start; the values a chunk is looked up by
BUFFERS = ("router.expert_bias",)  # model tensors that are no parameters: no optimizer state


# the weights' dtype -> (the main parameters in the weights' dtype, as bits; the bits' dtype)
COMPARED = {"F32": (lambda main: main.view(np.uint32), np.uint32), "BF16": (bf16_bits, np.uint16),
            "F16": (lambda main: main.astype(np.float16).view(np.uint16), np.uint16)}


def unchained(key):
    """A checkpoint key without the chained_<i>. that megatron-core puts before each optimizer's
    keys when a model has two (the experts' under expert parallelism; the distributed optimizer's
    flat buffers, or any under chained_optim_avoid_prefix false)."""
    return CHAINED.sub("", key)


def per_parameter_state(key):
    """A tensor of the per-parameter (model-space) optimizer state, which import reads."""
    return unchained(key).startswith(STATE)


def take_state(tensors):
    """Moves the optimizer.state.* tensors out of `tensors`: {kind: {model tensor name: Tensor}}."""
    state = {}
    for key in [k for k in tensors if per_parameter_state(k)]:
        kind, name = unchained(key)[len(STATE):].split(".", 1)
        check(name not in state.get(kind, {}), f"{key}: a second {STATE}{kind}.{name}")
        state.setdefault(kind, {})[name] = tensors.pop(key)
    return state


def torch_dist_step(folder, where, saved_groups=()):
    """adam_step of a torch_dist save: in common.pt's optimizer entry and `saved_groups` (the
    objects the distributed optimizer's default save keeps its param groups in)."""
    common = RankFile(os.path.join(folder, "common.pt"))  # its tensors read too
    try:
        check(isinstance(common.state.get("optimizer"), dict), f"{where}: the optimizer's "
              "tensors are saved but common.pt has no optimizer entry (its steps)")
        return adam_step([common.state["optimizer"], *saved_groups], where, common.tensor)
    finally:
        common.close()


def adam_step(saved, where, tensor=None):
    """The Adam steps taken, one for all, in the objects `saved`: optimizer.state.common_step
    (megatron-core's optimizer when not distributed; a tensor, which `tensor` reads) or the
    param groups' step (the distributed one's)."""
    steps = set()

    def value(x, what):
        if isinstance(x, LazyTensor):
            check(tensor is not None, f"{where}: {what} is a tensor this tool does not read")
            return float(tensor(x, what).array)
        return float(x)

    def walk(x):
        if isinstance(x, dict):
            if "common_step" in x:
                steps.add(value(x["common_step"], "optimizer common_step"))
            groups = x.get("param_groups")
            for group in groups if isinstance(groups, list) else []:
                if isinstance(group, dict) and "step" in group:
                    steps.add(value(group["step"], "a param group's step"))
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
    walk(saved)
    check(len(steps) == 1, f"{where}: the optimizer's step is "
          f"{'missing' if not steps else 'not one: ' + str(sorted(steps))} (megatron-core keeps "
          "it as optimizer.state.common_step or in its param groups)")
    step = steps.pop()
    check(step == int(step) and step >= 0, f"{where}: optimizer step {step}")
    return int(step)


def flat_bucket(key):
    """A flat buffer of the distributed optimizer's default save (one bucket's main parameters or
    moments), which import reads to place each parameter's state (flat_state)."""
    return unchained(key).startswith(FLAT) and BUCKET in key


def take_flat(tensors):
    """Moves the flat buffers out of `tensors`: {bucket key: {kind: Tensor}}."""
    buckets = {}
    for key in [k for k in tensors if flat_bucket(k)]:
        bucket, kind = key.rsplit(".", 1)
        buckets.setdefault(bucket, {})[kind] = tensors.pop(key)
    return buckets


def indexed_state(saved, local, tensor, where):
    """Adam's state of megatron-core's optimizer not distributed as the legacy format keeps it in
    a rank file (`saved`, its optimizer entry: torch's state_dict, the state numbered by position
    in its param groups; for 16-bit weights inside {"optimizer", "fp32_from_fp16_params": the
    main parameters per group}; a list of them for chained optimizers), placed on the rank's
    parameters (`local`: name -> Tensor, in the model's order) as megatron-core's default param
    groups take them: in the model's order, each group the parameters of its kind (weight-decay
    multiplier 0: biases and 1-D tensors; is_expert_parallel: the experts'). Every moment's shape
    is checked against its parameter, and for 16-bit weights the main parameters' values.
    Returns ({kind: {name: Tensor}}, the steps found). `tensor(lazy, what)` reads a tensor."""
    order = [n for n in local if not n.endswith(BUFFERS)]
    state, steps, taken = {"exp_avg": {}, "exp_avg_sq": {}, "param": {}}, set(), set()

    def kind(name):
        return name.endswith(".bias") or len(local[name].shape) == 1, ".experts." in name
    for i, entry in enumerate(saved if isinstance(saved, list) else [saved]):
        what = f"{where}: optimizer" + (f"[{i}]" if isinstance(saved, list) else "")
        mains = entry.get("fp32_from_fp16_params") if isinstance(entry, dict) else None
        inner = entry.get("optimizer") if mains is not None else entry
        check(isinstance(inner, dict) and isinstance(inner.get("state"), dict) and
              isinstance(inner.get("param_groups"), list), f"{what} is not torch's optimizer "
              "state_dict (state, param_groups)")
        for g, group in enumerate(inner["param_groups"]):
            check(isinstance(group, dict) and not group.get("is_decoupled_lr") and
                  group.get("lr_mult", 1.0) == 1.0, f"{what}: param group {g} is not one of "
                  "megatron-core's default groups (a learning rate of its own), by which this "
                  "tool places the state")
            ids = group.get("params")
            want = (group.get("wd_mult", 1.0) == 0.0, bool(group.get("is_expert_parallel")))
            members = [n for n in order if n not in taken and kind(n) == want]
            check(isinstance(ids, list) and len(ids) == len(members), f"{what}: param group {g} "
                  f"(weight-decay multiplier {group.get('wd_mult')}, experts {want[1]}) holds "
                  f"{len(ids or [])} parameters, the rank file {len(members)} of that kind")
            for j, (index, name) in enumerate(zip(ids, members)):
                entry_state = inner["state"].get(index)
                check(isinstance(entry_state, dict) and all(
                    isinstance(entry_state.get(k), LazyTensor) for k in MOMENTS),
                    f"{what}: no Adam moments for parameter {index} ({name})")
                for k in MOMENTS:
                    moment = tensor(entry_state[k], f"optimizer state {index} {k}")
                    check(moment.shape == local[name].shape, f"{what}: parameter {index}'s {k} "
                          f"is {moment.shape}, but {name}, its place in megatron-core's param "
                          f"groups, is {local[name].shape}")
                    state[k][name] = moment
                if "step" in entry_state:
                    step = entry_state["step"]
                    steps.add(float(tensor(step, "a step").array) if isinstance(step, LazyTensor)
                              else float(step))
                if mains is not None:
                    check(isinstance(mains, list) and g < len(mains) and isinstance(
                        mains[g], list) and len(mains[g]) == len(ids) and isinstance(
                        mains[g][j], LazyTensor), f"{what}: fp32_from_fp16_params does not hold "
                        f"group {g}'s {len(ids)} main parameters")
                    main = tensor(mains[g][j], f"fp32_from_fp16_params {g}.{j}")
                    rounded, bits = COMPARED[local[name].dtype]
                    check(main.dtype == "F32" and main.shape == local[name].shape and
                          np.array_equal(rounded(main.array), local[name].array.view(bits)),
                          f"{what}: the main parameters of group {g}, {j} are not {name}'s "
                          "weights: the groups hold the parameters in another order")
                    state["param"][name] = main
                taken.add(name)
    return state, steps


def gathered_buckets(objects, tensor, where):
    """The distributed optimizer's state gathered on each data-parallel group's first rank
    (megatron-core's get_parameter_state_dp_zero: the torch_dist object of its
    dp_zero_gather_scatter save, the legacy format's distrib_optim.pt; `objects`: {name: its
    value}) as take_flat's buffers: per gradient buffer its buckets' main parameters and moments
    one after another. `tensor(value, what)`: a saved tensor as a Tensor."""
    buckets = {}
    for name, state in objects.items():
        check(isinstance(state, dict) and state.get("buckets_coalesced") is True,
              f"{where}: {name} is not megatron-core's gathered optimizer state (a dict with "
              "buckets_coalesced; Megatron-LM before February 2024 wrote another layout, which "
              "its --ckpt-convert-update-legacy-dist-opt-format rewrites)")
        for buffer, dtypes in state.items():
            if buffer == "buckets_coalesced":
                continue
            check(isinstance(dtypes, dict) and len(dtypes) == 1, f"{where}: {name}[{buffer!r}] "
                  "is not one dtype's state")
            (flat,) = dtypes.values()
            check(isinstance(flat, dict) and set(FLAT_KINDS) <= set(flat), f"{where}: "
                  f"{name}[{buffer!r}] holds " + (str(sorted(map(str, flat))) if isinstance(
                      flat, dict) else f"a {type(flat).__name__}") + f", not {list(FLAT_KINDS)}")
            buckets[f"{name}.buffer_{buffer}"] = {
                kind: tensor(flat[kind], f"{name}[{buffer!r}] {kind}") for kind in FLAT_KINDS}
    return buckets


def flat_state(buckets, weights, chunks, where):
    """Adam's state per parameter ({kind: {model key: Tensor}}, take_state's form) of the
    distributed optimizer's default save (dp_reshardable, flat_bucket's buffers).

    A bucket holds its parameters one after another, each starting where the last ended or at
    the next multiple of 64 elements, in an order the checkpoint does not record. Which parameter
    lies where is found by value: the main parameters there equal, bit for bit (rounded to the
    weights' dtype), a chunk of a model tensor (`chunks`: how torch_dist saved each, a chunk per
    rank's parameter: a layer's, an expert's, a TP shard; SwiGLU's fc1 two). Refuses a piece that
    matches none, or two chunks of equal values (their states would be told apart by guessing)."""
    for key in chunks:
        check(weights[key].dtype in COMPARED, f"{where}: {key} is {weights[key].dtype}; the "
              f"distributed optimizer's flat state is read for {sorted(COMPARED)} weights")
    index = {}  # the weights' dtype -> the chunks by their first values; those shorter than that
    for key, boxes in chunks.items():
        dtype = weights[key].dtype
        by_head, small = index.setdefault(dtype, ({}, []))
        for offsets, sizes in boxes:
            box = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
            values = np.ascontiguousarray(weights[key].array[box]).reshape(-1)
            values = values.view(COMPARED[dtype][1])
            chunk = (key, offsets, box, values)
            if values.size >= PREFIX:
                by_head.setdefault(values[:PREFIX].tobytes(), []).append(chunk)
            else:
                small.append(chunk)
    state, placed = {kind: {} for kind in FLAT_KINDS}, {}
    for name in sorted(buckets):
        bucket = buckets[name]
        check(set(bucket) == set(FLAT_KINDS), f"{where}: {name} holds {sorted(bucket)}, not "
              f"{list(FLAT_KINDS)} (not Adam's state?)")
        sizes = {kind: (t.dtype, tuple(t.shape)) for kind, t in bucket.items()}
        check(len(set(sizes.values())) == 1 and sizes["param"] == ("F32", sizes["param"][1][:1]),
              f"{where}: {name}'s buffers are {sizes}; the distributed optimizer keeps three f32 "
              "buffers of one length")
        # the main parameters as each dtype's weights hold them
        probes = {dtype: COMPARED[dtype][0](bucket["param"].array) for dtype in index}
        pos, size, frame = 0, bucket["param"].array.size, 0
        while pos < size:
            found = []
            # Where the last parameter ended, or the next start of its bucket: a multiple of 64
            # elements from the bucket's start, which the last parameter placed shows (the
            # gathered state joins buckets unaligned); failing those, any start before the next
            # 64, nearest first.
            aligned = pos + (frame - pos) % ALIGN
            for start in dict.fromkeys((pos, aligned, *range(pos + 1, pos + ALIGN))):
                for dtype, (by_head, small) in index.items():
                    probe = probes[dtype]
                    head = probe[start:start + PREFIX].tobytes()
                    found += [c for c in by_head.get(head, []) + small if start < size and
                              np.array_equal(probe[start:start + c[3].size], c[3])]
                if found:
                    break
            if not found and not bucket["param"].array[pos:].any():
                break  # the padding after the last parameter
            check(found, f"{where}: {name}: elements {pos}.. match no parameter of the model "
                  "(a layout this tool does not read)")
            if len(found) > 1:
                raise ConvertError(f"{where}: {found[0][0]} at {list(found[0][1])} and "
                                   f"{found[1][0]} at {list(found[1][1])} hold the same values, "
                                   "so the flat state cannot tell their moments apart")
            key, offsets, box, values = found[0]
            if offsets not in placed.setdefault(key, set()):  # a replica's: the first one's
                placed[key].add(offsets)
                for kind in FLAT_KINDS:
                    whole = state[kind].setdefault(key, Tensor("F32", np.zeros(
                        weights[key].shape, dtype=np.float32)))
                    part = bucket[kind].array[start:start + values.size]
                    whole.array[box] = part.reshape(whole.array[box].shape)
            pos, frame = start + values.size, start % ALIGN
    for key, offsets in placed.items():
        check(len(offsets) == len(chunks[key]), f"{where}: the flat state holds "
              f"{len(offsets)} of {key}'s {len(chunks[key])} chunks")
    return state


def braid_state(state, weights, config, params, where):
    """braid's optimizer tensors (name -> Tensor) of `state` (take_state's): each moment of every
    parameter `params` names, mapped as its weight is; for 16-bit weights the f32 main
    parameters too. `weights`: the model's tensors under Megatron's names (what a moment is
    missing for is taken from them, then refused)."""
    for kind in state:
        check(kind in MOMENTS + MAIN_PARAMS, f"{where}: optimizer state {STATE}{kind}.* is not "
              "Adam's (exp_avg, exp_avg_sq, and the main parameters)")
    for kind in MOMENTS:
        check(kind in state, f"{where}: the optimizer state has no {STATE}{kind}.* (not Adam?)")
    kinds = {"exp_avg": "optimizer.exp_avg.", "exp_avg_sq": "optimizer.exp_avg_sq."}
    main = [k for k in MAIN_PARAMS if k in state]
    if config["params_dtype"] != "f32":
        check(main, f"{where}: {config['params_dtype']} weights without their f32 main "
              f"parameters ({STATE}param.*): save with the distributed optimizer, fully "
              "reshardable")
        kinds[main[0]] = "optimizer.master."
    out = {}
    for kind, prefix in kinds.items():
        tensors = state[kind]
        for name, t in tensors.items():
            check(name in weights, f"{where}: {STATE}{kind}.{name} is the state of no weight")
            check(t.shape == weights[name].shape, f"{where}: {STATE}{kind}.{name} is "
                  f"{t.shape}, its weight {weights[name].shape}")
            check(t.dtype == "F32", f"{where}: {STATE}{kind}.{name} is {t.dtype}; braid keeps "
                  "Adam's state in f32")
        mapped = megatron_to_braid(dict(tensors), config)
        for name in params:
            if name not in mapped:
                raise ConvertError(f"{where}: no {kind} for the parameter {name} (the optimizer "
                                   "state covers only part of the model)")
            out[prefix + name] = mapped[name]
    return out


def lr_schedule(common, args, where):
    """braid's lr_schedule (metadata.json) of Megatron's OptimizerParamScheduler state, whose
    steps count samples: iterations x the global batch."""
    s = common.get("opt_param_scheduler")
    check(isinstance(s, dict), f"{where}: no opt_param_scheduler (the learning-rate schedule)")
    batch = getattr(args, "global_batch_size", None)
    check(isinstance(batch, int) and batch > 0, f"{where}: args.global_batch_size {batch!r}")
    try:
        wd = {"start": float(s["start_wd"]), "end": float(s["end_wd"]),
              "style": s["wd_incr_style"]}
        if wd["style"] != "constant":
            wd["incr_iters"] = s["wd_incr_steps"] / batch
        return {"lr": float(s["max_lr"]), "min_lr": float(s["min_lr"]),
                "warmup_iters": s["lr_warmup_steps"] / batch,
                "decay_iters": s["lr_decay_steps"] / batch, "style": s["lr_decay_style"],
                "warmup_init": float(getattr(args, "lr_warmup_init", 0.0) or 0.0),
                "weight_decay": wd}
    except KeyError as e:
        raise ConvertError(f"{where}: opt_param_scheduler has no {e}")


# ---- export ----------------------------------------------------------------------------------

def megatron_state(tensors, config):
    """Adam's state of a braid checkpoint (read_checkpoint's optimizer.* tensors in `tensors`)
    under megatron-core's per-parameter keys, as its distributed optimizer saves it fully
    reshardable: ({key: Tensor}, the keys whose first axis is the layers). The main parameters
    (optimizer.state.param.*) are braid's f32 masters, or the f32 weights."""
    out, stacked = {}, []
    kinds = {"exp_avg": "optimizer.exp_avg.", "exp_avg_sq": "optimizer.exp_avg_sq.",
             "param": "optimizer.master." if config["params_dtype"] != "f32" else ""}
    names = [n for n in tensors if not n.startswith("optimizer.")]
    for kind, prefix in kinds.items():
        moments = {}
        for name in names:
            if prefix + name in tensors:
                moments[name] = tensors[prefix + name]
        mapped, layers = braid_to_megatron(moments, config)
        out.update({f"{STATE}{kind}.{k}": t for k, t in mapped.items()})
        stacked += [f"{STATE}{kind}.{k}" for k in layers]
    return out, stacked


def megatron_common(meta, where, expert_parallel=False):
    """(common.pt's optimizer entry, its opt_param_scheduler, Adam's step, the Megatron-LM args
    they imply) for a braid checkpoint's optimizer: what megatron-core's distributed optimizer
    saves fully reshardable (param groups with the step), and what its optimizer not
    distributed saves for f32 weights (torch's param groups and a step common to every
    parameter). `expert_parallel`: for a run with expert parallelism, where megatron-core chains
    the experts' optimizer after the others' (entries 0 and 1)."""
    trainer, schedule = meta["trainer"], meta["lr_schedule"]
    check(schedule.get("decoupled_lr") is None, f"{where}: a decoupled learning rate "
          "(--decoupled-lr) gives Megatron-LM other param groups")
    beta1, beta2, eps = adam_constants(meta, where)
    batch = global_batch(meta, where)
    step = int(trainer["optimizer_steps"])
    wd = schedule["weight_decay"]

    def samples(iterations):
        return int(round(iterations * batch))
    # float32 values as their shortest decimal, the command line's, which Megatron-LM's
    # scheduler asserts equal to its own
    scheduler = {"max_lr": f32_value(schedule["lr"]), "min_lr": f32_value(schedule["min_lr"]),
                 "lr_warmup_steps": samples(schedule["warmup_iters"]),
                 "lr_decay_steps": samples(schedule["decay_iters"]),
                 "lr_decay_style": schedule["style"], "num_steps": int(trainer["update_samples"]),
                 "start_wd": f32_value(wd["start"]), "end_wd": f32_value(wd["end"]),
                 "wd_incr_style": wd["style"],
                 # Megatron-LM's is --train-iters' samples; braid keeps it for an increasing
                 # decay only, else takes the decay's length (--lr-decay-iters' default)
                 "wd_incr_steps": samples(wd.get("incr_iters", schedule["decay_iters"]))}
    lr = f32_value(schedule.get("lr_now", schedule["lr"]))

    def optimizer(experts, mults):
        """One optimizer's entry: a param group per weight-decay multiplier (1: matrices; 0:
        biases and norms). The distributed optimizer keeps the step in its groups (as Transformer
        Engine's and Apex's FusedAdam do); torch's Adam in each parameter's state."""
        groups = [{"wd_mult": mult, "lr_mult": 1.0, "is_expert_parallel": experts,
                   "is_decoupled_lr": False, "default_config": True,
                   "max_lr": scheduler["max_lr"], "min_lr": scheduler["min_lr"], "lr": lr,
                   "weight_decay": scheduler["start_wd"] * mult, "betas": (beta1, beta2),
                   "eps": eps, "amsgrad": False, "maximize": False, "foreach": None,
                   "capturable": False, "differentiable": False, "fused": None,
                   "decoupled_weight_decay": True, "bias_correction": True} for mult in mults]
        return {"optimizer": {"param_groups": [dict(g, step=step) for g in groups]},
                "param_state_sharding_type": "fully_reshardable",
                "param_groups": groups, "state": {"common_step": torch.tensor(float(step))}}
    config = meta["config"]
    if expert_parallel and config.get("num_experts"):  # the experts' biases decay not either
        common = {0: optimizer(False, (1.0, 0.0)),
                  1: optimizer(True, (1.0, 0.0) if config["add_bias_linear"] else (1.0,))}
    else:
        common = optimizer(False, (1.0, 0.0))
    args = {"global_batch_size": batch, "adam_beta1": beta1, "adam_beta2": beta2,
            "adam_eps": eps, "lr": scheduler["max_lr"], "min_lr": scheduler["min_lr"],
            "weight_decay": scheduler["start_wd"], "lr_decay_style": scheduler["lr_decay_style"],
            "no_save_optim": False}
    return common, scheduler, step, args


def adam_constants(meta, where):
    """(beta1, beta2, eps) of the run that saved `meta`: braid's record, else an import's
    Megatron-LM args."""
    adam = meta.get("adam")
    if adam is None:
        args = meta.get("megatron_args") or {}
        adam = {k: args.get("adam_" + k) for k in ("beta1", "beta2", "eps")}
        check(None not in adam.values(), f"{where}: no record of Adam's betas and eps (saved "
              "by a braid before it recorded them)")
    return f32_value(adam["beta1"]), f32_value(adam["beta2"]), f32_value(adam["eps"])


def global_batch(meta, where):
    """The samples of a full update, in which Megatron's scheduler counts its steps."""
    trainer = meta["trainer"]
    batch = trainer.get("global_batch_size") or (meta.get("megatron_args") or {}).get(
        "global_batch_size")
    updates = trainer["iteration"] - trainer["skipped_iterations"]
    if not batch and updates > 0 and trainer["update_samples"] % updates == 0:
        batch = trainer["update_samples"] // updates  # iterations counted updates, all alike
    check(isinstance(batch, int) and batch > 0, f"{where}: no record of the global batch size, "
          "in which Megatron's learning-rate schedule counts")
    return batch
