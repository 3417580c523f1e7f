"""ParallelModel.gather_into refuses a target of another config on every rank, before any value
is copied: it used to copy by the target's offsets with the source's row width, writing past the
target's buffer (heap corruption, or a silently half-filled embedding)."""

import os
import subprocess
import sys

import pytest

from mpi_job import mpi_env

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", ".."))

# Each rank writes one line per target to its own file (mpirun may interleave the ranks' stdout):
# "<rank> <case> ok" or "<rank> <case> ValueError <text>".
SCRIPT = r'''
import sys
import numpy as np
import braid
job = braid.init_distributed()
cfg = braid.TransformerConfig.preset("gpt2-tiny")
model = braid.ParallelModel(cfg, "cpu", 1, braid.ParallelState(tp=1, pp=int(sys.argv[1])),
                            braid.ParallelConfig())
cases = {"narrower": {"hidden_size": 32, "ffn_hidden_size": 128},
         "more-vocab": {"vocab_size": 300},
         "deeper": {"num_layers": cfg.num_layers + 1}, "same": {}}
out = open(f"{sys.argv[2]}/rank{job.rank}.txt", "w")
for name, changes in cases.items():
    c = braid.TransformerConfig.preset("gpt2-tiny")
    for key, value in changes.items():
        setattr(c, key, value)
    whole = braid.GPTModel(c, device="cpu", seed=5)
    try:
        model.gather_into(whole)
        ids = np.array([[1, 2, 3, 4]], dtype=np.int32)
        fresh = braid.GPTModel(cfg, device="cpu", seed=1)  # the parallel model's initial values
        same = np.array_equal(np.from_dlpack(whole.logits(ids)), np.from_dlpack(fresh.logits(ids)))
        print(job.rank, name, "ok" if same else "differs", file=out, flush=True)
    except ValueError as e:
        print(job.rank, name, "ValueError", e, file=out, flush=True)
'''


def outcomes(tmp_path, ranks, pp):
    path = tmp_path / "gather.py"
    path.write_text(SCRIPT)
    cmd = [sys.executable, str(path), str(pp), str(tmp_path)]
    if ranks > 1:
        cmd = ["mpirun", "-np", str(ranks), "--oversubscribe", *cmd]
    r = subprocess.run(cmd, env=dict(mpi_env(), PYTHONPATH=os.path.join(REPO, "python")),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [line.split(" ", 2) for rank in range(ranks)
             for line in (tmp_path / f"rank{rank}.txt").read_text().splitlines()]
    return {(int(rank), name): rest for rank, name, rest in lines}


def test_one_process(tmp_path):
    got = outcomes(tmp_path, 1, 1)
    assert got[0, "same"] == "ok"
    assert "model.embed_tokens.weight is [256, 64] in this model and [256, 32] in the target" \
        in got[0, "narrower"]
    assert "model.embed_tokens.weight is [256, 64] in this model and [300, 64] in the target" \
        in got[0, "more-vocab"]
    assert "model.layers.2.input_layernorm.weight is [64] in the target and absent from this " \
        "model" in got[0, "deeper"]


@pytest.mark.skipif(subprocess.run(["which", "mpirun"], capture_output=True).returncode != 0,
                    reason="needs mpirun")
def test_every_pipeline_stage_refuses_what_one_stage_sees(tmp_path):
    # Under pp 2 only the first stage holds the embedding: the second refuses too.
    got = outcomes(tmp_path, 2, 2)
    assert got[0, "same"] == got[1, "same"] == "ok"
    assert "[300, 64] in the target" in got[0, "more-vocab"]
    assert "another rank found a parameter that differs" in got[1, "more-vocab"]
    for rank in (0, 1):
        assert got[rank, "narrower"].startswith("ValueError ParallelModel::gather_into: the "
                                                "target is another model")
        assert "model.layers.2.input_layernorm.weight" in got[rank, "deeper"]
