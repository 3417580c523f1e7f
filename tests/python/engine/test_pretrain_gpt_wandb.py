"""pretrain_gpt.py's Weights & Biases logging (Megatron-LM's --wandb-* flags) with W&B offline,
read back from the run's transaction log (the run-<id>.wandb file W&B writes): every scalar
braid wrote to metrics.jsonl, under the same name at the same step and with the same value;
the parsed arguments as the run's config; the run's name, project and entity. A 2-rank job
writes one run, rank 0's, into <--save>/wandb. Megatron's argument rules, and a missing wandb
package, end every rank with one error line before training."""

import json
import math
import os
import shutil
import struct
import subprocess
import sys
import zlib

import pytest

from mpi_job import mpi_env
from pretrain_job import MODEL, REPO, SCRIPT

pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2  # noqa: E402

import braid  # noqa: E402
from braid import wandb_log  # noqa: E402
from braid.arguments import parse_args  # noqa: E402
from braid.metrics import read_metrics  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")

ITERS = ["--train-iters", "10"]


# ---- W&B's transaction log ------------------------------------------------------------------

BLOCK = 32768  # LevelDB's log framing: 32 KiB blocks of chunks
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path) -> list:
    """The wandb_internal_pb2.Record messages of a .wandb file, in order: a 7-byte header
    (b":W&B", 0xBEE1, version 0), then LevelDB's log framing, each chunk a 7-byte header (the
    CRC-32 of the type byte and the data, the length, the type) and its data; a block's tail
    shorter than a header is padding. Every checksum is checked."""
    with open(path, "rb") as f:
        data = f.read()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0), data[:7]
    records, pending, pos = [], None, 7
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:  # zeroed padding
            continue
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"{path}: bad chunk at {pos}"
        if kind in (FULL, FIRST):
            assert pending is None, f"{path}: a record starts inside another"
            pending = b""
        pending += chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = None
    assert pos == len(data) and pending is None, f"{path}: truncated"
    return records


def _items(updates) -> dict:
    return {u.key or "/".join(u.nested_key): json.loads(u.value_json) for u in updates}


def the_run(directory) -> dict:
    """The one W&B run under `directory` (wandb.init's dir): its run record's fields, its config
    (the run record's and every config update after it, W&B's own _wandb key left out), its
    history as read_metrics' {name: [(step, value)]} (W&B's _step, _runtime, ... left out) and
    whether it was finished (an exit record)."""
    runs = sorted(os.listdir(os.path.join(directory, "wandb")))
    runs = [r for r in runs if r.startswith("offline-run-")]
    assert len(runs) == 1, runs
    run_dir = os.path.join(directory, "wandb", runs[0])
    logs = [f for f in os.listdir(run_dir) if f.endswith(".wandb")]
    assert len(logs) == 1, logs
    out = {"config": {}, "history": {}, "exit_code": None}
    for record in wandb_records(os.path.join(run_dir, logs[0])):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out.update(project=record.run.project, name=record.run.display_name,
                       entity=record.run.entity)
            out["config"].update(_items(record.run.config.update))
        elif kind == "config":
            out["config"].update(_items(record.config.update))
        elif kind == "history":
            row = _items(record.history.item)
            assert row["_step"] == record.history.step.num
            for name, value in row.items():
                if not name.startswith("_"):
                    out["history"].setdefault(name, []).append((row["_step"], float(value)))
        elif kind == "exit":
            out["exit_code"] = record.exit.exit_code
    out["config"].pop("_wandb", None)
    return out


# ---- pretrain_gpt.py runs -------------------------------------------------------------------

def wandb_env(tmp, **extra) -> dict:
    """W&B offline, quiet, its settings and caches under `tmp`: nothing reaches the network."""
    env = {k: v for k, v in mpi_env(**extra).items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true",
               WANDB_CONFIG_DIR=str(tmp / "wandb-config"), WANDB_CACHE_DIR=str(tmp / "wandb-cache"),
               WANDB_DATA_DIR=str(tmp / "wandb-data"))
    return env


