"""pretrain_gpt.py's optimizer, learning-rate and weight-decay schedule arguments: Megatron's
iteration- or sample-based flags, checked against each other and turned into the iterations
engine::LRSchedule and the weight-decay schedule take; and what a checkpoint's saved schedule
does on --load (Megatron's --override-opt_param-scheduler and
--use-checkpoint-opt_param-scheduler)."""

from __future__ import annotations

import argparse
import math
from typing import Callable

import numpy as np


def add_arguments(p: argparse.ArgumentParser, pos_float, nonneg_float, pos_int, nonneg_int):
    g = p.add_argument_group("optimizer and learning rate (AdamW)")
    g.add_argument("--optimizer", default="adam", choices=["adam"],
                   help="AdamW with decoupled weight decay (Megatron's adam); no SGD")
    g.add_argument("--lr", type=pos_float, default=1e-3)
    g.add_argument("--min-lr", type=nonneg_float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    g.add_argument("--lr-wsd-decay-style", default="exponential",
                   choices=["exponential", "linear", "cosine", "minus_sqrt"],
                   help="WSD: the shape of the final annealing")
    g.add_argument("--lr-wsd-decay-iters", type=pos_int, default=None,
                   help="WSD: the annealing's length, the last iterations before the decay's end")
    g.add_argument("--lr-wsd-decay-samples", type=pos_int, default=None,
                   help="WSD with --train-samples: the annealing's length in samples")
    g.add_argument("--lr-warmup-init", type=nonneg_float, default=0.0,
                   help="the learning rate the warmup starts from")
    g.add_argument("--lr-decay-iters", type=pos_int, default=None, help="default --train-iters")
    g.add_argument("--lr-warmup-iters", type=nonneg_int, default=0)
    g.add_argument("--lr-warmup-fraction", type=nonneg_float, default=None)
    g.add_argument("--lr-decay-samples", type=pos_int, default=None,
                   help="with --train-samples: decay over this many samples (default "
                        "--train-samples)")
    g.add_argument("--lr-warmup-samples", type=nonneg_int, default=0,
                   help="with --train-samples: warm up over this many samples")
    g.add_argument("--weight-decay", type=nonneg_float, default=0.01)
    g.add_argument("--weight-decay-incr-style", default="constant",
                   choices=["constant", "linear", "cosine"],
                   help="linear / cosine: from --start-weight-decay to --end-weight-decay over "
                        "the training iterations (constant: --weight-decay)")
    g.add_argument("--start-weight-decay", type=nonneg_float, default=None)
    g.add_argument("--end-weight-decay", type=nonneg_float, default=None)
    g.add_argument("--adam-beta1", type=nonneg_float, default=0.9)
    g.add_argument("--adam-beta2", type=nonneg_float, default=0.999)
    g.add_argument("--adam-eps", type=pos_float, default=1e-8)
    g.add_argument("--clip-grad", type=nonneg_float, default=1.0, help="0: no clipping")
    g.add_argument("--decoupled-lr", type=nonneg_float, default=None,
                   help="the embedding's and output layer's peak learning rate, on the same "
                        "warmup and decay (Megatron's decoupled learning rate)")
    g.add_argument("--decoupled-min-lr", type=nonneg_float, default=None,
                   help="with --decoupled-lr: their floor (default --min-lr)")
    # Megatron's precision-aware optimizer dtypes: braid's are f32, which these may only confirm.
    for flag, dtypes in (("--main-grads-dtype", ["fp32", "bf16"]),
                         ("--main-params-dtype", ["fp32", "fp16"]),
                         ("--exp-avg-dtype", ["fp32", "fp16", "bf16", "fp8"]),
                         ("--exp-avg-sq-dtype", ["fp32", "fp16", "bf16", "fp8"])):
        g.add_argument(flag, default="fp32", choices=dtypes,
                       help="fp32 only: braid's optimizer keeps f32 gradients, master weights "
                            "and moments")
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                   dest="override_opt_param_scheduler", action="store_true",
                   help="on --load: the command line's learning-rate and weight-decay "
                        "schedules, whatever the checkpoint's were")
    g.add_argument("--use-checkpoint-opt_param-scheduler",
                   "--use-checkpoint-opt-param-scheduler",
                   dest="use_checkpoint_opt_param_scheduler", action="store_true",
                   help="on --load: the checkpoint's learning-rate and weight-decay schedules "
                        "(default: the command line's must equal them)")


