"""pretrain_gpt.py's checkpointing arguments (Megatron-LM's --save, --load, --save-interval, ...),
their checks, and what --save-retain-interval does after each save (Retention).

Megatron's --save-retain-interval N keeps the checkpoints of multiples of N and the latest one
and deletes the others. Braid's, on world rank 0, once a save is committed (the iteration's
directory renamed into place and the tracker file naming it; under --async-save when the saver
reports the commit, never while the files are being written): every earlier ``iter_<n>``
directory of --save whose n is not a multiple of N, and is neither the tracker's iteration nor a
symbolic link, is renamed to ``iter_<n>.deleting-<host>-<pid>-<k>`` and then removed on a
background thread. The rename is atomic, so a directory named ``iter_<n>`` is always a whole
checkpoint, and the tracker never names a renamed one; a job killed while deleting leaves a
``.deleting-`` directory that the next job's retention removes. docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import threading
from typing import Callable

_ITERATION = re.compile(r"iter_(\d+)")
_DELETING = re.compile(r"iter_\d+\.deleting-.+")
TRACKER = "latest_checkpointed_iteration.txt"  # Megatron's name (docs/checkpoints.md)


def add_arguments(p: argparse.ArgumentParser, pos_int, nonneg_int):
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, metavar="DIR")
    g.add_argument("--load", default=None, metavar="DIR")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model's shape from the --load checkpoint (--ckpt-step or the "
                        "latest) instead of the command line")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="with --load: stop (exit 1) when it holds no checkpoint, instead of "
                        "training from scratch")
    g.add_argument("--save-interval", "--persistent-save-interval", type=pos_int, default=None,
                   help="(--persistent-save-interval: Megatron's other spelling)")
    g.add_argument("--save-retain-interval", type=pos_int, default=None, metavar="N",
                   help="keep the checkpoints of multiples of N (a multiple of --save-interval) "
                        "and the latest; delete the others of --save after each save")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--no-save-optim", action="store_true",
                   help="save the parameters without the optimizer state (a third of the size "
                        "with f32 parameters, a seventh with bf16; load it with --no-load-optim "
                        "or --finetune)")
    g.add_argument("--no-save-rng", action="store_true",
                   help="save without the dropout RNG state")
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--async-save", action="store_true")
    g.add_argument("--ckpt-step", type=nonneg_int, default=None)


def validate(a: argparse.Namespace, check: Callable[[bool, str], None]):
    """check(ok, message) raises the argument error. Notes for the log go to a.checkpoint_args."""
    for flag, value in (("--save-interval", a.save_interval), ("--async-save", a.async_save),
                        ("--no-save-optim", a.no_save_optim), ("--no-save-rng", a.no_save_rng),
                        ("--exit-signal-handler", a.exit_signal_handler),
                        ("--save-retain-interval", a.save_retain_interval)):
        check(not value or a.save, f"{flag} needs --save DIR")
    if a.save_retain_interval is not None:  # Megatron's rule: it thins what the interval saves
        check(a.save_interval is not None, "--save-retain-interval needs --save-interval (it "
              "keeps every Nth iteration of the checkpoints the interval saves)")
        check(a.save_retain_interval % a.save_interval == 0,
              f"--save-retain-interval {a.save_retain_interval} is not a multiple of "
              f"--save-interval {a.save_interval}")
    # Megatron's Mixtral script passes these without --load: they ask for nothing to be loaded.
    for flag, value in (("--no-load-optim", a.no_load_optim), ("--no-load-rng", a.no_load_rng)):
        if value and not a.load:
            a.checkpoint_args.append(f"braid: {flag} has no effect without --load")
    for flag, value in (("--exit-on-missing-checkpoint", a.exit_on_missing_checkpoint),
                        ("--finetune", a.finetune), ("--ckpt-step", a.ckpt_step is not None)):
        check(not value or a.load, f"{flag} needs --load DIR")


def read_tracker(directory: str) -> int:
    """The iteration the tracker file of `directory` names; -1 when there is none (or it is not
    a number: then retention keeps everything)."""
    try:
        with open(os.path.join(directory, TRACKER), encoding="utf-8") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return -1


class Retention:
    """--save-retain-interval on the rank that deletes (world rank 0; ``enabled=False`` on the
    others and without the flag makes it do nothing). Call ``committed(iteration)`` with the
    saver's last committed iteration after every saver call that may commit (save, poll, wait):
    it acts once per new commit. ``close()`` waits for the deletions (before exiting)."""

    def __init__(self, directory, interval, log, enabled=True):
        self.dir, self.interval, self.log = directory, interval, log
        self.enabled = enabled and directory is not None and interval is not None
        self.handled = -1  # the commit retention last ran after
        self.thread = None
        self.renamed = 0

    def committed(self, iteration: int):
        if not self.enabled or iteration < 0 or iteration == self.handled:
            return
        self.handled = iteration
        self.close()  # one deleting thread at a time: never two on one directory
        latest = read_tracker(self.dir)
        doomed, names = [], []
        for name in sorted(os.listdir(self.dir)):
            path = os.path.join(self.dir, name)
            if _DELETING.fullmatch(name):  # a job died while deleting it
                doomed.append(path)
                continue
            match = _ITERATION.fullmatch(name)
            if match is None or os.path.islink(path) or not os.path.isdir(path):
                continue  # a temporary of a save (in flight or dead), a pinned link, a file
            n = int(match.group(1))
            # Only earlier ones: a later one (left by a run that went further, resumed with
            # --ckpt-step) is not this run's to judge.
            if n >= iteration or n == latest or n % self.interval == 0:
                continue
            target = f"{path}.deleting-{socket.gethostname()}-{os.getpid()}-{self.renamed}"
            self.renamed += 1
            try:
                os.rename(path, target)
            except OSError as e:
                self.log(f"braid: warning: --save-retain-interval: cannot rename {path} to "
                         f"delete it: {e}")
                continue
            doomed.append(target)
            names.append(name)
        if names:
            self.log(f"braid: --save-retain-interval {self.interval}: deleting "
                     f"{', '.join(names)} of {self.dir} (kept: multiples of {self.interval} "
                     f"and the latest, {iteration})")
        if doomed:
            self.thread = threading.Thread(target=self._remove, args=(doomed,),
                                           name="braid-retention")
            self.thread.start()

    def _remove(self, paths):
        for path in paths:
            try:
                shutil.rmtree(path)
            except OSError as e:  # as Megatron: a failed deletion never stops training
                self.log(f"braid: warning: --save-retain-interval: cannot delete {path}: {e}")

    def close(self):
        if self.thread is not None:
            self.thread.join()
            self.thread = None
