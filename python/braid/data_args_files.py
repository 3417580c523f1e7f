"""Megatron-LM's data blends read from files, for blends too long for a command line:

- ``--data-args-path FILE``: FILE holds what --data-path would (PREFIX, or WEIGHT PREFIX ...),
  separated by any whitespace, newlines included;
- ``--per-split-data-args-path FILE.json``: ``{"train": ..., "valid": ..., "test": ...}``, each a
  list of --train-data-path style words or one string of them (split on whitespace), or null
  for a split without data.

Both are read while the arguments are checked and stand in for --data-path or
--train-data-path / --valid-data-path / --test-data-path from then on (so a.data_path holds the
file's blend), as Megatron-LM's get_blend_and_blend_per_split reads them.
"""

from __future__ import annotations

import json

SPLITS = ("train", "valid", "test")


def add_arguments(group) -> None:
    group.add_argument("--data-args-path", default=None, metavar="FILE",
                       help="a file holding --data-path's words (PREFIX, or WEIGHT PREFIX ...)")
    group.add_argument("--per-split-data-args-path", default=None, metavar="FILE",
                       help='a JSON file {"train": ..., "valid": ..., "test": ...} holding each '
                            "split's --*-data-path words (a list, or one string)")


def _read(path: str, flag: str, check, check_files: bool) -> str | None:
    """The file's text; None when it cannot be read and files are not checked (tools/plan.py
    planning on another machine)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        check(not check_files, f"{flag} {path}: cannot read it ({e.strerror})")
        return None


def resolve(a, check, check_files: bool = True) -> None:
    """Reads the two files into a.data_path and a.{train,valid,test}_data_path; `check(ok,
    message)` raises on a problem (found alike by every rank, before MPI starts)."""
    if a.data_args_path is not None:
        check(a.data_path is None, "give --data-path or --data-args-path, not both")
        text = _read(a.data_args_path, "--data-args-path", check, check_files)
        # Unread (planning elsewhere): the file stands in for its blend.
        a.data_path = text.split() if text is not None else [a.data_args_path]
        check(bool(a.data_path), f"--data-args-path {a.data_args_path}: the file is empty; it "
              "should hold --data-path's words (PREFIX, or WEIGHT PREFIX ...)")
    if a.per_split_data_args_path is None:
        return
    path = a.per_split_data_args_path
    given = [f"--{s}-data-path" for s in SPLITS if getattr(a, f"{s}_data_path") is not None]
    check(not given, f"give --per-split-data-args-path or {' / '.join(given)}, not both")
    text = _read(path, "--per-split-data-args-path", check, check_files)
    if text is None:
        a.train_data_path = [path]
        return
    try:
        blends = json.loads(text)
    except json.JSONDecodeError as e:
        check(False, f"--per-split-data-args-path {path}: not JSON ({e})")
    check(isinstance(blends, dict) and set(SPLITS) <= set(blends),
          f"--per-split-data-args-path {path}: should be a JSON object with the keys \"train\", "
          "\"valid\" and \"test\" (Megatron-LM's format), each a list of words, one string of "
          "them, or null")
    for split in SPLITS:
        words = blends[split]
        if isinstance(words, str):
            words = words.split()
        check(words is None or (isinstance(words, list) and all(isinstance(w, (str, int, float))
                                                               for w in words)),
              f"--per-split-data-args-path {path}: \"{split}\" should be a list of words, one "
              f"string of them, or null; got {json.dumps(words)[:80]}")
        setattr(a, f"{split}_data_path", [str(w) for w in words] if words else None)