def pretrain(ranks: int, args: list[str], env: dict) -> subprocess.CompletedProcess:
    cmd = [sys.executable, SCRIPT, *args]
    if ranks > 1:
        cmd = ["mpirun", "-np", str(ranks), "--oversubscribe", *cmd]
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=180)


def expected_config(args: list[str]) -> dict:
    """The parsed arguments as W&B records them: JSON values as they are, the rest as str()."""
    config = {}
    for name, value in vars(parse_args(args, 1)).items():
        try:
            config[name] = json.loads(json.dumps(value))
        except TypeError:
            config[name] = str(value)
    return config


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wandb_one")
    args = [*MODEL, *ITERS, "--tensorboard-dir", str(tmp / "tb"), "--wandb-project", "p",
            "--wandb-exp-name", "e", "--wandb-save-dir", str(tmp / "wb"), "--wandb-entity", "team"]
    r = pretrain(1, args, wandb_env(tmp))
    assert r.returncode == 0, r.stdout + r.stderr
    return dict(args=args, tb=tmp / "tb", wb=tmp / "wb", run=the_run(tmp / "wb"))


def test_wandb_logs_every_scalar_of_metrics_jsonl(one_process):
    history = one_process["run"]["history"]
    metrics = read_metrics(one_process["tb"] / "metrics.jsonl")
    assert history == metrics  # every name, step and value (W&B keeps Python's doubles)
    assert [step for step, _ in history["lm loss"]] == list(range(1, 11))
    assert [step for step, _ in history["learning-rate"]] == list(range(1, 11))
    assert [step for step, _ in history["lm loss validation"]] == [10]
    for name in ("grad-norm", "loss-scale", "batch-size", "tokens-per-sec", "mfu",
                 "lm loss validation ppl"):
        assert name in history, sorted(history)


def test_wandb_run_is_named_and_configured_as_megatron_does(one_process):
    run = one_process["run"]
    assert (run["project"], run["name"], run["entity"]) == ("p", "e", "team")
    assert run["config"] == expected_config(one_process["args"])
    assert run["config"]["wandb_save_dir"] == str(one_process["wb"])
    assert run["exit_code"] == 0  # finished


