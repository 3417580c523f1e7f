"""pretrain_gpt.py's --load and --save directories, checked before training (the same on every
rank, before any collective): a --load that holds something else than braid checkpoints, a
--save that cannot be written or holds a checkpoint the run would overwrite
(docs/checkpoints.md)."""

from __future__ import annotations

import os

from braid.checkpoint_flags import TRACKER  # braid's and Megatron-LM's


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
    tracker = os.path.join(a.save, TRACKER)
    continued = a.load and os.path.realpath(a.load) == os.path.realpath(a.save)
    if os.path.isfile(tracker) and not continued:
        with open(tracker) as f:
            saved = f.read().strip()
        return (f"--save {a.save} holds a checkpoint (iteration {saved}) that this run does not "
                f"load, and its saves would overwrite it: pass --load {a.save} to continue it, "
                "or --save another directory")
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
    if os.path.isfile(tracker):  # the iteration's folder tells whose checkpoint it is
        with open(tracker) as f:
            text = f.read().strip()
        folder = os.path.join(a.load, "release" if text == "release" else
                              f"iter_{int(text):07d}" if text.isdigit() else "")
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
