"""Weights & Biases logging: Megatron-LM's --wandb-* flags for pretrain_gpt.py.

    wandb = wandb_log.module(a)                  # every rank, before MPI: the package or None
    run = wandb_log.start(wandb, a) if rank == 0 else None
    metrics = MetricsWriter(tb_dir, jsonl_path, enabled=rank == 0, wandb_run=run)

MetricsWriter logs every scalars(step, values) call to the run as well (the same names at the
same steps as the TensorBoard files) and finishes it on close(). As Megatron-LM's
_set_wandb_writer: W&B is on when --wandb-project is given (not empty); the run is named
--wandb-exp-name, which it then requires; its files go to --wandb-save-dir, by default
<--save>/wandb (W&B writes them under DIR/wandb/); --wandb-entity, when given, is its entity;
its config is the parsed arguments. Megatron's last rank writes, braid's rank 0: the rank that
holds every scalar braid records. wandb is imported only when --wandb-project is given, on
every rank before MPI starts, so a missing package ends every rank with the same error.
"""

from __future__ import annotations

import argparse
import os

FLAGS = ("--wandb-project", "--wandb-exp-name", "--wandb-save-dir", "--wandb-entity")


def add_arguments(group) -> None:
    """The flags, in the parser's logging group (Megatron's names; empty means not given)."""
    group.add_argument("--wandb-project", default=None,
                       help="log the metrics to this Weights & Biases project as well "
                            "(rank 0 writes; needs the wandb package)")
    group.add_argument("--wandb-exp-name", default=None,
                       help="the W&B run's name (needed with --wandb-project)")
    group.add_argument("--wandb-save-dir", default=None,
                       help="where W&B keeps the run's files (default: <--save>/wandb)")
    group.add_argument("--wandb-entity", default=None,
                       help="the W&B entity (user or team) the run belongs to (default: W&B's "
                            "default entity)")


def validate(a: argparse.Namespace, check) -> None:
    """Megatron's rules, found by every rank alike; `check(condition, message)` raises."""
    if not a.wandb_project:
        return
    check(bool(a.wandb_exp_name),
          "--wandb-project needs --wandb-exp-name, the run's name (Megatron-LM: \"Please "
          "specify the wandb experiment name!\")")
    check(bool(a.wandb_save_dir or a.save),
          "--wandb-project needs --wandb-save-dir or --save (W&B's files go to "
          "--wandb-save-dir, by default <--save>/wandb)")


def notes(a: argparse.Namespace) -> list[str]:
    """A log line for each --wandb-* flag given without --wandb-project (Megatron ignores them)."""
    if a.wandb_project:
        return []
    return [f"braid: {flag} has no effect without --wandb-project" for flag in FLAGS[1:]
            if getattr(a, flag[2:].replace("-", "_"))]


def module(a: argparse.Namespace):
    """The wandb package with --wandb-project, else None; ValueError naming the fix when it
    cannot be imported."""
    if not a.wandb_project:
        return None
    try:
        import wandb
    except ImportError as e:
        raise ValueError(f"--wandb-project needs the wandb package, which this Python cannot "
                         f"import ({e}): pip install wandb") from None
    return wandb


def save_dir(a: argparse.Namespace) -> str:
    return a.wandb_save_dir or os.path.join(a.save, "wandb")


def start(wandb, a: argparse.Namespace):
    """Starts the W&B run the arguments describe (wandb.init's Run), or None without wandb."""
    if wandb is None:
        return None
    # Absolute: a wandb-core service this process did not start (WANDB_SERVICE, inherited from
    # a parent that uses W&B) resolves relative paths against its own directory.
    directory = os.path.abspath(save_dir(a))
    os.makedirs(directory, exist_ok=True)
    settings = dict(dir=directory, name=a.wandb_exp_name, project=a.wandb_project,
                    config=dict(vars(a)))
    if a.wandb_entity:
        settings["entity"] = a.wandb_entity
    return wandb.init(**settings)
