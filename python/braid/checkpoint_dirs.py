"""pretrain_gpt.py's --load and --save directories, checked before training (the same on every
rank, before any collective): a --load that holds something else than braid checkpoints, a
--save that cannot be written or holds a checkpoint the run would overwrite; and the job's
claim on --save, which keeps a second job from saving there at the same time
(docs/checkpoints.md)."""

from __future__ import annotations

import errno
import fcntl
import os
import re
import socket

from braid.checkpoint_flags import TRACKER  # braid's and Megatron-LM's


def _tracker(directory: str) -> str | None:
    """The tracker's text, stripped (bytes that are not UTF-8 shown replaced); None without one."""
    path = os.path.join(directory, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return f.read().decode("utf-8", "replace").strip()


def _iterations(directory: str) -> str:
    """The iteration folders `directory` holds (not a save's staging folders), named: "" if none,
    else e.g. "iter_0000004 and iter_0000008"."""
    held = sorted(n for n in os.listdir(directory) if re.fullmatch(r"iter_[0-9]{7,}", n)
                  and os.path.isdir(os.path.join(directory, n)))
    return " and ".join([", ".join(held[:-1]), held[-1]] if len(held) > 1 else held)


def save_directory_problem(a) -> str | None:
    """What is wrong with --save, found before training (the same on every rank): a directory
    that cannot be written, or one holding a checkpoint this run does not continue, whose
    iterations its saves would overwrite (and --save-retain-interval delete)."""
    if not a.save:
        return None
    try:
        os.makedirs(a.save, exist_ok=True)
    except OSError as e:
        return f"--save {a.save}: cannot create the directory ({e.strerror})"
    if not os.access(a.save, os.W_OK | os.X_OK):
        return f"--save {a.save}: cannot write there"
    saved = _tracker(a.save)
    continued = a.load and os.path.realpath(a.load) == os.path.realpath(a.save)
    if saved is not None and not continued:
        return (f"--save {a.save} holds a checkpoint (iteration {saved}) that this run does not "
                f"load, and its saves would overwrite it: pass --load {a.save} to continue it, "
                "or --save another directory")
    held = _iterations(a.save) if saved is None and not continued else ""
    if held:  # a first save stopped between its folder's rename and the tracker's
        return (f"--save {a.save} holds {held} but no {TRACKER}, and this run's saves could "
                f"overwrite them: pass --load {a.save} --ckpt-step N to continue one, or --save "
                "another directory")
    return None


def load_directory_problem(a) -> str | None:
    """A --load that holds something other than braid checkpoints (which would otherwise start a
    run from scratch, or fail deep in the load): a file, one iteration's folder, a Megatron-LM
    or Hugging Face checkpoint. The same on every rank."""
    if not a.load or not os.path.exists(a.load):
        return None
    if not os.path.isdir(a.load):
        return f"--load {a.load} is a file, not a checkpoint directory"
    where, names = a.load, set(os.listdir(a.load))
    tracker = os.path.join(a.load, TRACKER)
    text, held = _tracker(a.load), _iterations(a.load)
    number = text is not None and re.fullmatch(r"[0-9]+", text) is not None
    if text is None and a.ckpt_step is None and held:
        return (f"--load {a.load} holds {held} but no {TRACKER} (a first save stopped before it "
                "committed?): give --ckpt-step N to load iteration N")
    if text is not None and text != "release" and not number and a.ckpt_step is None:
        return (f"--load {a.load}: its {TRACKER} should hold an iteration number, holds "
                f"{text[:40]!r}" + (f" (the iterations there: {held}; --ckpt-step N loads "
                                    "iteration N)" if held else ""))
    if text is not None:  # the iteration's folder tells whose checkpoint it is
        folder = os.path.join(a.load, "release" if text == "release" else
                              f"iter_{int(text):07d}" if number else "")
        where, names = folder, set(os.listdir(folder)) if os.path.isdir(folder) else set()
    convert = "; convert it first: tools/{} import, then --load what it saves".format
    # torch_dist's files, or the legacy format's folder per model-parallel rank (braid's
    # mp_rank_* are files)
    if {"common.pt", ".metadata"} & names or any(
            n.startswith("mp_rank_") and os.path.isdir(os.path.join(where, n)) for n in names):
        return f"--load {a.load} holds a Megatron-LM checkpoint" + convert("convert_megatron.py")
    if "metadata.json" in names and not os.path.isfile(tracker):
        return (f"--load {a.load} is one iteration's folder of a braid checkpoint: give the "
                f"directory holding it ({os.path.dirname(os.path.abspath(a.load))}), and "
                "--ckpt-step for another iteration than its latest")
    if "config.json" in names and any(n.endswith(".safetensors") for n in names):
        return f"--load {a.load} holds a Hugging Face model" + convert("convert_hf.py")
    return None


SAVE_LOCK = ".braid-save.lock"


def claim_save_directory(save: str):
    """Rank 0's claim on --save for the job's life: an exclusive flock(2) on DIR/.braid-save.lock
    (the kernel drops it when the process ends, killed too), so that two jobs cannot save to one
    directory and overwrite each other's iterations. Returns the open lock file (keep it open),
    False when another job holds it, or None where the file system has no locks."""
    f = open(os.path.join(save, SAVE_LOCK), "a+", encoding="utf-8")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        f.close()
        return False if e.errno in (errno.EAGAIN, errno.EACCES) else None
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    return f


def save_directory_in_use(save: str) -> str:
    """The error of a --save another job holds, naming that job (its lock file's line)."""
    try:
        with open(os.path.join(save, SAVE_LOCK), encoding="utf-8") as f:
            holder = f.read().strip()
    except OSError:
        holder = ""
    return (f"--save {save} is in use by another job" + (f" ({holder})" if holder else "")
            + ": two jobs saving to one directory overwrite each other's checkpoints; wait for "
            "it to end, or --save another directory")
