"""Jobs that go wrong must end, everywhere, with a clear message and a non-zero exit.

Runs tests/cpp/comm/comm_fault_driver under mpirun (stdlib only, so it also runs in the
sanitizer build, which has no project venv):
  - bad parallel layouts: exit 2, the same one-line error from every rank, before any collective
  - one rank of 4 SIGKILLed inside a loop of all-reduces: every process gone within 60 s
  - one rank skipping a collective: the deadline message names the collective, the group, its
    size, the bytes and the rank, and the job exits non-zero
"""

import argparse
import os
import subprocess
import sys
import time

LIMIT_S = 60
failures = []


def run(args, driver, mpiexec, np, marker):
    cmd = [mpiexec, "-np", str(np), "--oversubscribe", driver, *args, "--marker", marker]
    start = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=LIMIT_S + 60)
    except subprocess.TimeoutExpired:
        return None, LIMIT_S + 60, "", "hung"
    return p.returncode, time.monotonic() - start, p.stdout, p.stderr


def leftover(marker):
    """PIDs of driver processes still alive (the marker is in their command line)."""
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    return [pid for pid in out.split() if int(pid) != os.getpid()]


def check(name, ok, detail):
    print(f"{'ok  ' if ok else 'FAIL'} {name}" + ("" if ok else f"\n{detail}"))
    if not ok:
        failures.append(name)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--driver", required=True)
    ap.add_argument("--mpiexec", required=True)
    a = ap.parse_args()

    bad_layouts = [  # (ranks, tp, pp, dp, expected message)
        (4, 3, 1, 0, "world size 4 is not divisible by --tensor-model-parallel-size (3)"),
        (4, 0, 1, 0, "--tensor-model-parallel-size must be at least 1, got 0"),
        (6, 2, 2, 0, "world size 6 is not divisible by"),
        (4, 2, 1, 4, "world size 4 is not tensor (2) × pipeline (1) × data (4) parallel = 8"),
        (3, 1, -1, 0, "--pipeline-model-parallel-size must be at least 1, got -1"),
    ]
    for np, tp, pp, dp, expected in bad_layouts:
        marker = f"braid-fault-layout-{os.getpid()}-{np}-{tp}-{pp}-{dp}"
        rc, took, out, err = run(["layout", str(tp), str(pp), str(dp)], a.driver, a.mpiexec, np, marker)
        lines = [l for l in err.splitlines() if l.startswith("braid: error:")]
        check(f"layout np={np} tp={tp} pp={pp} dp={dp}: exit 2, {np} identical lines, {took:.1f}s",
              rc == 2 and len(lines) == np and len(set(lines)) == 1 and expected in lines[0]
              and took < LIMIT_S,
              f"rc={rc} lines={lines}\nstderr:\n{err[-2000:]}")

    marker = f"braid-fault-ok-{os.getpid()}"
    rc, took, out, err = run(["layout", "2", "2", "0"], a.driver, a.mpiexec, 8, marker)
    check(f"good layout np=8 tp=2 pp=2: exit 0 ({took:.1f}s)", rc == 0 and "layout ok: tp 2 pp 2 dp 2" in out,
          f"rc={rc}\n{out}\n{err[-2000:]}")

    marker = f"braid-fault-kill-{os.getpid()}"
    rc, took, out, err = run(["kill", "2"], a.driver, a.mpiexec, 4, marker)
    time.sleep(1)
    alive = leftover(marker)
    check(f"rank 2 of 4 SIGKILLed: job exits non-zero in {took:.1f}s, no process left",
          rc not in (0, None) and took < LIMIT_S and not alive,
          f"rc={rc} alive={alive}\nstderr:\n{err[-2000:]}")

    marker = f"braid-fault-skip-{os.getpid()}"
    rc, took, out, err = run(["skip", "1", "--distributed-timeout-minutes", "0.05"], a.driver,
                             a.mpiexec, 4, marker)
    time.sleep(1)
    alive = leftover(marker)
    wanted = ["did not complete within 0.05 min", "all_reduce on group 'tp' (size 2",
              "global rank 0", "4194304 bytes", "aborting the job"]
    check(f"rank 1 skips an all-reduce: deadline message, non-zero exit in {took:.1f}s",
          rc not in (0, None) and took < LIMIT_S and not alive and all(w in err for w in wanted),
          f"rc={rc} alive={alive} missing={[w for w in wanted if w not in err]}\nstderr:\n{err[-3000:]}")

    print(f"{len(failures)} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
