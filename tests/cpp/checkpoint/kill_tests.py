"""Leaving a run: a save killed at any moment leaves the previous checkpoint intact and the
tracker naming a complete one; SIGTERM, SIGUSR1, --exit-interval and --exit-duration-in-mins
end the job with a saved checkpoint and exit 0.

Runs tests/cpp/checkpoint/ckpt_kill_driver (2 ranks, ZeRO, a save after every step) under
mpirun, SIGKILLs the whole job (mpirun and both ranks) at a spread of moments after a save
has begun, then checks that:
  - a fresh job loads the latest checkpoint (every file and tensor present and valid), and the
    iteration it names never goes backwards;
  - at least one kill landed inside a save (it left a temporary directory behind);
  - a resumed job trains on from there and its own saves clear the temporaries.
Stdlib only, so it also runs in the sanitizer build.
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

failures = []


def check(name, ok, detail=""):
    print(f"{'ok  ' if ok else 'FAIL'} {name}" + ("" if ok else f"\n{detail}"), flush=True)
    if not ok:
        failures.append(name)


def temporaries(directory):
    return [n for n in os.listdir(directory) if ".tmp-" in n]


def alive(marker):
    """PIDs of this job's processes (mpirun and its ranks: the marker is in their command line)."""
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split() if int(pid) != os.getpid()]


def kill_during_save(args, directory, saves_before, delay_s):
    """Starts a training job, waits until `saves_before` saves have completed and the next has
    begun, sleeps `delay_s`, and SIGKILLs every process of the job at once - mpirun and each
    rank (mpirun gives its ranks process groups of their own, so killing its group would leave
    them running). Returns the processes still alive 10 s later (none expected)."""
    marker = tempfile.mktemp(prefix="braid-kill-")
    cmd = [args.mpiexec, "-np", "2", "--oversubscribe", args.driver, "--dir", directory,
           "--steps", "1000000", "--marker", marker]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    started = 0
    try:
        deadline = time.monotonic() + 120
        for line in p.stdout:
            if line.startswith("saving"):
                started += 1
                if started > saves_before:
                    time.sleep(delay_s)
                    break
            if time.monotonic() > deadline:
                break
    finally:
        for pid in alive(marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait()
    for _ in range(100):
        if not alive(marker):
            break
        time.sleep(0.1)
    return alive(marker)


def verify(args, directory):
    cmd = [args.mpiexec, "-np", "2", "--oversubscribe", args.driver, "--dir", directory, "--verify"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    loaded = [int(l.split()[1]) for l in p.stdout.splitlines() if l.startswith("loaded")]
    return p.returncode, (loaded[0] if loaded else None), p.stdout + p.stderr


def leave_early(args, directory, extra, signal_to=None, wait_for_step=3):
    """Runs the driver (saving only when leaving) with `extra` flags; with `signal_to`
    ("ranks": SIGTERM to each rank, as Slurm does; "mpirun": SIGUSR1 to mpirun, which forwards
    it), sends the signal once it has printed `step <wait_for_step>`. Returns (exit code, the
    iteration it said it left at, the reason, output)."""
    marker = tempfile.mktemp(prefix="braid-exit-")
    cmd = [args.mpiexec, "-np", "2", "--oversubscribe", args.driver, "--dir", directory,
           "--steps", "1000000", "--save-interval", "0", *extra, "--marker", marker]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    out = []
    try:
        for line in p.stdout:
            out.append(line)
            if signal_to and line.strip() == f"step {wait_for_step}":
                if signal_to == "ranks":
                    pids = subprocess.run(["pgrep", "-f", f"{args.driver} .*{marker}"],
                                          capture_output=True, text=True).stdout.split()
                    for pid in pids:
                        if int(pid) != p.pid:
                            os.kill(int(pid), signal.SIGTERM)
                else:
                    os.kill(p.pid, signal.SIGUSR1)
        rc = p.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        return None, None, "", "".join(out) + "hung"
    text = "".join(out) + p.stderr.read()
    left = [l for l in out if l.startswith("exiting at")]
    if not left:
        return rc, None, "", text
    words = left[0].split()
    return rc, int(words[2].rstrip(":")), " ".join(words[3:]), text


def check_leaving(args):
    for name, extra, signal_to, want_reason in [
        ("SIGTERM to every rank", [], "ranks", "SIGTERM"),
        ("SIGUSR1 to mpirun", [], "mpirun", "SIGUSR1"),
        ("--exit-interval 4", ["--exit-interval", "4"], None, "--exit-interval"),
        ("--exit-duration-in-mins 0.01", ["--exit-duration-in-mins", "0.01"], None,
         "--exit-duration-in-mins"),
        ("SIGTERM with --async-save", ["--async-save"], "ranks", "SIGTERM"),
    ]:
        directory = tempfile.mkdtemp(prefix="braid_exit_")
        try:
            rc, left_at, reason, out = leave_early(args, directory, extra, signal_to)
            check(f"{name}: the job saves and exits 0 ({reason} at {left_at})",
                  rc == 0 and reason == want_reason and left_at is not None, out)
            if want_reason == "--exit-interval":
                check("  after exactly 4 iterations", left_at == 4, out)
            rc, loaded, out = verify(args, directory)
            check(f"  and the checkpoint it saved loads at {left_at}",
                  rc == 0 and loaded == left_at, out)
        finally:
            shutil.rmtree(directory, ignore_errors=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--driver", required=True)
    parser.add_argument("--mpiexec", required=True)
    args = parser.parse_args()
    check_leaving(args)
    directory = tempfile.mkdtemp(prefix="braid_kill_save_")
    try:
        last, mid_save = -1, 0
        # From the first save's start (no checkpoint yet) to late in a later one.
        for saves_before, delay in [(0, 0.0), (0, 0.05), (1, 0.0), (1, 0.02), (2, 0.1),
                                    (1, 0.2), (2, 0.005), (1, 0.5)]:
            left = kill_during_save(args, directory, saves_before, delay)
            check(f"SIGKILL {delay:.3f}s into save {saves_before + 1}: no process left", not left,
                  str(left))
            mid_save += bool(temporaries(directory))
            rc, loaded, out = verify(args, directory)
            if last < 0 and loaded is None and rc == 0:
                continue  # killed before any save completed: nothing to load yet
            check(f"after a kill {delay:.3f}s into save {saves_before + 1}: the latest "
                  f"checkpoint loads", rc == 0 and loaded is not None, out)
            check(f"  and its iteration ({loaded}) is not before the last one ({last})",
                  loaded is not None and loaded >= last, out)
            last = loaded if loaded is not None else last
        check(f"kills inside a save: {mid_save} of 8 left a temporary directory", mid_save > 0)
        p = subprocess.run([args.mpiexec, "-np", "2", "--oversubscribe", args.driver, "--dir",
                            directory, "--steps", str(last + 2)],
                           capture_output=True, text=True, timeout=300)
        check("a resumed job trains on from the latest checkpoint",
              p.returncode == 0 and f"resumed {last}" in p.stdout, p.stdout + p.stderr)
        check("and its saves removed the temporaries", not temporaries(directory),
              str(temporaries(directory)))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    if failures:
        print(f"{len(failures)} check(s) failed: {failures}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
