"""Megatron-LM's Adam state on import (convert_megatron.py import; docs/convert_megatron.md,
"What is carried"), so that braid continues a Megatron-LM run where its Adam stands.

megatron-core saves it per parameter, in the model's own names and layout, when the optimizer is
not distributed (`optimizer.state.exp_avg.<tensor>`, `optimizer.state.exp_avg_sq.<tensor>`, the
step in common.pt's `optimizer.state.common_step`) or distributed and saved fully reshardable
(Megatron-LM's --dist-ckpt-optim-fully-reshardable: the same names, the f32 main parameters as
`optimizer.state.param.<tensor>`, the step in its param groups). Those map to braid's names as
the weights do, moment by moment; braid's checkpoint then holds `optimizer.exp_avg.<name>`,
`optimizer.exp_avg_sq.<name>` (and `optimizer.master.<name>` for 16-bit parameters), its
optimizer steps and Megatron's learning-rate schedule. The distributed optimizer's default save
(dp_reshardable, and the older dp_zero_gather_scatter) keeps flat buffers per data-parallel rank
in the order of its gradient buckets; that is not read: the weights import without the state.
"""

import os

from hf_configs import ConvertError, check
from megatron_legacy import LazyTensor, RankFile
from megatron_mapping import megatron_to_braid

STATE = "optimizer.state."
MOMENTS = ("exp_avg", "exp_avg_sq")
MAIN_PARAMS = ("param", "fp32_param")  # the distributed optimizer's f32 main parameters
FLAT = "optimizer.distributed."         # dp_reshardable / dp_zero_gather_scatter


def per_parameter_state(key):
    """A tensor of the per-parameter (model-space) optimizer state, which import reads."""
    return key.startswith(STATE)


def take_state(tensors):
    """Moves the optimizer.state.* tensors out of `tensors`: {kind: {model tensor name: Tensor}}."""
    state = {}
    for key in [k for k in tensors if per_parameter_state(k)]:
        kind, name = key[len(STATE):].split(".", 1)
        state.setdefault(kind, {})[name] = tensors.pop(key)
    return state


def adam_step(folder, where):
    """The Adam steps taken: common.pt's optimizer.state.common_step (megatron-core's optimizer
    when not distributed; a tensor) or its param groups' step (the distributed one's), one for
    all."""
    common = RankFile(os.path.join(folder, "common.pt"))  # its tensors read too
    try:
        saved = common.state.get("optimizer")
        check(isinstance(saved, dict), f"{where}: the optimizer's tensors are saved but common.pt "
              "has no optimizer entry (its steps)")
        steps = set()

        def value(x, what):
            return float(common.tensor(x, what).array) if isinstance(x, LazyTensor) else float(x)

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
    finally:
        common.close()
    check(len(steps) == 1, f"{where}: the optimizer's step is "
          f"{'missing' if not steps else 'not one: ' + str(sorted(steps))} (megatron-core keeps "
          "it as optimizer.state.common_step or in its param groups)")
    step = steps.pop()
    check(step == int(step) and step >= 0, f"{where}: optimizer step {step}")
    return int(step)


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
