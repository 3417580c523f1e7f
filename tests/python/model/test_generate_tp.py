"""KV-cache decoding under tensor parallelism, as real MPI jobs: every rank of a tp 2 (and tp 4,
where llama-tiny's 2 kv heads are replicated over the ranks) model decodes a prefill and then
one token at a time, and gets the logits that the one-process model computes for the whole
sequence (f32, 1e-5)."""

import os
import shutil
import subprocess
import sys

import pytest

from mpi_job import mpi_env

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")

SCRIPT = r"""
import sys
import numpy as np
import braid

braid.init_distributed(timeout_minutes=1)
tp = int(sys.argv[1])
state = braid.ParallelState(tp=tp, pp=1)
for preset in ("gpt2-tiny", "llama-tiny"):
    cfg = braid.TransformerConfig.preset(preset)
    part = braid.ParallelModel(cfg, device="cpu", seed=5, state=state).chunk(0)
    whole = braid.GPTModel(cfg, device="cpu", seed=5)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 11)).astype(np.int32)
    full = np.from_dlpack(whole.logits(ids))
    cache = part.kv_cache(2)
    got = [np.from_dlpack(part.decode(ids[:, :4], cache))]
    for i in range(4, 11):
        got.append(np.from_dlpack(part.decode(ids[:, i:i + 1], cache)))
    err = float(np.abs(np.concatenate(got, axis=1) - full).max())
    assert err < 1e-5, (preset, tp, state.rank, err)
    print(f"rank {state.rank} {preset} tp {tp}: max error {err:.2e}", flush=True)
"""


@pytest.mark.parametrize("tp", [2, 4])
def test_decode_under_tensor_parallelism(tmp_path, tp):
    script = tmp_path / "decode_tp.py"
    script.write_text(SCRIPT)
    env = mpi_env()
    r = subprocess.run(["mpirun", "-np", str(tp), "--oversubscribe", sys.executable, str(script),
                        str(tp)], env=env, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(" max error ") == 2 * tp, r.stdout