def test_wandb_alone_records_every_tensorboard_log_interval(one_process, tmp_path):
    """No --tensorboard-dir: W&B alone gets the records, every --tensorboard-log-interval
    iterations, with the values of the run above (the same job, one process)."""
    r = pretrain(1, [*MODEL, *ITERS, "--tensorboard-log-interval", "2", "--wandb-project", "p",
                     "--wandb-exp-name", "alone", "--wandb-save-dir", str(tmp_path / "wb")],
                 wandb_env(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    history, full = the_run(tmp_path / "wb")["history"], one_process["run"]["history"]
    assert sorted(history) == sorted(full)
    for name in ("lm loss", "learning-rate", "grad-norm", "batch-size"):
        assert history[name] == [(s, v) for s, v in full[name] if s % 2 == 0], name
    assert history["lm loss validation"] == full["lm loss validation"]


def test_two_ranks_write_one_run_into_save_wandb(tmp_path):
    """dp 2: rank 0 alone writes; without --wandb-save-dir the run goes to <--save>/wandb,
    beside the checkpoint, which still loads."""
    ckpt, tb = tmp_path / "ckpt", tmp_path / "tb"
    r = pretrain(2, [*MODEL, *ITERS, "--eval-iters", "0", "--tensorboard-dir", str(tb), "--save",
                     str(ckpt), "--wandb-project", "p", "--wandb-exp-name", "two"],
                 wandb_env(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tp=1 pp=1 dp=2" in r.stdout
    run = the_run(ckpt / "wandb")  # exactly one offline run: rank 1 started none
    assert run["name"] == "two" and run["exit_code"] == 0
    assert run["history"] == read_metrics(tb / "metrics.jsonl")
    assert braid.latest_iteration(str(ckpt)) == 10


@pytest.mark.parametrize("extra, message", [
    (["--wandb-save-dir", "wb"], "--wandb-project needs --wandb-exp-name"),
    (["--wandb-exp-name", "e"], "--wandb-project needs --wandb-save-dir or --save"),
])
def test_megatrons_wandb_rules_end_every_rank(tmp_path, extra, message):
    r = pretrain(2, [*MODEL, *ITERS, "--wandb-project", "p", *extra], wandb_env(tmp_path))
    assert_every_rank_fails(r, message)


def test_missing_wandb_ends_every_rank_before_training(tmp_path):
    shim = tmp_path / "shim" / "wandb"  # a wandb that cannot be imported, first on the path
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'wandb'\", "
                                      "name='wandb')\n")
    r = pretrain(2, [*MODEL, *ITERS, "--wandb-project", "p", "--wandb-exp-name", "e",
                     "--wandb-save-dir", str(tmp_path / "wb")],
                 wandb_env(tmp_path, PYTHONPATH=str(tmp_path / "shim")))
    assert_every_rank_fails(r, "--wandb-project needs the wandb package, which this Python "
                               "cannot import (No module named 'wandb'): pip install wandb")
    assert not (tmp_path / "wb").exists()


def assert_every_rank_fails(r, message):
    assert r.returncode == 2, r.stdout + r.stderr
    errors = [line for line in (r.stdout + r.stderr).replace("braid: error:", "\nbraid: error:")
              .splitlines() if line.startswith("braid: error:")]
    assert len(errors) == 2 and len(set(errors)) == 1, r.stdout + r.stderr  # both ranks
    assert message in errors[0], errors[0]
    assert "iteration" not in r.stdout


def test_wandb_flags_without_a_project_do_nothing_and_say_so():
    a = parse_args([*MODEL, *ITERS, "--wandb-exp-name", "e", "--wandb-entity", "team"], 1)
    assert wandb_log.module(a) is None and wandb_log.start(None, a) is None
    assert wandb_log.notes(a) == ["braid: --wandb-exp-name has no effect without --wandb-project",
                                  "braid: --wandb-entity has no effect without --wandb-project"]
    empty = parse_args([*MODEL, *ITERS, "--wandb-project", ""], 1)  # Megatron's default: off
    assert wandb_log.module(empty) is None and wandb_log.notes(empty) == []


# ---- MetricsWriter's W&B sink -----------------------------------------------------------------

# In a process of its own: wandb.init starts a wandb-core service and names it in the process's
# environment (WANDB_SERVICE), where later tests' subprocesses would find it.
WRITER = """
import math, sys, wandb
from braid.metrics import MetricsWriter
run = wandb.init(project="p", name="writer", dir=sys.argv[1], mode="offline")
try:
    MetricsWriter(enabled=False, wandb_run=run)
    sys.exit("a disabled writer took a run")
except ValueError as e:
    assert "a disabled writer takes no wandb_run" in str(e), e
writer = MetricsWriter(jsonl_path=sys.argv[1] + "/m.jsonl", wandb_run=run)
writer.scalars(1, {"lm loss": 2.5, "batch-size": 16})
writer.scalars(1, {"lm loss validation": 2.75})  # a second call at one step: one row
writer.scalars(2, {"lm loss": math.nan, "batch-size": 16})
writer.close()
assert wandb.run is None, "close() left the run open"
print("closed")
"""


def test_metrics_writer_logs_to_the_run_and_finishes_it(tmp_path):
    r = subprocess.run([sys.executable, "-c", WRITER, str(tmp_path)], env=wandb_env(tmp_path),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["closed"], r.stdout + r.stderr
    logged = the_run(tmp_path)
    assert logged["exit_code"] == 0
    nan = logged["history"]["lm loss"].pop()
    assert nan[0] == 2 and math.isnan(nan[1])
    assert logged["history"] == {"lm loss": [(1, 2.5)], "batch-size": [(1, 16.0), (2, 16.0)],
                                 "lm loss validation": [(1, 2.75)]}
