"""The demo's Megatron checkpoint flags as real MPI jobs (--save, --load, --save-interval,
--exit-interval, SIGTERM): a 3D run (tp 2, pp 2, dp 2, ZeRO) that exits at iteration 10 and is
relaunched with --load prints, for iterations 11..20, exactly the losses of an uninterrupted run;
the same checkpoint loaded in one process or at tp 1 pp 2 dp 2 continues within 1e-4; SIGTERM
mid-run saves and exits 0; a checkpoint flag without --save/--load is one error line."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from mpi_job import mpi_env

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
        "--lr-warmup-iters", "4", "--eval-problems", "16", "--distributed-timeout-minutes", "1",
        "--micro-batch-size", "4", "--global-batch-size", "16", "--log-interval", "1"]
LAYOUT_3D = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
             "--use-distributed-optimizer"]


def demo_command(ranks: int, args: list[str]) -> list[str]:
    demo = [sys.executable, "-m", "braid.demo", *TINY, *args]
    return ["mpirun", "-np", str(ranks), "--oversubscribe", *demo] if ranks > 1 else demo


demo_env = mpi_env


def run_demo(ranks: int, args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(demo_command(ranks, args), env=demo_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def losses(stdout: str) -> dict[int, str]:
    """{iteration: the loss as printed} from rank 0's step lines."""
    return {int(m.group(1)): m.group(2) for m in
            re.finditer(r"^step +(\d+)/\d+ \| loss ([0-9.e+-]+) \|", stdout, re.MULTILINE)}


def latest_iteration(directory: str) -> int:
    with open(os.path.join(directory, "latest_checkpointed_iteration.txt")) as f:
        return int(f.read().strip())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted 20-iteration 3D run, and one that exits at 10 with a checkpoint."""
    tmp = tmp_path_factory.mktemp("demo_ckpt")
    data = ["--data-cache-path", str(tmp / "data")]
    full = run_demo(8, [*LAYOUT_3D, "--train-iters", "20", *data])
    assert full.returncode == 0, full.stdout + full.stderr
    ckpt = str(tmp / "ckpt")
    first = run_demo(8, [*LAYOUT_3D, "--train-iters", "20", "--save", ckpt, "--save-interval",
                         "10", "--exit-interval", "10", *data])
    return dict(tmp=tmp, data=data, ckpt=ckpt, full=full, first=first)


def test_exit_interval_saves_and_exits_0(runs):
    first = runs["first"]
    assert first.returncode == 0, first.stdout + first.stderr
    assert sorted(losses(first.stdout)) == list(range(1, 11)), first.stdout
    assert (f"demo: exiting at iteration 10 (--exit-interval); checkpoint saved to {runs['ckpt']}"
            in first.stdout.splitlines()), first.stdout
    assert "demo: accuracy=" not in first.stdout
    assert latest_iteration(runs["ckpt"]) == 10
    # The first 10 iterations are the uninterrupted run's.
    full = losses(runs["full"].stdout)
    assert losses(first.stdout) == {i: full[i] for i in range(1, 11)}


def test_3d_resume_is_bit_exact(runs):
    r = run_demo(8, [*LAYOUT_3D, "--train-iters", "20", "--load", runs["ckpt"], *runs["data"]])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "demo: loaded iteration 10" in r.stdout, r.stdout
    full = losses(runs["full"].stdout)
    resumed = losses(r.stdout)
    assert sorted(resumed) == list(range(11, 21)), r.stdout
    assert resumed == {i: full[i] for i in range(11, 21)}, (resumed, full)
    assert "demo: accuracy=" in r.stdout


@pytest.mark.parametrize("ranks,layout", [(1, []), (4, ["--pipeline-model-parallel-size", "2"])],
                         ids=["1-process", "tp1-pp2-dp2"])
def test_resume_under_another_layout(runs, ranks, layout):
    r = run_demo(ranks, [*layout, "--train-iters", "20", "--load", runs["ckpt"], *runs["data"]])
    assert r.returncode == 0, r.stdout + r.stderr
    full = losses(runs["full"].stdout)
    resumed = losses(r.stdout)
    assert sorted(resumed) == list(range(11, 21)), r.stdout
    for i in range(11, 21):
        assert float(resumed[i]) == pytest.approx(float(full[i]), rel=1e-4), (i, resumed, full)


def rank_pids(marker: str) -> list[int]:
    """The demo's rank processes: python processes whose command line holds `marker`."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"braid.demo" in argv and marker.encode() in argv and b"mpirun" not in argv[0]:
            pids.append(int(entry))
    return pids


