"""braid.cpu_blas(): OpenBLAS, the CPU GEMM, is loaded with kernels for this CPU's features
(Debian 12's OpenBLAS falls back to its SSE3 kernels on CPUs newer than itself), a user's
OPENBLAS_CORETYPE wins, and braid leaves the environment as it found it."""

import json
import os
import subprocess
import sys

import numpy as np

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
PROBE = """
import json, os, numpy as np, braid
before = os.environ.get("OPENBLAS_CORETYPE")
model = braid.GPTModel(braid.TransformerConfig.preset("gpt2-tiny"), device="cpu", seed=1)
logits = np.from_dlpack(model.logits(np.arange(8, dtype=np.int32).reshape(1, 8)))
print(json.dumps({**braid.cpu_blas(), "before": before,
                  "after": os.environ.get("OPENBLAS_CORETYPE"),
                  "logits": logits[0, -1, :4].tolist()}))
"""


def probe(**env):
    clean = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    clean["PYTHONPATH"] = os.path.join(REPO, "python")
    r = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


def cpu_flags():
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def test_kernels_follow_the_cpu_features_and_the_environment_is_left_alone():
    got = probe()
    assert got["before"] is None and got["after"] is None, got
    flags = cpu_flags()
    if {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        assert got["kernels"] == "SkylakeX", got
        assert got["chosen_by"] == \
            "OPENBLAS_CORETYPE=SkylakeX, chosen by braid from the CPU's AVX-512", got
    elif {"avx2", "fma"} <= flags:
        assert got["kernels"] == "Haswell", got
    assert os.path.exists(got["library"]) or got["library"] == "libopenblas.so.0", got


def test_the_users_coretype_wins_and_computes_the_same_model():
    ours = probe()
    theirs = probe(OPENBLAS_CORETYPE="Prescott")
    assert theirs["kernels"] == "Prescott", theirs
    assert theirs["chosen_by"] == "OPENBLAS_CORETYPE=Prescott (yours)", theirs
    assert theirs["before"] == theirs["after"] == "Prescott", theirs
    # Other kernels, other rounding: the same logits to f32 precision.
    np.testing.assert_allclose(theirs["logits"], ours["logits"], rtol=1e-4, atol=1e-5)