def validate(a: argparse.Namespace, check: Callable[[bool, str], None]):
    """Fills a.lr_decay_iters, a.lr_warmup_iters, a.lr_wsd_decay_iters and
    a.weight_decay_incr_iters; check(ok, message) raises the argument error."""
    # The LR schedule in iterations; Megatron's sample-based one (--train-samples) is samples /
    # global batch, fractional where it does not divide (engine::LRSchedule takes that).
    if a.train_samples:
        for flag, value in (("--lr-decay-iters", a.lr_decay_iters),
                            ("--lr-warmup-iters", a.lr_warmup_iters),
                            ("--lr-wsd-decay-iters", a.lr_wsd_decay_iters)):
            check(not value, f"{flag} is for --train-iters; with --train-samples give "
                  f"{flag.replace('iters', 'samples')}")
        a.lr_decay_iters = (a.lr_decay_samples or a.train_samples) / a.global_batch_size
        a.lr_warmup_iters = a.lr_warmup_samples / a.global_batch_size
        if a.lr_wsd_decay_samples:
            a.lr_wsd_decay_iters = a.lr_wsd_decay_samples / a.global_batch_size
        warmup_flag, wsd_flag = "--lr-warmup-samples", "--lr-wsd-decay-samples"
    else:
        for flag, value in (("--lr-decay-samples", a.lr_decay_samples),
                            ("--lr-warmup-samples", a.lr_warmup_samples),
                            ("--lr-wsd-decay-samples", a.lr_wsd_decay_samples)):
            check(not value, f"{flag} is for --train-samples; with --train-iters give "
                  f"{flag.replace('samples', 'iters')}")
        if a.lr_decay_iters is None:
            a.lr_decay_iters = a.train_iters
        warmup_flag, wsd_flag = "--lr-warmup-iters", "--lr-wsd-decay-iters"
    if a.lr_warmup_fraction is not None:
        check(a.lr_warmup_iters == 0, f"give {warmup_flag} or --lr-warmup-fraction, not both")
        check(a.lr_warmup_fraction <= 1, f"--lr-warmup-fraction must be <= 1, got "
              f"{a.lr_warmup_fraction}")
        a.lr_warmup_iters = a.lr_warmup_fraction * a.lr_decay_iters  # Megatron's, unrounded
    check(a.min_lr <= a.lr, f"--min-lr {a.min_lr} exceeds --lr {a.lr}")
    given = [f for f, v in (("--start-weight-decay", a.start_weight_decay),
                            ("--end-weight-decay", a.end_weight_decay)) if v is not None]
    if a.weight_decay_incr_style == "constant":
        check(not given, f"{' and '.join(given)}: give --weight-decay-incr-style linear or "
              "cosine (constant uses --weight-decay)")
    else:
        check(len(given) == 2, f"--weight-decay-incr-style {a.weight_decay_incr_style} needs "
              "--start-weight-decay and --end-weight-decay")
    # Megatron's: the decay's schedule runs over the whole training, in the LR's units.
    a.weight_decay_incr_iters = (a.train_samples / a.global_batch_size if a.train_samples
                                 else a.train_iters)
    check(a.lr_warmup_init <= a.lr, f"--lr-warmup-init {a.lr_warmup_init} exceeds --lr {a.lr}")
    check(a.lr_decay_style == "constant" or a.lr_warmup_iters < a.lr_decay_iters,
          f"--lr-warmup-iters {a.lr_warmup_iters} must be less than --lr-decay-iters "
          f"{a.lr_decay_iters} (default: the training iterations) for {a.lr_decay_style} decay")
    if a.lr_decay_style == "WSD":
        check(a.lr_wsd_decay_iters is not None, f"--lr-decay-style WSD needs {wsd_flag} (the "
              "length of the final annealing)")
        check(a.lr_wsd_decay_iters <= a.lr_decay_iters,
              f"{wsd_flag}: the annealing ({a.lr_wsd_decay_iters} iterations) is longer than "
              f"the decay ({a.lr_decay_iters})")


# What Megatron's OptimizerParamScheduler.load_state_dict checks (its names, for the message):
# the argument, the checkpoint's lr_schedule key, and how the values compare.
def _same_float(x, y) -> bool:  # braid keeps the rates as f32
    return np.float32(x) == np.float32(y)


def _same(x, y) -> bool:
    return x == y


SCHEDULE_FIELDS = (
    ("learning rate", "lr", "lr", _same_float),
    ("minimum learning rate", "min_lr", "min_lr", _same_float),
    ("warmup iterations", "lr_warmup_iters", "warmup_iters", _same),
    ("total number of iterations", "lr_decay_iters", "decay_iters", _same),
    ("learning rate decay style", "lr_decay_style", "style", _same),
)


def _weight_decay(a: argparse.Namespace) -> dict:
    """The command line's weight-decay schedule as a checkpoint's lr_schedule.weight_decay."""
    if a.weight_decay_incr_style == "constant":
        return {"start": a.weight_decay, "end": a.weight_decay, "style": "constant"}
    return {"start": a.start_weight_decay, "end": a.end_weight_decay,
            "incr_iters": a.weight_decay_incr_iters, "style": a.weight_decay_incr_style}


