#!/usr/bin/env python3
"""Draw a pipeline timeline from per-rank Chrome traces (braid::Trace, core/trace.h).

    tools/plot_schedule.py RANK_TRACES... -o out.png [--title TEXT]

Each file is one rank's Trace Event Format JSON (pipeline_bench --trace-dir DIR writes
DIR/<schedule>_rank<r>.json). The picture has one row per rank (the trace's pid), time in ms
from the shared origin: forwards and backwards as colored boxes labeled with their microbatch
(and chunk when a rank holds several), the optimizer step, the p2p lane's postings and
waits shaded in a thin strip under each row, and every communication wait (lanes comm:tp,
comm:dp, comm:pp, ...: Trainer.set_trace) in a second strip below it. Needs matplotlib (requirements-test.txt).
"""

import argparse
import json
import sys

COLORS = {  # forward blue, backward green, optimizer grey (Narayanan et al.'s figures)
    "forward": ["#4c78a8", "#9ecae9"],  # by chunk: dark, light
    "backward": ["#54a24b", "#a1d99b"],
    "optimizer": ["#9d9d9d"],
}
P2P_COLORS = {"wait": "#e45756", "send": "#f58518", "recv": "#f58518", "exchange": "#f58518"}
COMM_COLOR = "#b279a2"  # any communication wait (lanes "comm:<group>": tp, dp, pp, ...)


def load(paths):
    """{rank: [event, ...]} of the complete ("X") events of all files."""
    ranks = {}
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        events = doc["traceEvents"] if isinstance(doc, dict) else doc
        for e in events:
            if e.get("ph") == "X":
                ranks.setdefault(int(e["pid"]), []).append(e)
    if not ranks:
        sys.exit("plot_schedule: no complete (X) events in " + ", ".join(paths))
    return ranks


def plot(ranks, out, title=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    chunks = max((e.get("args", {}).get("chunk", 0) for es in ranks.values() for e in es), default=0)
    end_ms = max(e["ts"] + e["dur"] for es in ranks.values() for e in es) / 1e3
    rows = sorted(ranks)
    fig, ax = plt.subplots(figsize=(14, 0.75 * len(rows) + 1.4))
    for row, rank in enumerate(rows):
        y = len(rows) - 1 - row  # rank 0 on top
        for e in ranks[rank]:
            x, w = e["ts"] / 1e3, e["dur"] / 1e3
            args = e.get("args", {})
            lane = e.get("cat", "compute")
            if lane == "step":  # Trainer's whole-step span: the row itself
                continue
            if lane == "p2p" or lane.startswith("comm:"):
                color = COMM_COLOR if lane.startswith("comm:") else P2P_COLORS.get(e["name"],
                                                                                   "#bab0ac")
                strip = -0.42 if lane == "p2p" else -0.56
                ax.broken_barh([(x, w)], (y + strip, 0.14), color=color, alpha=0.55, linewidth=0)
                continue
            palette = COLORS.get(e["name"], ["#bab0ac"])
            chunk = args.get("chunk", 0)
            ax.broken_barh([(x, w)], (y - 0.25, 0.65), facecolor=palette[min(chunk, len(palette) - 1)],
                           edgecolor="white", linewidth=0.6)
            if "microbatch" in args:
                label = str(args["microbatch"]) + (f"c{chunk}" if chunks > 0 else "")
                # Only where it fits: ~0.6 % of the axis per character.
                if w > end_ms * 0.006 * len(label):
                    ax.text(x + w / 2, y + 0.075, label, ha="center", va="center", fontsize=7,
                            color="white" if chunk == 0 else "black")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r}" for r in reversed(rows)])
    ax.set_xlim(0, end_ms * 1.01)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlabel("time since the shared origin (ms)")
    if title:
        ax.set_title(title)
    legend = [Patch(color=COLORS["forward"][0], label="forward"),
              Patch(color=COLORS["backward"][0], label="backward")]
    if chunks > 0:
        legend += [Patch(color=COLORS["forward"][1], label="forward, chunk 1+"),
                   Patch(color=COLORS["backward"][1], label="backward, chunk 1+")]
    legend += [Patch(color=COLORS["optimizer"][0], label="optimizer"),
               Patch(color=P2P_COLORS["send"], alpha=0.55, label="p2p post"),
               Patch(color=P2P_COLORS["wait"], alpha=0.55, label="p2p wait")]
    if any(e.get("cat", "").startswith("comm:") for es in ranks.values() for e in es):
        legend.append(Patch(color=COMM_COLOR, alpha=0.55, label="comm wait (any group)"))
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.18 - 0.02 * (4 - len(rows))),
              ncol=len(legend), fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", nargs="+", help="one Chrome-trace JSON per rank")
    p.add_argument("-o", "--output", required=True, help="PNG (or any matplotlib format) to write")
    p.add_argument("--title")
    a = p.parse_args(argv)
    plot(load(a.traces), a.output, a.title)


if __name__ == "__main__":
    main()
