#!/usr/bin/env python3
"""Draw training curves (loss, learning rate, throughput, ...) from braid's metrics files.

    tools/plot_metrics.py PATH [--out DIR] [--tag NAME ...]

PATH is a metrics JSONL file, a TensorBoard event file or a directory of them
(``--tensorboard-dir``); both are read by braid.metrics' own readers, so neither tensorboard
nor braid's C++ extension is needed here. Writes one PNG per scalar, ``DIR/<name>.png``
(default DIR: PATH itself if it is a directory, else the directory holding it), against the
step, and prints the paths written. A missing, empty or unreadable file is one
``plot_metrics: error: ...`` line and exit code 1. Needs matplotlib (requirements-test.txt).
"""

import argparse
import importlib.util
import os
import re
import sys


def load_metrics_module():
    """braid/metrics.py by its path: importing the braid package would load the extension."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "braid",
                        "metrics.py")
    spec = importlib.util.spec_from_file_location("braid_metrics", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def file_name(tag):
    """'lm loss' -> 'lm_loss', 'train/grad-norm' -> 'train_grad-norm'."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", tag).strip("_") or "metric"


def plot(series, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    written, used = [], set()
    for tag, points in series.items():
        name = file_name(tag)
        while name in used:
            name += "_"
        used.add(name)
        steps = [s for s, _ in points]
        values = [v for _, v in points]
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(steps, values, marker="." if len(points) < 50 else None, linewidth=1.2)
        ax.set_xlabel("step")
        ax.set_ylabel(tag)
        ax.set_title(tag)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        path = os.path.join(out_dir, name + ".png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path", help="metrics JSONL file, TensorBoard event file or directory")
    parser.add_argument("--out", help="directory for the PNGs (default: next to PATH)")
    parser.add_argument("--tag", action="append", help="plot only this scalar (repeatable)")
    args = parser.parse_args(argv)

    metrics = load_metrics_module()
    try:
        series = metrics.read_metrics(args.path)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        sys.exit(f"plot_metrics: error: {e}")
    if args.tag:
        missing = [t for t in args.tag if t not in series]
        if missing:
            sys.exit(f"plot_metrics: error: {args.path}: no scalar {', '.join(map(repr, missing))}"
                     f" (has {', '.join(map(repr, series))})")
        series = {t: series[t] for t in args.tag}
    out = args.out
    if out is None:
        out = args.path if os.path.isdir(args.path) else (os.path.dirname(args.path) or ".")
    try:
        for path in plot(series, out):
            print(path)
    except OSError as e:
        sys.exit(f"plot_metrics: error: {e}")


if __name__ == "__main__":
    main()