def check_optimizer(a: argparse.Namespace, check: Callable[[bool, str], None]):
    for flag in ("--main-grads-dtype", "--main-params-dtype", "--exp-avg-dtype",
                 "--exp-avg-sq-dtype"):
        value = getattr(a, flag[2:].replace("-", "_"))
        check(value == "fp32", f"{flag} {value}: braid's optimizer keeps f32 gradients, master "
              "weights and moments (fp32 only)")
    if a.decoupled_min_lr is not None:
        check(a.decoupled_lr is not None, "--decoupled-min-lr needs --decoupled-lr")
    if a.decoupled_lr is not None:
        floor = a.min_lr if a.decoupled_min_lr is None else a.decoupled_min_lr
        check(floor <= a.decoupled_lr, f"the decoupled learning rate's floor {floor} "
              f"(--decoupled-min-lr, else --min-lr) exceeds --decoupled-lr {a.decoupled_lr}")
    check(not (a.override_opt_param_scheduler and a.use_checkpoint_opt_param_scheduler),
          "give --override-opt_param-scheduler or --use-checkpoint-opt_param-scheduler, not both")


def continues_optimizer(a: argparse.Namespace, meta: dict) -> bool:
    """Whether this run continues the checkpoint (metadata `meta`) with its optimizer - and so,
    as in Megatron, with its learning-rate schedule: not --finetune, not --no-load-optim, and
    saved with the optimizer."""
    return not a.finetune and not a.no_load_optim and meta.get("optimizer", True) is not False


def take_checkpoints(a: argparse.Namespace, saved: dict,
                     check: Callable[[bool, str], None]) -> list[str]:
    """--use-checkpoint-opt_param-scheduler: the checkpoint's learning rate, floor, warmup,
    decay length and style and weight-decay schedule (`saved`, its metadata's lr_schedule)
    replace the command line's. Returns the log line."""
    for _, dest, key, _ in SCHEDULE_FIELDS:
        setattr(a, dest, saved[key])
    decay = saved.get("weight_decay")
    if decay is not None:
        if decay["style"] == "constant":
            a.weight_decay, a.weight_decay_incr_style = decay["start"], "constant"
        else:
            a.start_weight_decay, a.end_weight_decay = decay["start"], decay["end"]
            a.weight_decay_incr_iters = decay["incr_iters"]
            a.weight_decay_incr_style = decay["style"]
    check(a.lr_warmup_init <= a.lr, f"--lr-warmup-init {a.lr_warmup_init} exceeds the "
          f"checkpoint's learning rate {a.lr}")
    check_optimizer(a, check)
    return [f"braid: the checkpoint's learning-rate schedule (--use-checkpoint-opt_param-"
            f"scheduler): {a.lr_decay_style} from {a.lr:g} to {a.min_lr:g}, warmup "
            f"{a.lr_warmup_iters:g} and decay {a.lr_decay_iters:g} iterations"]


def differences(a: argparse.Namespace, saved: dict | None,
                saved_batch: int | None = None) -> str | None:
    """Megatron's OptimizerParamScheduler rule for a run that continues a checkpoint with its
    optimizer, without --override-opt_param-scheduler or --use-checkpoint-opt_param-scheduler:
    its learning rate, floor, warmup, decay length and style and weight-decay schedule must be
    the checkpoint's (`saved`). Megatron keeps the warmup and decay in samples, so under another
    global batch than the checkpoint's (`saved_batch`) they compare as samples: iterations that
    the new batch would turn into another schedule are refused. The error naming what differs,
    or None."""
    if saved is None or a.override_opt_param_scheduler or a.use_checkpoint_opt_param_scheduler:
        return None
    def shown(v):  # the checkpoint keeps float32 rates and fractional iterations
        return f"{v:g}" if isinstance(v, float) else v
    differ = [f"{name}: {shown(getattr(a, dest))} (the checkpoint: {shown(saved[key])})"
              for name, dest, key, same in SCHEDULE_FIELDS
              if not same(getattr(a, dest), saved[key])]
    batch = a.global_batch_size
    if saved_batch and saved_batch != batch:
        for name, dest, key in (("warmup", "lr_warmup_iters", "warmup_iters"),
                                ("decay", "lr_decay_iters", "decay_iters")):
            mine, theirs = getattr(a, dest) * batch, saved[key] * saved_batch
            if not math.isclose(mine, theirs, rel_tol=1e-9):
                differ.append(f"the {name} in samples: {shown(getattr(a, dest))} iterations x "
                              f"global batch {batch} = {mine:g} (the checkpoint: "
                              f"{shown(saved[key])} x {saved_batch} = {theirs:g})")
    mine, theirs = _weight_decay(a), saved.get("weight_decay")
    if theirs is not None and not (
            theirs.keys() == mine.keys() and theirs["style"] == mine["style"]
            and all(_same_float(theirs[k], mine[k]) for k in ("start", "end"))
            and theirs.get("incr_iters") == mine.get("incr_iters")):
        differ.append(f"weight decay: {mine} (the checkpoint: {theirs})")
    if not differ:
        return None
    return ("the learning-rate schedule differs from the checkpoint's: " + "; ".join(differ)
            + ". Give --override-opt_param-scheduler to use the command line's, or "
            "--use-checkpoint-opt_param-scheduler to continue the checkpoint's")
