"""Weak and strong scaling of real braid training runs, with where the step time went.

Each row is one `mpirun -np N python pretrain_gpt.py` job (mock data) with braid's step timers
on (`--timing-log-level 2`): the trainer records every communication wait of every rank on its
trace (core/trace.h), so each rank's step splits into compute, pipeline wait (the bubble, the
p2p transfers and stage imbalance) and communication waits by group (tp, dp, other: the loss,
the gradient norm, tied embeddings). The figures are the second half of the run (the first half
is warm-up), ms per iteration averaged over the ranks.

    python benchmarks/scaling.py                     # 1, 2, 4 CPU ranks: weak and strong
    python benchmarks/scaling.py --ranks 1 2 --train-iters 6 --json out.json --trace-dir traces
    python tools/plot_schedule.py traces/weak_pp_2/traces/*.json -o weak_pp_2.png
    python benchmarks/scaling.py --device cuda --ranks 1 2 4 8   # one GPU per rank

Experiments, all against one 1-rank baseline (the base model, the base batch):
  weak dp      N ranks of data parallelism, the global batch N times the base
  weak pp      N pipeline stages, N times the base's layers (the same work per stage)
  strong dp/tp/pp/3d   the base model and batch spread over N ranks (3d: tp 2 x pp 2)
  strong pp uneven     strong pp with one layer fewer on the last stage, which also runs the LM
                       head and loss (--decoder-last-pipeline-num-layers; where the other stages
                       can split the rest evenly). It pays when the head outweighs a layer:
                       a large vocabulary against the hidden size (--vocab-size)

Efficiency is model FLOP/s (braid.flops, Narayanan et al.) of N ranks over N times the
baseline's: 100% is linear. With more ranks than CPUs (logical ones, as the OS schedules them),
the ranks share them and the best possible is CPUs/N; the "per core" column divides that out
(each rank's MPI polling and DP progress thread share its CPU too, so the limit is generous).
Pipeline wait is compared with the bubble braid's own 1F1B schedule implies for the measured
compute (braid._C.simulate; compute includes the optimizer step, a few % of it, so this bubble
is a slight overestimate).

On CUDA the timers synchronize the device around every span (core/trace.h), so the host does
not run ahead of the GPU: figures there are those of a traced run, lower than an untraced one's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "python"))

import braid  # noqa: E402
from braid import flops  # noqa: E402
from braid.arguments import parse_args as parse_training_args  # noqa: E402
from braid.training import model_config  # noqa: E402

PARTS = ["compute", "pipeline-wait", "tp-comm-wait", "dp-comm-wait", "other-comm-wait"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4],
                   help="job sizes to measure (1 is always measured: the baseline)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--num-layers", type=int, default=4, help="the base model's layers")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8,
                   help="the base global batch, in micro batches of one sequence")
    p.add_argument("--train-iters", type=int, default=8,
                   help="iterations per run; the second half is measured")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--trace-dir", default=None, metavar="DIR",
                   help="keep every rank's timeline of the first two measured iterations of "
                        "each run: DIR/<experiment>_<N>/traces/rank<r>.json "
                        "(tools/plot_schedule.py draws them)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    a = p.parse_args(argv)
    if a.train_iters < 2 or a.train_iters % 2:
        p.error(f"--train-iters must be even and >= 2, got {a.train_iters}")
    if any(n < 1 for n in a.ranks):
        p.error(f"--ranks must be >= 1, got {a.ranks}")
    a.ranks = sorted(set(a.ranks) | {1})
    return a


def experiments(a):
    """(experiment, ranks, tp, pp, layers, global batch, last stage's layers or None) of every
    run but the baseline."""
    runs = []
    for n in a.ranks:
        if n == 1:
            continue
        runs.append(("weak dp", n, 1, 1, a.num_layers, a.batch * n, None))
        runs.append(("weak pp", n, 1, n, a.num_layers * n, a.batch, None))
        if a.batch % n == 0:
            runs.append(("strong dp", n, 1, 1, a.num_layers, a.batch, None))
        if a.num_attention_heads % n == 0:
            runs.append(("strong tp", n, n, 1, a.num_layers, a.batch, None))
        if a.num_layers % n == 0:
            runs.append(("strong pp", n, 1, n, a.num_layers, a.batch, None))
            last = a.num_layers // n - 1
            if last >= 1 and (a.num_layers - last) % (n - 1) == 0:
                runs.append(("strong pp uneven", n, 1, n, a.num_layers, a.batch, last))
        if n == 4 and a.num_attention_heads % 2 == 0 and a.num_layers % 2 == 0:
            runs.append(("strong 3d", n, 2, 2, a.num_layers, a.batch, None))
    return runs


def stages(layers, pp, last):
    """Layers per stage: "4" (even), "3|1" (first|last), "3|3..|2" (first, the middle, last)."""
    if last is None:
        return str(layers // pp)
    each = (layers - last) // (pp - 1)
    return f"{each}|{last}" if pp == 2 else f"{each}|{each}..|{last}"


def training_args(a, tp, pp, layers, batch, metrics, trace_dir=None, ranks=1, last=None):
    args = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--num-layers", str(layers), "--hidden-size", str(a.hidden_size),
            "--num-attention-heads", str(a.num_attention_heads),
            "--seq-length", str(a.seq_length), "--max-position-embeddings", str(a.seq_length),
            "--vocab-size", str(a.vocab_size), "--mock-data",
            "--micro-batch-size", "1", "--global-batch-size", str(batch),
            "--train-iters", str(a.train_iters), "--log-interval", str(a.train_iters // 2),
            "--lr", "1e-4", "--eval-iters", "0", "--device", a.device,
            # cuDNN's attention on a GPU: with attention dropout braid's own kernels run
            "--attention-dropout", "0",
            "--timing-log-level", "2", "--timing-log-option", "all",
            "--log-timers-to-tensorboard", "--metrics-jsonl", metrics]
    if a.device == "cuda":
        args.append("--bf16")
    if last is not None:
        args += ["--decoder-last-pipeline-num-layers", str(last)]
    if trace_dir:
        start = a.train_iters // 2 + 1
        args += ["--profile", "--profile-step-start", str(start), "--profile-step-end",
                 str(min(start + 2, a.train_iters + 1)), "--profile-ranks",
                 *map(str, range(ranks)), "--tensorboard-dir", trace_dir]
    return args


def environment(ranks):
    env = dict(os.environ)
    # One thread per rank, idle ones asleep, so ranks sharing cores do not thrash.
    env.update(OMP_NUM_THREADS="1", OMP_WAIT_POLICY="passive", OPENBLAS_NUM_THREADS="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def run(a, experiment, ranks, tp, pp, layers, batch, last, workdir):
    """One job; its row (timers: mean over ranks, ms per iteration)."""
    name = f"{experiment.replace(' ', '_')}_{ranks}"
    metrics = os.path.join(workdir, f"{name}.jsonl")
    trace_dir = os.path.join(a.trace_dir, name) if a.trace_dir else None
    cmd = [sys.executable, os.path.join(REPO, "pretrain_gpt.py"),
           *training_args(a, tp, pp, layers, batch, metrics, trace_dir, ranks, last)]
    if ranks > 1 or shutil.which("mpirun"):
        cmd = ["mpirun", "-np", str(ranks), "--oversubscribe", *cmd]
    r = subprocess.run(cmd, env=environment(ranks), cwd=REPO, capture_output=True, text=True,
                       timeout=a.timeout)
    if r.returncode != 0:
        sys.exit(f"scaling: {experiment} on {ranks} ranks failed (exit {r.returncode}):\n"
                 + (r.stdout + r.stderr)[-3000:])
    with open(metrics) as f:
        timed = [rec for rec in map(json.loads, f) if "step-time" in rec]
    cfg = model_config(parse_training_args(training_args(a, tp, pp, layers, batch, metrics),
                                           ranks))
    step_s = timed[-1]["step-time"] / 1e3  # the second half of the run; the slowest rank's
    row = {"experiment": experiment, "ranks": ranks, "tp": tp, "pp": pp, "dp": ranks // (tp * pp),
           "layers": layers, "stages": stages(layers, pp, last), "global_batch": batch,
           "step_ms": timed[-1]["step-time"],
           "tokens_per_s": batch * a.seq_length / step_s,
           "model_flops_per_s": flops.flops_per_iteration(cfg, a.seq_length, batch) / step_s}
    for part in PARTS:
        row[part.replace("-", "_") + "_ms"] = timed[-1][f"{part}-time-mean"]
    row["bubble_schedule_ms"] = schedule_bubble_ms(pp, batch // row["dp"], row["compute_ms"])
    return row


def schedule_bubble_ms(pp, microbatches, compute_ms):
    """The idle time braid's 1F1B schedule implies for this compute per step (forward 1,
    backward 2 per microbatch; the rank's whole compute spread over its microbatches)."""
    if pp == 1:
        return 0.0
    idle = braid._C.simulate(braid._C.make_1f1b(pp, microbatches)).idle_fraction
    return compute_ms * idle / (1 - idle)


def add_efficiency(rows, cores):
    base = next(r for r in rows if r["ranks"] == 1)
    for r in rows:
        n = r["ranks"]
        r["efficiency"] = r["model_flops_per_s"] / (n * base["model_flops_per_s"])
        # With more ranks than cores, N ranks can at best run cores/N as fast each.
        r["core_limit"] = min(n, cores) / n
        r["efficiency_per_core"] = r["efficiency"] / r["core_limit"]


def print_table(rows, cores, device):
    header = (f"{'experiment':<17}{'N':>3}{'tp':>3}{'pp':>3}{'dp':>3}{'stages':>8}{'batch':>6}"
              f"{'step ms':>9}{'tokens/s':>10}{'effic.':>8}{'per core':>9} |"
              f"{'compute':>9}{'pp wait':>9}{'bubble*':>9}{'tp wait':>9}{'dp wait':>9}"
              f"{'other':>8}")
    print(f"braid scaling: {device}, {cores} cores; step parts are ms per iteration, mean over "
          "ranks; bubble* = what the 1F1B schedule implies for that compute")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['experiment']:<17}{r['ranks']:>3}{r['tp']:>3}{r['pp']:>3}{r['dp']:>3}"
              f"{r['stages']:>8}{r['global_batch']:>6}{r['step_ms']:>9.1f}"
              f"{r['tokens_per_s']:>10.0f}{100 * r['efficiency']:>7.1f}%"
              f"{100 * r['efficiency_per_core']:>8.1f}% |{r['compute_ms']:>9.1f}"
              f"{r['pipeline_wait_ms']:>9.1f}{r['bubble_schedule_ms']:>9.1f}"
              f"{r['tp_comm_wait_ms']:>9.1f}{r['dp_comm_wait_ms']:>9.1f}"
              f"{r['other_comm_wait_ms']:>8.1f}")
    for kind in ("weak", "strong"):
        mine = [r for r in rows if r["experiment"].startswith(kind)]
        if mine:
            best = max(mine, key=lambda r: (r["ranks"], r["efficiency_per_core"]))
            print(f"{kind} scaling at {best['ranks']} ranks: best {best['experiment']} at "
                  f"{100 * best['efficiency']:.1f}% of linear "
                  f"({100 * best['efficiency_per_core']:.1f}% of what {cores} cores allow)")


def main(argv=None):
    a = parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    if a.device == "cuda":
        gpus = braid.cuda_device_count()
        if max(a.ranks) > gpus:
            sys.exit(f"scaling: --ranks up to {max(a.ranks)} need one GPU each; "
                     f"this machine shows {gpus}")
        cores = max(a.ranks)  # one device per rank: no sharing
    with tempfile.TemporaryDirectory(prefix="braid_scaling_") as workdir:
        rows = [run(a, "baseline", 1, 1, 1, a.num_layers, a.batch, None, workdir)]
        for experiment in experiments(a):
            rows.append(run(a, *experiment, workdir))
            print(f"  measured {experiment[0]} on {experiment[1]} ranks", file=sys.stderr)
    add_efficiency(rows, cores)
    print_table(rows, cores, a.device)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": a.device, "cores": cores, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
