"""pretrain_gpt.py's learning-rate and weight-decay schedule arguments: Megatron's
iteration- or sample-based flags, checked against each other and turned into the iterations
engine::LRSchedule and the weight-decay schedule take."""

from __future__ import annotations

import argparse
from typing import Callable


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
