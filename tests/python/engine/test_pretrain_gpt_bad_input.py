"""pretrain_gpt.py on bad input a user makes by mistake: one line "braid: error: ...", exit code
2, no traceback, and nothing already saved overwritten. (The 4-rank cases of wrong arguments are
in test_pretrain_gpt.py.)"""

import hashlib
import json
import os
import signal
import subprocess
import sys

import pytest

from mpi_job import mpi_env
from pretrain_job import REPO, SCRIPT, run, write_documents

TINY = ["--device", "cpu", "--mock-data", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-2", "--vocab-size",
        "128", "--eval-iters", "0", "--train-iters", "3"]


def clean_error(r, message):
    out = r.stdout + r.stderr
    assert r.returncode == 2 and f"braid: error: {message}" in r.stderr, out
    assert "Traceback" not in out, out


def digest(directory):
    """The bytes of every file under `directory`, as one hash (not the lock file a job's rank 0
    writes its pid and host into)."""
    h = hashlib.sha256()
    for root, _, files in sorted(os.walk(directory)):
        for name in sorted(set(files) - {".braid-save.lock"}):
            h.update(name.encode())
            with open(os.path.join(root, name), "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def test_a_save_directory_holding_another_checkpoint_is_left_alone(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    assert run(1, [*TINY, "--save", ckpt, "--save-interval", "3"]).returncode == 0
    before = digest(ckpt)
    # A second run saving there without continuing it would overwrite its iterations.
    r = run(1, [*TINY, "--lr", "5e-2", "--save", ckpt, "--save-interval", "1"])
    clean_error(r, f"--save {ckpt} holds a checkpoint (iteration 3) that this run does not "
                f"load, and its saves would overwrite it: pass --load {ckpt} to continue it")
    assert " iteration " not in r.stdout and digest(ckpt) == before
    # Continuing it is what --load does.
    r = run(1, [*TINY, "--train-iters", "4", "--load", ckpt, "--save", ckpt,
                "--override-opt_param-scheduler"])
    assert r.returncode == 0 and "loaded iteration 3" in r.stdout, r.stdout + r.stderr


def test_a_launcher_that_disagrees_with_mpi_is_one_line():
    # torchrun's variables without MPI behind them: MPI sees one process, not rank 3 of 8 (it
    # was a traceback from pretrain_gpt.py, one line from the demo).
    r = subprocess.run([sys.executable, SCRIPT, *TINY, "--global-batch-size", "16"], cwd=REPO,
                       capture_output=True, text=True, timeout=120,
                       env={**mpi_env(), "RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3"})
    clean_error(r, "launch (torchrun): the environment says rank 3 of 8 but MPI sees rank 0 of "
                "1: braid connects its processes through MPI")


def test_a_save_directory_another_job_holds_is_refused(tmp_path):
    # Two jobs saving to one directory overwrite each other's iterations (the second passes the
    # check for a checkpoint there while the first has saved none yet). A job's rank 0 holds an
    # flock on DIR/.braid-save.lock - here this process, as another job would - and a second
    # job stops on every rank before training.
    import fcntl
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    with open(ckpt / ".braid-save.lock", "w", encoding="utf-8") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("pid 12345 on otherhost\n")
        held.flush()
        for ranks in (1, 2):
            r = run(ranks, [*TINY, "--save", str(ckpt)])
            clean_error(r, f"--save {ckpt} is in use by another job (pid 12345 on otherhost): "
                        "two jobs saving to one directory overwrite each other's checkpoints")
            assert " iteration " not in r.stdout
    assert not any(name.startswith("iter_") for name in os.listdir(ckpt))
    # The other job ended (its lock with it): this one saves there, and names itself.
    r = run(1, [*TINY, "--save", str(ckpt)])
    assert r.returncode == 0 and os.path.isdir(ckpt / "iter_0000003"), r.stdout + r.stderr
    assert (ckpt / ".braid-save.lock").read_text().startswith("pid ")


def test_a_save_directory_that_cannot_be_written_stops_before_training(tmp_path):
    (tmp_path / "file").write_text("")
    r = run(1, [*TINY, "--save", str(tmp_path / "file" / "ckpt")])
    clean_error(r, f"--save {tmp_path / 'file' / 'ckpt'}: cannot create the directory")
    assert " iteration " not in r.stdout


def test_an_optimizer_setting_out_of_range_is_one_line():
    clean_error(run(1, [*TINY, "--lr", "inf"]), "AdamWConfig.lr (--lr) must be finite and >= 0")


def test_a_checkpoint_whose_metadata_is_not_an_object_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert run(1, [*TINY, "--save", str(ckpt), "--save-interval", "3"]).returncode == 0
    (ckpt / "iter_0000003" / "metadata.json").write_text("[]\n")
    clean_error(run(1, [*TINY, "--train-iters", "4", "--load", str(ckpt)]),
                f"checkpoint: {ckpt / 'iter_0000003' / 'metadata.json'} holds array, not a JSON "
                "object")


def test_tokens_past_the_vocabulary_end_the_run_with_one_line(tmp_path):
    prefix = str(tmp_path / "docs")
    write_documents(prefix, 40, high=200, seed=3)
    args = [a for a in TINY if a != "--mock-data"]
    clean_error(run(1, [*args, "--data-path", prefix, "--split", "100,0,0"]),
                "iteration 1: ")


def test_ctrl_c_ends_the_run_without_a_traceback_and_keeps_its_checkpoints(tmp_path):
    ckpt = tmp_path / "ckpt"
    args = [*TINY, "--train-iters", "100000", "--save", str(ckpt), "--save-interval", "2",
            "--log-interval", "1"]
    p = subprocess.Popen([sys.executable, SCRIPT, *args], env=mpi_env(), cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in p.stdout:  # past the first save
            if " iteration        3/" in line:
                break
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130 and "braid: interrupted" in err, out + err
    assert "Traceback" not in err, err
    tracker = (ckpt / "latest_checkpointed_iteration.txt").read_text().strip()
    r = run(1, [*TINY, "--train-iters", str(int(tracker) + 1), "--load", str(ckpt),
                "--override-opt_param-scheduler"])
    assert r.returncode == 0 and f"loaded iteration {tracker}" in r.stdout, r.stdout + r.stderr


def test_ctrl_c_on_one_rank_ends_the_whole_job(tmp_path):
    # SIGINT to rank 1 alone: it used to return 130 and then wait in MPI_Finalize while rank 0
    # waited in its next collective, until --distributed-timeout-minutes. Now it ends the job.
    ckpt = tmp_path / "ckpt"
    args = [*TINY, "--train-iters", "100000", "--save", str(ckpt), "--log-interval", "1",
            "--distributed-timeout-minutes", "5"]
    p = subprocess.Popen(["mpirun", "-np", "2", "--oversubscribe", sys.executable, SCRIPT, *args],
                         env=mpi_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        for line in p.stdout:  # training runs
            if " iteration        3/" in line:
                break
        ranks = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if SCRIPT.encode() in argv and str(ckpt).encode() in argv and \
                    b"mpirun" not in argv[0]:
                ranks.append(int(entry))
        assert len(ranks) == 2, ranks
        os.kill(max(ranks), signal.SIGINT)
        out, err = p.communicate(timeout=90)  # not the 5 minutes of a collective's deadline
    finally:
        p.kill()
    assert p.returncode != 0 and "braid: interrupted" in err, out + err
    assert "did not complete within" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("layout, message", [
    ({"iter_0000003/metadata.json": "{}"}, "is one iteration's folder of a braid checkpoint: "
     "give the directory holding it"),
    ({"latest_checkpointed_iteration.txt": "3", "iter_0000003/common.pt": "",
      "iter_0000003/metadata.json": "{}"}, "holds a Megatron-LM checkpoint; convert it first: "
     "tools/convert_megatron.py import"),
    ({"mp_rank_00/model_optim_rng.pt": ""}, "holds a Megatron-LM checkpoint"),
    ({"config.json": "{}", "model.safetensors": ""}, "holds a Hugging Face model; convert it "
     "first: tools/convert_hf.py import"),
])
def test_load_of_something_else_than_a_braid_checkpoint_says_what_it_is(tmp_path, layout,
                                                                          message):
    for name, text in layout.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    load = tmp_path / "iter_0000003" if "iter_0000003/metadata.json" in layout and \
        len(layout) == 1 else tmp_path
    r = run(1, [*TINY, "--load", str(load)])
    clean_error(r, f"--load {load} {message}")
    assert " iteration " not in r.stdout
    (tmp_path / "file").write_text("")
    clean_error(run(1, [*TINY, "--load", str(tmp_path / "file")]),
                f"--load {tmp_path / 'file'} is a file, not a checkpoint directory")


def test_an_error_one_rank_finds_ends_every_rank(tmp_path):
    # An error some ranks meet alone ends the job at once (MPI_Abort) rather than leaving the
    # others in their next collective for --distributed-timeout-minutes (10 here: a wait would
    # outlast the test's 120 s).
    prefix = str(tmp_path / "docs")
    write_documents(prefix, 40, high=200, seed=3)
    data = [*(a for a in TINY if a != "--mock-data"), "--data-path", prefix,
            "--distributed-timeout-minutes", "10"]
    # Tokens past the vocabulary (128) reach the first pipeline stage; the last waits for it.
    r = run(2, [*data, "--split", "100,0,0", "--pipeline-model-parallel-size", "2"], timeout=120)
    assert r.returncode != 0 and "braid: error: iteration 1: GPTModel: token id" in r.stderr \
        and "(sample 0 of the microbatch, position " in r.stderr, \
        r.stdout + r.stderr
    # Rank 0 builds the datasets while the other waits: a validation split without documents
    # is met by both ranks (rank 0's error held past the barrier), each saying so.
    r = run(2, [*data, "--vocab-size", "256", "--split", "99,1,0", "--eval-iters", "1"],
            timeout=120)
    assert r.returncode == 2 and r.stderr.count("the valid split has no documents") == 2, \
        r.stdout + r.stderr


@pytest.mark.parametrize("split, message", [
    ("0,50,50", "--split 0,50,50 leaves no documents to train on"),
    ("abc", '--split "abc": expected one to three weights'),
])
def test_a_split_without_training_documents_is_an_argument_error(tmp_path, split, message):
    prefix = str(tmp_path / "docs")
    write_documents(prefix, 40, high=100, seed=3)
    args = [a for a in TINY if a != "--mock-data"]
    clean_error(run(1, [*args, "--data-path", prefix, "--split", split]), message)


def test_iterations_without_a_tracker_are_not_trained_over(tmp_path):
    # A first save stopped between its folder's rename and the tracker's write: neither a run
    # loading the directory nor one saving there starts from scratch over those iterations.
    ckpt = tmp_path / "ckpt"
    assert run(1, [*TINY, "--save", str(ckpt), "--save-interval", "1"]).returncode == 0
    (ckpt / "latest_checkpointed_iteration.txt").unlink()
    before = digest(ckpt)
    held = "iter_0000001, iter_0000002 and iter_0000003 but no latest_checkpointed_iteration.txt"
    clean_error(run(1, [*TINY, "--load", str(ckpt), "--save", str(ckpt)]),
                f"--load {ckpt} holds {held}")
    clean_error(run(1, [*TINY, "--save", str(ckpt)]), f"--save {ckpt} holds {held}")
    assert digest(ckpt) == before
    r = run(1, [*TINY, "--train-iters", "4", "--load", str(ckpt), "--ckpt-step", "3",
                "--save", str(ckpt), "--override-opt_param-scheduler"])
    assert r.returncode == 0 and "loaded iteration 3" in r.stdout, r.stdout + r.stderr


def test_a_damaged_tracker_is_named(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert run(1, [*TINY, "--save", str(ckpt), "--save-interval", "3"]).returncode == 0
    for text in (b"garbage\n", b"\xff\xfe", "\u00b2".encode()):  # "²" is a digit to str.isdigit
        (ckpt / "latest_checkpointed_iteration.txt").write_bytes(text)
        clean_error(run(1, [*TINY, "--train-iters", "4", "--load", str(ckpt)]),
                    f"--load {ckpt}: its latest_checkpointed_iteration.txt should hold an "
                    "iteration number")
        clean_error(run(1, [*TINY, "--save", str(ckpt)]), f"--save {ckpt} holds a checkpoint")


def test_another_global_batch_is_another_learning_rate_schedule(tmp_path):
    # Megatron keeps the warmup and decay in samples and refuses a resume whose batch changes
    # them; braid did not, and rewound the learning rate (4 iterations of 4 samples, resumed with
    # 8 a step: 2 iterations' worth of samples done, so the decay went back to its middle).
    ckpt = tmp_path / "ckpt"
    run4 = [*TINY, "--train-iters", "4"]
    assert run(1, [*run4, "--save", str(ckpt), "--exit-interval", "2"]).returncode == 0
    clean_error(run(1, [*run4, "--global-batch-size", "8", "--load", str(ckpt)]),
                "the learning-rate schedule differs from the checkpoint's: the decay in samples: "
                "4 iterations x global batch 8 = 32 (the checkpoint: 4 x 4 = 16)")
    r = run(1, [*run4, "--global-batch-size", "8", "--load", str(ckpt),
                "--override-opt_param-scheduler"])
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_full_metrics_disk_warns_and_training_goes_on(tmp_path):
    # A full disk under --tensorboard-dir used to end the run with a traceback, before its next
    # save. Here a file-size limit of 4 MiB (MPI's start-up needs files that large) and a
    # metrics.jsonl 2 KiB short of it, which a resumed job appends to: a few iterations fill it.
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20))
    (tmp_path / "tb").mkdir()
    line = json.dumps({"step": 0, "padding": "x" * 1000}) + "\n"
    (tmp_path / "tb" / "metrics.jsonl").write_text(line * ((4 << 20) // len(line) - 2))
    r = subprocess.run([sys.executable, SCRIPT, *TINY, "--train-iters", "30", "--log-interval",
                        "10", "--tensorboard-dir", str(tmp_path / "tb")], env=mpi_env(),
                       cwd=REPO, capture_output=True, text=True, timeout=180, preexec_fn=limit)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stderr.count("braid: warning: writing the metrics at step ") == 1, r.stderr
    assert "File too large" in r.stderr and "training goes on" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "braid: trained 30 iterations" in r.stdout, r.stdout


def test_a_save_that_fails_keeps_the_committed_checkpoints(tmp_path):
    # A full disk, as a file-size limit (RLIMIT_FSIZE; Python ignores SIGXFSZ, so the write
    # fails with EFBIG): the run ends with one line, the checkpoint committed before intact.
    import resource
    ckpt = tmp_path / "ckpt"
    wide = [*TINY, "--hidden-size", "256", "--train-iters", "5"]  # a checkpoint of ~19 MB
    assert run(1, [*wide, "--save", str(ckpt), "--exit-interval", "3"]).returncode == 0
    before = digest(ckpt)

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20))
    r = subprocess.run([sys.executable, SCRIPT, *wide, "--load", str(ckpt),
                        "--save", str(ckpt), "--save-interval", "1"], env=mpi_env(), cwd=REPO,
                       capture_output=True, text=True, timeout=180, preexec_fn=limit)
    clean_error(r, f"saving a checkpoint to {ckpt}: safetensors: writing ")
    assert "File too large" in r.stderr and "the checkpoints committed before stay" in r.stderr
    assert digest(ckpt) == before and sorted(os.listdir(ckpt)) == [
        ".braid-save.lock", "iter_0000003", "latest_checkpointed_iteration.txt"]
