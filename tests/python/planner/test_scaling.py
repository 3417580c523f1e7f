"""benchmarks/scaling.py: real 1- and 2-rank braid jobs, weak and strong, each step split into
compute and the waits by group. The figures themselves are not asserted (no test asserts a
time); what is: every experiment ran with the layout it names, a group of one never waits and
a group of two always does, weak pipeline scaling really doubled the model, and bad input is
refused with a clear line."""

import json
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
SCALING = os.path.join(REPO, "benchmarks", "scaling.py")

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")

SMALL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--vocab-size", "256", "--batch", "4", "--train-iters", "4"]


def scaling(*args, timeout=600):
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"))
    return subprocess.run([sys.executable, SCALING, *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scaling")
    r = scaling("--ranks", "1", "2", *SMALL, "--json", str(tmp / "rows.json"), "--trace-dir",
                str(tmp / "traces"))
    assert r.returncode == 0, r.stdout + r.stderr
    with open(tmp / "rows.json") as f:
        return r.stdout, json.load(f), tmp / "traces"


def test_every_experiment_ran_its_layout(result):
    _, doc, _ = result
    rows = {(r["experiment"], r["ranks"]): r for r in doc["rows"]}
    assert set(rows) == {("baseline", 1), ("weak dp", 2), ("weak pp", 2), ("strong dp", 2),
                         ("strong tp", 2), ("strong pp", 2), ("strong pp uneven", 2)}
    layouts = {k: (r["tp"], r["pp"], r["dp"], r["layers"], r["stages"], r["global_batch"])
               for k, r in rows.items()}
    assert layouts == {("baseline", 1): (1, 1, 1, 4, "4", 4),
                       ("weak dp", 2): (1, 1, 2, 4, "4", 8),
                       ("weak pp", 2): (1, 2, 1, 8, "4", 4),
                       ("strong dp", 2): (1, 1, 2, 4, "4", 4),
                       ("strong tp", 2): (2, 1, 1, 4, "4", 4),
                       ("strong pp", 2): (1, 2, 1, 4, "2", 4),
                       # --decoder-last-pipeline-num-layers 1: the first stage holds 3
                       ("strong pp uneven", 2): (1, 2, 1, 4, "3|1", 4)}
    assert rows[("baseline", 1)]["efficiency"] == 1.0


def test_a_group_of_one_never_waits_and_of_two_always_does(result):
    _, doc, _ = result
    for r in doc["rows"]:
        where = (r["experiment"], r["ranks"])
        assert (r["tp_comm_wait_ms"] > 0) == (r["tp"] > 1), where
        assert (r["pipeline_wait_ms"] > 0) == (r["pp"] > 1), where
        assert (r["dp_comm_wait_ms"] > 0) == (r["dp"] > 1), where
        assert (r["bubble_schedule_ms"] > 0) == (r["pp"] > 1), where
        assert r["compute_ms"] > 0, where


def test_weak_scaling_grows_the_work_strong_scaling_keeps_it(result):
    _, doc, _ = result
    rows = {(r["experiment"], r["ranks"]): r for r in doc["rows"]}

    def flops_per_token(r):
        return r["model_flops_per_s"] / r["tokens_per_s"]

    base = flops_per_token(rows[("baseline", 1)])
    for name in ("weak dp", "strong dp", "strong tp", "strong pp", "strong pp uneven"):
        assert flops_per_token(rows[(name, 2)]) == pytest.approx(base, rel=1e-12), name
    # Twice the layers: the layers' share of the FLOPs doubles, the embedding and head's not.
    assert 1.3 * base < flops_per_token(rows[("weak pp", 2)]) < 2 * base


def test_the_table_names_the_machine_and_the_summary(result):
    out, doc, _ = result
    assert f"braid scaling: cpu, {doc['cores']} cores" in out
    assert "weak scaling at 2 ranks: best" in out and "strong scaling at 2 ranks: best" in out
    rows = [line for line in out.splitlines() if line.startswith(("baseline", "weak", "strong"))
            and "%" in line and " scaling at " not in line]
    assert len(rows) == 7, out


@pytest.mark.parametrize("args, message", [
    (["--train-iters", "3"], "--train-iters must be even and >= 2, got 3"),
    (["--ranks", "0"], "--ranks must be >= 1"),
    (["--device", "cuda", "--ranks", "1", "64"], "need one GPU each"),
])
def test_bad_input_is_refused(args, message):
    r = scaling(*args, timeout=60)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr


def test_every_rank_of_every_run_left_its_timeline(result):
    _, doc, traces = result
    for r in doc["rows"]:
        run = traces / f"{r['experiment'].replace(' ', '_')}_{r['ranks']}" / "traces"
        assert sorted(os.listdir(run)) == [f"rank{i}.json" for i in range(r["ranks"])], run
        with open(run / "rank0.json") as f:
            events = json.load(f)["traceEvents"]
        # The first two measured iterations: 3 and 4 of the 4 (the second half).
        assert len([e for e in events if e.get("cat") == "step"]) == 2, run
