"""pretrain_gpt.py as the engine tests run it: the model and layout they train, a job of N
MPI ranks, the metrics it writes, and the one-process run every layout must match."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from mpi_job import mpi_env

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
SCRIPT = os.path.join(REPO, "pretrain_gpt.py")

# On the CPU ranks even where a GPU is visible (BRAID_TEST_DEVICE=cuda): 8 ranks cannot share
# one GPU under NCCL.
MODEL = ["--device", "cpu", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--group-query-attention", "--num-query-groups", "2", "--swiglu",
         "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--hidden-dropout", "0",
         "--attention-dropout", "0",
         "--mock-data", "--vocab-size", "300", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "16", "--lr", "3e-3",
         "--lr-warmup-iters", "3", "--distributed-timeout-minutes", "1", "--log-interval", "5",
         "--eval-interval", "10", "--eval-iters", "2"]
LAYOUT_3D = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
             "--sequence-parallel", "--use-distributed-optimizer", "--overlap-grad-reduce"]


def write_documents(prefix: str, documents: int, high: int, seed: int) -> int:
    """A Megatron .bin/.idx dataset at `prefix` of `documents` random documents of 20 to 79
    tokens below `high` (u16), from `seed`; returns its token count."""
    sys.path.insert(0, os.path.join(REPO, "python"))
    from braid.data import IndexedDatasetWriter
    rng = np.random.default_rng(seed)
    tokens = 0
    with IndexedDatasetWriter(prefix, "u16") as w:
        for _ in range(documents):
            doc = rng.integers(0, high, size=int(rng.integers(20, 80)), dtype=np.int32)
            w.add_document(doc)
            tokens += len(doc)
    return tokens


def save_metadata(directory, config: dict, iteration: int = 5) -> None:
    """A checkpoint directory whose iteration holds only a metadata.json of `config` (what
    --use-checkpoint-args reads)."""
    path = os.path.join(str(directory), f"iter_{iteration:07d}")
    os.makedirs(path)
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump({"config": config}, f)
    with open(os.path.join(str(directory), "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))


def run(ranks: int, args: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    cmd = [sys.executable, SCRIPT, *args]
    if ranks > 1:
        cmd = ["mpirun", "-np", str(ranks), "--oversubscribe", *cmd]
    return subprocess.run(cmd, env=mpi_env(), cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["lm loss"] for r in records if "lm loss" in r}


def validation(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["lm loss validation"] for r in records if "lm loss validation" in r}


def balancing(records: list[dict]) -> dict[int, float]:
    """The load-balancing loss by step, under either of Megatron's names (seq_aux_loss's is
    seq_load_balancing_loss)."""
    return {r["step"]: r[key] for r in records
            for key in ("load_balancing_loss", "seq_load_balancing_loss") if key in r}


def log_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if re.search(r"\] iteration +\d+/", line)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The same 20 iterations in one process: every layout must train alike."""
    tb = str(tmp_path_factory.mktemp("one_process") / "tb")
    r = run(1, [*MODEL, "--train-iters", "20", "--tensorboard-dir", tb, "--log-params-norm"])
    assert r.returncode == 0, r.stdout + r.stderr
    return jsonl(os.path.join(tb, "metrics.jsonl"))


def assert_trains_alike(records, one_process):
    one, got = losses(one_process), losses(records)
    assert sorted(one) == sorted(got) == list(range(1, 21))
    np.testing.assert_allclose([got[i] for i in range(1, 21)], [one[i] for i in range(1, 21)],
                               rtol=2e-4)
    one_valid, got_valid = validation(one_process), validation(records)
    assert one_valid.keys() == got_valid.keys() == {10, 20}
    for step in one_valid:
        assert got_valid[step] == pytest.approx(one_valid[step], rel=2e-4)


def run_layouts(tmp_path, args: list[str], layouts, timeout: float = 180
                ) -> tuple[dict[str, list[dict]], dict[str, str]]:
    """pretrain_gpt.py with `args`, 20 iterations without evaluation, once per (name, ranks,
    extra args) of `layouts`, each writing its metrics under tmp_path / name: the metrics and
    the stdout of each run, by name."""
    runs, stdout = {}, {}
    for name, ranks, extra in layouts:
        tb = str(tmp_path / name)
        r = run(ranks, [*args, *extra, "--train-iters", "20", "--eval-iters", "0",
                        "--tensorboard-dir", tb], timeout=timeout)
        assert r.returncode == 0, r.stdout + r.stderr
        runs[name] = jsonl(os.path.join(tb, "metrics.jsonl"))
        stdout[name] = r.stdout
    return runs, stdout


def assert_moe_layouts_train_alike(runs, steps):
    """Of run_layouts' `runs`, the one-process run "one" logs the lm loss of steps 1 to 20, and
    each run `name` of `steps` that of exactly steps[name], where its lm loss and load-balancing
    loss are the one-process run's (rtol 1e-5)."""
    one = runs["one"]
    assert sorted(losses(one)) == list(range(1, 21))
    for name, its_steps in steps.items():
        assert sorted(losses(runs[name])) == list(its_steps), name
        for metric in (losses, balancing):
            got, want = metric(runs[name]), metric(one)
            np.testing.assert_allclose([got[i] for i in its_steps],
                                       [want[i] for i in its_steps], rtol=1e-5, err_msg=name)


def assert_generate_decodes_greedily(ckpt, config: dict) -> None:
    """tools/generate.py decodes the checkpoint (its model `config`) over its KV cache: greedily,
    the ids the whole sequence's logits give one position at a time."""
    import braid
    from braid.generate import config_from_metadata

    model = braid.GPTModel(config_from_metadata(config))
    braid.load_parameters(ckpt, model)
    ids = [5, 17, 42, 7]
    for _ in range(6):
        logits = np.asarray(model.logits(np.array([ids], dtype=np.int32)))
        ids.append(int(logits[0, -1].argmax()))
    r = subprocess.run([sys.executable, os.path.join(REPO, "tools", "generate.py"), "--load",
                        ckpt, "--greedy", "--max-new-tokens", "6", "--prompt-ids", "5,17,42,7"],
                       env=mpi_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert [int(i) for i in r.stdout.split()] == ids[4:], (r.stdout, ids)