def test_sigterm_saves_and_exits_0(runs):
    ckpt = str(runs["tmp"] / "sigterm")
    proc = subprocess.Popen(demo_command(8, [*LAYOUT_3D, "--train-iters", "2000", "--save", ckpt,
                                             *runs["data"]]),
                            env=demo_env(), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 90
        for line in proc.stdout:  # wait until training runs (the handlers are installed)
            lines.append(line)
            if line.startswith("step     3/") or time.monotonic() > deadline:
                break
        pids = rank_pids(ckpt)
        assert len(pids) == 8, (pids, "".join(lines))
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines) + out
    assert proc.returncode == 0, out + err
    exits = [line for line in out.splitlines() if line.startswith("demo: exiting at iteration")]
    assert len(exits) == 1 and exits[0].endswith(f"(SIGTERM); checkpoint saved to {ckpt}"), out
    stopped = int(exits[0].split()[4])
    assert 3 <= stopped < 2000 and latest_iteration(ckpt) == stopped
    # Loadable: one process resumes from it and trains one more iteration.
    r = run_demo(1, ["--train-iters", "2000", "--load", ckpt, "--exit-interval", str(stopped + 1),
                     *runs["data"]])
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"demo: loaded iteration {stopped} from {ckpt}" in r.stdout, r.stdout
    assert sorted(losses(r.stdout)) == [stopped + 1], r.stdout


def test_checkpoint_flag_without_dir_is_one_error_line(tmp_path):
    r = run_demo(4, ["--save-interval", "10", "--train-iters", "5",
                     "--data-cache-path", str(tmp_path)], timeout=60)
    assert r.returncode == 2
    errors = [line for line in (r.stdout + r.stderr).replace("braid: error:", "\nbraid: error:")
              .splitlines() if line.startswith("braid: error:")]
    # Every rank prints the same line (mpirun may end the others before they do).
    assert set(errors) == {"braid: error: --save-interval needs --save DIR"}, r.stdout + r.stderr


def test_async_save_and_ckpt_step(runs):
    # --load and --save the same directory, as a job script resubmitted would: nothing there yet.
    ckpt = str(runs["tmp"] / "async")
    r = run_demo(8, [*LAYOUT_3D, "--train-iters", "20", "--save", ckpt, "--load", ckpt,
                     "--async-save", "--save-interval", "5", "--exit-interval", "12",
                     *runs["data"]])
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"demo: no checkpoint in {ckpt} yet; training from scratch" in r.stdout, r.stdout
    assert f"demo: exiting at iteration 12 (--exit-interval); checkpoint saved to {ckpt}" in r.stdout
    assert latest_iteration(ckpt) == 12
    assert sorted(d for d in os.listdir(ckpt) if d.startswith("iter_")) == [
        "iter_0000005", "iter_0000010", "iter_0000012"]
    # --ckpt-step picks an older one; the run continues from it exactly.
    r = run_demo(8, [*LAYOUT_3D, "--train-iters", "20", "--load", ckpt, "--ckpt-step", "10",
                     *runs["data"]])
    assert r.returncode == 0, r.stdout + r.stderr
    full = losses(runs["full"].stdout)
    assert losses(r.stdout) == {i: full[i] for i in range(11, 21)}, r.stdout
