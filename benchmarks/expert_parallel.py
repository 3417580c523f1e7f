"""Expert parallelism against plain data parallelism on the same ranks and the same MoE model;
with --tp, whole experts against experts split over tensor parallelism.

Each run is one `mpirun -np N python pretrain_gpt.py` job (mock data, --timing-log-level 2):
--expert-model-parallel-size 1 (every rank holds every expert; the experts' gradients are
all-reduced over DP) and --expert-model-parallel-size EP (each rank holds E/EP experts; the
routed tokens go all-to-all to them and back; the experts' gradients are reduced over the
expert-DP group only). With --tp T > 1 (sequence parallel) the two runs are instead "split",
each expert split over the TP group (Megatron's default expert TP) with ep = the DP size, and
"whole", --expert-tensor-parallel-size 1 with ep EP over TP x DP (each TP rank routes its own
tokens; no TP collective around the routed experts). The two alternate, `--repeats` times each;
the fastest repeat of each counts. Printed per run: ms per iteration (the last log interval),
peak memory per rank, and the dp- and ep-communication waits (the slowest rank's); then the
ratios of the second to the first.

    python benchmarks/expert_parallel.py                  # 2 CPU ranks, ep 2
    python benchmarks/expert_parallel.py --ranks 4 --ep 4 --num-experts 16
    python benchmarks/expert_parallel.py --ranks 4 --tp 2 --ep 4   # whole vs split experts
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--ep", type=int, default=None, help="the expert-parallel size (default: ranks)")
    p.add_argument("--tp", type=int, default=1,
                   help="> 1: whole experts against experts split over this TP size")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--moe-ffn-hidden-size", type=int, default=256)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--train-iters", type=int, default=12, help="the last half is timed")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    a = p.parse_args(argv)
    a.ep = a.ep or a.ranks
    if a.tp < 1 or a.ranks % a.tp or (a.tp > 1 and a.num_experts % (a.ranks // a.tp)):
        p.error(f"--tp {a.tp} must divide --ranks {a.ranks}, and the data-parallel size (the "
                f"split run's ep) --num-experts {a.num_experts}")
    if a.ep < (2 if a.tp == 1 else 1) or a.ranks % a.ep or a.num_experts % a.ep:
        p.error(f"--ep {a.ep} must be at least {2 if a.tp == 1 else 1} and divide --ranks "
                f"{a.ranks} and --num-experts {a.num_experts}")
    if a.train_iters < 2 or a.train_iters % 2:
        p.error(f"--train-iters must be even and >= 2, got {a.train_iters}")
    return a


def layouts(a) -> dict[str, list[str]]:
    """The two runs compared: their labels and layout arguments, the baseline first."""
    if a.tp == 1:
        return {f"ep {ep}": ["--expert-model-parallel-size", str(ep)] for ep in (1, a.ep)}
    tp = ["--tensor-model-parallel-size", str(a.tp), "--sequence-parallel"]
    dp = a.ranks // a.tp
    return {f"split ep {dp}": [*tp, "--expert-model-parallel-size", str(dp)],
            f"whole ep {a.ep}": [*tp, "--expert-tensor-parallel-size", "1",
                                 "--expert-model-parallel-size", str(a.ep)]}


def command(a, layout: list[str]) -> list[str]:
    args = ["--device", "cpu", "--num-layers", str(a.num_layers), "--hidden-size",
            str(a.hidden_size), "--num-attention-heads", "4", "--swiglu", "--normalization",
            "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear", "--mock-data",
            "--vocab-size", "1024", "--seq-length", str(a.seq_length), "--micro-batch-size",
            str(a.micro_batch_size), "--global-batch-size", str(a.global_batch_size), "--lr",
            "3e-4", "--train-iters", str(a.train_iters), "--eval-iters", "0", "--log-interval",
            str(a.train_iters // 2), "--num-experts", str(a.num_experts), "--moe-router-topk",
            str(a.topk), "--moe-ffn-hidden-size", str(a.moe_ffn_hidden_size),
            "--moe-aux-loss-coeff", "0.01", "--timing-log-level", "2", *layout]
    cmd = [sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *args]
    return ["mpirun", "-np", str(a.ranks), "--oversubscribe", *cmd] if a.ranks > 1 else cmd


def environment() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    env["PYTHONPATH"] = os.path.join(REPO, "python")
    return env


def measure(a, label: str, layout: list[str]) -> dict:
    r = subprocess.run(command(a, layout), env=environment(), cwd=REPO, capture_output=True,
                       text=True, timeout=a.timeout)
    if r.returncode != 0:
        raise SystemExit(f"{label}: pretrain_gpt.py failed ({r.returncode}):\n{r.stdout}{r.stderr}")
    last = [line for line in r.stdout.splitlines() if "elapsed time per iteration (ms):" in line][-1]
    timers = r.stdout.rsplit("time across ranks (ms):", 1)[1]

    def slowest(name):  # the max over ranks of a timer of the last interval
        return float(re.search(rf"    {name} \.+: \(([0-9.]+), ([0-9.]+)\)", timers).group(2))

    return {"ms": float(re.search(r"elapsed time per iteration \(ms\): ([0-9.]+)", last).group(1)),
            "peak_mb": float(re.search(r"peak memory \(MB\): ([0-9.]+)", last).group(1)),
            "dp_wait_ms": slowest("dp-comm-wait"), "ep_wait_ms": slowest("ep-comm-wait")}


def main(argv=None) -> int:
    a = parse_args(argv)
    runs = {label: [] for label in layouts(a)}
    for _ in range(a.repeats):
        for label, layout in layouts(a).items():
            runs[label].append(measure(a, label, layout))
    best = {label: min(rs, key=lambda r: r["ms"]) for label, rs in runs.items()}
    print(f"{a.ranks} ranks{f' (tp {a.tp}, sequence parallel)' if a.tp > 1 else ''}, "
          f"{a.num_layers} layers of {a.num_experts} experts (top-{a.topk}, hidden "
          f"{a.hidden_size}, expert ffn {a.moe_ffn_hidden_size}), batch {a.global_batch_size} x "
          f"{a.seq_length}; best of {a.repeats}, alternating")
    print(f"{'run':>12} {'ms/iter':>9} {'peak MB':>9} {'dp wait ms':>11} {'ep wait ms':>11}")
    for label, r in best.items():
        print(f"{label:>12} {r['ms']:>9.1f} {r['peak_mb']:>9.1f} {r['dp_wait_ms']:>11.2f} "
              f"{r['ep_wait_ms']:>11.2f}")
    (base, first), (other, second) = best.items()
    print(f"{other} / {base}: time {second['ms'] / first['ms']:.2f}x, peak memory "
          f"{second['peak_mb'] / first['peak_mb']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
